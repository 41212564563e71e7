"""The KV cache (`cache.py`: the rows, their one writer, restores into them) and its records
(`records.py`: image spans, the restore source protocol and result)."""

from edge_llm.kvcache.cache import K, MEMORY_HEADROOM, PIPELINED, SEQUENTIAL, V, KVCache, Restore, RowLease
from edge_llm.kvcache.records import ImageSpan, Restored, RowSource, lcp, next_position

__all__ = ["K", "MEMORY_HEADROOM", "PIPELINED", "SEQUENTIAL", "V", "ImageSpan", "KVCache", "Restore", "Restored",
           "RowLease", "RowSource", "lcp", "next_position"]
