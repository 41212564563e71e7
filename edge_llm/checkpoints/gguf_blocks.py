"""The GGUF blocks of an imported model, as the quantized CPU backend takes them.

`backends/cpuq/nbits.py` declares what it needs (`BlockSource`: HF tensor name -> stored blocks in
HF row order); this module provides it from the GGUF file a model directory was imported from.
The backend never reads GGUF names or llama.cpp's layouts itself: the name map and the Q/K row
permutation are the importer's (`gguf_import.py`), and the blocks are handed over with the row
order that undoes it, so they line up with the F32 tensors the importer wrote.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from edge_llm.backends.cpuq.nbits import SourceTensor
from edge_llm.checkpoints.default import MARKER as DEFAULT_MARKER
from edge_llm.checkpoints.gguf_import import IMPORT_RECORD, hf_name, unpermute_qk
from edge_llm.checkpoints.packaged import default_gguf_path


def gguf_source(model_dir: str | Path) -> Path | None:
    """The GGUF file a model directory was imported from, if it is still there."""
    d = Path(model_dir)
    try:
        rec = json.loads((d / IMPORT_RECORD).read_text())
    except (OSError, ValueError):
        return None
    cand = rec.get("source_path")
    if cand and Path(cand).is_file():
        return Path(cand)
    if (d / DEFAULT_MARKER).is_file():  # the embedded default model (imported before source_path)
        try:
            return default_gguf_path()
        except Exception:  # package uninstalled: re-quantize instead
            return None
    return None


class GgufBlocks:
    """A `nbits.BlockSource` over one GGUF file, read on first use (only a build needs it)."""

    def __init__(self, path: Path):
        self.path = path
        self._tensors: dict[str, Any] | None = None
        self._heads: dict[str, int] = {}  # ".q_proj." / ".k_proj." -> heads of the permutation

    def _load(self) -> dict[str, Any]:
        if self._tensors is None:
            import gguf

            reader = gguf.GGUFReader(self.path)
            fields = reader.fields
            arch = fields["general.architecture"].contents()
            if arch == "llama":  # convert_hf_to_gguf permuted Q/K rows with the GGUF's head counts
                n_head = int(fields[f"{arch}.attention.head_count"].contents())
                kv = fields.get(f"{arch}.attention.head_count_kv")
                self._heads = {".q_proj.": n_head, ".k_proj.": n_head if kv is None else int(kv.contents())}
            self._tensors = {hf_name(t.name): t for t in reader.tensors}
        return self._tensors

    def tensor(self, name: str) -> SourceTensor | None:
        t = self._load().get(name)
        if t is None:
            return None
        K, N = (int(d) for d in t.shape[:2])  # GGUF lists dimensions fastest-first
        order = next((unpermute_qk(np.arange(N), h) for part, h in self._heads.items() if part in name), None)
        return SourceTensor(t.tensor_type.name, t.data, K, N, order)


def gguf_blocks(model_dir: str | Path) -> GgufBlocks | None:
    """The blocks of the GGUF `model_dir` was imported from; None if it was not (or it is gone)."""
    path = gguf_source(model_dir)
    return None if path is None else GgufBlocks(path)
