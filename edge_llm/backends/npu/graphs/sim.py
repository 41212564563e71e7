"""`SimRunner`: the rknn-toolkit2 simulator runs the exported graphs (fp16, or w8a8), built from
ONNX in a worker process of the converter venv (`toolkit_worker.py`, spoken to in `wire.py`
messages over two pipes; the toolkit never loads in this process). `ToolkitWorker` is that
process, shared with the converter (`edge-llm convert rknn`)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from edge_llm.backends.graph.runners import check_inputs
from edge_llm.backends.graph.schema import GraphSpec
from edge_llm.backends.npu.graphs import wire
from edge_llm.errors import ConfigError, RunnerError

CONVERTER_ENV = "EDGE_LLM_CONVERTER_PYTHON"
WORKER = Path(__file__).with_name("toolkit_worker.py")
CHECKOUT = Path(__file__).resolve().parents[4]  # edge_llm/backends/npu/graphs/ -> the checkout


def converter_python(explicit: str | None = None) -> Path:
    """The converter venv's python: explicit, $EDGE_LLM_CONVERTER_PYTHON, or the checkout's
    `.venv-converter` (made by tools/setup-converter.sh)."""
    cand = explicit or os.environ.get(CONVERTER_ENV)
    path = Path(cand) if cand else CHECKOUT / ".venv-converter" / "bin" / "python"
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
