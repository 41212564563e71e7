"""VLKV v1 (edge_llm/snapshot/format.py): golden bytes, size formula, round trips, one bad file per
rejection reason, partial reads that touch only the blocks they need."""

from __future__ import annotations

import io
import os
import struct

import crc32c
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edge_llm import errors as E
from edge_llm.config import Geometry
from edge_llm.snapshot import format as F
from edge_llm.snapshot.inspect import describe

# ---- the golden file: 2 layers, 1 kv head, head_dim 2, kv_bs 2, 3 tokens --------------------------
G_GEOM = Geometry(n_layers=2, n_kv_heads=1, head_dim=2)
G_TOKENS = [151644, 872, 198]
G_MODEL_ID = 0x0123456789ABCDEF
# Layout worked by hand (see docs/snapshot-format.md); B = ceil(3 / 2) = 2 blocks per layer.
GOLDEN_HEX = (
    # header: magic 56 4b 4c 56, version 1, n_layers 2, n_kv_heads 1
    "564b4c56" "01000000" "02000000" "01000000"
    # head_dim 2, kv_bs 2, n_tokens 3, kv_dim 2
    "02000000" "02000000" "03000000" "02000000"
    # tokens_fnv (u64), model_id 0x0123456789abcdef (u64)
    "9882555a70132c96" "efcdab8967452301"
    # flags 1, reserved 0, trailer_crc, header_crc
    "01000000" "00000000" "f2e6868e" "fba64ff8"
    # token ids 151644, 872, 198
    "5c500200" "68030000" "c6000000"
    # layer 0: K block 0 (rows 0-1: [0, 1], [10, 11]), V block 0 ([-0.5, -1.5], [-10.5, -11.5])
    "00000000" "0000803f" "00002041" "00003041" "000000bf" "0000c0bf" "000028c1" "000038c1"
    # layer 0: K block 1 (row 2: [20, 21]), V block 1 ([-20.5, -21.5]) -- tail block, one row
    "0000a041" "0000a841" "0000a4c1" "0000acc1"
    # layer 1: K block 0 ([100, 101], [110, 111]), V block 0, K block 1 ([120, 121]), V block 1
    "0000c842" "0000ca42" "0000dc42" "0000de42" "0000c9c2" "0000cbc2" "0000ddc2" "0000dfc2"
    "0000f042" "0000f242" "0000f1c2" "0000f3c2"
    # trailer: CRC32C of L0 K0, L0 V0, L0 K1, L0 V1, L1 K0, L1 V0, L1 K1, L1 V1
    "91e68aa1" "54b26927" "2f52d8b0" "a0eaf3a0" "de4f69d5" "84932ee4" "29be305f" "63a3f64f"
)


def golden_value(layer: int, kv: int, row: int) -> list[float]:
    base = layer * 100 + row * 10
    return [base, base + 1] if kv == 0 else [-base - 0.5, -base - 1.5]


def golden_rows() -> np.ndarray:
    """(layers, 2, rows, kv_dim) with 2 spare rows, so writers must honour n_tokens."""
    data = np.full((2, 2, 5, 2), 999.0, dtype=np.float32)
    for layer in range(2):
        for kv in range(2):
            for row in range(3):
                data[layer, kv, row] = golden_value(layer, kv, row)
    return data


def ref_fnv1a64(data: bytes) -> int:
    h = 0xCBF29CE484222325
    for byte in data:
        h = ((h ^ byte) * 0x100000001B3) % 2**64
    return h


def hand_built_golden() -> bytes:
    """The golden file assembled field by field with struct, without the module under test."""
    tokens = b"".join(struct.pack("<I", t) for t in G_TOKENS)
    blocks = []
    for layer in range(2):
        for rows in ([0, 1], [2]):
            for kv in (0, 1):
                blocks.append(b"".join(struct.pack("<2f", *golden_value(layer, kv, r)) for r in rows))
    payload = b"".join(blocks)
    trailer = b"".join(struct.pack("<I", crc32c.crc32c(b)) for b in blocks)
    head = (struct.pack("<I", 0x564C4B56) + b"".join(struct.pack("<I", v) for v in (1, 2, 1, 2, 2, 3, 2))
            + struct.pack("<Q", ref_fnv1a64(tokens)) + struct.pack("<Q", G_MODEL_ID)
            + struct.pack("<III", 1, 0, crc32c.crc32c(trailer)))
    assert len(head) == 60
    return head + struct.pack("<I", crc32c.crc32c(head)) + tokens + payload + trailer


def repack(data: bytes, fix_crc: bool = True, **fields: int) -> bytes:
    """Golden-style file with header fields replaced (header CRC recomputed unless fix_crc=False)."""
    names = [n for n, _, _ in F.HEADER_FIELDS]
    values = dict(zip(names, struct.unpack_from("<8IQQ4I", data)))
    values.update(fields)
    head = struct.pack("<8IQQ4I", *(values[n] for n in names))
    if fix_crc:
        head = head[:60] + struct.pack("<I", crc32c.crc32c(head[:60]))
    return head + data[64:]


def flip(data: bytes, offset: int, mask: int = 0x01) -> bytes:
    b = bytearray(data)
    b[offset] ^= mask
    return bytes(b)


def read_all(data: bytes, geometry=G_GEOM, model_id=G_MODEL_ID, max_tokens=8192, m=None):
    f = io.BytesIO(data)
    hdr, tokens = F.read_header(f, geometry, model_id, max_tokens)
    dest = np.zeros((hdr.n_layers, 2, hdr.n_tokens, hdr.kv_dim), dtype=np.float32)
    F.read_rows_into(f, hdr, m or hdr.n_tokens, lambda l, kv: dest[l, kv])
    return hdr, tokens, dest


# ---- constants and reference values ------------------------------------------------------------
def test_header_struct_matches_field_table():
    assert F.HEADER.size == 64
    for name, off, size in F.HEADER_FIELDS:
        values = [0] * 14
        idx = [n for n, _, _ in F.HEADER_FIELDS].index(name)
        values[idx] = (1 << (8 * size)) - 1
        packed = F.HEADER.pack(*values)
        assert packed[off:off + size] == b"\xff" * size and packed.count(0xFF) == size, name
    assert F.HEADER.pack(F.MAGIC, *[0] * 13)[:4] == bytes.fromhex("564b4c56")


def test_checksum_reference_values():
    assert crc32c.crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value
    a = np.arange(1000, dtype=np.float32)
    assert crc32c.crc32c(memoryview(a).cast("B")) == crc32c.crc32c(a.tobytes())
    for data, want in ((b"", 0xCBF29CE484222325), (b"a", 0xAF63DC4C8601EC8C), (b"foobar", 0x85944171F73967E8)):
        assert F.fnv1a64(data) == want
    blob = os.urandom(4096)
    assert F.fnv1a64(blob) == ref_fnv1a64(blob)


def test_snapshot_name():
    assert F.snapshot_name(0xAB) == "kv_00000000000000ab.kv"
    assert F.snapshot_name(2**64 - 1) == "kv_ffffffffffffffff.kv"


def test_size_formula():
    assert F.snapshot_size(2, 3, 2, 2) == 64 + 12 + 2 * 2 * 3 * 2 * 4 + 8 * 2 * 2 == 204
    # Qwen3-VL-2B, 2056 tokens: the C engine's 471,605,344 bytes plus our trailer (B = 33 at kv_bs 64)
    assert F.snapshot_size(28, 2056, 1024, 64) == 471_605_344 + 8 * 28 * 33 == 471_612_736
    assert F.snapshot_size(28, 2056, 1024, 4096) - 8 * 28 == 471_605_344
    assert F.snapshot_size(1, 1, 1, 1) == 64 + 4 + 8 + 8


# ---- golden bytes ------------------------------------------------------------------------------
def test_golden_bytes_writer_and_reader():
    golden = bytes.fromhex(GOLDEN_HEX)
    assert golden == hand_built_golden()
    assert len(golden) == F.snapshot_size(2, 3, 2, 2)
    data = golden_rows()
    f = io.BytesIO()
    n = F.write_snapshot(f, G_TOKENS, G_MODEL_ID, G_GEOM, 2, lambda l, kv: data[l, kv])
    assert n == len(golden) and f.getvalue() == golden
    hdr, tokens, dest = read_all(golden)
    assert tokens.dtype == np.uint32 and tokens.tolist() == G_TOKENS
    assert (hdr.n_layers, hdr.n_kv_heads, hdr.head_dim, hdr.kv_bs, hdr.n_tokens, hdr.kv_dim) == (2, 1, 2, 2, 3, 2)
    assert hdr.model_id == G_MODEL_ID and hdr.flags == F.FLAG_TRAILER and hdr.n_blocks == 2
    assert hdr.payload_offset == 76 and hdr.trailer_offset == 172 and hdr.file_size == 204
    assert hdr.block_offset(1, 1, 1) == 76 + 48 + 32 + 8
    assert np.array_equal(dest, data[:, :, :3])
    assert F.snapshot_name(hdr.tokens_fnv) == "kv_962c13705a558298.kv"


def test_streaming_writer_real_file(tmp_path):
    data = golden_rows()
    path = tmp_path / "g.kv"
    with open(path, "wb", buffering=0) as f:  # raw file: writes may be partial, the writer loops
        w = F.SnapshotWriter(f, np.array(G_TOKENS), G_MODEL_ID, G_GEOM, 2)
        w.begin()
        with pytest.raises(ValueError):
            w.finish()  # no layers yet
        with pytest.raises(ValueError):
            w.write_layer(1, data[1, 0], data[1, 1])  # out of order
        w.write_layer(0, data[0, 0], data[0, 1])
        w.write_layer(1, data[1, 0], data[1, 1])
        assert w.finish() == 204
    assert path.read_bytes() == bytes.fromhex(GOLDEN_HEX)
    assert F.verify_file(path, G_GEOM, G_MODEL_ID).tokens_fnv == ref_fnv1a64(bytes.fromhex(GOLDEN_HEX)[64:76])


def test_unfinished_writer_leaves_a_rejected_file():
    data = golden_rows()
    f = io.BytesIO()
    w = F.SnapshotWriter(f, G_TOKENS, G_MODEL_ID, G_GEOM, 2)
    w.begin()
    w.write_layer(0, data[0, 0], data[0, 1])
    with pytest.raises(E.SnapshotBadMagic):  # the placeholder header is zeros until finish()
        F.read_header(io.BytesIO(f.getvalue()), G_GEOM, G_MODEL_ID)


@pytest.mark.parametrize("bad", [
    dict(tokens=[]), dict(tokens=[-1]), dict(tokens=[2**32]), dict(kv_bs=0), dict(model_id=-1),
    dict(model_id=2**64)])
def test_writer_rejects_bad_arguments(bad):
    args = dict(tokens=G_TOKENS, model_id=G_MODEL_ID, kv_bs=2) | bad
    with pytest.raises(ValueError):
        F.SnapshotWriter(io.BytesIO(), args["tokens"], args["model_id"], G_GEOM, args["kv_bs"])


@pytest.mark.parametrize("rows", [
    lambda d, l, kv: d[l, kv].astype(np.float64),          # wrong dtype
    lambda d, l, kv: d[l, kv, :2],                         # fewer rows than tokens
    lambda d, l, kv: np.asfortranarray(d[l, kv]),          # not C-contiguous
    lambda d, l, kv: d[l, kv][:, :1]])                     # wrong kv_dim
def test_writer_rejects_bad_rows(rows):
    data = golden_rows()
    with pytest.raises(ValueError):
        F.write_snapshot(io.BytesIO(), G_TOKENS, G_MODEL_ID, G_GEOM, 2, lambda l, kv: rows(data, l, kv))


# ---- one hand-built bad file per rejection reason -----------------------------------------------
GOLDEN = bytes.fromhex(GOLDEN_HEX)
BAD_FILES = {
    "empty": (b"", E.SnapshotTooShort, {}),
    "63 bytes": (GOLDEN[:63], E.SnapshotTooShort, {}),
    "magic": (flip(GOLDEN, 0), E.SnapshotBadMagic, {}),
    "magic big-endian": (repack(GOLDEN, magic=0x564B4C56), E.SnapshotBadMagic, {}),
    "version 2": (repack(GOLDEN, version=2), E.SnapshotBadVersion, {}),
    "version 0, stale crc": (repack(GOLDEN, fix_crc=False, version=0), E.SnapshotBadVersion, {}),
    "header crc": (flip(GOLDEN, 44), E.SnapshotHeaderCRC, {}),
    "header crc field": (flip(GOLDEN, 61), E.SnapshotHeaderCRC, {}),
    "flags 0": (repack(GOLDEN, flags=0), E.SnapshotFlags, {}),
    "flags 3": (repack(GOLDEN, flags=3), E.SnapshotFlags, {}),
    "reserved": (repack(GOLDEN, reserved=1), E.SnapshotFlags, {}),
    "n_layers": (repack(GOLDEN, n_layers=3), E.SnapshotGeometry, {}),
    "n_kv_heads": (repack(GOLDEN, n_kv_heads=2, kv_dim=4), E.SnapshotGeometry, {}),
    "head_dim": (repack(GOLDEN, head_dim=4, kv_dim=4), E.SnapshotGeometry, {}),
    "model geometry": (GOLDEN, E.SnapshotGeometry, dict(geometry=Geometry(2, 2, 1))),
    "zero layers unchecked": (repack(GOLDEN, n_layers=0), E.SnapshotGeometry, dict(geometry=None)),
    "kv_bs 0": (repack(GOLDEN, kv_bs=0), E.SnapshotGeometry, {}),
    "kv_dim": (repack(GOLDEN, kv_dim=3), E.SnapshotKVDim, {}),
    "kv_dim unchecked geometry": (repack(GOLDEN, kv_dim=4), E.SnapshotKVDim, dict(geometry=None)),
    "n_tokens 0": (repack(GOLDEN, n_tokens=0), E.SnapshotTokenCount, {}),
    "n_tokens > max": (GOLDEN, E.SnapshotTokenCount, dict(max_tokens=2)),
    "n_tokens 2^32-1": (repack(GOLDEN, n_tokens=2**32 - 1), E.SnapshotTokenCount, {}),
    "n_tokens 2^32-1 unbounded": (repack(GOLDEN, n_tokens=2**32 - 1), E.SnapshotSize, dict(max_tokens=None)),
    "n_tokens 2": (repack(GOLDEN, n_tokens=2), E.SnapshotSize, {}),
    "kv_bs 3": (repack(GOLDEN, kv_bs=3), E.SnapshotSize, {}),
    "one byte short": (GOLDEN[:-1], E.SnapshotSize, {}),
    "one byte long": (GOLDEN + b"\0", E.SnapshotSize, {}),
    "model_id": (GOLDEN, E.SnapshotModelID, dict(model_id=G_MODEL_ID ^ 1)),
    "model_id field": (repack(GOLDEN, model_id=0), E.SnapshotModelID, {}),
    "token byte": (flip(GOLDEN, 70), E.SnapshotTokenHash, {}),
    "tokens_fnv field": (repack(GOLDEN, tokens_fnv=1), E.SnapshotTokenHash, {}),
    "trailer byte": (flip(GOLDEN, 200, 0x80), E.SnapshotTrailerCRC, {}),
    "trailer_crc field": (repack(GOLDEN, trailer_crc=0), E.SnapshotTrailerCRC, {}),
    "block (L1 V1)": (flip(GOLDEN, 168), E.SnapshotBlockCRC, {}),
    "block (L0 K0)": (flip(GOLDEN, 76, 0x10), E.SnapshotBlockCRC, {}),
}


@pytest.mark.parametrize("name", list(BAD_FILES))
def test_each_bad_file_rejected_with_its_own_class(name, tmp_path):
    data, exc, kwargs = BAD_FILES[name]
    args = dict(geometry=G_GEOM, model_id=G_MODEL_ID, max_tokens=8192) | kwargs
    with pytest.raises(E.SnapshotError) as info:
        read_all(data, **args)
    assert type(info.value) is exc, (name, info.value)
    assert str(info.value) and info.value.reason != E.SnapshotError.reason
    # the same through a real file (preadv path) and through verify_file
    path = tmp_path / "bad.kv"
    path.write_bytes(data)
    with open(path, "rb", buffering=0) as f, pytest.raises(exc):
        hdr, _ = F.read_header(f, args["geometry"], args["model_id"], args["max_tokens"])
        dest = np.zeros((hdr.n_layers, 2, hdr.n_tokens, hdr.kv_dim), np.float32)
        F.read_rows_into(f, hdr, hdr.n_tokens, lambda l, kv: dest[l, kv])
    with pytest.raises(exc):
        F.verify_file(path, args["geometry"], args["model_id"], args["max_tokens"])
    # describe() checks no model expectation and reads no block: these look valid to it
    described_valid = name in ("model geometry", "model_id", "model_id field", "n_tokens > max",
                               "block (L1 V1)", "block (L0 K0)")
    info = describe(path)
    assert info["valid"] is described_valid
    assert (info["error"] is None) is described_valid or info["error"]["reason"] == exc.reason


def test_every_rejection_reason_is_covered():
    covered = {exc for _, exc, _ in BAD_FILES.values()}
    all_reasons = {c for c in vars(E).values() if isinstance(c, type) and issubclass(c, E.SnapshotError)}
    chain = {c for c in all_reasons if issubclass(c, E.SnapshotChainError)}  # tests/test_store_delta.py
    # not a file's bytes but its type (a FIFO, a device): tests/test_nonregular.py, tests/test_store.py
    assert covered == all_reasons - {E.SnapshotError, E.SnapshotNotRegular} - chain
    assert len({c.reason for c in covered}) == len(covered)


def test_block_crc_names_layer_block_and_kind():
    with pytest.raises(E.SnapshotBlockCRC, match=r"layer 1 block 1 \(V"):
        read_all(flip(GOLDEN, 168))
    with pytest.raises(E.SnapshotBlockCRC, match=r"layer 0 block 0 \(K"):
        read_all(flip(GOLDEN, 76, 0x10))


# ---- round trips over geometries, lengths and block sizes ---------------------------------------
class CountingReader(io.BytesIO):
    """In-memory file without fileno (the seek/readinto path) that records every byte range read."""

    def __init__(self, data: bytes):
        super().__init__(data)
        self.ranges: list[tuple[int, int]] = []

    def readinto(self, b) -> int:
        pos = self.tell()
        n = super().readinto(b)
        self.ranges.append((pos, pos + n))
        return n


def random_rows(rng, geom: Geometry, rows: int) -> np.ndarray:
    # random bit patterns (NaNs with payloads, denormals, -0.0): restore must be bitwise
    bits = rng.integers(0, 2**32, size=(geom.n_layers, 2, rows, geom.kv_dim), dtype=np.uint32)
    return bits.view(np.float32)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n_layers=st.integers(1, 3), n_kv_heads=st.integers(1, 3), head_dim=st.sampled_from([1, 2, 4, 8]),
       n=st.integers(1, 40), kv_bs=st.one_of(st.just(1), st.integers(1, 50)),
       m_frac=st.floats(0, 1), seed=st.integers(0, 2**31))
def test_round_trip(tmp_path, n_layers, n_kv_heads, head_dim, n, kv_bs, m_frac, seed):
    rng = np.random.default_rng(seed)
    geom = Geometry(n_layers, n_kv_heads, head_dim)
    data = random_rows(rng, geom, n + 3)
    tokens = rng.integers(0, 2**32, size=n, dtype=np.uint64)
    model_id = int(rng.integers(0, 2**63))
    path = tmp_path / f"rt_{seed}_{n}_{kv_bs}.kv"
    with open(path, "wb") as f:
        size = F.write_snapshot(f, tokens, model_id, geom, kv_bs, lambda l, kv: data[l, kv])
    assert size == path.stat().st_size == F.snapshot_size(n_layers, n, geom.kv_dim, kv_bs)
    assert F.verify_file(path, geom, model_id).n_tokens == n

    m = max(1, round(m_frac * n))
    with open(path, "rb", buffering=0) as f:
        hdr, got_tokens = F.read_header(f, geom, model_id)
        assert np.array_equal(got_tokens, tokens.astype(np.uint32))
        dest = np.full((n_layers, 2, n + 3, geom.kv_dim), 7.0, dtype=np.float32)
        nbytes = F.read_rows_into(f, hdr, m, lambda l, kv: dest[l, kv])
    need = F.rows_needed(hdr, m)
    assert need == min(n, -(-m // kv_bs) * kv_bs)
    assert nbytes == 2 * n_layers * need * geom.kv_dim * 4
    assert np.array_equal(dest[:, :, :need].view(np.uint32), data[:, :, :need].view(np.uint32))
    assert (dest[:, :, need:] == 7.0).all()  # nothing past the last needed block was written

    # the same partial read through the fallback path: only the needed blocks' bytes are read
    reader = CountingReader(path.read_bytes())
    hdr2, _ = F.read_header(reader, geom, model_id)
    reader.ranges.clear()
    dest2 = np.zeros_like(dest)
    assert F.read_rows_into(reader, hdr2, m, lambda l, kv: dest2[l, kv]) == nbytes
    allowed = [(hdr.block_offset(l, 0, 0), hdr.block_offset(l, 0, 0) + 2 * need * geom.kv_dim * 4)
               for l in range(n_layers)]
    assert sum(b - a for a, b in reader.ranges) == nbytes
    assert all(any(lo <= a and b <= hi for lo, hi in allowed) for a, b in reader.ranges)
    assert np.array_equal(dest2[:, :, :need].view(np.uint32), data[:, :, :need].view(np.uint32))


def test_partial_read_ignores_corruption_beyond_needed_blocks(tmp_path):
    geom = Geometry(3, 2, 4)
    data = random_rows(np.random.default_rng(1), geom, 20)
    f = io.BytesIO()
    F.write_snapshot(f, range(20), 5, geom, 4, lambda l, kv: data[l, kv])
    hdr, _ = F.read_header(io.BytesIO(f.getvalue()), geom, 5)
    corrupt = bytearray(f.getvalue())
    m = 6  # blocks 0 and 1 (rows 0..7) are needed; corrupt every byte of blocks 2.. in every layer
    for layer in range(3):
        start, end = hdr.block_offset(layer, 2, 0), hdr.payload_offset + (layer + 1) * hdr.layer_bytes
        corrupt[start:end] = b"\xa5" * (end - start)
    dest = np.zeros((3, 2, 20, 8), np.float32)
    assert F.read_rows_into(io.BytesIO(bytes(corrupt)), hdr, m, lambda l, kv: dest[l, kv]) == 3 * 2 * 8 * 32
    assert np.array_equal(dest[:, :, :8].view(np.uint32), data[:, :, :8].view(np.uint32))
    with pytest.raises(E.SnapshotBlockCRC, match="block 2"):  # a full read does see it
        F.read_rows_into(io.BytesIO(bytes(corrupt)), hdr, 20, lambda l, kv: dest[l, kv])
    # corruption inside a needed block is caught even if the row lies beyond m
    corrupt2 = flip(f.getvalue(), hdr.block_offset(2, 1, 1) + 4 * 8 * 3)  # row 7 of V, block 1, layer 2
    with pytest.raises(E.SnapshotBlockCRC, match=r"layer 2 block 1 \(V"):
        F.read_rows_into(io.BytesIO(corrupt2), hdr, m, lambda l, kv: dest[l, kv])


def test_file_shrinking_after_header_check_is_a_short_read(tmp_path):
    path = tmp_path / "g.kv"
    path.write_bytes(GOLDEN)
    with open(path, "rb", buffering=0) as f:
        hdr, _ = F.read_header(f, G_GEOM, G_MODEL_ID)
        os.truncate(path, 100)
        dest = np.zeros((2, 2, 3, 2), np.float32)
        with pytest.raises(E.SnapshotSize, match="short read"):
            F.read_rows_into(f, hdr, 3, lambda l, kv: dest[l, kv])


def test_read_rows_into_checks_arguments_before_reading():
    hdr, _ = F.read_header(io.BytesIO(GOLDEN), G_GEOM, G_MODEL_ID)
    reader = CountingReader(GOLDEN)
    dest = np.zeros((2, 2, 3, 2), np.float32)
    for m in (0, 4):
        with pytest.raises(ValueError):
            F.read_rows_into(reader, hdr, m, lambda l, kv: dest[l, kv])
    small = np.zeros((2, 2, 1, 2), np.float32)  # m=1 needs block 0 = 2 rows
    with pytest.raises(ValueError):
        F.read_rows_into(reader, hdr, 1, lambda l, kv: small[l, kv])
    readonly = dest.copy()
    readonly.flags.writeable = False
    with pytest.raises(ValueError):
        F.read_rows_into(reader, hdr, 3, lambda l, kv: readonly[l, kv])
    with pytest.raises(ValueError):  # a header that did not come from read_header has no trailer
        F.read_rows_into(reader, F.SnapshotHeader(2, 1, 2, 2, 3, 2, 0, 0), 3, lambda l, kv: dest[l, kv])
    assert reader.ranges == []


def test_describe_dissects_the_golden_file(tmp_path):
    path = tmp_path / F.snapshot_name(0x962C13705A558298)
    path.write_bytes(GOLDEN)
    info = describe(path, max_blocks=None)
    assert info["valid"] and info["error"] is None and info["tokens"] == G_TOKENS
    fields = {h["name"]: h for h in info["header"]}
    assert fields["magic"]["hex"] == "56 4b 4c 56" and fields["model_id"]["offset"] == 40
    assert fields["header_crc"]["value"] == info["header_crc_actual"]
    assert info["size_formula"]["terms"] == [64, 12, 96, 32] and info["size_formula"]["expected"] == 204
    assert [(s["name"], s["offset"], s["size"]) for s in info["sections"]] == [
        ("header", 0, 64), ("token ids", 64, 12), ("payload", 76, 96), ("trailer", 172, 32)]
    assert info["n_blocks_total"] == len(info["blocks"]) == 8
    for blk in info["blocks"]:
        chunk = GOLDEN[blk["offset"]:blk["offset"] + blk["size"]]
        assert crc32c.crc32c(chunk) == blk["crc_stored"]
        assert GOLDEN[blk["trailer_offset"]:blk["trailer_offset"] + 4] == struct.pack("<I", blk["crc_stored"])
    assert len(describe(path, max_blocks=3)["blocks"]) == 3
    path.write_bytes(GOLDEN[:-1])
    short = describe(path)
    assert not short["valid"] and short["error"]["reason"] == "size" and short["blocks"] == []
    assert short["size_formula"]["expected"] == 204 and short["size_formula"]["actual"] == 203


class TrickleWriter(io.BytesIO):
    """Accepts at most 5 bytes per write, like a raw file interrupted by signals."""

    def write(self, b) -> int:
        return super().write(bytes(memoryview(b).cast("B")[:5]))


def test_writer_loops_over_partial_writes():
    data = golden_rows()
    f = TrickleWriter()
    assert F.write_snapshot(f, G_TOKENS, G_MODEL_ID, G_GEOM, 2, lambda l, kv: data[l, kv]) == 204
    assert f.getvalue() == GOLDEN


# ---- the extension section: image runs (flags bit 1, byte length in `reserved`) ----------------
IMG_SPAN = dict(start=1, grid=(1, 1, 2), pos0=1, digest=bytes(range(32)))


def hand_built_image_file() -> bytes:
    """The golden rows and tokens with one image run (rows 1-2), assembled with struct only."""
    g = hand_built_golden()
    body = struct.pack("<I", 1) + struct.pack("<5I", 1, 1, 1, 2, 1) + bytes(range(32))
    records = struct.pack("<II", 1, len(body)) + body
    ext = records + struct.pack("<I", crc32c.crc32c(records))
    assert len(ext) == 68
    head = bytearray(g[:64])
    struct.pack_into("<II", head, 48, 3, len(ext))  # flags: trailer | extension; reserved: E
    struct.pack_into("<I", head, 60, crc32c.crc32c(bytes(head[:60])))
    return bytes(head) + g[64:76] + ext + g[76:]


IMAGE_FILE = hand_built_image_file()
BAD_FILES.update({
    "extension crc": (flip(IMAGE_FILE, 76 + 20), E.SnapshotExtension, {}),
    "extension without flag": (repack(IMAGE_FILE, flags=1), E.SnapshotFlags, {}),
    "extension size 6": (repack(IMAGE_FILE, reserved=6), E.SnapshotFlags, {}),
})


def _ext_file(body: bytes, tag: int = 1) -> bytes:
    records = struct.pack("<II", tag, len(body)) + body
    ext = records + struct.pack("<I", crc32c.crc32c(records))
    assert len(ext) == 68
    return IMAGE_FILE[:76] + ext + IMAGE_FILE[76 + 68:]


BAD_FILES.update({
    "extension unknown record": (_ext_file(IMAGE_FILE[76 + 8:76 + 64], tag=7), E.SnapshotExtension, {}),
    "extension run beyond rows": (_ext_file(struct.pack("<I5I", 1, 3, 1, 1, 2, 1) + bytes(32)),
                                  E.SnapshotExtension, {}),
})


def test_image_extension_golden_bytes(tmp_path):
    """Writer output equals the hand-built file; the reader returns the run; the payload moved by E."""
    from edge_llm.kvcache import ImageSpan

    span = ImageSpan(**IMG_SPAN)
    buf = io.BytesIO()
    n = F.write_snapshot(buf, G_TOKENS, G_MODEL_ID, G_GEOM, 2, lambda l, kv: golden_rows()[l, kv], spans=[span])
    assert buf.getvalue() == IMAGE_FILE and n == len(IMAGE_FILE) == len(GOLDEN) + 68
    assert n == F.snapshot_size(2, 3, 2, 2, ext_size=68)
    hdr, tokens, dest = read_all(IMAGE_FILE)
    assert hdr.spans == (span,) and hdr.ext_size == 68 and hdr.flags == 3
    assert span.next_pos == 3 and span.end == 3
    assert np.array_equal(dest, golden_rows()[:, :, :3])
    # no image run: byte-identical to the plain v1 file
    buf = io.BytesIO()
    F.write_snapshot(buf, G_TOKENS, G_MODEL_ID, G_GEOM, 2, lambda l, kv: golden_rows()[l, kv], spans=[])
    assert buf.getvalue() == GOLDEN
    path = tmp_path / "img.kv"
    path.write_bytes(IMAGE_FILE)
    info = describe(path)
    assert info["valid"] and [s["name"] for s in info["sections"]] == ["header", "token ids", "extension",
                                                                       "payload", "trailer"]
    assert info["images"][0]["rows"] == (1, 3) and info["size_formula"]["E"] == 68
    F.verify_file(path, G_GEOM, G_MODEL_ID)


# ---- a delta file, byte by byte: rows [2, 3) of the golden sequence on top of its first 2 tokens ----
def hand_built_delta(base_trailer_crc: int) -> bytes:
    """Flags 3 (trailer + extension), reserved E = 28: one base record (type 2, 16-byte body: base_n
    2, the base's trailer CRC, the FNV of the first 2 ids) + the section CRC; then row 2 only."""
    tokens = b"".join(struct.pack("<I", t) for t in G_TOKENS)
    record = struct.pack("<II", 2, 16) + struct.pack("<IIQ", 2, base_trailer_crc, ref_fnv1a64(tokens[:8]))
    ext = record + struct.pack("<I", crc32c.crc32c(record))
    blocks = [struct.pack("<2f", *golden_value(layer, kv, 2)) for layer in range(2) for kv in (0, 1)]
    trailer = b"".join(struct.pack("<I", crc32c.crc32c(b)) for b in blocks)
    head = (struct.pack("<I", 0x564C4B56) + b"".join(struct.pack("<I", v) for v in (1, 2, 1, 2, 2, 3, 2))
            + struct.pack("<Q", ref_fnv1a64(tokens)) + struct.pack("<Q", G_MODEL_ID)
            + struct.pack("<III", 3, len(ext), crc32c.crc32c(trailer)))
    return head + struct.pack("<I", crc32c.crc32c(head)) + tokens + ext + b"".join(blocks) + trailer


def test_delta_golden_bytes_and_chain_read():
    data = golden_rows()
    base_f = io.BytesIO()
    F.write_snapshot(base_f, G_TOKENS[:2], G_MODEL_ID, G_GEOM, 2, lambda l, kv: data[l, kv])
    base_hdr, _ = F.read_header(io.BytesIO(base_f.getvalue()), G_GEOM, G_MODEL_ID)
    ref = F.BaseRef(2, base_hdr.trailer_crc, base_hdr.tokens_fnv)
    want = hand_built_delta(base_hdr.trailer_crc)
    assert len(want) == 64 + 12 + 28 + 2 * 2 * 1 * 2 * 4 + 8 * 2 * 1 == 152
    assert F.snapshot_size(2, 3, 2, 2, ext_size=28, row0=2) == 152
    f = io.BytesIO()
    assert F.write_snapshot(f, G_TOKENS, G_MODEL_ID, G_GEOM, 2, lambda l, kv: data[l, kv], base=ref) == 152
    assert f.getvalue() == want
    hdr, tokens = F.read_header(io.BytesIO(want), G_GEOM, G_MODEL_ID)
    assert tokens.tolist() == G_TOKENS and hdr.base == ref and hdr.row0 == 2 and hdr.n_blocks == 1
    assert hdr.base.name == F.snapshot_name(base_hdr.tokens_fnv) and hdr.block_rows(0) == (2, 3)
    # the chain: the base fills rows [0, 2), the delta row 2; together the full sequence, bitwise
    dest = np.full((2, 2, 4, 2), 7.0, np.float32)
    F.read_rows_into(io.BytesIO(base_f.getvalue()), base_hdr, 2, lambda l, kv: dest[l, kv])
    F.read_rows_into(io.BytesIO(want), hdr, 3, lambda l, kv: dest[l, kv])
    assert np.array_equal(dest[:, :, :3], data[:, :, :3]) and (dest[:, :, 3] == 7.0).all()
    info = describe_bytes(want)
    assert info["valid"] and info["base"]["rows_held"] == (2, 3)
    assert info["size_formula"]["expected"] == 152 and info["size_formula"]["terms"] == [64, 12, 28, 32, 16]
    # a file without a base or images stays the plain v1 file (flags 1, reserved 0)
    assert F.encode_extension((), None) == b""


def describe_bytes(data: bytes) -> dict:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "x.kv")
        with open(path, "wb") as f:
            f.write(data)
        return describe(path)


@pytest.mark.parametrize("mutate, exc", [
    (lambda d: d[:-1], E.SnapshotSize),                                   # one byte short of the delta size
    (lambda d: d + bytes(8), E.SnapshotSize),                             # a full file's size is not a delta's
    (lambda d: flip(d, 64 + 12 + 8), E.SnapshotExtension),                # base_n byte: section CRC fails
    (lambda d: flip(d, 64), E.SnapshotTokenHash),                          # an id: reported before the section
])
def test_bad_delta_files(mutate, exc):
    data = golden_rows()
    f = io.BytesIO()
    F.write_snapshot(f, G_TOKENS, G_MODEL_ID, G_GEOM, 2, lambda l, kv: data[l, kv], base=F.BaseRef(2, 1, 2))
    assert type(pytest.raises(E.SnapshotError, F.read_header, io.BytesIO(f.getvalue()), G_GEOM,
                              G_MODEL_ID).value) is E.SnapshotExtension  # base FNV 2 is not the ids' hash
    ok = io.BytesIO()
    F.write_snapshot(ok, G_TOKENS, G_MODEL_ID, G_GEOM, 2, lambda l, kv: data[l, kv],
                     base=F.BaseRef(2, 1, ref_fnv1a64(ok_ids := struct.pack("<2I", *G_TOKENS[:2]))))
    assert ok_ids
    with pytest.raises(exc):
        F.read_header(io.BytesIO(mutate(ok.getvalue())), G_GEOM, G_MODEL_ID)
