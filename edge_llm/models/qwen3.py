"""The numpy decoder for qwen3_vl (text), qwen3, qwen2 and llama checkpoints.

Dense work (norms, projections, MLP, lm_head) runs in a backend; this module owns what touches
positions and KV rows: per-head q/k RMSNorm, RoPE / MRoPE, and GQA attention over the F32 rows of
`KVCache`. A backend with a `row_step` (cpu-q) runs one-row forwards after the first row, and
decode forwards of a few rows (speculative verify), whole, reading the cache rows in place; the
model still writes every KV row (`KVCache.write`). Given
the same tokens, the same cached rows and the same chunk shape, the logits are bitwise identical
(no reduction depends on thread timing).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edge_llm.backends import Backend, RowStep, get_backend, pick_chunk
from edge_llm.backends.cpu.backend import rms_norm
from edge_llm.config import ModelArgs
from edge_llm.errors import KVCacheError
from edge_llm.kvcache import KVCache
from edge_llm.models.rope import Rope, apply_rope
from edge_llm.progress import NO_WORK, PREFILL, Work
from edge_llm.settings import DEFAULTS
from edge_llm.weights import load_weights

log = logging.getLogger(__name__)


@dataclass
class VisualRows:
    """Image inputs of a run of rows (Qwen3-VL): which rows are image tokens, the vision
    encoder's embeddings that replace their token embeddings, and the DeepStack features added to
    their hidden states after decoder layers 0, 1, ... (as transformers' Qwen3VLTextModel)."""

    rows: np.ndarray  # (n,) row offsets within the run, ascending
    embeds: np.ndarray  # (n, hidden)
    deepstack: list[np.ndarray]  # each (n, hidden)

    def slice(self, a: int, b: int) -> "VisualRows | None":
        """The part for rows [a, b) of the run, offsets relative to a; None if no image row."""
        lo, hi = np.searchsorted(self.rows, [a, b])
        if lo == hi:
            return None
        return VisualRows(self.rows[lo:hi] - a, self.embeds[lo:hi], [d[lo:hi] for d in self.deepstack])


def attention(q: np.ndarray, keys: np.ndarray, values: np.ndarray, start: int,
              n_kv: int) -> np.ndarray:
    """Causal GQA attention of T new queries over S = start + T cached rows.

    q: (T, H, D) already rotated and scaled; keys/values: (S, n_kv*D) cache rows.
    Query head h uses kv head h // (H / n_kv), as HF's repeat_kv. Returns (T, H*D).
    """
    T, H, D = q.shape
    S, rep = keys.shape[0], H // n_kv
    qg = q.reshape(T, n_kv, rep, D).transpose(1, 2, 0, 3).reshape(n_kv, rep * T, D)
    k = keys.reshape(S, n_kv, D).transpose(1, 2, 0)  # (n_kv, D, S), strided view, no copy
    scores = np.matmul(qg, k)  # (n_kv, rep*T, S)
    if T > 1:  # new query i (absolute start+i) must not see new keys j > i
        causal = np.triu(np.full((T, T), -np.inf, dtype=np.float32), k=1)
        scores.reshape(n_kv, rep, T, S)[..., start:] += causal
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    denom = scores.sum(axis=-1, keepdims=True)
    v = values.reshape(S, n_kv, D).transpose(1, 0, 2)  # (n_kv, S, D)
    out = np.matmul(scores, v)  # (n_kv, rep*T, D)
    out /= denom  # normalise the D-wide output instead of the S-wide probabilities: one pass less
    return out.reshape(n_kv, rep, T, D).transpose(2, 0, 1, 3).reshape(T, H * D)


def chunk_bounds(start: int, stop: int, chunk: int) -> list[tuple[int, int]]:
    """Rows [start, stop) cut at the absolute multiples of `chunk`: the first piece may be short
    (it ends at the next multiple), the last one too (it ends at `stop`)."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    edges = [start, *range((start // chunk + 1) * chunk, stop, chunk), stop]
    return list(zip(edges[:-1], edges[1:]))


class Model:
    """A loaded text decoder: `forward` appends KV rows to a cache and returns logits."""

    def __init__(self, args: ModelArgs, backend: Backend, q_norms: list[np.ndarray],
                 k_norms: list[np.ndarray]):
        self.args = args
        self.backend = backend
        self.rope = Rope(args)
        self.q_norms, self.k_norms = q_norms, k_norms
        # folding 1/sqrt(D) into q costs T*H*D multiplies instead of T*H*S
        self.scale = np.float32(1.0 / math.sqrt(args.head_dim))

    @classmethod
    def load(cls, model_dir: str | Path, backend: str | Backend = "cpu",
             progress: Callable[[int, int], None] | None = None) -> "Model":
        """Read config.json, check every tensor's name and shape, then load the weights.

        `backend`: a loaded backend, or "cpu" (the exact reference; `backend = auto` is resolved
        by the runtime, edge_llm/footprint.py, which passes the backend it loaded).
        `progress(done, total)` is called after each tensor is loaded."""
        args = ModelArgs.from_dir(model_dir)
        weights = load_weights(model_dir, args)  # raises WeightsError before anything is read
        weights.progress = progress
        be = get_backend(backend) if isinstance(backend, str) else backend
        be.load(args, weights)  # first: a backend's row step may read the q/k norm gains (backends/npu/matmul/row_step.py)
        q_norms: list[np.ndarray] = []
        k_norms: list[np.ndarray] = []
        if args.qk_norm:
            for i in range(args.num_hidden_layers):
                lp = f"{args.weight_prefix}layers.{i}.self_attn."
                q_norms.append(weights.pop(f"{lp}q_norm.weight"))
                k_norms.append(weights.pop(f"{lp}k_norm.weight"))
        log.info("loaded %s: %d layers, hidden %d, backend %s", args.model_type,
                 args.num_hidden_layers, args.hidden_size, be.name)
        return cls(args, be, q_norms, k_norms)

    @property
    def numerics(self) -> str:
        return self.backend.numerics

    def chunk_size(self, requested: int) -> int:
        """The prefill chunk `prefill` uses for `requested` (a static-shape backend's nearest size):
        also the unit a reused prefix is aligned to (the engine's `align`)."""
        return pick_chunk(self.backend, requested)

    def close(self) -> None:
        """Release the backend's resources outside this process's heap (`Backend.close`)."""
        self.backend.close()

    def new_cache(self, max_seq: int = DEFAULTS.max_seq, **kw) -> KVCache:
        """A KV cache with this model's geometry."""
        return KVCache(self.args.geometry, max_seq=max_seq, **kw)

    # ---- forward --------------------------------------------------------------------------
    def forward(self, tokens, cache: KVCache, all_logits: bool = False,
                positions: np.ndarray | None = None, work: Work = NO_WORK,
                visual: VisualRows | None = None, decode: bool = False) -> np.ndarray:
        """Run `tokens` at rows [cache.length, +T): write their K/V rows, extend cache.tokens.

        Returns float32 logits of the last position (vocab,), or (T, vocab) if all_logits.
        `positions` overrides the text positions (T,) or MRoPE (3, T) (for image tokens).
        `visual` rows take their embeddings from the vision encoder; their entries in `tokens`
        are the image key ids stored in the cache (any value, not looked up).
        `decode`: the rows are decode rows (a speculative verify forward), not a prompt's: a
        backend's `row_step` takes them whole when they fit (a prompt's rows keep the batches of
        a cold prefill, engine.py).
        """
        return self._run(tokens, cache, "all" if all_logits else "last", positions, work, visual, decode)

    def prefill(self, tokens, cache: KVCache, chunk: int = DEFAULTS.prefill_chunk,
                work: Work = NO_WORK, positions: np.ndarray | None = None,
                visual: VisualRows | None = None, logits: bool = True) -> np.ndarray | None:
        """Forward in chunks so memory stays bounded; logits (vocab,) of the last token only, or
        None with `logits=False` (rows only: the engine computes the last prompt token alone).
        `positions` (3, T) and `visual` describe the whole run and are sliced per chunk.

        Chunks are cut at absolute row multiples of `chunk` (`chunk_bounds`), not relative to where
        the run starts: a run that starts at an aligned row batches its rows exactly as a run from
        row 0 does, which is what makes a restored prefix + tail bitwise a cold prefill on kernels
        whose per-row result depends on the batch (docs/store.md, "Alignment").

        After each chunk `work` gets a prefill report (rows valid / rows when done), and inside
        each chunk one `work.layer` per decoder layer (`_run`), so progress never waits for a whole
        chunk; either may cancel: `Cancelled` then leaves the cache valid up to the last complete
        chunk (the interrupted chunk's rows are never declared valid)."""
        ids = np.asarray(tokens, dtype=np.int64)
        if ids.size == 0:
            raise ValueError("prefill needs at least one token")
        start = cache.length
        out = None
        for a, b in chunk_bounds(start, start + ids.size, self.chunk_size(chunk)):
            a, b = a - start, b - start
            pos = None if positions is None else positions[..., a:b]
            vis = None if visual is None else visual.slice(a, b)
            out = self._run(ids[a:b], cache, "last" if logits and b == ids.size else "none", pos, work, vis)
            work.report(PREFILL, cache.length, start + ids.size)
        return out

    def _run(self, tokens, cache: KVCache, want: str, positions: np.ndarray | None, work: Work = NO_WORK,
             visual: VisualRows | None = None, decode: bool = False):
        args, be = self.args, self.backend
        ids = np.asarray(tokens, dtype=np.int64).reshape(-1)
        T, start = ids.size, cache.length
        if T == 0:
            raise ValueError("forward needs at least one token")
        if start + T > cache.max_seq:
            raise KVCacheError(f"{start + T} tokens exceed the cache's max_seq={cache.max_seq}")
        lookup = ids
        if visual is not None:  # image rows are not looked up: id 0 stands in, then is replaced
            lookup = ids.copy()
            lookup[visual.rows] = 0
        if lookup.min() < 0 or lookup.max() >= args.vocab_size:
            raise ValueError(f"token id out of range [0, {args.vocab_size})")
        pos = self.rope.positions(start, T) if positions is None else np.asarray(positions)
        cos, sin = self.rope.cos_sin(pos)
        H, n_kv, D = args.num_attention_heads, args.num_key_value_heads, args.head_dim
        eps = np.float32(args.rms_norm_eps)

        step = be.row_step
        if step is not None and start > 0 and visual is None and (T == 1 or decode and T <= step.max_rows):
            return self._row_step(step, ids, cache, want, cos, sin, work)
        x = be.embed(lookup)  # (T, hidden)
        if visual is not None:
            x = np.array(x, dtype=np.float32)  # own the buffer before writing image rows into it
            x[visual.rows] = be.residual(visual.embeds)
        fused = None  # this layer's q/k/v if the previous post computed them (a fused graph)
        for layer in range(args.num_hidden_layers):
            q, k, v = fused if fused is not None else be.qkv(layer, x)
            q = q.reshape(T, H, D)
            k = k.reshape(T, n_kv, D)
            if args.qk_norm:
                q = rms_norm(q, self.q_norms[layer], eps)
                k = rms_norm(k, self.k_norms[layer], eps)
            q = apply_rope(q, cos, sin)
            q *= self.scale
            cache.write(layer, start, apply_rope(k, cos, sin).reshape(T, n_kv * D), v, work)
            keys, values = cache.valid(layer, start + T, work)
            attn = attention(q, keys, values, start, n_kv)
            # DeepStack changes h after this layer: a next qkv fused into post would be of the old h
            deepstack = visual is not None and layer < len(visual.deepstack)
            x, fused = be.post(layer, attn, x, fuse_next=not deepstack)
            if deepstack:
                x[visual.rows] += be.residual(visual.deepstack[layer])
            work.layer(layer + 1, args.num_hidden_layers)  # may cancel: no row of this run is valid yet
        cache.append_tokens(ids.tolist())  # after the last layer: a cancelled run leaves no valid row
        if want == "none":
            return None
        if want == "last":
            return be.logits(x[-1:])[0]
        return be.logits(x)

    def _row_step(self, step: RowStep, ids: np.ndarray, cache: KVCache, want: str, cos: np.ndarray,
                  sin: np.ndarray, work: Work):
        """A decode forward in one backend call (`Backend.row_step`): the call reads every
        layer's cached rows [0, start) in place; the new K/V rows it returns are written here.
        One call is one progress step (a decode step's work), so it reports no layers."""
        start, n, half = cache.length, self.args.num_hidden_layers, self.args.head_dim // 2
        past = [cache.valid(layer, start, work) for layer in range(n)]  # waits for a pipelined restore
        logits, k_new, v_new = step(self.backend.embed(ids), np.ascontiguousarray(cos[:, :half]),
                                    np.ascontiguousarray(sin[:, :half]), past)
        for layer in range(n):
            cache.write(layer, start, k_new[layer], v_new[layer], work)
        cache.append_tokens(ids.tolist())
        if want == "none":
            return None
        return logits[-1].copy() if want == "last" else logits.copy()
