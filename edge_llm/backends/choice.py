"""`backend = auto`: which backend runs here and why (`choose_backend`), decided before anything is
loaded. The server, `edge-llm generate` and `edge-llm doctor` all ask here, so the reason they log
and show is the same (docs/architecture.md, "Backends")."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from edge_llm.settings import Settings


@dataclass(frozen=True)
class BackendChoice:
    """The backend that runs and why: `auto`'s reason, or that the configuration names it."""

    name: str  # cpu | cpu-q | rknn
    reason: str
    auto: bool
    # `auto` only: a quantized candidate whose accuracy record is not measured yet (cpu-q before its
    # first build); the runtime builds and measures it, then asks again (docs/quantization.md)
    unmeasured: str | None = None
    # an explicit quantized backend whose record fails or is missing: the warning (docs/logs.md)
    warning: str | None = None

    def describe(self) -> str:
        """'backend auto -> cpu-q (no RKNPU device node; ...)', 'backend cpu, set on the command line
        (--backend)': the start-up log line, /health's `backend_reason`, generate's and doctor's line."""
        if self.auto:
            return f"backend auto -> {self.name} ({self.reason})"
        return f"backend {self.name}, {self.reason}"  # a warning is logged on its own (runtime.py)


def quant_runtime() -> str | None:
    """onnxruntime's version when cpu-q can run here (onnx and onnxruntime installed), else None.
    Found without importing them (onnxruntime is imported only where a session starts)."""
    import importlib.metadata as md
    import importlib.util

    try:
        if importlib.util.find_spec("onnx") is None or importlib.util.find_spec("onnxruntime") is None:
            return None
    except (ImportError, ValueError):  # a finder refuses it, or a broken half-installed package
        return None
    try:
        return md.version("onnxruntime")
    except md.PackageNotFoundError:  # another distribution of the module (e.g. a GPU build)
        return "(version unknown)"


def choose_backend(s: Settings, model_dir: str | Path, sysroot: str | Path = "/") -> BackendChoice:
    """`backend = auto` picks rknn (an NPU and a manifest matching this model; an npu-mm directory
    only with a passing accuracy record), else cpu-q (onnxruntime importable and cpu-q's accuracy
    record passing: backends/record.py), else cpu; an explicit backend is taken as is, its reason where it
    was set (`Settings.source`: the command line, the configuration file, the environment)."""
    if s.backend != "auto":
        where = s.source("backend")
        return BackendChoice(s.backend, f"set {where}" if where else "set by the program that loaded it",
                             auto=False)
    from edge_llm.backends.npu.backend import npu_usable

    ok, why = npu_usable(s.rknn_dir, model_dir, sysroot)
    if ok:
        passed, record = rknn_record(s.rknn_dir)
        if passed is not False:
            return BackendChoice("rknn", f"{why}; {record}", auto=True)
        why = f"{why} but its {record}"
    return without_npu(why, model_dir, s.quant)


def without_npu(why: str, model_dir: str | Path, quant: str) -> BackendChoice:
    """`auto` where the NPU does not run (`why`): cpu-q when onnxruntime is importable and cpu-q's
    accuracy record passes, else cpu (`unmeasured="cpu-q"` when that record is not measured yet).
    Also `auto`'s fall-back when the NPU matmul path's start-up self-test refuses it
    (runtime.load_runtime)."""
    ort = quant_runtime()
    if ort is None:
        return BackendChoice("cpu", f"{why}; onnxruntime not importable (pip install 'edge-llm[quant]' "
                             "for the 4-bit backend)", auto=True)
    passed, record = cpu_q_record(model_dir, quant)
    if passed:
        return BackendChoice("cpu-q", f"{why}; onnxruntime {ort} importable; cpu-q's {record}", auto=True)
    if passed is None:
        return BackendChoice("cpu", f"{why}; cpu-q ({record}) not measured yet", auto=True, unmeasured="cpu-q")
    return BackendChoice("cpu", f"{why}; cpu-q not taken: its {record}", auto=True)


def cpu_q_record(model_dir: str | Path, quant: str) -> tuple[bool | None, str]:
    """(cpu-q's accuracy record of this model passes, fails, or None: not built or not measured;
    the reason): the record beside the quantized graphs, keyed by their manifest's identity."""
    from edge_llm.backends.cpuq.backend import mode, quant_dir
    from edge_llm.backends.graph.manifest import MANIFEST, Manifest
    from edge_llm.backends.record import judge
    from edge_llm.errors import EdgeLLMError

    try:
        root = quant_dir(model_dir, mode(quant))
        if not (root / MANIFEST).is_file():
            return None, "its 4-bit weights not built yet"
        return judge(root, Manifest.read(root).identity())
    except (EdgeLLMError, OSError, ValueError) as e:  # e.g. no weights to digest: nothing built either
        return None, f"no usable record ({e})"


def rknn_record(rknn_dir: str | Path) -> tuple[bool | None, str]:
    """An NPU directory's record: an npu-mm conversion carries one (passes, fails, or None when it
    is missing: converted before records existed); a graph directory (`convert rknn`) carries none
    and is taken as converted (docs/npu.md, "Accuracy record")."""
    from edge_llm.backends.npu.matmul.decoder import MmManifest, is_mm_dir
    from edge_llm.backends.record import judge
    from edge_llm.errors import EdgeLLMError

    if not is_mm_dir(rknn_dir):
        return None, "graph directories carry no accuracy record"
    try:
        passed, why = judge(rknn_dir, MmManifest.read(rknn_dir).identity())
    except EdgeLLMError as e:  # a broken manifest: loading it says so, with its own error
        return None, f"no usable accuracy record ({e})"
    return (False, f"npu-mm {why} (convert it again with this edge-llm)") if passed is None else (passed, why)
