"""Restore == recompute on every backend and every CPU (docs/store.md, "Restore and recompute").

A snapshot of the first m rows of a prompt, made in one process, restored in another for the whole
prompt (m unaligned: the engine cuts it back to a multiple of the prefill chunk and recomputes the
rest in the chunks a cold run uses), against a cold prefill of the whole prompt in a third:
bitwise the same last logits and greedy text. numpy's OpenBLAS is forced to its other kernel
families in subprocesses, so one machine covers the x86 families (their sgemm rows depend on the
batch in different ways: docs/store.md); the simulator's case is in test_rknn_sim.py, the arm64
board's in test_board_emulated.py.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

HELPER = Path(__file__).parent / "helpers" / "engine_session.py"
N = 300
MODES = {"save": "save", "restore": "restored", "cold": "oneshot"}  # this test's words -> the helper's


def avx512() -> bool:
    try:
        return " avx512f " in f" {Path('/proc/cpuinfo').read_text()} ".replace("\n", " ")
    except OSError:
        return False


def session(model, mode, prompt_file, out=None, kv=None, m=0, backend="cpu", chunk=None, env=None, rknn_dir=None,
            runner="auto"):
    cmd = [sys.executable, str(HELPER), "--model", str(model), "--mode", MODES[mode], "--x", "whole",
           "--state", str(prompt_file), "--backend", backend, "--m", str(m), "--kv-dir", str(kv or prompt_file.parent),
           "--out", str(out or prompt_file.parent / "unused.npz")]
    cmd += ["--chunk", str(chunk)] if chunk else []
    cmd += ["--rknn-dir", str(rknn_dir), "--rknn-runner", runner] if rknn_dir else []
    full = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), **(env or {})}
    r = subprocess.run(cmd, env=full, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return dict(np.load(out)) if out else None


def prompt_file(model_dir, path: Path, n: int = N) -> Path:
    from edge_llm.tokenizer import Tokenizer

    text = " ".join(f"Line {i}: the crate labelled {i * 11 % 97} holds {i * 7 % 13} green pears." for i in range(80))
    ids = Tokenizer.from_dir(model_dir).encode(text)[:n]
    assert len(ids) == n
    path.write_text(json.dumps({"prompt": ids}))
    return path


def check_restores(model, tmp, ms, backend="cpu", chunk=None, env=None, n=N, **kw) -> list[dict]:
    """Cold once, then save m rows + restore the whole n-token prompt in new processes, for each m."""
    prompt = prompt_file(model, tmp / "prompt.json", n)
    n = len(json.loads(prompt.read_text())["prompt"])
    cold = session(model, "cold", prompt, tmp / "cold.npz", backend=backend, chunk=chunk, env=env, **kw)
    align = int(cold["chunk"])
    assert str(cold["source"]) == "none" and int(cold["prefill_tokens"]) == n
    rows = []
    for m in ms:
        assert m % align, f"m={m} is aligned: not the case under test"
        kv = tmp / f"kv{m}"
        session(model, "save", prompt, kv=kv, m=m, backend=backend, chunk=chunk, env=env, **kw)
        got = session(model, "restore", prompt, tmp / f"restore{m}.npz", kv=kv, backend=backend, chunk=chunk,
                      env=env, **kw)
        k = m // align * align
        assert str(got["source"]) == "disk" and int(got["disk"]) == k, (m, got["source"], got["disk"])
        assert int(got["align"]) == m - k and int(got["prefill_tokens"]) == n - k
        assert np.array_equal(got["logits"].view(np.uint32), cold["logits"].view(np.uint32)), \
            f"m={m}: max |dlogit| {np.abs(got['logits'] - cold['logits']).max():.3g}"
        assert got["tokens"].tolist() == cold["tokens"].tolist(), m
        rows.append({"m": m, "restored": k, "aligned": m - k})
    return rows


@pytest.fixture(scope="module")
def default_model(edge_home):
    return next(edge_home.glob("models/*/config.json")).parent


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from edge_llm.checkpoints.synth import synth_checkpoint

    d = tmp_path_factory.mktemp("tiny") / "model"
    synth_checkpoint(d, preset="tiny", seed=7)
    return d


# numpy's OpenBLAS kernel families this CPU can run: the default pick, Haswell (AVX2), SkylakeX
FAMILIES = [None, "Haswell"] + (["SkylakeX"] if avx512() else [])


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f or "default-kernels")
def test_cpu_restore_is_a_cold_run_on_every_kernel_family(default_model, tmp_path, family):
    env = {"OPENBLAS_CORETYPE": family} if family else None
    check_restores(default_model, tmp_path, (161, 250, 299), env=env)


def test_cpu_small_chunk_tiny_model(tiny, tmp_path):
    check_restores(tiny, tmp_path, (37, 161, 250), chunk=32)


def test_cpu_q_restore_is_a_cold_run(default_model, tmp_path, edge_home):
    check_restores(default_model, tmp_path, (161, 250, 299), backend="cpu-q", env={"EDGE_LLM_HOME": str(edge_home)})


def test_graph_backend_on_onnxruntime(default_model, tmp_path):
    """The rknn graph set run by onnxruntime (F32, static shapes 1/32/128: a short chunk is padded)."""
    from edge_llm.backends.graph.onnx_export import export_graph_set

    graphs = tmp_path / "graphs"
    export_graph_set(default_model, graphs)
    check_restores(default_model, tmp_path, (161, 299), backend="rknn", rknn_dir=graphs, runner="onnxruntime")
