"""The NPU matmul engine (`engine.NpuInt8Matmul`) and its ctypes binding (`binding`) over a
fake librknnrt.so built here from tests/fake_librknnrt/fake_rknnrt.c. The fake stands in for
Rockchip's closed library, which cannot exist without an RK3588 NPU: it implements the entry
points the binding calls, on the CPU, with binding.h's native layout and refusals, and
counts live contexts and buffers (fake_live_objects). The same checks run on the emulated arm64
board (tests/test_board_emulated.py) through tests/helpers/npu_matmul_check.py.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import os
import platform
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from edge_llm.backends.npu.matmul import binding as api
from edge_llm.backends.npu.matmul.int8 import HostInt8Matmul
from edge_llm.backends.npu.matmul.engine import M_SHAPES, library_id, open_npu_matmul, shape_for, split_columns, split_weight
from edge_llm.errors import ConfigError, RknnMatmulError
from edge_llm.settings import LIBRKNNRT_ENV

sys.path.insert(0, str(Path(__file__).parent / "helpers"))
import npu_matmul_check as check  # noqa: E402

@pytest.fixture
def lib(fake_librknnrt):
    """The fake, with no object alive before and after the test (a leak fails the test that made it)."""
    path = str(fake_librknnrt)
    assert check.live(path) == (0, 0)
    yield path
    assert check.live(path) == (0, 0)


def native_reference(w: np.ndarray) -> np.ndarray:
    """binding.h's int8 B native layout on RK3588, from its comment: (N/32, K/32, 32, 32),
    and above K = 8192 ceil(K / 8192) segments of K, each in that layout, one after the other."""
    K, N = w.shape
    segs = [w[k0:k0 + 8192] for k0 in range(0, K, 8192)]
    return np.concatenate([s.reshape(s.shape[0] // 32, 32, N // 32, 32).transpose(2, 0, 3, 1).reshape(-1)
                           for s in segs])


@pytest.mark.parametrize("K,N", [(64, 96), (8256, 64)])
def test_the_fakes_native_layout_is_the_headers(lib, K, N):
    """The layout the fake converts B into (and reads in run) is the header's, by an independent
    numpy rewrite of the header's description: the engine's bitwise results would not show a
    layout both sides got wrong the same way."""
    lib_ = api.load_library(lib)
    w = np.random.default_rng(1).integers(-127, 128, (K, N), dtype=np.int8)
    out = np.zeros(K * N, dtype=np.int8)
    info = api.MatmulInfo(M=1, K=K, N=N, type=api.MatmulType.INT8_MM_INT8_TO_INT32, B_layout=api.Layout.NATIVE)
    lib_.b_to_native(w.ctypes.data, out.ctypes.data, K, N, info)
    assert np.array_equal(out, native_reference(w))


def test_results_are_the_host_emulations_bitwise(lib):
    """M = 1, 3, 32, 33, 128, 200 (padded to a dynamic shape, split above 128), weights cut over
    the three cores by N in parts that are not thirds, by K (partial products summed in int32),
    by both (two halves of N over part of K, all of N over the rest), K up to the 10240 limit
    (two native segments), the extremes +-127."""
    res = check.bitwise(lib, cases=((64, 224, (1, 3, 32, 33, 128, 200)), (576, 1536, (1, 33)),
                                    (10240, 96, (2,)), (8224, 64, (3,)), (2048, 2048, (1, 5)), (128, 128, (2,))))
    assert res["checked"] == 13 and res["mismatches"] == [], res
    parts = res["parts"]
    assert parts["w64x224"] == [[0, 0, 64, 0, 96], [1, 0, 64, 96, 160], [2, 0, 64, 160, 224]]
    assert parts["w10240x96"] == [[0, 0, 10240, 0, 32], [1, 0, 10240, 32, 64], [2, 0, 10240, 64, 96]]
    assert parts["w8224x64"] == [[0, 0, 2752, 0, 64], [1, 2752, 5504, 0, 64], [2, 5504, 8224, 0, 64]]  # by K
    # the 2B's o: 1376 x 1024 tiles on two cores, 672 x 2048 on the third (1376 of 4096 32x32 tiles at most)
    assert parts["w2048x2048"] == [[0, 0, 1376, 0, 1024], [1, 0, 1376, 1024, 2048], [2, 1376, 2048, 0, 2048]]
    assert res["masks_domains"] == [[1, 0], [2, 0], [4, 0]]  # one core per context, all in domain 0
    assert res["live_during"] == [6 * 3, 3 * 6 * 3] and res["live_after"] == [0, 0]
    assert res["numerics"].startswith("librknnrt-") and res["numerics"].endswith("-cores0,1,2")


def test_rows_never_mix_and_the_result_is_the_callers(lib):
    """A row's result is the same alone, padded (3 -> 4 rows) or in a split batch (200 = 128 + 72);
    the returned array is not the engine's buffer (the next run leaves it alone)."""
    rng = np.random.default_rng(2)
    w = rng.integers(-127, 128, (96, 160), dtype=np.int8)
    a = rng.integers(-127, 128, (200, 96), dtype=np.int8)
    e = open_npu_matmul(lib, cores=(0, 2))
    try:
        e.add("w", w)
        whole = e.run("w", a)
        kept = whole.copy()
        for i in (0, 2, 130, 199):
            assert np.array_equal(e.run("w", a[i:i + 1])[0], whole[i])
        assert np.array_equal(e.run("w", a[5:8]), whole[5:8])
        assert np.array_equal(whole, kept)
        assert [p.core for p in e.weights["w"]] == [0, 2] and e.numerics.endswith("-cores0,2")
    finally:
        e.close()


def _task_names() -> list[str]:
    """The OS names of this process's threads, read once: a thread that ends between the listing
    and the read of its name (a BLAS or server thread another test left winding down) is skipped,
    not an error."""
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            names.append(Path(f"/proc/self/task/{tid}/comm").read_text().strip())
        except (FileNotFoundError, ProcessLookupError):  # that thread ended mid-count
            continue
    return names


def _helpers() -> int:
    """The engine's helper threads alive in this process: C ones by their OS name, Python's by theirs."""
    return _task_names().count("npu-round") + sum(t.name.startswith("npu-mm") for t in threading.enumerate())


def _helpers_gone(timeout: float = 30.0) -> int:
    """_helpers() once it reaches 0, else its count at the deadline. Polled: pthread_join returns
    once the thread has exited, but the kernel may list the exited task in /proc/self/task (with
    its name) a moment longer, on a busy machine longer still; a helper that is never stopped
    still fails at the deadline."""
    deadline = time.monotonic() + timeout
    while (n := _helpers()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return n


@pytest.mark.parametrize("c_round", [True, False], ids=["c-round", "python-pool"])
def test_a_round_runs_every_part_and_reports_the_failing_one(lib, c_round):
    """The parts of a round run on the caller and one helper thread per other core: C helpers
    (rounds.py over _rounds.c) or, without the operator library, Python's pool; both give the
    emulation's bits (three cuts: by N, by K, both), a refused run names rknn_matmul_run and its
    code (here part 2's A unbound behind the engine's back: the fake refuses with -8), and close()
    stops the helpers."""
    rng = np.random.default_rng(5)
    assert _helpers_gone() == 0  # an earlier test's helpers may still be being reaped
    e = open_npu_matmul(lib, c_round=c_round)
    assert (e.round is not None) == c_round and (e.pool is None) == c_round
    assert _helpers() == (2 if c_round else 0)  # the pool's threads start on first use
    if not c_round:
        # the pool starts a thread on a submit only while none of its threads is idle, so rounds
        # alone may leave it with one thread (a busy scheduler lets the first finish before the
        # second submit). Two tasks that wait for each other need two threads at once: the pool
        # starts both, and the count below is exact (a pool of one would fail the barrier)
        meet = threading.Barrier(2, timeout=120)
        for f in [e.pool.submit(meet.wait) for _ in range(2)]:
            f.result()
    host = HostInt8Matmul()
    try:
        for K, N in ((64, 224), (192, 64), (128, 128)):
            w = rng.integers(-127, 128, (K, N), dtype=np.int8)
            e.add(f"w{K}", w)
            host.add(f"w{K}", w)
            for m in (1, 3, 130):
                a = rng.integers(-127, 128, (m, K), dtype=np.int8)
                assert np.array_equal(e.run(f"w{K}", a), host.run(f"w{K}", a))
        p2 = e.weights["w64"][2]
        a = rng.integers(-127, 128, (p2.m, 64), dtype=np.int8)  # the shape the contexts are at: no rebinding
        other = next(m for m in M_SHAPES if m != p2.m)  # its shape moved behind the engine: A and C unbound
        b = p2.blk
        e.lib.set_dynamic_shape(p2.ctx, api.Shape(other, b.k1 - b.k0, b.n1 - b.n0))
        with pytest.raises(RknnMatmulError) as exc:
            e.run("w64", a)
        _refused(exc, "rknn_matmul_run", -8)
        if c_round:
            assert str(exc.value).endswith("part 2 of 3"), exc.value
    finally:
        assert _helpers() == 2
        e.close()
        host.close()
    assert _helpers_gone() == 0  # close() joined them; polled only for the kernel's reaping


def test_split_and_shapes():
    def cut(k, n):
        return [(b.k0, b.k1, b.n0, b.n1) for b in split_weight(k, n, 3)]

    # Qwen3-VL-2B: qkv, gate/up and the head by N, down by K (thirds exactly), o both ways
    assert cut(2048, 4096) == [(0, 2048, 0, 1376), (0, 2048, 1376, 2752), (0, 2048, 2752, 4096)]
    assert cut(2048, 12288) == [(0, 2048, 0, 4096), (0, 2048, 4096, 8192), (0, 2048, 8192, 12288)]
    assert cut(6144, 2048) == [(0, 2048, 0, 2048), (2048, 4096, 0, 2048), (4096, 6144, 0, 2048)]
    assert cut(2048, 2048) == [(0, 1376, 0, 1024), (0, 1376, 1024, 2048), (1376, 2048, 0, 2048)]
    assert max(b.size for b in split_weight(2048, 151936, 3)) == 2048 * 50656
    assert cut(32, 32) == [(0, 32, 0, 32)]  # one tile: one part
    # two cores: 64 x 96 by K (32 x 96 each) beats by N (64 x 64 on the first)
    assert [(b.k0, b.k1, b.n0, b.n1) for b in split_weight(64, 96, 2)] == [(0, 32, 0, 96), (32, 64, 0, 96)]
    assert split_columns(224, 3) == [(0, 96), (96, 160), (160, 224)]
    assert split_columns(64, 3) == [(0, 32), (32, 64)]  # no empty part: two contexts
    assert split_columns(96, 1) == [(0, 96)]
    assert [shape_for(m) for m in (1, 3, 32, 33, 128)] == [1, 4, 32, 64, 128] and M_SHAPES[-1] == 128
    # what Block.adds rests on, for every cut split_weight makes: the parts that start at row 0
    # come first and cover every (k, n) once with the rest; a part that adds only meets columns
    # those parts wrote
    for k in range(32, 33 * 32, 96):
        for n in range(32, 33 * 32, 160):
            for cores in (1, 2, 3):
                blocks = split_weight(k, n, cores)
                seen = np.zeros((k, n), np.int8)
                for b in blocks:
                    seen[b.k0:b.k1, b.n0:b.n1] += 1
                assert (seen == 1).all(), (k, n, cores, blocks)
                written = [b for b in blocks if not b.adds]
                assert blocks[:len(written)] == written and sum(b.n1 - b.n0 for b in written) == n


def _info(K=64, N=32, **kw) -> api.MatmulInfo:
    return api.MatmulInfo(K=K, N=N, type=kw.pop("type", api.MatmulType.INT8_MM_INT8_TO_INT32),
                          B_layout=api.Layout.NATIVE, **kw)


def _refused(exc: pytest.ExceptionInfo, function: str, code: int | None) -> None:
    e = exc.value
    assert e.function == function and e.code == code, e
    assert str(e).startswith(f"{function} returned ") and (code is None or api.ERRORS[code] in str(e)), e


@pytest.mark.parametrize("info", [_info(K=48), _info(N=40), _info(K=10272), _info(type=99)],
                         ids=["K-not-32", "N-not-32", "K-over-10240", "not-a-type"])
def test_refused_shapes_and_types(lib, info):
    with pytest.raises(RknnMatmulError) as exc:
        api.load_library(lib).create_dynamic_shape(info, [api.Shape(1, info.K, info.N)])
    _refused(exc, "rknn_matmul_create_dynamic_shape", -5)


def test_refused_calls_on_a_context(lib):
    """A three-core mask (-1, as boards answer it), a buffer smaller than its io attr, an M outside
    the dynamic shapes, a run with nothing bound: each names its function and code, and the context
    stays usable."""
    L = api.load_library(lib)
    ctx, attrs = L.create_dynamic_shape(_info(), [api.Shape(1, 64, 32), api.Shape(4, 64, 32)])
    small = L.create_mem(ctx, attrs[1].A.size - 1)
    try:
        with pytest.raises(RknnMatmulError) as exc:
            L.set_core_mask(ctx, api.CoreMask.CORE_0_1_2)
        _refused(exc, "rknn_matmul_set_core_mask", -1)
        L.set_core_mask(ctx, api.CoreMask.CORE_1)
        L.set_dynamic_shape(ctx, api.Shape(4, 64, 32))
        with pytest.raises(RknnMatmulError) as exc:
            L.set_io_mem(ctx, small, attrs[1].A)
        _refused(exc, "rknn_matmul_set_io_mem", -5)
        with pytest.raises(RknnMatmulError) as exc:
            L.set_dynamic_shape(ctx, api.Shape(3, 64, 32))
        _refused(exc, "rknn_matmul_set_dynamic_shape", -5)
        L.set_dynamic_shape(ctx, api.Shape(1, 64, 32))
        with pytest.raises(RknnMatmulError) as exc:
            L.run(ctx)
        _refused(exc, "rknn_matmul_run", -8)
    finally:
        L.destroy_mem(ctx, small)
        L.destroy(ctx)
    with pytest.raises(RknnMatmulError) as exc:
        L.destroy(ctx)
    _refused(exc, "rknn_matmul_destroy", -7)


def test_a_failed_add_releases_what_it_made_and_close_releases_the_rest(lib):
    """The fake's domain limit lowered so a weight's third part finds its domain full half-way
    through `add`: the refusal surfaces, the two parts made so far are released, the weight
    registered before still runs, and close() (twice) leaves nothing alive."""
    fake = ctypes.CDLL(lib)
    e = open_npu_matmul(lib)
    w = np.ones((64, 96), dtype=np.int8)
    try:
        e.add("first", w)
        before = check.live(lib)
        per_part = check.domain_bytes(lib, 0) // 3
        fake.fake_set_domain_limit(ctypes.c_uint64(check.domain_bytes(lib, 0) + 2 * per_part + per_part // 2))
        with pytest.raises(RknnMatmulError) as exc:
            e.add("second", w)
        _refused(exc, "rknn_create_mem", None)
        assert check.live(lib) == before and "second" not in e.weights
        assert np.array_equal(e.run("first", np.ones((1, 64), np.int8)), np.full((1, 96), 64, np.int32))
    finally:
        fake.fake_set_domain_limit(ctypes.c_uint64(1 << 32))
        e.close()
    e.close()
    assert check.live(lib) == (0, 0)


def test_one_iommu_domain_holds_the_2b_decoder_and_the_tower(lib):
    """Qwen3-VL-2B's int8 decoder as the engine allocates it, page-rounded, and the vision tower's
    0.85 GB fit IOMMU domain 0 together (4 GiB); the fp16 graphs' 3.49 GB and the tower do not."""
    res = check.domains(lib)
    assert res["decoder_int8_bytes"] == 1_720_451_072  # 28 x (qkv, o, gate_up, down) + head, int8
    assert res["int8_one_domain"] is None, res
    tower = -(-check.TOWER_BYTES // 4096) * 4096  # page-rounded, as the driver maps it
    assert res["one_domain_bytes"] - res["decoder_domain_bytes"] == tower
    # + the A and C buffers for 128 rows, each page-rounded
    assert res["decoder_int8_bytes"] < res["decoder_domain_bytes"] < res["one_domain_bytes"] < 1 << 32
    assert res["fp16_one_domain"].startswith("rknn_create_mem returned NULL"), res
    assert res["live_after"] == [0, 0]


def test_a_missing_library_says_what_to_install(tmp_path, monkeypatch, lib):
    monkeypatch.setenv(LIBRKNNRT_ENV, str(tmp_path / "nowhere" / "librknnrt.so"))
    with pytest.raises(ConfigError) as exc:
        open_npu_matmul()
    msg = str(exc.value)
    assert str(tmp_path / "nowhere" / "librknnrt.so") in msg and "rknpu2" in msg and LIBRKNNRT_ENV in msg, msg
    monkeypatch.setenv(LIBRKNNRT_ENV, lib)  # the variable is what open_npu_matmul() loads
    open_npu_matmul().close()
    libm = ctypes.util.find_library("m")
    assert libm
    with pytest.raises(ConfigError, match="libm.* has no rknn_matmul_create, .*librknnrt 2.1 or newer"):
        open_npu_matmul(libm)


def test_the_micro_benchmark_labels_what_it_measured(lib):
    """bench_matmul over the fake: every figure comes with the engine's numerics (the library's
    hash) and the machine, so the fake's numbers on this CPU are not read as an NPU's."""
    from edge_llm.bench.npu.matmul import bench_matmul

    res = bench_matmul(lib, reps=3, stream_reps=1, shapes={"64x96": (64, 96)})
    assert res.numerics == f"librknnrt-{library_id(lib)}-cores0" and res.machine.startswith(platform.machine())
    # the figures exist and are real times; their order (rknn_matmul_run under the engine's run)
    # is not asserted: medians of separate timed loops, which a busy machine's preemption reorders
    assert all(0 < v < math.inf for v in (res.lib_run_us, res.run_us, res.round_us, res.pool_round_us))
    assert res.round_c and res.round_cores >= 1 and set(res.gbps["64x96"]) == {"1 core", "3 cores"}
    text = "\n".join(res.lines())
    assert res.numerics in text and res.machine in text and "GB/s" in text, text
