"""VLKV version 1: one KV snapshot file, full or delta (docs/snapshot-format.md). Knows nothing of
directories.

One import for callers; the parts live in `layout.py` (header, extension records, size formula,
block map), `encode.py` (the one-pass writer) and `decode.py` (validation, partial reads,
verification).
"""

from edge_llm.snapshot.decode import (  # noqa: F401
    read_header,
    read_layer_into,
    read_rows_into,
    rows_needed,
    size_from_head,
    verify_file,
)
from edge_llm.snapshot.encode import SnapshotWriter, write_snapshot  # noqa: F401
from edge_llm.snapshot.layout import (  # noqa: F401
    BASE_REF,
    EXT_BASE,
    EXT_IMAGES,
    EXT_MAX,
    EXT_RECORD,
    F32,
    FLAG_EXTENSION,
    FLAG_TRAILER,
    HEADER,
    HEADER_FIELDS,
    IMAGE_SPAN,
    KNOWN_FLAGS,
    KV_NAMES,
    MAGIC,
    SNAPSHOT_GLOB,
    SNAPSHOT_NAME,
    SNAPSHOT_RE,
    VERSION,
    BaseRef,
    SnapshotHeader,
    decode_extension,
    encode_extension,
    fnv1a64,
    is_snapshot_name,
    n_blocks,
    snapshot_name,
    snapshot_size,
)
