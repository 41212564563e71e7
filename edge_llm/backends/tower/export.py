"""Export the Qwen3-VL vision tower to one ONNX graph, or to segments of it (schema:
`schema.vision_spec`).

The same arithmetic as the numpy tower (`vision/encoder.py` + `cpu/tower.py`), written with
plain ONNX ops that onnxruntime and rknn-toolkit2 both run: patch embedding as one MatMul, per
block LayerNorm + qkv, the 2-D rotary embedding (rotate-half), full attention over the image's
patches with an additive key bias (padding patches get `schema.KEY_PAD`), the output projection, the
GELU MLP, and the final + DeepStack mergers, whose outputs are concatenated per decoder token.
What depends on the grid alone (position embeddings, rotary tables) is an input: the encoder
computes it on the CPU, so one graph holds every grid (docs/vision.md, "The tower as one graph").

How a linear is written is a parameter, as for the decoder (`onnx_export.Linear`): F32 `MatMul`,
or `NBitsLinear` (weight-only int8/int4 `MatMulNBits`, onnxruntime only).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from onnx import helper

from edge_llm.backends.graph.schema import GraphSpec, vision_segments
from edge_llm.backends.graph.onnx_export import (
    Exported,
    GraphBuilder,
    Linear,
    WeightKey,
    row_absmax,
    export_one,
    f32_linear,
)
from edge_llm.backends.cpuq.nbits import center, quantize
from edge_llm.backends.cpuq.nbits_export import write_nbits
from edge_llm.config import ModelArgs, VisionArgs, vision_args_from_dir
from edge_llm.errors import ConfigError
from edge_llm.weights import Weights, load_vision_weights

LN_EPS = 1e-6  # torch.nn.LayerNorm(eps=1e-6), as cpu_vision.LN_EPS


class NBitsLinear:
    """`onnx_export.Linear` writing weight-only `MatMulNBits` (`bits` 8 or 4, blocks of `block`
    input channels, symmetric around the block's own zero point: nbits.quantize). The tower's
    weights come as BF16 checkpoints, never as GGUF blocks, so every weight is quantized here."""

    def __init__(self, bits: int, block: int = 32, accuracy_level: int = 4):
        self.bits, self.block, self.accuracy_level = bits, block, accuracy_level
        self.nbytes = 0

    def __call__(self, g: GraphBuilder, x: str, w: np.ndarray, bias: np.ndarray | None, out: str | None,
                 key: WeightKey) -> str:
        qw = center(quantize(w, self.bits, self.block))
        self.nbytes += qw.nbytes
        y = write_nbits(g, x, qw, self.accuracy_level, out if bias is None else None)
        return y if bias is None else g.op("Add", [y, g.const("b", bias)], out=out)


def _c(g: GraphBuilder, hint: str, value) -> str:
    return g.const(hint, np.asarray(value, dtype=np.int64 if isinstance(value, list) else np.float32))


def layer_norm_f32(g: GraphBuilder, x: str, w: np.ndarray, b: np.ndarray) -> str:
    """(x - mean) / sqrt(var + eps) * w + b over the last axis (torch's LayerNorm, float32)."""
    d = g.op("Sub", [x, g.op("ReduceMean", [x], axes=[-1], keepdims=1)])
    var = g.op("ReduceMean", [g.op("Mul", [d, d])], axes=[-1], keepdims=1)
    n = g.op("Div", [d, g.op("Sqrt", [g.op("Add", [var, _c(g, "eps", LN_EPS)])])])
    return g.op("Add", [g.op("Mul", [n, g.const("ln_w", w)]), g.const("ln_b", b)])


def _row_mean(g: GraphBuilder, x: str, n: int) -> str:
    """ReduceSum(x) / n: rknn-toolkit2 2.5.0 keeps ReduceSum on the NPU, and places a ReduceMean
    outside its own LayerNorm pattern on the CPU (measured)."""
    total = g.op("ReduceSum", [x, _c(g, "axes", [-1])], keepdims=1)
    return g.op("Mul", [total, _c(g, "inv_n", 1.0 / n)])


def layer_norm_fp16(g: GraphBuilder, x: str, w: np.ndarray, b: np.ndarray) -> str:
    """The same LayerNorm with every intermediate inside fp16's range for any finite fp16 row (the
    decoder's `rms_norm_fp16_op` idea; rknn-toolkit2 #149 reports fp16 LayerNorm precision loss,
    and a ViT's residual stream can carry channels in the thousands, whose squares pass 65,504).

    s = max|x| + F per row with F = sqrt(n eps); u = x / s, |u| < 1; d = u - mean(u), |d| < 2,
    sum(d^2) < 4n. (x - mean(x)) / sqrt(var(x) + eps) = d / sqrt(mean(d^2) + eps / s^2), and
    sqrt(eps) / s = (F / s) / sqrt(n) = (1 - max|u|) / sqrt(n): no constant divided by a tensor,
    which the compiler would run on the CPU. Means as `_row_mean`. A zero (padding) row gives b."""
    n = w.shape[0]
    s = g.op("Add", [row_absmax(g, x, n), _c(g, "floor", np.sqrt(n * LN_EPS))])
    u = g.op("Div", [x, s])
    d = g.op("Sub", [u, _row_mean(g, u, n)])
    t = g.op("Mul", [g.op("Sub", [_c(g, "one", 1.0), row_absmax(g, u, n)]), _c(g, "inv_sqrt_n", 1.0 / np.sqrt(n))])
    var = g.op("Add", [_row_mean(g, g.op("Mul", [d, d]), n), g.op("Mul", [t, t])])
    normed = g.op("Div", [d, g.op("Sqrt", [var])])
    return g.op("Add", [g.op("Mul", [normed, g.const("ln_w", w)]), g.const("ln_b", b)])


def gelu_tanh(g: GraphBuilder, x: str) -> str:
    inner = g.op("Mul", [x, g.op("Add", [_c(g, "one", 1.0), g.op("Mul", [g.op("Mul", [x, x]),
                                                                         _c(g, "c3", 0.044715)])])])
    t = g.op("Tanh", [g.op("Mul", [inner, _c(g, "c", np.sqrt(2.0 / np.pi))])])
    return g.op("Mul", [g.op("Mul", [x, _c(g, "half", 0.5)]), g.op("Add", [t, _c(g, "one", 1.0)])])


def gelu_erf(g: GraphBuilder, x: str) -> str:
    e = g.op("Erf", [g.op("Mul", [x, _c(g, "rs2", 1.0 / np.sqrt(2.0))])])
    return g.op("Mul", [g.op("Mul", [x, _c(g, "half", 0.5)]), g.op("Add", [e, _c(g, "one", 1.0)])])


ACTIVATIONS: dict[str, Callable[[GraphBuilder, str], str]] = {"gelu_pytorch_tanh": gelu_tanh, "gelu": gelu_erf}


def _rope(g: GraphBuilder, x: str, heads: int, dim: int) -> str:
    """x * cos + rotate_half(x) * sin per head; x (N, heads * dim), cos/sin (N, dim) fed as
    (N, 1, dim) and broadcast over the heads (reshapes only: no transpose)."""
    x3 = g.op("Reshape", [x, _c(g, "nhd", [0, heads, dim])])
    a, b = _split(g, x3, [dim // 2, dim // 2], 2, "half")
    rot = g.op("Concat", [g.op("Neg", [b]), a], axis=-1)
    y = g.op("Add", [g.op("Mul", [x3, "cos3"]), g.op("Mul", [rot, "sin3"])])
    return g.op("Reshape", [y, _c(g, "nh", [0, heads * dim])])


def _split(g: GraphBuilder, x: str, sizes: list[int], axis: int, hint: str) -> list[str]:
    names = [g.fresh(hint) for _ in sizes]
    g.nodes.append(helper.make_node("Split", [x, _c(g, "sizes", sizes)], names, axis=axis))
    return names


def _attention_batched(g: GraphBuilder, q: str, k: str, v: str, kbias: str, heads: int, dim: int) -> str:
    """The same attention with every head in one batched MatMul / Softmax / MatMul (the NPU
    graph: rknn-toolkit2 estimates the same cycles and gives the same error for both forms on
    the 2B geometry, and compiles a third fewer ops, measured)."""
    hnd = _c(g, "hnd", [0, heads, dim])
    qb = g.op("Transpose", [g.op("Reshape", [q, hnd])], perm=[1, 0, 2])  # (H, N, D)
    kt = g.op("Transpose", [g.op("Reshape", [k, hnd])], perm=[1, 2, 0])  # (H, D, N)
    vb = g.op("Transpose", [g.op("Reshape", [v, hnd])], perm=[1, 0, 2])
    s = g.op("Add", [g.op("MatMul", [qb, kt]), kbias])
    o = g.op("MatMul", [g.op("Softmax", [s], axis=-1), vb])
    return g.op("Reshape", [g.op("Transpose", [o], perm=[1, 0, 2]), _c(g, "nh", [0, heads * dim])])


def _attention(g: GraphBuilder, q: str, k: str, v: str, kbias: str, heads: int, dim: int) -> str:
    """softmax(q_h k_h^T + kbias) v_h for each head h, concatenated: q, k, v (N, heads * dim),
    the heads' columns side by side. One head at a time: its (N, N) scores are the largest
    tensor of the graph, and one at a time they stay 16x smaller (39 MB at 896x896)."""
    out = []
    for qh, kh, vh in zip(*(_split(g, t, [dim] * heads, 1, n) for t, n in ((q, "qh"), (k, "kh"), (v, "vh")))):
        s = g.op("Gemm", [qh, kh, kbias], transB=1)  # q_h k_h^T + kbias: no Transpose node
        out.append(g.op("MatMul", [g.op("Softmax", [s], axis=-1), vh]))
    return g.op("Concat", out, axis=1) if heads > 1 else out[0]


def _linear(g: GraphBuilder, linear: Linear, x: str, weights: Weights, name: str, key: WeightKey,
            out: str | None = None) -> str:
    """x @ W.T + b of a checkpoint's (out, in) weight and its bias."""
    w = np.ascontiguousarray(weights.pop(f"{name}.weight").T)
    return linear(g, x, w, weights.pop(f"{name}.bias"), out, key)


def build_tower(g: GraphBuilder, v: VisionArgs, weights: Weights, linear: Linear, spec: GraphSpec, end: int,
                npu: bool = False) -> None:
    """The tower, or its segment `spec` (schema.vision_spec) of blocks [spec.index, end); segments
    are built in order from one `weights` (each pops what it uses). `npu`: for the fp16 NPU, the
    LayerNorms in their fp16-safe form (`layer_norm_fp16`), the mergers' exact GELU in its tanh
    form, whose largest difference (~3e-4 absolute, near x = -2) lies below fp16's rounding,
    because rknn-toolkit2 2.5.0 places `Erf` on the CPU (measured), and attention batched over
    the heads (`_attention_batched`); else onnxruntime's F32 forms, attention head by head."""
    merger_act, layer_norm = (gelu_tanh, layer_norm_fp16) if npu else (gelu_erf, layer_norm_f32)
    attention = _attention_batched if npu else _attention
    p, H, D, h = v.weight_prefix, v.num_heads, v.head_dim, v.hidden_size
    a, b = spec.index, end
    if a == 0:
        pw = weights.pop(f"{p}patch_embed.proj.weight")
        x = f32_linear(g, "pixels", np.ascontiguousarray(pw.reshape(h, -1).T), weights.pop(f"{p}patch_embed.proj.bias"))
        x = g.op("Add", [x, "pos"])
        weights.pop(f"{p}pos_embed.weight")  # resampled on the CPU: the `pos` input
    else:
        x = "h"
    kbias = g.op("Reshape", ["kbias", _c(g, "row", [1, -1])])
    g.op("Reshape", ["cos", _c(g, "n1d", [0, 1, D])], out="cos3")
    g.op("Reshape", ["sin", _c(g, "n1d", [0, 1, D])], out="sin3")
    scale = _c(g, "scale", D ** -0.5)
    features: list[str] = []
    for i in range(a, b):
        bp = f"{p}blocks.{i}."
        n1 = layer_norm(g, x, weights.pop(f"{bp}norm1.weight"), weights.pop(f"{bp}norm1.bias"))
        qkv = _linear(g, linear, n1, weights, f"{bp}attn.qkv", WeightKey("vision.qkv", i))
        q, k, val = _split(g, qkv, [h, h, h], 1, "qkv")
        q = g.op("Mul", [_rope(g, q, H, D), scale])
        o = attention(g, q, _rope(g, k, H, D), val, kbias, H, D)
        x = g.op("Add", [x, _linear(g, linear, o, weights, f"{bp}attn.proj", WeightKey("vision.proj", i))])
        n2 = layer_norm(g, x, weights.pop(f"{bp}norm2.weight"), weights.pop(f"{bp}norm2.bias"))
        act = ACTIVATIONS[v.hidden_act](g, _linear(g, linear, n2, weights, f"{bp}mlp.linear_fc1",
                                                   WeightKey("vision.fc1", i)))
        x = g.op("Add", [x, _linear(g, linear, act, weights, f"{bp}mlp.linear_fc2", WeightKey("vision.fc2", i))],
                 out="h_out" if i == b - 1 and b < v.depth else None)
        if i in v.deepstack_visual_indexes:
            j = 1 + v.deepstack_visual_indexes.index(i)
            features.append(_merger(g, v, weights, linear, x, f"{p}deepstack_merger_list.{j - 1}.", j, merger_act,
                                    layer_norm))
    if b == v.depth:
        features.insert(0, _merger(g, v, weights, linear, x, f"{p}merger.", 0, merger_act, layer_norm))
    if features:
        cat = g.op("Concat", features, axis=1) if len(features) > 1 else features[0]
        g.op("Reshape", [cat, _c(g, "out_rows", [-1, dict(spec.outputs)["features"]])], out="features")


def _merger(g: GraphBuilder, v: VisionArgs, weights: Weights, linear: Linear, x: str, mp: str, j: int,
            act: Callable[[GraphBuilder, str], str], layer_norm: Callable[..., str]) -> str:
    """Merger j (0 = final: LayerNorm per patch; else DeepStack: LayerNorm over the 2x2 group),
    fc1, exact GELU, fc2: (N, hidden) -> (N / merge^2, out_hidden)."""
    group = _c(g, "group", [-1, v.merged_dim])
    nw, nb = weights.pop(f"{mp}norm.weight"), weights.pop(f"{mp}norm.bias")
    if j:
        n = layer_norm(g, g.op("Reshape", [x, group]), nw, nb)
    else:
        n = g.op("Reshape", [layer_norm(g, x, nw, nb), group])
    hid = act(g, _linear(g, linear, n, weights, f"{mp}linear_fc1", WeightKey("vision.merger_fc1", j)))
    return _linear(g, linear, hid, weights, f"{mp}linear_fc2", WeightKey("vision.merger_fc2", j))


def export_tower(model_dir: str | Path, out_dir: str | Path, rows: tuple[int, ...] = (),
                 linear: Linear = f32_linear, npu: bool = False, blocks: int | None = None) -> list[Exported]:
    """Write the model's vision tower to `out_dir` as one graph `vision.onnx` (+ `.onnx.data`),
    or with `blocks` as segments `vision.AA-BB.onnx` of that many blocks (`npu`: as
    `build_tower`)."""
    v = vision_args_from_dir(model_dir)
    if v is None:
        raise ConfigError(f"{model_dir} has no vision tower")
    weights = load_vision_weights(model_dir, ModelArgs.from_dir(model_dir), v)
    if weights is None:
        raise ConfigError(f"{model_dir} declares a vision tower but has no vision weights")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    specs = vision_segments(v, rows, blocks)
    ends = [s.index for s in specs[1:]] + [v.depth]
    return [export_one(spec, out, lambda g, spec=spec, end=end: build_tower(g, v, weights, linear, spec, end,
                                                                         npu))
            for spec, end in zip(specs, ends)]
