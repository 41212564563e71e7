"""The fake librknnrt.so (tests/fake_librknnrt) refuses what Rockchip says the library refuses.

The library here is a FAKE: Rockchip's closed librknnrt cannot exist without an RK3588 NPU, so the
tests run the engine over a C stand-in. It is only worth as much as the rules it enforces, so each
rule it takes from Rockchip's sources (rknn_matmul_api.h, the dynamic-shape matmul demo, board
reports; docs/npu.md, "The fake library", lists them line by line) is shown here being broken on
purpose, by calling the fake directly, and refused. The old engine's call order (B bound right
after the context is created, before any shape is set) is one of them. The accepted uses run too,
so a rule cannot pass by refusing everything. The driver's IOMMU domain rules:
tests/test_fake_librknnrt_domains.py.
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import numpy as np
import pytest

from edge_llm.backends.npu.matmul import binding as api
from edge_llm.backends.npu.matmul.engine import open_npu_matmul
from edge_llm.errors import RknnMatmulError

sys.path.insert(0, str(Path(__file__).parent / "helpers"))
import fake_calls as fc  # noqa: E402
from fake_calls import L, lib  # noqa: E402,F401  (the fixtures)


def test_the_old_call_order_is_refused(L):
    """The engine's order before issue 47: B bound right after rknn_matmul_create_dynamic_shape,
    before any rknn_matmul_set_dynamic_shape. The demo says set_io_mem must come after it; the fake
    refuses (RKNN_ERR_FAIL), for B and for A alike, and the demo's order then runs."""
    c = fc.Ctx(L)
    try:
        a, b, cm = c.buffers()
        with pytest.raises(RknnMatmulError) as exc:
            L.set_io_mem(c.ctx, b, c.attrs[0].B)
        fc.refused(exc, "rknn_matmul_set_io_mem", -1)
        with pytest.raises(RknnMatmulError) as exc:
            L.set_io_mem(c.ctx, a, c.attrs[0].A)
        fc.refused(exc, "rknn_matmul_set_io_mem", -1)
        with pytest.raises(RknnMatmulError) as exc:
            L.run(c.ctx)
        fc.refused(exc, "rknn_matmul_run", -8)
    finally:
        c.close()


def test_the_demo_order_runs_and_rebinds_at_each_shape(L):
    """Shape, B once, A and C; at a shape change the shape first, then A and C with its attrs.
    A and C bound with another shape's attrs are refused (the fake's own strictness)."""
    c = fc.Ctx(L)
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
        fc.refused(exc, "rknn_matmul_set_io_mem", -5)
        with pytest.raises(RknnMatmulError) as exc:
            L.run(c.ctx)  # A and C still bound for M = 1
        fc.refused(exc, "rknn_matmul_run", -8)
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
    fc.refused(exc, "rknn_matmul_create_dynamic_shape", -5)


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
    c = fc.Ctx(L)
    try:
        if ok:
            L.set_core_mask(c.ctx, mask)
        else:
            with pytest.raises(RknnMatmulError) as exc:
                L.set_core_mask(c.ctx, mask)
            fc.refused(exc, "rknn_matmul_set_core_mask", -1)
    finally:
        c.close()


def test_buffers_only_with_the_context_that_made_them(L):
    """Another context's buffer is refused by set_io_mem and by destroy_mem; each is then
    destroyed with its own context."""
    c1, c2 = fc.Ctx(L), fc.Ctx(L)
    try:
        a1, _, _ = c1.buffers()
        c2.shape(1)
        with pytest.raises(RknnMatmulError) as exc:
            L.set_io_mem(c2.ctx, a1, c2.attrs[0].A)
        fc.refused(exc, "rknn_matmul_set_io_mem", -5)
        with pytest.raises(RknnMatmulError) as exc:
            L.destroy_mem(c2.ctx, a1)
        fc.refused(exc, "rknn_destroy_mem", -5)
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
    fc.refused(exc, "rknn_B_normal_layout_to_native_layout", -5)


def test_the_engine_breaks_no_rule(lib):
    """The engine's whole life (add, runs at every shape, split rows, close) over the fake: not one
    call refused (the fake counts its refusals)."""
    fake = fc.hooks(lib)
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
