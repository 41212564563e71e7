"""The rknn path on this machine: `edge-llm convert rknn` with the real rknn-toolkit2 2.5.0 (in the
converter venv the Makefile builds with tools/setup-converter.sh), its simulator (fp16) driving
the engine, and bit-exact restore within the simulator's numerics. The NPU itself is not here:
tests/test_rknnlite_runner.py covers the board runner against a fake."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from modelutil import greedy_run

from edge_llm.backends.rknn import open_rknn
from edge_llm.backends.runners import converter_python
from edge_llm.convert.report import FP16_REL_LIMIT, worst
from edge_llm.errors import ConfigError

HELPER = Path(__file__).parent / "helpers" / "engine_session.py"

try:
    CONVERTER = converter_python()
except ConfigError as e:  # `make test` builds it; a bare pytest run may not have it
    pytestmark = pytest.mark.skip(reason=f"converter venv missing ({e}); run tools/setup-converter.sh")


@pytest.fixture(scope="module")
def converted(tmp_path_factory, tiny_model_dir, tiny_synth_dir):
    """Both tiny models converted once through the real CLI (ONNX export + toolkit build)."""
    out = {}
    for name, model in (("qwen3", tiny_model_dir("qwen3", tied=False)), ("qwen3_vl", tiny_synth_dir)):
        d = tmp_path_factory.mktemp(f"rknn-{name}")
        r = subprocess.run([sys.executable, "-m", "edge_llm", "convert", "rknn", str(model), str(d),
                            "--head-split", "2" if name == "qwen3" else "1"],
                           capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, r.stderr[-3000:]
        out[name] = (model, d, r.stdout)
    return out


@pytest.mark.parametrize("name", ["qwen3", "qwen3_vl"])
def test_convert_writes_rknn_manifest_and_report(converted, name, record_property):
    model, d, stdout = converted[name]
    m = json.loads((d / "manifest.json").read_text())
    assert m["toolkit"] == "2.5.0" and m["target"] == "rk3588" and m["chunks"] == [1, 32, 128]
    assert "report.md" in stdout and (d / "report.md").is_file()
    import hashlib

    for g in m["graphs"]:
        data = (d / g["rknn"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == g["rknn_sha256"] and len(data) == g["rknn_bytes"]
        assert g["rknn"].startswith(f"rknn/{g['name']}-{g['build_key'][:16]}")
        shapes = sorted(t["rows"] for t in g["cost"])
        assert shapes == sorted(g["rows"]) and all(t["cycles"] > 0 for t in g["cost"])
    from edge_llm.backends.manifest import Manifest

    man = Manifest.read(d)
    errs = {g.name: worst(g) for g in man.graphs}
    for g, w in errs.items():
        print(f"{name} {g}: max rel {w['max_rel']:.2e}, mean rel {w['mean_rel']:.2e}, cosine {w['cosine']:.7f}")
        record_property(f"{g}_max_rel", w["max_rel"])
        assert w["max_rel"] <= FP16_REL_LIMIT and w["cosine"] >= 0.99999
    # the three shapes share one weight copy: the 3-shape layer file is far below 3x one shape
    qkv = next(g for g in man.graphs if g.kind == "qkv")
    weights_fp16 = (d / qkv.onnx.replace(".onnx", ".onnx.data")).stat().st_size / 2
    assert qkv.rknn_bytes < 2 * weights_fp16 + 512 * 1024  # + the fp16-safe norm's command buffers per shape


def test_reconvert_reuses_builds(converted):
    model, d, _ = converted["qwen3"]
    before = json.loads((d / "manifest.json").read_text())
    r = subprocess.run([sys.executable, "-m", "edge_llm", "convert", "rknn", str(model), str(d), "--head-split", "2"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    after = json.loads((d / "manifest.json").read_text())
    assert after["identity"] == before["identity"]
    assert after["build"]["built"] == 0 and after["build"]["reused"] == len(after["graphs"])


@pytest.mark.parametrize("name", ["qwen3", "qwen3_vl"])
def test_engine_on_simulator_agrees_with_cpu(converted, name, record_property):
    from edge_llm.models.qwen3 import Model

    model_dir, d, _ = converted[name]
    sim = open_rknn(d, "sim", model_dir=model_dir)
    assert sim.numerics.startswith("rknn:") and "rknn-sim-2.5.0-fp16" in sim.numerics
    try:
        npu, cpu = Model.load(model_dir, backend=sim), Model.load(model_dir)
        prompt = (np.arange(24) * 13 + 5) % min(cpu.args.vocab_size, 3000)
        runs = [greedy_run(m, prompt, 8, 64) for m in (npu, cpu)]
        toks, rows = [t for t, _ in runs], [r for _, r in runs]
    finally:
        sim.close()
    # teacher-free greedy: once a token differs the two continue different texts, so count the prefix
    agree = next((i for i, (a, b) in enumerate(zip(*toks)) if a != b), len(toks[0]))
    a, b = rows[0][:1].ravel(), rows[1][:1].ravel()
    cos = float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))
    print(f"{name}: simulator vs CPU greedy prefix agreement {agree}/8, first-logits cosine {cos:.6f}; "
          f"sim {toks[0]} cpu {toks[1]}")
    record_property("agreement", agree)
    record_property("cosine", cos)
    assert toks[0][0] == toks[1][0] and cos >= 0.999


def test_simulator_padding_rows_do_not_change_real_rows(converted):
    from edge_llm.backends.onnx_export import sample_inputs

    model_dir, d, _ = converted["qwen3"]
    be = open_rknn(d, "sim", model_dir=model_dir)
    try:
        rng = np.random.default_rng(0)
        for spec in be.specs[:2]:
            real = sample_inputs(spec, 3)
            pad = [np.concatenate([x, np.zeros((29, x.shape[1]), np.float32)]) for x in real]
            noisy = [np.concatenate([x, 50 * rng.standard_normal((29, x.shape[1]), dtype=np.float32)]) for x in real]
            for a, b in zip(be.runner.run(spec, pad), be.runner.run(spec, noisy)):
                assert np.array_equal(a[:3], b[:3])
            again = be.runner.run(spec, pad)  # deterministic for identical input of identical shape
            assert all(np.array_equal(x, y) for x, y in zip(again, be.runner.run(spec, pad)))
    finally:
        be.close()


def _session(model, kv, mode, tmp, state, backend="rknn", rknn_dir=None):
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    out = tmp / f"{mode}-{backend}.npz"
    cmd = [sys.executable, str(HELPER), "--model", str(model), "--kv-dir", str(kv), "--mode", mode, "--x", "ext",
           "--state", str(state), "--out", str(out), "--backend", backend, "--steps", "4"]
    if rknn_dir:
        cmd += ["--rknn-dir", str(rknn_dir), "--rknn-runner", "sim"]
    subprocess.run(cmd, check=True, env=env, timeout=900)
    return dict(np.load(out))


def test_restore_is_bitwise_within_simulator_numerics(converted, tmp_path):
    """Save under the simulator in one process, restore in another: the same bits as the RAM
    continuation. A cpu process does not restore the simulator's snapshot (another namespace)."""
    from edge_llm.tokenizer import Tokenizer

    model, d, _ = converted["qwen3_vl"]
    kv, state = tmp_path / "kv", tmp_path / "state.json"
    text = " ".join(f"Item {i} costs {i * 3} coins." for i in range(60))
    # over one prefill chunk (128): the reused prefix is cut back to a chunk multiple (docs/store.md)
    state.write_text(json.dumps({"prompt": Tokenizer.from_dir(model).encode(text)[:200]}))
    warm = _session(model, kv, "warm", tmp_path, state, rknn_dir=d)
    restored = _session(model, kv, "restored", tmp_path, state, rknn_dir=d)
    assert str(warm["source"]) == "ram" and str(restored["source"]) == "disk"
    assert int(restored["cached"]) == int(warm["cached"]) >= 16
    for key in ("k", "v", "logits", "last_logits"):
        assert np.array_equal(restored[key].view(np.uint32), warm[key].view(np.uint32)), key
    assert restored["tokens"].tolist() == warm["tokens"].tolist()
    cpu = _session(model, kv, "restored", tmp_path, state, backend="cpu")
    assert str(cpu["source"]) == "none"
    assert len(list(kv.iterdir())) == 2  # two namespaces side by side


def test_restore_is_a_cold_run_in_the_simulator(converted, tmp_path):
    """tests/test_restore_recompute.py's property under the simulator's fp16 numerics: a snapshot
    of m unaligned rows restored in a new process + the tail is bitwise a cold prefill."""
    from test_restore_recompute import check_restores

    model, d, _ = converted["qwen3_vl"]
    rows = check_restores(model, tmp_path, (45, 100), backend="rknn", chunk=32, n=150, rknn_dir=d, runner="sim")
    assert [r["restored"] for r in rows] == [32, 96]
