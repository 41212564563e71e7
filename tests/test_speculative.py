"""Speculative decoding in the engine on the real default model (docs/speculative.md): the text
is plain decoding's (greedy, and seeded sampling; backends cpu and cpu-q), up to a near-tie
where a batched verify row rounds differently from a one-row step; stops inside a verified run;
rejected rows never reach a snapshot; a restart after a speculative turn restores bitwise (cpu
and cpu-q).

The backend's cost profile is replaced by "T rows cost one" so that every test drafts wherever
the lookup finds a match (the shipped profiles draft only once acceptance is high)."""

from __future__ import annotations

import numpy as np
import pytest

from edge_llm.backends.cost import ForwardCost
from edge_llm.drafting import DraftConfig
from edge_llm.engine import GenerationRequest
from edge_llm.runtime import load_runtime
from edge_llm.sampling import SamplingParams
from edge_llm.settings import Settings

DOC = ("The north warehouse holds 40 crates of copper wire, 12 pallets of ceramic tiles, and 7 drums of "
       "machine oil. The south warehouse holds 25 crates of steel bolts, 9 pallets of glass panes, and 3 "
       "drums of paint. ")
RECALL = (f"<|im_start|>user\n{DOC}\nWhat does the north warehouse hold? Quote the sentence.<|im_end|>\n"
          "<|im_start|>assistant\n")
CHAT = "<|im_start|>user\nWrite a short poem about the sea.<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def default_model(edge_home):
    return next(edge_home.glob("models/*/config.json")).parent


def engine(model_dir, kv=None, backend="cpu"):
    eng = load_runtime(Settings(model=str(model_dir), backend=backend, disk_kv=str(kv) if kv else None,
                                max_seq=1024, kv_bs=16))
    eng.model.backend.forward_cost = ForwardCost(1.0, 0.0)  # see the module docstring
    return eng


def run(eng, ids, mode="ngram", **kw):
    eng.draft = DraftConfig(mode)
    events = list(eng.generate(GenerationRequest(list(ids), **kw)))
    return "".join(e.text for e in events), events[-1]


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def plain_logits(eng, prompt, plain, i, images=()):
    """The logits plain decoding sampled token i from: the prompt, then one-row steps."""
    eng.cache.reset()
    logits, _ = eng.prefill_prompt(prompt, images=images)
    for tok in plain[:i]:
        pos = np.repeat(np.array([[eng.cache.next_pos]]), 3, axis=0) if eng.cache.spans else None
        logits = eng.model.forward([tok], eng.cache, positions=pos, decode=True)
    return logits


def assert_same_or_near_tie(eng, prompt, plain, spec, sampling: SamplingParams, images=()):
    """Equal ids, or the first difference is a near-tie of plain decoding's own choice there."""
    i = first_difference(plain, spec)
    if i is None:
        return
    logits = plain_logits(eng, prompt, plain, i, images)
    if sampling.greedy:
        top2 = np.sort(logits)[-2:]
        assert top2[1] - top2[0] < 1e-3, f"greedy token {i} differs ({plain[i]} vs {spec[i]}) without a tie"
        return
    # the uniform the sampler draws for token i, against the CDF at the boundary it fell near
    u = np.random.default_rng(sampling.seed).random(i + 1)[-1]
    x = logits.astype(np.float64) / sampling.temperature
    p = np.exp(x - x.max())
    cdf = np.cumsum(p / p.sum())
    assert np.min(np.abs(cdf - u)) < 1e-4, f"sampled token {i} differs ({plain[i]} vs {spec[i]}) away from a tie"


@pytest.mark.parametrize("backend", ["cpu", "cpu-q"])
def test_greedy_drafting_is_plain_greedy_in_fewer_forwards(default_model, backend):
    eng = engine(default_model, backend=backend)
    ids = eng.tokenizer.encode(RECALL)
    text_off, off = run(eng, ids, "off", max_tokens=40)
    eng.cache.reset()
    text_on, on = run(eng, ids, max_tokens=40)
    assert off.timings.decode_forwards == len(off.completion_ids) - 1 and off.timings.drafted_tokens == 0
    t = on.timings
    assert t.drafted_tokens > 0 and t.accepted_tokens > 0, t  # the answer quotes the prompt
    assert t.decode_forwards + t.accepted_tokens == len(on.completion_ids) - 1
    assert t.decode_forwards < off.timings.decode_forwards
    assert_same_or_near_tie(eng, ids, off.completion_ids, on.completion_ids, SamplingParams())
    assert "40 crates of copper wire" in text_on
    if backend == "cpu-q":  # a verify row is bitwise a plain step's on every CPU: the same text, exactly
        from edge_llm.backends import kernels

        assert on.completion_ids == off.completion_ids
        lib, native = kernels.library(), kernels.qmatmul_isa()
        try:  # and MatMulQ's AVX2 path (when this CPU has it) gives the very same answer
            if lib.edge_qmatmul_force(b"avx2") == 0:
                eng.cache.reset()
                assert run(eng, ids, max_tokens=40)[1].completion_ids == on.completion_ids
        finally:
            lib.edge_qmatmul_force(native.encode())


def test_seeded_sampling_with_drafting_samples_plain_tokens(default_model):
    eng = engine(default_model)
    ids = eng.tokenizer.encode(CHAT)
    sp = SamplingParams(temperature=0.8, seed=3)
    _, off = run(eng, ids, "off", max_tokens=60, sampling=sp)
    eng.cache.reset()
    _, on = run(eng, ids, max_tokens=60, sampling=sp)
    assert on.timings.drafted_tokens > 0
    assert_same_or_near_tie(eng, ids, off.completion_ids, on.completion_ids, sp)


@pytest.mark.parametrize("backend", ["cpu", "cpu-q"])
def test_drafting_after_an_image_keeps_its_positions(tiny_synth_dir, backend):
    """After an image the rows' MRoPE positions are not their row numbers: a verify forward
    continues them (tiny random Qwen3-VL: its greedy text repeats itself, so it drafts; on
    cpu-q the verify forward is one decode-graph call with each row's cos/sin)."""
    import io

    from PIL import Image

    eng = engine(tiny_synth_dir, backend=backend)
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 96, 3), dtype=np.uint8)).save(buf, "PNG")
    img = eng.vision.prepare(buf.getvalue())
    va = eng.vision.args
    ids = [1000, 2000, va.vision_start_token_id, *[va.image_token_id] * img.n_tokens, va.vision_end_token_id, 3000]
    _, off = run(eng, ids, "off", max_tokens=40, images=[img])
    eng.cache.reset()
    _, on = run(eng, ids, max_tokens=40, images=[img])
    assert on.timings.accepted_tokens > 0 and on.timings.images == 1
    rows_on, n = eng.cache.data[:, :, :eng.cache.length].copy(), eng.cache.length
    assert n == len(ids) + len(on.completion_ids) - 1
    # the K rows carry the rotation of their positions: the decode rows equal a prefill's of the
    # same tokens (which takes positions from the prompt plan) up to batched rounding (cpu-q: the
    # decode graph's 4-bit kernels against the per-layer graphs', ~5e-3 here); rows at row-number
    # positions would differ in the leading digits
    eng.cache.reset()
    eng.prefill_prompt(ids + on.completion_ids[:-1], images=[img])
    rtol, atol = (1e-3, 1e-4) if backend == "cpu" else (0.0, 0.05)
    np.testing.assert_allclose(rows_on, eng.cache.data[:, :, :n], rtol=rtol, atol=atol)
    assert_same_or_near_tie(eng, ids, off.completion_ids, on.completion_ids, SamplingParams(), [img])


def test_a_stop_inside_a_verified_run_ends_the_cache_where_plain_decoding_does(default_model):
    eng = engine(default_model)
    ids = eng.tokenizer.encode(RECALL)
    full, _ = run(eng, ids, "off", max_tokens=40)
    stop = "ceramic"  # inside the quoted sentence: verified tokens follow it in the same run
    assert stop in full
    eng.cache.reset()
    text, last = run(eng, ids, max_tokens=40, stop=[stop])
    assert last.finish_reason == "stop" and text == full[:full.index(stop)]
    assert last.timings.accepted_tokens > 0
    # rows of the prompt and of every emitted token but the last: what plain decoding leaves
    assert eng.cache.length == len(ids) + len(last.completion_ids) - 1
    assert eng.cache.tokens == ids + last.completion_ids[:-1]


@pytest.mark.parametrize("backend", ["cpu", "cpu-q"])
def test_rejected_rows_are_never_saved_and_a_restart_restores_bitwise(default_model, tmp_path, backend):
    kv = tmp_path / "kv"
    eng = engine(default_model, kv, backend)
    # a prompt longer than a prefill chunk: a reused prefix is cut back to a multiple of 128
    ids = eng.tokenizer.encode(f"<|im_start|>user\n{DOC * 3}\nWrite a short poem about these warehouses."
                               "<|im_end|>\n<|im_start|>assistant\n")
    _, last = run(eng, ids, max_tokens=90)
    t = last.timings
    assert t.drafted_tokens > t.accepted_tokens  # some drafts were rejected: their rows were written
    eng.store.flush()
    saved = max(eng.store.entries(), key=lambda e: e.n_tokens)
    assert saved.tokens.tolist() == ids + last.completion_ids[:-1]  # no row of a rejected draft
    follow = ids + last.completion_ids + eng.tokenizer.encode("<|im_end|>\n<|im_start|>user\nAgain.<|im_end|>\n")
    warm_logits, warm_t = eng.prefill_prompt(follow)
    # the reused prefix holds rows that verify forwards wrote, not only the prompt's
    assert warm_t.cache_source == "ram" and warm_t.ram_cached_tokens > len(ids), (len(ids), warm_t)
    warm_rows = eng.cache.data[:, :, :len(follow)].copy()
    eng.close()

    eng2 = engine(default_model, kv, backend)  # a restart: the rows come back from the snapshot
    logits, t2 = eng2.prefill_prompt(follow)
    assert t2.cache_source == "disk" and t2.disk_cached_tokens == warm_t.ram_cached_tokens
    assert np.array_equal(logits.view(np.uint32), warm_logits.view(np.uint32))
    assert np.array_equal(eng2.cache.data[:, :, :len(follow)].view(np.uint32), warm_rows.view(np.uint32))
    eng2.close()
