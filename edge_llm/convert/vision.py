"""`edge-llm convert rknn` for the Qwen3-VL vision tower: one fp16 `.rknn` holding every grid.

The tower is exported as one graph (`backends/tower/export.py`, schema `schema.vision_spec`)
whose inputs carry what depends on the grid alone (position embeddings, rotary tables) and a
key bias for padding, so one `.rknn` with one shape per patch count (`dynamic_input`: the
shapes share one copy of the weights) serves every image: the grid rule resizes an image onto at
most the largest shape's patches and pads it up to the smallest shape that holds it
(docs/vision.md, "Grids on the NPU"). Written to `<out>/vision/` with a manifest of its own, so
the decoder's graphs and identity do not change.

The accuracy reference is the numpy tower on one synthetic image per shape (no real Qwen3-VL
tower is on the machines that build this; the decoder uses real activations instead), and every
tensor's range on those inputs is checked against fp16's before the toolkit runs.
"""

from __future__ import annotations

import io
import json
import logging
import resource
import time
from pathlib import Path

import numpy as np

from edge_llm.backends.graph.schema import vision_spec
from edge_llm.backends.graph.manifest import GraphEntry, Manifest
from edge_llm.backends.npu.graphs.sim import ToolkitWorker
from edge_llm.backends.tower.export import export_tower
from edge_llm.backends.tower.graph import VISION_DIR
from edge_llm.config import ModelArgs, VisionArgs, vision_args_from_dir
from edge_llm.convert import calibration as C
from edge_llm.convert.report import NPU_HZ, cycles, worst
from edge_llm.convert.rknn import peak_rss_mb, build_graph
from edge_llm.errors import ConfigError
from edge_llm.files import write_atomic
from edge_llm.weights import load_vision_weights

log = logging.getLogger(__name__)

# 448x448 is Rockchip's own choice for Qwen3-VL (rknn-llm's multimodal demo) and the grid the
# issue benchmarks: 784 patches, and through the resize rule every aspect ratio users send fits in
# it (4:3 photos -> 384x512 = 768 patches, 16:9 -> 320x576 = 720, 3:4 / 9:16 the same turned);
# 256x256 is the smallest image the preprocessor makes (min_pixels 65,536): small images and
# thumbnails run at a third of the patches (a ninth of the attention) instead of padded to 784
DEFAULT_GRIDS = ((256, 256), (448, 448))


def parse_grids(text: str) -> tuple[tuple[int, int], ...]:
    """'448x448,256x256' -> ((448, 448), (256, 256)) (width x height in pixels)."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        try:
            w, h = (int(x) for x in part.lower().split("x"))
        except ValueError:
            raise ConfigError(f"--vision-grids: {part!r} is not WIDTHxHEIGHT (e.g. 448x448)") from None
        out.append((w, h))
    if not out:
        raise ConfigError("--vision-grids: give at least one WIDTHxHEIGHT")
    return tuple(out)


def grid_rows(v: VisionArgs, grids: tuple[tuple[int, int], ...], min_pixels: int) -> list[int]:
    """The patch counts (static shapes) of the grids, checked against the resize rule."""
    factor = v.patch_size * v.spatial_merge_size
    rows = set()
    for w, h in grids:
        if w % factor or h % factor or w * h < min_pixels:
            raise ConfigError(f"--vision-grids: {w}x{h} is not a size the resize rule makes (sides are "
                              f"multiples of {factor}, area at least {min_pixels} pixels)")
        rows.add((w // v.patch_size) * (h // v.patch_size))
    return sorted(rows)


def _grid_of(rows: int, v: VisionArgs) -> tuple[int, int]:
    """The squarest (gh, gw) patch grid of `rows` patches with both sides multiples of the merge."""
    m = v.spatial_merge_size
    blocks = rows // (m * m)
    a = max(d for d in range(1, int(blocks ** 0.5) + 1) if blocks % d == 0)
    return a * m, blocks // a * m


def sample_image(width: int, height: int, seed: int = 0) -> bytes:
    """A deterministic photo-like PNG: smooth gradients, an edge pattern and a little noise."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    arr = np.stack([x * 255 // width, y * 255 // height, (x ^ y) & 255], -1) + rng.integers(0, 40, (height, width, 3))
    buf = io.BytesIO()
    Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def write_samples(model_dir: str | Path, path: Path, rows: list[int]) -> dict[int, list[np.ndarray]]:
    """One synthetic image per shape through the numpy tower: `in.<name>@<rows>` (the graph's
    inputs) and `out.features@<rows>` (the reference) in `path`; returns the inputs by shape."""
    from edge_llm.vision.model import VisionModel

    vm = VisionModel.load(model_dir, ModelArgs.from_dir(model_dir))
    assert vm is not None
    v, enc, spec = vm.args, vm.encoder, vision_spec(vm.args)
    arrays, inputs = {}, {}
    for r in rows:
        gh, gw = _grid_of(r, v)
        img = vm.prepare(sample_image(gw * v.patch_size, gh * v.patch_size, seed=r))
        if img.grid_thw != (1, gh, gw):
            raise ConfigError(f"the resize rule maps a {gw * v.patch_size}x{gh * v.patch_size} image to grid "
                              f"{img.grid_thw}, not (1, {gh}, {gw})")
        cos, sin = enc.rotary(gh, gw)
        xs = [img.pixel_values, enc.position_embeddings(gh, gw), cos, sin, np.zeros((r, 1), np.float32)]
        feats = enc.encode(img.pixel_values, img.grid_thw)
        ref = np.concatenate([feats.embeds, *feats.deepstack], axis=1).reshape(r, -1)
        inputs[r] = [np.ascontiguousarray(x, dtype=np.float32) for x in xs]
        arrays |= {f"in.{n}@{r}": x for (n, _), x in zip(spec.inputs, inputs[r])}
        arrays[f"out.features@{r}"] = np.ascontiguousarray(ref, dtype=np.float32)
    np.savez(path, **arrays)
    return inputs


def convert_tower(model_dir: str | Path, out_dir: str | Path, grids=DEFAULT_GRIDS,
                  converter_python: str | None = None, accuracy: bool = True,
                  headroom: float = C.HEADROOM) -> Manifest | None:
    """Export, range-check and build the tower into `<out_dir>/vision/`; None: no tower."""
    from edge_llm.vision.preprocess import PreprocessConfig
    from edge_llm.weights import weight_digest

    v = vision_args_from_dir(model_dir)
    if v is None:
        return None
    t0 = time.perf_counter()
    args = ModelArgs.from_dir(model_dir)
    if load_vision_weights(model_dir, args, v) is None:  # declared, not shipped: a text-only export
        return None
    rows = grid_rows(v, tuple(grids), PreprocessConfig.from_dir(model_dir, v).min_pixels)
    root = Path(out_dir).resolve() / VISION_DIR
    (root / "rknn").mkdir(parents=True, exist_ok=True)
    (e,) = export_tower(model_dir, root / "onnx", rows=tuple(rows), npu=True)
    samples = root / "onnx" / "vision.samples.npz"
    inputs = write_samples(model_dir, samples, rows)
    entry = GraphEntry(name=e.spec.name, kind=e.spec.kind, index=0, rows=rows,
                       inputs=[list(i) for i in e.spec.inputs], outputs=[list(o) for o in e.spec.outputs],
                       vocab=[0, 0], onnx=str(e.onnx.relative_to(root)), input_key=e.input_key,
                       onnx_bytes=e.nbytes)
    entry.ranges = C.tensor_ranges(e.onnx, e.spec, inputs[max(rows)])
    m = Manifest(model={"name": Path(model_dir).resolve().name, "model_type": args.model_type,
                        "weights_sha256": weight_digest(model_dir),
                        "config": json.loads(json.dumps(args.identity_fields()))},
                 chunks=rows, layers=v.depth, head_split=1, graphs=[entry],
                 calibration={"source": "synthetic images, one per shape", "grids": [list(g) for g in grids],
                              "fp16_max": C.FP16_MAX, "headroom": headroom})
    m.write(root)
    C.check_ranges({entry.name: entry.ranges}, headroom)
    export_rss, t_export = peak_rss_mb(), time.perf_counter() - t0
    worker = ToolkitWorker(converter_python, log_file=root / "build.log")
    try:
        m.toolkit = worker.version
        res, key, rel, fresh = build_graph(worker, m, entry, root, accuracy)
    finally:
        worker.close()
    m.build = {"export_seconds": round(t_export, 2), "total_seconds": round(time.perf_counter() - t0, 2),
               "built": int(fresh), "reused": int(not fresh), "peak_rss_mb_export": round(export_rss, 1),
               "peak_rss_mb_toolkit": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024, 1)}
    entry.rknn, entry.build_key, entry.rknn_sha256, entry.rknn_bytes = rel, key, res["sha256"], res["bytes"]
    entry.accuracy, entry.cost, entry.build_seconds = res.get("accuracy"), res.get("cost"), res.get("build_seconds")
    m.write(root)
    write_atomic(root / "report.md", tower_report(m))
    return m


def tower_rows(m: Manifest) -> list[dict]:
    """Per shape: patches, the grid it was checked on, accuracy vs numpy, compiler-predicted ms."""
    (g,) = m.graphs
    out = []
    for r in g.rows:
        acc = ((g.accuracy or {}).get(str(r)) or {}).get("features")
        c = cycles(g, r)
        out.append({"patches": r, "accuracy": acc, "cycles": c,
                    "predicted_ms": None if c is None else c / NPU_HZ * 1e3})
    return out


def tower_report(m: Manifest) -> str:
    (g,) = m.graphs
    lines = ["# Vision tower on the NPU (fp16)", "",
             f"One `.rknn` ({(g.rknn_bytes or 0) / 1e6:.0f} MB), shapes {g.rows} patches, built with "
             f"rknn-toolkit2 {m.toolkit}. Accuracy: the simulator against the numpy tower on one synthetic "
             "image per shape. Time: the compiler's cycle estimate at 1 GHz (one image, all layers).", "",
             "| patches | max rel | mean rel | cosine | predicted encode |", "|---:|---:|---:|---:|---:|"]
    for row in tower_rows(m):
        a = row["accuracy"] or {}
        ms = f"{row['predicted_ms']:.1f} ms" if row["predicted_ms"] is not None else "-"
        lines.append(f"| {row['patches']} | {a.get('max_rel', float('nan')):.2e} | {a.get('mean_rel', float('nan')):.2e} "
                     f"| {a.get('cosine', float('nan')):.6f} | {ms} |")
    w = worst(g)
    if w is not None:
        lines += ["", f"Worst over the shapes: max rel {w['max_rel']:.2e}, cosine {w['cosine']:.6f}."]
    return "\n".join(lines) + "\n"
