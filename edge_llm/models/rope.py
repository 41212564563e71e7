"""Rotary position embeddings: 1-D RoPE (default / linear / llama3 scaling) and interleaved MRoPE.

Layout follows HF ("rotate half"): frequency i rotates dims i and i + head_dim/2. Angles are
computed in float32 exactly as HF does (position as float32 times float32 inverse frequency).
"""

from __future__ import annotations

import math

import numpy as np

from edge_llm.config import ModelArgs


def inv_freq(args: ModelArgs) -> np.ndarray:
    """Inverse frequencies (head_dim/2,) float32 after the config's rope scaling."""
    d = args.head_dim
    # HF: 1 / base ** (arange(0, d, 2).float() / d), in float32
    exponent = np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / np.float32(d)
    freq = (np.float32(1.0) / np.power(np.float32(args.rope_theta), exponent)).astype(np.float32)
    if args.rope_type == "linear":
        freq = freq / np.float32(args.rope_param("factor"))
    elif args.rope_type == "llama3":
        freq = _llama3_scale(freq, args)
    return freq.astype(np.float32)


def _llama3_scale(freq: np.ndarray, args: ModelArgs) -> np.ndarray:
    """Llama 3.1 frequency-dependent scaling (same formula as HF `_compute_llama3_parameters`)."""
    factor = args.rope_param("factor")
    low = args.rope_param("low_freq_factor", 1.0)
    high = args.rope_param("high_freq_factor", 4.0)
    old_len = args.rope_param("original_max_position_embeddings", 8192.0)
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = np.float32(2 * math.pi) / freq
    scaled = np.where(wavelen > low_wavelen, freq / np.float32(factor), freq).astype(np.float32)
    smooth = ((old_len / wavelen - low) / (high - low)).astype(np.float32)
    smoothed = ((1 - smooth) * scaled / np.float32(factor) + smooth * scaled).astype(np.float32)
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def mrope_selector(section: tuple[int, ...], half: int) -> np.ndarray:
    """For each frequency index, which position axis (0=t, 1=h, 2=w) drives it.

    Interleaved layout (Qwen3-VL): index i uses h if i % 3 == 1 and i < 3*section[1], w if
    i % 3 == 2 and i < 3*section[2], otherwise t.
    """
    sel = np.zeros(half, dtype=np.intp)
    idx = np.arange(half)
    for axis in (1, 2):
        sel[(idx % 3 == axis) & (idx < 3 * section[axis])] = axis
    return sel


class Rope:
    """Precomputed frequencies for one model; `cos_sin(positions)` gives (T, head_dim) tables."""

    def __init__(self, args: ModelArgs):
        self.inv_freq = inv_freq(args)
        self.half = args.head_dim // 2
        self.mrope = args.model_type == "qwen3_vl"
        # HF's Qwen3-VL text model always uses the interleaved layout
        self.selector = mrope_selector(args.mrope_section, self.half) if self.mrope else None

    def positions(self, start: int, n: int) -> np.ndarray:
        """Text positions start..start+n-1: (3, n) for MRoPE (t = h = w), else (n,)."""
        pos = np.arange(start, start + n, dtype=np.int64)
        return np.broadcast_to(pos, (3, n)) if self.mrope else pos

    def cos_sin(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """cos, sin tables (T, head_dim) float32 for positions (T,) or (3, T) (MRoPE t/h/w)."""
        pos = np.asarray(positions)
        if self.mrope:
            if pos.ndim == 1:
                pos = np.broadcast_to(pos, (3, pos.shape[0]))
            freqs3 = pos.astype(np.float32)[..., None] * self.inv_freq  # (3, T, half)
            # frequency i takes its angle from axis selector[i]: freqs3[selector[i], :, i]
            freqs = freqs3[self.selector, :, np.arange(self.half)].T  # (T, half)
        else:
            freqs = pos.astype(np.float32)[:, None] * self.inv_freq  # (T, half)
        emb = np.concatenate([freqs, freqs], axis=-1)
        return np.cos(emb), np.sin(emb)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate x (T, heads, head_dim) by tables (T, head_dim): x*cos + rotate_half(x)*sin."""
    half = x.shape[-1] // 2
    c, s = cos[:, None, :], sin[:, None, :]
    out = x * c
    # rotate_half(x) = concat(-x2, x1): write both halves without building it
    out[..., :half] -= x[..., half:] * s[..., :half]
    out[..., half:] += x[..., :half] * s[..., half:]
    return out
