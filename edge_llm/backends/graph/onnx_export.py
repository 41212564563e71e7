"""Export the decoder's dense graphs (schema: `schema.py`) to ONNX with the `onnx` helper API.

Built from the same fused F32 arrays the CPU backend computes with (`cpu.backend.DenseLayer`), one
layer at a time, so peak memory is one layer (plus the head). Weights go to an external-data
file written straight from numpy (no protobuf copy, no 2 GB protobuf limit); onnxruntime and
rknn-toolkit2 both read it from beside the `.onnx` file.

How a linear layer is written is a parameter (`linear`): F32 `MatMul` here; a quantized
backend passes a function that writes e.g. `MatMulNBits` instead and reuses everything else.

How an RMSNorm is written is a parameter too (`norm`). Graphs for an fp16 NPU use
`rms_norm_fp16_op`, which scales each row by its own max |x| before squaring: real checkpoints
carry massive activations in a few residual channels (about 24,900 in SmolLM2-135M's first row
from layer 12 on),
whose squares overflow fp16's 65,504 in any plain form (docs/npu.md, "fp16 range"). F32 graphs
(cpu-q, docs/quantization.md) keep the shorter `rms_norm_op`.

The `onnx` package comes with the `convert` extra; nothing in the runtime imports this module
unless it exports graphs.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from edge_llm.backends.cpu.backend import CPUBackend, DenseLayer, load_layer, rms_norm
from edge_llm.backends.graph.schema import (
    DEFAULT_CHUNKS,
    HEAD,
    OPSET,
    OUTPUTS,
    POST,
    QKV,
    STEP,
    GraphSpec,
    graph_specs,
)
from edge_llm.backends.graph.manifest import GraphEntry, Manifest, sha256_files
from edge_llm.config import ModelArgs
from edge_llm.weights import Weights, load_weights

log = logging.getLogger(__name__)

EXTERNAL_MIN_BYTES = 1024  # smaller constants stay inside the .onnx file
_ALIGN = 4096  # external tensors start page-aligned (lets a runtime mmap them)
MS_DOMAIN = "com.microsoft"


class GraphBuilder:
    """Collects nodes and constants of one graph; big constants stream to `<name>.onnx.data`."""

    def __init__(self, name: str, data_path: Path):
        self.name = name
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[TensorProto] = []
        self.data_path = data_path
        self._data = open(data_path, "wb")
        self._n = 0

    def fresh(self, hint: str) -> str:
        self._n += 1
        return f"{hint}_{self._n}"

    def const(self, hint: str, arr: np.ndarray) -> str:
        """Add a constant (float32, int64 or uint8) and return its name."""
        arr = np.ascontiguousarray(arr)
        name = self.fresh(hint)
        if arr.nbytes < EXTERNAL_MIN_BYTES:
            self.inits.append(numpy_helper.from_array(arr, name))
            return name
        pad = -self._data.tell() % _ALIGN
        self._data.write(b"\0" * pad)
        offset = self._data.tell()
        arr.tofile(self._data)
        t = TensorProto()
        t.name, t.data_type = name, helper.np_dtype_to_tensor_dtype(arr.dtype)
        t.dims.extend(arr.shape)
        t.data_location = TensorProto.EXTERNAL
        for k, v in (("location", self.data_path.name), ("offset", str(offset)), ("length", str(arr.nbytes))):
            entry = t.external_data.add()
            entry.key, entry.value = k, v
        self.inits.append(t)
        return name

    def op(self, op_type: str, inputs: list[str], out: str | None = None, **attrs) -> str:
        out = out or self.fresh(op_type.lower())
        self.nodes.append(helper.make_node(op_type, inputs, [out], **attrs))
        return out

    def finish(self, spec: GraphSpec, path: Path) -> None:
        """Write the .onnx file (symbolic row dim "T"; static shapes are chosen at build time)."""
        self.write([(n, ["T", w]) for n, w in spec.inputs], [(n, ["T", w]) for n, w in spec.outputs], path)

    def write(self, inputs: list[tuple[str, list]], outputs: list[tuple[str, list]], path: Path,
              opset: int = OPSET) -> None:
        """Write the .onnx file: float32 inputs/outputs given as (name, shape), a dim may be a
        symbol ("T", "S")."""
        self._data.close()
        ins = [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs]
        outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in outputs]
        graph = helper.make_graph(self.nodes, self.name, ins, outs, self.inits)
        opsets = [helper.make_opsetid("", opset)]
        for domain in sorted({n.domain for n in self.nodes} - {"", "ai.onnx"}):  # MatMulNBits, AttnRow (cpu-q)
            opsets.append(helper.make_opsetid(domain, 1))
        model = helper.make_model(graph, opset_imports=opsets, producer_name="edge-llm")
        # 8: readable by onnx 1.12+ / onnxruntime 1.14+ / rknn-toolkit2; opset 23 needs 10
        model.ir_version = 8 if opset <= OPSET else 10
        path.write_bytes(model.SerializeToString())
        onnx.checker.check_model(str(path))  # by path: it checks the external data file too


# Which weight a linear call writes: (kind, index), kind in qkv/o/gate/up/down (index = layer)
# or head (index = part, the part's vocab range in `vocab`); lets a quantized `linear` find the
# weight's original blocks (GGUF) instead of re-quantizing the F32 values.
@dataclass(frozen=True)
class WeightKey:
    kind: str
    index: int
    vocab: tuple[int, int] = (0, 0)


# linear(g, x, w (in, out) F32, bias or None, out name or None, key) -> output name
Linear = Callable[[GraphBuilder, str, np.ndarray, "np.ndarray | None", "str | None", WeightKey], str]
# norm(g, x, weight (hidden,), eps) -> output name
Norm = Callable[[GraphBuilder, str, np.ndarray, float], str]


def f32_linear(g: GraphBuilder, x: str, w: np.ndarray, bias: np.ndarray | None = None,
               out: str | None = None, key: WeightKey | None = None) -> str:
    """x @ w (+ bias) as F32 MatMul."""
    y = g.op("MatMul", [x, g.const("w", w)], out=None if bias is not None else out)
    return g.op("Add", [y, g.const("b", bias)], out=out) if bias is not None else y


def rms_norm_op(g: GraphBuilder, x: str, weight: np.ndarray, eps: float) -> str:
    """weight * x / sqrt(mean(x^2) + eps), mean(x^2) taken as sum((x / sqrt(n))^2): for F32
    graphs; its squares overflow fp16 once a channel passes ~256 sqrt(n) (module doc)."""
    n = weight.shape[0]
    xs = g.op("Mul", [x, g.const("inv_sqrt_n", np.array(1.0 / np.sqrt(n), np.float32))])
    ss = g.op("ReduceSum", [g.op("Mul", [xs, xs]), g.const("axes", np.array([-1], np.int64))],
              keepdims=1)
    denom = g.op("Sqrt", [g.op("Add", [ss, g.const("eps", np.array(eps, np.float32))])])
    return g.op("Mul", [g.op("Div", [x, denom]), g.const("norm", weight)])


def row_absmax(g: GraphBuilder, x: str, n: int) -> str:
    """max |x| of each row, (T, 1), as GlobalMaxPool over (1, T, 1, n): rknn-toolkit2 2.5.0 keeps
    GlobalMaxPool on the NPU for every row count, while it places ReduceMax on the CPU."""
    grid = g.op("Reshape", [g.op("Abs", [x]), g.const("rows_grid", np.array([1, -1, 1, n], np.int64))])
    return g.op("Reshape", [g.op("GlobalMaxPool", [grid]), g.const("rows_col", np.array([-1, 1], np.int64))])


def rms_norm_fp16_op(g: GraphBuilder, x: str, weight: np.ndarray, eps: float) -> str:
    """The same RMSNorm with every intermediate inside fp16's range for any finite fp16 row, and
    every op on the RK3588 NPU (no CPU round trip inside the graph; docs/npu.md, "fp16 range").

    s = max|x| + F per row with F = sqrt(n eps); u = x / s, so |u| < 1 and sum(u^2) < n.
    sqrt(mean(x^2) + eps) = s * sqrt(mean(u^2) + (sqrt(eps) / s)^2) for any s > 0, and
    sqrt(eps) / s = (F / s) / sqrt(n) = (1 - max|u|) / sqrt(n): no division of a constant by a
    tensor, which the compiler would run on the CPU. out = weight * x / rms: x is divided by rms,
    not by s, so the ordinary channels of a row with a massive activation (|x| ~ 1 next to
    ~24,900) stay normal fp16 numbers instead of subnormals. A zero (padding) row gives 0."""
    n = weight.shape[0]
    s = g.op("Add", [row_absmax(g, x, n), g.const("floor", np.array(np.sqrt(n * eps), np.float32))])
    u = g.op("Div", [x, s])
    ss = g.op("ReduceSum", [g.op("Mul", [u, u]), g.const("axes", np.array([-1], np.int64))], keepdims=1)
    f = g.op("Sub", [g.const("one", np.array(1.0, np.float32)), row_absmax(g, u, n)])  # F / s
    t = g.op("Mul", [f, g.const("inv_sqrt_n", np.array(1.0 / np.sqrt(n), np.float32))])  # sqrt(eps) / s
    var = g.op("Add", [g.op("Mul", [ss, g.const("inv_n", np.array(1.0 / n, np.float32))]), g.op("Mul", [t, t])])
    rms = g.op("Mul", [g.op("Sqrt", [var]), s])
    return g.op("Mul", [g.op("Div", [x, rms]), g.const("norm", weight)])


def build_qkv(g: GraphBuilder, L: DenseLayer, eps: float, linear: Linear, norm: Norm, layer: int = 0,
              x: str = "x") -> None:
    linear(g, norm(g, x, L.in_norm, eps), L.w_qkv, L.b_qkv, OUTPUTS[QKV][0], WeightKey("qkv", layer))


def _post_deltas(g: GraphBuilder, L: DenseLayer, eps: float, linear: Linear, norm: Norm, layer: int,
                 outs: tuple[str | None, str | None], fuse_gate_up: bool = False) -> tuple[str, str]:
    """attn_out = attn @ Wo; mlp_out = SwiGLU(RMSNorm(x + attn_out)); returns both names.
    `fuse_gate_up`: one (hidden, 2 inter) linear + Split instead of two (fewer kernel launches)."""
    o = linear(g, "attn", L.w_o, None, outs[0], WeightKey("o", layer))
    hn = norm(g, g.op("Add", ["x", o]), L.post_norm, eps)
    inter = L.w_down.shape[0]
    if fuse_gate_up:
        gu = linear(g, hn, L.w_gu, None, None, WeightKey("gate_up", layer))
        gate, up = g.fresh("gate"), g.fresh("up")
        g.nodes.append(helper.make_node("Split", [gu, g.const("split", np.array([inter, inter], np.int64))],
                                        [gate, up], axis=1))
    else:
        gate = linear(g, hn, L.w_gu[:, :inter], None, None, WeightKey("gate", layer))
        up = linear(g, hn, L.w_gu[:, inter:], None, None, WeightKey("up", layer))
    act = g.op("Mul", [g.op("Mul", [gate, g.op("Sigmoid", [gate])]), up])  # SwiGLU
    return o, linear(g, act, L.w_down, None, outs[1], WeightKey("down", layer))


def build_post(g: GraphBuilder, L: DenseLayer, eps: float, linear: Linear, norm: Norm, layer: int = 0) -> None:
    _post_deltas(g, L, eps, linear, norm, layer, OUTPUTS[POST])


def build_step(g: GraphBuilder, L: DenseLayer, nxt: DenseLayer | None, eps: float, linear: Linear,
               norm: Norm, layer: int) -> None:
    """Fused step (schema.py): h = (x + attn_out) + mlp_out in float32, then the next layer's qkv."""
    o, m = _post_deltas(g, L, eps, linear, norm, layer, (None, None), fuse_gate_up=True)
    h_name, qkv_name = OUTPUTS[STEP]
    g.op("Add", [g.op("Add", ["x", o]), m], out=h_name)
    if nxt is not None:
        linear(g, norm(g, h_name, nxt.in_norm, eps), nxt.w_qkv, nxt.b_qkv, qkv_name,
               WeightKey("qkv", layer + 1))


def build_head(g: GraphBuilder, final_norm: np.ndarray, lm_rows: np.ndarray, eps: float, linear: Linear,
               norm: Norm, part: int = 0, vocab: tuple[int, int] = (0, 0)) -> None:
    """lm_rows: (vocab part, hidden) rows of lm_head."""
    linear(g, norm(g, "x", final_norm, eps), lm_rows.T, None, OUTPUTS[HEAD][0], WeightKey(HEAD, part, vocab))


@dataclass(frozen=True)
class Exported:
    """One exported graph: where its files are and the digest of their bytes."""

    spec: GraphSpec
    onnx: Path
    data: Path
    input_key: str  # sha256 of .onnx + .onnx.data bytes: what a compiled build is keyed by

    @property
    def nbytes(self) -> int:
        return self.onnx.stat().st_size + self.data.stat().st_size


def export_one(spec: GraphSpec, out_dir: Path, build: Callable[[GraphBuilder], None]) -> Exported:
    path = out_dir / f"{spec.name}.onnx"
    data = out_dir / f"{spec.name}.onnx.data"
    g = GraphBuilder(spec.name, data)
    build(g)
    g.finish(spec, path)
    return Exported(spec, path, data, sha256_files(path, data))


def write_probe(onnx_path: Path, probe: Path) -> dict[str, str]:
    """Write a copy of the graph at `probe` (beside it, so its external data resolves) whose
    outputs are every node's output, for the converter's range check (convert/calibration.py);
    returns {tensor name: op type} of the node outputs."""
    model = onnx.load(str(onnx_path), load_external_data=False)
    outs = {o.name for o in model.graph.output}
    ops = {}
    for node in model.graph.node:
        for name in node.output:
            ops[name] = node.op_type
            if name not in outs:
                model.graph.output.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, None))
    probe.write_bytes(model.SerializeToString())
    return ops


# samples(spec) -> the graph's inputs (float32, rows x width each) for the accuracy check
Samples = Callable[[GraphSpec], list[np.ndarray]]


def export_model(model_dir: str | Path, out_dir: str | Path, chunks: tuple[int, ...] | None = DEFAULT_CHUNKS,
                 layers: int | None = None, head_split: int = 1, linear: Linear = f32_linear,
                 samples: Samples | None = None, progress: Callable[[GraphSpec], None] | None = None,
                 fused: bool = False, unfused: int = 0, norm: Norm = rms_norm_fp16_op) -> list[Exported]:
    """Write every graph of `graph_specs(...)` to `out_dir` as `<name>.onnx` + `.onnx.data`.

    With `samples`, also writes `<name>.samples.npz`: the inputs `samples(spec)` gives and the
    CPU backend's F32 outputs for them (the reference the converter's accuracy report uses).
    `fused`: the qkv + step partition (schema.py); `chunks=None`: dynamic row counts; `norm`:
    how RMSNorm is written (the fp16-safe form unless the graphs stay F32).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    args = ModelArgs.from_dir(model_dir)
    weights = load_weights(model_dir, args)
    specs = graph_specs(args, chunks, layers, head_split, fused=fused, unfused=unfused)
    ref = CPUBackend()
    ref.setup(args)
    eps = float(args.rms_norm_eps)
    head: tuple[np.ndarray, np.ndarray] | None = None
    held: dict[int, DenseLayer] = {}  # layers read so far that a later graph still needs

    def layer(i: int) -> DenseLayer:
        if i not in held:
            held[i] = load_layer(args, weights, i)
        return held[i]

    done: list[Exported] = []
    for spec in specs:
        if progress:
            progress(spec)
        i = spec.index
        if spec.kind == QKV:
            L = layer(i)
            done.append(export_one(spec, out, lambda g: build_qkv(g, L, eps, linear, norm, i)))
            if samples is not None:
                ref.layers = [L]
                _write_samples(out, spec, samples, lambda x: [ref.qkv_fused(0, x)])
        elif spec.kind == POST:
            L = held.pop(i)
            done.append(export_one(spec, out, lambda g: build_post(g, L, eps, linear, norm, i)))
            if samples is not None:
                ref.layers = [L]
                _write_samples(out, spec, samples, lambda a, x: list(ref.post_deltas(0, a, x)))
        elif spec.kind == STEP:
            L, nxt = held.pop(i), (layer(i + 1) if len(spec.outputs) > 1 else None)
            done.append(export_one(spec, out, lambda g: build_step(g, L, nxt, eps, linear, norm, i)))
        else:
            if head is None:
                head = _head_tensors(args, weights)
            final_norm, lm = head
            lo, hi = spec.vocab
            rows = lm[lo:hi]
            done.append(export_one(spec, out, lambda g: build_head(g, final_norm, rows, eps, linear, norm, i, spec.vocab)))
            if samples is not None:
                _write_samples(out, spec, samples, lambda x: [rms_norm(x, final_norm, np.float32(eps)) @ rows.T])
        log.debug("exported %s (%.1f MB)", spec.name, done[-1].nbytes / 1e6)
    return done


def _head_tensors(args: ModelArgs, weights: Weights) -> tuple[np.ndarray, np.ndarray]:
    """Final norm and lm_head (vocab, hidden) (the embedding table when tied)."""
    p = args.weight_prefix
    lm = weights.pop(f"{p}embed_tokens.weight") if args.tie_word_embeddings else weights.pop(args.lm_head_name)
    return weights.pop(f"{p}norm.weight"), lm


def _write_samples(out: Path, spec: GraphSpec, samples: Samples, fn) -> None:
    xs = samples(spec)
    ys = fn(*xs)
    arrays = {f"in.{n}": x for (n, _), x in zip(spec.inputs, xs)}
    arrays |= {f"out.{n}": np.ascontiguousarray(y, dtype=np.float32) for (n, _), y in zip(spec.outputs, ys)}
    np.savez(out / f"{spec.name}.samples.npz", **arrays)


def export_graph_set(model_dir: str | Path, out_dir: str | Path, chunks: tuple[int, ...] | None = DEFAULT_CHUNKS,
                     layers: int | None = None, head_split: int = 1, samples: Samples | None = None,
                     progress: Callable[[GraphSpec], None] | None = None, linear: Linear = f32_linear,
                     fused: bool = False, unfused: int = 0, norm: Norm = rms_norm_fp16_op,
                     **manifest_fields) -> Manifest:
    """Export all graphs to `out_dir/onnx/` and write `out_dir/manifest.json` (ONNX part).

    The manifest identity hashes each graph's ONNX bytes, so another `linear` (e.g. quantized
    weights) gives another identity, and so another snapshot namespace. `manifest_fields`
    (target, dtype, build) describe graphs made for another runtime than the NPU."""
    root = Path(out_dir)
    exported = export_model(model_dir, root / "onnx", chunks, layers, head_split, linear=linear,
                            samples=samples, progress=progress, fused=fused, unfused=unfused, norm=norm)
    m = manifest_for(model_dir, root, exported, layers, head_split, **manifest_fields)
    m.write(root)
    return m


def manifest_for(model_dir: str | Path, root: Path, exported: list[Exported], layers: int | None, head_split: int,
                 **manifest_fields) -> Manifest:
    """The manifest of exported graphs (paths relative to `root`), not yet written."""
    from edge_llm.weights import weight_digest

    args = ModelArgs.from_dir(model_dir)
    entries = [GraphEntry(name=e.spec.name, kind=e.spec.kind, index=e.spec.index, rows=list(e.spec.rows),
                          inputs=[list(i) for i in e.spec.inputs], outputs=[list(o) for o in e.spec.outputs],
                          vocab=list(e.spec.vocab), onnx=str(e.onnx.relative_to(root)),
                          input_key=e.input_key, onnx_bytes=e.nbytes) for e in exported]
    return Manifest(model={"name": Path(model_dir).resolve().name, "model_type": args.model_type,
                           "weights_sha256": weight_digest(model_dir),
                           "config": json.loads(json.dumps(args.identity_fields()))},
                    chunks=list(exported[0].spec.rows), layers=layers or args.num_hidden_layers,
                    head_split=head_split, graphs=entries, **manifest_fields)
