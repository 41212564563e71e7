"""MRoPE positions of a prompt with images, and its image-safe prefix key.

Positions follow transformers' `Qwen3VLModel.get_rope_index`: text tokens advance t = h = w by one;
an image's run of t*h*w tokens sits on its (t, h, w) grid offset by the position where it starts;
the text after it continues at that offset + max(h, w) (= the run's largest position + 1).

Prefix key: every image's pad tokens carry the same id, so matching cached rows on token ids
alone would reuse one image's KV rows for another image. `plan_prompt` replaces each image run by
ids derived from the image's digest (bit 31 set: never a vocabulary id); that sequence is what the
engine matches against its RAM cache and the snapshot store, what the cache holds, and what a
snapshot file names and stores. `PromptPlan.reusable` is the one rule, for RAM and disk alike,
that decides how many matched rows may really be reused.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from edge_llm.errors import ImageError
from edge_llm.kvcache import ImageSpan
from edge_llm.vision.preprocess import PreparedImage

KEY_BIT = 0x80000000  # image-row key ids have bit 31 set; vocabulary ids never do


def image_key_ids(digest: bytes, n: int) -> np.ndarray:
    """n distinct-looking u32 ids for an image's rows, derived from its digest (31 bits each)."""
    raw = np.frombuffer(hashlib.shake_256(digest).digest(4 * n), dtype="<u4").astype(np.int64)
    return (raw & 0x7FFFFFFF) | KEY_BIT


def is_image_key(token: int) -> bool:
    return token >= KEY_BIT


@dataclass
class PromptPlan:
    """A prompt's prefix key, image runs and MRoPE positions."""

    keys: list[int]
    spans: list[ImageSpan] = field(default_factory=list)
    images: list[PreparedImage] = field(default_factory=list)  # spans[i] is images[i]'s run
    positions: np.ndarray | None = None  # (3, n) int64; None = text only (position == row)

    @property
    def n(self) -> int:
        return len(self.keys)

    @property
    def image_tokens(self) -> int:
        return sum(s.length for s in self.spans)

    def positions_for(self, a: int, b: int) -> np.ndarray | None:
        """(3, b - a) positions of rows [a, b), or None when they equal the row indices."""
        return None if self.positions is None else self.positions[:, a:b]

    def reusable(self, m: int, cached: Sequence[ImageSpan]) -> int:
        """How many of m matched rows may be reused: never part of an image run, and every image
        run in [0, m) must be the cached one (same rows, grid, positions and full digest)."""
        have = set(cached)
        for s in self.spans:
            if s.start >= m:
                break
            if s.end > m or s not in have:
                return s.start
        return m


def plan_prompt(tokens: Sequence[int], images: Sequence[PreparedImage], image_token_id: int | None
                ) -> PromptPlan:
    """Locate each image's pad run (in order), build the prefix key and the MRoPE positions.

    Raises ImageError when the pad runs do not match the images one to one (e.g. the text itself
    contains image placeholder tokens).
    """
    ids = np.asarray(tokens, dtype=np.int64)
    if image_token_id is None:
        if images:
            raise ImageError("this model has no vision encoder")
        return PromptPlan(ids.tolist())
    pad = ids == image_token_id
    starts = np.flatnonzero(pad & ~np.concatenate([[False], pad[:-1]]))
    ends = np.flatnonzero(pad & ~np.concatenate([pad[1:], [False]])) + 1
    if len(starts) != len(images):
        raise ImageError(f"the prompt has {len(starts)} image placeholder run(s) for {len(images)} "
                         f"image(s) (image placeholder tokens in the text are not allowed)")
    if not images:
        return PromptPlan(ids.tolist())
    keys = ids.copy()
    pos = np.empty((3, ids.size), dtype=np.int64)
    spans: list[ImageSpan] = []
    cur, row = 0, 0  # next text position, next row to place
    for img, a, b in zip(images, starts, ends):
        if b - a != img.n_tokens:
            raise ImageError(f"image {len(spans) + 1} needs {img.n_tokens} placeholder tokens, the "
                             f"prompt has a run of {b - a}")
        pos[:, row:a] = np.arange(cur, cur + a - row)  # text before the image
        cur += a - row
        t, h, w = img.llm_grid
        ti, hi, wi = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
        pos[:, a:b] = cur + np.stack([ti.ravel(), hi.ravel(), wi.ravel()])
        span = ImageSpan(int(a), (t, h, w), cur, img.digest)
        keys[a:b] = image_key_ids(img.digest, span.length)
        spans.append(span)
        cur, row = span.next_pos, int(b)
    pos[:, row:] = np.arange(cur, cur + ids.size - row)
    return PromptPlan(keys.tolist(), spans, list(images), pos)


def expand_placeholders(tokens: Sequence[int], images: Sequence[PreparedImage], image_token_id: int
                        ) -> list[int]:
    """Replace the i-th single image placeholder (as a chat template renders it) by images[i]'s
    n_tokens pads, as the reference processor does before tokenisation."""
    ids = list(tokens)
    at = [i for i, t in enumerate(ids) if t == image_token_id]
    if len(at) != len(images):
        raise ImageError(f"the prompt has {len(at)} image placeholder(s) for {len(images)} image(s) "
                         f"(image placeholder tokens in the text are not allowed)")
    out: list[int] = []
    prev = 0
    for i, img in zip(at, images):
        out += ids[prev:i] + [image_token_id] * img.n_tokens
        prev = i + 1
    return out + ids[prev:]
