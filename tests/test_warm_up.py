"""The server's warm-up before the ready line (edge_llm/server/state.py `warm_up`, docs/logs.md):
the start-up work a first request paid (the tokenizer's length bound, every kernel path's first
run) is done before the server says it is ready, on a scratch cache, without changing a bit of
what a client gets."""

from __future__ import annotations

import json
import logging
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import pytest

from edge_llm.runtime import load_runtime
from edge_llm.server.state import AppState
from edge_llm.settings import Settings

HELPER = Path(__file__).parent / "helpers" / "warm_up_bits.py"


def _settings(model, tmp_path, backend: str) -> Settings:
    return Settings(model=str(model), backend=backend, disk_kv=str(tmp_path / "kv"), max_seq=512)


def test_the_warm_up_runs_before_the_ready_line(tiny_synth_dir, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("EDGE_LLM_HOME", str(tmp_path / "home"))
    settings = _settings(tiny_synth_dir, tmp_path, "cpu")
    state = AppState(settings, loader=lambda: load_runtime(settings))
    with caplog.at_level(logging.INFO, logger="edge_llm.server.state"):
        state.start_loading()
        deadline = time.monotonic() + 120

        def logged_ready() -> bool:  # the line follows the status "ok" by a moment: wait for the line
            return any(r.getMessage().startswith("ready: url=") for r in caplog.records)

        while not logged_ready() and state.status in ("loading", "ok") and time.monotonic() < deadline:
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


X86_ONLY = pytest.mark.skipif(platform.machine() != "x86_64", reason="an x86 OpenBLAS kernel family")


@pytest.mark.parametrize("family", [None, pytest.param("Haswell", marks=X86_ONLY)], ids=lambda f: f or "default-kernels")
@pytest.mark.parametrize("backend", ["cpu", "cpu-q"])
def test_a_warm_up_changes_no_bit(edge_home, backend, family):
    """On the default model (real weights), under numpy's default BLAS kernels and under OpenBLAS's
    Haswell ones: a 300-token prompt's K/V rows, the logits and 8 greedy tokens after it are
    bitwise those of an engine that never warmed up (docs/quantization.md: the kernels hold no
    state across calls). Each run is a fresh process (the kernel family is picked at load)."""
    if backend == "cpu-q":
        pytest.importorskip("onnxruntime")
    model_dir = next(edge_home.glob("models/*/config.json")).parent
    env = {**os.environ, "EDGE_LLM_HOME": str(edge_home)} | ({"OPENBLAS_CORETYPE": family} if family else {})
    r = subprocess.run([sys.executable, str(HELPER), str(model_dir), backend], capture_output=True, text=True,
                       env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    if family:  # the variable was honoured: these runs really used the other kernels
        assert got["blas"] == family
    assert got["runs"]["warmed"] == got["runs"]["cold"]
