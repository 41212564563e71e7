"""Calls into the tests' fake librknnrt.so (tests/fake_librknnrt: a FAKE, standing in for
Rockchip's closed library, which needs an RK3588 NPU) for the tests that break its rules on
purpose: tests/test_fake_librknnrt_rules.py (the API's rules) and
tests/test_fake_librknnrt_domains.py (the driver's IOMMU domains)."""

from __future__ import annotations

import contextlib
import ctypes
import threading
from collections.abc import Iterator

import numpy as np
import pytest

from edge_llm.backends.npu.matmul import binding as api
from edge_llm.errors import RknnMatmulError

import npu_matmul_check as check

WAIT_MS = 120_000  # how long a test waits for a thread to reach the fake's gate (never the rule's time)


@pytest.fixture
def lib(fake_librknnrt):
    """The fake's path, nothing alive before or after, its knobs back to the driver's after (the
    rules' and the domains' tests import this fixture)."""
    path = str(fake_librknnrt)
    fake = ctypes.CDLL(path)
    assert check.live(path) == (0, 0)
    yield path
    fake.fake_hold_runs(0)
    fake.fake_set_switch_timeout_ms(6000)
    fake.fake_set_domain_limit(ctypes.c_uint64(1 << 32))
    assert check.live(path) == (0, 0)


@pytest.fixture
def L(lib):
    return api.load_library(lib)


def hooks(path: str) -> ctypes.CDLL:
    fake = ctypes.CDLL(path)
    fake.fake_active_domain.argtypes = [ctypes.POINTER(ctypes.c_uint64)]
    fake.fake_refusals.restype = ctypes.c_int64
    return fake


def switches(fake: ctypes.CDLL) -> tuple[int, int]:
    """(the attached domain, switches so far)."""
    n = ctypes.c_uint64()
    d = fake.fake_active_domain(ctypes.byref(n))
    return d, n.value


def refused(exc: pytest.ExceptionInfo, function: str, code: int | None) -> None:
    assert exc.value.function == function and exc.value.code == code, exc.value


class Ctx:
    """One matmul context made at the library level, its buffers, released by close()."""

    def __init__(self, L: api.MatmulLib, K=64, N=32, ms=(1, 4), domain=0, **info):
        self.L, self.K, self.N, self.ms = L, K, N, ms
        self.info = api.MatmulInfo(M=max(ms), K=K, N=N, type=api.MatmulType.INT8_MM_INT8_TO_INT32,
                                   B_layout=api.Layout.NATIVE, iommu_domain_id=domain, **info)
        self.ctx, self.attrs = L.create_dynamic_shape(self.info, [api.Shape(m, K, N) for m in ms])
        self.mems: list = []

    def mem(self, size: int):
        m = self.L.create_mem(self.ctx, size)
        self.mems.append(m)
        return m

    def buffers(self):
        """A, B and C sized for the largest shape (the demo's), B converted from a known weight."""
        a, b, c = (self.mem(max(getattr(x, t).size for x in self.attrs)) for t in "ABC")
        self.w = np.arange(self.K * self.N, dtype=np.int64).reshape(self.K, self.N).astype(np.int8)
        self.L.b_to_native(self.w.ctypes.data, b.contents.virt_addr, self.K, self.N, self.info)
        return a, b, c

    def shape(self, m: int):
        self.L.set_dynamic_shape(self.ctx, api.Shape(m, self.K, self.N))
        return self.attrs[self.ms.index(m)]

    def demo_order(self):
        """The dynamic-shape demo's order: shape, B once, then A and C of that shape."""
        a, b, c = self.buffers()
        at = self.shape(self.ms[0])
        self.L.set_io_mem(self.ctx, b, at.B)
        self.L.set_io_mem(self.ctx, a, at.A)
        self.L.set_io_mem(self.ctx, c, at.C)
        return a, b, c

    def close(self):
        for m in self.mems:
            self.L.destroy_mem(self.ctx, m)
        self.L.destroy(self.ctx)


def run_in_thread(L: api.MatmulLib, ctx: int) -> tuple[threading.Thread, list]:
    """rknn_matmul_run on a thread of its own; the list gets None or the error."""
    out: list = []

    def go():
        try:
            L.run(ctx)
            out.append(None)
        except RknnMatmulError as e:
            out.append(e)

    t = threading.Thread(target=go)
    t.start()
    return t, out


@contextlib.contextmanager
def two_domains(L: api.MatmulLib, lib: str) -> Iterator[tuple[ctypes.CDLL, "Ctx", "Ctx", list[threading.Thread]]]:
    """The fake's hooks, a context in domain 0 and one in domain 1, and a list for the threads a
    test starts: on the way out the held runs are let go, every thread is joined (a run still going
    must finish before its buffers go) and both contexts are closed."""
    fake = hooks(lib)
    c0, c1 = Ctx(L, domain=0), Ctx(L, domain=1)
    threads: list[threading.Thread] = []
    try:
        yield fake, c0, c1, threads
    finally:
        fake.fake_hold_runs(0)
        for t in threads:
            t.join()
        c0.close()
        c1.close()
