"""Snapshots removed under a running server (docs/store.md, "Files that vanish"), on the default
model through the real process: a file deleted by hand, the namespace directory removed, and
`edge-llm kv rm` / `kv gc` run as their own processes against the live kv dir. /health and /metrics
count what is on disk at once; resending the conversation writes its snapshot again (today's main
skipped it as "already stored"), and the next process restores from that file."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
from serverutil import ServerProc, wait_for

from edge_llm.snapshot.format import SNAPSHOT_GLOB

ARGS = ("--model", "default", "--max-seq", "1024", "--backend", "cpu")
FACTS = " ".join(f"Fact {i}: the ferry from harbour {i} leaves at {i + 6} o'clock with {i * 11} crates."
                 for i in range(1, 13))  # > 128 tokens: a restore covers at least one prefill chunk
SAVE_DONE = re.compile(r"\[KV-DISK\] (saved|skipped|save failed:) \d+-token KV -> (kv_[0-9a-f]{16}\.kv)")


def conversation(topic: str) -> list[dict]:
    return [{"role": "user", "content": f"{topic}\n{FACTS}\nWhich ferry carries the most crates?"}]


def chat(srv: ServerProc, messages: list[dict]) -> str:
    """One request; returns the name its save wrote or skipped (waits for the writer)."""
    mark = srv.log_size()
    r = httpx.post(srv.url + "/v1/chat/completions", timeout=300,
                   json={"messages": messages, "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    m = wait_for(lambda: SAVE_DONE.search(srv.log(mark)), timeout=120, what="the request's save")
    return m.group(2)


def on_disk(kv: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in kv.glob("*/" + SNAPSHOT_GLOB)}


def assert_counts_match(srv: ServerProc, kv: Path) -> None:
    files = on_disk(kv)
    snap = srv.health().json()["snapshots"]
    assert (snap["count"], snap["bytes"]) == (len(files), sum(files.values())), (snap, files)
    metrics = httpx.get(srv.url + "/metrics", timeout=30).text
    gauge = re.search(r"^edge_llm_snapshot_files (\S+)$", metrics, re.M)
    assert gauge is not None and float(gauge.group(1)) == len(files)


def kv_cli(home: Path, *args: str) -> str:
    r = subprocess.run([sys.executable, "-m", "edge_llm", "kv", *args], capture_output=True, text=True,
                       timeout=120, env={**os.environ, "EDGE_LLM_HOME": str(home)})
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def resend_writes_it_again(srv: ServerProc, kv: Path, messages: list[dict], name: str) -> str:
    """The conversation whose file is gone, sent again: its snapshot is written (main: skipped as
    "already stored"), and the counts still match the disk. Returns the log of that request."""
    assert name not in on_disk(kv)
    assert_counts_match(srv, kv)  # main: still counts the removed file(s)
    mark = srv.log_size()
    assert chat(srv, messages) == name
    text = srv.log(mark)
    assert "[KV-DISK] saved" in text and "already stored" not in text, text
    assert name in on_disk(kv)
    assert_counts_match(srv, kv)
    return text


def test_vanished_snapshots_are_written_again_counted_and_restored(edge_home, tmp_path):
    """Four ways a file leaves under the live server, one after the other on one process (one
    start, one restart: the test stays fast); each step fails on today's main on its own. The
    conversation sent again is the one in the RAM cache, so no failed restore can hide a stale
    index entry: only the save's own check can."""
    kv, log_file = tmp_path / "kv", tmp_path / "edge-llm.log"
    first, second = conversation("Harbour timetable."), conversation("Another harbour, another list.")
    with ServerProc(edge_home, tmp_path, *ARGS, kv_dir=kv, log_file=log_file).start() as srv:
        other = chat(srv, second)
        name = chat(srv, first)
        ns = next(kv.glob(f"*/{name}")).parent
        assert set(on_disk(kv)) == {name, other}
        # 1. deleted by hand
        (ns / name).unlink()
        resend_writes_it_again(srv, kv, first, name)
        # 2. `edge-llm kv rm NAME`, its own process
        assert f"removed {ns.name}/{name}" in kv_cli(edge_home, "rm", "--kv-dir", str(kv), name)
        resend_writes_it_again(srv, kv, first, name)
        # 3. `edge-llm kv gc`: with `first` made the least recently used (its mtime is its last use)
        os.utime(ns / name, (1e9, 1e9))
        out = kv_cli(edge_home, "gc", "--kv-dir", str(kv), "--max-files", "1")
        assert f"evicted {ns.name}/{name}" in out and other not in out
        resend_writes_it_again(srv, kv, first, name)
        # 4. the whole namespace directory removed: made again (identity.json too), and said so
        shutil.rmtree(ns)
        text = resend_writes_it_again(srv, kv, first, name)  # main: the save failed (no directory)
        assert f"namespace directory {ns.name} was removed under the running store: recreated" in text
        assert (ns / "identity.json").is_file() and set(on_disk(kv)) == {name}
    with ServerProc(edge_home, tmp_path, *ARGS, kv_dir=kv, log_file=log_file).start() as srv:
        mark = srv.log_size()
        assert_counts_match(srv, kv)
        chat(srv, first)
        assert re.search(rf"\[KV-DISK\] loaded \d+-token KV prefix from disk file {name}", srv.log(mark)), \
            srv.log(mark)
