"""`OrtDecodeStep`: a one-row step as the n + 1 decode graphs with the C attention kernel between.

Every graph's inputs and outputs are bound once, by pointer (`IOBinding`), to arrays owned here:
the token's embedding row and cos/sin (copied in per call), the residual stream per layer, the
query row, the attention output, and per layer the new K/V row that the model writes into the
cache with `KVCache.write` right after the call (graphs and kernel only read rows; `KVCache`
stays their one writer). Per layer: graph LL (-> q, new K/V row), then the kernel over the
cache's rows [0, S) in place plus the new row (-> attn), which graph LL+1 reads. Nothing here
imports onnxruntime at module import time.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from edge_llm.backends.attn_kernel import AttnKernel
from edge_llm.backends.graphs import decode_specs
from edge_llm.backends.runners import open_session, session_options
from edge_llm.config import ModelArgs
from edge_llm.errors import ConfigError


class OrtDecodeStep:
    """One row through every layer and the head (a `RowStep`); `files[name]` per decode graph."""

    def __init__(self, files: Mapping[str, Path], args: ModelArgs, threads: int, kernel: AttnKernel,
                 config: Mapping[str, str] | None = None, shared_arena: bool = False):
        try:
            import onnxruntime as ort
        except ImportError:
            raise ConfigError("onnxruntime is not installed: pip install 'edge-llm[quant]'") from None
        n = args.num_hidden_layers
        self.n, self.kernel, self.width = n, kernel, (args.hidden_size, args.head_dim // 2, args.kv_dim)
        opts = session_options(ort, threads, config, shared_arena)
        self.x = np.zeros((1, args.hidden_size), np.float32)
        self.cos = np.zeros((1, args.head_dim // 2), np.float32)
        self.sin = np.zeros_like(self.cos)
        self.h = np.zeros((n, 1, args.hidden_size), np.float32)  # residual stream entering layer l+1's graph
        self.q = np.zeros((1, args.q_dim), np.float32)
        self.attn = np.zeros((1, args.q_dim), np.float32)
        self.logits = np.zeros((1, args.vocab_size), np.float32)
        self.k_new = np.zeros((n, 1, args.kv_dim), np.float32)
        self.v_new = np.zeros((n, 1, args.kv_dim), np.float32)
        self.sessions, self.bindings = [], []
        for spec in decode_specs(args):
            if spec.name not in files:
                raise ConfigError(f"no decode graph {spec.name} in the graph directory: rebuild it")
            path = files[spec.name]
            sess = open_session(ort, path, opts)
            have = {i.name for i in sess.get_inputs()} | {o.name for o in sess.get_outputs()}
            want = {t for t, _ in spec.inputs} | {t for t, _ in spec.outputs}
            if have != want:
                raise ConfigError(f"{path}: not the decode graph {spec.name} of this model (tensors "
                                  f"{sorted(have)}, expected {sorted(want)}): rebuild the graph directory")
            io = sess.io_binding()
            l = spec.index
            arrays = {"x": self.x, "cos": self.cos, "sin": self.sin, "attn": self.attn, "q": self.q,
                      "logits": self.logits}
            if l > 0:
                arrays["h"] = self.h[l - 1] if l > 1 else self.x
            if l < n:
                arrays |= {"knew": self.k_new[l], "vnew": self.v_new[l]}
                if l > 0:
                    arrays["h_out"] = self.h[l]
            for t, _ in spec.inputs:
                a = arrays[t]
                io.bind_input(t, "cpu", 0, np.float32, list(a.shape), a.ctypes.data)
            for t, _ in spec.outputs:
                a = arrays[t]
                io.bind_output(t, "cpu", 0, np.float32, list(a.shape), a.ctypes.data)
            self.sessions.append(sess)
            self.bindings.append(io)

    def __call__(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray,
                 past: Sequence[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """x (1, hidden), cos/sin (1, head_dim/2), past[l] = (K rows, V rows) (S, kv_dim), S >= 1 ->
        (logits (1, vocab), new K rows (n_layers, 1, kv_dim), new V rows), the last three reused
        by the next call. The inputs must stay unchanged until this returns."""
        hidden, half, kv = self.width
        if x.shape != (1, hidden) or cos.shape != (1, half) or sin.shape != (1, half) or len(past) != self.n:
            raise ValueError(f"decode: one row of {hidden}, cos/sin of {half} and {self.n} layers, got "
                             f"{list(x.shape)}, {list(cos.shape)} and {len(past)}")
        self.x[:] = x
        self.cos[:] = cos
        self.sin[:] = sin
        for layer, (k, v) in enumerate(past):
            self.sessions[layer].run_with_iobinding(self.bindings[layer])
            self.kernel(self.q, k, v, self.k_new[layer], self.v_new[layer], self.attn)
        self.sessions[self.n].run_with_iobinding(self.bindings[self.n])
        return self.logits, self.k_new, self.v_new
