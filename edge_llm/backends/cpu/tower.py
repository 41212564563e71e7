"""CPU vision backend: the Qwen3-VL encoder's dense work in numpy float32 (BLAS sgemm).

The projection matrices stay in the checkpoint file (mmap, `weights.MappedMatrix`) and are
widened to float32 when a block runs; every projection is `x @ W.T + b` with BLAS reading the
transposed operand in place. So the tower holds no anonymous memory between images (1.5 GiB as
F32 for Qwen3-VL-2B) for a few percent of an image's encode time (docs/vision.md). LayerNorm
and both GELU forms follow torch's float32 definitions; erf has no numpy ufunc, so the exact GELU
of the mergers uses a rational approximation evaluated in float64 (relative error < 1.2e-7,
below float32 rounding).
"""

from __future__ import annotations

import numpy as np

from edge_llm.backends.cpu.backend import cpu_numerics
from edge_llm.config import VisionArgs
from edge_llm.weights import Weights

LN_EPS = np.float32(1e-6)


def layer_norm(x: np.ndarray, w: np.ndarray, b: np.ndarray) -> np.ndarray:
    """torch.nn.LayerNorm(eps=1e-6) over the last axis, float32."""
    mean = x.mean(axis=-1, keepdims=True)
    d = x - mean
    var = np.mean(np.square(d), axis=-1, keepdims=True)
    return d * (np.float32(1.0) / np.sqrt(var + LN_EPS)) * w + b


def _erf(x: np.ndarray) -> np.ndarray:
    """erf in float64 (Numerical Recipes' erfc Chebyshev fit, fractional error < 1.2e-7)."""
    z = np.abs(x.astype(np.float64))
    t = 1.0 / (1.0 + 0.5 * z)
    poly = -z * z - 1.26551223 + t * (1.00002368 + t * (0.37409196 + t * (0.09678418 + t * (
        -0.18628806 + t * (0.27886807 + t * (-1.13520398 + t * (1.48851587 + t * (
            -0.82215223 + t * 0.17087277))))))))
    erfc = t * np.exp(poly)
    return np.where(x >= 0, 1.0 - erfc, erfc - 1.0)


def gelu_erf(x: np.ndarray) -> np.ndarray:
    """torch.nn.GELU() (exact form): 0.5 x (1 + erf(x / sqrt 2))."""
    return (0.5 * x * (1.0 + _erf(x / np.sqrt(2.0)))).astype(np.float32)


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """gelu_pytorch_tanh: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), in two temporaries."""
    t = np.square(x)
    t *= np.float32(0.044715)
    t += np.float32(1.0)
    t *= x
    t *= np.float32(np.sqrt(2.0 / np.pi))
    np.tanh(t, out=t)
    t += np.float32(1.0)
    t *= x
    t *= np.float32(0.5)
    return t


ACTIVATIONS = {"gelu_pytorch_tanh": gelu_tanh, "gelu": gelu_erf}


class _Block:
    __slots__ = ("n1w", "n1b", "w_qkv", "b_qkv", "w_proj", "b_proj", "n2w", "n2b", "w1", "b1", "w2", "b2")


class _Merger:
    __slots__ = ("nw", "nb", "post", "w1", "b1", "w2", "b2")


class CPUVisionBackend:
    """Dense vision-tower work in numpy float32 (see `edge_llm.backends.tower.seam.VisionBackend`)."""

    name = "cpu"

    @property
    def numerics(self) -> str:
        return cpu_numerics()

    def load_vision(self, args: VisionArgs, weights: Weights) -> None:
        p = args.weight_prefix
        self.args, self.act = args, ACTIVATIONS[args.hidden_act]
        pw = weights.pop(f"{p}patch_embed.proj.weight")  # (hidden, C, T, P, P)
        self.w_patch = np.ascontiguousarray(pw.reshape(pw.shape[0], -1).T)  # (patch_dim, hidden)
        self.b_patch = weights.pop(f"{p}patch_embed.proj.bias")
        self.blocks: list[_Block] = []
        for i in range(args.depth):
            bp, B = f"{p}blocks.{i}.", _Block()
            B.n1w, B.n1b = weights.pop(f"{bp}norm1.weight"), weights.pop(f"{bp}norm1.bias")
            B.n2w, B.n2b = weights.pop(f"{bp}norm2.weight"), weights.pop(f"{bp}norm2.bias")
            B.w_qkv, B.b_qkv = weights.pop_matrix(f"{bp}attn.qkv.weight"), weights.pop(f"{bp}attn.qkv.bias")
            B.w_proj, B.b_proj = weights.pop_matrix(f"{bp}attn.proj.weight"), weights.pop(f"{bp}attn.proj.bias")
            B.w1, B.b1 = weights.pop_matrix(f"{bp}mlp.linear_fc1.weight"), weights.pop(f"{bp}mlp.linear_fc1.bias")
            B.w2, B.b2 = weights.pop_matrix(f"{bp}mlp.linear_fc2.weight"), weights.pop(f"{bp}mlp.linear_fc2.bias")
            self.blocks.append(B)
        prefixes = [f"{p}merger."] + [f"{p}deepstack_merger_list.{j}."
                                      for j in range(len(args.deepstack_visual_indexes))]
        self.mergers: list[_Merger] = []
        for j, mp in enumerate(prefixes):
            M = _Merger()
            M.post = j > 0  # DeepStack mergers normalise the 2x2 group, the final one each patch
            M.nw, M.nb = weights.pop(f"{mp}norm.weight"), weights.pop(f"{mp}norm.bias")
            M.w1, M.b1 = weights.pop_matrix(f"{mp}linear_fc1.weight"), weights.pop(f"{mp}linear_fc1.bias")
            M.w2, M.b2 = weights.pop_matrix(f"{mp}linear_fc2.weight"), weights.pop(f"{mp}linear_fc2.bias")
            self.mergers.append(M)

    @property
    def nbytes(self) -> int:
        """Bytes held in RAM (the mapped matrices are file pages, not counted)."""
        arrays = [self.w_patch, self.b_patch]
        arrays += [getattr(B, s) for B in self.blocks for s in _Block.__slots__]
        arrays += [getattr(M, s) for M in self.mergers for s in _Merger.__slots__ if s != "post"]
        return sum(a.nbytes for a in arrays if isinstance(a, np.ndarray))

    def vis_patch_embed(self, pixels: np.ndarray) -> np.ndarray:
        out = pixels @ self.w_patch
        out += self.b_patch
        return out

    def vis_qkv(self, block: int, x: np.ndarray) -> np.ndarray:
        B = self.blocks[block]
        out = layer_norm(x, B.n1w, B.n1b) @ B.w_qkv.t()
        out += B.b_qkv
        return out

    def vis_attn_out(self, block: int, attn: np.ndarray, x: np.ndarray) -> np.ndarray:
        B = self.blocks[block]
        out = attn @ B.w_proj.t()
        out += B.b_proj
        out += x
        return out

    def vis_mlp(self, block: int, x: np.ndarray) -> np.ndarray:
        B = self.blocks[block]
        h = layer_norm(x, B.n2w, B.n2b) @ B.w1.t()
        h += B.b1
        out = self.act(h) @ B.w2.t()
        out += B.b2
        out += x
        return out

    def vis_merge(self, which: int, x: np.ndarray) -> np.ndarray:
        M, width = self.mergers[which], self.args.merged_dim
        if M.post:
            g = layer_norm(x.reshape(-1, width), M.nw, M.nb)
        else:
            g = layer_norm(x, M.nw, M.nb).reshape(-1, width)
        h = g @ M.w1.t()
        h += M.b1
        out = gelu_erf(h) @ M.w2.t()
        out += M.b2
        return out
