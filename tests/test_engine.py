"""Engine behaviour on real (tiny random / embedded default) models: prefix reuse from RAM and
disk, stop strings, context limits, cancellation, and a corrupt snapshot during restore."""

import threading

import numpy as np
import pytest

from edge_llm.engine import GenerationRequest
from edge_llm.errors import ContextOverflowError
from edge_llm.runtime import load_runtime
from edge_llm.settings import Settings


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from edge_llm.models.synth import synth_checkpoint

    d = tmp_path_factory.mktemp("tiny") / "model"
    synth_checkpoint(d, preset="tiny", seed=5)
    return d


def engine(model, kv=None, **kw):
    return load_runtime(Settings(model=str(model), disk_kv=str(kv) if kv else None,
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


def test_cancel_stops_at_next_token_and_skips_save(tiny, tmp_path):
    eng = engine(tiny, tmp_path / "kv")
    cancel = threading.Event()
    gen = eng.generate(GenerationRequest(PROMPT, max_tokens=50), cancel=cancel)
    got = []
    for ev in gen:
        got.append(ev)
        cancel.set()
    assert got[-1].finish_reason == "cancelled" and got[-1].usage.completion_tokens <= 2
    eng.store.flush()
    assert not list((tmp_path / "kv").rglob("kv_*.kv"))


def test_corrupt_snapshot_during_restore_falls_back_and_quarantines(tiny, tmp_path):
    kv = tmp_path / "kv"
    eng = engine(tiny, kv)
    cold_text, cold = run(eng, PROMPT, max_tokens=6)
    eng.store.close()
    (snap,) = list(kv.rglob("kv_*.kv"))
    n = int(np.frombuffer(snap.read_bytes()[24:28], "<u4")[0])
    with open(snap, "r+b") as f:  # flip one bit in layer 0's first K block
        f.seek(64 + 4 * n + 100)
        b = f.read(1)
        f.seek(64 + 4 * n + 100)
        f.write(bytes([b[0] ^ 0x10]))
    eng2 = engine(tiny, kv)
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


def test_model_asks_the_write_guard_before_overwriting_rows(tiny, tmp_path):
    eng = engine(tiny, tmp_path / "kv")
    assert eng.cache.write_guard == eng.store.wait_write  # installed by the engine
    calls = []
    eng.cache.write_guard = lambda layer, start: calls.append((layer, start)) or 0.0
    run(eng, PROMPT, max_tokens=1)
    n_layers = eng.model.args.num_hidden_layers
    # chunked body from row 0, then the last prompt token alone at row len-1: every layer, each time
    assert calls == [(layer, 0) for layer in range(n_layers)] + [(layer, len(PROMPT) - 1) for layer in range(n_layers)]
