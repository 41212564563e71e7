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

    def describe(self) -> str:
        """'backend auto -> cpu-q (no RKNPU device node; ...)', 'backend cpu, set on the command line
        (--backend)': the start-up log line, /health's `backend_reason`, generate's and doctor's line."""
        if self.auto:
            return f"backend auto -> {self.name} ({self.reason})"
        return f"backend {self.name}, {self.reason}"


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
    """`backend = auto` picks rknn (an NPU and a manifest matching this model), else cpu-q
    (onnxruntime importable), else cpu; an explicit backend is taken as is, its reason where it
    was set (`Settings.source`: the command line, the configuration file, the environment)."""
    if s.backend != "auto":
        where = s.source("backend")
        return BackendChoice(s.backend, f"set {where}" if where else "set by the program that loaded it",
                             auto=False)
    from edge_llm.backends.npu.backend import npu_usable

    ok, why = npu_usable(s.rknn_dir, model_dir, sysroot)
    if ok:
        return BackendChoice("rknn", why, auto=True)
    return without_npu(why)


def without_npu(why: str) -> BackendChoice:
    """`auto` where the NPU does not run (`why`): cpu-q when onnxruntime is importable, else cpu. Also
    `auto`'s fall-back when the NPU matmul path's start-up self-test refuses it (runtime.load_runtime)."""
    ort = quant_runtime()
    if ort is not None:
        return BackendChoice("cpu-q", f"{why}; onnxruntime {ort} importable", auto=True)
    return BackendChoice("cpu", f"{why}; onnxruntime not importable (pip install 'edge-llm[quant]' "
                         "for the 4-bit backend)", auto=True)
