"""Untrusted text in log lines (docs/logs.md, "Untrusted text"): file names the snapshot scan
finds, paths, anything a call site passes, reach the log escaped: no newline splits a line (a
forged second line), no ESC sequence reaches a terminal, no undecodable byte loses the line."""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import threading
from pathlib import Path

import pytest
from serverutil import ServerProc

from edge_llm.config import Geometry
from edge_llm.logsetup import setup_logging
from edge_llm.safetext import one_line, printable
from edge_llm.snapshot.identity import Identity
from edge_llm.snapshot.layout import is_snapshot_name
from edge_llm.snapshot.store import SnapshotStore

G = Geometry(n_layers=2, n_kv_heads=2, head_dim=8)
ID = Identity(config={"model": "log-injection"}, weights_digest="dd" * 32)
RED = "kv_\x1b[31mred.kv"
FORGED = "kv_0\n2026-01-01T00:00:00.000 ERROR edge_llm.kvdisk: forged.kv"
CLEAR = "kv_\x1b[2J.kv"  # a FIFO: skipped, never opened
UNDECODABLE = b"kv_\xff\x9b.kv"  # not UTF-8 (0x9b: CSI in 8-bit terminals); Python names it with surrogates
LINE = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3} [A-Z]+ \S+: ")


def plant(ns: Path) -> None:
    """Files named like snapshots whose names hold control characters (garbage content)."""
    for name in (RED, FORGED):
        (ns / name).write_bytes(b"not a snapshot")
    os.mkfifo(ns / CLEAR)
    with open(os.path.join(os.fsencode(ns), UNDECODABLE), "wb") as f:
        f.write(b"not a snapshot either")


def test_printable_escapes_what_a_terminal_or_a_log_reader_would_obey():
    assert printable("kv_0123456789abcdef.kv") == "kv_0123456789abcdef.kv"
    assert printable(RED) == "kv_\\x1b[31mred.kv"
    assert printable("a\nb\rc\td\x00e\x7f\x9b\u2028\udcff") == "a\\nb\\rc\\td\\x00e\\x7f\\x9b\\u2028\\udcff"
    assert printable("C:\\x1b") == "C:\\\\x1b"  # a literal backslash cannot pass for an escape
    assert printable(Path("/models/modèle-日本")) == "/models/modèle-日本"  # printable text stays
    assert one_line(printable(RED)) == printable(RED) and one_line("a\\n\n") == "a\\n\\n"


def test_names_with_control_characters_are_not_snapshot_names():
    assert is_snapshot_name("kv_0123456789abcdef.kv")
    assert not is_snapshot_name("kv_0123456789abcdef.kv\n")  # `$` matched before a final newline


@pytest.mark.timeout(120)
def test_scan_logs_untrusted_names_escaped(tmp_path, caplog):
    SnapshotStore(tmp_path, ID, G).close()  # the namespace directory
    (ns,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    plant(ns)
    caplog.set_level(logging.DEBUG, logger="edge_llm.kvdisk")
    done = threading.Event()

    def scan() -> None:
        store = SnapshotStore(tmp_path, ID, G)
        store.scan()
        store.close()
        done.set()

    th = threading.Thread(target=scan, daemon=True)
    th.start()
    th.join(60)
    assert done.is_set(), "the scan blocked"
    messages = [r.getMessage() for r in caplog.records]
    for m in messages:  # main: the raw names, ESC and newline included
        assert m.isprintable(), repr(m)
    text = "\n".join(messages)
    assert f"[KV-DISK] rejected {printable(RED)}: " in text
    assert f"[KV-DISK] rejected {printable(FORGED)}: " in text
    assert "[KV-DISK] rejected kv_\\udcff\\udc9b.kv: " in text
    assert f"[KV-DISK] skipped {printable(CLEAR)}: not a regular file" in text


def test_formatter_makes_every_message_one_line(tmp_path):
    """The safety net of setup_logging: whatever a call site forgot (or a library logs), the
    file gets one line per record; a traceback keeps its lines."""
    log_file = tmp_path / "edge-llm.log"
    setup = setup_logging(log_file)
    try:
        lg = logging.getLogger("edge_llm.test_injection")
        lg.warning("opened %s", "/srv/img\n2026-01-01T00:00:00.000 INFO forged: \x1b[31mred")
        lg.warning("skipped %s", printable("kv_C:\\x\x1b\n.kv"))  # escaped at the call site, then by the formatter
        try:
            raise ValueError("boom: /srv/\x1b[2J\x9b.png")  # an exception's text quoting a client's path
        except ValueError:
            lg.exception("request \x1b]0;title\x07 failed")
    finally:
        setup.file_handler.close()
        logging.getLogger().handlers.clear()
    raw = log_file.read_bytes()
    assert b"\x1b" not in raw and b"\x07" not in raw and b"\xc2\x9b" not in raw  # main: the traceback's ESC, CSI
    lines = raw.decode().splitlines()
    assert LINE.match(lines[0]) and lines[0].endswith("opened /srv/img\\n2026-01-01T00:00:00.000 INFO forged: "
                                                       "\\x1b[31mred")
    assert lines[1].endswith(" skipped kv_C:\\\\x\\x1b\\n.kv")  # once: the backslash doubled, no escape escaped again
    assert lines[2].endswith("request \\x1b]0;title\\x07 failed") and lines[3] == "Traceback (most recent call last):"
    assert lines[-1] == "ValueError: boom: /srv/\\x1b[2J\\x9b.png"


@pytest.mark.timeout(900)
def test_server_log_has_one_line_per_record_and_no_escape_bytes(edge_home, tmp_path):
    """The real service: the start-up scan of a namespace holding such names writes a log file
    (and stderr) with no ESC byte, no forged line, nothing lost to an encoding error."""
    kv, log_file = tmp_path / "kv", tmp_path / "edge-llm.log"
    args = ("--model", "default", "--max-seq", "512", "--backend", "cpu")
    srv = ServerProc(edge_home, tmp_path, *args, kv_dir=kv, log_file=log_file).start()
    assert srv.stop(signal.SIGTERM) == 0
    (ns,) = [p.parent for p in kv.glob("*/identity.json")]
    plant(ns)
    srv = ServerProc(edge_home, tmp_path, *args, kv_dir=kv, log_file=log_file)
    mark = srv.log_size()
    with srv.start():
        for target in (b"/v1/models?\x9b31m", b"/v1/\x9b[2J", b"/v1/\x1b[31m"):  # raw request targets
            with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as sock:
                sock.sendall(b"GET " + target + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
                while sock.recv(65536):
                    pass
    raw = log_file.read_bytes()[mark:]
    err = srv.stderr_path.read_bytes()
    for blob in (raw, err):
        assert b"\x1b" not in blob and b"\xff" not in blob and b"\xc2\x9b" not in blob
        assert b"Logging error" not in blob  # main: an undecodable name raised in the file handler
    lines = raw.decode().splitlines()
    assert lines and all(LINE.match(line) for line in lines), [ln for ln in lines if not LINE.match(ln)]
    text = raw.decode()
    assert f"[KV-DISK] rejected {printable(RED)}: " in text
    assert f"[KV-DISK] rejected {printable(FORGED)}: " in text
    assert "[KV-DISK] rejected kv_\\udcff\\udc9b.kv: " in text
    assert f"[KV-DISK] skipped {printable(CLEAR)}: not a regular file" in text
    assert "[KV-DISK] index: 0 checkpoint(s), 3 rejected" in text


def test_kv_cli_prints_file_controlled_text_escaped(tmp_path):
    """`kv ls` shows identity.json's fields and `kv rm --all` every file it removes (quarantined
    files keep the name the scan found): escaped, never obeyed by the terminal nor taken as markup."""
    import json
    import subprocess
    import sys

    SnapshotStore(tmp_path, ID, G).close()
    (ns,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    ident = json.loads((ns / "identity.json").read_text())
    ident["model_dir"] = "/models/\x1b[31mred[bold]\nforged"
    (ns / "identity.json").write_text(json.dumps(ident))
    (ns / "quarantine").mkdir()
    (ns / "quarantine" / f"20260101T000000-1-{RED}").write_bytes(b"x")
    env = {**os.environ, "EDGE_LLM_HOME": str(tmp_path / "home")}
    ls = subprocess.run([sys.executable, "-m", "edge_llm", "kv", "ls", "--kv-dir", str(tmp_path)],
                        capture_output=True, timeout=120, env=env)
    rm = subprocess.run([sys.executable, "-m", "edge_llm", "kv", "rm", "--all", "--kv-dir", str(tmp_path)],
                        capture_output=True, timeout=120, env=env)
    assert ls.returncode == 0 and rm.returncode == 0, (ls.stderr, rm.stderr)
    for out in (ls.stdout, rm.stdout):
        assert b"\x1b" not in out
    assert b"/models/\\x1b[31mred[bold]\\nforged" in ls.stdout
    assert f"removed {ns.name}/quarantine/20260101T000000-1-kv_\\x1b[31mred.kv".encode() in rm.stdout


def test_cli_logging_makes_every_message_one_line():
    """generate / model / convert log to stderr through the same one-line formatter."""
    import subprocess
    import sys

    code = ("import logging\nfrom edge_llm.logsetup import setup_cli_logging\nsetup_cli_logging()\n"
            "logging.getLogger('edge_llm.x').warning('opened %s', '/m/\\x1b[31mred\\nforged')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stderr == b"opened /m/\\x1b[31mred\\nforged\n"


def test_kv_commands_print_paths_as_written_not_as_markup(tmp_path):
    """kv ls / verify / export / import print the paths they were given as text: the console would
    take `[bold]` in a directory's name as markup and drop it."""
    import subprocess
    import sys

    from edge_llm.kvcache import KVCache

    kv_dir, archive, dest = tmp_path / "k[bold]v", tmp_path / "a[red]b.tar", tmp_path / "i[bold]x"
    store = SnapshotStore(kv_dir, ID, G, kv_bs=4)
    store.scan()
    cache = KVCache(G, max_seq=64, kv_bs=4, check_memory=False)
    cache.set_tokens(list(range(1000, 1040)))
    store.save_async(cache)
    assert store.flush(60)
    store.close()
    env = {**os.environ, "EDGE_LLM_HOME": str(tmp_path / "home")}

    def kv(*args: str) -> str:
        r = subprocess.run([sys.executable, "-m", "edge_llm", "kv", *args], capture_output=True, text=True,
                           timeout=120, env=env)
        assert r.returncode == 0, r.stderr
        return r.stdout
    assert f"kv dir {kv_dir}" in kv("ls", "--kv-dir", str(kv_dir))
    assert f"OK  {store.ns}/kv_" in kv("verify", "--kv-dir", str(kv_dir))
    assert f"-> {archive}" in kv("export", "--kv-dir", str(kv_dir), "-o", str(archive))
    assert f"imported into {dest / store.ns.name};" in kv("import", "--kv-dir", str(dest), str(archive))
