"""What int8 graphs leave to the CPU: the RMSNorms and the per-channel scales around them.

The norms-on-the-CPU partition (`schema.py`: `qkv_n`, `o`, `mlp`, `head_n`; docs/npu.md, "w8a8")
feeds the NPU only rows whose range is set by the model's weights, never the residual stream. A
w8a8 graph quantizes its input with one static scale per tensor, and the residual stream of a
real checkpoint carries massive activations (about 24,900 in one channel of SmolLM2-135M's first
row): a scale that holds them rounds every ordinary row to zero. Per layer l, in float32:

    xn   = RMSNorm(x, in_gain[l])        -> qkv_n(l)   (gain = norm weight / input smoothing)
    qkv  = qkv_n(l)(xn) * qkv_scale[l]                 (q, k and v share one output tensor)
    o    = o(l)(attn * attn_scale[l])                  (attn_scale = 1 / smoothing of attn)
    h    = x + o
    hn   = RMSNorm(h, post_gain[l])      -> mlp(l)
    out  = h + mlp(l)(hn) * out_scale[l]               (out_scale: the output channels' range)
    logits = head_n(RMSNorm(x, final_gain))

With `--w8a8-rotation hadamard` the residual stream lives in a rotated basis x R (R orthogonal,
`rotation`): the embeddings and image rows are rotated on their way in (`GraphBackend.embed`,
`residual`), the norm gains and R^T go into the weights of qkv_n, mlp's gate/up and head_n (the
CPU's gains are then the smoothing alone), and o's and mlp's output columns are rotated. RMSNorm
commutes with R, so nothing else on the CPU changes; q, k, v and the logits are the model's own.

The `*_scale` outputs divide each output channel by its range over the median range (one static
int8 scale per output tensor otherwise follows its widest channels). The graphs hold the weights multiplied by the matching factors (SmoothQuant-style migration of
activation outliers into per-channel weight scales, exact in real arithmetic), so the CPU side and
the graphs are made together by the converter (`convert/w8a8.py`) and stored together
(`cpu_side.npz` beside `manifest.json`, its digest in the manifest identity).
"""

from __future__ import annotations

import hashlib
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edge_llm.errors import ConfigError

FILE = "cpu_side.npz"
_FIELDS = ("in_gain", "qkv_scale", "attn_scale", "post_gain", "out_scale")


@dataclass
class CpuSide:
    """Per-layer float32 vectors (lists indexed by layer) and the final norm's gain."""

    in_gain: list[np.ndarray]  # (hidden,)
    qkv_scale: list[np.ndarray]  # (q_dim + 2 kv_dim,)
    attn_scale: list[np.ndarray]  # (q_dim,)
    post_gain: list[np.ndarray]  # (hidden,)
    out_scale: list[np.ndarray]  # (hidden,)
    final_gain: np.ndarray  # (hidden,)
    rotation: np.ndarray | None = None  # (hidden, hidden) orthogonal: the residual basis, or None

    def save(self, root: Path) -> str:
        arrays = {f"{k}.{i:02d}": np.asarray(v, np.float32) for k in _FIELDS for i, v in enumerate(getattr(self, k))}
        arrays["final_gain"] = np.asarray(self.final_gain, np.float32)
        if self.rotation is not None:
            arrays["rotation"] = np.asarray(self.rotation, np.float32)
        np.savez(root / FILE, **arrays)
        return digest(root)

    @classmethod
    def load(cls, root: Path, layers: int, sha256: str | None = None) -> "CpuSide":
        """The CPU side of a w8a8 directory; `sha256`: the manifest's `cpu_side_sha256`, checked first."""
        if sha256 is not None:
            try:
                actual = digest(root)
            except OSError as e:
                raise ConfigError(f"{root / FILE}: unreadable ({e}): re-run "
                                  "`edge-llm convert rknn --dtype w8a8`") from None
            if actual != sha256:
                raise ConfigError(f"{root / FILE}: sha256 {actual[:16]}... is not the manifest.json's cpu_side_sha256 "
                                  f"{sha256[:16]}...: changed, truncated or replaced after the conversion wrote it; "
                                  "re-run `edge-llm convert rknn --dtype w8a8`")
        try:
            with np.load(root / FILE) as z:
                fields = {k: [np.array(z[f"{k}.{i:02d}"], np.float32) for i in range(layers)] for k in _FIELDS}
                rot = np.array(z["rotation"], np.float32) if "rotation" in z.files else None
                return cls(**fields, final_gain=np.array(z["final_gain"], np.float32), rotation=rot)
        except (OSError, KeyError, ValueError, zipfile.BadZipFile) as e:
            raise ConfigError(f"{root / FILE}: unreadable ({e}): re-run `edge-llm convert rknn --dtype w8a8`") from None


def digest(root: Path) -> str:
    return hashlib.sha256((root / FILE).read_bytes()).hexdigest()
