"""The w8a8 graphs (docs/npu.md, "w8a8") without the toolkit: the norms-on-the-CPU partition
with smoothing folded into the weights must compute the model exactly (in real arithmetic), so
the exported graphs run in F32 by onnxruntime agree with the CPU backend on the real default
model. What int8 does to them is measured by tests/test_npu_accuracy.py in the simulator.

A wrong smoothing direction, a scale applied twice or forgotten on the CPU side, a missed
out_scale or final gain all break the agreement below (each was checked by breaking it)."""

from __future__ import annotations

import numpy as np
import pytest

from edge_llm.backends.graph.cpu_side import CpuSide
from edge_llm.backends.graph.schema import HEAD_N, MLP, QKV_N, O, graph_specs
from edge_llm.backends.graph.manifest import Manifest
from edge_llm.bench import accuracy
from edge_llm.config import ModelArgs
from edge_llm.convert import calibration as C
from edge_llm.convert.w8a8 import export_w8a8, hadamard, orthogonal, smoothing
from edge_llm.errors import ConfigError


def test_smoothing_is_exact_and_neutral_on_dead_channels():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((16, 8)) * np.array([1, 1, 1, 50, 1, 1, 1, 0.0])  # an outlier, a dead channel
    w = rng.standard_normal((8, 5))
    s = smoothing(a, w).astype(np.float64)
    assert s[7] == 1.0 and s[3] > 3 * np.median(s)  # the outlier channel is scaled down most
    np.testing.assert_allclose((a / s) @ (s[:, None] * w), a @ w, rtol=1e-12, atol=1e-12)
    # after smoothing, the activation's largest channel is far closer to its median channel
    sm = np.abs(a / s).max(axis=0)[:7]
    assert sm.max() / np.median(sm) < np.abs(a).max(axis=0)[:7].max() / np.median(np.abs(a).max(axis=0)[:7])


def test_partition_names_every_layer_and_head():
    args = ModelArgs(model_type="qwen3", vocab_size=100, hidden_size=8, intermediate_size=16, num_hidden_layers=2,
                     num_attention_heads=2, num_key_value_heads=1, head_dim=4, rms_norm_eps=1e-6, rope_theta=1e4)
    kinds = [s.kind for s in graph_specs(args, cpu_norm=True, head_split=2)]
    assert kinds == [QKV_N, O, MLP, QKV_N, O, MLP, HEAD_N, HEAD_N]


@pytest.fixture(scope="module", params=["none", "hadamard"])
def exported(edge_home, tmp_path_factory, request):
    model_dir = next(edge_home.glob("models/*/config.json")).parent
    out = tmp_path_factory.mktemp("w8a8-onnx")
    ids, source = C.calibration_ids(model_dir, None, 128)
    ex = export_w8a8(model_dir, out, (1, 32, 128), None, 1, C.capture(model_dir, ids, source),
                     rotation=request.param)
    ex.manifest.dtype = "w8a8"
    ex.manifest.quant = {"algorithm": "normal", "method": "channel", "max_samples": 4, "rotation": request.param,
                         "cpu_side_sha256": ex.side.save(out)}
    ex.manifest.calibration = {"source": source}
    ex.manifest.write(out)
    return model_dir, out, ex


def test_exported_graphs_in_f32_are_the_model(exported, record_property):
    model_dir, out, _ = exported
    res = accuracy.run(str(model_dir), "rknn", str(out), "onnxruntime", teacher_tokens=64, greedy_tokens=16)
    print(accuracy.markdown(res))
    record_property("min_cosine", res["min_cosine"])
    assert res["min_cosine"] >= 0.99999 and all(p["argmax_equal"] for p in res["prompts"])
    assert res["teacher"]["top1"] == 1.0 and res["teacher"]["kl"] < 1e-5
    assert res["answer"]["same_tokens"] and res["greedy"] == {**res["greedy"], "tokens": 16, "same_prefix": 16}


def test_cpu_side_is_part_of_the_identity_and_required(exported):
    _, out, ex = exported
    m = Manifest.read(out)
    before = m.identity()
    m.quant["cpu_side_sha256"] = "0" * 64
    assert m.identity() != before
    (out / "cpu_side.npz").rename(out / "gone.npz")
    try:
        with pytest.raises(ConfigError, match="cpu_side.npz"):
            CpuSide.load(out, m.layers)
    finally:
        (out / "gone.npz").rename(out / "cpu_side.npz")
    widest = max(float(s.max()) for s in ex.side.out_scale)
    if ex.side.rotation is None:  # the massive-activation writer's output channels got a scale
        assert widest > 100
    else:  # rotated, its one massive channel is spread over all 576 (the rotation's point)
        assert widest < 10 and m.quant["rotation"] == "hadamard"



def test_changed_cpu_side_is_refused(exported, tmp_path):
    """docs/npu.md "Verification at load": a cpu_side.npz whose bytes are not the manifest's
    `cpu_side_sha256` (one byte changed) is refused when the directory is opened."""
    import shutil

    from edge_llm.backends.npu.backend import open_rknn

    model_dir, out, _ = exported
    d = tmp_path / "w8a8"
    shutil.copytree(out, d)
    side = d / "cpu_side.npz"
    data = bytearray(side.read_bytes())
    data[len(data) // 2] ^= 1
    side.write_bytes(bytes(data))
    claimed = Manifest.read(d).quant["cpu_side_sha256"]
    with pytest.raises(ConfigError, match=rf"{side}: sha256 [0-9a-f]{{16}}\.\.\. is not the manifest.json's "
                                          rf"cpu_side_sha256 {claimed[:16]}"):
        open_rknn(d, "onnxruntime", model_dir=model_dir)

def test_hadamard_is_orthogonal_at_model_widths():
    """The rotation is exact up to float32 (576 = 8 x Paley 72, 2048 = Sylvester, 960 = 16 x 60)
    and spreads one massive channel evenly: what takes the attention-sink row out of the int8
    scales."""
    for n in (576, 960, 2048, 100):  # 100: no Hadamard construction here, a random orthogonal matrix
        r = orthogonal(n).astype(np.float64)
        assert np.abs(r @ r.T - np.eye(n)).max() < 1e-5, n
        if hadamard(n) is not None:
            assert np.allclose(np.abs(r), 1 / np.sqrt(n), rtol=1e-6), n  # e_c R: all entries equal in size
    assert hadamard(100) is None and hadamard(576) is not None


def test_rotated_graphs_take_image_rows_in_their_basis(tiny_model_dir, tmp_path):
    """Image embeddings and DeepStack features enter the residual stream outside `embed`: rotated
    w8a8 graphs (F32, onnxruntime) must see them rotated too (`Backend.residual`), or the image
    rows' logits are of another input. Tiny random Qwen3-VL: the shape of the path, not accuracy."""
    from edge_llm.backends.npu.backend import open_rknn
    from edge_llm.models.qwen3 import Model, VisualRows

    model_dir = tiny_model_dir("qwen3_vl")
    ids, source = C.calibration_ids(model_dir, None, 64)
    ex = export_w8a8(model_dir, tmp_path, (1, 32), None, 1, C.capture(model_dir, ids, source), rotation="hadamard")
    ex.manifest.dtype = "w8a8"
    ex.manifest.quant = {"rotation": "hadamard", "cpu_side_sha256": ex.side.save(tmp_path)}
    ex.manifest.calibration = {"source": source}
    ex.manifest.write(tmp_path)
    args = ModelArgs.from_dir(model_dir)
    rng = np.random.default_rng(3)
    rows = np.array([2, 3, 4, 5])
    vis = VisualRows(rows, rng.standard_normal((4, args.hidden_size)).astype(np.float32),
                     [rng.standard_normal((4, args.hidden_size)).astype(np.float32) for _ in range(2)])
    out = {}
    for name, backend in (("graphs", open_rknn(tmp_path, "onnxruntime", model_dir=model_dir)), ("cpu", "cpu")):
        model = Model.load(model_dir, backend=backend)
        try:
            out[name] = model.forward(np.arange(10), model.new_cache(16, check_memory=False), all_logits=True,
                                      visual=vis)
        finally:
            model.close()
    assert np.abs(out["graphs"] - out["cpu"]).max() < 1e-3 * np.abs(out["cpu"]).max()


def test_convert_names_the_graph_kinds_it_can_build_fp16(tiny_model_dir, tmp_path):
    """`--w8a8-fp16` takes only the partition's kinds; anything else is refused before any work,
    with the kinds named, and nothing is written."""
    from click.testing import CliRunner

    from edge_llm.cli import cli

    out = tmp_path / "out"
    r = CliRunner().invoke(cli, ["convert", "rknn", str(tiny_model_dir("qwen3")), str(out), "--dtype", "w8a8",
                                 "--w8a8-fp16", "mlp,post"])
    assert r.exit_code == 1 and "graph kinds are qkv_n, o, mlp, head_n" in r.output, r.output
    assert not out.exists()
