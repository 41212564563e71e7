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

from edge_llm.backends.npu.backend import open_rknn
from edge_llm.backends.npu.graphs.sim import converter_python
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
    from edge_llm.backends.graph.manifest import Manifest

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
    from edge_llm.backends.graph.schema import sample_inputs

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


def test_a_verify_forward_runs_the_head_once_at_its_multi_row_shape(converted, monkeypatch):
    """Speculative decoding on the NPU (docs/speculative.md): a verify forward of T rows runs the
    32-row layer graphs and the head's 32-row shape once (`schema.head_rows`), not the one-row
    head T times; its rows are the one-row steps' up to the simulator's fp16 rounding, and the
    compiler's estimates price it below T one-row steps (the cost profile drafting reads)."""
    from edge_llm.backends.graph.schema import HEAD
    from edge_llm.models.qwen3 import Model

    model_dir, d, _ = converted["qwen3"]
    be = open_rknn(d, "sim", model_dir=model_dir)
    try:
        heads = [s for s in be.specs if s.kind == HEAD]
        assert heads and all(s.rows == (1, 32) for s in heads)
        calls: list[tuple[str, int]] = []
        run = be.runner.run
        monkeypatch.setattr(be.runner, "run", lambda spec, xs: calls.append((spec.kind, xs[0].shape[0])) or run(spec, xs))
        m = Model.load(model_dir, backend=be)
        cache = m.new_cache(max_seq=256)
        m.prefill(list(range(40, 80)), cache, chunk=32)
        S, toks = cache.length, [5, 77, 200, 42, 11]
        steps = [m.forward([t], cache).copy() for t in toks]
        cache.truncate(S)
        calls.clear()
        rows = m.forward(toks, cache, all_logits=True, decode=True)
        assert [c for c in calls if c[0] == HEAD] == [(HEAD, 32)] * len(heads)  # each head part once, 32 rows
        for r, p in zip(rows, steps):
            assert int(np.argmax(r)) == int(np.argmax(p))
            assert float(r @ p / (np.linalg.norm(r) * np.linalg.norm(p))) >= 0.9999
        assert 1.0 < be.forward_cost(5) < 5.0
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


def test_w8a8_restore_is_a_cold_run_in_the_simulator(tiny_synth_dir, tmp_path):
    """The same property under the simulator's w8a8 numerics, rotated graphs included: the
    simulator quantizes every int8 graph again from `calib/` each time it loads, so this holds
    only if that is deterministic, and the rotation (cpu_side.npz) must be applied identically
    by the saving and the restoring process."""
    from test_restore_recompute import check_restores

    d = tmp_path / "rknn-w8a8"
    r = subprocess.run([sys.executable, "-m", "edge_llm", "convert", "rknn", str(tiny_synth_dir), str(d), "--dtype",
                        "w8a8", "--w8a8-rotation", "hadamard", "--vision-grids", "none", "--calib-tokens", "512"],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((d / "manifest.json").read_text())["quant"]["rotation"] == "hadamard"
    rows = check_restores(tiny_synth_dir, tmp_path, (45, 100), backend="rknn", chunk=32, n=150, rknn_dir=d,
                          runner="sim")
    assert [r["restored"] for r in rows] == [32, 96]


# ---- the vision tower on the simulator (convert/vision.py, backends/tower/graph.py) -----------
def test_vision_tower_converts_within_fp16(converted, record_property):
    """The tiny Qwen3-VL's tower: one .rknn for the default grids (256 and 784 patches), every
    shape checked in the simulator against the numpy tower on an image of exactly that shape."""
    import hashlib

    from edge_llm.backends.graph.manifest import Manifest

    _, d, stdout = converted["qwen3_vl"]
    assert "vision tower at 784 patches: compiler estimate" in stdout
    m = Manifest.read(d / "vision")
    (g,) = m.graphs
    assert g.kind == "vision" and g.rows == [256, 784] and m.toolkit == "2.5.0"
    assert hashlib.sha256((d / "vision" / g.rknn).read_bytes()).hexdigest() == g.rknn_sha256
    assert sorted(t["rows"] for t in g.cost) == [256, 784] and all(t["cycles"] > 0 for t in g.cost)
    assert not any("Erf" in t["cpu_ops"] for t in g.cost)  # the mergers' GELU stays on the NPU
    for rows, per in g.accuracy.items():
        acc = per["features"]
        print(f"tower at {rows} patches: max rel {acc['max_rel']:.2e}, cosine {acc['cosine']:.7f}")
        record_property(f"tower_{rows}_max_rel", acc["max_rel"])
        assert acc["max_rel"] <= FP16_REL_LIMIT and acc["cosine"] >= 0.99999
    assert (d / "vision" / "report.md").is_file()
    # the decoder's manifest (and so its snapshot namespace) does not list the tower
    assert all(g.kind != "vision" for g in Manifest.read(d).graphs)


def _image_request(model_dir, seed: int = 11):
    """(prompt ids with one expanded image, PreparedImage) for a 320x256 image (80 rows after
    the grid rule: 20x16 patches, padded to the 256-patch shape)."""
    from edge_llm.convert.vision import sample_image
    from edge_llm.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(model_dir)

    def make(vision):
        img = vision.prepare(sample_image(320, 256, seed=seed))
        va = vision.args
        ids = tok.encode("Look:") + [va.vision_start_token_id, va.image_token_id, va.vision_end_token_id]
        tail = (" Describe the colours of it, the shapes you can see in it, and what the picture might show"
                " to a person who cannot see it.")  # long enough that the reuse cut (chunk 32) lands after the image
        return vision.expand(ids + tok.encode(tail), [img]), img
    return make


def test_image_on_simulator_agrees_with_cpu(converted, record_property):
    """Tower and decoder both on the simulator answer an image with the CPU backend's (numpy
    tower) first greedy token; every row's logits close."""
    from edge_llm.backends.tower.graph import open_rknn_tower
    from edge_llm.models.qwen3 import Model
    from edge_llm.vision.model import VisionModel

    model_dir, d, _ = converted["qwen3_vl"]
    sim, tower = open_rknn(d, "sim", model_dir=model_dir), open_rknn_tower(d, "sim", model_dir=model_dir)
    assert tower is not None and tower.numerics.startswith("rknn-tower:") and "rknn-sim" in tower.numerics
    try:
        out = {}
        for name, backend, graph in (("sim", sim, tower), ("cpu", "cpu", None)):
            model = Model.load(model_dir, backend=backend)
            vision = VisionModel.load(model_dir, model.args, graph=graph)
            ids, img = _image_request(model_dir)(vision)
            plan = vision.plan(ids, [img])
            vis, _, n = vision.visual_rows(plan, 0, plan.n)
            cache = model.new_cache(256, check_memory=False)
            out[name] = model.forward(plan.keys, cache, all_logits=True, positions=plan.positions, visual=vis)
    finally:
        sim.close()
        tower.close()
    a, b = out["sim"].astype(np.float64), out["cpu"].astype(np.float64)
    cos = float((a * b).sum() / np.linalg.norm(a) / np.linalg.norm(b))
    agree = float(np.mean(a.argmax(1) == b.argmax(1)))
    print(f"image prompt, simulator (tower + decoder) vs cpu: cosine {cos:.6f} over all rows' logits, "
          f"argmax agreement {agree:.3f}, next token {int(a[-1].argmax())} vs {int(b[-1].argmax())}")
    record_property("cosine", cos)
    assert cos >= 0.999 and a[-1].argmax() == b[-1].argmax()


def test_image_restore_is_bitwise_within_simulator_numerics(converted, tmp_path):
    """An image conversation saved by one runtime (tower + decoder on the simulator) and
    continued by a fresh one: the image rows come from disk (not encoded again) and the follow-up
    computes the same bits as the runtime that kept its RAM cache."""
    from edge_llm.engine import GenerationRequest
    from edge_llm.runtime import load_runtime
    from edge_llm.sampling import SamplingParams
    from edge_llm.settings import Settings

    model_dir, d, _ = converted["qwen3_vl"]
    settings = Settings(model=str(model_dir), disk_kv=str(tmp_path / "kv"), max_seq=512, kv_bs=16, backend="rknn",
                        rknn_dir=str(d), rknn_runner="sim", prefill_chunk=32)

    def ask(eng, ids, img):
        ev = list(eng.generate(GenerationRequest(ids, max_tokens=4, sampling=SamplingParams(temperature=0.0),
                                                 images=[img])))[-1]
        return ev.completion_ids, ev.timings

    warm = load_runtime(settings)
    assert warm.vision.encoder.graph is not None  # the simulator's tower, not numpy
    ids, img = _image_request(model_dir)(warm.vision)
    first, t1 = ask(warm, ids, img)
    assert t1.images_encoded == 1
    follow = ids + first + [100, 200, 300, 400, 500]
    warm_out, tw = ask(warm, follow, img)
    warm.store.close()
    assert tw.cache_source == "ram" and tw.images_encoded == 0
    n = warm.cache.length
    warm_rows = warm.cache.data[:, :, :n].copy()
    warm.model.backend.close()
    warm.vision.encoder.graph.close()

    fresh = load_runtime(settings)
    ids2, img2 = _image_request(model_dir)(fresh.vision)
    assert img2.digest == img.digest
    fresh_out, tf = ask(fresh, follow, img2)
    try:
        assert tf.cache_source == "disk" and tf.images_encoded == 0 and tf.disk_cached_tokens > len(ids) // 2
        assert fresh_out == warm_out and fresh.cache.length == n
        assert np.array_equal(fresh.cache.data[:, :, :n].view(np.uint32), warm_rows.view(np.uint32))
    finally:
        fresh.store.close()
        fresh.model.backend.close()
        fresh.vision.encoder.graph.close()


def test_bench_vision_reads_the_npu_estimates(converted, tiny_synth_dir):
    """`bench vision --rknn-dir`: each size maps through the grid rule onto a held shape and gets
    that shape's compiler estimate and simulator accuracy."""
    from edge_llm.bench.vision import markdown, npu_rows
    from edge_llm.config import ModelArgs
    from edge_llm.vision.model import VisionModel

    model_dir, d, _ = converted["qwen3_vl"]
    vision = VisionModel.load(model_dir, ModelArgs.from_dir(model_dir))
    rows = npu_rows(d, vision, (224, 448, 1280))
    assert [(r["patches"], r["shape"]) for r in rows] == [(256, 256), (784, 784), (784, 784)]
    assert all(r["predicted_ms"] > 0 and r["accuracy"]["max_rel"] <= FP16_REL_LIMIT for r in rows)
    md = markdown({"label": "tiny", "machine": "x", "blas": "x", "command": "x", "encoder": [], "npu": rows})
    assert "| 1280x1280 | 28x28 | 784 | 784 |" in md
