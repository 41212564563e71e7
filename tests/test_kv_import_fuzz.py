"""Fuzz of `kv import` with generated archives (docs/fleet.md, "What an archive may hold"): every
archive, built from a real export's members with crafted headers, identities, sizes, types and
times, then byte-mutated or cut, either imports files bitwise equal to real snapshots or is
refused with TransferError, and a refused one leaves the kv dir exactly as it was. Any other
exception, any temp file left, any changed file fails."""

from __future__ import annotations

import io
import json
import re
import shutil
import tarfile
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from edge_llm.snapshot import format as F
from edge_llm.snapshot import transfer
from helpers.kv_archives import IDENTITY, MODEL_ID, NS, good_members, member, tar_bytes, tree

GOOD = dict(good_members())  # name -> bytes: the base, then the delta on it
ORDER = list(GOOD)
VALUES = ["nan", "NaN", "inf", "-inf", "-1", "1e300", "0", "1", str(1 << 70), "abc", "", "1,2,3", "0,99999999999",
          "GNUSparseFile.0/x", "../../etc/passwd", "kv_0000000000000000.kv"]
PAX_KEYS = ["mtime", "size", "path", "linkpath", "uid", "atime", "GNU.sparse.size", "GNU.sparse.map",
            "GNU.sparse.major", "GNU.sparse.minor", "GNU.sparse.name", "GNU.sparse.realsize",
            "GNU.sparse.offset", "GNU.sparse.numbytes", "hdrcharset"]
TYPES = [tarfile.REGTYPE, tarfile.AREGTYPE, tarfile.SYMTYPE, tarfile.LNKTYPE, tarfile.DIRTYPE, tarfile.FIFOTYPE,
         tarfile.CHRTYPE, tarfile.BLKTYPE, tarfile.CONTTYPE, tarfile.GNUTYPE_SPARSE, b"x", b"g", b"L", b"K"]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=12)


@st.composite
def identities(draw) -> bytes:
    """identity.json: the real one, with one field replaced by any JSON value, nested deep, or cut."""
    doc = json.loads(IDENTITY.to_json())
    how = draw(st.sampled_from(["real"] * 5 + ["field", "nest", "cut", "config-value"]))
    if how == "field":
        doc[draw(st.sampled_from([*doc, "extra"]))] = draw(json_values)
    elif how == "config-value":
        doc["config"][draw(st.sampled_from([*doc["config"], "new"]))] = draw(json_values)
    elif how == "nest":
        depth = draw(st.sampled_from([15, 16, 17, 100, 3000]))
        doc["config"]["deep"] = "@"
        return json.dumps(doc).replace('"@"', "[" * depth + "]" * depth).encode()
    text = json.dumps(doc).encode()  # json.dumps writes NaN / Infinity for such floats
    return text[: draw(st.integers(0, len(text)))] if how == "cut" else text


@st.composite
def members(draw) -> list:
    """The snapshot members: the real ones, reordered, dropped, doubled, each maybe with a crafted
    header (type, declared size, pax records) or its data cut or padded."""
    names = draw(st.lists(st.sampled_from(ORDER), min_size=1, max_size=3))
    out = []
    for name in names:
        data = GOOD[name]
        if not draw(st.booleans()):
            out.append((name, data))
            continue
        pax = draw(st.dictionaries(st.sampled_from(PAX_KEYS), st.sampled_from(VALUES), max_size=2))
        cut = draw(st.sampled_from([None, 0, 63, 64, 100, len(data) - 1, len(data) + 512]))
        if cut is not None:
            data = data[:cut].ljust(cut, b"\0")
        size = draw(st.sampled_from([None, 0, len(data) - 8, len(data) + 8, 1 << 40]))
        kind = draw(st.sampled_from(TYPES))
        info = member(name, data, size=None if size is None or size > 1 << 20 else size, pax=pax, kind=kind)
        out.append(info)
    return out


@st.composite
def archives(draw) -> bytes:
    ns = draw(st.sampled_from([NS.encode()] * 8 + [NS.encode() + b"\n", b"0123456789abcdef", b"\xff" * 8, b"x" * 100]))
    ident = draw(identities())
    try:
        raw = bytearray(tar_bytes(draw(members()), namespace=ns, identity=ident))
    except (ValueError, UnicodeError, OSError, tarfile.TarError):  # a header tarfile itself will not write
        raw = bytearray(tar_bytes([], namespace=ns, identity=ident))
    for _ in range(draw(st.sampled_from([0] * 5 + [1, 2, 3]))):  # raw damage: a byte, a resealed header checksum, a cut
        op = draw(st.sampled_from(["byte", "reseal", "cut"]))
        pos = draw(st.integers(0, len(raw) - 1))
        if op == "byte":
            raw[pos] = draw(st.integers(0, 255))
        elif op == "reseal":  # a byte of a header block changed and its checksum made right again
            block = pos - pos % 512
            raw[pos] = draw(st.integers(0, 255))
            raw[block + 148:block + 156] = b" " * 8
            raw[block + 148:block + 156] = b"%06o\0 " % sum(raw[block:block + 512])
        else:
            del raw[pos:]
            if not raw:
                break
    return bytes(raw)


@pytest.fixture(scope="module")
def templates(tmp_path_factory) -> dict[str, Path]:
    """Kv dirs to import into: none yet, and one already holding the base snapshot."""
    root = tmp_path_factory.mktemp("templates")
    held = root / "held"
    transfer.import_archive(io.BytesIO(tar_bytes([(ORDER[0], GOOD[ORDER[0]])])), held)
    return {"empty": root / "empty", "held": held}


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(archive=archives(), start=st.sampled_from(["empty", "held"]))
def test_every_archive_imports_real_snapshots_or_is_refused_leaving_the_kv_dir(templates, tmp_path, archive, start):
    work = Path(tempfile.mkdtemp(dir=tmp_path))
    kv = work / "kv"
    if templates[start].exists():
        shutil.copytree(templates[start], kv)
    before = tree(kv)
    try:
        try:
            res = transfer.import_archive(io.BytesIO(archive), kv)
        except transfer.TransferError as e:
            event(f"refused: {re.sub(r'kv_[0-9a-f]{16}[.]kv|[0-9]+', '#', str(e))[:48]}")
            assert tree(kv) == before
            return
        event(f"imported {len(res.published)}, kept {len(res.kept)}")
        after = tree(kv)
        assert not [p for p in after if p.endswith(".tmp")], after.keys()
        for path, (data, _, _) in before.items():
            assert data is None or after[path][0] == data, path  # what was there is untouched
        for name in res.published:  # what came in is a real snapshot, whole
            assert (kv / NS / name).read_bytes() == GOOD[name]
            F.verify_file(kv / NS / name, None, MODEL_ID)
    finally:
        shutil.rmtree(work)
