"""Engine behaviour on real (tiny random / embedded default) models: prefix reuse from RAM and
disk, stop strings, context limits, cancellation, and a corrupt snapshot during restore."""

import threading

import numpy as np
import pytest

from edge_llm.engine import GenerationRequest
from edge_llm.errors import ContextOverflowError
from edge_llm.kvcache import KVCache
from edge_llm.progress import NO_WORK
from edge_llm.runtime import load_runtime
from edge_llm.settings import Settings
from edge_llm.snapshot.layout import SNAPSHOT_GLOB


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from edge_llm.checkpoints.synth import synth_checkpoint

    d = tmp_path_factory.mktemp("tiny") / "model"
    synth_checkpoint(d, preset="tiny", seed=5)
    return d


def engine(model, kv=None, **kw):
    return load_runtime(Settings(model=str(model), backend="cpu", disk_kv=str(kv) if kv else None,
                                       max_seq=512, kv_bs=16, **kw))


def run(eng, ids, **kw):
    events = list(eng.generate(GenerationRequest(list(ids), **kw)))
    return "".join(e.text for e in events), events[-1]


PROMPT = list(range(1000, 1060))


def test_ram_reuse_recomputes_only_last_token(tiny):
    eng = engine(tiny)
    text1, last1 = run(eng, PROMPT, max_tokens=5)
    assert last1.timings.cache_source == "none" and last1.timings.prefill_tokens == len(PROMPT)
    text2, last2 = run(eng, PROMPT, max_tokens=5)
    assert last2.timings.cache_source == "ram"
    assert last2.usage.cached_tokens == len(PROMPT) - 1 and last2.timings.prefill_tokens == 1
    assert last2.completion_ids == last1.completion_ids and text2 == text1


def test_ram_reuse_is_cut_back_to_the_chunk_and_equals_a_cold_run(tiny):
    """A longer prompt reuses the RAM prefix only up to a multiple of the chunk: the rows after it
    are batched as in a cold run, so the logits are bitwise a fresh engine's (docs/store.md)."""
    eng = engine(tiny, prefill_chunk=16)
    run(eng, PROMPT, max_tokens=3)
    longer = PROMPT + list(range(2000, 2010))
    logits, t = eng.prefill_prompt(longer)
    assert t.cache_source == "ram" and t.ram_cached_tokens == 48 and t.align_rows == len(PROMPT) - 48
    assert t.prefill_tokens == len(longer) - 48
    cold, tc = engine(tiny, prefill_chunk=16).prefill_prompt(longer)
    assert tc.cache_source == "none" and np.array_equal(logits.view(np.uint32), cold.view(np.uint32))


def test_stop_string_truncates_output(tiny):
    eng = engine(tiny)
    full, _ = run(eng, PROMPT, max_tokens=24)
    assert len(full) > 6
    stop = full[len(full) // 2: len(full) // 2 + 3]
    cut = full.index(stop)
    text, last = run(eng, PROMPT, max_tokens=24, stop=[stop])
    assert text == full[:cut] and last.finish_reason == "stop"


def test_context_overflow_names_numbers(tiny):
    eng = engine(tiny)
    with pytest.raises(ContextOverflowError, match=r"500 tokens.*\+ max_tokens \(100\).*512"):
        run(eng, list(range(500)), max_tokens=100)


def test_cancel_stops_at_next_token_and_keeps_the_prompt_rows(tiny, tmp_path):
    eng = engine(tiny, tmp_path / "kv")
    cancel = threading.Event()
    gen = eng.generate(GenerationRequest(PROMPT, max_tokens=50), cancel=cancel)
    got = []
    for ev in gen:
        got.append(ev)
        cancel.set()
    assert got[-1].finish_reason == "cancelled" and got[-1].usage.completion_tokens <= 2
    eng.store.flush()
    (entry,) = eng.store.entries()  # the rows computed so far are saved for a retry
    assert entry.n_tokens >= len(PROMPT) and list(entry.tokens[:len(PROMPT)]) == PROMPT


def test_cancel_during_prefill_keeps_complete_chunks_and_a_retry_resumes(tiny, tmp_path):
    """A prefill cancelled after its third chunk keeps those rows, saves them, and a new engine
    (a restart) restores them and prefills only the rest: same text as an uninterrupted run."""
    prompt = [(i * 37) % 250 + 3 for i in range(200)]
    cold_text, cold = run(engine(tiny, prefill_chunk=32), prompt, max_tokens=8)
    eng = engine(tiny, tmp_path / "kv", prefill_chunk=32)
    cancel, seen = threading.Event(), []

    def progress(stage, done, total):
        seen.append((stage, done, total))
        if stage == "prefill" and done >= 96:
            cancel.set()

    events = list(eng.generate(GenerationRequest(prompt, max_tokens=8), cancel=cancel, progress=progress))
    last = events[-1]
    assert last.finish_reason == "cancelled" and last.usage.completion_tokens == 0
    assert [s for s in seen if s[0] == "prefill"] == [("prefill", 32, 199), ("prefill", 64, 199), ("prefill", 96, 199)]
    assert eng.cache.length == 96 and last.timings.prefill_tokens == 96
    eng.store.close()
    again = engine(tiny, tmp_path / "kv", prefill_chunk=32)
    text, res = run(again, prompt, max_tokens=8)
    assert res.timings.cache_source == "disk" and res.timings.disk_cached_tokens == 96
    assert res.timings.prefill_tokens == len(prompt) - 96
    assert text == cold_text and res.completion_ids == cold.completion_ids


def test_corrupt_snapshot_during_restore_falls_back_and_quarantines(tiny, tmp_path):
    kv = tmp_path / "kv"
    eng = engine(tiny, kv, prefill_chunk=16)  # a 60-token prompt restores 48 aligned rows
    cold_text, cold = run(eng, PROMPT, max_tokens=6)
    eng.store.close()
    (snap,) = list(kv.rglob(SNAPSHOT_GLOB))
    n = int(np.frombuffer(snap.read_bytes()[24:28], "<u4")[0])
    with open(snap, "r+b") as f:  # flip one bit in layer 0's first K block
        f.seek(64 + 4 * n + 100)
        b = f.read(1)
        f.seek(64 + 4 * n + 100)
        f.write(bytes([b[0] ^ 0x10]))
    eng2 = engine(tiny, kv, prefill_chunk=16)
    assert eng2.store.stats()["files"] == 1  # the scan reads no payload, so it cannot see the flip
    text, last = run(eng2, PROMPT, max_tokens=6)
    assert last.timings.cache_source == "none" and last.usage.cached_tokens == 0
    assert text == cold_text and last.completion_ids == cold.completion_ids
    assert list(snap.parent.glob("quarantine/*")), "the bad file is quarantined"
    eng2.store.flush()  # the recomputed rows were saved again, as a good file
    from edge_llm.snapshot.format import verify_file

    verify_file(snap)


def test_default_model_knows_paris(edge_home, monkeypatch):
    from edge_llm.sampling import SamplingParams

    monkeypatch.setenv("EDGE_LLM_HOME", str(edge_home))
    eng = engine("default")
    ids = eng.tokenizer.apply_chat_template_ids([{"role": "user", "content": "What is the capital of France?"}])
    text, last = run(eng, ids, max_tokens=24, sampling=SamplingParams())
    assert "Paris" in text, text


def test_model_writes_every_row_through_the_cache(tiny, tmp_path, monkeypatch):
    """One writer of KV rows: the model's writes go through KVCache.write (which waits for a
    pending save's lease), chunk by chunk, every layer."""
    eng = engine(tiny, tmp_path / "kv", prefill_chunk=8)
    calls = []
    real = KVCache.write
    monkeypatch.setattr(KVCache, "write", lambda self, layer, start, k, v, work=None:
                        calls.append((layer, start, k.shape[0])) or real(self, layer, start, k, v, work or NO_WORK))
    run(eng, PROMPT, max_tokens=1)
    n_layers, n = eng.model.args.num_hidden_layers, len(PROMPT)
    chunks = [(a, min(8, n - 1 - a)) for a in range(0, n - 1, 8)] + [(n - 1, 1)]
    assert calls == [(layer, a, t) for a, t in chunks for layer in range(n_layers)]
