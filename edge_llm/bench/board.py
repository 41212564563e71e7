"""`edge-llm bench board`: one report a board owner sends back (docs/board.md, "The board report").

The existing benchmarks, run once each at sizes a board finishes in minutes (`Sizes.quick`: seconds,
for the tests), into one Markdown file that ends with the whole result as a JSON block:

- the machine: CPU, ISA, the device tree's board model, kernel, librknnrt and RKNPU driver versions,
  edge-llm's version;
- the NPU start-up self-test's answers (`backends/npu/matmul/selftest.py`), every probe run for the
  report (the answers a server keeps are not reused) for the npu-mm directory's largest part;
- the matmul path's accuracy against the F32 CPU backend (`bench.accuracy`), over the library when
  there is one, else over the exact host emulation;
- the matmul engine's per-call cost and GB/s (`bench.npu.matmul`), and the prediction at the
  published and at the measured rates with cpu-q's decode on the A76 cores beside it
  (`bench.npu.cpu.run_prediction`, `bench.npu.a76`);
- the store disk's raw write + fsync and cold read (`bench.disk`), snapshot save and restore at
  2K and 8K tokens of the model's KV geometry (`bench.restore`);
- decode plain and with drafting (`bench.decode`): cpu-q, and the matmul path when a library is there.

Each section that fails records "not run: <reason>" and the others still run. Without an NPU any
library is a stand-in (the tests' fake librknnrt): the report's first lines say its numbers are
not a board's.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import shutil
import secrets
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

JSON_FENCE = "```json"


@dataclass(frozen=True)
class Sizes:
    """How much each section measures (`FULL` on a board, `QUICK` for a test run)."""

    teacher_tokens: int
    greedy_tokens: int
    matmul_reps: int
    stream_reps: int
    stream_shapes: tuple[str, ...]  # of bench.npu.matmul.STREAM_SHAPES, the first one gives the measured rates
    contexts: tuple[int, ...]  # the prediction's decode contexts
    drafting_tokens: int
    repeats: int
    disk_bytes: int
    restore_contexts: tuple[int, ...]
    scan_files: int
    decode_tokens: int
    families: tuple[str, ...]
    threads: int


FULL = Sizes(320, 100, 200, 5, ("2048x6144", "2B head / 3"), (512, 2048, 8192), 128, 3, 256 << 20, (2048, 8192),
             8, 128, ("recall", "code", "chat"), 4)
QUICK = Sizes(32, 0, 20, 2, ("2048x6144",), (256,), 0, 1, 8 << 20, (2048, 8192), 2, 8, ("recall",), 2)


@dataclass(frozen=True)
class Where:
    """What the NPU sections run on: `lib` (a librknnrt path or name, None: none), `npu` (the device
    node, None: no NPU on this machine)."""

    lib: str | None
    npu: str | None

    @property
    def fake(self) -> bool:
        return self.lib is not None and self.npu is None

    def headline(self) -> str:
        if self.fake:
            return (f"ran over a fake librknnrt ({self.lib}; no NPU on this machine): numbers are not a board's. "
                    "The NPU sections measure that stand-in's C code on this CPU.")
        if self.lib is None:
            return ("no NPU and no librknnrt on this machine: the NPU sections were not run (the matmul path's "
                    "accuracy ran over the exact host emulation); the CPU sections are this machine's.")
        return f"NPU at {self.npu}, librknnrt {self.lib}."


def machine_facts(where: Where, sysroot: str = "/") -> dict:
    """CPU, ISA, board model, kernel, librknnrt and driver versions, edge-llm's version."""
    from edge_llm import __version__
    from edge_llm.backends.cpuq.backend import kernel_isa
    from edge_llm.backends.npu.backend import librknnrt_version
    from edge_llm.backends.npu.matmul.binding import NPU_DRIVER_DEBUGFS, npu_driver_version
    from edge_llm.bench.npu.cpu import cpu_isa
    from edge_llm.bench.npu.matmul import machine

    root = Path(sysroot)

    def text(rel: str) -> str | None:
        try:
            return (root / rel).read_text(errors="replace").strip("\0\n ")
        except OSError:
            return None

    lib_version = None
    if where.lib is not None:
        try:
            lib_version = librknnrt_version(Path(where.lib).read_bytes()) or "no version string in the file"
        except OSError as e:
            lib_version = f"not read ({e.strerror or e}): found by the dynamic loader"
    drv = text(NPU_DRIVER_DEBUGFS)
    return {"cpu": machine(), "cpus": len(os.sched_getaffinity(0)), "isa": cpu_isa(), "cpu_q_kernels": kernel_isa(),
            "board": text("proc/device-tree/model"), "kernel": f"{platform.system()} {platform.release()} "
            f"{platform.version()}", "python": platform.python_version(), "edge_llm": __version__,
            "npu": where.npu, "librknnrt": where.lib, "librknnrt_version": lib_version,
            "npu_driver": (npu_driver_version(drv) if drv else None)
            or ("unknown (debugfs not readable: run as root)" if where.npu else None)}


def not_run(reason: str) -> dict:
    return {"status": "not run", "reason": reason}


def section(name: str, fn: Callable[[], dict], step: Callable[[str], None]) -> dict:
    """`fn`'s result, or what stopped it: a section's failure is its own, never the report's."""
    step(name)
    try:
        return {"status": "ok", **fn()}
    except Exception as e:  # noqa: BLE001 - any failure of one benchmark is that section's result
        log.warning("bench board: section %s not run: %s", name, e, exc_info=True)
        return not_run(f"{type(e).__name__}: {e}")


def run(model: str, mm_dir: str | None, where: Where, store_dir: Path, sizes: Sizes = FULL,
        step: Callable[[str], None] = lambda _m: None) -> dict:
    """Every section (module docstring); `mm_dir`: an `edge-llm convert npu-mm` directory of `model`,
    None: one converted here, round to nearest."""
    from edge_llm.checkpoints.default import resolve_model_dir

    res: dict = {"headline": where.headline(), "fake_library": where.fake, "quick": sizes == QUICK,
                 "model": model, "sections": {}}
    s = res["sections"]
    s["machine"] = section("machine", lambda: machine_facts(where), step)
    model_dir = resolve_model_dir(model)
    with tempfile.TemporaryDirectory(prefix="edge-llm-board-") as tmp:
        if mm_dir is None:
            s["conversion"] = section("npu-mm conversion", lambda: _convert(model_dir, Path(tmp) / "mm"), step)
            if s["conversion"]["status"] == "ok":
                mm_dir = str(Path(tmp) / "mm")
        else:
            s["conversion"] = {"status": "ok", "made_here": False, "dir": str(mm_dir)}
        no_mm = not_run(f"no npu-mm directory: {s['conversion'].get('reason', '')}")
        s["self_test"] = (section("self-test", lambda: _self_test(where, mm_dir), step) if where.lib and mm_dir else
                          not_run("no librknnrt: no NPU device on this machine and no --lib / $EDGE_LLM_LIBRKNNRT")
                          if mm_dir else no_mm)
        s["accuracy"] = section("accuracy", lambda: _accuracy(model_dir, mm_dir, where, sizes), step) \
            if mm_dir else no_mm
        s["matmul"] = section("matmul rates", lambda: _matmul(where, sizes), step) if where.lib else \
            not_run("no librknnrt: no NPU device on this machine and no --lib / $EDGE_LLM_LIBRKNNRT")
        s["prediction"] = section("prediction", lambda: _prediction(model_dir, mm_dir, where, sizes, s["matmul"]),
                                  step) if mm_dir else no_mm
        work = store_dir / f"board-bench-{secrets.token_hex(4)}"
        try:
            s["disk"] = section("store disk", lambda: _disk(work, sizes), step)
            s["restore"] = section("restore", lambda: _restore(work, model_dir, sizes), step)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        s["decode"] = section("decode", lambda: _decode(model_dir, mm_dir, where, sizes, step), step)
    return res


def _convert(model_dir: Path, out: Path) -> dict:
    from edge_llm.convert.npu_mm import convert_mm8

    convert_mm8(model_dir, out, gptq_tokens=0)
    return {"made_here": True, "gptq": False, "note": "converted for this report, round to nearest (no GPTQ): "
            "less accurate than `edge-llm convert npu-mm`'s default"}


def _self_test(where: Where, mm_dir: str) -> dict:
    """The NPU start-up self-test (docs/npu.md, "The start-up self-test") for the largest part of
    `mm_dir`'s model, every probe run now: the answers a server keeps are not reused here."""
    from edge_llm.backends.npu.matmul import binding as api
    from edge_llm.backends.npu.matmul.decoder import matmul_shapes
    from edge_llm.backends.npu.matmul.selftest import largest_part, run_self_test

    lib = api.load_library(api.library_path(where.lib))
    with tempfile.TemporaryDirectory(prefix="edge-llm-selftest-") as tmp:
        return run_self_test(lib, largest_part(matmul_shapes(mm_dir)), cache=Path(tmp) / "selftest.json").to_dict()


def _accuracy(model_dir: Path, mm_dir: str, where: Where, sizes: Sizes) -> dict:
    from edge_llm.bench import accuracy

    runner = "librknnrt" if where.lib else "host"
    return {"runner": runner, **accuracy.run(str(model_dir), "rknn", mm_dir, runner, sizes.teacher_tokens,
                                             greedy_tokens=sizes.greedy_tokens)}


def _matmul(where: Where, sizes: Sizes) -> dict:
    from edge_llm.bench.npu.matmul import STREAM_SHAPES, bench_matmul

    shapes = {k: STREAM_SHAPES[k] for k in sizes.stream_shapes}
    return bench_matmul(where.lib, reps=sizes.matmul_reps, stream_reps=sizes.stream_reps, shapes=shapes).as_dict()


def _prediction(model_dir: Path, mm_dir: str, where: Where, sizes: Sizes, matmul: dict) -> dict:
    from edge_llm.bench.npu.cpu import run_prediction
    from edge_llm.bench.npu.predict import Rates

    at = {}
    if matmul.get("status") == "ok":
        first = matmul["gbps"][next(iter(matmul["gbps"]))]
        at["measured"] = Rates(bw_core_gbs=first["1 core"], bw_all_gbs=first["3 cores"], call_us=matmul["lib_run_us"],
                               engine_us=matmul["engine_us"])
    return run_prediction(model_dir, mm_dir, drafting_tokens=sizes.drafting_tokens, repeats=sizes.repeats,
                          contexts=sizes.contexts, lib=where.lib, at_rates=at)


def _disk(work: Path, sizes: Sizes) -> dict:
    from edge_llm.bench.disk import measure_raw

    return {"directory": str(work.parent), **measure_raw(work, sizes.disk_bytes).to_dict()}


def _restore(work: Path, model_dir: Path, sizes: Sizes) -> dict:
    from edge_llm.bench import restore
    from edge_llm.config import ModelArgs

    g = ModelArgs.from_dir(model_dir).geometry
    return restore.run(work / "restore", g, list(sizes.restore_contexts), scan_files=sizes.scan_files,
                       repeats=sizes.repeats)


def _decode(model_dir: Path, mm_dir: str | None, where: Where, sizes: Sizes, step) -> dict:
    from edge_llm.bench import decode

    backends, settings = ["cpu-q"], {}
    if where.lib and mm_dir:
        backends.append("rknn")
        settings["rknn"] = {"rknn_dir": mm_dir, "rknn_runner": "librknnrt"}
    return decode.run(tuple(backends), sizes.families, sizes.decode_tokens, sizes.threads, sizes.repeats,
                      step=step, model=str(model_dir), settings=settings)


def markdown(res: dict) -> str:
    """The report: the headline first, each section's table (the benchmarks' own Markdown), then
    the whole result as a JSON block (`read_report` parses it back)."""
    from edge_llm.bench import accuracy, decode, restore
    from edge_llm.bench.npu import a76, predict

    s = res["sections"]
    lines = ["# edge-llm board report", "", f"**{res['headline']}**", ""]
    if res["quick"]:
        lines += ["Run with --quick: small sizes, for a check of the report itself, not a measurement.", ""]

    def head(name: str, title: str, label: str = "") -> bool:
        lines.extend([f"## {title}", ""])
        if s[name]["status"] != "ok":
            lines.extend([f"{label}: not run ({s[name]['reason']})" if label else f"not run: {s[name]['reason']}", ""])
            return False
        return True

    if head("machine", "Machine"):
        lines += [f"- {k}: {v if v is not None else '-'}" for k, v in s["machine"].items() if k != "status"] + [""]
    if head("self_test", "NPU self-test", "self-test"):
        lines += ["```", json.dumps({k: v for k, v in s["self_test"].items() if k != "status"}, indent=1), "```", ""]
    if s["conversion"]["status"] == "ok" and s["conversion"].get("made_here"):
        lines += [f"npu-mm conversion: {s['conversion']['note']}", ""]
    if head("accuracy", "Accuracy of the matmul path"):
        lines += [f"runner: {s['accuracy']['runner']}", "", accuracy.markdown(s["accuracy"])]
    if head("matmul", "Matmul rates"):
        m = s["matmul"]
        lines += [f"- run {m['run_us']:.1f} us (rknn_matmul_run {m['lib_run_us']:.1f} us), a round over "
                  f"{m['round_cores']} cores {m['round_us']:.1f} us, the engine's own {m['engine_us']:.1f} us"]
        lines += [f"- stream {k}: " + ", ".join(f"{c} {v:.2f} GB/s" for c, v in by.items())
                  for k, by in m["gbps"].items()]
        lines.append("")
    if head("prediction", "Prediction"):
        p = s["prediction"]
        lines += [predict.markdown(p, p["cpu"]["isa"])]
        for label, q in p.get("at_rates", {}).items():
            lines += [f"At the {label} rates: " + ", ".join(f"decode at {d['context']} {d['tok_s']:.2f} tok/s"
                                                            for d in q["decode"]), ""]
        lines += [a76.markdown(p["cpu_q"], p["decode"][0]["tok_s"])]
    if head("disk", "Store disk (raw)"):
        d = s["disk"]
        lines += [f"- {d['directory']}: write + fsync {d['write']['mb_s']:.1f} MB/s, cold read "
                  f"{d['read']['mb_s']:.1f} MB/s ({d['write']['nbytes']:,} bytes)", ""]
    if head("restore", "Snapshot save and restore"):
        lines += [restore.markdown(s["restore"])]
    if head("decode", "Decode, plain and with drafting"):
        lines += [decode.markdown(s["decode"])]
    lines += ["## The whole result", "", JSON_FENCE, json.dumps(res, indent=1, default=str), "```", ""]
    return "\n".join(lines)


def read_report(text: str) -> dict:
    """The JSON block of a report `markdown` wrote."""
    start = text.rindex(JSON_FENCE + "\n") + len(JSON_FENCE) + 1
    return json.loads(text[start:text.index("\n```", start)])
