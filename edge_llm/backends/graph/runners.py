"""Graph runners: one protocol, interchangeable implementations under `GraphBackend`.

- `OrtRunner`: onnxruntime executes the exported ONNX graphs in float32 on the CPU (the F32
  reference of the graph path, and the base a quantized CPU backend builds on).
- the NPU's runners (`backends/npu/graphs/`): `SimRunner` (`sim.py`, the rknn-toolkit2 simulator
  in the converter venv) and `RKNNLiteRunner` (`rknnlite.py`, the compiled `.rknn` files on the
  RK3588 NPU).

Nothing here imports onnxruntime or a Rockchip package at module import time.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from edge_llm.backends.graph.schema import GraphSpec
from edge_llm.errors import ConfigError, RunnerError

log = logging.getLogger(__name__)


@runtime_checkable
class GraphRunner(Protocol):
    name: str  # "onnxruntime" | "rknn-sim" | "rknnlite"
    numerics: str  # what decides its output bits (version, threads, core masks): identity
    act_dtype: type  # dtype the graphs compute in: np.float32, or np.float16 on the NPU

    def run(self, spec: GraphSpec, inputs: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Run one graph. `inputs`: float32, C-contiguous, in `spec.inputs` order, each with a row
        count from `spec.rows`. Returns float32 outputs in `spec.outputs` order, same rows."""

    def close(self) -> None:
        """Free sessions / NPU contexts / the worker process."""


def check_inputs(spec: GraphSpec, inputs: Sequence[np.ndarray]) -> int:
    """The row count of a call, after checking shapes and dtypes against the spec."""
    if len(inputs) != len(spec.inputs):
        raise RunnerError(f"{spec.name}: {len(inputs)} inputs, expected {len(spec.inputs)}")
    rows = inputs[0].shape[0]
    if spec.rows and rows not in spec.rows:
        raise RunnerError(f"{spec.name}: {rows} rows is not a static shape {list(spec.rows)}")
    for (name, width), a in zip(spec.inputs, inputs):
        if a.shape != (rows, width) or a.dtype != np.float32:
            raise RunnerError(f"{spec.name}: input {name} is {a.dtype}{list(a.shape)}, "
                              f"expected float32[{rows}, {width}]")
    return rows


class OrtRunner:
    """onnxruntime, float32, a fixed thread count (fixed bits for a given shape)."""

    name = "onnxruntime"
    act_dtype = np.float32

    def __init__(self, onnx_files: Mapping[str, Path], threads: int | None = None, kind: str = "f32",
                 config: Mapping[str, str] | None = None, shared_arena: bool = False):
        """`kind` names the graphs' arithmetic in `numerics` (f32, or the quantized CPU backend's
        kernel and quantization); `config`: onnxruntime session config entries; `shared_arena`:
        all sessions allocate from one process-wide arena (else each graph's session keeps its
        own, and their peaks add up: +0.9 GB for 28 Qwen3-VL-2B layers after a 128-row prefill)."""
        try:
            import onnxruntime as ort
        except ImportError:
            raise ConfigError("onnxruntime is not installed: pip install 'edge-llm[convert]'") from None
        self.threads = threads or max(1, min(4, os.cpu_count() or 1))
        opts = session_options(ort, self.threads, config, shared_arena)
        self.sessions = {name: open_session(ort, path, opts) for name, path in onnx_files.items()}
        self.version = ort.__version__
        self.numerics = f"onnxruntime-{ort.__version__}-{kind}-t{self.threads}"

    def run(self, spec: GraphSpec, inputs: Sequence[np.ndarray]) -> list[np.ndarray]:
        check_inputs(spec, inputs)
        feed = {name: x for (name, _), x in zip(spec.inputs, inputs)}
        return self.sessions[spec.name].run([n for n, _ in spec.outputs], feed)

    def close(self) -> None:
        self.sessions.clear()


def session_options(ort: Any, threads: int, config: Mapping[str, str] | None = None, shared_arena: bool = False):
    """onnxruntime options of every CPU session here: `threads` intra-op threads, sequential
    execution (fixed bits for a given shape), session config entries, optionally the shared arena."""
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.log_severity_level = 3
    for k, v in (config or {}).items():
        opts.add_session_config_entry(k, v)
    if shared_arena:
        _register_shared_arena(ort)
        opts.add_session_config_entry("session.use_env_allocators", "1")
    return opts


def open_session(ort: Any, path: Path, opts: Any) -> Any:
    """An onnxruntime CPU session on `path`; a missing or unreadable graph is a ConfigError that
    names the file."""
    if not Path(path).is_file():
        raise ConfigError(f"graph file {path} is missing: rebuild the graph directory")
    try:
        return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    except Exception as e:  # onnxruntime raises its own classes (InvalidProtobuf, Fail, ...)
        raise ConfigError(f"graph file {path} cannot be loaded ({type(e).__name__}: "
                          f"{str(e).splitlines()[0][:300]}): rebuild the graph directory") from None


_ARENA: list[bool] = []


def _register_shared_arena(ort) -> None:
    """One CPU arena for every session of this process (onnxruntime's environment allocator)."""
    if not _ARENA:
        info = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
        ort.create_and_register_allocator(info, ort.OrtArenaCfg(0, -1, -1, -1))
        _ARENA.append(True)
