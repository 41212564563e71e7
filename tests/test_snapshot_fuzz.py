"""Mutation fuzz of a valid VLKV file: every mutated file is either rejected with a SnapshotError
subclass or accepted with contents bitwise equal to the original. Any other exception fails."""

from __future__ import annotations

import collections
import io
import struct

import crc32c
import numpy as np

from edge_llm.config import Geometry
from edge_llm.errors import SnapshotError
from edge_llm.snapshot import format as F

GEOM = Geometry(n_layers=2, n_kv_heads=2, head_dim=3)
N_TOKENS, KV_BS, MODEL_ID = 7, 3, 0xFEEDFACECAFEBEEF
NAMES = [n for n, _, _ in F.HEADER_FIELDS]


def make_original(rng):
    bits = rng.integers(0, 2**32, size=(GEOM.n_layers, 2, N_TOKENS, GEOM.kv_dim), dtype=np.uint32)
    rows = bits.view(np.float32)  # arbitrary bit patterns, NaN payloads included
    tokens = rng.integers(0, 2**32, size=N_TOKENS, dtype=np.uint64)
    f = io.BytesIO()
    F.write_snapshot(f, tokens, MODEL_ID, GEOM, KV_BS, lambda l, kv: rows[l, kv])
    return f.getvalue(), tokens.astype(np.uint32), rows


def mutate(rng, data: bytes) -> tuple[str, bytes]:
    kind = rng.choice(["bitflip", "overwrite", "truncate", "extend", "header-field"],
                      p=[0.35, 0.25, 0.12, 0.08, 0.20])
    b = bytearray(data)
    if kind == "bitflip":
        for _ in range(int(rng.integers(1, 4))):
            b[int(rng.integers(len(b)))] ^= 1 << int(rng.integers(8))
    elif kind == "overwrite":
        pos = int(rng.integers(len(b)))
        chunk = rng.integers(0, 256, size=int(rng.integers(1, 9)), dtype=np.uint8).tobytes()
        b[pos:pos + len(chunk)] = chunk
        del b[len(data):]
    elif kind == "truncate":
        del b[int(rng.integers(len(b))):]
    elif kind == "extend":
        b += rng.integers(0, 256, size=int(rng.integers(1, 65)), dtype=np.uint8).tobytes()
    else:  # rewrite one header field and re-seal the header CRC, so the deeper checks are exercised
        values = dict(zip(NAMES, F.HEADER.unpack_from(b)))
        name = str(rng.choice(NAMES[:-1]))
        size = dict((n, s) for n, _, s in F.HEADER_FIELDS)[name]
        old = values[name]
        top = (1 << (8 * size)) - 1
        choices = [(old + 1) & top, (old - 1) & top, 0, 1, top, int(rng.integers(0, 1 << min(8 * size, 63)))]
        values[name] = choices[int(rng.integers(len(choices)))]
        head = F.HEADER.pack(*(values[n] for n in NAMES))
        b[:64] = head[:60] + struct.pack("<I", crc32c.crc32c(head[:60]))
    return str(kind), bytes(b)


def check(data: bytes, m: int, original: bytes, tokens: np.ndarray, rows: np.ndarray, f=None) -> str:
    """'rejected:<reason>' or 'accepted'; asserts an accepted file restores the original bits."""
    f = f or io.BytesIO(data)
    try:
        hdr, got_tokens = F.read_header(f, GEOM, MODEL_ID, max_tokens=64)
        dest = np.zeros((hdr.n_layers, 2, hdr.n_tokens, hdr.kv_dim), dtype=np.float32)
        F.read_rows_into(f, hdr, min(m, hdr.n_tokens), lambda l, kv: dest[l, kv])
    except SnapshotError as e:
        return f"rejected:{e.reason}"
    need = F.rows_needed(hdr, min(m, hdr.n_tokens))
    assert np.array_equal(got_tokens, tokens), "accepted with different token ids"
    assert np.array_equal(dest[:, :, :need].view(np.uint32), rows[:, :, :need].view(np.uint32)), \
        "accepted with different KV rows"
    if m >= N_TOKENS:  # a full read that passed must have come from the original bytes
        assert data == original, "a modified file passed every check of a full read"
    return "accepted"


def test_mutation_fuzz():
    rng = np.random.default_rng(20261129)
    original, tokens, rows = make_original(rng)
    assert check(original, N_TOKENS, original, tokens, rows) == "accepted"
    outcomes: collections.Counter[str] = collections.Counter()
    kinds: collections.Counter[str] = collections.Counter()
    cases = 4000
    for i in range(cases):
        kind, data = mutate(rng, original)
        kinds[kind] += 1
        m = N_TOKENS if i % 2 == 0 else int(rng.integers(1, N_TOKENS + 1))
        outcomes[check(data, m, original, tokens, rows)] += 1
    assert sum(outcomes.values()) == cases
    rejected = sum(v for k, v in outcomes.items() if k.startswith("rejected:"))
    # bit flips and extensions always change the file, so most cases must be rejections
    assert rejected >= 0.9 * cases, outcomes
    # the generator reaches every check behind the header CRC, not just the first few
    for reason in ("short-file", "bad-magic", "header-crc", "bad-version", "flags", "geometry",
                   "kv-dim", "n-tokens", "size", "model-id", "token-hash", "trailer-crc", "block-crc"):
        assert outcomes[f"rejected:{reason}"] > 0, (reason, outcomes)
    assert min(kinds.values()) > 200, kinds


def test_mutation_fuzz_real_files(tmp_path):
    """A smaller run through real files (preadv path) and verify_file, which must agree."""
    rng = np.random.default_rng(7)
    original, tokens, rows = make_original(rng)
    path = tmp_path / "fuzz.kv"
    outcomes: collections.Counter[str] = collections.Counter()
    for _ in range(300):
        _, data = mutate(rng, original)
        path.write_bytes(data)
        with open(path, "rb", buffering=0) as f:
            outcome = check(data, N_TOKENS, original, tokens, rows, f)
        try:
            F.verify_file(path, GEOM, MODEL_ID, max_tokens=64)
            verified = "accepted"
        except SnapshotError as e:
            verified = f"rejected:{e.reason}"
        assert verified == outcome
        outcomes[outcome] += 1
    assert outcomes["accepted"] < 30 and sum(outcomes.values()) == 300, outcomes
