"""`edge-llm convert rknn`: HF model directory -> ONNX graphs -> fp16 `.rknn` for the RK3588 NPU.

Two processes, because the toolkit cannot share a venv with the runtime (rknn-toolkit2 2.5.0
pins numpy 1.26, onnx <= 1.18, protobuf 4.25 and imports torch; docs/npu.md):
1. here, in the runtime venv: run the F32 model on a calibration text and keep every graph's
   real inputs (`calibration.py`); export every graph to ONNX from the F32 weights, one layer at
   a time, with those inputs and the CPU backend's reference outputs (`onnx_export.py`); measure
   every tensor's range on them in onnxruntime and refuse graphs that would leave fp16's range;
2. a `toolkit_worker.py` process in the converter venv: build each graph (all static shapes in
   one `.rknn` via `dynamic_input`), record the compiler's per-op cycle table, run the
   simulator on the samples and compare with the reference.
Builds are content-addressed: `rknn/<graph>-<key>.rknn` with key = sha256 of the ONNX bytes,
the build options and the toolkit version. An unchanged graph is not rebuilt, which also keeps
the manifest identity (and so the snapshot namespace) stable across re-runs.

OUT_DIR is published whole (`files.publish_dir`; docs/npu.md, "Publication"): built beside it as
`.tmp-<name>-*`, every file fsynced, then renamed in, so a killed conversion leaves the old OUT_DIR
or none. The old directory's builds that verify against its manifest (and a subdirectory's, the
vision tower's) are hard-linked into the new one first, and so reused. A refused range check
publishes nothing; its report goes to `<OUT_DIR>.refused.md` beside it (`refused_report`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import resource
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from edge_llm.backends.graph.schema import HEAD_N, MLP, QKV_N, O
from edge_llm.backends.graph.manifest import MANIFEST, GraphEntry, Manifest
from edge_llm.backends.graph.onnx_export import export_graph_set
from edge_llm.backends.npu.graphs.sim import ToolkitWorker, compile_request
from edge_llm.convert import calibration as C
from edge_llm.convert.report import markdown_report
from edge_llm.config import ModelArgs
from edge_llm.errors import ConfigError, EdgeLLMError
from edge_llm.files import fsync_tree, publish_dir, write_atomic
from edge_llm.safetext import printable

log = logging.getLogger(__name__)

# progress(phase, graph name, index, total)
Progress = Callable[[str, str, int, int], None]


DTYPES = ("float16", "w8a8")
ALGORITHMS = ("normal", "mmse", "kl_divergence")  # rknn-toolkit2's quantized_algorithm
METHODS = ("channel", "layer")  # its quantized_method (weights: per channel or per tensor)
MIN_COSINE = 0.99  # a w8a8 graph below this mean per-row cosine on calibration rows is built fp16
MAX_SAMPLES = 64  # calibration samples (of the largest shape) per graph
W8A8_KINDS = (QKV_N, O, MLP, HEAD_N)  # the graph kinds of the w8a8 partition (`--w8a8-fp16` picks from them)


def build_key(entry: GraphEntry, toolkit: str, target: str, dtype: str, quant: dict | None = None) -> str:
    q = None if quant is None else {k: v for k, v in quant.items() if k != "dataset"}
    if quant is not None:  # the calibration inputs are part of what the build is made from
        q["dataset_sha256"] = hashlib.sha256(Path(quant["dataset"]).read_bytes()).hexdigest()
    doc = [entry.input_key, entry.rows, entry.inputs, entry.outputs, toolkit, target, dtype] + ([q] if q else [])
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def peak_rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# the most F32 weight bytes of one head graph: the head is built at two shapes (schema.head_rows),
# and rknn-toolkit2 2.5.0's dynamic-shape save failed on Qwen3-VL-2B's whole head (1.24 GB of F32:
# an onnx checker error inside save_dynamic_shape_onnx) and built its quarters (311 MB each)
HEAD_PART_BYTES = 320_000_000


def head_parts(args: ModelArgs) -> int:
    """The default `head_split`: parts of at most HEAD_PART_BYTES of F32 weights (Qwen3-VL-2B: 4,
    the default model: 1)."""
    return max(1, -(-args.vocab_size * args.hidden_size * 4 // HEAD_PART_BYTES))


def convert_rknn(model_dir: str | Path, out_dir: str | Path, chunks: tuple[int, ...], layers: int | None = None,
                 head_split: int | None = None, converter_python: str | None = None, accuracy: bool = True,
                 progress: Progress | None = None, calib_text: str | None = None,
                 calib_tokens: int = C.CALIB_TOKENS, headroom: float = C.HEADROOM, dtype: str = "float16",
                 algorithm: str = "normal", method: str = "channel", min_cosine: float = MIN_COSINE,
                 rotation: str = "hadamard", fp16_kinds: tuple[str, ...] = (),
                 tower: Callable[[Path], object] | None = None) -> Manifest:
    """Calibrate + export + range-check + build every graph; write manifest.json and report.md;
    publish OUT_DIR whole (module docstring). Returns the manifest. Raises `calibration.RangeError`
    (after writing `refused_report(out_dir)`, publishing nothing) when a graph's tensor passes
    FP16_MAX / headroom on the calibration text, before any build. `tower(new_dir)`: more built
    into the new directory before it is published (the CLI's vision tower).
    `dtype="w8a8"`: the norms-on-the-CPU graphs (`convert/w8a8.py`) quantized by the toolkit
    (`algorithm`, `method`) on the calibration activations; a graph whose mean per-row cosine on
    them stays below `min_cosine` is built fp16 instead; `rotation` "hadamard" rotates the residual
    stream's basis first (`w8a8.orthogonal`); graphs of a kind in `fp16_kinds` (of `W8A8_KINDS`)
    are built fp16 outright (a hybrid: docs/npu.md "w8a8"). `head_split` None: `head_parts`."""
    from edge_llm.convert.w8a8 import ROTATIONS

    if dtype not in DTYPES or algorithm not in ALGORITHMS or method not in METHODS or rotation not in ROTATIONS:
        raise ValueError(f"dtype {dtype!r}, algorithm {algorithm!r}, method {method!r}, rotation {rotation!r}")
    if not set(fp16_kinds) <= set(W8A8_KINDS):
        raise ConfigError(f"--w8a8-fp16 {','.join(fp16_kinds)}: graph kinds are {', '.join(W8A8_KINDS)}")
    if head_split is None:
        head_split = head_parts(ModelArgs.from_dir(model_dir))
    target = Path(out_dir).resolve()  # the toolkit worker runs in a directory of its own
    check_target(target)
    refused = refused_report(target)

    def build(out: Path) -> Manifest:  # the new directory beside the target; publish_dir renames it in
        carry_builds(target, out)
        try:
            m = _convert_into(model_dir, out, chunks, layers, head_split, converter_python, accuracy, progress,
                              calib_text, calib_tokens, headroom, dtype, algorithm, method, min_cosine, rotation,
                              fp16_kinds)
        except C.RangeError as e:
            write_atomic(refused, (out / "report.md").read_text())
            raise C.RangeError(f"{e}; the report: {refused}") from None
        if tower is not None:
            tower(out)
        fsync_tree(out)
        return m

    m = publish_dir(target, build, lambda _target: None)
    refused.unlink(missing_ok=True)  # an earlier refusal's report no longer describes OUT_DIR
    return m


def refused_report(out_dir: str | Path) -> Path:
    """Where a conversion refused by the range check leaves its report: beside OUT_DIR, which it
    does not publish."""
    out = Path(out_dir)
    return out.parent / f"{out.name}.refused.md"


def check_target(out: Path) -> None:
    """OUT_DIR may be absent, empty or an earlier `convert rknn` output: publishing replaces the
    whole directory, so one holding anything else is refused before any work."""
    if not out.exists():
        return
    if not out.is_dir():
        raise ConfigError(f"{printable(str(out))} is not a directory: choose a directory (it is replaced as a whole)")
    if not any(out.iterdir()):
        return
    try:
        Manifest.read(out)
    except (EdgeLLMError, OSError, ValueError) as e:
        raise ConfigError(f"{printable(str(out))} is not an earlier `convert rknn` output ({e}): the directory is "
                          "replaced as a whole; choose an empty or new directory") from None


def carry_builds(old: Path, new: Path) -> int:
    """Hard-link (else copy) into `new` the `.rknn` builds of `old` and of its subdirectories with a
    manifest (the vision tower's) whose bytes match their manifest's sha256 and whose build record
    names the same digest: `build_graph` then reuses them. Anything that does not verify is left
    behind (built again). Returns how many builds were carried."""
    n = 0
    for man in (old / MANIFEST, *old.glob(f"*/{MANIFEST}")):
        root = man.parent
        try:
            m = Manifest.read(root)
        except (EdgeLLMError, OSError, ValueError):
            continue
        dest = new / root.relative_to(old)
        for g in m.graphs:
            if not g.rknn or not g.rknn_sha256:
                continue
            rec = root / (g.rknn + ".json")
            res = _cached(root / g.rknn, rec)
            if res is None or res.get("sha256") != g.rknn_sha256:
                log.info("%s: not reused (its bytes or record do not match %s)", g.rknn, man)
                continue
            for src in (root / g.rknn, rec):
                _link(src, dest / src.relative_to(root))
            n += 1
    return n


def _link(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)  # the same filesystem (beside the target): no bytes copied
    except OSError:
        shutil.copyfile(src, dst)


def _convert_into(model_dir, out: Path, chunks, layers, head_split, converter_python, accuracy, progress,
                  calib_text, calib_tokens, headroom, dtype, algorithm, method, min_cosine, rotation,
                  fp16_kinds) -> Manifest:
    """`convert_rknn`'s work in the directory `out` (the new one, not yet published)."""
    (out / "rknn").mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    step = progress or (lambda *a: None)
    count = {"n": 0}

    def on_export(spec) -> None:
        step("export", spec.name, count["n"], -1)
        count["n"] += 1

    step("calibrate", "", 0, 1)
    ids, source = C.calibration_ids(model_dir, calib_text, calib_tokens)
    cap = C.capture(model_dir, ids, source)
    t_calib = time.perf_counter() - t0
    if dtype == "w8a8":
        from edge_llm.convert.w8a8 import ALPHA, export_w8a8, write_datasets

        ex = export_w8a8(model_dir, out, chunks, layers, head_split, cap, rotation=rotation, progress=on_export)
        m, inputs_for = ex.manifest, (lambda spec: ex.inputs[spec.name])
        m.dtype = dtype
        write_datasets(out, m, ex.inputs)
        m.quant = {"algorithm": algorithm, "method": method, "alpha": ALPHA, "rotation": rotation, "fp16_kinds": sorted(fp16_kinds),
                   "max_samples": MAX_SAMPLES,
                   "min_cosine": min_cosine, "cpu_side_sha256": ex.side.save(out),
                   "calibration_sha256": hashlib.sha256(json.dumps(list(map(int, ids))).encode()).hexdigest()}
    else:
        m = export_graph_set(model_dir, out, chunks, layers, head_split, samples=cap.samples() if accuracy else None,
                             progress=on_export)
        inputs_for = cap.for_spec
    C.record_ranges(m, out, inputs_for, progress=lambda i, name: step("ranges", name, i, len(m.graphs)))
    m.calibration = {"source": source, "tokens": cap.tokens, "fp16_max": C.FP16_MAX, "headroom": headroom}
    del cap
    t_export = time.perf_counter() - t0
    export_rss = peak_rss_mb()
    m.write(out)
    (out / "report.md").write_text(markdown_report(m))  # a refused conversion still shows its ranges
    C.check_ranges({g.name: g.ranges for g in m.graphs}, headroom)
    worker = ToolkitWorker(converter_python, log_file=out / "build.log")
    built = reused = 0
    try:
        m.toolkit = worker.version
        for i, g in enumerate(m.graphs):
            step("build", g.name, i, len(m.graphs))
            if dtype != "float16" and g.kind in fp16_kinds:
                g.dtype = "float16"
            res, key, rel, fresh = build_graph(worker, m, g, out, accuracy or dtype != "float16")
            if m.graph_dtype(g) != "float16" and (cos := _row_cosine(res)) < min_cosine:
                log.info("%s: w8a8 mean row cosine %.4f < %.4f on the calibration rows: built fp16", g.name,
                         cos, min_cosine)
                m.quant.setdefault("fp16_graphs", {})[g.name] = round(cos, 5)
                g.dtype = "float16"
                res, key, rel, fresh2 = build_graph(worker, m, g, out, accuracy)
                fresh = fresh or fresh2
            built, reused = built + fresh, reused + (not fresh)
            g.rknn, g.build_key, g.rknn_sha256, g.rknn_bytes = rel, key, res["sha256"], res["bytes"]
            g.accuracy, g.cost, g.build_seconds = res.get("accuracy"), res.get("cost"), res.get("build_seconds")
    finally:
        worker.close()
    worker_rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    m.build = {"calibration_seconds": round(t_calib, 2), "export_seconds": round(t_export - t_calib, 2), "total_seconds": round(time.perf_counter() - t0, 2),
               "built": built, "reused": reused, "peak_rss_mb_export": round(export_rss, 1),
               "peak_rss_mb_toolkit": round(worker_rss, 1)}
    m.write(out)
    (out / "report.md").write_text(markdown_report(m))
    log.info("converted %d graphs (%d built, %d reused) in %.1f s -> %s", len(m.graphs), built, reused,
             m.build["total_seconds"], out)
    return m


def build_graph(worker: ToolkitWorker, m: Manifest, g: GraphEntry, out: Path, accuracy: bool) -> tuple[dict, str, str, bool]:
    """Build `g` (or reuse an intact build of the same key): (result, key, .rknn path, built now)."""
    quant = m.quant_request(out, g)
    key = build_key(g, m.toolkit, m.target, m.graph_dtype(g), quant)
    rel = f"rknn/{g.name}-{key[:16]}.rknn"
    record = out / (rel + ".json")
    res = _cached(out / rel, record)
    if res is not None:
        return res, key, rel, False
    samples = out / g.onnx.replace(".onnx", ".samples.npz") if accuracy else None
    (out / rel).unlink(missing_ok=True)  # never written through a link to an older directory's build
    req = compile_request(g.spec(), out / g.onnx, out=str(out / rel), quant=quant,
                          samples=str(samples) if samples and samples.is_file() else None)
    res, _ = worker.call({"op": "build", **req})
    res.pop("ok", None)
    record.write_text(json.dumps(res, indent=1) + "\n")
    return res, key, rel, True


def _row_cosine(res: dict) -> float:
    """The smallest mean per-row cosine of any output at the largest shape (1.0 without samples)."""
    acc = res.get("accuracy") or {}
    if not acc:
        return 1.0
    per = acc[max(acc, key=int)]
    return min(o.get("row_cosine_mean", o["cosine"]) for o in per.values())


def _cached(rknn: Path, record: Path) -> dict | None:
    """A previous build of the same key, if its file is intact."""
    try:
        res = json.loads(record.read_text())
        data = rknn.read_bytes()
    except (OSError, ValueError):
        return None
    if hashlib.sha256(data).hexdigest() != res.get("sha256"):
        return None
    return res
