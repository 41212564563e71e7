"""The rknn-toolkit2 worker: runs in the converter venv, never imported by edge_llm.

Started as `<converter python> toolkit_worker.py READ_FD WRITE_FD` by the converter
(`edge-llm convert rknn`) and by the simulator runner. It imports only the standard library,
numpy, the toolkit (`rknn.api`) and `wire.py` from its own directory. Requests (wire messages):

- {"op": "build", ...}: ONNX -> fp16 (or, with "quant", w8a8) `.rknn` for rk3588 with one static shape per row count
  (rknn `dynamic_input`, so the shapes share one weight copy), the compiler's per-op cycle
  table per shape (its cost estimate), the ops it placed on the CPU, and, given sample inputs
  and reference outputs, the simulator's accuracy per shape.
- {"op": "load", ...}: the same build, kept in memory with the simulator initialised
  (`init_runtime()` without target: it cannot load a `.rknn` file, only what it just built).
- {"op": "run", "name": ..., arrays}: simulator inference of a loaded graph.
- {"op": "version"} / {"op": "quit"}.
Every reply is {"ok": true, ...} or {"ok": false, "error": "..."}.
The toolkit prints to stdout; the worker points fd 1 at stderr so nothing mixes with replies.
This file's directory is removed from sys.path first: no module of edge_llm beside it may shadow
one of the toolkit's (its `rknn` package; `rknnlite.py` lives here).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import re
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np

_HERE = Path(__file__).resolve().parent
# Python put this directory first on sys.path: nothing here may shadow the toolkit's packages
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
_spec = importlib.util.spec_from_file_location("edge_llm_wire", _HERE / "wire.py")
wire = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(wire)  # stdlib + numpy only

TARGET = "rk3588"
_ROW = re.compile(r"^\s*\d+\s+(\w+)\s+(\w+)\s+(CPU|NPU)\s+(\S+)\s+(\S+)\s+(\d+)/(\d+)/(\d+)\s+(\S+)\s+(\S+)")


@contextlib.contextmanager
def _capture_fds(path: str):
    """fd 1 and 2 into `path`: the compiler's native code prints its tables there, not to a
    Python logger."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for f in (fd, *saved):
            os.close(f)


def _dataset(req: dict, quant: dict, tmp: str) -> str:
    """The toolkit's dataset file: one line per sample of the largest shape, `.npy` paths of its
    inputs separated by spaces, cut from the calibration inputs (all rows) in quant["dataset"]."""
    r = max(req["rows"])
    with np.load(quant["dataset"]) as z:
        arrays = [np.asarray(z[n], dtype=np.float32) for n, _ in req["inputs"]]
    n = min(len(arrays[0]) // r, int(quant.get("max_samples", 64)))
    lines = []
    for k in range(max(n, 1)):
        paths = []
        for name, a in zip((n_ for n_, _ in req["inputs"]), arrays):
            p = os.path.join(tmp, f"{name}.{k}.npy")
            np.save(p, np.ascontiguousarray(a[k * r:(k + 1) * r]))
            paths.append(p)
        lines.append(" ".join(paths))
    path = os.path.join(tmp, "dataset.txt")
    Path(path).write_text("\n".join(lines) + "\n")
    return path


def _compile(req: dict, verbose: bool = False):
    """Build one graph: fp16, or with req["quant"] = {dtype, algorithm, method, dataset} int8."""
    from rknn.api import RKNN

    rk = RKNN(verbose=verbose)
    rows, inputs = req["rows"], req["inputs"]  # inputs: [[name, width], ...]
    dyn = [[[r, w] for _, w in inputs] for r in rows] if len(rows) > 1 else None
    quant = req.get("quant")
    qargs = ({"quantized_dtype": quant["dtype"], "quantized_algorithm": quant["algorithm"],
              "quantized_method": quant["method"]} if quant else {})
    _check(rk.config(target_platform=TARGET, float_dtype="float16", dynamic_input=dyn,
                     optimization_level=3, **qargs), "config")
    if dyn:  # input order and widths come from the ONNX graph itself
        _check(rk.load_onnx(model=req["onnx"]), "load_onnx")
    else:
        _check(rk.load_onnx(model=req["onnx"], inputs=[n for n, _ in inputs],
                            input_size_list=[[rows[0], w] for _, w in inputs]), "load_onnx")
    if not quant:
        _check(rk.build(do_quantization=False), "build")
        return rk
    with tempfile.TemporaryDirectory(prefix="edge-llm-calib-") as tmp:
        _check(rk.build(do_quantization=True, dataset=_dataset(req, quant, tmp)), "build (quantized)")
    return rk


def _check(ret, what: str) -> None:
    if ret != 0:
        raise RuntimeError(f"rknn {what} returned {ret}")


def parse_cost(log_text: str) -> list[dict]:
    """The compiler's layer tables (one per static shape): total cycles and ops placed on CPU."""
    tables, cur = [], None
    for line in log_text.splitlines():
        if "Network Layer Information Table" in line:
            cur = {"cycles": 0, "ddr_cycles": 0, "npu_cycles": 0, "ops": 0, "cpu_ops": [], "rows": None}
            tables.append(cur)
            continue
        if cur is None:
            continue
        body = line.split("] ", 1)[1] if "] " in line else line
        m = _ROW.match(body)
        if not m:
            continue
        op, _dtype, target, _in, out_shape, ddr, npu, total = m.groups()[:8]
        cur["ops"] += 1
        cur["ddr_cycles"] += int(ddr)
        cur["npu_cycles"] += int(npu)
        cur["cycles"] += int(total)
        if op == "InputOperator" and cur["rows"] is None:
            cur["rows"] = int(out_shape.strip("()").split(",")[0])
        elif target == "CPU" and op not in ("InputOperator", "OutputOperator"):
            cur["cpu_ops"].append(op)
    return tables


def _sample(samples: dict, key: str, r: int):
    """`key@r` when the samples hold one input of that shape (the vision tower: one image per
    patch count), else the first r rows of `key` (decoder graphs: rows of one calibration run)."""
    return samples[f"{key}@{r}"] if f"{key}@{r}" in samples else samples[key][:r]


def _accuracy(rk, req: dict, samples: dict) -> dict:
    out = {}
    names_in = [n for n, _ in req["inputs"]]
    for r in req["rows"]:
        xs = [np.ascontiguousarray(_sample(samples, f"in.{n}", r)) for n in names_in]
        ys = rk.inference(inputs=xs)
        if ys is None:
            raise RuntimeError(f"simulator inference failed at {r} rows")
        per = {}
        for name, y in zip(req["outputs"], ys):
            ref = _sample(samples, f"out.{name}", r).astype(np.float64)
            y = np.asarray(y, dtype=np.float64).reshape(ref.shape)
            d = np.abs(y - ref)
            # per row too: one row with massive values dominates the whole-block cosine
            norms = np.linalg.norm(y, axis=1) * np.linalg.norm(ref, axis=1)
            live = norms > 0
            rows_cos = (y * ref).sum(axis=1)[live] / norms[live] if live.any() else np.ones(1)
            per[name] = {
                "max_rel": float(d.max() / max(np.abs(ref).max(), 1e-30)),
                "mean_rel": float(d.mean() / max(np.abs(ref).mean(), 1e-30)),
                "cosine": float((y * ref).sum() / max(np.linalg.norm(y) * np.linalg.norm(ref), 1e-30)),
                "row_cosine_mean": float(rows_cos.mean()),
                "row_cosine_min": float(rows_cos.min()),
            }
        out[str(r)] = per
    return out


def op_build(req: dict) -> dict:
    t0 = time.time()
    fd, log_path = tempfile.mkstemp(suffix=".rknn-build.log")
    os.close(fd)
    try:
        with _capture_fds(log_path):
            rk = _compile(req, verbose=True)
        text = Path(log_path).read_text(errors="replace")
        sys.stderr.write(text[-20000:])  # the end of it into the build log
        try:
            tmp = req["out"] + ".tmp"
            _check(rk.export_rknn(tmp), "export_rknn")
            os.replace(tmp, req["out"])
            build_s = time.time() - t0
            acc = None
            if req.get("samples"):
                _check(rk.init_runtime(), "init_runtime (simulator)")
                acc = _accuracy(rk, req, dict(np.load(req["samples"])))
        finally:
            rk.release()
        cost = parse_cost(text)
    finally:
        os.unlink(log_path)
    data = Path(req["out"]).read_bytes()
    return {"ok": True, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(),
            "build_seconds": build_s, "seconds": time.time() - t0, "cost": cost, "accuracy": acc}


LOADED: dict = {}


def op_load(req: dict) -> dict:
    rk = _compile(req)
    _check(rk.init_runtime(), "init_runtime (simulator)")
    LOADED[req["name"]] = (rk, req)
    return {"ok": True}


def op_run(req: dict, arrays: list) -> tuple[dict, list]:
    rk, spec = LOADED[req["name"]]
    ys = rk.inference(inputs=[np.ascontiguousarray(a, dtype=np.float32) for a in arrays])
    if ys is None:
        raise RuntimeError(f"simulator inference of {req['name']} returned None")
    return {"ok": True}, [np.ascontiguousarray(y, dtype=np.float32).reshape(len(arrays[0]), -1) for y in ys]


def version() -> str:
    import importlib.metadata as md

    return md.version("rknn-toolkit2")


def main() -> int:
    rfd, wfd = int(sys.argv[1]), int(sys.argv[2])
    os.dup2(2, 1)  # the toolkit prints progress to stdout
    rf, wf = os.fdopen(rfd, "rb"), os.fdopen(wfd, "wb")
    while True:
        try:
            req, arrays = wire.recv(rf)
        except wire.WireError:
            return 0
        op = req.get("op")
        out: list = []
        try:
            if op == "quit":
                wire.send(wf, {"ok": True})
                return 0
            if op == "version":
                reply = {"ok": True, "toolkit": version(), "numpy": np.__version__}
            elif op == "build":
                reply = op_build(req)
            elif op == "load":
                reply = op_load(req)
            elif op == "run":
                reply, out = op_run(req, arrays)
            else:
                reply = {"ok": False, "error": f"unknown op {op!r}"}
        except Exception as e:  # reported to the caller, which raises a clear error
            traceback.print_exc()
            reply, out = {"ok": False, "error": f"{type(e).__name__}: {e}"}, []
        wire.send(wf, reply, out)


if __name__ == "__main__":
    sys.exit(main())
