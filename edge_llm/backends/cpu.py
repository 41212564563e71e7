"""CPU backend: numpy float32 with BLAS sgemm/sgemv for every projection.

Weights are stored transposed to (in, out) and C-contiguous so `x @ W` is a plain NN sgemm;
q/k/v and gate/up are fused into one matrix each so a layer runs four matmuls. OpenBLAS splits
work by output blocks, so a given (shape, thread count) always gives the same bits.
"""

from __future__ import annotations

import logging

import numpy as np

from edge_llm.config import ModelArgs
from edge_llm.weights import Weights

log = logging.getLogger(__name__)


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """HF RMSNorm in float32 over the last axis: weight * x / sqrt(mean(x^2) + eps)."""
    var = np.mean(np.square(x), axis=-1, keepdims=True)
    return weight * (x * (np.float32(1.0) / np.sqrt(var + np.float32(eps))))


def _t(*mats: np.ndarray) -> np.ndarray:
    """Transpose (out, in) matrices into one contiguous (in, sum(out)) matrix, one copy each."""
    out = np.empty((mats[0].shape[1], sum(m.shape[0] for m in mats)), dtype=np.float32)
    col = 0
    for m in mats:
        out[:, col:col + m.shape[0]] = m.T
        col += m.shape[0]
    return out


class _Layer:
    __slots__ = ("in_norm", "post_norm", "w_qkv", "b_qkv", "w_o", "w_gu", "w_down")


class CPUBackend:
    """Dense decoder work in numpy float32 (see `edge_llm.backends.Backend`)."""

    name = "cpu"
    numerics = "cpu-f32"
    chunk_sizes: tuple[int, ...] = ()

    def __init__(self) -> None:
        self.args: ModelArgs | None = None
        self.layers: list[_Layer] = []

    def load(self, args: ModelArgs, weights: Weights) -> None:
        self.args = args
        p = args.weight_prefix
        self.eps = np.float32(args.rms_norm_eps)
        self.q_dim, self.kv_dim, self.inter = args.q_dim, args.kv_dim, args.intermediate_size
        self.embed_tokens = weights.pop(f"{p}embed_tokens.weight")  # (vocab, hidden)
        # lm_head stays (vocab, hidden): x @ W.T is a transposed-B sgemm, and a tied model
        # shares the embedding table instead of holding a second 0.6-1.2 GB copy
        self.lm_head = self.embed_tokens if args.tie_word_embeddings else weights.pop(args.lm_head_name)
        self.final_norm = weights.pop(f"{p}norm.weight")
        self.layers = []
        for i in range(args.num_hidden_layers):
            lp = f"{p}layers.{i}."
            L = _Layer()
            L.in_norm = weights.pop(f"{lp}input_layernorm.weight")
            L.post_norm = weights.pop(f"{lp}post_attention_layernorm.weight")
            L.w_qkv = _t(*(weights.pop(f"{lp}self_attn.{n}_proj.weight") for n in "qkv"))
            # (hidden, q_dim + 2 kv_dim)
            L.b_qkv = (
                np.concatenate([weights.pop(f"{lp}self_attn.{n}_proj.bias") for n in "qkv"])
                if args.attention_bias else None
            )
            L.w_o = _t(weights.pop(f"{lp}self_attn.o_proj.weight"))  # (q_dim, hidden)
            L.w_gu = _t(*(weights.pop(f"{lp}mlp.{n}_proj.weight") for n in ("gate", "up")))
            # (hidden, 2 inter)
            L.w_down = _t(weights.pop(f"{lp}mlp.down_proj.weight"))  # (inter, hidden)
            self.layers.append(L)
        log.debug("cpu backend: %d layers, %.1f MB of weights", len(self.layers), self.nbytes / 1e6)

    @property
    def nbytes(self) -> int:
        """Bytes of weight arrays held (a tied lm_head counted once)."""
        n = self.embed_tokens.nbytes + self.final_norm.nbytes
        if self.lm_head is not self.embed_tokens:
            n += self.lm_head.nbytes
        for L in self.layers:
            n += sum(a.nbytes for a in (L.in_norm, L.post_norm, L.w_qkv, L.w_o, L.w_gu, L.w_down))
            n += 0 if L.b_qkv is None else L.b_qkv.nbytes
        return n

    def embed(self, tokens: np.ndarray) -> np.ndarray:
        return self.embed_tokens[tokens]

    def qkv(self, layer: int, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        L = self.layers[layer]
        y = rms_norm(x, L.in_norm, self.eps) @ L.w_qkv  # (T, q_dim + 2 kv_dim)
        if L.b_qkv is not None:
            y += L.b_qkv
        q, kv = self.q_dim, self.kv_dim
        return y[:, :q], y[:, q:q + kv], y[:, q + kv:]

    def attn_out(self, layer: int, attn: np.ndarray, x: np.ndarray) -> np.ndarray:
        out = attn @ self.layers[layer].w_o
        out += x
        return out

    def mlp(self, layer: int, x: np.ndarray) -> np.ndarray:
        L = self.layers[layer]
        gu = rms_norm(x, L.post_norm, self.eps) @ L.w_gu  # (T, 2 inter)
        gate, up = gu[:, :self.inter], gu[:, self.inter:]
        # silu(g) * u = g * u / (1 + exp(-g)), in place on the fused buffer
        with np.errstate(over="ignore"):  # exp(-g) -> inf for g << 0 gives silu = -0, correct
            act = np.exp(np.negative(gate))
        act += np.float32(1.0)
        np.divide(gate, act, out=act)
        act *= up
        out = act @ L.w_down
        out += x
        return out

    def logits(self, x: np.ndarray) -> np.ndarray:
        return rms_norm(x, self.final_norm, self.eps) @ self.lm_head.T
