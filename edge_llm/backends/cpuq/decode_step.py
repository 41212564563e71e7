"""`OrtDecodeStep`: runs the decode graph (decode_export.py) with the KV rows bound in place.

Every call binds the rows' embeddings, their cos/sin and, per layer, the cache's K and V rows
[0, S) (contiguous views of `KVCache` rows) straight into onnxruntime by pointer (`IOBinding`): no
cached row is copied. The outputs are bound to arrays owned here and reused by every call: the
logits rows and the new K/V rows of each layer, which the model writes into the cache with
`KVCache.write` right after the call (the graph only reads rows; `KVCache` stays their one
writer). A call takes 1 to `max_rows` rows (a decode step, or a speculative verify forward).
Nothing here imports onnxruntime at module import time.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from edge_llm.backends import kernels
from edge_llm.backends.graph.schema import decode_kv_names
from edge_llm.backends.graph.runners import open_session, session_options
from edge_llm.config import ModelArgs
from edge_llm.errors import ConfigError


MAX_ROWS = 16  # rows per call: a verify forward of up to 15 drafted tokens (settings: draft_max)


class OrtDecodeStep:
    """Up to `max_rows` rows through every layer and the head in one onnxruntime call (a `RowStep`)."""

    def __init__(self, onnx_path: Path, args: ModelArgs, threads: int, config: Mapping[str, str] | None = None,
                 shared_arena: bool = False, max_rows: int = MAX_ROWS):
        try:
            import onnxruntime as ort
        except ImportError:
            raise ConfigError("onnxruntime is not installed: pip install 'edge-llm[quant]'") from None
        opts = session_options(ort, threads, config, shared_arena)
        kernels.register(opts)
        self.session = open_session(ort, onnx_path, opts)
        n = args.num_hidden_layers
        self.names = [decode_kv_names(i) for i in range(n)]
        want = {"x", "cos", "sin"} | {t for names in self.names for t in names[:2]}
        have = {i.name for i in self.session.get_inputs()}
        if have != want:
            raise ConfigError(f"{onnx_path}: not a decode graph of this model (inputs {sorted(have)[:4]}..., "
                              f"expected {len(want)} for {n} layers): rebuild the graph directory")
        self.width = (args.hidden_size, args.head_dim // 2, args.kv_dim)
        self.max_rows = max_rows
        self.logits = np.empty((max_rows, args.vocab_size), np.float32)
        self.k_new = np.empty((n, max_rows, args.kv_dim), np.float32)
        self.v_new = np.empty((n, max_rows, args.kv_dim), np.float32)
        self.io = self.session.io_binding()
        self.bound_rows = 0  # the row count the outputs are bound for

    def _bind_outputs(self, T: int) -> None:
        """Bind the first T rows of the output buffers (contiguous: rows are the inner-most
        dimension but one) for calls of T rows."""
        self._bind_out("logits", self.logits[:T])
        for i, (_, _, kn, vn) in enumerate(self.names):
            self._bind_out(kn, self.k_new[i, :T])
            self._bind_out(vn, self.v_new[i, :T])
        self.bound_rows = T

    def _bind_out(self, name: str, arr: np.ndarray) -> None:
        self.io.bind_output(name, "cpu", 0, np.float32, list(arr.shape), arr.ctypes.data)

    def _bind_in(self, name: str, arr: np.ndarray, width: int) -> None:
        if arr.dtype != np.float32 or not arr.flags.c_contiguous or arr.ndim != 2 or arr.shape[1] != width:
            raise ValueError(f"decode input {name}: {arr.dtype}{list(arr.shape)}, "
                             f"expected C-contiguous float32[rows, {width}]")
        self.io.bind_input(name, "cpu", 0, np.float32, list(arr.shape), arr.ctypes.data)

    def __call__(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray,
                 past: Sequence[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """x (T, hidden), cos/sin (T, head_dim/2), past[l] = (K rows, V rows) (S, kv_dim), S >= 1 ->
        (logits (T, vocab), new K rows (n_layers, T, kv_dim), new V rows), views of buffers the
        next call reuses. Row t attends to the S past rows and new rows 0..t. The inputs must
        stay alive and unchanged until this returns."""
        hidden, half, kv = self.width
        T = x.shape[0]
        if not 1 <= T <= self.max_rows or len(past) != len(self.names):
            raise ValueError(f"decode: 1 to {self.max_rows} rows and {len(self.names)} layers, "
                             f"got {T} and {len(past)}")
        if cos.shape[0] != T or sin.shape[0] != T:
            raise ValueError(f"decode: cos/sin need {T} rows, got {cos.shape[0]} and {sin.shape[0]}")
        if T != self.bound_rows:
            self._bind_outputs(T)
        self._bind_in("x", x, hidden)
        self._bind_in("cos", cos, half)
        self._bind_in("sin", sin, half)
        for (kp, vp, _, _), (k, v) in zip(self.names, past):
            self._bind_in(kp, k, kv)
            self._bind_in(vp, v, kv)
        self.session.run_with_iobinding(self.io)
        return self.logits[:T], self.k_new[:, :T], self.v_new[:, :T]
