"""The fake librknnrt.so (tests/fake_librknnrt) models the NPU driver's IOMMU domains as Rockchip's
driver has them: one domain attached at a time, a switch only while nothing is outstanding in the
current one, a wait up to the switch timeout and then a refusal, page-rounded allocations counted
per domain, a free that switches too.

The library here is a FAKE (Rockchip's closed librknnrt and its driver cannot exist without an
RK3588 NPU); each rule (docs/npu.md, "The fake library", with its source) is broken on purpose and
seen refused, and the accepted uses run. Runs are kept outstanding with the fake's gate
(fake_hold_runs) and a test waits on the fake's own count of held and waiting callers
(fake_wait_for), never on a sleep; the switch timeout is the fake's behaviour under test, lowered
so the refusal comes quickly.
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import numpy as np
import pytest

from edge_llm.backends.npu.matmul.engine import open_npu_matmul
from edge_llm.errors import RknnMatmulError

sys.path.insert(0, str(Path(__file__).parent / "helpers"))
import fake_calls as fc  # noqa: E402
from fake_calls import L, lib  # noqa: E402,F401  (the fixtures)
import npu_matmul_check as check  # noqa: E402


def test_allocations_are_page_rounded_per_domain(L, lib):
    """1 byte takes a 4 KiB page of its domain's 4 GiB, counted in that domain only; a domain
    whose limit is reached gives NULL, another domain still allocates."""
    fake = ctypes.CDLL(lib)
    c0, c1 = fc.Ctx(L, domain=0), fc.Ctx(L, domain=1)
    try:
        before = check.domain_bytes(lib, 0), check.domain_bytes(lib, 1)
        c0.mem(1)
        c0.mem(4097)
        assert (check.domain_bytes(lib, 0), check.domain_bytes(lib, 1)) == (before[0] + 3 * 4096, before[1])
        fake.fake_set_domain_limit(ctypes.c_uint64(check.domain_bytes(lib, 0) + 4096))
        c0.mem(4096)
        with pytest.raises(RknnMatmulError) as exc:
            c0.mem(1)
        fc.refused(exc, "rknn_create_mem", None)
        c1.mem(1)
    finally:
        fake.fake_set_domain_limit(ctypes.c_uint64(1 << 32))
        c0.close()
        c1.close()


def test_one_domain_at_a_time_waits_then_switches(L, lib):
    """A run in domain 1 while a run in domain 0 is outstanding waits (the driver's
    get_and_switch); when the domain-0 run completes, the NPU switches and the waiting run runs."""
    with fc.two_domains(L, lib) as (fake, c0, c1, threads):
        c0.demo_order()
        c1.demo_order()
        L.run(c0.ctx)
        assert fc.switches(fake)[0] == 0
        fake.fake_hold_runs(1)
        t0, r0 = fc.run_in_thread(L, c0.ctx)
        threads.append(t0)
        assert fake.fake_wait_for(1, 0, fc.WAIT_MS) == 1  # the domain-0 run holds its reference
        _, n = fc.switches(fake)
        t1, r1 = fc.run_in_thread(L, c1.ctx)
        threads.append(t1)
        assert fake.fake_wait_for(1, 1, fc.WAIT_MS) == 1  # the domain-1 run waits for the switch
        assert fc.switches(fake) == (0, n) and not r1
        fake.fake_hold_runs(0)
        t0.join()
        t1.join()
        assert r0 == [None] and r1 == [None] and fc.switches(fake) == (1, n + 1)


def test_a_switch_that_waits_past_the_timeout_is_refused(L, lib):
    """The same, with the domain-0 run held past the switch timeout (lowered from the driver's
    6000 ms): the domain-1 run fails (the driver's -EINVAL, -1 here) and so does an allocation in
    domain 1; nothing switched; once the run completes, domain 1 is usable."""
    with fc.two_domains(L, lib) as (fake, c0, c1, threads):
        c0.demo_order()
        c1.demo_order()
        L.run(c0.ctx)
        fake.fake_set_switch_timeout_ms(200)
        fake.fake_hold_runs(1)
        t0, r0 = fc.run_in_thread(L, c0.ctx)
        threads.append(t0)
        assert fake.fake_wait_for(1, 0, fc.WAIT_MS) == 1
        n = fc.switches(fake)
        with pytest.raises(RknnMatmulError) as exc:
            L.run(c1.ctx)
        fc.refused(exc, "rknn_matmul_run", -1)
        with pytest.raises(RknnMatmulError) as exc:
            c1.mem(64)
        fc.refused(exc, "rknn_create_mem", None)
        assert fc.switches(fake) == n
        fake.fake_hold_runs(0)
        t0.join()
        assert r0 == [None]
        L.run(c1.ctx)
        assert fc.switches(fake)[0] == 1


def test_a_free_in_a_busy_other_domain_leaves_the_pages_mapped(L, lib):
    """The driver frees a buffer in its own domain: with a run outstanding in domain 0 past three
    switch timeouts, destroying a domain-1 buffer gives up, and its pages stay counted in domain
    1 (the buffer itself is gone); with the NPU idle, a free gives its pages back."""
    with fc.two_domains(L, lib) as (fake, c0, c1, threads):
        c0.demo_order()
        L.run(c0.ctx)
        c1.mem(4096)  # stays until close()
        c1.mem(4096)  # destroyed below while domain 0 is busy
        before = check.domain_bytes(lib, 1)
        fake.fake_set_switch_timeout_ms(100)
        fake.fake_hold_runs(1)
        t0, r0 = fc.run_in_thread(L, c0.ctx)
        threads.append(t0)
        assert fake.fake_wait_for(1, 0, fc.WAIT_MS) == 1
        L.destroy_mem(c1.ctx, c1.mems.pop())  # the second one
        assert check.domain_bytes(lib, 1) == before  # still mapped
        fake.fake_hold_runs(0)
        t0.join()
        assert r0 == [None]
        c1.mem(4096)
        assert check.domain_bytes(lib, 1) == before + 4096
        L.destroy_mem(c1.ctx, c1.mems.pop())  # an idle NPU: its page is given back
        assert check.domain_bytes(lib, 1) == before


def test_two_engines_in_two_domains_serialize(lib):
    """Why the engine keeps the decoder in domain 0: an engine in domain 1 beside one in domain 0
    costs a detach/attach at every alternation (and waits while the other's round is outstanding);
    two engines in one domain switch never."""
    fake = fc.hooks(lib)
    w = np.ones((64, 96), np.int8)
    x = np.ones((1, 64), np.int8)
    for domains, switches in (((0, 1), 6), ((0, 0), 0)):
        e0, e1 = open_npu_matmul(lib, domain=domains[0]), open_npu_matmul(lib, domain=domains[1])
        try:
            e0.add("w", w)
            e1.add("w", w)
            e0.run("w", x)
            _, n = fc.switches(fake)
            for _ in range(3):
                assert np.array_equal(e1.run("w", x), np.full((1, 96), 64, np.int32))
                assert np.array_equal(e0.run("w", x), np.full((1, 96), 64, np.int32))
            assert fc.switches(fake)[1] - n == switches, domains
        finally:
            e0.close()
            e1.close()
