"""Real activations for the converter: every graph's inputs captured from the F32 model on a
calibration text, and the range of every tensor of every graph on them (docs/npu.md, "fp16 range").

1. `capture`: the CPU backend runs the whole model on the calibration tokens (a chat-formatted
   text, so the first rows are the attention-sink tokens that carry a checkpoint's massive
   activations) behind a recording wrapper of the backend seam: what `qkv`, `post` and `logits`
   are called with is exactly what the graphs get at run time.
2. `tensor_ranges`: onnxruntime (F32) runs each exported graph on those inputs with every node's
   output exposed, so the max |value| of inputs, intermediates and outputs is measured, not
   modelled. An fp16 NPU stores every one of them in fp16 (matmuls accumulate wider inside).
3. `check_ranges`: a tensor above FP16_MAX / HEADROOM fails the conversion with its graph,
   tensor and op named; the accuracy table is then computed on the same real inputs
   (`Capture.samples`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edge_llm.backends.cpu.backend import CPUBackend
from edge_llm.backends.graph.schema import HEAD, POST, QKV, GraphSpec, capture_key, layer_name
from edge_llm.backends.graph.manifest import Manifest
from edge_llm.backends.graph.onnx_export import Samples
from edge_llm.config import ModelArgs
from edge_llm.convert.report import FP16_MAX, worst_tensor
from edge_llm.errors import ConfigError, EdgeLLMError
from edge_llm.convert.calibration_text import CALIB_TOKENS, CALIBRATION_TEXT
from edge_llm.weights import Weights

log = logging.getLogger(__name__)

HEADROOM = 2.0  # a tensor must stay below FP16_MAX / HEADROOM on the calibration text
_SEED = 4321
RANDOM_TOKENS = 256  # a model without a tokenizer (tiny test models) calibrates on this many random ids


class RangeError(EdgeLLMError):
    """A graph's tensor leaves fp16's range on real activations."""


class _Recorder:
    """The CPU backend behind the seam, keeping a copy of every graph input it is called with."""

    name, numerics, chunk_sizes, row_step = "cpu", "cpu-f32", (), None

    def __init__(self) -> None:
        self.cpu = CPUBackend()
        self.seen: dict[str, list[np.ndarray]] = {}

    def _keep(self, key: str, *arrays: np.ndarray) -> None:
        self.seen[key] = [np.array(a, dtype=np.float32) for a in arrays]

    def load(self, args: ModelArgs, weights: Weights) -> None:
        self.cpu.load(args, weights)

    def embed(self, tokens: np.ndarray) -> np.ndarray:
        return self.cpu.embed(tokens)

    def residual(self, rows: np.ndarray) -> np.ndarray:
        return self.cpu.residual(rows)

    def qkv(self, layer: int, x: np.ndarray):
        self._keep(layer_name(layer, QKV), x)
        return self.cpu.qkv(layer, x)

    def post(self, layer: int, attn: np.ndarray, x: np.ndarray, fuse_next: bool = True):
        self._keep(layer_name(layer, POST), attn, x)
        return self.cpu.post(layer, attn, x, fuse_next)

    def logits(self, x: np.ndarray) -> np.ndarray:
        self._keep(HEAD, x)
        return self.cpu.logits(x)

    def close(self) -> None:
        self.cpu.close()


@dataclass
class Capture:
    """The graphs' real inputs: `inputs[capture_key(spec)]` in the spec's input order."""

    source: str  # what the tokens are (for the report)
    tokens: int
    inputs: dict[str, list[np.ndarray]]

    def for_spec(self, spec: GraphSpec, rows: int | None = None) -> list[np.ndarray]:
        return [np.ascontiguousarray(a[:rows]) for a in self.inputs[capture_key(spec)]]

    def samples(self) -> Samples:
        """The accuracy check's inputs: the first max(shape) rows (row 0 is the first token)."""
        return lambda spec: self.for_spec(spec, max(spec.rows) if spec.rows else None)


def calibration_ids(model_dir: str | Path, text: str | None = None, tokens: int = CALIB_TOKENS) -> tuple[list[int], str]:
    """The calibration tokens and what they are: `text` (default: the built-in calibration text,
    `calibration_text.py`, which the accuracy benchmarks' text is not part of) as a
    user message in the model's chat template, cut to `tokens`; fixed random ids for a model
    without a tokenizer (tiny test models)."""
    from edge_llm.tokenizer import Tokenizer

    try:
        tok = Tokenizer.from_dir(model_dir)
    except EdgeLLMError:
        tok = None
    if tok is None:
        vocab = ModelArgs.from_dir(model_dir).vocab_size
        n = min(tokens, RANDOM_TOKENS)
        ids = np.random.default_rng(_SEED).integers(0, vocab, n).tolist()
        return ids, f"{n} fixed random token ids (the model has no tokenizer)"
    body = text if text is not None else CALIBRATION_TEXT
    try:
        ids = tok.apply_chat_template_ids([{"role": "user", "content": body}])
        how = "as a chat user message"
    except EdgeLLMError:
        ids, how = tok.encode(body), "as plain text (no chat template)"
    what = "the built-in calibration text" if text is None else "the given text"
    if len(ids) < 8:
        raise ConfigError(f"calibration text gives {len(ids)} tokens: give a longer text")
    return ids[:tokens], f"{min(tokens, len(ids))} tokens of {what} {how}"


def capture(model_dir: str | Path, ids: Sequence[int], source: str) -> Capture:
    """Run the F32 model on `ids` in one chunk and keep every graph's inputs. Loads the whole
    F32 model (4 bytes per weight) for as long as the forward takes."""
    from edge_llm.models.qwen3 import Model

    rec = _Recorder()
    try:
        model = Model.load(model_dir, backend=rec)
        model.forward(np.asarray(ids, dtype=np.int64), model.new_cache(len(ids), check_memory=False),
                      all_logits=True)
    finally:
        rec.close()
    log.info("calibration: %d graph inputs captured from %s", len(rec.seen), source)
    return Capture(source, len(ids), rec.seen)


def tensor_ranges(onnx_path: Path, spec: GraphSpec, inputs: Sequence[np.ndarray]) -> dict:
    """Max |value| of every input, node output and graph output of one exported graph on
    `inputs`, run by onnxruntime in F32: {"inputs": {name: max}, "outputs": {...},
    "intermediates": [[tensor, op, max], ...] largest first}."""
    import onnxruntime as ort

    from edge_llm.backends.graph.onnx_export import write_probe
    from edge_llm.backends.graph.runners import open_session, session_options

    probe = onnx_path.with_name(f".{onnx_path.stem}.ranges.onnx")
    ops = write_probe(onnx_path, probe)
    outs = {n for n, _ in spec.outputs}
    try:
        opts = session_options(ort, max(1, min(4, os.cpu_count() or 1)))
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # keep every node
        sess = open_session(ort, probe, opts)
        names = [o.name for o in sess.get_outputs()]
        values = sess.run(names, {n: x for (n, _), x in zip(spec.inputs, inputs)})
    finally:
        probe.unlink(missing_ok=True)
    amax = {n: float(np.max(np.abs(v))) if np.size(v) else 0.0 for n, v in zip(names, values)}
    return {"inputs": {n: float(np.max(np.abs(x))) for (n, _), x in zip(spec.inputs, inputs)},
            "outputs": {n: amax[n] for n, _ in spec.outputs},
            "intermediates": sorted(([n, ops[n], v] for n, v in amax.items() if n not in outs),
                                    key=lambda t: -t[2])}


def record_ranges(m: Manifest, root: Path, cap: Capture | Callable[[GraphSpec], list[np.ndarray]],
                  progress: Callable[[int, str], None] = lambda _i, _n: None) -> dict[str, dict]:
    """`tensor_ranges` of every graph of `m` (ONNX under `root`) on the captured inputs (or on
    what `cap(spec)` gives: graphs whose inputs the CPU derives from them, convert/w8a8.py),
    stored in each graph's `ranges`; returns {graph name: ranges} for `check_ranges`."""
    inputs_for = cap.for_spec if isinstance(cap, Capture) else cap
    for i, g in enumerate(m.graphs):
        progress(i, g.name)
        g.ranges = tensor_ranges(root / g.onnx, g.spec(), inputs_for(g.spec()))
    return {g.name: g.ranges for g in m.graphs}


def check_ranges(ranges: dict[str, dict], headroom: float = HEADROOM) -> None:
    """Raise RangeError naming every graph whose largest tensor passes FP16_MAX / headroom."""
    limit = FP16_MAX / headroom
    bad = []
    for name, r in ranges.items():
        where, v = worst_tensor(r)
        if not np.isfinite(v) or v > limit:
            bad.append(f"{name}: {where} reaches {v:.4g}")
    if bad:
        raise RangeError(f"{len(bad)} graph(s) leave fp16's range on real activations (limit {limit:.0f} = "
                         f"{FP16_MAX:.0f} / headroom {headroom:g}): " + "; ".join(bad[:8])
                         + (f"; ... ({len(bad) - 8} more)" if len(bad) > 8 else "")
                         + ". The fp16 graphs would compute inf/NaN or lose the answer: see report.md and "
                         "docs/npu.md ('fp16 range')")
