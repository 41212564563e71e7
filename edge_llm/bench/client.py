"""Driving a real `edge-llm serve` from outside: process control, HTTP, log markers, kv dir size.

Used by `edge-llm bench recovery` and by tools/recovery_check.py (the docs/evidence.md evidence
script). HTTP and processes with the standard library only (urllib, subprocess), so it runs
unchanged on a board that has nothing but the installed package.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from email.message import Message
from pathlib import Path

from edge_llm.snapshot.layout import SNAPSHOT_NAME, is_snapshot_name

log = logging.getLogger(__name__)

# the log lines of docs/logs.md
SAVED_RE = re.compile(rf"\[KV-DISK\] saved (\d+)-token KV -> ({SNAPSHOT_NAME}) \((\d+) bytes, ([\d.]+) ms, ([\d.]+) MB/s\)")
LOADED_RE = re.compile(rf"\[KV-DISK\] loaded (\d+)-token KV prefix from disk file ({SNAPSHOT_NAME})"
                       r" \((\d+) bytes, ([\d.]+) ms, ([\d.]+) MB/s\)")
# a request reused rows a start-up prefetch read (disk_kv_prefetch; its LOADED_RE line came at start)
REUSED_RE = re.compile(rf"\[KV-DISK\] reused (\d+)-token KV prefix read from disk file ({SNAPSHOT_NAME}) at start")
# either disk read a request's prefix came from: this request's own restore, or the prefetch's rows
DISK_READ_RE = re.compile(f"{LOADED_RE.pattern}|{REUSED_RE.pattern}")
SKIPPED_RE = re.compile(rf"\[KV-DISK\] skipped (\d+)-token KV -> ({SNAPSHOT_NAME})")
# aligned=K: rows of the n that matched but were recomputed (docs/store.md); absent in older logs
PREFILL_RE = re.compile(r"\[PREFILL-TIMING\] n=(\d+) total=([\d.]+)ms(?: aligned=(\d+))?")


# ---- log file ------------------------------------------------------------------------------------
def log_offset(path: str | os.PathLike) -> int:
    """Byte offset marker: the current size of the (append-only) log file, 0 if it does not exist."""
    try:
        return os.path.getsize(path)
    except FileNotFoundError:
        return 0


def read_since(path: str | os.PathLike, offset: int) -> str:
    """Text appended to the log after `offset` (only these lines count as evidence for a phase)."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read().decode("utf-8", errors="replace")
    except FileNotFoundError:
        return ""


def wait_for_line(path: str | os.PathLike, offset: int, pattern: re.Pattern, timeout: float,
                  poll: float = 0.1) -> re.Match | None:
    """Poll the log until a line matching `pattern` appears after `offset`; None on timeout."""
    deadline = time.monotonic() + timeout
    while True:
        m = pattern.search(read_since(path, offset))
        if m or time.monotonic() >= deadline:
            return m
        time.sleep(poll)


def snapshot_bytes(path: str | os.PathLike) -> int:
    """Total size of the snapshot files (`kv_<hash>.kv`) below `path` (0 if it does not exist).

    Only KV data counts: a namespace's metadata (identity, write counters, the cost gate's
    estimates) is rewritten by any run, including one that restores without writing a row."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            if not is_snapshot_name(name):
                continue
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except FileNotFoundError:
                pass  # evicted or compacted while walking
    return total


def dir_listing(path: str | os.PathLike) -> list[dict]:
    out = []
    for root, _dirs, files in os.walk(path):
        for name in sorted(files):
            p = os.path.join(root, name)
            try:
                out.append({"path": os.path.relpath(p, path), "bytes": os.lstat(p).st_size})
            except FileNotFoundError:
                pass
    return out


# ---- HTTP ------------------------------------------------------------------------------------------
class HTTPFailure(RuntimeError):
    pass


def http_call(method: str, url: str, body: dict | None = None, timeout: float = 600.0,
              api_key: str | None = None) -> tuple[int, Message, dict]:
    """One request; returns (status, response headers, parsed JSON body, or {"raw": text}).
    Connection errors raise HTTPFailure."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, headers, raw = r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        status, headers, raw = e.code, e.headers, e.read()
    except (urllib.error.URLError, OSError) as e:
        raise HTTPFailure(f"{method} {url}: {e}") from e
    try:
        return status, headers, json.loads(raw or b"{}")
    except json.JSONDecodeError:
        return status, headers, {"raw": raw.decode("utf-8", errors="replace")}


def http_json(method: str, url: str, body: dict | None = None, timeout: float = 600.0,
              api_key: str | None = None) -> tuple[int, dict]:
    """One request; returns (status, parsed JSON body). Connection errors raise HTTPFailure."""
    status, _, parsed = http_call(method, url, body, timeout, api_key)
    return status, parsed


# /health `prefetch` states of a start-up prefetch not decided or not finished yet (docs/store.md)
PREFETCH_UNSETTLED = ("pending", "running")


def wait_ready(base_url: str, timeout: float, proc: subprocess.Popen | None = None,
               api_key: str | None = None, stderr_file: str | os.PathLike | None = None,
               prefetch_settled: bool = False) -> float:
    """Poll GET /health until 200; return seconds waited. Raises TimeoutError / RuntimeError
    (with the end of the server's stderr, if it was written to `stderr_file`).
    `prefetch_settled`: also until its `prefetch` has left PREFETCH_UNSETTLED (`off` with the
    prefetch off), so a request sent next finds the latest conversation in RAM, or its outcome."""
    t0 = time.monotonic()
    while True:
        if proc is not None and proc.poll() is not None:
            tail = ""
            if stderr_file is not None:
                try:
                    tail = ":\n" + Path(stderr_file).read_text(errors="replace")[-2000:]
                except OSError:
                    pass
            raise RuntimeError(f"server process exited with code {proc.returncode} before it was ready{tail}")
        try:
            status, body = http_json("GET", base_url.rstrip("/") + "/health", timeout=5, api_key=api_key)
            if status == 200 and not (prefetch_settled and isinstance(body, dict)
                                      and body.get("prefetch") in PREFETCH_UNSETTLED):
                return time.monotonic() - t0
        except HTTPFailure:
            pass
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"{base_url} not ready within {timeout:.0f} s")
        time.sleep(0.2)


@dataclass
class Completion:
    """One /v1/completions answer plus what the client measured."""

    text: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    timings: dict
    wall_ms: float
    raw: dict = field(repr=False, default_factory=dict)

    def to_dict(self) -> dict:
        return {"text": self.text, "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens, "cached_tokens": self.cached_tokens,
                "timings": self.timings, "wall_ms": round(self.wall_ms, 1)}


def complete(base_url: str, prompt: str | list[int], max_tokens: int, timeout: float = 3600.0,
             api_key: str | None = None) -> Completion:
    """Greedy (temperature 0) completion; raises HTTPFailure on a non-200 answer."""
    t0 = time.perf_counter()
    status, body = http_json("POST", base_url.rstrip("/") + "/v1/completions",
                             {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
                             timeout=timeout, api_key=api_key)
    wall = (time.perf_counter() - t0) * 1e3
    if status != 200:
        raise HTTPFailure(f"/v1/completions answered {status}: {json.dumps(body)[:500]}")
    usage = body.get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    return Completion(text=body["choices"][0]["text"], prompt_tokens=int(usage.get("prompt_tokens", 0)),
                      completion_tokens=int(usage.get("completion_tokens", 0)),
                      cached_tokens=int(details.get("cached_tokens") or 0),
                      timings=dict(body.get("timings") or {}), wall_ms=wall, raw=body)


# ---- the local server process ---------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalServer:
    """`python -m edge_llm serve ...` started and killed by us (the default, no-systemd mode)."""

    def __init__(self, model: str, kv_dir: str | os.PathLike, log_file: str | os.PathLike,
                 port: int | None = None, extra_args: list[str] | None = None,
                 stderr_file: str | os.PathLike | None = None):
        self.port = port or free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.args = [sys.executable, "-m", "edge_llm", "serve", "--model", str(model), "--host", "127.0.0.1",
                     "--port", str(self.port), "--disk-kv", str(kv_dir), "--log-file", str(log_file),
                     *(extra_args or [])]
        self.stderr_file = stderr_file
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        err = open(self.stderr_file, "ab") if self.stderr_file else subprocess.DEVNULL
        try:
            self.proc = subprocess.Popen(self.args, stdout=subprocess.DEVNULL, stderr=err,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        finally:
            if self.stderr_file:
                err.close()
        log.info("started edge-llm serve pid %d on port %d", self.proc.pid, self.port)

    def stop(self, sig: int = signal.SIGKILL, timeout: float = 60.0) -> int | None:
        """Signal our own process (by pid) and reap it; returns its exit code."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(timeout)

    def restart(self, sig: int = signal.SIGKILL) -> None:
        self.stop(sig)
        self.start()


def run_restart_cmd(cmd: str, timeout: float = 300.0) -> None:
    """The board's restart command (e.g. `systemctl restart edge-llm`); raises on failure."""
    r = subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"restart command {cmd!r} failed ({r.returncode}): {r.stderr.strip()[:500]}")
