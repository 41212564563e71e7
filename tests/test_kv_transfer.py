"""`edge-llm kv export` / `kv import` (docs/fleet.md, "Replacing a board"): a conversation's
snapshots move to another board and its follow-up restores them from disk there; a corrupt file,
a delta without its base or another identity imports nothing."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from edge_llm.bench.fleet import Conversation
from serverutil import ServerProc

CHUNK = ["--prefill-chunk", "16"]  # short chats reuse rows (docs/store.md); the same on both boards


def kv(home: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edge_llm", "kv", *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "EDGE_LLM_HOME": str(home)})


def snapshots(kv_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in kv_dir.glob("*/kv_*.kv")}


def leftovers(kv_dir: Path) -> list[Path]:
    return [p for p in kv_dir.rglob("*") if p.is_file() and p.name != "identity.json"]


def _members(archive: Path) -> list[tarfile.TarInfo]:
    with tarfile.open(archive) as t:
        return t.getmembers()


def _rebuild(archive: Path, dest: Path, keep, patch=None) -> Path:
    """A copy of `archive` with only the members `keep(info)` accepts, `patch(name, data)` applied."""
    with tarfile.open(archive) as src, tarfile.open(dest, "w") as out:
        for info in src.getmembers():
            if keep(info):
                data = src.extractfile(info).read()
                data = patch(info.name, data) if patch else data
                info.size = len(data)
                out.addfile(info, io.BytesIO(data))
    return dest


@pytest.fixture(scope="module")
def board_a(edge_home, tmp_path_factory):
    """A board that held a two-turn conversation (a full file and a delta on it), stopped."""
    work = tmp_path_factory.mktemp("board-a")
    conv = Conversation("c", ["Tell me one fact about tides.", "Why is that?", "Say it in five words."])
    with ServerProc(edge_home, work, *CHUNK).start() as a:
        for t in range(2):
            assert conv.send(a.url, t, 4).status == 200
        a.stop()
    files = snapshots(a.kv_dir)
    assert len(files) == 2, files.keys()
    return a.kv_dir, conv


def test_a_conversation_moves_to_another_board(edge_home, board_a, tmp_path):
    kv_a, conv = board_a
    archive = tmp_path / "conv.tar"
    r = kv(edge_home, "export", "--kv-dir", str(kv_a), "-o", str(archive))
    assert r.returncode == 0, r.stderr
    names = [m.name for m in _members(archive)]
    assert names[:2] == ["namespace", "identity.json"] and len(names) == 4, names
    ns = next(kv_a.iterdir()).name
    kv_b = tmp_path / "b" / "kv"
    # board B is running (its namespace is empty) when the archive is imported into its kv dir
    with ServerProc(edge_home, tmp_path / "b", *CHUNK, kv_dir=kv_b).start() as b:
        assert b.health().json()["snapshots"]["count"] == 0
        r = kv(edge_home, "import", "--kv-dir", str(kv_b), "--namespace", ns, str(archive))
        assert r.returncode == 0, r.stdout + r.stderr
        assert snapshots(kv_b) == snapshots(kv_a)  # bitwise the same files
        assert kv(edge_home, "verify", "--kv-dir", str(kv_b)).returncode == 0
        # importing again keeps what is there
        again = kv(edge_home, "import", "--kv-dir", str(kv_b), str(archive))
        assert again.returncode == 0 and "0 snapshot(s) imported" in again.stdout, again.stdout
        # without a restart, the follow-up restores the conversation from the imported files
        reply = conv.send(b.url, 2, 4)
        assert reply.status == 200 and reply.source == "disk" and reply.cached > 0, reply.body["timings"]
        assert "2 new file(s) in" in b.log()


def test_export_by_name_takes_the_bases_along(edge_home, board_a, tmp_path):
    kv_a, _ = board_a
    ns = next(kv_a.iterdir())
    files = sorted(ns.glob("kv_*.kv"), key=lambda p: p.stat().st_size)  # the delta is the smaller file
    delta = files[0].name
    archive = tmp_path / "one.tar"
    r = kv(edge_home, "export", "--kv-dir", str(kv_a), "-o", str(archive), delta)
    assert r.returncode == 0, r.stderr
    names = [m.name for m in _members(archive)][2:]
    assert len(names) == 2 and names[-1] == delta, names  # the base first, then the delta


def test_bad_archives_import_nothing(edge_home, board_a, tmp_path):
    kv_a, _ = board_a
    ns = next(kv_a.iterdir()).name
    good = tmp_path / "good.tar"
    assert kv(edge_home, "export", "--kv-dir", str(kv_a), "-o", str(good)).returncode == 0
    members = [m.name for m in _members(good)]
    base, delta = members[2], members[3]

    def flip(name: str, data: bytes) -> bytes:  # one payload byte of the delta: its block CRC fails
        if name != delta:
            return data
        b = bytearray(data)
        b[len(b) // 2] ^= 0x40
        return bytes(b)

    def rename(info: tarfile.TarInfo) -> bool:  # the delta under another snapshot's name: its ids hash elsewhere
        if info.name == delta:
            info.name = "kv_" + "0" * 16 + ".kv"
        return True

    cases = {
        "corrupt": (_rebuild(good, tmp_path / "corrupt.tar", lambda i: True, flip), "block-crc"),
        "renamed": (_rebuild(good, tmp_path / "renamed.tar", rename), "does not match its tokens hash"),
        "no-base": (_rebuild(good, tmp_path / "nobase.tar", lambda i: i.name != base), "base-missing"),
        "not-a-tar": (tmp_path / "junk.tar", "not a readable archive"),
    }
    (tmp_path / "junk.tar").write_bytes(b"\0" * 100 + b"junk")
    for what, (archive, reason) in cases.items():
        dest = tmp_path / f"kv-{what}"
        r = kv(edge_home, "import", "--kv-dir", str(dest), str(archive))
        assert r.returncode == 1 and reason in r.stderr, (what, r.stdout, r.stderr)
        assert leftovers(dest) == [] if dest.exists() else True, (what, leftovers(dest))
    # another identity: refused by the namespace the receiving board names, nothing written
    other = "0123456789abcdef"
    r = kv(edge_home, "import", "--kv-dir", str(tmp_path / "kv-other"), "--namespace", other, str(good))
    assert r.returncode == 1 and f"holds namespace {ns}" in r.stderr, r.stderr
    assert not (tmp_path / "kv-other").exists() or leftovers(tmp_path / "kv-other") == []
    # a namespace directory of that name with another identity.json: refused too
    dest = tmp_path / "kv-mismatch"
    (dest / ns).mkdir(parents=True)
    ident = (kv_a / ns / "identity.json").read_text().replace('"prefill_chunk": 16', '"prefill_chunk": 32')
    assert ident != (kv_a / ns / "identity.json").read_text()
    (dest / ns / "identity.json").write_text(ident)
    r = kv(edge_home, "import", "--kv-dir", str(dest), str(good))
    assert r.returncode == 1 and "another identity" in r.stderr, r.stderr
    assert leftovers(dest) == []
