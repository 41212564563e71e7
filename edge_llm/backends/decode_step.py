"""`OrtDecodeStep`: runs the one-row decode graph (decode_export.py) with the KV rows bound in place.

Every call binds the token's embedding row, its cos/sin and, per layer, the cache's K and V rows
[0, S) (contiguous views of `KVCache` rows) straight into onnxruntime by pointer (`IOBinding`): no
cached row is copied. The outputs are bound to arrays owned here and reused by every call: the
logits row and the new K/V row of each layer, which the model writes into the cache with
`KVCache.write` right after the call (the graph only reads rows; `KVCache` stays their one
writer).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from edge_llm.config import ModelArgs
from edge_llm.errors import ConfigError

log = logging.getLogger(__name__)

DECODE_GRAPH = "decode"


def _kv_names(layer: int) -> tuple[str, str, str, str]:
    # the schema lives in decode_export.kv_names (which imports onnx): keep the two in step
    return f"k{layer:02d}", f"v{layer:02d}", f"knew{layer:02d}", f"vnew{layer:02d}"


class OrtDecodeStep:
    """One token through every layer and the head, in one onnxruntime call (a `RowStep`)."""

    def __init__(self, onnx_path: Path, args: ModelArgs, threads: int, config: dict[str, str]):
        try:
            import onnxruntime as ort
        except ImportError:
            raise ConfigError("onnxruntime is not installed: pip install 'edge-llm[quant]'") from None
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
        opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        opts.log_severity_level = 3
        for k, v in config.items():
            opts.add_session_config_entry(k, v)
        self.session = ort.InferenceSession(str(onnx_path), opts, providers=["CPUExecutionProvider"])
        self.n_layers, self.kv_dim = args.num_hidden_layers, args.kv_dim
        self.half = args.head_dim // 2
        self.logits = np.empty((1, args.vocab_size), np.float32)
        self.k_new = np.empty((self.n_layers, 1, self.kv_dim), np.float32)
        self.v_new = np.empty((self.n_layers, 1, self.kv_dim), np.float32)
        self.io = self.session.io_binding()
        self._bind_out("logits", self.logits)
        self.names = [_kv_names(i) for i in range(self.n_layers)]
        for i, (_, _, kn, vn) in enumerate(self.names):
            self._bind_out(kn, self.k_new[i])
            self._bind_out(vn, self.v_new[i])

    def _bind_out(self, name: str, arr: np.ndarray) -> None:
        self.io.bind_output(name, "cpu", 0, np.float32, list(arr.shape), arr.ctypes.data)

    def _bind_in(self, name: str, arr: np.ndarray) -> None:
        if arr.dtype != np.float32 or not arr.flags.c_contiguous:
            raise ValueError(f"decode input {name} must be C-contiguous float32")
        self.io.bind_input(name, "cpu", 0, np.float32, list(arr.shape), arr.ctypes.data)

    def __call__(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray,
                 past: Sequence[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """x (1, hidden), cos/sin (1, head_dim/2), past[l] = (K rows, V rows) (S, kv_dim) ->
        (logits (1, vocab), new K rows (n_layers, 1, kv_dim), new V rows), the last two reused by
        the next call. The inputs must stay alive and unchanged until this returns."""
        self._bind_in("x", x)
        self._bind_in("cos", cos)
        self._bind_in("sin", sin)
        for (kp, vp, _, _), (k, v) in zip(self.names, past):
            self._bind_in(kp, k)
            self._bind_in(vp, v)
        self.session.run_with_iobinding(self.io)
        return self.logits, self.k_new, self.v_new
