"""The NPU matmul path's start-up self-test (backends/npu/matmul/selftest.py, probes.py) over the fake
librknnrt.so's builds (tests/fake_librknnrt: the normal one, and one misbehaving build per probe,
fake_misbehave.c): each probe's answer and the engine's documented reaction (docs/npu.md, "The
start-up self-test"): rknn_mem_sync around runs for a stale cache, serialized rounds for racing
threads (both still bitwise the host emulation), a refusal naming the probe for a wrong product,
an old driver or an unusable domain; the cache per library and driver; /health, the page's state,
doctor, `serve --backend rknn`'s exit and `auto`'s fall-back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import numpy as np
import pytest
from serverutil import ServerProc

from edge_llm.backends.npu.matmul import binding as api
from edge_llm.backends.npu.matmul import probes, selftest
from edge_llm.backends.npu.matmul.engine import open_npu_matmul
from edge_llm.backends.npu.matmul.int8 import HostInt8Matmul
from edge_llm.errors import NpuRefused
from helpers.npu_selftest_check import PART, passes_every_probe


@pytest.fixture(scope="module")
def fake(request):
    """fake(misbehave=None) -> the path of that build of the fake librknnrt.so (compiled once)."""
    from fake_librknnrt.build import build_fake

    where = Path(request.config.cache.mkdir("fake_librknnrt"))
    return lambda misbehave=None: str(build_fake(where, misbehave=misbehave))


def _product(eng, seed: int = 0, k: int = 256, n: int = 960, m: int = 5) -> tuple[np.ndarray, np.ndarray]:
    """(the engine's product, the host emulation's) of one weight cut over the engine's cores, run
    on a fresh thread (as the server's worker runs it) three times: the last result."""
    rng = np.random.default_rng(seed)
    w = rng.integers(-127, 128, size=(k, n), dtype=np.int8)
    a = rng.integers(-127, 128, size=(m, k), dtype=np.int8)
    host = HostInt8Matmul()
    host.add("w", w)
    eng.add("w", w)
    out: list[np.ndarray] = []

    def work() -> None:
        for _ in range(3):
            out.append(eng.run("w", a).copy())

    t = threading.Thread(target=work)
    t.start()
    t.join()
    wrong = [o for o in out if not np.array_equal(o, host.run("w", a))]
    return (wrong[0] if wrong else out[-1]), host.run("w", a)


def test_the_normal_build_passes_every_probe(fake, tmp_path):
    r = passes_every_probe(fake(), tmp_path / "selftest.json")
    d = r.to_dict()
    assert d["summary"] == "passed, driver 0.9.8: no rknn_mem_sync, rounds in parallel"
    assert d["part"] == list(PART) and d["cores"] == [0, 1, 2] and d["domain"] == 0
    assert "576x16384 in one context: bitwise the host's" in d["probes"]["head"]["text"]
    assert "at M=1,2,4,8,16,32,64,128" in d["probes"]["products"]["text"]
    lines = r.lines()
    assert lines[-1] == "NPU self-test: matmul path accepted" and all(x.startswith("NPU self-test: ") for x in lines)
    assert selftest.SelfTestReport.from_dict(json.loads(json.dumps(d))) == r


def _wrong_without_the_reaction(lib: str, c_round: bool = True) -> None:
    """The same misbehaving library opened without the self-test (no sync, no serial rounds) gives a wrong product:
    the probe's reaction is what makes the engine right."""
    plain = open_npu_matmul(lib, c_round=c_round)
    try:
        got, want = _product(plain)
        assert not np.array_equal(got, want)
    finally:
        plain.close()


def test_stale_cache_gets_rknn_mem_sync_around_runs(fake, tmp_path):
    lib = fake("stale-cache")
    eng = selftest.open_checked(PART, lib, cache=tmp_path / "c.json")
    try:
        r = eng.selftest
        assert r.sync and not r.serialize and r.refused is None
        assert r.probes["coherency"]["text"].startswith("without rknn_mem_sync: stale data in C after the first run")
        assert eng.sync and eng.round is None
        got, want = _product(eng)
        assert np.array_equal(got, want)
    finally:
        eng.close()
    _wrong_without_the_reaction(lib)  # stale results


def test_racing_threads_serialize_the_rounds(fake, tmp_path):
    lib = fake("racing")
    eng = selftest.open_checked(PART, lib, cache=tmp_path / "c.json")
    try:
        r = eng.selftest
        assert r.serialize and not r.sync and r.refused is None
        assert r.probes["concurrency"]["text"].startswith("3 contexts at once differ")
        assert r.concurrent_ms is not None and r.serial_ms is not None
        assert eng.round is None and eng.pool is None and len(eng.cores) == 3
        got, want = _product(eng)
        assert np.array_equal(got, want)
    finally:
        eng.close()
    for c_round in (True, False):  # the parts at once, in C or on Python's pool: wrong
        _wrong_without_the_reaction(lib, c_round)


def test_a_wrong_product_is_refused(fake, tmp_path):
    with pytest.raises(NpuRefused) as e:
        selftest.open_checked(PART, fake("wrong-product"), cache=tmp_path / "c.json")
    assert "a product differs from the host emulation: core 0 at M=16: row 0 column 0:" in str(e.value)
    assert e.value.report.refused and not e.value.report.transient


def test_an_old_driver_is_refused(fake, tmp_path):
    with pytest.raises(NpuRefused) as e:
        selftest.open_checked(PART, fake("old-driver"), cache=tmp_path / "c.json")
    assert "NPU driver 0.9.6 is older than 0.9.7" in str(e.value)
    assert set(e.value.report.probes) == {"driver"}  # nothing else ran


def test_driver_version_from_debugfs_when_the_library_does_not_answer(fake, tmp_path):
    (tmp_path / "sys/kernel/debug/rknpu").mkdir(parents=True)
    (tmp_path / "sys/kernel/debug/rknpu/version").write_text("RKNPU driver: v0.9.5\n")
    lib = api.load_library(fake())
    lib.has = lambda name: name != "rknn_query"  # a library without the query
    r = selftest.run_self_test(lib, PART, cache=tmp_path / "c.json", sysroot=tmp_path)
    assert (r.driver_version, r.driver_source) == ("0.9.5", "debugfs") and "older than 0.9.7" in r.refused
    assert probes.parse_driver("Initialized rknpu 0.9.8 20240424 for fdab0000.npu") == (0, 9, 8)


def test_a_failing_domain_switch_is_reported_and_an_unusable_domain_refused(fake, tmp_path):
    lib = fake("domain-switch")
    eng = selftest.open_checked(PART, lib, cache=tmp_path / "c.json")
    try:
        r = eng.selftest
        assert r.refused is None and not r.probes["domain"]["ok"]
        assert r.probes["domain"]["text"].startswith("a switch to domain 1 failed (rknn_create_mem returned NULL")
        assert "IOMMU domain 0 used; a switch to domain 1 failed" in "\n".join(r.lines())
        got, want = _product(eng)
        assert np.array_equal(got, want)
    finally:
        eng.close()
    with pytest.raises(NpuRefused) as e:  # the engine's own contexts in a domain the driver cannot switch to
        selftest.open_checked(PART, lib, domain=1, cache=tmp_path / "c.json")
    assert "rknn_create_mem returned NULL" in str(e.value) and "(contexts in IOMMU domain 1)" in str(e.value)
    assert e.value.report.transient and len(json.loads((tmp_path / "c.json").read_text())) == 1  # not kept


def test_answers_are_cached_per_library_and_driver(fake, tmp_path, monkeypatch):
    cache = tmp_path / "c.json"
    first = selftest.run_self_test(api.load_library(fake("stale-cache")), PART, cache=cache)
    assert not first.cached and first.sync

    def no_probe(*a, **kw):
        raise AssertionError("a probe ran")

    for name in ("coherency", "products", "concurrency", "domain_switch", "head_part"):
        monkeypatch.setattr(probes, name, no_probe)
    again = selftest.run_self_test(api.load_library(fake("stale-cache")), PART, cache=cache)
    assert again.cached and again.sync and "cached, no probe ran" in again.lines()[0]
    assert again.summary().endswith("(cached)")
    other = tmp_path / "lib" / "librknnrt.so"  # another library file: another id, the probes again
    other.parent.mkdir()
    other.write_bytes(Path(fake("stale-cache")).read_bytes() + b"\0")
    with pytest.raises(AssertionError, match="a probe ran"):
        selftest.run_self_test(api.load_library(str(other)), PART, cache=cache)
    monkeypatch.undo()
    third = selftest.run_self_test(api.load_library(str(other)), PART, cache=cache)
    assert not third.cached and third.library != first.library
    keys = json.loads(cache.read_text())
    assert len(keys) == 2 and all(f"|driver 0.9.8|probes {selftest.PROBE_SET}|" in k for k in keys)
    assert selftest.run_self_test(api.load_library(fake("stale-cache")), (576, 8192), cache=cache).cached is False


def _serve(edge_home, mm_dir, tmp_path, lib, *extra):
    return ServerProc(edge_home, tmp_path, "--model", "default", "--backend", "rknn", "--rknn-dir", str(mm_dir),
                      "--rknn-runner", "librknnrt", "--no-disk-kv", *extra,
                      env={"EDGE_LLM_LIBRKNNRT": lib})


def test_health_page_and_doctor_show_the_decisions(default_mm_rtn, edge_home, fake, tmp_path):
    lib = fake("racing")
    home = tmp_path / "home"  # the self-test's cache: a home of this test's own, the models linked in
    home.mkdir()
    (home / "models").symlink_to(edge_home / "models")
    with _serve(home, default_mm_rtn, tmp_path, lib).start() as srv:
        h = srv.health().json()
        st = httpx.get(srv.url + "/v1/edge/state", timeout=30).json()
        log = srv.log()
    assert h["npu_selftest"]["serialize"] is True and h["npu_selftest"]["refused"] is None
    assert h["npu_selftest"]["summary"] == "passed, driver 0.9.8: no rknn_mem_sync, rounds serialized"
    assert st["npu_selftest"] == h["npu_selftest"]["summary"]
    assert "NPU self-test: concurrency: 3 contexts at once differ" in log and "-> rounds serialized" in log
    assert log.index("NPU self-test: matmul path accepted") < log.index("runtime ready")
    env = {**os.environ, "EDGE_LLM_HOME": str(home), "EDGE_LLM_LIBRKNNRT": lib}
    r = subprocess.run([sys.executable, "-m", "edge_llm", "doctor", "--json", "--model", "default", "--backend",
                        "rknn", "--rknn-dir", str(default_mm_rtn)], capture_output=True, text=True, timeout=300,
                       env=env)
    c = {x["name"]: x for x in json.loads(r.stdout)["checks"]}["npu-selftest"]
    assert c["status"] == "warn" and "rounds serialized (cached)" in c["detail"], c  # the server's answers
    assert "concurrency: 3 contexts at once differ" in c["detail"]


def test_a_refusal_stops_a_named_rknn_backend(default_mm_rtn, edge_home, fake, tmp_path):
    srv = _serve(edge_home, default_mm_rtn, tmp_path, fake("wrong-product"), "--log-file", "off").start(wait=False)
    rc = srv.proc.wait(timeout=300)
    err = srv.stderr()
    assert rc == 1, err[-2000:]
    assert "the NPU matmul path's self-test refused it: a product differs from the host emulation: core 0 at M=16" in err


def test_auto_falls_back_when_the_self_test_refuses(default_mm_rtn, default_model_dir, fake, monkeypatch):
    from edge_llm.backends import choice
    from edge_llm.backends.npu import backend as npu_backend
    from edge_llm.runtime import load_runtime
    from edge_llm.settings import Settings

    monkeypatch.setattr(npu_backend, "npu_present", lambda sysroot="/": "/dev/rknpu")  # a board, to `auto`
    monkeypatch.setattr(choice, "quant_runtime", lambda: None)  # the fall-back is cpu (no cpu-q graphs to build)
    # the round-to-nearest conversion carries no accuracy record (its measurement is test_quant_record's and
    # test_mm8's subject): auto takes it as a passing one here, so that the self-test is what refuses it
    monkeypatch.setattr(choice, "rknn_record", lambda rknn_dir: (True, "accuracy record passes (taken as such here)"))
    monkeypatch.setenv("EDGE_LLM_LIBRKNNRT", fake("old-driver"))
    eng = load_runtime(Settings(model=str(default_model_dir), backend="auto", rknn_dir=str(default_mm_rtn),
                                disk_kv=None))
    assert eng.model.backend.name == "cpu"
    assert eng.backend_reason.startswith("backend auto -> cpu (the NPU matmul path's self-test refused it: NPU "
                                         "driver 0.9.6 is older than 0.9.7"), eng.backend_reason
    assert eng.npu_selftest["refused"].startswith("NPU driver 0.9.6") and eng.npu_selftest["summary"].startswith(
        "refused: ")
