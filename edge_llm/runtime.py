"""Build a ready Engine from options: model dir -> model, tokenizer, KV cache, snapshot store.

Shared by `edge-llm generate`, `edge-llm serve` and the benchmarks so all three load a model the
same way.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from edge_llm.engine import DEFAULT_PREFILL_CHUNK, Engine
from edge_llm.kvcache import DEFAULT_KV_BS, DEFAULT_MAX_SEQ, KVCache

log = logging.getLogger(__name__)


@dataclass
class RuntimeOptions:
    model: str = "default"  # a HF model directory, or "default" for the embedded model
    backend: str = "cpu"
    max_seq: int = DEFAULT_MAX_SEQ
    kv_bs: int = DEFAULT_KV_BS
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK
    disk_kv: str | None = None  # directory of snapshot namespaces; None = disk KV off
    disk_kv_min_lcp: int = 16
    disk_kv_max_files: int = 8
    disk_kv_max_bytes: int | None = None
    disk_kv_max_tokens: int = 8192
    max_image_bytes: int = 20 * 1024 * 1024
    max_image_pixels: int = 64 * 1024 * 1024


def load_runtime(opts: RuntimeOptions, progress=None) -> Engine:
    """Load model + tokenizer, allocate the KV cache, open and scan the snapshot store."""
    from edge_llm.models.default import resolve_model_dir
    from edge_llm.models.qwen3 import Model
    from edge_llm.tokenizer import Tokenizer

    model_dir = Path(resolve_model_dir(opts.model, progress=progress))
    model = Model.load(model_dir, backend=opts.backend)
    from edge_llm.vision.model import VisionModel

    from edge_llm.vision.preprocess import ImageLimits

    limits = ImageLimits(opts.max_image_bytes, opts.max_image_pixels)
    vision = (VisionModel.load(model_dir, model.args, backend=opts.backend, limits=limits)
              if model.args.model_type == "qwen3_vl" else None)
    tokenizer = Tokenizer.from_dir(model_dir)
    cache = KVCache(model.args.geometry, max_seq=opts.max_seq, kv_bs=opts.kv_bs)
    store = None
    if opts.disk_kv:
        from edge_llm.snapshot.identity import Identity
        from edge_llm.snapshot.store import SnapshotStore

        identity = Identity.for_model(model_dir, model.args, model.backend.numerics)
        store = SnapshotStore(
            Path(opts.disk_kv), identity, model.args.geometry,
            min_lcp=opts.disk_kv_min_lcp, max_files=opts.disk_kv_max_files,
            max_bytes=opts.disk_kv_max_bytes, max_tokens=opts.disk_kv_max_tokens, kv_bs=opts.kv_bs,
        )
        store.scan()
    engine = Engine(model, tokenizer, cache, store=store, prefill_chunk=opts.prefill_chunk,
                    model_dir=model_dir, vision=vision)
    log.info("runtime ready: model %s (%s), KV cache %d MiB (max_seq %d)", model_dir.name,
             opts.backend, cache.nbytes >> 20, opts.max_seq)
    return engine
