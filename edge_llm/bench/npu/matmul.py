"""The NPU matmul micro-benchmark (`bench npu` runs it on a board): the per-call overhead of
`NpuInt8Matmul.run` and the GB/s it streams weights at, on one NPU core and over three.

- overhead: the median time of `run` at M = 1 on a 32 x 32 weight (nothing to stream), next to
  the median of `rknn_matmul_run` alone on the same context: the library's fixed cost and what
  the binding adds (copies in and out, the ctypes call); and a round: `run` on a 32-column part
  per core (32 x 96 over the three cores), its parts on the caller's thread and the engine's helper
  threads, with a CPU pause between rounds as a decode token has (`ROUND_GAP_US`), over as many
  cores as this machine has CPUs for (a thread each: on a board three of its eight; here maybe
  fewer). `round_us - lib_run_us` is the engine's own time per round, which the prediction counts
  (`predict.Rates.engine_us`); the same round on Python's thread pool (`pool_round_us`, the
  fallback without the operator library) for comparison;
- GB/s: int8 weight bytes / median time of `run` at M = 1, for a 2048 x 6144 weight (the 2B's
  gate/up width) and one core's third of the 2B head (2048 x 50656), on core 0 and over 0, 1, 2.

Every figure is labelled with the engine's `numerics` (the library's hash) and the machine: on a
machine without an NPU the library is the tests' fake, and the numbers describe that C code on
this CPU, not an NPU (docs/npu.md, "The matmul API binding").
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from edge_llm.backends.npu.matmul.engine import CORES, open_npu_matmul, split_columns

HEAD_2B = (2048, 151936)  # Qwen3-VL-2B's tied head (hidden, vocab)
STREAM_SHAPES = {"2048x6144": (2048, 6144),
                 "2B head / 3": (HEAD_2B[0], split_columns(HEAD_2B[1], 3)[0][1])}
TINY = (32, 32)
ROUND_GAP_US = 50.0  # CPU work between two rounds of a decode token (x86 here: docs/npu.md, "Prediction")


@dataclass
class MatmulBench:
    numerics: str  # of the one-core engine (the library's hash)
    machine: str
    run_us: float  # median NpuInt8Matmul.run, M = 1, 32 x 32, one core
    lib_run_us: float  # median rknn_matmul_run alone, same context
    round_us: float = 0.0  # median NpuInt8Matmul.run, M = 1, a 32-column part on each of `round_cores`
    round_cores: int = 0
    round_c: bool = False  # the round above ran in C (rounds.py), not on Python's pool
    pool_round_us: float = 0.0  # the same round on Python's thread pool (the fallback), to compare
    gbps: dict[str, dict[str, float]] = field(default_factory=dict)  # shape -> {"1 core", "3 cores"} -> GB/s

    def lines(self) -> list[str]:
        out = [f"NPU matmul engine {self.numerics} on {self.machine}",
               f"  per-call: run {self.run_us:.1f} us (M=1, 32x32, one core), of it rknn_matmul_run "
               f"{self.lib_run_us:.1f} us; a round over {self.round_cores} cores {self.round_us:.1f} us "
               f"{'in C' if self.round_c else 'on Python threads'} (the engine's own {self.engine_us:.1f} us), "
               f"on Python's thread pool {self.pool_round_us:.1f} us"]
        for shape, by in self.gbps.items():
            out.append(f"  stream {shape} int8, M=1: " + ", ".join(f"{k} {v:.2f} GB/s" for k, v in by.items()))
        return out

    @property
    def engine_us(self) -> float:
        """The engine's time per round around the library's call: copies, hand-off, Python."""
        return max(self.round_us - self.lib_run_us, 0.0)

    def as_dict(self) -> dict:
        return {**asdict(self), "engine_us": self.engine_us}


def machine() -> str:
    """The CPU the figures were taken on (the fake computes there; on a board it only drives the NPU)."""
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith(("model name", "cpu part")):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{platform.machine()} ({name})"


def _median_s(fn: Callable[[], object], reps: int, gap_s: float = 0.0) -> float:
    """The median time of `fn`, with `gap_s` of CPU work (a busy loop) between two calls."""
    fn()  # warm: sets the dynamic shape, faults the buffers in
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
        while time.perf_counter() - t < times[-1] + gap_s:
            pass
    return statistics.median(times)


def round_cores() -> tuple[int, ...]:
    """The NPU cores a round is measured over: as many as this process has CPUs for (a thread each)."""
    return CORES[:max(1, min(len(CORES), len(os.sched_getaffinity(0))))]


def bench_matmul(lib: str | None = None, reps: int = 200, stream_reps: int = 5,
                 shapes: dict[str, tuple[int, int]] = STREAM_SHAPES,
                 core_sets: Sequence[Sequence[int]] = ((0,), CORES)) -> MatmulBench:
    """Measure `lib` (None: `$EDGE_LLM_LIBRKNNRT`, else librknnrt.so)."""
    rng = np.random.default_rng(0)
    one = open_npu_matmul(lib, cores=(0,))
    try:
        one.add("tiny", rng.integers(-127, 128, TINY, dtype=np.int8))
        a = rng.integers(-127, 128, (1, TINY[0]), dtype=np.int8)
        run_s = _median_s(lambda: one.run("tiny", a), reps)
        ctx = one.weights["tiny"][0].ctx
        lib_s = _median_s(lambda: one.lib.run(ctx), reps)
        res = MatmulBench(one.numerics, machine(), run_s * 1e6, lib_s * 1e6)
    finally:
        one.close()
    cores = round_cores()
    res.round_cores = len(cores)
    w = rng.integers(-127, 128, (TINY[0], TINY[1] * len(cores)), dtype=np.int8)
    for c_round in (True, False):  # the engine's round (C where built), then Python's pool to compare
        many = open_npu_matmul(lib, cores=cores, c_round=c_round)
        try:
            many.add("round", w)
            us = _median_s(lambda: many.run("round", a), reps, ROUND_GAP_US / 1e6) * 1e6
        finally:
            many.close()
        if c_round:
            res.round_us, res.round_c = us, many.round is not None
        else:
            res.pool_round_us = us
    for label, (K, N) in shapes.items():
        w = rng.integers(-127, 128, (K, N), dtype=np.int8)
        a = rng.integers(-127, 128, (1, K), dtype=np.int8)
        for cores in core_sets:
            eng = open_npu_matmul(lib, cores=cores)
            try:
                eng.add(label, w)
                s = _median_s(lambda: eng.run(label, a), stream_reps)
            finally:
                eng.close()
            res.gbps.setdefault(label, {})[f"{len(cores)} core{'s' if len(cores) > 1 else ''}"] = K * N / s / 1e9
    return res
