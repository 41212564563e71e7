"""Graphs for `convert rknn --dtype w8a8`: the norms on the CPU, smoothing folded into the weights.

Why not the fp16 graphs quantized (docs/npu.md, "w8a8"): rknn-toolkit2 quantizes every tensor
between two ops to int8 with one static scale, and the fp16 graphs take the residual stream as
input. On the default model that gave a cosine of 0.05 for layer 12's mlp output on real
activations (massive activation in row 0 sets the scale, every other row rounds to zero). The
toolkit's hybrid mode would keep the norm in fp16, but its step 2 drops `dynamic_input` (one
static shape per file: three weight copies on the board). So:

1. the partition `graph_specs(cpu_norm=True)`: `qkv_n`, `o`, `mlp`, `head_n`, pure matmul graphs
   whose inputs are normalized rows or attention outputs (`backends/graph/cpu_side.py` computes the
   rest in float32);
2. per-channel smoothing (SmoothQuant, alpha = 0.5) of every matmul input, from the calibration
   activations: s = max|a|^alpha / max|w|^(1 - alpha) per input channel; the input is divided by
   s (folded into the norm gain, or one multiply of attn on the CPU; for down_proj, folded into
   up_proj's output columns since SwiGLU is linear in up) and the weight rows multiplied by it;
3. qkv's and mlp's output channels divided by their range over the median range (`qkv_scale`,
   `out_scale`, multiplied back on the CPU): q, k and v share one output tensor, and a layer that
   writes a massive activation no longer sets the mlp output's scale alone;
4. by default (`rotation="hadamard"`; "none" turns it off) the residual stream in a rotated
   basis x R, R a randomized Hadamard matrix (QuaRot): RMSNorm(x R) R^T = RMSNorm(x), so R^T
   and the norm gain fold into the weights that read a normalized row and R into the weights
   that write the stream; a massive channel is spread over all channels before any int8 scale
   sees it. down_proj's input (SwiGLU's output) is not rotated: the toolkit fuses SiLU * up into
   one conv whose output is int8 before any rotation could act (measured, docs/npu.md "w8a8").
What stays badly quantized is measured per graph by the converter and built fp16 instead
(`convert/rknn.py`, `--w8a8-min-cosine`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edge_llm.backends.cpu.backend import load_layer, rms_norm
from edge_llm.backends.graph.cpu_side import CpuSide
from edge_llm.backends.graph.schema import HEAD, HEAD_N, MLP, POST, QKV, QKV_N, O, GraphSpec, graph_specs, layer_name
from edge_llm.backends.graph.manifest import CALIB_DIR, Manifest
from edge_llm.backends.graph.onnx_export import GraphBuilder, export_one, _head_tensors, f32_linear, manifest_for
from edge_llm.config import ModelArgs
from edge_llm.convert.calibration import Capture
from edge_llm.convert.hadamard import ROTATION_SEED, ROTATIONS, hadamard, orthogonal  # noqa: F401 (re-exported)
from edge_llm.weights import load_weights

log = logging.getLogger(__name__)

ALPHA = 0.5


def smoothing(a: np.ndarray, w: np.ndarray, alpha: float = ALPHA) -> np.ndarray:
    """Per input channel of `w` (in, out): max|a|^alpha / max|w|^(1-alpha); 1 where a or w is 0."""
    am, wm = np.abs(a).max(axis=0).astype(np.float64), np.abs(w).max(axis=1).astype(np.float64)
    s = np.ones_like(am)
    ok = (am > 0) & (wm > 0)
    s[ok] = am[ok] ** alpha / wm[ok] ** (1 - alpha)
    return np.clip(s, 1e-4, 1e4).astype(np.float32)


def channel_scale(y: np.ndarray) -> np.ndarray:
    """Per output channel: its range over the median channel's, at least 1 (multiplied back on
    the CPU): the channels above the median no longer set the output tensor's one int8 scale."""
    rng = np.abs(y).max(axis=0)
    return np.maximum(rng / max(float(np.median(rng)), 1e-30), 1.0).astype(np.float32)


def _silu_mul(gu: np.ndarray, inter: int) -> np.ndarray:
    g = gu[:, :inter]
    return g / (np.float32(1) + np.exp(-g)) * gu[:, inter:]


@dataclass
class W8A8Export:
    manifest: Manifest
    inputs: dict[str, list[np.ndarray]]  # graph name -> its inputs on all calibration rows
    side: CpuSide


def export_w8a8(model_dir: str | Path, root: Path, chunks: tuple[int, ...], layers: int | None, head_split: int,
                cap: Capture, alpha: float = ALPHA, rotation: str = "hadamard",
                progress: Callable[[GraphSpec], None] | None = None) -> W8A8Export:
    """Export the cpu-norm graph set under `root/onnx` with `.samples.npz` (inputs and the F32
    reference outputs on the first max(shape) calibration rows); return the manifest (not yet
    written), every graph's inputs on all calibration rows (ranges, quantization dataset) and the
    CPU side (not yet saved). `rotation="hadamard"`: the residual stream in a rotated basis
    (`orthogonal`), folded into the weights as described in the module docstring."""
    args = ModelArgs.from_dir(model_dir)
    weights = load_weights(model_dir, args)
    eps = np.float32(args.rms_norm_eps)
    specs = {s.name: s for s in graph_specs(args, chunks, layers, head_split, cpu_norm=True)}
    out = root / "onnx"
    out.mkdir(parents=True, exist_ok=True)
    inputs: dict[str, list[np.ndarray]] = {}
    done = []
    side = CpuSide([], [], [], [], [], np.ones(0, np.float32))

    def emit(spec: GraphSpec, build: Callable[[GraphBuilder], None], xs: list[np.ndarray],
             ref: Callable[..., np.ndarray]) -> None:
        if progress:
            progress(spec)
        done.append(export_one(spec, out, build))
        inputs[spec.name] = xs
        r = max(spec.rows) if spec.rows else None
        head = [np.ascontiguousarray(x[:r]) for x in xs]
        arrays = {f"in.{n}": x for (n, _), x in zip(spec.inputs, head)}
        arrays[f"out.{spec.outputs[0][0]}"] = np.ascontiguousarray(ref(*head), dtype=np.float32)
        np.savez(out / f"{spec.name}.samples.npz", **arrays)

    n = layers or args.num_hidden_layers
    R = None if rotation == "none" else orthogonal(args.hidden_size)
    side.rotation = R

    def res(a: np.ndarray) -> np.ndarray:  # residual rows -> the graphs' residual basis
        return a if R is None else (a @ R).astype(np.float32)

    def fold(w: np.ndarray, gain: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """A matmul after an RMSNorm: (the gain the CPU keeps, the weight). Rotated, the gain
        goes into the weight with R^T (RMSNorm(x R) R^T = RMSNorm(x) for orthogonal R)."""
        if R is None:
            return gain, w
        return np.ones_like(gain), (R.T @ (gain[:, None] * w)).astype(np.float32)

    for i in range(n):
        L = load_layer(args, weights, i)
        (x,) = cap.inputs[layer_name(i, QKV)]
        attn, xp = cap.inputs[layer_name(i, POST)]
        x, xp = res(x), res(xp)
        g1, w_qkv = fold(L.w_qkv, L.in_norm)
        s1 = smoothing(rms_norm(x, g1, eps), w_qkv, alpha)
        in_gain = (g1 / s1).astype(np.float32)
        xn = rms_norm(x, in_gain, eps)
        w_qkv = s1[:, None] * w_qkv
        qkv_scale = channel_scale(xn @ w_qkv + (0 if L.b_qkv is None else L.b_qkv))
        w_qkv = w_qkv / qkv_scale[None, :]
        b_qkv = None if L.b_qkv is None else (L.b_qkv / qkv_scale).astype(np.float32)
        spec = specs[layer_name(i, QKV_N)]
        emit(spec, lambda g: f32_linear(g, "xn", w_qkv, b_qkv, "qkv"), [xn],
             lambda v: v @ w_qkv + (0 if b_qkv is None else b_qkv))

        w_o = res(L.w_o)  # o_proj writes the residual stream: its output columns rotate
        s2 = smoothing(attn, w_o, alpha)
        h = xp + attn @ w_o
        w_o = s2[:, None] * w_o
        emit(specs[layer_name(i, O)], lambda g: f32_linear(g, "attn", w_o, None, "attn_out"),
             [(attn / s2).astype(np.float32)], lambda a: a @ w_o)

        inter = L.w_down.shape[0]
        g2, w_gu = fold(L.w_gu, L.post_norm)
        s3 = smoothing(rms_norm(h, g2, eps), w_gu, alpha)
        post_gain = (g2 / s3).astype(np.float32)
        hn = rms_norm(h, post_gain, eps)
        w_gu = s3[:, None] * w_gu
        act = _silu_mul(hn @ w_gu, inter)
        w_down = res(L.w_down)
        s4 = smoothing(act, w_down, alpha)
        out_scale = channel_scale(act @ w_down)
        w_gate, w_up = w_gu[:, :inter], w_gu[:, inter:] / s4[None, :]
        w_down = s4[:, None] * w_down / out_scale[None, :]

        def build_mlp(g: GraphBuilder) -> None:
            gate = f32_linear(g, "hn", w_gate)
            up = f32_linear(g, "hn", w_up)
            a = g.op("Mul", [g.op("Mul", [gate, g.op("Sigmoid", [gate])]), up])
            f32_linear(g, a, w_down, None, "mlp_out")

        emit(specs[layer_name(i, MLP)], build_mlp, [hn],
             lambda v: _silu_mul(v @ np.concatenate([w_gate, w_up], axis=1), inter) @ w_down)
        side.in_gain.append(in_gain)
        side.qkv_scale.append(qkv_scale)
        side.attn_scale.append((1 / s2).astype(np.float32))
        side.post_gain.append(post_gain)
        side.out_scale.append(out_scale)
    final_norm, lm = _head_tensors(args, weights)
    xh = res(cap.inputs[HEAD][0])
    g5, w_head = fold(lm.T, final_norm)
    del lm
    s5 = smoothing(rms_norm(xh, g5, eps), w_head, alpha)
    side.final_gain = (g5 / s5).astype(np.float32)
    xn = rms_norm(xh, side.final_gain, eps)
    for spec in (s for s in specs.values() if s.kind == HEAD_N):
        lo, hi = spec.vocab
        w = s5[:, None] * w_head[:, lo:hi]
        # no per-column output scale here (measured worse: docs/npu.md "w8a8"): a logit column's
        # range on the calibration text does not bound it on other text, and clipping the
        # winning logit costs more than the coarser common step
        emit(spec, lambda g, w=w: f32_linear(g, "xn", w, None, "logits"), [xn], lambda v, w=w: v @ w)
    m = manifest_for(model_dir, root, done, layers, head_split)
    return W8A8Export(m, inputs, side)


def write_datasets(root: Path, m: Manifest, inputs: dict[str, list[np.ndarray]]) -> None:
    """Every graph's calibration inputs (all rows), the toolkit worker cuts them into samples of
    the graph's largest shape (rknn quantizes with the largest `dynamic_input` shape)."""
    (root / CALIB_DIR).mkdir(exist_ok=True)
    for g in m.graphs:
        np.savez(root / CALIB_DIR / f"{g.name}.npz", **{n: x for (n, _), x in zip(g.spec().inputs, inputs[g.name])})

