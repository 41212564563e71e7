"""The decode graph of backend cpu-q: a whole decode step in one onnxruntime call.

A decode step (and the last prompt token, which the engine computes alone) is one row; a
speculative verify forward is a few (docs/speculative.md). Run as the chunk path does (a graph
per layer plus numpy for q/k norm, RoPE and attention) it costs ~30 runtime calls and ~600 small
numpy operations per token, and that overhead, not the weight bytes, decided the speed. This
graph holds every layer of the decoder and the head, for T rows after the S cached ones:

    inputs   x (T, hidden)                 the rows' embeddings
             cos, sin (T, head_dim / 2)    RoPE (or MRoPE) of their positions, from numpy
             kLL, vLL (S, kv_dim)          layer LL's cached K/V rows [0, S): the F32 cache rows
                                           themselves, bound zero-copy (decode_step.OrtDecodeStep)
    outputs  logits (T, vocab)
             knewLL, vnewLL (T, kv_dim)    layer LL's new rows (K rotated): the model writes them
                                           with `KVCache.write`, the one writer of rows

Row t attends to the S cached rows and new rows 0..t (causal). Every node computes a row from
that row alone, so row t's result is bitwise what a one-row forward gives it (docs/quantization.md,
"Bits and batches").

Per layer: RMSNorm (ONNX opset 23 `RMSNormalization`; after the first layer fused with the
residual add as `SkipSimplifiedLayerNormalization`), the fused q/k/v projection, per-head
q/k RMSNorm (Qwen3), `RotaryEmbedding` (rotate-half, cos/sin given per row), GQA attention
over the S cached rows and the new ones, o_proj, the SwiGLU MLP; the residual stream stays float32.

The linears are whatever `linear` writes: cpu-q passes `QuantLinear(row_op=True)`, whose nodes
are `ai.edge_llm.MatMulQ` (C, backends/kernels/_qmatmul.c: 4/8-bit blocks times int8 activations, the
same bits on every CPU).

Attention of the query rows over the S cached rows and the new rows is one node of our own,
`ai.edge_llm.AttnRow` (C, backends/kernels/_attn.c, loaded into the session by `kernels`): it reads
each layer's rows in place, in the cache's layout (S, n_kv * D), once per token (~18 GB/s here),
splitting its work over onnxruntime's own pool threads. onnxruntime's operators would copy or
pack every row per token (docs/quantization.md, "Attention").
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
from onnx import helper

from edge_llm.backends.cpu.backend import DenseLayer, load_layer
from edge_llm.backends.kernels import ATTN_DOMAIN, ATTN_OP
from edge_llm.backends.graph.schema import DECODE, decode_kv_names, decode_spec
from edge_llm.backends.graph.onnx_export import (
    MS_DOMAIN,
    Exported,
    GraphBuilder,
    Linear,
    WeightKey,
)
from edge_llm.backends.graph.manifest import sha256_files
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
        self.scale = g.const("scale", np.array(1.0 / np.sqrt(args.head_dim), np.float32))
        # position_ids of one element: an offset, row t takes cos/sin row 0 + t
        self.pos0 = g.const("pos0", np.zeros((1,), np.int64))

    # ---- small pieces -----------------------------------------------------------------------
    def norm(self, x: str, w: np.ndarray) -> str:
        return self.g.op("RMSNormalization", [x, self.g.const("norm", w)], axis=-1, epsilon=self.eps)

    def skip_norm(self, delta: str, h: str, w: np.ndarray) -> tuple[str, str]:
        """(RMSNorm(h + delta), h + delta): the residual add and the next norm in one node."""
        g = self.g
        y, s = g.fresh("normed"), g.fresh("h")
        g.nodes.append(helper.make_node("SkipSimplifiedLayerNormalization", [delta, h, g.const("norm", w)],
                                        [y, "", "", s], domain=MS_DOMAIN, epsilon=self.eps))
        return y, s

    def rope(self, x: str, heads: int, norm: np.ndarray | None) -> str:
        """(T, heads * D) -> per-head RMSNorm (if any) -> RoPE, as (1, T, heads * D)."""
        g, D = self.g, self.args.head_dim
        if norm is not None:
            x = self.norm(g.op("Reshape", [x, g.const("heads", _i64(-1, heads, D))]), norm)
        x3 = g.op("Reshape", [x, g.const("row3", _i64(1, -1, heads * D))])
        return g.op("RotaryEmbedding", [x3, self.pos0, "cos", "sin"], domain=MS_DOMAIN, interleaved=0,
                    num_heads=heads)

    def attention(self, q3: str, k_new: str, v_new: str, k_past: str, v_past: str) -> str:
        """(1, T, H * D) rotated queries -> (T, H * D): the `AttnRow` node over the cached rows + the new rows."""
        g, a = self.g, self.args
        q = g.op("Mul", [g.op("Reshape", [q3, g.const("qrow", _i64(-1, a.q_dim))]), self.scale])
        return g.op(ATTN_OP, [q, k_past, v_past, k_new, v_new], domain=ATTN_DOMAIN,
                    num_heads=a.num_attention_heads, kv_heads=a.num_key_value_heads)

    # ---- a layer ------------------------------------------------------------------------------
    def layer(self, i: int, L: DenseLayer, h: str, hn: str, q_norm: np.ndarray | None,
              k_norm: np.ndarray | None) -> tuple[str, str]:
        """Layer i on the residual stream h (hn = RMSNorm(h) with the layer's input norm); writes
        the new K/V row outputs and returns (mlp delta, h after attention): the caller adds the
        two and norms the sum for what follows (the next layer or the head), in one node."""
        g, a = self.g, self.args
        q_dim, kv = a.q_dim, a.kv_dim
        k_past, v_past, k_out, v_out = decode_kv_names(i)
        qkv = self.linear(g, hn, L.w_qkv, L.b_qkv, None, WeightKey("qkv", i))
        q, k, v = g.fresh("q"), g.fresh("k"), v_out
        g.nodes.append(helper.make_node("Split", [qkv, g.const("qkv_split", _i64(q_dim, kv, kv))], [q, k, v], axis=1))
        q3 = self.rope(q, a.num_attention_heads, q_norm)
        k_row = g.op("Reshape", [self.rope(k, a.num_key_value_heads, k_norm), g.const("kvrow", _i64(-1, kv))],
                     out=k_out)
        attn = self.attention(q3, k_row, v, k_past, v_past)
        o = self.linear(g, attn, L.w_o, None, None, WeightKey("o", i))
        hn2, h2 = self.skip_norm(o, h, L.post_norm)
        gu = self.linear(g, hn2, L.w_gu, None, None, WeightKey("gate_up", i))
        inter = L.w_down.shape[0]
        gate, up = g.fresh("gate"), g.fresh("up")
        g.nodes.append(helper.make_node("Split", [gu, g.const("gu_split", _i64(inter, inter))], [gate, up], axis=1))
        act = g.op("Mul", [g.op("Mul", [gate, g.op("Sigmoid", [gate])]), up])
        return self.linear(g, act, L.w_down, None, None, WeightKey("down", i)), h2


def export_decode(model_dir: str | Path, out_dir: Path, linear: Linear,
                  progress: Callable[[str], None] | None = None) -> Exported:
    """Write `decode.onnx` + `.onnx.data` into out_dir, one layer's F32 tensors in RAM at a time."""
    args = ModelArgs.from_dir(model_dir)
    weights = load_weights(model_dir, args)
    spec = decode_spec(args)
    path, data = out_dir / f"{DECODE}.onnx", out_dir / f"{DECODE}.onnx.data"
    g = GraphBuilder(DECODE, data)
    dg = DecodeGraph(g, args, linear)
    n, p = args.num_hidden_layers, args.weight_prefix
    L = load_layer(args, weights, 0)
    h, hn = "x", dg.norm("x", L.in_norm)
    for i in range(n):
        if progress:
            progress(f"layer {i}")
        qn = kn = None
        if args.qk_norm:
            qn = weights.pop(f"{p}layers.{i}.self_attn.q_norm.weight")
            kn = weights.pop(f"{p}layers.{i}.self_attn.k_norm.weight")
        delta, h2 = dg.layer(i, L, h, hn, qn, kn)
        L = load_layer(args, weights, i + 1) if i + 1 < n else None
        hn, h = dg.skip_norm(delta, h2, L.in_norm if L is not None else weights.pop(f"{p}norm.weight"))
    lm = weights.pop(f"{p}embed_tokens.weight") if args.tie_word_embeddings else weights.pop(args.lm_head_name)
    linear(g, hn, lm.T, None, "logits", WeightKey("head", 0, (0, args.vocab_size)))
    half, kv = args.head_dim // 2, args.kv_dim
    ins = [("x", ["T", args.hidden_size]), ("cos", ["T", half]), ("sin", ["T", half])]
    outs = [("logits", ["T", args.vocab_size])]
    for i in range(n):
        kp, vp, kn_, vn = decode_kv_names(i)
        ins += [(kp, ["S", kv]), (vp, ["S", kv])]
        outs += [(kn_, ["T", kv]), (vn, ["T", kv])]
    g.write(ins, outs, path, opset=DECODE_OPSET)
    return Exported(spec, path, data, sha256_files(path, data))
