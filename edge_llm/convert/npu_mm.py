"""`edge-llm convert npu-mm`: int8 weights for the matmul path, numpy only (docs/npu.md, "The matmul path").

No rknn-toolkit2: per-channel symmetric int8 weights (`int8.quantize_weight`, rounded by GPTQ on
the built-in calibration text: `convert/gptq.py`) of the fused linears (q/k/v, o, gate/up, down,
head), their scales, and the rotations folded in:

- `rotation="hadamard"`: the residual stream in the basis x R, R the randomized Hadamard matrix of
  `convert/w8a8.py` (QuaRot): R^T and the norm gain fold into the weights that read a normalized
  row (qkv, gate/up, head), R into those that write the stream (o, down). Without it the gains
  fold into those weights alone.
- `down_rotation="hadamard"`: down_proj's input (SwiGLU's output) times a Hadamard matrix H on
  the CPU at run time (`row_ops.fwht`: Sylvester butterflies times a small Paley block), H^T folded
  into W_down: its outlier channels are spread before the row's int8 scale is taken.
- `vo_rotation="hadamard"`: each attention head's value columns times an orthonormal Hadamard
  matrix G (W_v G, b_v G) and W_o's rows of every query head times G^T: attention is linear in
  the values, so each head's output comes out times G and o's input row is spread before its
  int8 scale is taken, at no run-time cost (the cache holds the rotated values).
- `clip="mse"`: each output channel's scale from the clip ratio of its absmax (0.80 .. 1.00) with
  the least squared weight error, instead of the absmax itself.

Writes OUT_DIR/weights.npz (`layer.L.{qkv,o,gu,down}.{w,s}`, `layer.L.qkv.b` for a model with
q/k/v biases, `head.{w,s}`, `rotation` (and its factors `rotation_block`, `rotation_scale`
when it is a Hadamard matrix), `down_block`) and OUT_DIR/manifest.json (`decoder.MmManifest`),
published whole: both written into a new directory beside OUT_DIR, fsynced, and renamed over it
(`files.publish_dir`; docs/npu.md, "Publication"), so a killed conversion leaves the old OUT_DIR
or none, never a mix.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from edge_llm.backends.cpu.backend import load_layer
from edge_llm.backends.npu.matmul.int8 import ALIGN, MAX_K, quantize_weight
from edge_llm.backends.npu.matmul.decoder import MANIFEST, WEIGHTS, MmManifest, read_doc
from edge_llm.backends.record import RECORD
from edge_llm.config import ModelArgs
from edge_llm.convert.gptq import calibration_ids, capture, gptq
from edge_llm.convert.hadamard import dense_hadamard, hadamard, orthogonal, orthogonal_factors
from edge_llm.errors import ConfigError
from edge_llm.files import atomic_file, publish_dir
from edge_llm.qrecord import record_mm
from edge_llm.settings import (MM_CLIP, MM_CLIPS, MM_DOWN_ROTATION, MM_GPTQ_TOKENS, MM_ROTATION, MM_ROTATIONS,
                               MM_VO_ROTATION)
from edge_llm.weights import load_weights, sha256_file, weight_digest

log = logging.getLogger(__name__)

# the phases `convert_mm8` reports to its `progress(phase, done, total)`, in order: the F32 model's
# run over the GPTQ calibration tokens (its layers), the layers quantized (+1: the head), weights.npz
# written and hashed (2 steps)
CAPTURE, QUANTIZE, WRITE, RECORD_PHASE = "capture", "quantize", "write", "record"
Progress = Callable[[str, int, int], None]
HEAD_COLUMNS = 16384  # the head is rotated and quantized in parts of this many vocab columns (peak RAM)
CLIP_RATIOS = np.round(np.arange(0.80, 1.0001, 0.02), 2).astype(np.float32)


def mse_clip(w: np.ndarray) -> np.ndarray:
    """Per output channel of w (K, N): the ratio in CLIP_RATIOS whose int8 grid has the least
    squared error over the channel (ties: the larger ratio)."""
    best = np.full(w.shape[1], np.inf)
    pick = np.ones(w.shape[1], np.float32)
    for r in CLIP_RATIOS[::-1]:
        q, s = quantize_weight(w, np.full(w.shape[1], r, np.float32))
        err = np.square(q * s[None, :] - w).sum(axis=0, dtype=np.float64)
        better = err < best
        best[better], pick[better] = err[better], r
    return pick


def down_block(n: int, what: str = "down_proj's input", option: str = "--down-rotation") -> np.ndarray:
    """The normalized small factor of the online Hadamard over n columns: n = m * 2^k with the
    smallest m that has a Hadamard matrix here (1 for a power of two, else a Paley order)."""
    for k in range(n.bit_length() - 1, -1, -1):
        m = n >> k
        if m << k == n and (h := hadamard(m)) is not None:
            return (h / np.sqrt(m)).astype(np.float32)
    raise ConfigError(f"no Hadamard construction for {what} width {n}: use {option} none")


def rotate_values(args: ModelArgs, g: np.ndarray, w_qkv: np.ndarray, b_qkv: np.ndarray | None,
                  w_o: np.ndarray) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
    """The V/O rotation (module docstring): W_qkv's value columns and b_v per KV head times g
    (head_dim, head_dim), W_o's rows per query head times g^T."""
    hd, a, K = args.head_dim, args.q_dim + args.kv_dim, w_qkv.shape[0]
    w = np.array(w_qkv, np.float32)
    w[:, a:] = (w[:, a:].reshape(K, -1, hd) @ g).reshape(K, -1)
    b = None if b_qkv is None else np.array(b_qkv, np.float32)
    if b is not None:
        b[a:] = (b[a:].reshape(-1, hd) @ g).reshape(-1)
    o = (g.T @ np.asarray(w_o, np.float32).reshape(-1, hd, w_o.shape[1])).reshape(w_o.shape)
    return w, b, o


def _check_dims(args: ModelArgs) -> None:
    for what, k in (("hidden_size", args.hidden_size), ("q_dim", args.q_dim),
                    ("intermediate_size", args.intermediate_size)):
        if k % ALIGN or k > MAX_K:
            raise ConfigError(f"{what} = {k}: the NPU's int8 matmul needs K a multiple of {ALIGN}, at most {MAX_K}")


def convert_mm8(model_dir: str | Path, out_dir: str | Path, rotation: str = MM_ROTATION,
                down_rotation: str = MM_DOWN_ROTATION, clip: str = MM_CLIP,
                gptq_tokens: int = MM_GPTQ_TOKENS, vo_rotation: str = MM_VO_ROTATION,
                progress: Progress | None = None, record: bool = True) -> MmManifest:
    """Quantize MODEL_DIR's decoder into OUT_DIR (see the module docstring); the manifest.
    `gptq_tokens`: GPTQ on that many calibration tokens (`convert/gptq.py`); 0: round to nearest.
    `progress(phase, done, total)`: CAPTURE layers, QUANTIZE layers + head, WRITE steps, RECORD_PHASE, as each ends.
    `record`: measure the accuracy record (record.json, edge_llm/qrecord.py) before publishing; False
    only for callers that measure nothing with the directory's answers (it is then missing, and
    `backend = auto` does not take the directory)."""
    say = progress or (lambda _phase, _done, _total: None)
    if {rotation, down_rotation, vo_rotation} - set(MM_ROTATIONS) or clip not in MM_CLIPS:
        raise ConfigError(f"rotation, down_rotation, vo_rotation: one of {MM_ROTATIONS}; clip: one of {MM_CLIPS}")
    t0 = time.perf_counter()
    root = Path(out_dir)
    _check_target(root)
    args = ModelArgs.from_dir(model_dir)
    _check_dims(args)
    seen = capture(model_dir, calibration_ids(model_dir, gptq_tokens),
                   lambda done, total: say(CAPTURE, done, total)) if gptq_tokens else {}
    weights = load_weights(model_dir, args)
    n = args.num_hidden_layers
    r = orthogonal(args.hidden_size) if rotation == "hadamard" else None
    block = down_block(args.intermediate_size) if down_rotation == "hadamard" else None
    h_down = dense_hadamard(block, args.intermediate_size).astype(np.float32) if block is not None else None
    g = None  # the V/O rotation's matrix: Sylvester's for a power of two, as the online Hadamard's
    if vo_rotation == "hadamard":
        g = dense_hadamard(down_block(args.head_dim, "head_dim", "--vo-rotation"), args.head_dim).astype(np.float32)
    out: dict[str, np.ndarray] = {}

    def quantize(w: np.ndarray, x: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """`x`: the real rows this weight reads (in its basis), for GPTQ."""
        q, s = quantize_weight(w, mse_clip(w) if clip == "mse" else None)
        return (q if x is None else gptq(w, x, s)), s

    def put(name: str, w: np.ndarray, x: np.ndarray | None = None) -> None:
        out[f"{name}.w"], out[f"{name}.s"] = quantize(w, x)

    def rows(layer: int, kind: str, basis: np.ndarray | None = None) -> np.ndarray | None:
        x = seen.pop((layer, kind), None)
        return x if x is None or basis is None else x @ basis

    def reads(w: np.ndarray, gain: np.ndarray) -> np.ndarray:  # a weight reading a normalized row
        w = gain[:, None] * w
        return w if r is None else r.T @ w

    def writes(w: np.ndarray) -> np.ndarray:  # a weight writing the residual stream
        return w if r is None else w @ r

    p = args.weight_prefix
    for i in range(n):
        L = load_layer(args, weights, i)
        w_qkv, b_qkv, w_o, x_o = L.w_qkv, L.b_qkv, L.w_o, rows(i, "o")
        if g is not None:
            w_qkv, b_qkv, w_o = rotate_values(args, g, w_qkv, b_qkv, w_o)
            x_o = None if x_o is None else (x_o.reshape(len(x_o), -1, args.head_dim) @ g).reshape(x_o.shape)
        put(f"layer.{i}.qkv", reads(w_qkv, L.in_norm), rows(i, "qkv", r))
        if b_qkv is not None:
            out[f"layer.{i}.qkv.b"] = b_qkv.astype(np.float32)
        put(f"layer.{i}.o", writes(w_o), x_o)
        put(f"layer.{i}.gu", reads(L.w_gu, L.post_norm), rows(i, "gu", r))
        down = L.w_down if h_down is None else h_down.T @ L.w_down
        put(f"layer.{i}.down", writes(down), rows(i, "down", h_down))
        del L
        say(QUANTIZE, i + 1, n + 1)
    final = weights.pop(f"{p}norm.weight")
    head = weights.pop(f"{p}embed_tokens.weight" if args.tie_word_embeddings else args.lm_head_name)
    x_head, parts = rows(-1, "head", r), []
    for c in range(0, head.shape[0], HEAD_COLUMNS):  # output channels are independent: a part at a time
        parts.append(quantize(reads(np.ascontiguousarray(head[c:c + HEAD_COLUMNS].T), final), x_head))
    del head
    pad = -args.vocab_size % ALIGN  # zero columns up to a multiple of 32 (the backend drops them)
    zeros = np.zeros((args.hidden_size, pad), np.int8)
    out["head.w"] = np.ascontiguousarray(np.concatenate([q for q, _ in parts] + [zeros], axis=1))
    out["head.s"] = np.concatenate([sc for _, sc in parts] + [np.ones(pad, np.float32)])
    del parts
    if r is not None:
        out["rotation"] = r  # the dense matrix: what the numpy path multiplies by, and the fallback
        if (factors := orthogonal_factors(args.hidden_size)) is not None:  # the C ops' fast transform
            out["rotation_block"], out["rotation_scale"] = factors
    if block is not None:
        out["down_block"] = block
    say(QUANTIZE, n + 1, n + 1)
    source = {"name": Path(model_dir).resolve().name, "model_type": args.model_type,
              "weights_sha256": weight_digest(model_dir), "config": json.loads(json.dumps(args.identity_fields()))}

    def build(tmp: Path) -> MmManifest:  # the new directory beside the target; files.publish_dir renames it in
        with atomic_file(tmp / WEIGHTS) as f:  # fsynced, and the directory after its rename
            np.savez(f, **out)
        say(WRITE, 1, 2)
        m = MmManifest(model=source, layers=n, rotation=rotation, down_rotation=down_rotation, clip=clip,
                       gptq_tokens=gptq_tokens, vo_rotation=vo_rotation, weights_sha256=sha256_file(tmp / WEIGHTS))
        m.build = {"seconds": round(time.perf_counter() - t0, 2),
                   "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
                   "bytes": (tmp / WEIGHTS).stat().st_size}
        m.write(tmp)  # write_atomic: fsynced, with the directory
        if record:  # measured on the new directory, published with it (docs/npu.md, "Accuracy record")
            say(RECORD_PHASE, 0, 1)
            record_mm(model_dir, tmp)
            say(RECORD_PHASE, 1, 1)
        return m

    m = publish_dir(root, build, lambda _target: None)
    say(WRITE, 2, 2)
    log.info("npu-mm: %d layers -> %s in %.1f s", n, root, m.build["seconds"])
    return m


OWN_FILES = (MANIFEST, WEIGHTS, RECORD, f".{WEIGHTS}.tmp")  # the last: an older converter's temp file


def _check_target(root: Path) -> None:
    """OUT_DIR may be absent, empty or an earlier npu-mm conversion: publishing replaces the whole
    directory, so one holding anything else is refused before any work."""
    if not root.exists():
        return
    if not root.is_dir():
        raise ConfigError(f"{root} is not a directory: choose a directory (it is replaced as a whole)")
    if (root / MANIFEST).exists() and read_doc(root / MANIFEST).get("format") != MmManifest.format:
        raise ConfigError(f"{root} holds another conversion (its {MANIFEST} is not an npu-mm one): choose "
                          "an empty directory")
    other = sorted(set(os.listdir(root)) - set(OWN_FILES))
    if other:
        raise ConfigError(f"{root} holds {len(other)} file(s) that are not an npu-mm conversion's ({other[0]}, ...): "
                          "the directory is replaced as a whole; choose an empty directory or move them")
