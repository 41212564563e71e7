"""The server's warm-up before the ready line (edge_llm/server/state.py `warm_up`, docs/logs.md):
the start-up work a first request paid (the tokenizer's length bound, every kernel path's first
run) is done before the server says it is ready, on a scratch cache, without changing a bit of
what a client gets."""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import numpy as np
import pytest

from edge_llm.runtime import load_runtime
from edge_llm.server.state import AppState, warm_up
from edge_llm.settings import Settings

PROMPT = list(range(100, 400))  # 300 tokens: two full chunks, a short one and the last token alone


def _settings(model, tmp_path, backend: str) -> Settings:
    return Settings(model=str(model), backend=backend, disk_kv=str(tmp_path / "kv"), max_seq=512)


def test_the_warm_up_runs_before_the_ready_line(tiny_synth_dir, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("EDGE_LLM_HOME", str(tmp_path / "home"))
    settings = _settings(tiny_synth_dir, tmp_path, "cpu")
    state = AppState(settings, loader=lambda: load_runtime(settings))
    with caplog.at_level(logging.INFO, logger="edge_llm.server.state"):
        state.start_loading()
        deadline = time.monotonic() + 120
        while not state.ready and state.status in ("loading", "ok") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert state.ready, state.error
    try:
        lines = [r.getMessage() for r in caplog.records]
        warm = next(i for i, m in enumerate(lines) if m.startswith("warm-up: a "))
        ready = next(i for i, m in enumerate(lines) if m.startswith("ready: url="))
        assert warm < ready, lines
        engine = state.engine
        assert "bytes_per_token" in vars(engine.tokenizer)  # the length bound is built: no request pays it
        assert engine.cache.length == 0 and not engine.cache.tokens  # the clients' cache was not used
    finally:
        state.close(grace=0)


@pytest.mark.parametrize("backend", ["cpu", "cpu-q"])
def test_a_warm_up_changes_no_bit(tiny_synth_dir, tmp_path, monkeypatch, backend):
    """The prompt's rows, its logits and a greedy continuation are bitwise those of an engine that
    never warmed up (docs/quantization.md: the kernels hold no state across calls)."""
    if backend == "cpu-q":
        pytest.importorskip("onnxruntime")
    monkeypatch.setenv("EDGE_LLM_HOME", str(tmp_path / "home"))
    settings = replace(_settings(tiny_synth_dir, tmp_path, backend), disk_kv=None)
    out = {}
    for warmed in (False, True):
        engine = load_runtime(settings)
        try:
            if warmed:
                assert warm_up(engine) > 1
            logits, _ = engine.prefill_prompt(PROMPT)
            layers = engine.model.args.num_hidden_layers
            rows = [engine.cache.rows(i, kv, 0, len(PROMPT)).copy() for i in range(layers) for kv in (0, 1)]
            tokens = []
            for _ in range(8):
                tokens.append(int(np.argmax(logits)))
                logits = engine.model.forward(tokens[-1:], engine.cache, decode=True)
            out[warmed] = (logits.copy(), rows, tokens)
        finally:
            engine.close()
    (l0, r0, t0), (l1, r1, t1) = out[False], out[True]
    assert t0 == t1
    assert np.array_equal(l0.view(np.uint32), l1.view(np.uint32))
    assert all(np.array_equal(a.view(np.uint32), b.view(np.uint32)) for a, b in zip(r0, r1))
