"""GPTQ's calibration inputs, and its int8 grid for the matmul path (docs/npu.md, "The matmul path").

Rounding each weight to its nearest int8 step (RTN) leaves an error the next layers amplify; on
the default model RTN weights alone cost KL 0.0035 against F32 (docs/npu.md). GPTQ (Frantar et
al. 2022) quantizes one input row of W (K, N) at a time and moves its rounding error onto the rows
not yet quantized, weighted by the inverse Hessian H = X^T X of the layer's real inputs X, so the
layer's output on inputs like X changes least. For the int8 path the scales stay per output channel
and are fixed before (absmax or the MSE clip), so the engine and the run-time code do not change.
The solver itself is `backends/gptq.py` (cpu-q's 4-bit blocks use it too).

`capture` runs the F32 CPU backend over calibration tokens (`calibration_text.py`, not the
accuracy text) and keeps, per layer, the rows each int8 matmul will read, unrotated and with
unit-gain norms: the converter rotates them into its basis (`convert/npu_mm.py`). `CpuqInputs`
hands cpu-q's build the same rows with the norm gains applied, as its weights read them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np

from edge_llm.backends.cpu.backend import CPUBackend, rms_norm, swiglu
from edge_llm.backends.gptq import factor, hessian, solve
from edge_llm.backends.npu.matmul.int8 import QMAX

log = logging.getLogger(__name__)

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


class _Int8Grid:
    """Per output channel symmetric int8 on fixed scales: the matmul path's grid."""

    group = 0

    def __init__(self, shape: tuple[int, int], scale: np.ndarray):
        self.s = np.asarray(scale, np.float32)
        self.q = np.empty(shape, np.int8)

    def begin(self, k: int, rows: np.ndarray) -> None:
        pass

    def round(self, k: int, row: np.ndarray) -> np.ndarray:
        q = np.clip(np.rint(row / self.s), -QMAX, QMAX)
        self.q[k] = q
        return q * self.s


def gptq(w: np.ndarray, x: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """W (K, N) float32, X (T, K) its real input rows, scale (N,) per output channel -> int8
    (K, N) on the grid `scale`, rows quantized in act order with the error compensation above."""
    grid = _Int8Grid(w.shape, scale)
    solve(w, factor(hessian(x), act_order=True), grid)
    return grid.q


CPUQ_TOKENS = 512  # cpu-q's calibration tokens (docs/quantization.md, "GPTQ for re-quantized weights")
_CAPTURED = {"qkv": "qkv", "o": "o", "gate_up": "gu", "gate": "gu", "up": "gu", "down": "down", "head": "head"}


class CpuqInputs:
    """cpu-q's `nbits.Calibration`: the F32 model's rows on `tokens` calibration tokens, captured
    on first use (a model whose weights are all exact GGUF blocks never runs it), handed out as
    Hessians of the rows each weight reads: the norm gains applied (cpu-q's weights do not hold
    them). Holds the captured rows until their weight asked (4 bytes per row element). `refusal`:
    asked before the capture, which holds the F32 model; a reason (the memory it would need does not
    fit, runtime.py) skips it, and every weight it was for is rounded to nearest."""

    def __init__(self, model_dir: str | Path, tokens: int = CPUQ_TOKENS,
                 layers_done: Callable[[int, int], None] | None = None,
                 refusal: Callable[[], str | None] | None = None):
        self.model_dir, self.tokens, self.layers_done, self.refusal = Path(model_dir), tokens, layers_done, refusal
        self._seen: dict[tuple[int, str], np.ndarray] | None = None
        self._gains: dict[tuple[int, str], np.ndarray] = {}
        self._last: tuple[tuple[int, str], np.ndarray] | None = None  # gate and up read the same rows

    def _capture(self) -> None:
        from edge_llm.config import ModelArgs
        from edge_llm.weights import load_weights

        why = self.refusal() if self.refusal is not None else None
        if why is not None:
            log.warning("GPTQ calibration skipped: %s; the weights without exact GGUF blocks are rounded to nearest "
                        "(docs/quantization.md, \"GPTQ for re-quantized weights\")", why)
            self._seen = {}
            return
        self._seen = capture(self.model_dir, calibration_ids(self.model_dir, self.tokens), self.layers_done)
        args = ModelArgs.from_dir(self.model_dir)
        weights, p = load_weights(self.model_dir, args), args.weight_prefix  # mapped: only the gains are read
        for i in range(args.num_hidden_layers):
            for kind, norm in (("qkv", "input_layernorm"), ("gu", "post_attention_layernorm")):
                self._gains[(i, kind)] = np.asarray(weights[f"{p}layers.{i}.{norm}.weight"], np.float32)
        self._gains[(-1, "head")] = np.asarray(weights[f"{p}norm.weight"], np.float32)

    def hessian(self, kind: str, layer: int) -> np.ndarray | None:
        if self._seen is None:
            self._capture()
        key = (-1, "head") if kind == "head" else (layer, _CAPTURED.get(kind, ""))
        if self._last is None or self._last[0] != key:
            x = self._seen.pop(key, None)
            if x is None:
                return None
            if key in self._gains:
                x = x * self._gains[key][None, :]
            self._last = key, hessian(x)
        return self._last[1]
