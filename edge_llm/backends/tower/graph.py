"""The vision tower as one graph (`schema.vision_spec`) on a graph runner: onnxruntime for cpu-q
(built here, once per model and mode), the rknn-toolkit2 simulator or RKNNLite for rknn (from a
`convert rknn` directory: backends/npu/backend.py). `VisionEncoder` hands an image to it when a shape
holds the image's patches, and to the numpy tower otherwise (docs/vision.md).

onnxruntime's tower lives in `$EDGE_LLM_HOME/quant/<model>-<weights digest>-vision-<mode>/`
(`vision.AA-BB.onnx` segments + data + `tower.json`), built on first use under a lock (files.publish_dir) and
reused while the weights are unchanged. Modes: `f32` (the numpy tower's arithmetic in
onnxruntime's kernels) and weight-only `q8` (MatMulNBits, int8 activations per block: the
decoder's cpu-q kernel family); docs/vision.md "Tower paths" has the measured speed and error.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edge_llm.backends.graph.schema import GraphSpec
from edge_llm.backends.graph.runners import GraphRunner, OrtRunner
from edge_llm.errors import ConfigError
from edge_llm.files import publish_dir, write_atomic
from edge_llm.safetext import printable

log = logging.getLogger(__name__)

TOWER_FORMAT = 2  # 2: segments
TOWER_FILE = "tower.json"
# onnxruntime runs any patch count, but a head's (N, N) scores (and the softmax's copy) grow as
# N^2: 4096 patches (a 1024x1024 image) is 64 MiB each; larger images take the numpy tower,
# which bounds its score buffer (vision/encoder.py)
ORT_MAX_PATCHES = 4096
# onnxruntime runs the tower in segments of this many blocks, so that an encode reports progress
# (cancellation, the service watchdog) between them: a 1024x1024 image is ~4 TFLOP, a minute or
# more on a board's CPU, longer than the unit's WatchdogSec in one call (docs/vision.md)
ORT_SEGMENT_BLOCKS = 4
# no prepacked copies of the weights: onnxruntime then maps the page-aligned external data file
# and reads the weights in place, so between images the tower holds file pages the kernel may
# drop, not 1.6 GB of anonymous memory (Qwen3-VL-2B), for ~5 % of an encode (docs/vision.md)
TOWER_CONFIG = {"session.disable_prepacking": "1"}


@dataclass(frozen=True)
class TowerMode:
    name: str
    bits: int  # 32: F32 MatMul; 8 or 4: MatMulNBits
    block: int = 32
    accuracy_level: int = 4


TOWER_MODES = {"f32": TowerMode("f32", 32), "q8": TowerMode("q8", 8), "q4": TowerMode("q4", 4)}


@dataclass
class TowerGraph:
    """A runner holding the tower as graphs `specs`: one, or segments run in order
    (`schema.vision_segments`). `rows`: the patch counts they hold (static shapes; () = any
    count up to `max_patches`); `numerics`: what decides their output bits, which enters every
    image digest (VisionModel.tag), so rows from another tower path never match."""

    specs: list[GraphSpec]
    runner: GraphRunner
    numerics: str
    max_patches: int = ORT_MAX_PATCHES

    @property
    def rows(self) -> tuple[int, ...]:
        return self.specs[0].rows

    def shape_for(self, patches: int) -> int | None:
        return held_shape(self.rows, patches, self.max_patches)

    def run(self, spec: GraphSpec, inputs: list[np.ndarray]) -> dict[str, np.ndarray]:
        return dict(zip((n for n, _ in spec.outputs), self.runner.run(spec, inputs)))

    def close(self) -> None:
        self.runner.close()


def held_shape(rows: tuple[int, ...], patches: int, max_patches: int = ORT_MAX_PATCHES) -> int | None:
    """The row count a call for `patches` patches runs at: the smallest static shape that holds
    them (padded up), any count up to `max_patches` for a dynamic graph (`rows == ()`), or None."""
    if not rows:
        return patches if patches <= max_patches else None
    fits = [r for r in rows if r >= patches]
    return min(fits) if fits else None


def tower_mode(name: str) -> TowerMode:
    try:
        return TOWER_MODES[name]
    except KeyError:
        raise ConfigError(f"vision tower mode {name!r} is not available "
                          f"(available: {', '.join(TOWER_MODES)})") from None


def tower_dir(model_dir: str | Path, tm: TowerMode) -> Path:
    from edge_llm.backends.cpuq.backend import quant_root
    from edge_llm.weights import weight_digest

    return quant_root() / f"{Path(model_dir).resolve().name}-{weight_digest(model_dir)[:12]}-vision-{tm.name}"


def _usable(root: Path, tm: TowerMode) -> dict | None:
    try:
        meta = json.loads((root / TOWER_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if meta.get("format") != TOWER_FORMAT or meta.get("mode") != tm.name or \
            not all((root / f).is_file() for f in meta.get("onnx", {}).values()):
        log.warning("%s is stale: rebuilding", printable(root))
        return None
    return meta


def build_ort_tower(model_dir: str | Path, out: Path, tm: TowerMode) -> dict:
    """Export the tower's segments in mode `tm` into `out` (onnx + data + tower.json)."""
    try:
        from edge_llm.backends.graph.onnx_export import f32_linear
        from edge_llm.backends.tower.export import NBitsLinear, export_tower
    except ImportError as e:
        raise ConfigError(f"the onnxruntime vision tower needs onnx ({e}): pip install 'edge-llm[quant]'") from None
    linear = f32_linear if tm.bits == 32 else NBitsLinear(tm.bits, tm.block, tm.accuracy_level)
    log.info("exporting the vision tower of %s (%s) into %s", printable(Path(model_dir).name), tm.name, printable(out))
    done = export_tower(model_dir, out, linear=linear, blocks=ORT_SEGMENT_BLOCKS)
    digest = hashlib.sha256("".join(e.input_key for e in done).encode()).hexdigest()
    meta = {"format": TOWER_FORMAT, "mode": tm.name, "onnx": {e.spec.name: e.onnx.name for e in done},
            "sha256": digest, "bytes": sum(e.nbytes for e in done)}
    write_atomic(out / TOWER_FILE, json.dumps(meta, indent=1))
    return meta


def open_ort_tower(model_dir: str | Path, mode: str = "f32", threads: int | None = None,
                   progress: Callable[[str], None] | None = None) -> TowerGraph | None:
    """The model's tower on onnxruntime (built first if needed); None if it has no tower."""
    from edge_llm.backends.cpuq.backend import SESSION_CONFIG, kernel_isa
    from edge_llm.backends.graph.schema import vision_segments
    from edge_llm.config import vision_args_from_dir

    v = vision_args_from_dir(model_dir)
    if v is None:
        return None
    tm = tower_mode(mode)
    root = tower_dir(model_dir, tm)
    if progress:
        progress(f"vision tower graph ({tm.name})")
    meta = publish_dir(root, lambda tmp: build_ort_tower(model_dir, tmp, tm), lambda d: _usable(d, tm))
    specs = vision_segments(v, (), ORT_SEGMENT_BLOCKS)
    runner = OrtRunner({s.name: root / meta["onnx"][s.name] for s in specs}, threads=threads,
                       kind=f"vision-{tm.name}", config={**SESSION_CONFIG, **TOWER_CONFIG}, shared_arena=True)
    # not the thread count: MLAS splits no reduction across threads (as for cpu-q's graphs)
    numerics = f"ort-tower:{tm.name}:{meta['sha256'][:16]}:onnxruntime-{runner.version}:{kernel_isa()}"
    log.info("vision tower on onnxruntime (%s, %d segments, %.0f MB of graphs, mapped), up to %d patches a call",
             tm.name, len(specs), meta["bytes"] / 1e6, ORT_MAX_PATCHES)
    return TowerGraph(specs, runner, numerics)


# ---- the NPU's tower: `edge-llm convert rknn` writes it to <rknn_dir>/vision/ ------------------
VISION_DIR = "vision"


def open_rknn_tower(rknn_dir: str | Path, runner: str = "auto", model_dir: str | Path | None = None,
                    converter_python: str | None = None,
                    progress: Callable[[str], None] | None = None) -> TowerGraph | None:
    """The tower graph of a converted directory (`<rknn_dir>/vision/manifest.json`: its own
    manifest, so the decoder's identity and graph set do not change) on the runner the decoder
    uses; None when the conversion holds no tower (images then take the numpy tower)."""
    from edge_llm.backends.graph.manifest import MANIFEST, Manifest
    from edge_llm.backends.npu.backend import resolve_runner

    root = Path(rknn_dir) / VISION_DIR
    if not (root / MANIFEST).is_file():
        log.info("%s holds no vision tower graph: images take the numpy tower", printable(rknn_dir))
        return None
    m = Manifest.read(root)
    if model_dir is not None:
        from edge_llm.weights import weight_digest

        if m.model.get("weights_sha256") != weight_digest(model_dir):
            raise ConfigError(f"{root}: the tower graph was converted from other weights: "
                              "re-run `edge-llm convert rknn` for this model")
    specs = m.specs()
    if progress:
        progress(f"loading the NPU vision tower ({', '.join(map(str, specs[0].rows))} patches)")
    kind = resolve_runner(runner)
    if kind == "rknnlite":
        from edge_llm.backends.npu.graphs.rknnlite import RKNNLiteRunner

        r: GraphRunner = RKNNLiteRunner(specs, m.rknn_files(root))
    elif kind == "sim":
        from edge_llm.backends.npu.graphs.sim import SimRunner

        r = SimRunner(specs, m.onnx_files(root), python=converter_python)
    else:
        r = OrtRunner(m.onnx_files(root), kind="vision-f32", config={**TOWER_CONFIG})
    return TowerGraph(specs, r, f"rknn-tower:{m.identity()}:{r.numerics}")
