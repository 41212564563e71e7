"""What the engine and the server use of the vision package: load the tower next to the decoder,
turn bytes into `PreparedImage`s, plan a prompt (prefix key + positions), and produce the decoder's
image inputs for a range of rows, encoding only the images that range touches."""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np

from edge_llm.backends.tower.seam import VisionBackend, get_vision_backend
from edge_llm.backends.tower.graph import TowerGraph
from edge_llm.config import ModelArgs, VisionArgs, vision_args_from_dir
from edge_llm.errors import ConfigError
from edge_llm.models.qwen3 import VisualRows
from edge_llm.progress import NO_WORK, Work
from edge_llm.safetext import printable
from edge_llm.vision.encoder import ImageFeatures, VisionEncoder
from edge_llm.vision.positions import PromptPlan, expand_placeholders, plan_prompt
from edge_llm.vision.preprocess import (
    ImageHeader,
    ImageLimits,
    PreparedImage,
    PreprocessConfig,
    prepare_image,
    read_header,
)
from edge_llm.weights import load_vision_weights

log = logging.getLogger(__name__)


def fit_to_graph(pre: PreprocessConfig, rows: tuple[int, ...]) -> PreprocessConfig:
    """The grid rule of a tower graph with static shapes `rows` (the NPU): the resize rule's pixel
    budget becomes the largest shape's patches, so every image is resized (aspect ratio kept,
    never cropped) onto at most that many patches, then padded up to the smallest shape that
    holds it (docs/vision.md, "Grids on the NPU"). Preprocessing, the image digest (the config
    is in the tag) and so the prefix keys all follow this one rule."""
    if not rows:
        return pre
    budget = max(rows) * pre.patch_size ** 2
    if budget >= pre.max_pixels:
        return pre
    if budget < pre.min_pixels:
        raise ConfigError(f"the tower graph's largest shape ({max(rows)} patches) is below the "
                          f"preprocessor's min_pixels {pre.min_pixels}: convert with a larger --vision-grids")
    log.info("vision: images are resized to at most %d pixels (%d patches, the tower graph's largest shape)",
             budget, max(rows))
    return replace(pre, max_pixels=budget)


class VisionModel:
    """A loaded Qwen3-VL vision tower with its preprocessing configuration."""

    def __init__(self, args: VisionArgs, encoder: VisionEncoder, pre: PreprocessConfig,
                 limits: ImageLimits = ImageLimits()):
        self.args, self.encoder, self.pre, self.limits = args, encoder, pre, limits
        # the encoder configuration enters every image digest: a changed preprocessing or tower
        # configuration gives new image keys, so old image rows are never matched
        # and so does the tower's path (numpy, onnxruntime, NPU: their rows differ in the last bits)
        self.tag = hashlib.sha256(json.dumps({"vision": asdict(args), "pre": asdict(pre),
                                              "tower": encoder.numerics},
                                             sort_keys=True, default=list).encode()).digest()

    @classmethod
    def load(cls, model_dir: str | Path, text: ModelArgs, backend: str | VisionBackend = "cpu",
             limits: ImageLimits = ImageLimits(), graph: TowerGraph | None = None) -> "VisionModel | None":
        """The tower of a qwen3_vl checkpoint; None when the model has no vision weights.
        `graph`: the tower as one graph (onnxruntime or the NPU), for the images it holds."""
        args = vision_args_from_dir(model_dir)
        if args is None:
            return None
        if args.out_hidden_size != text.hidden_size:
            raise ConfigError(f"config.json: vision out_hidden_size {args.out_hidden_size} != text "
                              f"hidden_size {text.hidden_size}")
        weights = load_vision_weights(model_dir, text, args)
        if weights is None:
            log.info("%s declares a vision tower but has no vision weights: text only", printable(model_dir))
            return None
        be = get_vision_backend(backend) if isinstance(backend, str) else backend
        encoder = VisionEncoder.from_weights(args, weights, be, graph)
        pre = fit_to_graph(PreprocessConfig.from_dir(model_dir, args), graph.rows if graph else ())
        log.info("loaded vision tower: %d blocks, hidden %d, patch %d, deepstack %s, backend %s%s",
                 args.depth, args.hidden_size, args.patch_size, list(args.deepstack_visual_indexes), be.name,
                 f" + one graph ({graph.runner.name})" if graph is not None else "")
        return cls(args, encoder, pre, limits)

    def header(self, data: bytes) -> ImageHeader:
        """Image bytes -> format, size and token count, from the header alone (no pixel decoded;
        raises the same ImageError subclasses as `prepare` for the limits it checks)."""
        return read_header(data, self.pre, self.limits)

    def prepare(self, data: bytes) -> PreparedImage:
        """Image bytes -> PreparedImage (raises an ImageError subclass naming the problem)."""
        return prepare_image(data, self.pre, self.limits, self.tag)

    def placeholder(self, id_to_token: Callable[[int], str | None]) -> str:
        """The text a chat template renders for one image: <|vision_start|><|image_pad|><|vision_end|>."""
        ids = (self.args.vision_start_token_id, self.args.image_token_id, self.args.vision_end_token_id)
        names = [id_to_token(i) for i in ids]
        if any(n is None for n in names):
            raise ConfigError(f"the tokenizer has no tokens for the image ids {ids}")
        return "".join(names)  # type: ignore[arg-type]

    def expand(self, tokens: Sequence[int], images: Sequence[PreparedImage]) -> list[int]:
        """One placeholder per image -> each image's run of pad tokens (its token count)."""
        return expand_placeholders(tokens, images, self.args.image_token_id)

    def plan(self, tokens: Sequence[int], images: Sequence[PreparedImage]) -> PromptPlan:
        return plan_prompt(tokens, images, self.args.image_token_id)

    def encode(self, image: PreparedImage, work: Work = NO_WORK) -> ImageFeatures:
        return self.encoder.encode(image.pixel_values, image.grid_thw, work)

    def visual_rows(self, plan: PromptPlan, a: int, b: int,
                    work: Work = NO_WORK) -> tuple[VisualRows | None, float, int]:
        """Decoder image inputs for rows [a, b) of the plan (offsets relative to a): encodes each
        image whose run intersects the range, reporting each tower block to `work` (which may
        cancel). Returns (rows or None, encoder ms, images encoded)."""
        rows, embeds, deep = [], [], []
        t0, n = time.perf_counter(), 0
        for span, img in zip(plan.spans, plan.images):
            lo, hi = max(a, span.start), min(b, span.end)
            if lo >= hi:
                continue
            feats = self.encode(img, work)
            n += 1
            sl = slice(lo - span.start, hi - span.start)
            rows.append(np.arange(lo, hi) - a)
            embeds.append(feats.embeds[sl])
            deep.append([d[sl] for d in feats.deepstack])
        ms = (time.perf_counter() - t0) * 1e3
        if not rows:
            return None, 0.0, 0
        layers = len(self.args.deepstack_visual_indexes)
        vis = VisualRows(np.concatenate(rows), np.concatenate(embeds),
                         [np.concatenate([d[i] for d in deep]) for i in range(layers)])
        return vis, ms, n
