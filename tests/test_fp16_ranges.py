"""The fp16 range check (convert/calibration.py) and the fp16-safe RMSNorm (onnx_export.py), on
onnxruntime F32 with real exported graphs; no toolkit needed. The end-to-end proof on the real
default model in the simulator is tests/test_npu_accuracy.py."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from edge_llm.backends.cpu.backend import DenseLayer, rms_norm
from edge_llm.backends.graph.schema import QKV, GraphSpec, layer_name
from edge_llm.backends.graph.onnx_export import (
    export_one,
    build_qkv,
    f32_linear,
    rms_norm_fp16_op,
    rms_norm_op,
)
from edge_llm.convert.calibration import (
    FP16_MAX,
    RangeError,
    calibration_ids,
    capture,
    check_ranges,
    record_ranges,
    tensor_ranges,
    worst_tensor,
)

HIDDEN, QKV_W, EPS = 576, 96, 1e-5  # SmolLM2-135M's width: its residual reaches 22,545 in one channel


def _layer(rng) -> DenseLayer:
    z = np.zeros(1, np.float32)
    return DenseLayer(in_norm=(1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32), post_norm=z,
                      w_qkv=(rng.standard_normal((HIDDEN, QKV_W)) / 24).astype(np.float32), b_qkv=None,
                      w_o=z, w_gu=z, w_down=z)


def _rows(rng) -> np.ndarray:
    """Row 0 as a real attention-sink row (one channel at 22,545, the rest ordinary), then
    ordinary rows, a tiny one and a zero (padding) row."""
    x = rng.standard_normal((6, HIDDEN)).astype(np.float32)
    x[0, 17] = 22545.0
    x[1, 300] = -980.0
    x[4] *= 1e-4
    x[5] = 0
    return x


@pytest.fixture(scope="module")
def qkv_graphs(tmp_path_factory):
    rng = np.random.default_rng(0)
    L = _layer(rng)
    spec = GraphSpec(layer_name(0, QKV), QKV, 0, (), (("x", HIDDEN),), (("qkv", QKV_W),))
    out = {}
    for name, norm in (("plain", rms_norm_op), ("fp16", rms_norm_fp16_op)):
        d = tmp_path_factory.mktemp(name)
        out[name] = export_one(spec, d, lambda g, norm=norm: build_qkv(g, L, EPS, f32_linear, norm, 0))
    return L, spec, out


def test_plain_norm_overflows_fp16_on_a_massive_activation(qkv_graphs):
    L, spec, g = qkv_graphs
    x = _rows(np.random.default_rng(1))
    r = tensor_ranges(g["plain"].onnx, spec, [x])
    where, v = worst_tensor(r)
    assert v == pytest.approx((22545.0 / np.sqrt(HIDDEN)) ** 2, rel=1e-4) and v > FP16_MAX
    assert where.endswith("(ReduceSum)")  # the sum of the squares of x / sqrt(n)
    squares = max(val for _, op, val in r["intermediates"] if op == "Mul")
    assert squares > FP16_MAX  # ... and the square itself
    with pytest.raises(RangeError, match=r"layer00\.qkv: .*\(ReduceSum\) reaches 8\.8"):
        check_ranges({spec.name: r})


def test_fp16_safe_norm_keeps_every_tensor_in_range_and_the_value(qkv_graphs):
    import onnxruntime as ort

    L, spec, g = qkv_graphs
    x = _rows(np.random.default_rng(1))
    r = tensor_ranges(g["fp16"].onnx, spec, [x])
    where, v = worst_tensor(r)
    # nothing inside the graph is larger than its input (s = max|x| + sqrt(n eps) by a hair)
    assert v <= 22545.0 * (1 + 1e-4) and r["inputs"]["x"] == 22545.0
    inter: dict[str, float] = {}
    for _, op, val in r["intermediates"]:
        inter[op] = max(inter.get(op, 0.0), val)
    # sum((x/s)^2) < n; sqrt(mean(u^2) + (sqrt(eps)/s)^2) < sqrt(1 + 1/n)
    assert inter["ReduceSum"] <= HIDDEN and inter["Sqrt"] <= np.sqrt(1 + 1 / HIDDEN) + 1e-6
    check_ranges({spec.name: r})  # 22,545 is 2.9x below fp16's max: passes the 2x headroom
    with pytest.raises(RangeError):
        check_ranges({spec.name: r}, headroom=4.0)
    # the same value as the reference RMSNorm, zero row included (no NaN from max|x| = 0)
    ref = rms_norm(x, L.in_norm, np.float32(EPS)) @ L.w_qkv
    sess = ort.InferenceSession(str(g["fp16"].onnx), providers=["CPUExecutionProvider"])
    (y,) = sess.run(None, {"x": x})
    assert np.isfinite(y).all() and np.abs(y - ref).max() <= 1e-5 * np.abs(ref).max()


def test_fp16_safe_norm_in_numpy_fp16_matches_f32(qkv_graphs):
    """The two norm formulas evaluated op by op in numpy float16 (what an fp16 NPU stores between
    ops): the plain one gives inf on the sink row, the safe one stays within fp16 rounding."""
    L, _, _ = qkv_graphs
    x = _rows(np.random.default_rng(1)).astype(np.float16)
    w = L.in_norm.astype(np.float16)
    ref = rms_norm(x.astype(np.float32), L.in_norm, np.float32(EPS))
    with np.errstate(over="ignore", invalid="ignore"):
        xs = x * np.float16(1 / np.sqrt(HIDDEN))
        plain = x / np.sqrt((xs * xs).sum(-1, keepdims=True, dtype=np.float16) + np.float16(EPS)) * w
        assert not np.isfinite((xs * xs)[0]).all()  # the square itself overflows
    assert np.abs(plain[0].astype(np.float32) - ref[0]).max() > 0.5 * np.abs(ref[0]).max()  # wrong row
    h = np.float16
    s = np.abs(x).max(-1, keepdims=True) + h(np.sqrt(HIDDEN * EPS))
    u = x / s
    t = (h(1) - np.abs(u).max(-1, keepdims=True)) * h(1 / np.sqrt(HIDDEN))
    rms = np.sqrt((u * u).sum(-1, keepdims=True, dtype=h) * h(1 / HIDDEN) + t * t) * s
    safe = (x / rms * w).astype(np.float32)
    assert np.isfinite(safe).all()
    err = np.abs(safe - ref).max(axis=1) / np.abs(ref).max(axis=1).clip(1e-30)
    assert err[:5].max() < 4e-3 and np.abs(safe[5]).max() == 0  # fp16 rounding; zero row stays zero


@pytest.fixture(scope="module")
def default_capture(edge_home):
    model = next(edge_home.glob("models/*/config.json")).parent
    ids, source = calibration_ids(model)
    return model, capture(model, ids, source)


@pytest.mark.parametrize("norm", [rms_norm_op, rms_norm_fp16_op], ids=["plain", "fp16-safe"])
def test_range_check_on_the_real_default_model(default_capture, tmp_path, norm):
    """The real weights: the range check refuses the old norm's graphs (36 of 61 leave fp16's range,
    layer 12 on, where row 0's residual carries ~24,900) and passes the fp16-safe norm's."""
    from edge_llm.backends.graph.onnx_export import export_graph_set

    model, cap = default_capture
    assert "built-in calibration text as a chat user message" in cap.source and cap.tokens > 2000
    ranges = record_ranges(export_graph_set(model, tmp_path, norm=norm), tmp_path, cap)
    over = sorted(n for n, r in ranges.items() if worst_tensor(r)[1] > FP16_MAX)
    print(f"{norm.__name__}: {len(over)} of {len(ranges)} graphs over fp16's max: {over[:3]} ...")
    if norm is rms_norm_op:
        assert len(over) == 36 and "layer12.qkv" in over, over
        with pytest.raises(RangeError, match=r"layer12\.qkv: .*\(ReduceSum\) reaches 1\.09e\+06"):
            check_ranges(ranges)
    else:
        assert over == []
        check_ranges(ranges)
        assert 2e4 < ranges["layer12.qkv"]["inputs"]["x"] < FP16_MAX / 2


def test_convert_refuses_a_graph_that_overflows(tiny_model_dir, tmp_path):
    """A checkpoint whose MLP output passes fp16's range on the calibration text: `convert rknn`
    fails naming the graph before any toolkit build, publishes no OUT_DIR, and leaves its report
    (the range table) beside it as OUT_DIR.refused.md."""
    from safetensors.numpy import load_file, save_file

    src = tiny_model_dir("qwen3", tied=False)
    model = tmp_path / "hot"
    model.mkdir()
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            (model / f.name).write_bytes(f.read_bytes())
    for f in src.glob("*.safetensors"):
        t = load_file(f)
        t["model.layers.1.mlp.down_proj.weight"] = t["model.layers.1.mlp.down_proj.weight"] * np.float32(3e4)
        save_file(t, model / f.name, metadata={"format": "pt"})
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "edge_llm", "convert", "rknn", str(model), str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode != 0
    assert "leave fp16's range" in r.stderr and "layer01.post: output mlp_out reaches" in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    report = (tmp_path / "out.refused.md").read_text()
    assert "out.refused.md" in r.stderr  # the refusal says where its report is
    assert "**over**" in report and "no tokenizer" in report
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-out-")]
