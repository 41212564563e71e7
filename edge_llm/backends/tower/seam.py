"""The vision tower's side of the backend seam: the dense per-block work of the Qwen3-VL encoder.

Same contract as `Backend` (float32, C-contiguous, rows = patches, deterministic for identical
input shapes). The encoder (`edge_llm.vision.encoder`) keeps what touches positions: the learned
position-embedding resampling, the 2-D rotary embedding and attention within each image. An NPU
backend can take these calls over one by one; the method names do not collide with `Backend`'s,
so one object may implement both.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np

from edge_llm.config import VisionArgs
from edge_llm.errors import ConfigError
from edge_llm.weights import Weights


@runtime_checkable
class VisionBackend(Protocol):
    name: str
    numerics: str

    def load_vision(self, args: VisionArgs, weights: Weights) -> None:
        """Take the tower's dense tensors out of `weights` (pop them)."""

    def vis_patch_embed(self, pixels: np.ndarray) -> np.ndarray:
        """(N, patch_dim) flattened patches -> (N, hidden): the Conv3d with stride == kernel."""

    def vis_qkv(self, block: int, x: np.ndarray) -> np.ndarray:
        """LayerNorm1 + fused qkv projection: (N, hidden) -> (N, 3 * hidden) as [q | k | v]."""

    def vis_attn_out(self, block: int, attn: np.ndarray, x: np.ndarray) -> np.ndarray:
        """Residual + output projection: x + attn @ Wproj + b."""

    def vis_mlp(self, block: int, x: np.ndarray) -> np.ndarray:
        """Residual + LayerNorm2 + fc1 + activation + fc2."""

    def vis_merge(self, which: int, x: np.ndarray) -> np.ndarray:
        """Patch merger `which` (0 = the final merger, 1.. = DeepStack mergers in config order):
        (N, hidden) in merge-block order -> (N / merge^2, out_hidden)."""


def get_vision_backend(name: str) -> VisionBackend:
    """Instantiate the vision side of a backend by name ("cpu")."""
    if name == "cpu":
        from edge_llm.backends.cpu.tower import CPUVisionBackend

        return CPUVisionBackend()
    raise ConfigError(f"vision backend {name!r} is not available (available: cpu)")
