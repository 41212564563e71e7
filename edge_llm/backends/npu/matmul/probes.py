"""The start-up self-test's probes of librknnrt's matmul path, each through `NpuInt8Matmul` itself
(the vendor demo's call sequence, the engine's cut, its rounds) against the host emulation
(`HostInt8Matmul`), bit for bit. `selftest.py` runs them, caches the answers and decides what the
engine does with them (docs/npu.md, "The start-up self-test").

Every probe answers with a `Probe` (what was seen, in words, and whether it passed); a call the
library refuses is an answer too (`RknnMatmulError`'s text), never an exception out of here.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edge_llm.backends.npu.matmul import binding as api
from edge_llm.backends.npu.matmul.engine import M_SHAPES, NpuInt8Matmul
from edge_llm.backends.npu.matmul.int8 import HostInt8Matmul
from edge_llm.errors import ConfigError, RknnMatmulError

SMALL = (64, 64)  # (K, N) of a per-core probe: one 32-wide block more than the smallest in each
SPREAD = (512, 1536)  # (K, N) of the concurrency probe's weight: 512 columns a core
TIMED_RUNS = 8  # rounds timed each way in the concurrency probe
COLUMNS = 8192  # the head part's expected product is computed this many columns at a time (RAM)


@dataclass(frozen=True)
class Probe:
    ok: bool
    text: str
    call: bool = False  # failed because the library refused a call (the NPU may have been busy)
    serialize: bool = False  # the concurrency probe: wrong at once, right one after another


def weight(k: int, n: int, seed: int) -> np.ndarray:
    """A random (k, n) int8 weight in [-127, 127] with both extremes in it (random bytes, -128
    raised to -127: a head part's 100 MB in a fraction of a second)."""
    w = np.frombuffer(np.random.default_rng(seed).bytes(k * n), np.int8).reshape(k, n).copy()
    np.maximum(w, -127, out=w)
    w[0, :2] = (127, -127)
    return w


def rows(m: int, k: int, seed: int) -> np.ndarray:
    a = np.random.default_rng(seed).integers(-127, 128, size=(m, k), dtype=np.int8)
    a[0, :2] = (127, -127)
    return a


def expected(a: np.ndarray, w: np.ndarray) -> np.ndarray:
    """A @ W in the host emulation, COLUMNS at a time (a head part's float32 copy stays small)."""
    out = np.empty((a.shape[0], w.shape[1]), np.int32)
    for n0 in range(0, w.shape[1], COLUMNS):
        host = HostInt8Matmul()
        host.add("w", np.ascontiguousarray(w[:, n0:n0 + COLUMNS]))
        out[:, n0:n0 + COLUMNS] = host.run("w", a)
    return out


def _first_difference(got: np.ndarray, want: np.ndarray) -> str:
    r, c = (int(i) for i in np.argwhere(got != want)[0])
    return f"row {r} column {c}: {int(got[r, c])} instead of {int(want[r, c])}"


def parse_driver(text: str) -> tuple[int, ...] | None:
    v = api.npu_driver_version(text)
    return tuple(int(x) for x in v.split(".")) if v else None


def versions(lib: api.MatmulLib, core: int, domain: int, sysroot: str | Path = "/") -> tuple[str, str, str]:
    """(api version, driver version, where the driver's came from): `rknn_query`'s
    RKNN_QUERY_SDK_VERSION on a matmul context when the library answers it, else the driver's
    debugfs file; "unknown" for what neither says."""
    api_v, drv, source = "unknown", "", ""
    if lib.has("rknn_query"):
        eng = NpuInt8Matmul(lib, (core,), domain, c_round=False)
        try:
            eng.add("v", weight(*SMALL, 0))
            api_v, drv = eng.lib.sdk_version(eng.weights["v"][0].ctx)
            source = "rknn_query"
        except RknnMatmulError:
            pass
        finally:
            eng.close()
    if parse_driver(drv) is None:
        try:
            drv, source = (Path(sysroot) / api.NPU_DRIVER_DEBUGFS).read_text(), "debugfs"
        except OSError:
            drv, source = "", ""
    parsed = parse_driver(drv)
    return api_v.strip() or "unknown", ".".join(map(str, parsed)) if parsed else "unknown", source or "none"


def coherency(lib: api.MatmulLib, core: int, domain: int, sync: bool) -> Probe:
    """One context, bound once; new A written between two runs without a rebind, C read back
    after each: both products exact, or which was stale."""
    eng = NpuInt8Matmul(lib, (core,), domain, c_round=False, sync=sync)
    try:
        w = weight(*SMALL, 1)
        eng.add("c", w)
        for i, what in ((0, "C after the first run"), (1, "the second run (new A, no rebind)")):
            a = rows(4, SMALL[0], 10 + i)
            got, want = eng.run("c", a), expected(a, w)
            if not np.array_equal(got, want):
                return Probe(False, f"stale data in {what}: {_first_difference(got, want)}")
        return Probe(True, "A and C coherent" + (" with rknn_mem_sync" if sync else " without rknn_mem_sync"))
    except (RknnMatmulError, ConfigError) as e:
        return Probe(False, str(e), call=True)
    finally:
        eng.close()


def products(lib: api.MatmulLib, cores: Sequence[int], domain: int, sync: bool) -> Probe:
    """One small matmul on each core's one-core mask at every dynamic shape M, bitwise the host's."""
    for core in cores:
        eng = NpuInt8Matmul(lib, (core,), domain, c_round=False, sync=sync)
        try:
            w = weight(*SMALL, 2 + core)
            eng.add("p", w)
            for m in M_SHAPES:
                a = rows(m, SMALL[0], 100 + m)
                got, want = eng.run("p", a), expected(a, w)
                if not np.array_equal(got, want):
                    return Probe(False, f"core {core} at M={m}: {_first_difference(got, want)}")
        except RknnMatmulError as e:
            return Probe(False, f"core {core}: {e}", call=True)
        finally:
            eng.close()
    return Probe(True, f"bitwise the host's on cores {','.join(map(str, cores))} at M={','.join(map(str, M_SHAPES))}")


def _timed(eng: NpuInt8Matmul, a: np.ndarray, want: np.ndarray) -> tuple[str | None, float]:
    """(the first wrong product's difference or None, seconds a round): the first run sets the shape
    and binds, untimed; every run's product is checked."""
    wrong = None
    t_all = 0.0
    for i in range(TIMED_RUNS + 1):
        t0 = time.perf_counter()
        got = eng.run("s", a)
        if i:
            t_all += time.perf_counter() - t0
        if wrong is None and not np.array_equal(got, want):
            wrong = _first_difference(got, want)
    return wrong, t_all / TIMED_RUNS


def concurrency(lib: api.MatmulLib, cores: Sequence[int], domain: int, sync: bool) -> tuple[Probe, float, float]:
    """One weight cut over the cores (a context each): its rounds with the parts at once (the C
    round's threads, or Python's pool) against one after another on one thread, every product
    bitwise the host's; (answer, seconds a round at once, seconds one after another)."""
    w, a = weight(*SPREAD, 3), rows(1, SPREAD[0], 7)
    want = expected(a, w)
    out: dict[bool, tuple[str | None, float]] = {}
    for serial in (True, False):
        eng = NpuInt8Matmul(lib, cores, domain, sync=sync, serial=serial)
        try:
            eng.add("s", w)
            out[serial] = _timed(eng, a, want)
        except RknnMatmulError as e:
            return Probe(False, f"{'one after another' if serial else 'at once'}: {e}", call=True), 0.0, 0.0
        finally:
            eng.close()
    (one, t_one), (once, t_once) = out[True], out[False]
    times = f"{t_once * 1e3:.3f} ms a round at once, {t_one * 1e3:.3f} ms one after another"
    if one is not None:
        return Probe(False, f"wrong even one after another: {one}"), t_once, t_one
    if once is not None:
        return Probe(False, f"{len(cores)} contexts at once differ: {once} ({times})", serialize=True), t_once, t_one
    return Probe(True, f"{len(cores)} contexts at once bitwise equal to one after another ({times})"), t_once, t_one


def domain_switch(lib: api.MatmulLib, core: int, domain: int) -> Probe:
    """A buffer in another IOMMU domain, then back: whether the driver switches (the engine itself
    stays in `domain`: docs/npu.md, "IOMMU domains")."""
    other = 1 if domain == 0 else 0
    eng = NpuInt8Matmul(lib, (core,), other, c_round=False)
    try:
        eng.add("d", weight(*SMALL, 4))
        return Probe(True, f"a switch to domain {other} and back works")
    except RknnMatmulError as e:
        return Probe(False, f"a switch to domain {other} failed ({e}): only domain {domain} is usable")
    finally:
        eng.close()


def head_part(lib: api.MatmulLib, core: int, domain: int, part: tuple[int, int], sync: bool) -> Probe:
    """One context at the largest (K, N) part the engine will create for the model, one row."""
    k, n = part
    eng = NpuInt8Matmul(lib, (core,), domain, c_round=False, sync=sync)
    try:
        w = weight(k, n, 5)
        eng.add("h", w)
        a = rows(1, k, 9)
        got, want = eng.run("h", a), expected(a, w)
        if not np.array_equal(got, want):
            return Probe(False, f"{k}x{n}: {_first_difference(got, want)}")
        return Probe(True, f"{k}x{n} in one context: bitwise the host's")
    except RknnMatmulError as e:
        return Probe(False, f"{k}x{n}: {e}", call=True)
    finally:
        eng.close()

