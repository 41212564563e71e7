"""`disk_kv_prefetch = "latest"` through real server processes, real sockets and real snapshot files.

A restart with prefetch on restores the latest conversation while idle; the follow-up reuses the
rows from RAM, says so (`cache_source`, the `[KV-DISK] reused ... at start` line naming the file,
/metrics) and answers bitwise as a server without prefetch that restores on demand. A request for
another conversation during the read preempts it; the follow-up during the read joins it; a
corrupt latest snapshot is quarantined and the server serves on. The in-flight cases hold the
read with tests/helpers/slow_disk_serve.py (the real reader; a read gate the test opens once its
request is queued, or a sleep per layer): a slow device cannot be relied on here, and neither can
any fixed time on a busy machine.
"""

from __future__ import annotations

import re
import shutil
import signal
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from serverutil import ServerProc, wait_for

from edge_llm.snapshot.format import SNAPSHOT_GLOB, SNAPSHOT_NAME

HELPERS = Path(__file__).parent / "helpers"
ARGS = ("--model", "default", "--max-seq", "2048", "--disk-kv-compact-idle", "none")
PREFETCH = ("--disk-kv-prefetch", "latest")
STORY = " ".join(f"Note {i}: the lighthouse keeper counted {i * 7} ships passing the northern cape."
                 for i in range(1, 30))
QUESTION = "\nQuestion: how many ships did note 3 count?\nAnswer:"
FOLLOW_UP = "\nQuestion: and how many did note 5 count?\nAnswer:"
OTHER = " ".join(f"Item {i}: the baker sold {i * 3} loaves of rye before noon on market day."
                 for i in range(1, 12)) + "\nQuestion: how many loaves did item 2 sell?\nAnswer:"
LOADED_IN_RAM = re.compile(rf"\[KV-DISK\] prefetch: (\d+)-token KV prefix of ({SNAPSHOT_NAME}) is in RAM")
REUSED = re.compile(rf"\[KV-DISK\] reused (\d+)-token KV prefix read from disk file ({SNAPSHOT_NAME}) at start")


def complete(srv: ServerProc, prompt: str, max_tokens: int = 16) -> dict:
    r = httpx.post(srv.url + "/v1/completions", timeout=900,
                   json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def prefetches(srv: ServerProc) -> dict[str, float]:
    text = httpx.get(srv.url + "/metrics", timeout=30).text
    return {m[1]: float(m[2]) for m in re.finditer(r'^edge_llm_prefetches_total\{outcome="(\w+)"\} ([\d.]+)$',
                                                   text, re.M)}


def first_conversation(home: Path, work: Path, kv: Path) -> tuple[str, str]:
    """S1 without prefetch: the cold request, its snapshot flushed by SIGTERM; (answer, file name)."""
    srv = ServerProc(home, work / "s1", *ARGS, kv_dir=kv).start()
    r1 = complete(srv, STORY + QUESTION)
    assert r1["timings"]["cache_source"] == "none"
    assert srv.stop(signal.SIGTERM, timeout=600) == 0  # the flush waits behind the disk's other writers
    (snap,) = kv.glob("*/" + SNAPSHOT_GLOB)
    return r1["choices"][0]["text"], snap.name


# three to four server processes each (model loads): the marks bound a hang on a busy machine
@pytest.mark.timeout(1800)
def test_prefetched_follow_up_is_the_on_demand_restore(edge_home, tmp_path):
    kv = tmp_path / "kv"
    answer, snap = first_conversation(edge_home, tmp_path, kv)
    follow_up = STORY + QUESTION + answer + FOLLOW_UP
    shutil.copytree(kv, tmp_path / "kv-copy")  # the same files for the server without prefetch

    # ---- with prefetch: the follow-up arrives after the prefetch finished ----------------------
    with ServerProc(edge_home, tmp_path / "s2", *ARGS, *PREFETCH, kv_dir=kv) as srv:
        srv.start()
        m = wait_for(lambda: LOADED_IN_RAM.search(srv.log()), 600, what="the prefetch")
        assert m[2] == snap
        # the prefetch states and counts its outcome before it logs the line (server/prefetch.py)
        assert srv.health().json()["prefetch"] == "loaded"
        assert prefetches(srv) == {"started": 1, "loaded": 1, "joined": 0, "preempted": 0, "failed": 0, "used": 0}
        mark = srv.log_size()  # the request's own marker: its evidence comes after it
        r2 = complete(srv, follow_up)
        t2, after = r2["timings"], srv.log(mark)
        assert t2["cache_source"] == "disk-prefetch" and t2["restore_bytes"] == 0
        used = REUSED.search(after)
        assert used and used[2] == snap and int(used[1]) == r2["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert int(used[1]) == t2["disk_cached_tokens"] > 0 and t2["ram_cached_tokens"] == 0
        assert "[KV-DISK] loaded" not in after  # this request read nothing itself
        assert after.index("[KV-DISK] reused") < after.index("[PREFILL-TIMING]")
        assert prefetches(srv)["used"] == 1
        # the next request reuses its predecessor's rows: plain RAM again
        r2b = complete(srv, follow_up)
        assert r2b["timings"]["cache_source"] == "ram" and prefetches(srv)["used"] == 1

    # ---- without prefetch (the default): restored on demand, the same answer bitwise -----------
    with ServerProc(edge_home, tmp_path / "s3", *ARGS, kv_dir=tmp_path / "kv-copy") as srv:
        srv.start()
        assert srv.health().json()["prefetch"] == "off"
        r3 = complete(srv, follow_up)
        t3 = r3["timings"]
        assert t3["cache_source"] == "disk" and t3["restore_bytes"] > 0
        assert r3["choices"][0]["text"] == r2["choices"][0]["text"]
        assert t3["prefill_tokens"] == t2["prefill_tokens"] and t3["align_rows"] == t2["align_rows"]
        assert r3["usage"] == r2["usage"]
        assert "[KV-DISK] prefetch" not in srv.log() and set(prefetches(srv).values()) == {0}


def slow_server(home: Path, work: Path, kv: Path, layer_s: float = 0.3, read_gate: Path | None = None) -> ServerProc:
    env = {"SLOW_LAYER_S": str(layer_s), **({"READ_GATE": str(read_gate)} if read_gate else {})}
    return ServerProc(home, work, *ARGS, *PREFETCH, kv_dir=kv, env=env,
                      entry=[sys.executable, str(HELPERS / "slow_disk_serve.py")])


def during_the_read(srv: ServerProc, gate: Path, prompt: str) -> dict:
    """`prompt` sent while the prefetch's read is held after its first layer (the read gate): the
    gate opens only once /health counts the request in the queue, so the read's next step sees it
    whatever the machine's speed (no read that ends before the request is admitted)."""
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(complete, srv, prompt)
        wait_for(lambda: answer.done() or srv.health().json()["queue_depth"] >= 1, 300,
                 what="the request queued behind the prefetch")
        gate.touch()
        return answer.result()


@pytest.mark.timeout(1800)
def test_request_during_the_prefetch_joins_or_preempts(edge_home, tmp_path):
    kv = tmp_path / "kv"
    answer, snap = first_conversation(edge_home, tmp_path, kv)
    follow_up = STORY + QUESTION + answer + FOLLOW_UP
    shutil.copytree(kv, tmp_path / "kv-copy")
    with ServerProc(edge_home, tmp_path / "ref", *ARGS, "--no-disk-kv") as ref:  # cold answers
        ref.start()
        cold_other = complete(ref, OTHER)["choices"][0]["text"]
        cold_follow = complete(ref, follow_up)["choices"][0]["text"]

    # ---- another conversation arrives during the read: the prefetch is preempted ----------------
    gate = tmp_path / "read-gate-s2"
    with slow_server(edge_home, tmp_path / "s2", kv, 0.1, gate) as srv:
        srv.start()
        wait_for(lambda: "[KV-DISK] prefetch: restoring" in srv.log(), 300, what="the prefetch to start")
        r = during_the_read(srv, gate, OTHER)
        assert r["timings"]["cache_source"] == "none" and r["choices"][0]["text"] == cold_other
        log = srv.log()
        assert re.search(rf"\[KV-DISK\] prefetch of {snap} preempted at layer \d+/30: a request for another", log)
        assert "is in RAM" not in log and "reused" not in log
        assert prefetches(srv) == {"started": 1, "loaded": 0, "joined": 0, "preempted": 1, "failed": 0, "used": 0}
        assert srv.health().json()["prefetch"] == "preempted"
        # the snapshot is intact: the follow-up restores it on demand and answers as a cold run
        r = complete(srv, follow_up)
        assert r["timings"]["cache_source"] == "disk" and r["choices"][0]["text"] == cold_follow

    # ---- the follow-up arrives during the read: it joins and starts from the rows read ---------
    gate = tmp_path / "read-gate-s3"
    with slow_server(edge_home, tmp_path / "s3", tmp_path / "kv-copy", 0.1, gate) as srv:
        srv.start()
        wait_for(lambda: "[KV-DISK] prefetch: restoring" in srv.log(), 300, what="the prefetch to start")
        r = during_the_read(srv, gate, follow_up)
        assert r["timings"]["cache_source"] == "disk-prefetch" and r["choices"][0]["text"] == cold_follow
        log = srv.log()
        assert re.search(r"a request for this conversation joins the read at layer \d+/30", log)
        assert LOADED_IN_RAM.search(log) and REUSED.search(log)[2] == snap
        assert prefetches(srv) == {"started": 1, "loaded": 1, "joined": 1, "preempted": 0, "failed": 0, "used": 1}


@pytest.mark.timeout(1800)
def test_corrupt_latest_snapshot_is_quarantined_and_the_server_serves(edge_home, tmp_path):
    kv = tmp_path / "kv"
    answer, snap = first_conversation(edge_home, tmp_path, kv)
    (path,) = kv.glob("*/" + snap)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # a payload byte: the header stays valid, so the scan indexes it
    path.write_bytes(bytes(data))
    follow_up = STORY + QUESTION + answer + FOLLOW_UP
    with ServerProc(edge_home, tmp_path / "s2", *ARGS, *PREFETCH, kv_dir=kv) as srv:
        srv.start()
        # the outcome is counted before the state is set, and the lines come before both
        # (server/prefetch.py): once /health says failed, the log and /metrics say it too
        wait_for(lambda: srv.health().json()["prefetch"] == "failed", 600, what="the prefetch to fail")
        log = srv.log()
        assert re.search(rf"\[KV-DISK\] rejected {snap}: ", log) and f"prefetch of {snap} failed" in log
        assert list((path.parent / "quarantine").glob("*-" + snap)) and not path.exists()
        assert prefetches(srv) == {"started": 1, "loaded": 0, "joined": 0, "preempted": 0, "failed": 1, "used": 0}
        r = complete(srv, follow_up)
        assert r["timings"]["cache_source"] == "none"
    with ServerProc(edge_home, tmp_path / "ref", *ARGS, "--no-disk-kv") as ref:
        ref.start()
        assert complete(ref, follow_up)["choices"][0]["text"] == r["choices"][0]["text"]


@pytest.mark.parametrize("setting", ["latest"])
def test_prefetch_without_disk_kv_is_a_no_op(edge_home, tmp_path, setting):
    with ServerProc(edge_home, tmp_path, *ARGS, "--no-disk-kv", "--disk-kv-prefetch", setting) as srv:
        srv.start()
        assert srv.health().json()["prefetch"] == "off"
        assert "no snapshots to prefetch (disk KV is off)" in srv.log()
        assert complete(srv, OTHER)["timings"]["cache_source"] == "none"


def test_sigterm_during_the_prefetch_stops_it_and_exits_cleanly(edge_home, tmp_path):
    kv = tmp_path / "kv"
    _, snap = first_conversation(edge_home, tmp_path, kv)
    # the read is held after its first layer until the shutdown has begun; then each layer takes
    # 2 s, so the worker has stopped taking work (right after the "shutdown requested" line) well
    # before the read's next step looks
    gate = tmp_path / "read-gate"
    srv = slow_server(edge_home, tmp_path / "s2", kv, 2.0, gate).start()
    try:
        wait_for(lambda: "[KV-DISK] prefetch: restoring" in srv.log(), 300, what="the prefetch to start")
        mark = srv.log_size()
        srv.send(signal.SIGTERM)
        wait_for(lambda: "shutdown requested" in srv.log(mark), 300, what="the shutdown to begin")
        gate.touch()
        assert srv.proc.wait(300) == 0  # bounds a hang only
    finally:
        if srv.proc.poll() is None:
            srv.kill()
    log = srv.log()
    assert re.search(rf"\[KV-DISK\] prefetch of {snap} preempted at layer \d+/30: shutdown", log)
    assert "reason=SIGTERM code=0" in log and list(kv.glob("*/" + snap))  # the snapshot stays
