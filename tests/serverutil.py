"""Run a real `python -m edge_llm serve` subprocess on a free port for the server tests.

The session fixtures `edge_home` (one EDGE_LLM_HOME with the default model imported once) and
`tiny_synth_dir` live in conftest.py, so every module shares one instance of each.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

READY_TIMEOUT = 600  # generous: a hang is a failure, slowness on a loaded CI box is not
KEEPALIVE_S = 2.0  # a client keeps an idle connection for less than the server (5 s) does
STOP_TIMEOUT = 180


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProc:
    """One server process: start, wait for /health 200, signal, read its log file."""

    def __init__(self, home: Path, workdir: Path, *args: str, env: dict[str, str] | None = None,
                 port: int | None = None, log_file: Path | None = None, kv_dir: Path | None = None,
                 entry: list[str] | None = None):
        self.home, self.workdir = Path(home), Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.log_file = log_file or self.workdir / "edge-llm.log"
        self.kv_dir = kv_dir or self.workdir / "kv"
        self.args = list(args)
        # the program: `python -m edge_llm`, or a test helper that wraps it (e.g. a stuck engine)
        self.entry = entry or [sys.executable, "-m", "edge_llm"]
        self.env = {**os.environ, "EDGE_LLM_HOME": str(self.home), "PYTHONUNBUFFERED": "1",
                    **(env or {})}
        self.proc: subprocess.Popen | None = None
        self.stderr_path = self.workdir / f"stderr-{self.port}.txt"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        cmd = [*self.entry, "serve", "--host", "127.0.0.1", "--port", str(self.port),
               "--log-file", str(self.log_file)]
        if "--no-disk-kv" not in self.args and "--disk-kv" not in self.args:
            cmd += ["--disk-kv", str(self.kv_dir)]
        return cmd + self.args

    def start(self, wait: bool = True) -> "ServerProc":
        err = open(self.stderr_path, "ab")
        self.proc = subprocess.Popen(self.command(), env=self.env, cwd=self.workdir,
                                     stdout=err, stderr=subprocess.STDOUT)
        err.close()
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self, timeout: float = READY_TIMEOUT) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.stderr()[-3000:]}")
            try:
                r = httpx.get(self.url + "/health", timeout=5)
                if r.status_code == 200:
                    return r.json()
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"server not ready after {timeout}s:\n{self.stderr()[-3000:]}")

    def send(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = STOP_TIMEOUT) -> int:
        """Send `sig` and wait for the exit; returns the exit code."""
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise

    def kill(self) -> int:
        """SIGKILL: nothing runs after this, exactly like a power cut for the process."""
        return self.stop(signal.SIGKILL)

    def stderr(self) -> str:
        try:
            return self.stderr_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log(self, offset: int = 0) -> str:
        """The log file from byte `offset` (a marker taken with `log_size()`)."""
        try:
            with open(self.log_file, "rb") as f:
                f.seek(offset)
                return f.read().decode(errors="replace")
        except FileNotFoundError:
            return ""

    def log_size(self) -> int:
        try:
            return self.log_file.stat().st_size
        except FileNotFoundError:
            return 0

    def openai(self, api_key: str = "unused", **kw):
        import openai

        # pooled connections expire before the server's keep-alive timeout (5 s, cli/serve.py):
        # a request never goes out on a connection the server is closing (no retries to hide that)
        pool = httpx.Client(timeout=READY_TIMEOUT, limits=httpx.Limits(keepalive_expiry=KEEPALIVE_S))
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0,
                             timeout=READY_TIMEOUT, http_client=pool, **kw)

    api_key: str | None = None  # sent by health(): with a key configured, the details need it

    def health(self) -> httpx.Response:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return httpx.get(self.url + "/health", timeout=30, headers=headers)

    def __enter__(self) -> "ServerProc":
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.stop(signal.SIGTERM)


def wait_for(predicate, timeout: float = 120, interval: float = 0.05, what: str = "condition"):
    """Poll until predicate() is truthy; returns its value (a hang fails, speed is not judged)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = predicate()
        if v:
            return v
        time.sleep(interval)
    raise TimeoutError(f"{what} not reached within {timeout}s")
