"""Log file: append-only across restarts, a banner per start, reopened after SIGHUP."""

from __future__ import annotations

import logging
import os
import re
import signal

import httpx
from serverutil import ServerProc, wait_for

from edge_llm.logsetup import log_banner, log_exit, setup_logging

BANNER = re.compile(r"=== edge-llm \S+ start pid=(\d+) boot_id=(\S+) model=(\S+) backend=cpu ")


def test_handler_appends_and_reopens(tmp_path):
    path = tmp_path / "logs" / "edge.log"
    path.parent.mkdir()
    path.write_text("line from an earlier run\n")
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    setup = setup_logging(path)
    try:
        lg = logging.getLogger("edge_llm.test")
        lg.info("[KV-DISK] first")
        # flushed per line: readable before any close
        assert path.read_text().startswith("line from an earlier run\n") and "[KV-DISK] first" in path.read_text()
        os.rename(path, tmp_path / "logs" / "edge.log.1")  # what logrotate does
        lg.info("still to the renamed file")
        setup.reopen()  # what SIGHUP does
        lg.info("[PREFILL-TIMING] n=1 total=1.0ms")
        log_banner(model="m", backend="cpu")
        log_exit("test", setup)
    finally:
        for h in list(root.handlers):
            root.removeHandler(h)
            h.close()
        for h in saved[0]:
            root.addHandler(h)
        root.setLevel(saved[1])
    old = (tmp_path / "logs" / "edge.log.1").read_text()
    new = path.read_text()
    assert "[KV-DISK] first" in old and "still to the renamed file" in old and "PREFILL" not in old
    lines = new.splitlines()
    assert "log file reopened (SIGHUP)" in lines[0]
    assert "[PREFILL-TIMING] n=1 total=1.0ms" in lines[1]
    assert BANNER.search(lines[2]).group(1) == str(os.getpid())
    assert "reason=test code=0" in lines[3]


def _request(srv: ServerProc) -> None:
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": "hello world", "max_tokens": 2}, timeout=300)
    assert r.status_code == 200, r.text


def test_restart_keeps_lines_and_sighup_reopens(tiny_synth_dir, tmp_path):
    log_file = tmp_path / "edge-llm.log"
    args = ("--model", str(tiny_synth_dir), "--max-seq", "128")
    first = ServerProc(tmp_path / "home", tmp_path, *args, log_file=log_file).start()
    _request(first)
    assert first.stop() == 0
    text1 = log_file.read_text()
    assert len(BANNER.findall(text1)) == 1 and "reason=SIGTERM code=0" in text1

    second = ServerProc(tmp_path / "home", tmp_path, *args, log_file=log_file).start()
    try:
        _request(second)
        text2 = log_file.read_text()
        assert text2.startswith(text1)  # append-only: the previous run's lines are kept
        banners = BANNER.findall(text2)
        assert [b[0] for b in banners] == [str(first.proc.pid), str(second.proc.pid)]
        assert banners[0][1] == banners[1][1]  # same boot
        assert f"ready: url=http://127.0.0.1:{second.port} model=" in text2[len(text1):]
        assert "namespace=" in text2[len(text1):]
        # uvicorn's early line says that the model is still loading, and comes before the ready line
        run2 = text2[len(text1):]
        listening = run2.find(f"listening on http://127.0.0.1:{second.port}: loading the model")
        assert 0 <= listening < run2.find("ready: url=") and "Uvicorn running on" not in run2

        rotated = tmp_path / "edge-llm.log.1"
        os.rename(log_file, rotated)
        second.send(signal.SIGHUP)
        _request(second)  # produces log lines after the reopen
        assert second.proc.poll() is None  # SIGHUP does not end the service
        # the worker logs "done" after the response went out: wait for the line, don't race it
        wait_for(lambda: "done (completion)" in log_file.read_text(),
                 what="the request's log line in the reopened file")
        new = log_file.read_text()
        assert "log file reopened (SIGHUP)" in new
        assert "log file reopened" not in rotated.read_text()
    finally:
        assert second.stop() == 0
    assert "reason=SIGTERM code=0" in log_file.read_text()


def test_failed_start_logs_the_reason_and_exits_1(tmp_path):
    log_file = tmp_path / "edge-llm.log"
    srv = ServerProc(tmp_path / "home", tmp_path, "--model", str(tmp_path / "no-such-model"), log_file=log_file)
    srv.start(wait=False)
    assert srv.proc.wait(300) == 1
    text = log_file.read_text()
    assert len(BANNER.findall(text)) == 1
    assert re.search(r"=== edge-llm exit pid=\d+ reason=model load failed: ConfigError: .*no-such-model.* code=1", text)


LATE_RECORD = """
import logging, sys, threading
from edge_llm.logsetup import setup_logging

setup_logging(sys.argv[1])
go = threading.Event()

def loader():  # the server's model loader: a daemon thread that logs while the process exits
    go.wait()
    logging.getLogger("edge_llm.footprint").info("memory: estimated 1.02 GiB")

t = threading.Thread(target=loader, daemon=True)
t.start()
logging.getLogger("edge_llm.server").error("[Errno 98] address already in use")
logging.shutdown()  # what the interpreter's exit does (atexit) before daemon threads stop
go.set()
t.join()
"""


def test_a_record_after_shutdown_is_dropped_without_a_traceback(tmp_path):
    """A server that cannot bind its port exits while its loader thread still logs: the file
    handler is closed by then. The late record is dropped; no "--- Logging error ---" traceback
    on stderr buries the reason the server exited (tools/test-recovery.sh shows stderr's tail)."""
    import subprocess
    import sys

    log_file = tmp_path / "edge-llm.log"
    r = subprocess.run([sys.executable, "-c", LATE_RECORD, str(log_file)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert "Logging error" not in r.stderr and "closed file" not in r.stderr, r.stderr
    assert "address already in use" in r.stderr and "address already in use" in log_file.read_text()
    assert "memory: estimated" not in log_file.read_text()
