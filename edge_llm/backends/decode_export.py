"""The one-row decode graphs of backend cpu-q: a token step in n + 1 onnxruntime calls.

A decode step (and the last prompt token, which the engine computes alone) is one row. Run as
the chunk path does (a graph per layer plus numpy for q/k norm, RoPE and attention) it costs
~30 runtime calls and ~600 small numpy operations per token, and that overhead, not the weight
bytes, decided the speed. Here everything of a token but attention is in graphs, cut at each
layer's attention (`graphs.decode_specs`):

    decode.00   x, cos, sin            -> q, knew, vnew      layer 0 up to its attention
    decode.LL   attn, h, cos, sin      -> h', q, knew, vnew  layer LL-1 after its attention
                                                             (o_proj, MLP), layer LL up to its own
    decode.NN   attn, h                -> logits             the last layer after attention, the head

    x, h (1, hidden)     the residual stream (h' = h + o + mlp, float32, in that order)
    cos, sin (1, D / 2)  RoPE (or MRoPE) of the token's position, from numpy
    q (1, H * D)         the layer's query heads, q/k-normed (Qwen3), rotated, scaled by 1/sqrt(D)
    knew, vnew (1, kv)   the layer's new K (rotated) and V row: the model writes them with
                         `KVCache.write`, the one writer of rows
    attn (1, H * D)      attention of q over the cached rows and the new row: the C kernel
                         (_attn.c), between two graphs, reading the cache's rows in place

Per layer: RMSNorm (ONNX opset 23 `RMSNormalization`; after the first layer fused with the
residual add as `SkipSimplifiedLayerNormalization`), the fused q/k/v `MatMulNBits`, per-head
q/k RMSNorm, `RotaryEmbedding` (rotate-half, cos/sin given for the one position), o_proj, the
SwiGLU MLP. docs/quantization.md ("Decode") has why attention is not an onnxruntime op.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
from onnx import helper

from edge_llm.backends.cpu import DenseLayer, load_layer
from edge_llm.backends.graphs import ATTN, H_IN, H_OUT, KNEW, Q, VNEW, decode_specs
from edge_llm.backends.onnx_export import (
    MS_DOMAIN,
    Exported,
    GraphBuilder,
    Linear,
    WeightKey,
    _digest,
)
from edge_llm.config import ModelArgs
from edge_llm.weights import load_weights

DECODE_OPSET = 23  # RMSNormalization


def _i64(*v: int) -> np.ndarray:
    return np.array(v, np.int64)


class DecodeGraph:
    """Writes the decode graph into a `GraphBuilder` (see the module docstring)."""

    def __init__(self, g: GraphBuilder, args: ModelArgs, linear: Linear):
        self.g, self.args, self.linear = g, args, linear
        self.eps = float(args.rms_norm_eps)
        self.pos0 = g.const("pos0", np.zeros((1, 1), np.int64))

    # ---- small pieces -----------------------------------------------------------------------
    def norm(self, x: str, w: np.ndarray) -> str:
        return self.g.op("RMSNormalization", [x, self.g.const("norm", w)], axis=-1, epsilon=self.eps)

    def skip_norm(self, delta: str, h: str, w: np.ndarray, sum_out: str | None = None) -> tuple[str, str]:
        """(RMSNorm(h + delta), h + delta): the residual add and the next norm in one node."""
        g = self.g
        y, s = g.fresh("normed"), sum_out or g.fresh("h")
        g.nodes.append(helper.make_node("SkipSimplifiedLayerNormalization", [delta, h, g.const("norm", w)],
                                        [y, "", "", s], domain=MS_DOMAIN, epsilon=self.eps))
        return y, s

    def rope(self, x: str, heads: int, norm: np.ndarray | None) -> str:
        """(1, heads * D) -> per-head RMSNorm (if any) -> RoPE, as (1, 1, heads * D)."""
        g, D = self.g, self.args.head_dim
        if norm is not None:
            x = self.norm(g.op("Reshape", [x, g.const("heads", _i64(heads, D))]), norm)
        x3 = g.op("Reshape", [x, g.const("row3", _i64(1, 1, heads * D))])
        return g.op("RotaryEmbedding", [x3, self.pos0, "cos", "sin"], domain=MS_DOMAIN, interleaved=0,
                    num_heads=heads)

    # ---- a layer ------------------------------------------------------------------------------
    def qkv(self, i: int, L: DenseLayer, hn: str, q_norm: np.ndarray | None,
            k_norm: np.ndarray | None) -> None:
        """Layer i from its normed input hn to the outputs q (scaled), knew, vnew."""
        g, a = self.g, self.args
        q_dim, kv = a.q_dim, a.kv_dim
        qkv = self.linear(g, hn, L.w_qkv, L.b_qkv, None, WeightKey("qkv", i))
        q, k = g.fresh("q"), g.fresh("k")
        g.nodes.append(helper.make_node("Split", [qkv, g.const("qkv_split", _i64(q_dim, kv, kv))], [q, k, VNEW],
                                        axis=1))
        q = g.op("Reshape", [self.rope(q, a.num_attention_heads, q_norm), g.const("qrow", _i64(1, q_dim))])
        g.op("Mul", [q, g.const("scale", np.array(1.0 / np.sqrt(a.head_dim), np.float32))], out=Q)
        g.op("Reshape", [self.rope(k, a.num_key_value_heads, k_norm), g.const("kvrow", _i64(1, kv))], out=KNEW)

    def post(self, i: int, L: DenseLayer, h: str) -> tuple[str, str]:
        """Layer i after its attention (input ATTN) on the residual stream h: (mlp delta, h + o)."""
        g = self.g
        o = self.linear(g, ATTN, L.w_o, None, None, WeightKey("o", i))
        hn2, h2 = self.skip_norm(o, h, L.post_norm)
        gu = self.linear(g, hn2, L.w_gu, None, None, WeightKey("gate_up", i))
        inter = L.w_down.shape[0]
        gate, up = g.fresh("gate"), g.fresh("up")
        g.nodes.append(helper.make_node("Split", [gu, g.const("gu_split", _i64(inter, inter))], [gate, up], axis=1))
        act = g.op("Mul", [g.op("Mul", [gate, g.op("Sigmoid", [gate])]), up])
        return self.linear(g, act, L.w_down, None, None, WeightKey("down", i)), h2


def export_decode(model_dir: str | Path, out_dir: Path, linear: Linear,
                  progress: Callable[[str], None] | None = None) -> list[Exported]:
    """Write the n + 1 graphs `decode.LL.onnx` + `.onnx.data` into out_dir (module docstring),
    one layer's F32 tensors in RAM at a time."""
    args = ModelArgs.from_dir(model_dir)
    weights = load_weights(model_dir, args)
    specs = decode_specs(args)
    n, p = args.num_hidden_layers, args.weight_prefix
    out: list[Exported] = []
    prev: DenseLayer | None = None
    for i, spec in enumerate(specs):
        if progress:
            progress(spec.name)
        path, data = out_dir / f"{spec.name}.onnx", out_dir / f"{spec.name}.onnx.data"
        g = GraphBuilder(spec.name, data)
        dg = DecodeGraph(g, args, linear)
        L = load_layer(args, weights, i) if i < n else None
        norm = L.in_norm if L is not None else weights.pop(f"{p}norm.weight")
        if prev is None:
            hn = dg.norm("x", norm)
        else:
            delta, h2 = dg.post(i - 1, prev, H_IN)
            hn, _ = dg.skip_norm(delta, h2, norm, H_OUT if L is not None else None)
        if L is not None:
            qn = kn = None
            if args.qk_norm:
                qn = weights.pop(f"{p}layers.{i}.self_attn.q_norm.weight")
                kn = weights.pop(f"{p}layers.{i}.self_attn.k_norm.weight")
            dg.qkv(i, L, hn, qn, kn)
        else:
            lm = weights.pop(f"{p}embed_tokens.weight") if args.tie_word_embeddings else weights.pop(args.lm_head_name)
            linear(g, hn, lm.T, None, "logits", WeightKey("head", 0, (0, args.vocab_size)))
        g.write([(t, [1, w]) for t, w in spec.inputs], [(t, [1, w]) for t, w in spec.outputs], path,
                opset=DECODE_OPSET)
        out.append(Exported(spec, path, data, _digest(path, data)))
        prev = L
    return out
