"""A FIFO (or a device, or a directory) where a client or the file system put a file is refused
with the caller's own error, promptly, and never read: the one rule `files.open_regular`, checked
for every caller on a real FIFO under a time limit (a plain `open()` of a FIFO without a writer
blocks its thread for good; docs/store.md "Faults", docs/vision.md)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest
from click.testing import CliRunner

from edge_llm import files
from edge_llm.errors import ImageNotRegular, SnapshotError, SnapshotNotRegular, WeightsError

T = TypeVar("T")
# seconds: a refusal takes milliseconds, but some calls include a CLI's first (cold) imports, slow
# on a busy machine; a blocked open() never returns, so a generous limit still tells them apart
LIMIT = 120.0


def within(fn: Callable[[], T], fifos: list[Path], seconds: float = LIMIT) -> T:
    """fn() in a thread; fails if it is still running after `seconds` (then the FIFOs get a writer
    for a moment, so the blocked thread returns instead of leaking)."""
    out: list[T] = []
    err: list[BaseException] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as e:  # re-raised in the test's thread
            err.append(e)

    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(seconds)
    if th.is_alive():
        for f in fifos:
            try:
                os.close(os.open(f, os.O_WRONLY | os.O_NONBLOCK))  # a reader is waiting: this succeeds
            except OSError:
                pass
        th.join(5)
        pytest.fail(f"blocked for more than {seconds} s on a FIFO: {fifos}")
    if err:
        raise err[0]
    return out[0]


@pytest.fixture
def fifo(tmp_path) -> Path:
    p = tmp_path / "fifo"
    os.mkfifo(p)
    return p


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


# ---- the rule itself --------------------------------------------------------------------------
def test_open_regular_refuses_fifo_device_and_directory_and_opens_a_file_blocking(tmp_path, fifo):
    n = open_fds()
    for path, kind in ((fifo, "a FIFO"), (Path("/dev/null"), "a character device"), (tmp_path, "a directory")):
        with pytest.raises(SnapshotNotRegular, match=f"not a regular file \\({kind}\\)"):
            within(lambda: files.open_regular(path, SnapshotNotRegular), [fifo])
    assert open_fds() == n
    (tmp_path / "f").write_bytes(b"abc")
    with files.open_regular(tmp_path / "f", SnapshotNotRegular) as f:
        assert f.read() == b"abc"
        assert os.get_blocking(f.fileno())  # O_NONBLOCK cleared: reads are plain blocking reads
    assert files.read_regular(tmp_path / "f", WeightsError, limit=1) == b"ab"
    with pytest.raises(FileNotFoundError):
        files.open_regular(tmp_path / "missing", SnapshotNotRegular)
    os.symlink(tmp_path / "f", tmp_path / "link")
    assert files.read_regular(tmp_path / "link", WeightsError) == b"abc"
    os.symlink(fifo, tmp_path / "link-to-fifo")
    with pytest.raises(SnapshotNotRegular, match="a FIFO"):
        within(lambda: files.open_regular(tmp_path / "link-to-fifo", SnapshotNotRegular), [fifo])


def test_a_fifo_swapped_in_after_the_stat_is_caught_by_fstat_without_blocking(tmp_path, fifo, monkeypatch):
    """The race the stat alone would leave open: the path was a file when looked at, a FIFO when
    opened. The O_NONBLOCK open returns, fstat sees the FIFO, the descriptor is closed."""
    (tmp_path / "f").write_bytes(b"x")
    regular = os.stat(tmp_path / "f")
    real_stat = os.stat
    monkeypatch.setattr(os, "stat", lambda p, *a, **k: regular if Path(p) == fifo else real_stat(p, *a, **k))
    n = open_fds()
    with pytest.raises(ImageNotRegular, match="a FIFO"):
        within(lambda: files.open_regular(fifo, ImageNotRegular), [fifo])
    assert open_fds() == n


# ---- images: --image-dir and generate --image ------------------------------------------------------
def test_image_dir_fifo_is_a_400_not_a_blocked_thread(tmp_path):
    from edge_llm.server.errors import APIError
    from edge_llm.server.images import read_image_url

    d = tmp_path / "images"
    d.mkdir()
    os.mkfifo(d / "cam.jpg")
    (d / "sub").mkdir()
    for url in ("cam.jpg", "file://" + str(d / "cam.jpg"), "sub"):
        with pytest.raises(APIError) as e:
            within(lambda: read_image_url(url, str(d), 1 << 20), [d / "cam.jpg"])
        assert e.value.status == 400 and e.value.code == "image_path", url
        assert "not a regular file" in e.value.message


def test_generate_image_fifo_is_refused(tiny_synth_dir, edge_home, fifo, monkeypatch):
    from edge_llm.cli import cli as main

    monkeypatch.setenv("EDGE_LLM_HOME", str(edge_home))
    # it loads a model first: a generous limit (a blocked open() never returns)
    r = within(lambda: CliRunner().invoke(main, ["generate", "--model", str(tiny_synth_dir), "--image", str(fifo),
                                                 "--max-tokens", "1", "-p", "hi"]), [fifo], seconds=300)
    assert r.exit_code != 0 and f"--image {fifo}" in r.output and "not a regular file (a FIFO)" in r.output, r.output


# ---- snapshots: kv inspect / verify, the file readers ------------------------------------------------
def test_snapshot_readers_refuse_a_fifo(fifo):
    from edge_llm.snapshot.format import verify_file
    from edge_llm.snapshot.inspect import describe
    from edge_llm.snapshot.store import read_entry

    for fn in (lambda: verify_file(fifo), lambda: describe(fifo), lambda: read_entry(fifo, None, None)):
        with pytest.raises(SnapshotNotRegular) as e:
            within(fn, [fifo])
        assert isinstance(e.value, SnapshotError) and e.value.reason == "not-regular"


def test_kv_inspect_and_verify_refuse_a_fifo(tmp_path):
    from edge_llm.cli import cli as main

    fifo = tmp_path / ("kv_" + "0" * 16 + ".kv")
    os.mkfifo(fifo)
    r = within(lambda: CliRunner().invoke(main, ["kv", "verify", str(fifo)]), [fifo])
    assert r.exit_code == 1 and "BAD" in r.output and "not-regular" in r.output, r.output
    r = within(lambda: CliRunner().invoke(main, ["kv", "inspect", str(fifo)]), [fifo])
    assert r.exit_code != 0 and "not a regular file" in r.output, r.output


def test_kv_inspect_refuses_a_file_replaced_by_a_fifo_after_the_lookup(tmp_path, monkeypatch):
    """find_snapshot saw a file; by the time inspect opens it, it is a FIFO."""
    from edge_llm.cli import kv as kv_cli
    from edge_llm.cli import cli as main

    path = tmp_path / ("kv_" + "1" * 16 + ".kv")
    real = kv_cli.find_snapshot

    def swap(name: str, kv_dir: Path | None) -> Path:
        path.write_bytes(b"x")
        found = real(name, kv_dir)
        path.unlink()
        os.mkfifo(path)
        return found

    monkeypatch.setattr(kv_cli, "find_snapshot", swap)
    r = within(lambda: CliRunner().invoke(main, ["kv", "inspect", str(path)]), [path])
    assert r.exit_code != 0 and "not a regular file (a FIFO)" in r.output, r.output


# ---- checkpoints: safetensors, GGUF, config.json ----------------------------------------------------
def test_a_fifo_config_json_is_a_config_error(tmp_path):
    from edge_llm.config import ModelArgs, vision_args_from_dir
    from edge_llm.errors import ConfigError

    os.mkfifo(tmp_path / "config.json")
    for fn in (lambda: ModelArgs.from_dir(tmp_path), lambda: vision_args_from_dir(tmp_path)):
        with pytest.raises(ConfigError, match="not a regular file"):
            within(fn, [tmp_path / "config.json"])


CHECKPOINT_READERS = """
import sys
from pathlib import Path
from edge_llm.checkpoints.gguf_header import gguf_sizes
from edge_llm.checkpoints.gguf_import import import_tokenizer
from edge_llm.checkpoints.safetensors_writer import read_safetensors_header
from edge_llm.weights import index_tensors
model, shard, gguf, out = map(Path, sys.argv[1:])
for fn in (lambda: index_tensors(model), lambda: read_safetensors_header(shard), lambda: gguf_sizes(gguf),
           lambda: import_tokenizer(gguf, out)):
    try:
        fn()
        print("accepted")
    except Exception as e:
        print(type(e).__name__, e, flush=True)
"""


def test_checkpoint_readers_refuse_a_fifo(tmp_path):
    """In a child process: the safetensors library opens a file holding the GIL, so a blocked
    open there would stop a thread-based time limit too."""
    model = tmp_path / "model"
    model.mkdir()
    shard = model / "model.safetensors"
    gguf = tmp_path / "m.gguf"
    for f in (shard, gguf):
        os.mkfifo(f)
    proc = subprocess.Popen([sys.executable, "-c", CHECKPOINT_READERS, str(model), str(shard), str(gguf),
                             str(tmp_path / "out")], stdout=subprocess.PIPE, text=True)
    try:
        out, _ = proc.communicate(timeout=300)  # a new interpreter's imports: bounds a hang
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"a checkpoint reader blocked on a FIFO; before that it printed:\n{out}")
    lines = out.splitlines()
    assert [line.split()[0] for line in lines] == ["WeightsError", "ModelImportError", "ModelImportError",
                                                   "ModelImportError"], out
    assert all("not a regular file (a FIFO)" in line for line in lines), out
    assert stat.S_ISFIFO(os.stat(shard).st_mode) and stat.S_ISFIFO(os.stat(gguf).st_mode)


# ---- through the real server ---------------------------------------------------------------------------
def test_64_requests_naming_a_fifo_in_image_dir_get_400s_and_the_server_keeps_answering(tiny_synth_dir, edge_home,
                                                                                      tmp_path):
    """Each request would hold a worker-pool thread in open() for good (the pool has ~40): after
    that every endpoint hung, and SIGTERM waited for them."""
    import httpx
    from serverutil import ServerProc

    images = tmp_path / "images"
    images.mkdir()
    os.mkfifo(images / "cam.jpg")
    body = {"max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "cam.jpg"}}, {"type": "text", "text": "What is this?"}]}]}
    with ServerProc(edge_home, tmp_path / "srv", "--model", str(tiny_synth_dir), "--max-seq", "1024",
                    "--image-dir", str(images)).start() as srv:
        answers: list[httpx.Response | BaseException] = []
        lock = threading.Lock()

        def ask() -> None:
            try:
                # the bounds below are for a hang (a thread blocked in open() for good), not a speed
                r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=300)
            except httpx.HTTPError as e:
                r = e
            with lock:
                answers.append(r)

        threads = [threading.Thread(target=ask, daemon=True) for _ in range(64)]
        for th in threads:
            th.start()
        assert srv.health().status_code == 200  # during the burst
        for th in threads:
            th.join(300)
        assert len(answers) == 64, f"{64 - len(answers)} requests still waiting"
        for r in answers:
            assert isinstance(r, httpx.Response) and r.status_code == 400, r
            err = r.json()["error"]
            assert err["code"] == "image_path" and "not a regular file" in err["message"], err
        assert srv.health().json()["status"] == "ok"
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=120,
                       json={"max_tokens": 2, "messages": [{"role": "user", "content": "Say hi."}]})
        assert r.status_code == 200, r.text
        assert stat.S_ISFIFO(os.stat(images / "cam.jpg").st_mode)
        assert srv.stop(timeout=120) == 0  # nothing left blocked for SIGTERM to wait on


STORY = " ".join(f"Note {i}: the lighthouse keeper counted {i * 7} ships passing the northern cape."
                 for i in range(1, 30)) + "\nQuestion: how many ships did note 3 count?\nAnswer:"
OTHER = " ".join(f"Item {i}: the baker sold {i * 3} loaves of rye before noon on market day."
                 for i in range(1, 12)) + "\nQuestion: how many loaves did item 2 sell?\nAnswer:"


def test_a_snapshot_replaced_by_a_fifo_after_the_start_is_recomputed_and_the_server_serves_on(edge_home, tmp_path):
    """The restore's open of a FIFO blocked the engine for good (every later request queued behind
    it while /health said ok). Now: `[KV-DISK] rejected ...: not-regular`, the request recomputed
    (the same text as the first time), the FIFO quarantined, later requests served."""
    import re

    import httpx
    from serverutil import ServerProc, wait_for

    from edge_llm.snapshot.format import SNAPSHOT_GLOB

    def complete(srv: ServerProc, prompt: str) -> dict:
        r = httpx.post(srv.url + "/v1/completions", timeout=180,
                       json={"prompt": prompt, "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()

    def saves(srv: ServerProc) -> int:
        return len(re.findall(r"\[KV-DISK\] saved", srv.log()))

    kv = tmp_path / "kv"
    args = ("--model", "default", "--max-seq", "2048", "--disk-kv-compact-idle", "none")
    with ServerProc(edge_home, tmp_path / "srv", *args, kv_dir=kv).start() as srv:
        first = complete(srv, STORY)
        wait_for(lambda: saves(srv) >= 1, what="the first snapshot")
        (snap,) = kv.glob("*/" + SNAPSHOT_GLOB)
        complete(srv, OTHER)  # the RAM cache now holds another conversation: STORY's rows are on disk only
        wait_for(lambda: saves(srv) >= 2, what="the second snapshot")
        snap.unlink()
        os.mkfifo(snap)
        mark = srv.log_size()
        again = complete(srv, STORY)
        assert again["choices"][0]["text"] == first["choices"][0]["text"]
        assert again["timings"]["cache_source"] != "disk"
        log = srv.log(mark)
        # refused by the restore's open (quarantined), or already by the lookup's check that the
        # indexed files are still there (dropped from the index: docs/store.md "Files that vanish")
        rejected = f"[KV-DISK] rejected {snap.name}: not-regular: " in log
        dropped = f"[KV-DISK] {snap.name} vanished" in log and "(no longer a regular file)" in log
        assert rejected or dropped, log
        assert not rejected or list((snap.parent / "quarantine").glob("*-" + snap.name))
        follow = complete(srv, STORY + first["choices"][0]["text"] + "\nQuestion: and note 5?\nAnswer:")
        assert follow["usage"]["prompt_tokens"] > again["usage"]["prompt_tokens"]
        assert srv.health().json()["status"] == "ok"
        assert srv.stop(timeout=120) == 0


def test_a_namespace_whose_identity_io_stats_and_gate_are_fifos_opens_and_replaces_them(tmp_path):
    """identity.json, io-stats.json and gate.json are read when a store and its cost gate open
    their namespace (and by `kv ls`): FIFOs there are refused unread (the gate starts unmeasured), and
    the store replaces its two by the real files."""
    from edge_llm.config import Geometry
    from edge_llm.costgate import GATE_FILE, CostGate
    from edge_llm.snapshot.catalog import IO_STATS
    from edge_llm.snapshot.identity import IDENTITY_FILE, Identity, read_identity
    from edge_llm.snapshot.store import SnapshotStore

    ident = Identity(config={"model": "a"}, weights_digest="aa" * 32)
    ns = tmp_path / ident.namespace
    ns.mkdir(mode=0o700)
    fifos = [ns / IDENTITY_FILE, ns / IO_STATS, ns / GATE_FILE]
    for f in fifos:
        os.mkfifo(f)
    assert within(lambda: read_identity(ns), fifos) is None
    store = within(lambda: SnapshotStore(tmp_path, ident, Geometry(n_layers=2, n_kv_heads=2, head_dim=8), kv_bs=4),
                   fifos)
    assert store.catalog.io.bytes_written == 0
    gate = within(lambda: CostGate(1024, state_dir=ns), fifos)
    assert gate.read_bps is None and gate.prefill_tps is None
    assert stat.S_ISREG(os.stat(ns / IDENTITY_FILE).st_mode) and read_identity(ns) is not None
    store.close()
