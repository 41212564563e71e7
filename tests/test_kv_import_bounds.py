"""`kv import` holds an untrusted archive to its bounds (docs/fleet.md, "What an archive may
hold"): sparse and other non-regular members, a declared size other than the one the member's
VLKV header implies, a total over the cap, a bad identity.json or modification time are each a
one-line error that leaves the kv dir as it was, and nothing is written before the checks."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from edge_llm.snapshot import format as F
from edge_llm.snapshot import transfer
from edge_llm.snapshot.identity import Identity
from helpers.kv_archives import (
    IDENTITY,
    NS,
    good_members,
    gnu_sparse_archive,
    member,
    pax_sparse,
    raw_head,
    tar_bytes,
    tree,
    written_bytes,
)

OTHER = Identity(config={"n_layers": 3}, weights_digest="cd" * 32)  # another namespace on the same board


def kv_cli(home: Path, *args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edge_llm", "kv", *args], capture_output=True, timeout=300,
                          input=stdin, env={**os.environ, "EDGE_LLM_HOME": str(home)})


@pytest.fixture
def store(tmp_path) -> Path:
    """A kv dir that already holds another identity's namespace (its identity.json only)."""
    kv = tmp_path / "kv"
    (kv / OTHER.namespace).mkdir(parents=True)
    (kv / OTHER.namespace / "identity.json").write_text(OTHER.to_json())
    return kv


def refused(kv: Path, archive: bytes, expect: str, max_written: int | None = None) -> None:
    """Import in this process: it must write at most `max_written` bytes (when given), raise
    TransferError naming `expect` and leave the kv dir as it was."""
    before, start = tree(kv), written_bytes()
    with pytest.raises(transfer.TransferError) as err:
        transfer.import_archive(io.BytesIO(archive), kv)
    wrote = written_bytes() - start
    assert max_written is None or wrote <= max_written, f"{wrote} bytes written for a {len(archive)}-byte archive"
    assert re.search(expect, str(err.value)), str(err.value)
    assert tree(kv) == before


SPARSE = ["gnu-old", "pax-0.0", "pax-0.1", "pax-1.0"]


@pytest.mark.parametrize("flavour", SPARSE)
def test_a_sparse_member_is_refused_before_a_byte_is_written(store, flavour):
    """12 KiB of archive that tarfile would expand to 1 GiB (holes read as zeros) in the kv dir."""
    name = good_members()[0][0]
    archive = gnu_sparse_archive(name) if flavour == "gnu-old" else tar_bytes([pax_sparse(flavour[4:], name)])
    assert len(archive) < 32 << 10
    refused(store, archive, "is a sparse file", max_written=64 << 10)


@pytest.mark.parametrize("kind", [tarfile.SYMTYPE, tarfile.LNKTYPE, tarfile.DIRTYPE, tarfile.FIFOTYPE,
                                  tarfile.CHRTYPE, tarfile.CONTTYPE],
                         ids=["symlink", "hardlink", "dir", "fifo", "chardev", "contiguous"])
def test_only_regular_members_are_taken(store, kind):
    name, data = good_members()[0]
    info = member(name, data if kind == tarfile.CONTTYPE else b"", kind=kind)
    info.linkname = "identity.json" if kind in (tarfile.SYMTYPE, tarfile.LNKTYPE) else ""
    refused(store, tar_bytes([info]), "is not a regular file")


def test_a_declared_size_other_than_the_headers_is_refused_unwritten(store):
    (base, bdata), (delta, ddata) = good_members()
    # a full file declaring 1 MiB more than its header implies (the padding is really there)
    longer = tar_bytes([member(base, bdata + b"\0" * (1 << 20))])
    refused(store, longer, f"declares {len(bdata) + (1 << 20)} bytes, its VLKV header implies {len(bdata)}",
            max_written=64 << 10)
    # a delta (its size depends on the base record in its extension section) cut short by 8 bytes
    shorter = tar_bytes([(base, bdata), member(delta, ddata[:-8])])
    refused(store, shorter, f"declares {len(ddata) - 8} bytes, its VLKV header implies {len(ddata)}")


def test_the_total_is_capped(store):
    members = good_members()
    total = sum(len(d) for _, d in members)
    with pytest.raises(transfer.TransferError, match=f"over --max-bytes {total - 1}"):
        transfer.import_archive(io.BytesIO(tar_bytes(members)), store, max_bytes=total - 1)
    assert not (store / NS).exists()
    # the free space caps it anyway: a header whose geometry implies 16 TiB, declared as such
    # (the archive ends 64 KiB into it: its tar stream is built from raw blocks)
    hdr = F.SnapshotHeader(1 << 20, 1 << 10, 4, 16, 1000, 1 << 12, 0, IDENTITY.model_id)
    assert hdr.file_size > 1 << 44
    info = tarfile.TarInfo(members[0][0])
    info.size, info.mode, info.mtime = hdr.file_size, 0o600, 1
    archive = raw_head() + info.tobuf(tarfile.PAX_FORMAT) + hdr.pack().ljust(64 << 10, b"\0")
    refused(store, archive, "bytes free on the kv dir's filesystem")


def _nested(depth: int) -> bytes:
    return IDENTITY.to_json().replace('"config": {', '"config": {"deep": ' + "[" * depth + "]" * depth + ", ",
                                      1).encode()


def _crafted() -> dict[str, tuple[bytes, str]]:
    """The five archives that crashed `kv import` with a traceback, and the error each gets now."""
    (base, data), _ = good_members()
    ident = IDENTITY.to_json()
    nan = ident.replace('"theta": 1000000.0', '"theta": NaN').encode()
    assert b"NaN" in nan
    as_list = ident.replace('"model_dir": "tiny-model"', '"model_dir": ["tiny-model"]').encode()
    assert as_list != ident.encode()
    return {
        "nan-identity": (tar_bytes([(base, data)], identity=nan), "NaN is not a JSON number"),
        "nested-identity": (tar_bytes([(base, data)], identity=_nested(5000)), "nested too deeply"),
        "nested-16": (tar_bytes([(base, data)], identity=_nested(20)), "nested deeper than 16 levels"),
        "model_dir-list": (tar_bytes([(base, data)], identity=as_list), "model_dir is list, not a string"),
        "mtime-1e300": (tar_bytes([member(base, data, pax={"mtime": "1e300"})]), "modification time 1e"),
        "mtime-nan": (tar_bytes([member(base, data, pax={"mtime": "nan"})]), "modification time nan"),
        "mtime-negative": (tar_bytes([member(base, data, pax={"mtime": "-5"})]), "modification time -5"),
    }


@pytest.mark.parametrize("case", list(_crafted()))
def test_crafted_archives_are_one_line_errors_that_leave_nothing(edge_home, store, case):
    archive, expect = _crafted()[case]
    before = tree(store)
    r = kv_cli(edge_home, "import", "--kv-dir", str(store), "-", stdin=archive)
    err = r.stderr.decode()
    assert r.returncode == 1 and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1 and err.startswith("Error: ") and expect in err, err
    assert tree(store) == before  # no namespace directory, no identity.json, no temp file


def test_a_last_use_within_a_day_ahead_is_now_and_the_good_archive_imports(store):
    """The bounds refuse nothing real: export's archive (a base and a delta) imports whole; a
    last use a little ahead of this clock (another board's) becomes now."""
    (base, bdata), (delta, ddata) = good_members()
    ahead = time.time() + 3600
    archive = tar_bytes([(base, bdata), member(delta, ddata, pax={"mtime": f"{ahead}"})])
    res = transfer.import_archive(io.BytesIO(archive), store)
    assert res.published == [base, delta]
    assert (store / NS / base).read_bytes() == bdata and (store / NS / delta).read_bytes() == ddata
    assert (store / NS / delta).stat().st_mtime <= time.time()
    assert Identity.from_json((store / NS / "identity.json").read_text()) == IDENTITY


def test_max_bytes_on_the_command_line(edge_home, store):
    archive = tar_bytes(good_members())
    before = tree(store)
    r = kv_cli(edge_home, "import", "--kv-dir", str(store), "--max-bytes", "1K", "-", stdin=archive)
    assert r.returncode == 1 and "over --max-bytes 1024" in r.stderr.decode(), r.stderr
    assert tree(store) == before
    r = kv_cli(edge_home, "import", "--kv-dir", str(store), "--max-bytes", "lots", "-", stdin=archive)
    assert r.returncode == 2 and "'lots' is not a size" in r.stderr.decode(), r.stderr
