"""`MmRowStep`: the matmul path's decode forwards in one call (a `RowStep`; docs/npu.md,
"The matmul path: decode forwards").

A decode step (one row) or a speculative verify forward (up to `max_rows` rows) goes through every
layer and the head here instead of through the model's per-layer loop: the dense work is the
backend's own (`MmBackend.qkv` / `post` / `logits`: the same int8 matmuls and the same float32
per-row ops, so those bits are the seam's), the model's per-head q/k RMSNorm, RoPE and q scale are
one call of the matmul path's C ops (`row_ops.COps.qk_rope`: the model's float32 formulas, its sums
of squares in the C order, so within float32 rounding of the model's numpy), and attention over the
cached K/V rows is the operator library's C kernel (`edge_attn_rows` in `_attn.c`, docs/quantization.md "The attention operator"):
it reads the cache's rows in place, one pass over them for all T query rows, where the model's
numpy attention builds (n_kv, T, S) scores and a transposed view of every row. That kernel sums
in another order than numpy's, so the row step's logits and new K/V rows are the seam's up to
float32 rounding, never bitwise; they are deterministic (the kernel's chunked order is fixed),
and the model runs every decode forward through the row step, so restore == recompute holds.

`MmBackend.load` builds it (`make`) when the operator library is built, reading the model's q/k
norm gains from the checkpoint without taking them (the model takes them after the backend's
load), and puts the kernel's code path into the backend's numerics: the K/V rows' bits depend on it.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Sequence

import numpy as np

from edge_llm.backends import kernels
from edge_llm.backends.npu.matmul import row_ops
from edge_llm.backends import Backend
from edge_llm.config import ModelArgs
from edge_llm.errors import ConfigError
from edge_llm.weights import Weights

MAX_ROWS = 16  # rows per call: a verify forward of up to 15 drafted tokens (settings: draft_max)


def _ptr(a: np.ndarray) -> ctypes.c_void_p:
    return ctypes.c_void_p(a.ctypes.data)


class MmRowStep:
    """Up to `max_rows` rows through every layer of an `MmBackend` and its head (a `RowStep`)."""

    def __init__(self, backend: Backend, args: ModelArgs, q_norms: Sequence[np.ndarray],
                 k_norms: Sequence[np.ndarray], max_rows: int = MAX_ROWS):
        lib, ops = kernels.library(), row_ops.c_ops()
        if lib is None or ops is None:
            raise ConfigError("the attention operator (_attn.c) was not built at install: no row step")
        if args.qk_norm and (len(q_norms) != args.num_hidden_layers or len(k_norms) != args.num_hidden_layers):
            raise ConfigError(f"row step: {args.num_hidden_layers} q/k norm gains needed, got "
                              f"{len(q_norms)} and {len(k_norms)}")
        self.lib, self.ops, self.be, self.args, self.max_rows = lib, ops, backend, args, max_rows
        self.q_norms = [np.asarray(w, np.float32) for w in q_norms]
        self.k_norms = [np.asarray(w, np.float32) for w in k_norms]
        self.eps = np.float32(args.rms_norm_eps)
        self.scale = np.float32(1.0 / math.sqrt(args.head_dim))  # the model's (models/qwen3.py)
        n, kv = args.num_hidden_layers, args.kv_dim
        self.k_new = np.empty((n, max_rows, kv), np.float32)
        self.v_new = np.empty((n, max_rows, kv), np.float32)
        self.attn = np.empty((max_rows, args.q_dim), np.float32)
        self.q = np.empty((max_rows, args.q_dim), np.float32)
        self.work = np.empty(0, np.float32)

    def _work(self, S: int, T: int) -> np.ndarray:
        a = self.args
        need = int(self.lib.edge_attn_rows_work_size(S, T, a.num_attention_heads, a.head_dim))
        if self.work.size < need:  # grows with the context, in steps, never per call
            self.work = np.empty(max(need, 2 * self.work.size), np.float32)
        return self.work

    def __call__(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray,
                 past: Sequence[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """x (T, hidden) rows of the residual stream (`embed`), cos/sin (T, head_dim/2),
        past[l] = (K rows, V rows) (S, kv_dim) C-contiguous, S >= 1 -> (logits (T, vocab), new K
        rows (n_layers, T, kv_dim) rotated, new V rows), the last two views of buffers the next
        call reuses. Row t attends to the S past rows and new rows 0..t."""
        a, be = self.args, self.be
        T = x.shape[0]
        n, H, n_kv, D = a.num_hidden_layers, a.num_attention_heads, a.num_key_value_heads, a.head_dim
        if not 1 <= T <= self.max_rows or len(past) != n:
            raise ValueError(f"row step: 1 to {self.max_rows} rows and {n} layers, got {T} and {len(past)}")
        if cos.shape != (T, D // 2) or sin.shape != (T, D // 2):
            raise ValueError(f"row step: cos/sin need shape ({T}, {D // 2}), got {cos.shape} and {sin.shape}")
        S = past[0][0].shape[0]
        work, attn, q_rows = self._work(S, T), self.attn[:T], self.q[:T]
        for layer, (kp, vp) in enumerate(past):
            if kp.shape != (S, a.kv_dim) or vp.shape != (S, a.kv_dim) or not (kp.flags.c_contiguous
                                                                                and vp.flags.c_contiguous):
                raise ValueError(f"row step: layer {layer}'s past rows must be C-contiguous ({S}, {a.kv_dim})")
            q, k, v = be.qkv(layer, x)
            k_new, v_new = self.k_new[layer, :T], self.v_new[layer, :T]
            gains = (self.q_norms[layer], self.k_norms[layer]) if a.qk_norm else None
            self.ops.qk_rope(q, k, v, H, n_kv, gains, self.eps, cos, sin, self.scale, q_rows, k_new, v_new)
            rc = self.lib.edge_attn_rows(_ptr(q_rows), _ptr(kp), _ptr(vp), _ptr(k_new), _ptr(v_new), S, T, a.kv_dim,
                                         H, n_kv, D, _ptr(attn), _ptr(work))
            if rc != 0:
                raise ValueError(f"row step: attention refused its sizes (S={S}, T={T}, H={H}, n_kv={n_kv}, D={D})")
            x, _ = be.post(layer, attn, x, fuse_next=False)
        return be.logits(x), self.k_new[:, :T], self.v_new[:, :T]


def make(backend: Backend, args: ModelArgs, weights: Weights, max_rows: int = MAX_ROWS) -> MmRowStep | None:
    """The row step of `backend` (an `MmBackend` being loaded), or None without the operator
    library (the model then runs decode forwards through the seam). Reads the q/k norm gains from
    `weights` without taking them: the model takes them after the backend's load."""
    if kernels.library() is None or row_ops.c_ops() is None:
        return None
    q_norms, k_norms = [], []
    if args.qk_norm:
        for i in range(args.num_hidden_layers):
            lp = f"{args.weight_prefix}layers.{i}.self_attn."
            q_norms.append(weights[f"{lp}q_norm.weight"])
            k_norms.append(weights[f"{lp}k_norm.weight"])
    return MmRowStep(backend, args, q_norms, k_norms, max_rows)
