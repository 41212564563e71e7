"""Streaming safetensors writer: HF-layout checkpoints written tensor by tensor.

Used by the synthetic-checkpoint writer and the GGUF importer. The header is computed from the
tensor plans first, so at most one tensor (or one row block of it) is in memory at a time; files
are written under a temp name, fsynced and renamed (edge_llm/files.py). BF16 helpers convert exactly.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edge_llm import files
from edge_llm.errors import ModelImportError

# progress(done_bytes, total_bytes, what)
Progress = Callable[[int, int, str], None]

_DTYPE_BYTES = {"F32": 4, "BF16": 2, "F16": 2}
_DTYPE_NUMPY = {"F32": np.dtype("<f4"), "BF16": np.dtype("<u2"), "F16": np.dtype("<f2")}
DEFAULT_SHARD_BYTES = 1 << 30


@dataclass(frozen=True)
class TensorPlan:
    """One tensor to write: name, safetensors dtype (F32 / BF16 / F16) and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * _DTYPE_BYTES[self.dtype]


Produce = Callable[[TensorPlan], "np.ndarray | Iterable[np.ndarray]"]


def write_safetensors(path: Path, plans: Sequence[TensorPlan], produce: Produce,
                      on_tensor: Callable[[TensorPlan], None] | None = None, durable: bool = True) -> None:
    """Write one safetensors file tensor by tensor (files.atomic_file: temp name, fsync unless
    not `durable`, rename; a failure leaves no file).

    The header is computed from the plans first, so at most one tensor is in memory at a time.
    `produce` returns the tensor's storage array (BF16 as raw uint16 bits), or an iterable of
    row blocks of it (axis 0) so that large tensors never exist whole.
    """
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    off = 0
    for p in plans:
        header[p.name] = {"dtype": p.dtype, "shape": list(p.shape), "data_offsets": [off, off + p.nbytes]}
        off += p.nbytes
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)  # the data section starts 8-byte aligned, as the reference writer pads
    with files.atomic_file(path, durable=durable) as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        for p in plans:
            out = produce(p)
            written = 0
            for arr in ([out] if isinstance(out, np.ndarray) else out):
                arr = np.ascontiguousarray(arr)
                if arr.dtype != _DTYPE_NUMPY[p.dtype] or arr.shape[1:] != p.shape[1:]:
                    raise ModelImportError(f"{p.name}: produced {arr.dtype}{arr.shape}, planned {p.dtype}{p.shape}")
                f.write(memoryview(arr.reshape(-1)).cast("B"))
                written += arr.nbytes
            if written != p.nbytes:
                raise ModelImportError(f"{p.name}: produced {written} bytes, planned {p.nbytes}")
            if on_tensor:
                on_tensor(p)


def write_checkpoint(out_dir: Path, plans: Sequence[TensorPlan], produce: Produce,
                     max_shard_bytes: int = DEFAULT_SHARD_BYTES, progress: Progress | None = None,
                     durable: bool = True) -> list[str]:
    """Write `model.safetensors`, or HF-style shards + `model.safetensors.index.json` when the
    tensors exceed `max_shard_bytes`. Returns the file names written."""
    shards: list[list[TensorPlan]] = [[]]
    size = 0
    for p in plans:
        if shards[-1] and size + p.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(p)
        size += p.nbytes
    total = sum(p.nbytes for p in plans)
    done = 0

    def tick(p: TensorPlan) -> None:
        nonlocal done
        done += p.nbytes
        if progress:
            progress(done, total, p.name)

    if len(shards) == 1:
        names = ["model.safetensors"]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for name, shard in zip(names, shards):
        write_safetensors(out_dir / name, shard, produce, on_tensor=tick, durable=durable)
    if len(shards) > 1:
        index = {"metadata": {"total_size": total},
                 "weight_map": {p.name: n for n, s in zip(names, shards) for p in s}}
        write_json_atomic(out_dir / "model.safetensors.index.json", index, durable=durable)
    keep = set(names) | ({"model.safetensors.index.json"} if len(shards) > 1 else set())
    for old in out_dir.glob("model*.safetensors*"):  # a previous, differently sharded checkpoint
        if old.name not in keep:
            old.unlink()
    if durable:
        files.fsync_dir(out_dir)  # the removals above
    return names


def write_json_atomic(path: Path, obj: Any, durable: bool = True) -> None:
    files.write_atomic(path, json.dumps(obj, indent=2, ensure_ascii=False) + "\n", durable=durable)


def read_safetensors_header(path: str | Path) -> dict[str, Any]:
    """The JSON header of a safetensors file (tensor dtypes, shapes, offsets) without reading data."""
    with files.open_regular(path, ModelImportError) as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ModelImportError(f"{path}: too short for a safetensors file")
        (n,) = struct.unpack("<Q", raw)
        size = os.fstat(f.fileno()).st_size
        if n > min(size - 8, 100 << 20):
            raise ModelImportError(f"{path}: header length {n} is implausible")
        try:
            return json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ModelImportError(f"{path}: bad safetensors header: {e}") from None


# ---- BF16 ----------------------------------------------------------------------------------
def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round F32 to BF16 (round to nearest, ties to even) and return the raw uint16 bits."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    u = x.view(np.uint32)
    t = u >> np.uint32(16)  # in-place steps: this runs over ~1.7e9 values for the 2B preset
    t &= np.uint32(1)
    t += np.uint32(0x7FFF)
    t += u  # wraps only for NaN payloads, fixed below
    t >>= np.uint32(16)
    out = t.astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():  # keep NaN a (quiet) NaN instead of letting the carry turn it into inf
        out[nan] = ((u[nan] >> 16) | 0x40).astype(np.uint16)
    return out


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    """Widen raw BF16 bits to F32 exactly."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)
