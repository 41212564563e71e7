"""Model identity (docs/identity.md): the 64-bit `model_id` stamped into every snapshot, and the
per-identity namespace directory `<kv-dir>/<model_id as 16 hex>/` with its `identity.json`.

Everything that determines the KV values of a token sequence goes into the digest: the text-model
config fields, the weight bytes, the tokenizer, the snapshot layout, the backend numerics and the
prefill chunk (the batches prompt rows are computed in).
Changing any of them yields a new namespace; old namespaces are left alone (isolated, not
deleted) and are found again when the same configuration comes back.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edge_llm.config import ModelArgs
from edge_llm.errors import SnapshotNotRegular
from edge_llm.files import read_regular
from edge_llm.safetext import printable
from edge_llm.settings import DEFAULTS
from edge_llm.snapshot.writer import Modes, write_atomic
from edge_llm.weights import sha256_file, weight_digest

log = logging.getLogger(__name__)

# VLKV version 1, F32 rows, payload ordered (layer, block, K then V). Bump when any of that changes.
LAYOUT_VERSION = "VLKV1/f32-rows/layer-block-kv"
IDENTITY_FILE = "identity.json"
NO_TOKENIZER = "none"


def _jsonable(value: Any) -> Any:
    """Tuples -> lists recursively, so the canonical JSON does not depend on container types."""
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return value


IDENTITY_MAX_DEPTH = 16  # a model config nests a few levels (rope_scaling); identity.json no deeper
_KIND_NAMES = {dict: "an object", str: "a string", int: "an integer"}
# identity.json key -> (Identity field, type, default when absent)
_FIELDS: dict[str, tuple[str, type, Any]] = {
    "config": ("config", dict, None),
    "weights_sha256": ("weights_digest", str, None),
    "tokenizer_sha256": ("tokenizer_digest", str, NO_TOKENIZER),
    "layout": ("layout", str, LAYOUT_VERSION),
    "backend_numerics": ("backend_numerics", str, "cpu-f32"),
    "prefill_chunk": ("prefill_chunk", int, DEFAULTS.prefill_chunk),
    "model_dir": ("model_dir", str, ""),
}


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e400 parses to inf, which no canonical JSON can hold
        raise ValueError(f"{text[:20]} is out of range")
    return value


def parse_identity_json(text: str) -> dict[str, Any]:
    """identity.json as a dict: strict JSON (NaN, Infinity refused), at most IDENTITY_MAX_DEPTH
    levels of objects and arrays, `config` and `weights_sha256` present. ValueError otherwise."""
    try:
        doc = json.loads(text, parse_constant=_no_constant, parse_float=_finite)
    except RecursionError:
        raise ValueError("nested too deeply") from None
    if not isinstance(doc, dict):
        raise ValueError(f"a JSON {type(doc).__name__}, not an object")
    stack: list[tuple[Any, int]] = [(doc, 1)]
    while stack:  # iterative: the depth being checked cannot exhaust the interpreter's stack
        value, depth = stack.pop()
        if depth > IDENTITY_MAX_DEPTH:
            raise ValueError(f"nested deeper than {IDENTITY_MAX_DEPTH} levels")
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
        stack.extend((v, depth + 1) for v in children if isinstance(v, (dict, list)))
    for key in ("config", "weights_sha256"):
        if key not in doc:
            raise ValueError(f"no {key!r}")
    return doc


@dataclass(frozen=True)
class Identity:
    """What produced a KV snapshot. `model_id` is a digest of all fields."""

    config: dict[str, Any]
    weights_digest: str
    tokenizer_digest: str = NO_TOKENIZER
    layout: str = LAYOUT_VERSION
    backend_numerics: str = "cpu-f32"
    # prompt rows are computed in chunks of this many rows, cut at its multiples: it decides the
    # bits of the KV rows as the numerics do (docs/store.md, "Restore and recompute")
    prefill_chunk: int = DEFAULTS.prefill_chunk
    # informational only (not hashed): where the model was loaded from
    model_dir: str = field(default="", compare=False)

    def canonical(self) -> dict[str, Any]:
        """The hashed fields, JSON-ready."""
        return {
            "config": _jsonable(self.config),
            "weights_sha256": self.weights_digest,
            "tokenizer_sha256": self.tokenizer_digest,
            "layout": self.layout,
            "backend_numerics": self.backend_numerics,
            "prefill_chunk": self.prefill_chunk,
        }

    def canonical_json(self) -> str:
        # sort_keys + compact separators: one byte string per identity, independent of dict order
        return json.dumps(self.canonical(), sort_keys=True, separators=(",", ":"), allow_nan=False)

    @property
    def model_id(self) -> int:
        """First 8 bytes of sha256(canonical JSON), little-endian."""
        digest = hashlib.sha256(self.canonical_json().encode()).digest()
        return int.from_bytes(digest[:8], "little")

    @property
    def namespace(self) -> str:
        """Directory name of this identity's snapshots: model_id as 16 hex digits."""
        return f"{self.model_id:016x}"

    def to_json(self) -> str:
        """Human-readable identity.json text (hashed fields + model_id + informational fields)."""
        doc = {"model_id": self.namespace, **self.canonical()}
        if self.model_dir:
            doc["model_dir"] = self.model_dir
        return json.dumps(doc, indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> "Identity":
        """Parse identity.json strictly (docs/identity.md): JSON without NaN/Infinity, nested at
        most IDENTITY_MAX_DEPTH deep, each field of its type. ValueError says what is wrong."""
        doc = parse_identity_json(text)
        fields = {name: doc[key] if key in doc else default for key, (name, _, default) in _FIELDS.items()}
        for key, (name, kind, _) in _FIELDS.items():
            value = fields[name]
            if not isinstance(value, kind) or isinstance(value, bool):
                raise ValueError(f"{key} is {type(value).__name__}, not {_KIND_NAMES[kind]}")
        if fields["prefill_chunk"] < 1:
            raise ValueError(f"prefill_chunk {fields['prefill_chunk']} is not a positive integer")
        return cls(**fields)

    @classmethod
    def for_model(cls, model_dir: str | Path, args: ModelArgs, backend_numerics: str = "cpu-f32",
                  progress: Callable[[str], None] | None = None,
                  prefill_chunk: int = DEFAULTS.prefill_chunk) -> "Identity":
        """Identity of a loaded HF model directory (weight digest is cached by edge_llm.weights;
        `progress(text)` while a first start hashes the weights)."""
        model_dir = Path(model_dir)
        tok = model_dir / "tokenizer.json"
        return cls(
            config=args.identity_fields(),
            weights_digest=weight_digest(model_dir, progress),
            tokenizer_digest=sha256_file(tok) if tok.is_file() else NO_TOKENIZER,
            backend_numerics=backend_numerics,
            prefill_chunk=prefill_chunk,
            model_dir=str(model_dir.resolve()),
        )


NAMESPACE_RE = re.compile(r"^[0-9a-f]{16}\Z")  # a namespace directory's name (Identity.namespace)


def namespace_dir(kv_dir: str | Path, identity: Identity) -> Path:
    """`<kv-dir>/<model_id hex>/` (not created)."""
    return Path(kv_dir) / identity.namespace


def ensure_namespace(kv_dir: str | Path, identity: Identity, modes: Modes | None = None) -> Path:
    """Create the kv dir and the namespace directory (mode from `modes`: owner-only unless the
    operator allows the group) and its identity.json (rewritten only when it differs)."""
    modes = modes or Modes()
    ns = namespace_dir(kv_dir, identity)
    for d in (Path(kv_dir), ns):
        _own_dir(d, modes)
    ident_path = ns / IDENTITY_FILE
    text = identity.to_json()
    try:  # a FIFO here is refused unread, then replaced by the real file (docs/store.md, "Faults")
        current = read_regular(ident_path, SnapshotNotRegular).decode()
    except (FileNotFoundError, UnicodeDecodeError, SnapshotNotRegular):
        current = None
    if current != text:
        write_atomic(ident_path, text.encode(), modes)
        log.info("[KV-DISK] namespace %s (%s, %s)", ns.name, identity.backend_numerics,
                 printable(identity.model_dir or "model"))
    return ns


def _own_dir(d: Path, modes: Modes) -> None:
    """Create with the store's mode; an existing directory is tightened only if we own it (the kv
    dir may be a mount point or a directory the operator prepared)."""
    if not d.exists():
        modes.mkdir(d)
        return
    st = d.stat()
    if st.st_uid == os.getuid() and (st.st_mode & 0o777) & ~modes.dir:
        os.chmod(d, st.st_mode & modes.dir)
        log.info("[KV-DISK] %s was readable by others: mode now %o", printable(d), st.st_mode & modes.dir & 0o777)


def read_identity(ns_dir: str | Path) -> dict[str, Any] | None:
    """Parsed identity.json of a namespace directory, or None if missing/unreadable."""
    try:
        return json.loads(read_regular(Path(ns_dir) / IDENTITY_FILE, SnapshotNotRegular))
    except (OSError, ValueError, SnapshotNotRegular):
        return None
