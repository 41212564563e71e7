"""The fake librknnrt.so (tests/fake_librknnrt) refuses what Rockchip says the library refuses.

The library here is a FAKE: Rockchip's closed librknnrt cannot exist without an RK3588 NPU, so the
tests run the engine over a C stand-in. It is only worth as much as the rules it enforces, so each
rule it takes from Rockchip's sources (rknn_matmul_api.h, the dynamic-shape matmul demo, board
reports, the NPU driver's IOMMU domain code; docs/npu.md, "The fake library", lists them line by
line) is shown here being broken on purpose, by calling the fake directly, and refused. The old
engine's call order (B bound right after the context is created, before any shape is set) is one
of them. The accepted uses run too, so a rule cannot pass by refusing everything.
"""

from __future__ import annotations

import ctypes
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from edge_llm.backends.npu.matmul import binding as api
from edge_llm.backends.npu.matmul.engine import open_npu_matmul
from edge_llm.errors import RknnMatmulError

sys.path.insert(0, str(Path(__file__).parent / "helpers"))
import npu_matmul_check as check  # noqa: E402

WAIT_MS = 120_000  # how long a test waits for a thread to reach the fake's gate (never the rule's time)


@pytest.fixture
def lib(fake_librknnrt):
    """The fake's path, nothing alive before or after, its knobs back to the driver's after."""
    path = str(fake_librknnrt)
    fake = ctypes.CDLL(path)
    assert check.live(path) == (0, 0)
    yield path
    fake.fake_hold_runs(0)
    fake.fake_set_switch_timeout_ms(6000)
    fake.fake_set_domain_limit(ctypes.c_uint64(1 << 32))
    assert check.live(path) == (0, 0)


def _hooks(path: str) -> ctypes.CDLL:
    fake = ctypes.CDLL(path)
    fake.fake_active_domain.argtypes = [ctypes.POINTER(ctypes.c_uint64)]
    fake.fake_refusals.restype = ctypes.c_int64
    return fake


def _switches(fake: ctypes.CDLL) -> tuple[int, int]:
    """(the attached domain, switches so far)."""
    n = ctypes.c_uint64()
    d = fake.fake_active_domain(ctypes.byref(n))
    return d, n.value


def _refused(exc: pytest.ExceptionInfo, function: str, code: int | None) -> None:
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


@pytest.fixture
def L(lib):
    return api.load_library(lib)


def test_the_old_call_order_is_refused(L):
    """The engine's order before issue 47: B bound right after rknn_matmul_create_dynamic_shape,
    before any rknn_matmul_set_dynamic_shape. The demo says set_io_mem must come after it; the fake
    refuses (RKNN_ERR_FAIL), for B and for A alike, and the demo's order then runs."""
    c = Ctx(L)
    try:
        a, b, cm = c.buffers()
        with pytest.raises(RknnMatmulError) as exc:
            L.set_io_mem(c.ctx, b, c.attrs[0].B)
        _refused(exc, "rknn_matmul_set_io_mem", -1)
        with pytest.raises(RknnMatmulError) as exc:
            L.set_io_mem(c.ctx, a, c.attrs[0].A)
        _refused(exc, "rknn_matmul_set_io_mem", -1)
        with pytest.raises(RknnMatmulError) as exc:
            L.run(c.ctx)
        _refused(exc, "rknn_matmul_run", -8)
    finally:
        c.close()


def test_the_demo_order_runs_and_rebinds_at_each_shape(L):
    """Shape, B once, A and C; at a shape change the shape first, then A and C with its attrs.
    A and C bound with another shape's attrs are refused (the fake's own strictness)."""
    c = Ctx(L)
    try:
        a, b, cm = c.demo_order()
        x = np.ones((1, c.K), np.int8)
        ctypes.memmove(a.contents.virt_addr, x.ctypes.data, x.nbytes)
        L.run(c.ctx)
        got = np.frombuffer((ctypes.c_int32 * c.N).from_address(cm.contents.virt_addr), np.int32)
        assert np.array_equal(got, c.w.astype(np.int32).sum(axis=0))
        at4 = c.shape(4)
        with pytest.raises(RknnMatmulError) as exc:
            L.set_io_mem(c.ctx, a, c.attrs[0].A)  # the old shape's attrs
        _refused(exc, "rknn_matmul_set_io_mem", -5)
        with pytest.raises(RknnMatmulError) as exc:
            L.run(c.ctx)  # A and C still bound for M = 1
        _refused(exc, "rknn_matmul_run", -8)
        L.set_io_mem(c.ctx, a, at4.A)
        L.set_io_mem(c.ctx, cm, at4.C)
        L.run(c.ctx)
    finally:
        c.close()


@pytest.mark.parametrize("info", [dict(K=48), dict(N=40), dict(K=10272), dict(type=13), dict(type=16),
                                  dict(B_quant_type=6), dict(AC_quant_type=1), dict(iommu_domain_id=16),
                                  dict(iommu_domain_id=-1)],
                         ids=["K-not-32", "N-not-32", "K-over-10240", "type-13-unused", "type-past-15",
                              "quant-type-past-5", "AC-quant-not-0", "domain-16", "domain-negative"])
def test_refused_infos(L, info):
    """Alignment (K and N by 32 for int8), K <= 10240, rknn_matmul_type 1..12 and 15,
    rknn_matmul_quant_type 0..5, A and C per-layer only, the driver's domains 0..15."""
    K, N = info.pop("K", 64), info.pop("N", 32)
    base = dict(M=1, K=K, N=N, type=api.MatmulType.INT8_MM_INT8_TO_INT32, B_layout=api.Layout.NATIVE)
    with pytest.raises(RknnMatmulError) as exc:
        L.create_dynamic_shape(api.MatmulInfo(**{**base, **info}), [api.Shape(1, K, N)])
    _refused(exc, "rknn_matmul_create_dynamic_shape", -5)


def test_the_enum_values_are_the_headers():
    """rknn_matmul_api.h 2.3.2: the quant type enum (PER_CHANNEL_SYM 2, PER_GROUP_SYM 4, not the
    struct comment's 1 and 2), the last matmul type 15, the layouts."""
    assert [int(q) for q in api.QuantType] == [0, 1, 2, 3, 4, 5]
    assert api.QuantType.PER_CHANNEL_SYM == 2 and api.QuantType.PER_GROUP_SYM == 4
    assert api.LAST_MATMUL_TYPE == 15 and 13 not in set(api.MatmulType) and 14 not in set(api.MatmulType)
    assert api.MatmulType.INT8_MM_INT8_TO_INT32 == 2 and api.Layout.NATIVE == 1


@pytest.mark.parametrize("mask,ok", [(0, True), (1, True), (2, True), (4, True), (3, False), (7, False),
                                     (5, False), (0xFFFF, False)])
def test_core_masks_as_boards_answer(L, mask, ok):
    """AUTO or one core is taken; 0_1 and 0_1_2 are refused with -1 as boards report ("Not support
    core mask"), and so is a mask the header does not list."""
    c = Ctx(L)
    try:
        if ok:
            L.set_core_mask(c.ctx, mask)
        else:
            with pytest.raises(RknnMatmulError) as exc:
                L.set_core_mask(c.ctx, mask)
            _refused(exc, "rknn_matmul_set_core_mask", -1)
    finally:
        c.close()


def test_buffers_only_with_the_context_that_made_them(L):
    """Another context's buffer is refused by set_io_mem and by destroy_mem; each is then
    destroyed with its own context."""
    c1, c2 = Ctx(L), Ctx(L)
    try:
        a1, _, _ = c1.buffers()
        c2.shape(1)
        with pytest.raises(RknnMatmulError) as exc:
            L.set_io_mem(c2.ctx, a1, c2.attrs[0].A)
        _refused(exc, "rknn_matmul_set_io_mem", -5)
        with pytest.raises(RknnMatmulError) as exc:
            L.destroy_mem(c2.ctx, a1)
        _refused(exc, "rknn_destroy_mem", -5)
    finally:
        c1.close()
        c2.close()


@pytest.mark.parametrize("change", [dict(M=0), dict(K=96), dict(N=64)], ids=["M-unset", "K-other", "N-other"])
def test_b_conversion_wants_the_contexts_info(L, change):
    """rknn_B_normal_layout_to_native_layout with info.M set (as the demo sets it) and info's K
    and N those of the B it converts."""
    w = np.zeros((64, 32), np.int8)
    out = np.zeros(64 * 32, np.int8)
    info = api.MatmulInfo(**{**dict(M=1, K=64, N=32, type=api.MatmulType.INT8_MM_INT8_TO_INT32,
                                    B_layout=api.Layout.NATIVE), **change})
    with pytest.raises(RknnMatmulError) as exc:
        L.b_to_native(w.ctypes.data, out.ctypes.data, 64, 32, info)
    _refused(exc, "rknn_B_normal_layout_to_native_layout", -5)


def test_allocations_are_page_rounded_per_domain(L, lib):
    """1 byte takes a 4 KiB page of its domain's 4 GiB, counted in that domain only; a domain
    whose limit is reached gives NULL, another domain still allocates."""
    fake = ctypes.CDLL(lib)
    c0, c1 = Ctx(L, domain=0), Ctx(L, domain=1)
    threads: list[threading.Thread] = []
    try:
        before = check.domain_bytes(lib, 0), check.domain_bytes(lib, 1)
        c0.mem(1)
        c0.mem(4097)
        assert (check.domain_bytes(lib, 0), check.domain_bytes(lib, 1)) == (before[0] + 3 * 4096, before[1])
        fake.fake_set_domain_limit(ctypes.c_uint64(check.domain_bytes(lib, 0) + 4096))
        c0.mem(4096)
        with pytest.raises(RknnMatmulError) as exc:
            c0.mem(1)
        _refused(exc, "rknn_create_mem", None)
        c1.mem(1)
    finally:
        fake.fake_set_domain_limit(ctypes.c_uint64(1 << 32))
        c0.close()
        c1.close()


def _run_in_thread(L: api.MatmulLib, ctx: int) -> tuple[threading.Thread, list]:
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


def test_one_domain_at_a_time_waits_then_switches(L, lib):
    """A run in domain 1 while a run in domain 0 is outstanding waits (the driver's
    get_and_switch); when the domain-0 run completes, the NPU switches and the waiting run runs."""
    fake = _hooks(lib)
    c0, c1 = Ctx(L, domain=0), Ctx(L, domain=1)
    threads: list[threading.Thread] = []
    try:
        c0.demo_order()
        c1.demo_order()
        L.run(c0.ctx)
        assert _switches(fake)[0] == 0
        fake.fake_hold_runs(1)
        t0, r0 = _run_in_thread(L, c0.ctx)
        threads.append(t0)
        assert fake.fake_wait_for(1, 0, WAIT_MS) == 1  # the domain-0 run holds its reference
        _, n = _switches(fake)
        t1, r1 = _run_in_thread(L, c1.ctx)
        threads.append(t1)
        assert fake.fake_wait_for(1, 1, WAIT_MS) == 1  # the domain-1 run waits for the switch
        assert _switches(fake) == (0, n) and not r1
        fake.fake_hold_runs(0)
        t0.join()
        t1.join()
        assert r0 == [None] and r1 == [None] and _switches(fake) == (1, n + 1)
    finally:
        fake.fake_hold_runs(0)
        for t in threads:  # a run still going must finish before its buffers go
            t.join()
        c0.close()
        c1.close()


def test_a_switch_that_waits_past_the_timeout_is_refused(L, lib):
    """The same, with the domain-0 run held past the switch timeout (lowered from the driver's
    6000 ms): the domain-1 run fails (the driver's -EINVAL, -1 here) and so does an allocation in
    domain 1; nothing switched; once the run completes, domain 1 is usable."""
    fake = _hooks(lib)
    c0, c1 = Ctx(L, domain=0), Ctx(L, domain=1)
    threads: list[threading.Thread] = []
    try:
        c0.demo_order()
        c1.demo_order()
        L.run(c0.ctx)
        fake.fake_set_switch_timeout_ms(200)
        fake.fake_hold_runs(1)
        t0, r0 = _run_in_thread(L, c0.ctx)
        threads.append(t0)
        assert fake.fake_wait_for(1, 0, WAIT_MS) == 1
        n = _switches(fake)
        with pytest.raises(RknnMatmulError) as exc:
            L.run(c1.ctx)
        _refused(exc, "rknn_matmul_run", -1)
        with pytest.raises(RknnMatmulError) as exc:
            c1.mem(64)
        _refused(exc, "rknn_create_mem", None)
        assert _switches(fake) == n
        fake.fake_hold_runs(0)
        t0.join()
        assert r0 == [None]
        L.run(c1.ctx)
        assert _switches(fake)[0] == 1
    finally:
        fake.fake_hold_runs(0)
        for t in threads:  # a run still going must finish before its buffers go
            t.join()
        c0.close()
        c1.close()


def test_a_free_in_a_busy_other_domain_leaves_the_pages_mapped(L, lib):
    """The driver frees a buffer in its own domain: with a run outstanding in domain 0 past three
    switch timeouts, destroying a domain-1 buffer gives up, and its pages stay counted in domain
    1 (the buffer itself is gone); with the NPU idle, a free gives its pages back."""
    fake = _hooks(lib)
    c0, c1 = Ctx(L, domain=0), Ctx(L, domain=1)
    threads: list[threading.Thread] = []
    try:
        c0.demo_order()
        L.run(c0.ctx)
        c1.mem(4096)  # stays until close()
        lost = c1.mem(4096)
        before = check.domain_bytes(lib, 1)
        fake.fake_set_switch_timeout_ms(100)
        fake.fake_hold_runs(1)
        t0, r0 = _run_in_thread(L, c0.ctx)
        threads.append(t0)
        assert fake.fake_wait_for(1, 0, WAIT_MS) == 1
        L.destroy_mem(c1.ctx, c1.mems.pop())  # lost
        assert check.domain_bytes(lib, 1) == before  # still mapped
        fake.fake_hold_runs(0)
        t0.join()
        assert r0 == [None]
        c1.mem(4096)
        assert check.domain_bytes(lib, 1) == before + 4096
        L.destroy_mem(c1.ctx, c1.mems.pop())  # an idle NPU: its page is given back
        assert check.domain_bytes(lib, 1) == before
    finally:
        fake.fake_hold_runs(0)
        for t in threads:  # a run still going must finish before its buffers go
            t.join()
        fake.fake_set_switch_timeout_ms(6000)
        c0.close()
        c1.close()


def test_two_engines_in_two_domains_serialize(lib):
    """Why the engine keeps the decoder in domain 0: an engine in domain 1 beside one in domain 0
    costs a detach/attach at every alternation (and waits while the other's round is outstanding);
    two engines in one domain switch never."""
    fake = _hooks(lib)
    w = np.ones((64, 96), np.int8)
    x = np.ones((1, 64), np.int8)
    for domains, switches in (((0, 1), 6), ((0, 0), 0)):
        e0, e1 = open_npu_matmul(lib, domain=domains[0]), open_npu_matmul(lib, domain=domains[1])
        try:
            e0.add("w", w)
            e1.add("w", w)
            e0.run("w", x)
            _, n = _switches(fake)
            for _ in range(3):
                assert np.array_equal(e1.run("w", x), np.full((1, 96), 64, np.int32))
                assert np.array_equal(e0.run("w", x), np.full((1, 96), 64, np.int32))
            assert _switches(fake)[1] - n == switches, domains
        finally:
            e0.close()
            e1.close()


def test_the_engine_breaks_no_rule(lib):
    """The engine's whole life (add, runs at every shape, split rows, close) over the fake: not one
    call refused (the fake counts its refusals)."""
    fake = _hooks(lib)
    before = fake.fake_refusals()
    e = open_npu_matmul(lib)
    try:
        rng = np.random.default_rng(3)
        e.add("w", rng.integers(-127, 128, (128, 224), dtype=np.int8))
        for m in (1, 2, 3, 8, 33, 128, 200, 1):
            e.run("w", rng.integers(-127, 128, (m, 128), dtype=np.int8))
    finally:
        e.close()
    assert fake.fake_refusals() == before
