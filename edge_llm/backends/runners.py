"""Graph runners: one protocol, interchangeable implementations under `GraphBackend`.

- `OrtRunner`: onnxruntime executes the exported ONNX graphs in float32 on the CPU (the F32
  reference of the graph path, and the base a quantized CPU backend builds on).
- `SimRunner`: the rknn-toolkit2 simulator executes the same graphs in fp16, built from ONNX in
  a worker process of the converter venv (`toolkit_worker.py`; the toolkit never loads here).
- `RKNNLiteRunner` (`rknnlite.py`): the compiled `.rknn` files on the RK3588 NPU.

Nothing here imports onnxruntime or a Rockchip package at module import time.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from edge_llm.backends import wire
from edge_llm.backends.graphs import GraphSpec
from edge_llm.errors import ConfigError, RunnerError

log = logging.getLogger(__name__)

CONVERTER_ENV = "EDGE_LLM_CONVERTER_PYTHON"
WORKER = Path(__file__).with_name("toolkit_worker.py")


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


def converter_python(explicit: str | None = None) -> Path:
    """The converter venv's python: explicit, $EDGE_LLM_CONVERTER_PYTHON, or the checkout's
    `.venv-converter` (made by tools/setup-converter.sh)."""
    cand = explicit or os.environ.get(CONVERTER_ENV)
    path = Path(cand) if cand else Path(__file__).resolve().parents[2] / ".venv-converter" / "bin" / "python"
    if not path.is_file():
        raise ConfigError(f"converter python {path} not found: run tools/setup-converter.sh "
                          f"(or set {CONVERTER_ENV})")
    return path


class ToolkitWorker:
    """A `toolkit_worker.py` process in the converter venv, spoken to over two pipes."""

    def __init__(self, python: str | Path | None = None, log_file: str | Path | None = None):
        py = converter_python(str(python) if python else None)
        r_req, w_req = os.pipe()
        r_rep, w_rep = os.pipe()
        self._temp_log = log_file is None
        if log_file is None:
            fd, log_file = tempfile.mkstemp(prefix="edge-llm-toolkit-", suffix=".log")
            os.close(fd)
        self.log_file = Path(log_file)
        self._log = open(self.log_file, "ab")
        # the toolkit writes check*.onnx dumps into its working directory (GBs for a 2B head):
        # a scratch directory of its own, removed at close; every path it is sent is absolute
        self._scratch = tempfile.mkdtemp(prefix="edge-llm-toolkit-")
        self.proc = subprocess.Popen([str(py), str(WORKER), str(r_req), str(w_rep)],
                                     pass_fds=(r_req, w_rep), stdin=subprocess.DEVNULL,
                                     stdout=self._log, stderr=self._log, cwd=self._scratch)
        os.close(r_req)
        os.close(w_rep)
        self._w = os.fdopen(w_req, "wb")
        self._r = os.fdopen(r_rep, "rb")
        self.version = self.call({"op": "version"})[0]["toolkit"]

    def call(self, req: dict[str, Any], arrays: Sequence[np.ndarray] = ()) -> tuple[dict, list[np.ndarray]]:
        try:
            wire.send(self._w, req, list(arrays))
            reply, out = wire.recv(self._r)
        except (wire.WireError, BrokenPipeError) as e:
            raise RunnerError(f"rknn-toolkit2 worker died ({e}); its log: {self.log_file}") from None
        if not reply.get("ok"):
            raise RunnerError(f"rknn-toolkit2 {req.get('op')} {req.get('name', '')}: {reply.get('error')} "
                              f"(log: {self.log_file})")
        return reply, out

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call({"op": "quit"})
            except RunnerError:
                pass
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for f in (self._w, self._r, self._log):
            f.close()
        shutil.rmtree(self._scratch, ignore_errors=True)
        if self._temp_log and self.proc.returncode == 0:
            self.log_file.unlink(missing_ok=True)  # kept when the worker failed: errors point at it


def compile_request(spec: GraphSpec, onnx_path: Path, **extra: Any) -> dict[str, Any]:
    """The worker's build/load request for one graph."""
    return {"name": spec.name, "onnx": str(Path(onnx_path).resolve()), "rows": list(spec.rows),
            "inputs": [[n, w] for n, w in spec.inputs], "outputs": [n for n, _ in spec.outputs], **extra}


class SimRunner:
    """The rknn-toolkit2 simulator (fp16, or w8a8 for graphs given a "quant" request) over the
    ONNX graphs, in a converter-venv worker.

    Builds every graph from ONNX at start (the simulator cannot load `.rknn` files), so start-up
    takes as long as a conversion without export; meant for tests and for checking numerics. An
    int8 graph is quantized again from the converter's calibration inputs (`calib/`).
    """

    name = "rknn-sim"
    act_dtype = np.float16

    def __init__(self, specs: Sequence[GraphSpec], onnx_files: Mapping[str, Path],
                 python: str | Path | None = None, progress=None, quant: Mapping[str, dict | None] | None = None,
                 dtype: str = "fp16"):
        self.worker = ToolkitWorker(python)
        try:
            for spec in specs:
                if progress:
                    progress(spec)
                q = (quant or {}).get(spec.name)
                self.worker.call({"op": "load", **compile_request(spec, onnx_files[spec.name], quant=q)})
        except BaseException:
            self.worker.close()
            raise
        self.numerics = f"rknn-sim-{self.worker.version}-{dtype}"

    def run(self, spec: GraphSpec, inputs: Sequence[np.ndarray]) -> list[np.ndarray]:
        rows = check_inputs(spec, inputs)
        _, out = self.worker.call({"op": "run", "name": spec.name}, inputs)
        if len(out) != len(spec.outputs) or any(o.shape != (rows, w) for o, (_, w) in zip(out, spec.outputs)):
            raise RunnerError(f"{spec.name}: simulator returned {[o.shape for o in out]}")
        return out

    def close(self) -> None:
        self.worker.close()
