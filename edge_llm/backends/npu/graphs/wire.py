"""Message framing between edge-llm and the rknn-toolkit2 worker process (`toolkit_worker.py`).

The worker runs in the converter venv (numpy 1.26, its own Python packages), so nothing is
pickled: a message is a little-endian u32 length, a JSON header, then the raw bytes of the
arrays the header describes (dtype string + shape each). This module imports only the standard
library and numpy, so the worker can import it by file location without importing edge_llm.
"""

from __future__ import annotations

import json
import struct
from typing import Any, BinaryIO

import numpy as np

_LEN = struct.Struct("<I")
MAX_HEADER = 16 << 20


class WireError(RuntimeError):
    """The other side closed the pipe or sent something that is not a message."""


def _read_exact(f: BinaryIO, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = f.read(n - len(buf))
        if not chunk:
            raise WireError(f"pipe closed after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


def send(f: BinaryIO, header: dict[str, Any], arrays: list[np.ndarray] = ()) -> None:
    arrays = [np.ascontiguousarray(a) for a in arrays]
    head = json.dumps({**header, "arrays": [[a.dtype.str, list(a.shape)] for a in arrays]}).encode()
    f.write(_LEN.pack(len(head)))
    f.write(head)
    for a in arrays:
        f.write(memoryview(a).cast("B"))
    f.flush()


def recv(f: BinaryIO) -> tuple[dict[str, Any], list[np.ndarray]]:
    (n,) = _LEN.unpack(_read_exact(f, _LEN.size))
    if n > MAX_HEADER:
        raise WireError(f"header of {n} bytes exceeds {MAX_HEADER}")
    header = json.loads(_read_exact(f, n))
    arrays = []
    for dtype, shape in header.pop("arrays", []):
        dt = np.dtype(dtype)
        count = int(np.prod(shape, dtype=np.int64))
        arrays.append(np.frombuffer(_read_exact(f, count * dt.itemsize), dtype=dt).reshape(shape))
    return header, arrays
