"""GPTQ for cpu-q's re-quantized 4-bit blocks (backends/gptq.py, cpuq/nbits.py `quantize_gptq`,
convert/gptq.py `CpuqInputs`; docs/quantization.md, "GPTQ for re-quantized weights"): on the
default model's real activations it lowers a layer's output error against round to nearest, its
blocks are a valid MatMulNBits / MatMulQ layout, and cpu-q's build uses it where a weight has no
exact GGUF blocks (and only there)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from edge_llm.backends.cpuq import nbits as Q


@pytest.fixture(scope="module")
def default_rows(default_model_dir: Path):
    """The default model's F32 weights of layers 3 and 28, the calibration rows of cpu-q's build
    (`CpuqInputs`, norm gains applied) and, held out, the rows they read on the accuracy text."""
    from edge_llm.backends.cpu.backend import load_layer
    from edge_llm.config import ModelArgs
    from edge_llm.convert.gptq import CpuqInputs, capture
    from edge_llm.quality_text import QUALITY_TEXT
    from edge_llm.tokenizer import Tokenizer
    from edge_llm.weights import load_weights

    args = ModelArgs.from_dir(default_model_dir)
    weights = load_weights(default_model_dir, args)
    cal = CpuqInputs(default_model_dir)
    held = capture(default_model_dir, Tokenizer.from_dir(default_model_dir).encode(QUALITY_TEXT)[:160])
    out = {"args": args, "cal": Fixed()}
    for layer in (3, 28):
        L = load_layer(args, weights, layer)
        out[("qkv", layer)] = L.w_qkv, held[(layer, "qkv")] * L.in_norm[None, :]
        out[("o", layer)] = L.w_o, held[(layer, "o")]
        out[("down", layer)] = L.w_down, held[(layer, "down")]
        for kind in ("qkv", "o", "down"):  # CpuqInputs hands each weight's rows out once
            out["cal"].rows[(kind, layer)] = cal.hessian(kind, layer)
    return out


class Fixed:
    """`nbits.Calibration` over rows `CpuqInputs` handed out, for several tests to ask again."""

    tokens = 0

    def __init__(self) -> None:
        self.rows: dict[tuple[str, int], np.ndarray] = {}

    def hessian(self, kind: str, layer: int) -> np.ndarray:
        return self.rows[(kind, layer)]


def _err(x: np.ndarray, w: np.ndarray, qw: Q.QuantWeight) -> float:
    x64 = x.astype(np.float64)
    return float(np.square(x64 @ Q.dequantize(qw).astype(np.float64) - x64 @ w.astype(np.float64)).mean())


@pytest.mark.parametrize("kind", ["qkv", "o"])
@pytest.mark.parametrize("layer", [3, 28])
def test_gptq_lowers_the_output_error(default_rows, kind, layer, record_property):
    """X @ W with GPTQ's 4-bit blocks is closer to F32 than round to nearest on rows of another
    text than the calibration's, and the MSE clip lowers it further. The default model's F32
    weights are Q4_1 blocks dequantized: re-quantizing them onto a new grid is a stress case."""
    w, x = default_rows[(kind, layer)]
    h = default_rows["cal"].hessian(kind, layer)
    rtn, gptq = _err(x, w, Q.quantize(w, 4, 32)), _err(x, w, Q.quantize_gptq(w, h, 4, 32))
    mse = _err(x, w, Q.quantize_gptq(w, h, 4, 32, clip=True))
    record_property("output_mse", {"rtn": rtn, "gptq": gptq, "gptq-mse": mse})
    print(kind, layer, "output error / round to nearest's: gptq", gptq / rtn, "gptq + mse clip", mse / rtn)
    assert gptq < rtn and mse < 0.85 * rtn and mse < gptq, (rtn, gptq, mse)


def test_mse_clip_lowers_the_weight_error():
    """Round to nearest with each block's range by the MSE clip: no block's squared error above
    min/max's (ratio 1 is a candidate), and less overall on heavy-tailed weights."""
    rng = np.random.default_rng(3)
    w = rng.standard_t(3, (256, 64)).astype(np.float32)
    e = [np.square(Q.dequantize(Q.quantize(w, 4, 32, clip=c)) - w).reshape(8, 32, 64).sum(axis=1)
         for c in (False, True)]
    assert np.all(e[1] <= e[0] * (1 + 1e-6)) and e[1].sum() < 0.97 * e[0].sum()


def test_gptq_blocks_are_a_valid_layout(default_rows, tmp_path):
    """GPTQ's blocks as MatMulNBits (float activations, as q4's prompt rows) and as MatMulQ (two
    passes, as q4's decode graph) in onnxruntime give the product of the dequantized weights."""
    import onnxruntime as ort

    from edge_llm.backends import kernels
    from edge_llm.backends.cpuq.nbits_export import write_nbits, write_qmatmul
    from edge_llm.backends.graph.onnx_export import GraphBuilder

    if kernels.library() is None:
        pytest.skip("the operator library was not built at install (no C compiler)")
    w, x = default_rows[("down", 3)]
    qw = Q.center(Q.quantize_gptq(w, default_rows["cal"].hessian("down", 3), 4, 32, clip=True))
    assert qw.q.max() <= 15 and qw.zp.max() <= 15 and not qw.default_zp
    g = GraphBuilder("q4", tmp_path / "q4.onnx.data")
    write_nbits(g, "x", qw, 0, "y_nbits")
    write_qmatmul(g, "x", qw, "y_q4", passes=2)
    g.write([("x", ["T", qw.K])], [("y_nbits", ["T", qw.N]), ("y_q4", ["T", qw.N])], tmp_path / "q4.onnx", opset=21)
    opts = ort.SessionOptions()
    kernels.register(opts)
    sess = ort.InferenceSession(str(tmp_path / "q4.onnx"), opts, providers=["CPUExecutionProvider"])
    want = x.astype(np.float64) @ Q.dequantize(qw).astype(np.float64)
    scale = np.abs(want).max()
    for y in sess.run(None, {"x": x}):
        assert np.abs(y - want).max() / scale < 1e-4


def test_build_uses_gptq_only_for_requantized_weights(tiny_synth_dir, home):
    """cpu-q's build with calibration rows: every weight of a checkpoint without GGUF blocks is
    GPTQ + MSE clip (the manifest says so, and layer 0's q/k/v blocks in the graph are exactly
    `quantize_gptq`'s on those rows); a directory built without calibration (round to nearest) is
    rebuilt, and the graphs run."""
    import onnx
    from onnx import numpy_helper

    from edge_llm.backends.cpu.backend import load_layer
    from edge_llm.backends.cpuq import backend as cpuq
    from edge_llm.config import ModelArgs
    from edge_llm.convert.gptq import CpuqInputs
    from edge_llm.models.qwen3 import Model
    from edge_llm.qrecord import greedy
    from edge_llm.weights import load_weights

    _, rtn = cpuq.ensure_quantized(tiny_synth_dir, cpuq.mode("q4"), blocks=None)
    assert rtn.build["summary"]["requant"] == ["rtn"]
    root, m = cpuq.ensure_quantized(tiny_synth_dir, cpuq.mode("q4"), blocks=None,
                                    calibration=CpuqInputs(tiny_synth_dir, tokens=64))
    assert m.build["summary"]["requant"] == ["gptq-mse"] and m.build["calibration_tokens"] == 64
    assert m.identity() != rtn.identity()
    assert m.build["summary"]["rounded"] == {"gptq-mse": m.build["summary"]["requantized"]}
    args = ModelArgs.from_dir(tiny_synth_dir)
    L = load_layer(args, load_weights(tiny_synth_dir, args), 0)
    want = Q.center(Q.quantize_gptq(L.w_qkv, CpuqInputs(tiny_synth_dir, tokens=64).hessian("qkv", 0), 4, 32,
                                    clip=True))
    graph = onnx.load(str(root / "onnx" / "layer00.qkv.onnx"))
    inits = {i.name: numpy_helper.to_array(i) for i in graph.graph.initializer}
    node = next(n for n in graph.graph.node if n.op_type == "MatMulNBits")
    b, scales, zp = want.packed()
    assert np.array_equal(inits[node.input[1]], b) and np.array_equal(inits[node.input[2]], scales)
    assert np.array_equal(inits[node.input[3]], zp)
    be = cpuq.open_cpu_q(tiny_synth_dir, "q4", threads=2, blocks=None, calibration=CpuqInputs(tiny_synth_dir, 64))
    try:
        assert len(greedy(Model.load(tiny_synth_dir, backend=be), [1, 2, 3, 4], 3)) == 3
    finally:
        be.close()


def test_gate_and_up_alone_are_the_halves_of_gate_up(tiny_synth_dir):
    """Layers after DeepStack rows run gate and up as two linears in the per-layer graphs and one
    in the decode graph: both hold the same GPTQ blocks, whichever is built first (the
    calibration hands each layer's rows out once)."""
    from edge_llm.backends.cpu.backend import load_layer
    from edge_llm.backends.cpuq.nbits_export import QuantLinear
    from edge_llm.backends.graph.onnx_export import WeightKey
    from edge_llm.config import ModelArgs
    from edge_llm.convert.gptq import CpuqInputs
    from edge_llm.weights import load_weights

    args = ModelArgs.from_dir(tiny_synth_dir)
    L = load_layer(args, load_weights(tiny_synth_dir, args), 0)
    inter = L.w_down.shape[0]
    lin = QuantLinear(args, None, 4, 32, 0, requant="gptq-mse", calibration=CpuqInputs(tiny_synth_dir, 64))
    gate = lin.weight(L.w_gu[:, :inter], WeightKey("gate", 0))
    up = lin.weight(L.w_gu[:, inter:], WeightKey("up", 0))
    both = lin.weight(L.w_gu, WeightKey("gate_up", 0))
    assert [r["rounded"] for r in lin.report] == ["gptq-mse"] * 3
    assert np.array_equal(both.q, np.concatenate([gate.q, up.q])) and np.array_equal(both.scales[inter:], up.scales)
    lin = QuantLinear(args, None, 4, 32, 0, requant="gptq-mse", calibration=CpuqInputs(tiny_synth_dir, 64))
    both2 = lin.weight(L.w_gu, WeightKey("gate_up", 0))
    assert np.array_equal(lin.weight(L.w_gu[:, inter:], WeightKey("up", 0)).q, both2.q[inter:])


def test_a_refused_calibration_rounds_to_nearest_without_the_f32_model(tiny_synth_dir, tmp_path, monkeypatch, caplog):
    """Where the calibration's F32 model cannot fit (runtime._calibration_refusal says why), the
    capture never runs: one warning with the reason, every re-quantized weight rounded to nearest,
    and the graphs run."""
    from edge_llm.backends.cpuq import backend as cpuq
    from edge_llm.convert import gptq as G

    monkeypatch.setenv("EDGE_LLM_HOME", str(tmp_path))
    monkeypatch.setattr(G, "capture", lambda *a, **k: pytest.fail("the capture ran after a refusal"))
    cal = G.CpuqInputs(tiny_synth_dir, tokens=64, refusal=lambda: "it would hold 8 GiB, but only 4 GiB")
    with caplog.at_level("WARNING"):
        _, m = cpuq.ensure_quantized(tiny_synth_dir, cpuq.mode("q4"), blocks=None, calibration=cal)
    assert [r.message for r in caplog.records if "GPTQ calibration skipped" in r.message] == [
        "GPTQ calibration skipped: it would hold 8 GiB, but only 4 GiB; the weights without exact GGUF blocks are "
        "rounded to nearest (docs/quantization.md, \"GPTQ for re-quantized weights\")"]
    assert m.build["summary"]["rounded"] == {"rtn": m.build["summary"]["requantized"]}
    assert "calibration_tokens" not in m.build  # no rows were captured


@pytest.mark.skipif(os.geteuid() != 0 or not os.access("/sys/fs/cgroup/memory", os.W_OK),
                    reason="needs root and a writable cgroup v1 memory controller")
def test_the_calibration_is_refused_where_its_f32_model_cannot_fit(default_model_dir, tmp_path):
    """In a real cgroup v1 of 700 MiB, the default model's calibration (F32 weights 0.50 GiB + its
    rows 0.19 GiB + runtime) does not fit: the refusal names the estimate, the memory available and
    the way out; outside any limit the calibration runs."""
    from test_footprint import memory_cgroup

    code = ("import sys; from pathlib import Path; from edge_llm.runtime import _calibration_refusal; "
            "from edge_llm.settings import Settings; print(_calibration_refusal(Settings(), Path(sys.argv[1]))())")
    with memory_cgroup(700 << 20) as cg:
        r = subprocess.run(["sh", "-c", f'echo $$ > {cg}/cgroup.procs && exec "$@"', "sh", sys.executable, "-c", code,
                            str(default_model_dir)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert re.search(r"it would hold backend cpu-q calibration, max_seq 512: F32 weights 0\.50 GiB \+ captured rows "
                     r"0\.19 GiB \+ runtime 0\.16 GiB = 0\.85 GiB, but only 0\.\d\d GiB available \(cgroup", r.stdout), r.stdout
    assert "edge-llm model info MODEL --quant q4" in r.stdout
    r = subprocess.run([sys.executable, "-c", code, str(default_model_dir)], capture_output=True, text=True, timeout=300)
    assert r.stdout.strip() == "None", r.stdout
