"""sd_notify over real unix datagram sockets: the helper alone, then a real server process."""

from __future__ import annotations

import os
import signal
import socket
import threading
import uuid

from serverutil import ServerProc

from edge_llm.sdnotify import Notifier


def _recv_all(sock: socket.socket) -> list[str]:
    out = []
    sock.settimeout(0.2)
    while True:
        try:
            out.append(sock.recv(4096).decode())
        except socket.timeout:
            return out


def test_path_socket_messages(tmp_path):
    path = str(tmp_path / "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(path)
        # WatchdogSec=1000: the rate limit (an eighth: 125 s) outlasts any stall of this process
        # between the two pings below, however busy the machine
        n = Notifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "1000000000"})
        assert n.enabled and n.watchdog_interval == 125.0
        assert n.extend_timeout(90) and n.ready("up") and n.status("busy") and n.watchdog() and n.stopping()
        assert not n.watchdog()  # rate limited to an eighth of the interval
        assert n.watchdog(force=True)
        n.close()
        assert _recv_all(sock) == ["EXTEND_TIMEOUT_USEC=90000000", "READY=1\nSTATUS=up", "STATUS=busy",
                                   "WATCHDOG=1", "STOPPING=1", "WATCHDOG=1"]
    # the interval is an eighth of WATCHDOG_USEC at any size (arithmetic only: nothing is sent)
    assert Notifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "2000000"}).watchdog_interval == 0.25


def test_abstract_socket():
    name = f"edge-llm-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        n = Notifier({"NOTIFY_SOCKET": "@" + name})
        assert n.ready()
        assert _recv_all(sock) == ["READY=1"]


def test_disabled_and_failures_are_harmless(tmp_path):
    n = Notifier({})
    assert not n.enabled and not n.ready() and not n.watchdog()
    # a manager that went away: the send fails quietly
    gone = Notifier({"NOTIFY_SOCKET": str(tmp_path / "nobody.sock"), "WATCHDOG_USEC": "1000"})
    assert gone.ready() is False and gone.watchdog() is False
    # the watchdog belongs to another pid: not ours to ping
    other = Notifier({"NOTIFY_SOCKET": str(tmp_path / "x"), "WATCHDOG_USEC": "1000",
                      "WATCHDOG_PID": str(os.getpid() + 1)})
    assert other.watchdog_interval is None
    assert Notifier({"WATCHDOG_USEC": "soon"}).watchdog_interval is None


def test_server_lifecycle_notifications(tiny_synth_dir, tmp_path):
    path = str(tmp_path / "n.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    got: list[str] = []
    done = threading.Event()

    def listen() -> None:
        sock.settimeout(0.5)
        while not done.is_set():
            try:
                got.append(sock.recv(4096).decode())
            except socket.timeout:
                continue

    t = threading.Thread(target=listen, daemon=True)
    t.start()
    srv = ServerProc(tmp_path / "home", tmp_path, "--model", str(tiny_synth_dir), "--max-seq", "256",
                     env={"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "300000"})
    try:
        srv.start()
        # wait for a few watchdog pings from the worker loop while idle
        deadline = threading.Event()
        for _ in range(600):
            if sum(m == "WATCHDOG=1" for m in got) >= 2:
                break
            deadline.wait(0.1)
        assert srv.stop(signal.SIGTERM) == 0
    finally:
        if srv.proc.poll() is None:
            srv.kill()
        done.set()
        t.join()
        # what the listener thread had not read yet (it may lag on a busy machine): the server has
        # exited, so every datagram it sent is queued on the socket by now
        got.extend(_recv_all(sock))
        sock.close()
    kinds = [m.splitlines()[0].split("=")[0] for m in got]
    assert "READY" in kinds and "STOPPING" in kinds, got
    ready = kinds.index("READY")
    assert kinds[0] == "STATUS" and "loading" in got[0]  # status while loading, before READY
    assert "STATUS=serving default" not in got[ready]  # the id is the model dir's name
    assert any(line.startswith("STATUS=serving ") for line in got[ready].splitlines())
    watchdogs = [i for i, k in enumerate(kinds) if k == "WATCHDOG"]
    assert len(watchdogs) >= 2 and watchdogs[0] > ready
    assert kinds[-1] == "STOPPING" and kinds.index("STOPPING") > ready
