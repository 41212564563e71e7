"""Backends run the dense per-layer work of the decoder; the model keeps the rest in numpy.

This package is the seam: the protocol below, `get_backend`, the cost profile every backend
declares (`cost.py`) and the choice `backend = auto` makes (`choice.py`). Each way of running the
decoder has a folder of its own: `cpu/` (numpy F32, the reference), `cpuq/` (4-bit weights on
onnxruntime), `npu/` (the RK3588 NPU: compiled graphs or int8 matmuls), with the graph family
cpu-q and the NPU graphs share in `graph/`, the vision tower's parts in `tower/` and the C
operator library in `kernels/` (docs/architecture.md, the module map).

The seam: a backend owns the weight matrices and computes norms + projections + MLP + lm_head.
The model owns everything that touches KV rows or positions (qk-norm, RoPE, attention over the
F32 cache) and sampling. All arrays crossing the seam are float32, C-contiguous, rows = tokens.

A layer is two calls: `qkv` (input RMSNorm + fused projections) and `post` (o_proj, residual,
post-attention RMSNorm, SwiGLU MLP, residual), which returns the new residual stream h and, when
the backend computed it in the same call, the next layer's q/k/v of that h (else None: the model
then calls `qkv`). The CPU backend runs `post` as its two steps `attn_out` + `mlp` and never
fuses. A graph backend (`graph/backend.py`: onnxruntime, the rknn simulator, the NPU) runs it as one
graph: a `post` graph returns the two deltas, which it adds to the F32 residual stream; cpu-q's
fused `step` graph returns h itself (added in F32 inside the graph) and, for most layers, the
next layer's qkv of it. Fusion is asked for, never inferred: the model passes `fuse_next=False`
when it will change h before the next layer (Qwen3-VL's DeepStack adds image features to image
rows), and the backend then returns None. Nothing is kept between calls.

A static-shape backend (an NPU running precompiled graphs) reports the chunk sizes it was built
for in `chunk_sizes`; the model prefills in one of those sizes and the backend pads a shorter
final chunk to its graph shape and drops the padded rows (one place: `schema.row_plan`). Every
method must be deterministic for identical inputs of identical shape: bit-exact KV restore
relies on it.

A backend may also offer a `row_step` (`RowStep`): a decode step of the whole decoder + head in
one call, reading the cached K/V rows in place and returning the new rows for the model to
write (backend cpu-q: cpuq/decode_step.py, docs/quantization.md; the matmul path: npu/matmul/row_step.py,
docs/npu.md). The model runs every one-row
forward with it (decode, and the last prompt token) and every decode forward of up to
`row_step.max_rows` rows (a speculative verify), and prompt chunks through the seam above; the
choice depends only on the row count and on whether the rows are a prompt's, so bit-exact
restore still holds.

Every backend states what a forward of T rows costs relative to one row (`forward_cost`, a
declared profile such as `cost.ForwardCost`, not a timing): speculative decoding drafts only
where the profile says a verify forward pays (docs/speculative.md), so its choices, and with them the output, never
depend on how fast this moment happens to be.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import numpy as np

from edge_llm.config import ModelArgs
from edge_llm.errors import ConfigError
from edge_llm.weights import Weights


QKVArrays = tuple[np.ndarray, np.ndarray, np.ndarray]  # q (T, q_dim), k, v (T, kv_dim) of one layer


class RowStep(Protocol):
    max_rows: int  # rows one call takes (a decode step is one; a verify forward more)

    def __call__(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray,
                 past: Sequence[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """T <= max_rows rows through every layer and the head. x (T, hidden) embeddings,
        cos/sin (T, head_dim/2) of their positions, past[l] = layer l's cached (K, V) rows [0, S),
        S >= 1, read in place and never written; row t attends to them and new rows 0..t ->
        (logits (T, vocab), new K (n_layers, T, kv_dim) rotated, new V), buffers the next call
        reuses."""


@runtime_checkable
class Backend(Protocol):
    name: str
    numerics: str  # goes into the snapshot identity: KV values depend on it
    chunk_sizes: tuple[int, ...]  # static chunk shapes the backend runs natively; () = any
    row_step: RowStep | None  # decode forwards in one call (see the module docstring), or None
    forward_cost: Callable[[int], float]  # rows -> cost relative to one row (see the module docstring)

    def load(self, args: ModelArgs, weights: Weights) -> None:
        """Take the dense tensors out of `weights` (pop them) and prepare them."""

    def embed(self, tokens: np.ndarray) -> np.ndarray:
        """(T,) token ids -> (T, hidden) embeddings."""

    def residual(self, rows: np.ndarray) -> np.ndarray:
        """(T, hidden) rows of the model's hidden space (image embeddings, DeepStack features)
        -> the same rows in the basis of this backend's residual stream (what `embed` returns and
        `post` keeps). The identity except for rotated w8a8 graphs (backends/graph/cpu_side.py)."""

    def qkv(self, layer: int, x: np.ndarray) -> QKVArrays:
        """input RMSNorm + q/k/v projections (+bias): (T, hidden) -> q (T, q_dim), k, v (T, kv_dim)."""

    def post(self, layer: int, attn: np.ndarray, x: np.ndarray,
             fuse_next: bool = True) -> tuple[np.ndarray, QKVArrays | None]:
        """The rest of the layer: h = x + attn @ Wo; h + MLP(RMSNorm(h)). attn (T, q_dim),
        x (T, hidden) -> (h (T, hidden), next); the residual additions happen in float32. next is
        layer + 1's (q, k, v) of this h when this call computed them (a fused graph), else None.
        `fuse_next=False`: the caller changes h before layer + 1, so next must be None."""

    def logits(self, x: np.ndarray) -> np.ndarray:
        """Final RMSNorm + lm_head: (T, hidden) -> (T, vocab)."""

    def close(self) -> None:
        """Release what the backend holds outside this process's heap (NPU contexts, the
        simulator's worker process). Called once at shutdown; nothing is called after it."""


def pick_chunk(backend: Backend, requested: int) -> int:
    """The prefill chunk size to use: `requested`, or the largest static size not above it."""
    if not backend.chunk_sizes:
        return requested
    fitting = [c for c in backend.chunk_sizes if c <= requested]
    return max(fitting) if fitting else min(backend.chunk_sizes)


def get_backend(name: str) -> Backend:
    """Instantiate a backend by name ("cpu"); `cpu-q` and `rknn` need a model or graph directory:
    `cpuq.backend.open_cpu_q`, `npu.backend.open_rknn` (both built by `runtime.make_backend`)."""
    if name == "cpu":
        from edge_llm.backends.cpu.backend import CPUBackend

        return CPUBackend()
    raise ConfigError(f"backend {name!r} is not available (available: cpu)")
