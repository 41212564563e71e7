"""Backend `rknn`: a converted graph directory (`edge-llm convert rknn`) run by a graph runner.

Runners (`--rknn-runner`): `rknnlite` (the `.rknn` files on the RK3588 NPU, the board's
default), `sim` (the rknn-toolkit2 simulator in the converter venv, fp16, for checking numerics
on a host) and `onnxruntime` (the same graphs' ONNX in F32). `numerics` =
`rknn:<manifest identity>:<runner numerics>`: the graph set, chunk sizes and toolkit version,
plus the runtime version, core masks, and simulator vs board. So snapshots made under one of
them are never restored under another, nor under the CPU backend (`cpu-f32`).

`--backend auto` picks `rknn` when the NPU is usable and `rknn_dir` holds a manifest made from
this model, else `cpu`, and logs why.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from pathlib import Path

from edge_llm.backends.graph.backend import GraphBackend
from edge_llm.backends.cost import NEVER_PAYS
from edge_llm.backends.graph.schema import HEAD, HEAD_N, row_plan
from edge_llm.backends.graph.manifest import MANIFEST, Manifest
from edge_llm.backends.npu.matmul.decoder import MmBackend, MmManifest, is_mm_dir
from edge_llm.errors import ConfigError, EdgeLLMError
from edge_llm.settings import MM_RUNNERS, RKNN_RUNNERS

log = logging.getLogger(__name__)

RUNNERS = RKNN_RUNNERS
NPU_NODES = ("dev/rknpu",)
# the version string `doctor` and `bench board` report: librknnrt.so carries its own in its bytes
# (the RKNPU driver's: binding.npu_driver_version)
LIBRKNNRT_VERSION = re.compile(rb"librknnrt version: ([0-9][^\x00\n]{0,80})")


def librknnrt_version(data: bytes) -> str | None:
    """The version a librknnrt.so's bytes name, or None (no version string: e.g. the tests' fake)."""
    m = LIBRKNNRT_VERSION.search(data)
    return m.group(1).decode(errors="replace").strip() if m else None


def npu_present(sysroot: str | Path = "/") -> str | None:
    """The RKNPU device node if this machine has one (/dev/rknpu, or a DRM render node whose
    driver is RKNPU), else None."""
    root = Path(sysroot)
    for rel in NPU_NODES:
        if (root / rel).exists():
            return "/" + rel
    for rd in sorted((root / "sys/class/drm").glob("renderD*")):
        try:
            if "DRIVER=RKNPU" in (rd / "device/uevent").read_text().upper():
                return f"/dev/dri/{rd.name}"
        except OSError:
            continue
    return None


def resolve_runner(runner: str) -> str:
    """`auto` -> rknnlite when this machine has an NPU; any other name must be one of RUNNERS."""
    if runner == "auto":
        if not npu_present():
            raise ConfigError("no RKNPU device on this machine: use --rknn-runner sim or onnxruntime "
                              "to run the graphs here, or --backend cpu")
        return "rknnlite"
    if runner not in RUNNERS:
        raise ConfigError(f"unknown rknn runner {runner!r} (choose from {', '.join(RUNNERS)})")
    if runner in MM_RUNNERS:
        raise ConfigError(f"runner {runner} runs an `edge-llm convert npu-mm` directory, not compiled graphs "
                          "(use rknnlite, sim or onnxruntime)")
    return runner


def open_rknn(rknn_dir: str | Path, runner: str = "auto", model_dir: str | Path | None = None,
              threads: int | None = None, converter_python: str | None = None, progress=None,
              layer_masks: tuple[int, ...] | None = None) -> GraphBackend:
    """Read the manifest, check it against the model, start the runner; a Backend to load.
    `layer_masks`: the board runner's NPU core masks for layer graphs (None: its default)."""
    root = Path(rknn_dir)
    if is_mm_dir(root):
        return open_mm(root, runner, model_dir)
    m = Manifest.read(root)
    if model_dir is not None:
        from edge_llm.config import ModelArgs
        from edge_llm.weights import weight_digest

        m.check_model(ModelArgs.from_dir(model_dir), weight_digest(model_dir))
    specs = m.specs()
    runner = resolve_runner(runner)
    if runner == "rknnlite":
        from edge_llm.backends.npu.graphs.rknnlite import LAYER_CORES, RKNNLiteRunner

        files = m.rknn_files(root)
        m.check_fp16(root)
        m.verify(root, "rknn")
        r = RKNNLiteRunner(specs, files, layer_masks=layer_masks or LAYER_CORES, progress=progress)
    elif runner == "sim":
        from edge_llm.backends.npu.graphs.sim import SimRunner

        m.check_fp16(root)
        m.verify(root, "onnx")
        quant = {g.name: m.quant_request(root, g) for g in m.graphs}
        r = SimRunner(specs, m.onnx_files(root), python=converter_python, progress=progress, quant=quant,
                      dtype="fp16" if m.dtype == "float16" else m.dtype)
    elif runner == "onnxruntime":
        from edge_llm.backends.graph.runners import OrtRunner

        m.verify(root, "onnx")
        r = OrtRunner(m.onnx_files(root), threads=threads)
    else:
        raise ConfigError(f"unknown rknn runner {runner!r} (choose from {', '.join(RUNNERS)})")
    side = None
    if m.dtype != "float16":
        from edge_llm.backends.graph.cpu_side import CpuSide

        side = CpuSide.load(root, m.layers, m.quant.get("cpu_side_sha256"))
    return GraphBackend("rknn", specs, r, f"rknn:{m.identity()}:{r.numerics}", forward_cost=compiler_cost(m),
                        cpu_side=side)


def open_mm(root: Path, runner: str, model_dir: str | Path | None) -> MmBackend:
    """An `edge-llm convert npu-mm` directory (backends/npu/matmul/decoder.py) on its engine: `librknnrt` (the
    NPU's matmul API, backends/npu/matmul/engine.py; `auto` on a machine with an NPU) or `host` (the exact
    emulation, int8.py)."""
    m = MmManifest.read(root)
    if model_dir is not None:
        from edge_llm.config import ModelArgs
        from edge_llm.weights import weight_digest

        m.check_model(ModelArgs.from_dir(model_dir), weight_digest(model_dir))
    if runner == "auto":
        if not npu_present():
            raise ConfigError(f"no RKNPU device on this machine: use --rknn-runner host to run {root} in the exact "
                              "emulation, or --backend cpu")
        runner = "librknnrt"
    if runner == "host":
        from edge_llm.backends.npu.matmul.int8 import HostInt8Matmul

        return MmBackend(root, m, HostInt8Matmul())
    if runner == "librknnrt":  # the start-up self-test first: NpuRefused when it refuses the path
        from edge_llm.backends.npu.matmul.decoder import matmul_shapes
        from edge_llm.backends.npu.matmul.selftest import largest_part, open_checked

        return MmBackend(root, m, open_checked(largest_part(matmul_shapes(root))))
    raise ConfigError(f"{root} holds int8 matmul weights (`edge-llm convert npu-mm`): runner "
                      f"{' or '.join(MM_RUNNERS)}, not {runner!r}")


def compiler_cycles(m: Manifest, rows: int, layers: int | None = None) -> int | None:
    """NPU cycles of one forward of `rows` rows by the compiler's estimates: every graph at the
    static shapes `row_plan` covers the rows with (a head without a multi-row shape runs once per
    row); None if a shape has no estimate (converted without the toolkit). `layers`: scale the
    layer graphs from the `m.layers` converted to that many (every layer has the same geometry:
    a prediction from a `--layers N` conversion)."""
    scale = 1.0 if layers is None else layers / m.layers
    total = 0.0
    for g in m.graphs:
        table = {int(c["rows"]): int(c["cycles"]) for c in g.cost or [] if "cycles" in c}
        for _a, _b, shape in row_plan(rows, tuple(g.rows)):
            if shape not in table:
                return None
            total += table[shape] * (1.0 if g.kind in (HEAD, HEAD_N) else scale)
    return round(total)


def compiler_cost(m: Manifest) -> Callable[[int], float]:
    """Speculative decoding's cost profile (edge_llm/backends/__init__.py) from the compiler's
    estimates; without them drafts never pay."""
    one = compiler_cycles(m, 1)
    if not one:
        return NEVER_PAYS

    def cost(rows: int) -> float:
        c = compiler_cycles(m, rows)
        return float(rows) if c is None else c / one

    return cost


def npu_usable(rknn_dir: str | Path | None, model_dir: str | Path, sysroot: str | Path = "/") -> tuple[bool, str]:
    """(whether backend rknn can run this model here, why): an RKNPU device node and an rknn_dir
    whose manifest matches the model (`backend = auto` tries this first: edge_llm/footprint.py).
    The directory says which NPU path runs: an `edge-llm convert npu-mm` directory (w8a8 on the
    matmul API, the recommended decoder: docs/npu.md, "Backend choice") or a graph directory
    (`edge-llm convert rknn`, fp16 or w8a8 graphs)."""
    node = npu_present(sysroot)
    if node is None:
        return False, "no RKNPU device node"
    if not rknn_dir:
        return False, f"NPU at {node} but no rknn_dir configured"
    if not (Path(rknn_dir) / MANIFEST).is_file():
        return False, f"NPU at {node} but no {MANIFEST} in {rknn_dir}"
    try:
        from edge_llm.config import ModelArgs
        from edge_llm.weights import weight_digest

        args, digest = ModelArgs.from_dir(model_dir), weight_digest(model_dir)
        if is_mm_dir(rknn_dir):
            MmManifest.read(rknn_dir).check_model(args, digest)
            return True, f"NPU at {node} and a matching npu-mm {MANIFEST} in {rknn_dir} (w8a8 on the matmul API)"
        m = Manifest.read(rknn_dir)
        m.check_model(args, digest)
        m.check_fp16(Path(rknn_dir))
    except EdgeLLMError as e:
        return False, f"NPU at {node} but {rknn_dir} does not match the model: {e}"
    return True, f"NPU at {node} and a matching {MANIFEST} in {rknn_dir} ({m.dtype} graphs)"
