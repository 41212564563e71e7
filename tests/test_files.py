"""edge_llm/files.py: atomic files and directories on a real filesystem, with real processes."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from edge_llm import files

REPO = Path(__file__).resolve().parents[1]


def listing(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


# ---- files ------------------------------------------------------------------------------------
def test_write_atomic_replaces_and_leaves_no_temp(tmp_path):
    p = tmp_path / "config.json"
    files.write_atomic(p, "first\n")
    files.write_atomic(p, b"second\n")
    assert p.read_text() == "second\n" and listing(tmp_path) == ["config.json"]


def test_a_writer_that_fails_half_way_leaves_the_old_file_and_no_temp(tmp_path):
    p = tmp_path / "model.safetensors"
    p.write_bytes(b"old complete content")
    with pytest.raises(RuntimeError, match="disk pulled"):
        with files.atomic_file(p) as f:
            f.write(b"new, half")
            f.flush()  # the half is on disk, under the temp name
            assert len(listing(tmp_path)) == 2
            raise RuntimeError("disk pulled")
    assert p.read_bytes() == b"old complete content" and listing(tmp_path) == ["model.safetensors"]
    with pytest.raises(KeyboardInterrupt):  # also when the process is interrupted
        with files.atomic_file(tmp_path / "new.bin") as f:
            f.write(b"x")
            raise KeyboardInterrupt
    assert listing(tmp_path) == ["model.safetensors"]


def test_mode_is_exact_whatever_the_umask_and_durable_fsyncs(tmp_path, monkeypatch):
    old = os.umask(0o077)
    try:
        files.write_atomic(tmp_path / "a", b"x", mode=0o640)
        files.write_atomic(tmp_path / "b", b"x")  # no mode: open's 0o666 through the umask
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "a").stat().st_mode) == 0o640
    assert stat.S_IMODE((tmp_path / "b").stat().st_mode) == 0o600
    synced, others = [], []
    real, me = os.fsync, threading.get_ident()

    def fsync(fd):  # count this thread's calls: a store writer another test left may fsync too
        (synced if threading.get_ident() == me else others).append(threading.current_thread().name)
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    files.write_atomic(tmp_path / "c", b"x")
    assert len(synced) == 2, others  # the file, then its directory (the rename)
    files.write_atomic(tmp_path / "d", b"x", durable=False)
    assert len(synced) == 2


def test_temp_names_name_their_writer(tmp_path):
    name = files.temp_name("kv_0123456789abcdef.kv")
    assert name.startswith(f"kv_0123456789abcdef.kv.{os.getpid()}-") and name.endswith(files.TMP_SUFFIX)
    assert name != files.temp_name("kv_0123456789abcdef.kv")
    assert files.orphaned_temp(tmp_path / name, own_writer_busy=False)
    assert not files.orphaned_temp(tmp_path / name, own_writer_busy=True)
    assert files.orphaned_temp(tmp_path / "x.tmp", own_writer_busy=True)  # no pid: nobody's


# ---- directories --------------------------------------------------------------------------------
def _marker(d: Path) -> str | None:
    try:
        return (d / "built").read_text()
    except OSError:
        return None


def test_publish_dir_builds_once_and_cleans_up_after_killed_builders(tmp_path):
    target = tmp_path / "smollm2"
    (tmp_path / ".tmp-smollm2-stale").mkdir()  # a killed builder's
    (tmp_path / ".tmp-smollm2-old-abc").mkdir()  # an old target moved aside by an older builder
    (tmp_path / ".tmp-smollm2-v2-abc").mkdir()  # another target's (smollm2-v2), maybe live
    calls = []

    def build(tmp: Path) -> str:
        calls.append(tmp)
        assert tmp.parent == tmp_path and listing(tmp) == []
        (tmp / "built").write_text("1")
        return "built"

    assert files.publish_dir(target, build, _marker) == "built"
    assert files.publish_dir(target, build, _marker) == "1"  # ready: no second build
    assert len(calls) == 1 and _marker(target) == "1"
    assert stat.S_IMODE(target.stat().st_mode) == 0o755
    assert listing(tmp_path) == [".smollm2.lock", ".tmp-smollm2-v2-abc", "smollm2"]


def test_a_stale_directory_is_judged_once_unless_another_builder_replaced_it(tmp_path):
    """`ready` logs why a directory is stale (the quant graphs' "is stale: rebuilding"): asked again
    under the lock only when another process put a new directory there meanwhile, so one rebuild
    says it once, and a build finished while we waited is still found."""
    target = tmp_path / "q4"
    target.mkdir()
    (target / "built").write_text("stale")
    asked: list[str] = []

    def ready(d: Path) -> str | None:
        asked.append(_marker(d))
        return None if asked[-1] in (None, "stale") else asked[-1]

    def build(tmp: Path) -> str:
        (tmp / "built").write_text("new")
        return "built"

    assert files.publish_dir(target, build, ready) == "built"
    assert asked == ["stale"] and _marker(target) == "new"

    target2 = tmp_path / "q8"

    def ready_racing(d: Path) -> str | None:  # another builder publishes while we wait for the lock
        asked.append(_marker(d))
        if len(asked) == 2:
            files.publish_dir(d, lambda t: (t / "built").write_text("theirs"), lambda _d: None)
            return None
        return asked[-1]

    assert files.publish_dir(target2, lambda t: pytest.fail("built twice"), ready_racing) == "theirs"
    assert asked[1:] == [None, "theirs"]


def test_a_failed_build_leaves_the_old_directory_and_no_temp(tmp_path):
    target = tmp_path / "q4"
    files.publish_dir(target, lambda t: (t / "built").write_text("old"), _marker)

    def broken(tmp: Path) -> None:
        (tmp / "half").write_text("x")
        raise OSError("no space left")

    with pytest.raises(OSError, match="no space"):
        files.publish_dir(target, broken, lambda d: None)
    assert _marker(target) == "old" and listing(tmp_path) == [".q4.lock", "q4"]


@pytest.mark.parametrize("exchange", [True, False], ids=["rename-exchange", "two-renames"])
def test_a_republished_directory_is_never_missing(tmp_path, monkeypatch, exchange):
    """A reader polling the target through 100 rebuilds always finds a complete directory; the
    old one is deleted only after the new one is in place (with RENAME_EXCHANGE: in one step)."""
    if not exchange:
        monkeypatch.setattr(files, "_exchange", lambda a, b: False)
    target = tmp_path / "model"
    names = [f"f{i}" for i in range(20)]

    def build(tmp: Path) -> None:
        for n in names:
            (tmp / n).write_text(n)
        (tmp / "built").write_text("x")

    files.publish_dir(target, build, _marker)
    stop, missing, polls = threading.Event(), [], [0]

    def reader() -> None:
        while not stop.is_set():
            polls[0] += 1
            if not all((target / n).is_file() for n in names):
                missing.append(polls[0])

    t = threading.Thread(target=reader)
    t.start()
    try:
        for _ in range(100):
            files.publish_dir(target, build, lambda d: None)  # stale every time: rebuild
    finally:
        stop.set()
        t.join()
    assert polls[0] > 100 and listing(tmp_path) == [".model.lock", "model"]
    print(f"\n{'rename-exchange' if exchange else 'two renames'}: the directory was incomplete or missing at "
          f"{len(missing)} of {polls[0]} polls")  # -s shows what the fallback costs
    if exchange:
        assert not missing, f"the directory was incomplete or missing at {len(missing)} of {polls[0]} polls"


BUILDER = """
import os, sys, time
from pathlib import Path
from edge_llm.files import publish_dir
target, log = Path(sys.argv[1]), Path(sys.argv[2])
def build(tmp):
    with open(log, "a") as f:
        f.write(f"{os.getpid()}\\n")
    time.sleep(0.5)  # the others are waiting on the lock meanwhile
    (tmp / "built").write_text(str(os.getpid()))
    return (tmp / "built").read_text()
def ready(d):
    try:
        return (d / "built").read_text()
    except OSError:
        return None
print(publish_dir(target, build, ready))
"""


def test_concurrent_processes_build_once(tmp_path):
    target, log = tmp_path / "quant" / "m-q4", tmp_path / "builds.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    procs = [subprocess.Popen([sys.executable, "-c", BUILDER, str(target), str(log)], env=env,
                              stdout=subprocess.PIPE, text=True) for _ in range(4)]
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    builders = log.read_text().split()
    assert len(builders) == 1 and set(outs) == {builders[0]}  # one build, everyone got its result
    assert listing(target.parent) == [".m-q4.lock", "m-q4"]
