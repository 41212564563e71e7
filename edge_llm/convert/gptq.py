"""GPTQ for the matmul path's per-channel int8 weights, numpy only (docs/npu.md, "The matmul path").

Rounding each weight to its nearest int8 step (RTN) leaves an error the next layers amplify; on
the default model RTN weights alone cost KL 0.0035 against F32 (docs/npu.md). GPTQ (Frantar et
al. 2022) quantizes one input row of W (K, N) at a time and moves its rounding error onto the rows
not yet quantized, weighted by the inverse Hessian H = X^T X of the layer's real inputs X, so the
layer's output on inputs like X changes least. The scales stay per output channel and are fixed
before (absmax or the MSE clip), so the engine and the run-time code do not change. Written here
because the maintained implementations (AutoGPTQ, GPTQModel, llm-compressor) need torch and
quantize whole checkpoints into their own formats; this converter must run with numpy alone (on the
board too).

`capture` runs the F32 CPU backend over calibration tokens (`calibration_text.py`, not the
accuracy text) and keeps, per layer, the rows each int8 matmul will read, unrotated and with
unit-gain norms: the converter rotates them into its basis (`convert/npu_mm.py`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np

from edge_llm.backends.cpu.backend import CPUBackend, rms_norm, swiglu
from edge_llm.backends.npu.matmul.int8 import QMAX

log = logging.getLogger(__name__)

BLOCK = 128  # rows of W updated together before the rest gets one matrix product (the paper's lazy batch)
DAMP = 0.01  # of the mean Hessian diagonal, added to it (the paper's default)
KINDS = ("qkv", "o", "gu", "down", "head")


class _Recorder(CPUBackend):
    """The F32 CPU backend, keeping every int8 matmul's input rows (float32) by (layer, kind)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[tuple[int, str], list[np.ndarray]] = {}

    def _keep(self, layer: int, kind: str, x: np.ndarray) -> None:
        self.seen.setdefault((layer, kind), []).append(np.array(x, np.float32))

    def qkv_fused(self, layer: int, x: np.ndarray) -> np.ndarray:
        self._keep(layer, "qkv", rms_norm(x, np.float32(1.0), self.eps))
        return super().qkv_fused(layer, x)

    def attn_out(self, layer: int, attn: np.ndarray, x: np.ndarray) -> np.ndarray:
        self._keep(layer, "o", attn)
        return super().attn_out(layer, attn, x)

    def mlp_delta(self, layer: int, x: np.ndarray) -> np.ndarray:
        L = self.layers[layer]
        self._keep(layer, "gu", rms_norm(x, np.float32(1.0), self.eps))
        gu = rms_norm(x, L.post_norm, self.eps) @ L.w_gu
        act = swiglu(gu, self.inter)
        self._keep(layer, "down", act)
        return act @ L.w_down

    def post(self, layer: int, attn: np.ndarray, x: np.ndarray, fuse_next: bool = True) -> tuple[np.ndarray, None]:
        h, _ = super().post(layer, attn, x, fuse_next)
        if self.args is not None and layer == self.args.num_hidden_layers - 1:  # the head reads every row
            self._keep(-1, "head", rms_norm(h, np.float32(1.0), self.eps))
        return h, None


def calibration_ids(model_dir: str | Path, tokens: int) -> list[int]:
    """The built-in calibration text as a chat user message, cut to `tokens` (random ids for a
    model without a tokenizer: tiny test models)."""
    from edge_llm.config import ModelArgs
    from edge_llm.convert.calibration_text import CALIBRATION_TEXT
    from edge_llm.errors import EdgeLLMError
    from edge_llm.tokenizer import Tokenizer

    try:
        tok = Tokenizer.from_dir(model_dir)
    except EdgeLLMError:
        return np.random.default_rng(4321).integers(0, ModelArgs.from_dir(model_dir).vocab_size, tokens).tolist()
    try:
        ids = tok.apply_chat_template_ids([{"role": "user", "content": CALIBRATION_TEXT}])
    except EdgeLLMError:
        ids = tok.encode(CALIBRATION_TEXT)
    return ids[:tokens]


def capture(model_dir: str | Path, ids: list[int],
            layers_done: Callable[[int, int], None] | None = None) -> dict[tuple[int, str], np.ndarray]:
    """Every int8 matmul's input rows on `ids` ((layer, kind) -> (T, K); the head under layer -1).
    Holds the F32 model while it runs (4 bytes per weight). `layers_done(done, total)`: after each
    decoder layer of the run (one forward of every row)."""
    from edge_llm.models.qwen3 import Model
    from edge_llm.progress import LAYER, Work

    rec = _Recorder()
    model = Model.load(model_dir, backend=rec)
    work = Work(on_progress=lambda stage, done, total: layers_done(done, total) if layers_done and stage == LAYER
                else None)
    # the last row's logits only: the head's inputs are kept from the last layer's output (all rows),
    # so the capture does not multiply every row by the head (1.3 TFLOP for 2048 rows of the 2B)
    model.forward(np.asarray(ids, dtype=np.int64), model.new_cache(len(ids), check_memory=False), work=work)
    rec.layers = []
    log.info("gptq: inputs of %d matmuls captured on %d tokens", len(rec.seen), len(ids))
    return {k: np.concatenate(v) for k, v in rec.seen.items()}


def gptq(w: np.ndarray, x: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """W (K, N) float32, X (T, K) its real input rows, scale (N,) per output channel -> int8
    (K, N) on the grid `scale`, rows quantized in order with the error compensation above."""
    K = w.shape[0]
    W = np.array(w, np.float32)  # float32 updates (half the memory traffic of float64); H and its inverse in float64
    H = x.astype(np.float64).T @ x.astype(np.float64)
    dead = np.diag(H) == 0  # an input channel that is always 0: its weights do not matter
    H[dead, dead] = 1.0
    W[dead, :] = 0.0
    H[np.diag_indices(K)] += DAMP * float(np.mean(np.diag(H)))
    # act order: the rows with the largest inputs first, while the most rows are left to absorb their error
    order = np.argsort(-np.diag(H), kind="stable")
    W, H = W[order], H[np.ix_(order, order)]
    # the upper Cholesky factor U of H^-1 (H^-1 = U^T U): row i holds the update coefficients
    U = np.linalg.cholesky(np.linalg.inv(H)).T.astype(np.float32)
    s = np.asarray(scale, np.float32)
    Q = np.empty(W.shape, np.int8)
    for a in range(0, K, BLOCK):
        b = min(a + BLOCK, K)
        W1, U1, E = W[a:b], U[a:b, a:b], np.empty((b - a, W.shape[1]), np.float32)
        for i in range(b - a):
            q = np.clip(np.rint(W1[i] / s), -QMAX, QMAX)
            Q[a + i] = q
            E[i] = (W1[i] - q * s) / U1[i, i]
            W1[i + 1:] -= np.outer(U1[i, i + 1:], E[i])
        W[b:] -= U[a:b, b:].T @ E
    out = np.empty_like(Q)
    out[order] = Q
    return out
