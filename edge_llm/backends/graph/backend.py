"""`GraphBackend`: the decoder's dense work as exported graphs run by a `GraphRunner`.

The same orchestration for every runner (onnxruntime F32, rknn simulator fp16, NPU fp16):
embedding lookup on the CPU (table kept in the runner's activation dtype and widened per row),
`qkv` and `post` graphs per layer (or cpu-q's fused `step` graphs: `post` of layer l and, when
built so, layer l+1's qkv in one call, returned by `post` unless the caller says it will change h
first), the head graph(s) per row, residual additions in float32. Int8 graphs (`qkv_n`, `o`, `mlp`,
`head_n`) get their norms and per-channel scales from a `CpuSide` (cpu_side.py) computed here in
float32. Stateless between calls.
Row counts are mapped onto the graphs' static shapes in `_call` through `schema.row_plan`:
padding rows are zeros and are dropped from the outputs; rows never mix inside a graph, so a
real row's result does not depend on the padding (tests/test_graph_backend.py checks it).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import numpy as np

from edge_llm.backends import QKVArrays, RowStep
from edge_llm.backends.cost import NEVER_PAYS
from edge_llm.backends.cpu.backend import rms_norm
from edge_llm.backends.graph.cpu_side import CpuSide
from edge_llm.backends.graph.schema import (
    HEAD,
    HEAD_N,
    MLP,
    POST,
    QKV,
    QKV_N,
    STEP,
    O,
    GraphSpec,
    layer_name,
    row_plan,
)
from edge_llm.backends.graph.runners import GraphRunner
from edge_llm.config import ModelArgs
from edge_llm.errors import ConfigError
from edge_llm.weights import Weights

log = logging.getLogger(__name__)


class GraphBackend:
    """A `Backend` (see `edge_llm.backends`) over graphs; `numerics` names graphs + runner."""

    def __init__(self, name: str, specs: Sequence[GraphSpec], runner: GraphRunner, numerics: str,
                 mapped_embedding: bool = False, row_step: RowStep | None = None, max_rows: int | None = None,
                 forward_cost: Callable[[int], float] = NEVER_PAYS, cpu_side: CpuSide | None = None):
        """`mapped_embedding`: gather embedding rows from the checkpoint file (mmap, exact F32)
        instead of holding the table in RAM; `row_step`: one-row forwards in one call (cpu-q's
        decode graph; `numerics` must cover it); `max_rows`: rows per call of a dynamic graph
        (None: all rows in one call); `forward_cost`: the cost profile speculative decoding reads
        (`edge_llm.backends`; default: drafts never pay); `cpu_side`: the norms and scales of
        the norms-on-the-CPU graphs (required by them)."""
        self.name = name
        self.forward_cost = forward_cost
        self.max_rows = max_rows
        self.row_step = row_step
        self.mapped_embedding = mapped_embedding
        self.runner = runner
        self.numerics = numerics
        self.specs = list(specs)
        self.qkv_g = {s.index: s for s in specs if s.kind in (QKV, QKV_N)}
        self.post_g = {s.index: s for s in specs if s.kind in (POST, STEP, O)}
        self.mlp_g = {s.index: s for s in specs if s.kind == MLP}
        self.head_g = sorted((s for s in specs if s.kind in (HEAD, HEAD_N)), key=lambda s: s.vocab)
        self.side = cpu_side
        if cpu_side is None and any(s.kind in (QKV_N, O, MLP, HEAD_N) for s in specs):
            raise ConfigError("graphs with the norms on the CPU (w8a8) need their cpu_side.npz")
        self.chunk_sizes: tuple[int, ...] = self.qkv_g[0].rows if self.qkv_g else ()
        self.calls: dict[tuple[str, int], int] = {}  # (graph, rows) -> count, for benchmarks

    def load(self, args: ModelArgs, weights: Weights) -> None:
        n = args.num_hidden_layers
        # layer l's qkv comes from its own graph or from a step l-1 that also outputs it
        fed = {s.index + 1 for s in self.post_g.values() if s.kind == STEP and len(s.outputs) > 1}
        if sorted(set(self.qkv_g) | fed) != list(range(n)) or sorted(self.post_g) != list(range(n)):
            raise ConfigError(f"graphs cover layers {sorted(self.qkv_g)}, the model has {n} "
                              "(converted with --layers? convert all layers to serve)")
        if not self.head_g or self.head_g[-1].vocab[1] != args.vocab_size:
            raise ConfigError(f"head graphs cover vocab {self.head_g[-1].vocab if self.head_g else None}, "
                              f"the model has {args.vocab_size}")
        if self.mlp_g and sorted(self.mlp_g) != list(range(n)):
            raise ConfigError(f"mlp graphs cover layers {sorted(self.mlp_g)}, the model has {n}")
        self.q_dim, self.kv_dim = args.q_dim, args.kv_dim
        self.eps = np.float32(args.rms_norm_eps)
        name = f"{args.weight_prefix}embed_tokens.weight"
        if self.mapped_embedding:
            self.table = weights.pop_rows(name)
        else:
            table = weights.pop(name)
            # an fp16 NPU sees fp16 activations anyway; half the table's RAM (0.6 GB for 2B)
            self.table = table if self.runner.act_dtype == np.float32 else table.astype(self.runner.act_dtype)
            del table
        log.info("graph backend %s: %d graphs, runner %s, chunks %s", self.name, len(self.specs),
                 self.runner.name, list(self.chunk_sizes))

    def close(self) -> None:
        self.runner.close()
        self.row_step = None  # cpu-q's decode session goes with its last reference

    # ---- the seam -------------------------------------------------------------------------
    def embed(self, tokens: np.ndarray) -> np.ndarray:
        return self.residual(self.table[tokens].astype(np.float32, copy=False))  # mapped rows are fresh F32

    def residual(self, rows: np.ndarray) -> np.ndarray:
        if self.side is None or self.side.rotation is None:
            return rows
        return rows @ self.side.rotation  # the rotated basis of w8a8 graphs (cpu_side.py)

    def qkv(self, layer: int, x: np.ndarray) -> QKVArrays:
        spec = self.qkv_g.get(layer)
        if spec is None:  # load() checked that step layer-1 computes it: only post(fuse_next=True) has it
            raise ConfigError(f"layer {layer}'s qkv is computed only inside {layer_name(layer - 1, STEP)}; a "
                              "caller that changes h between the two layers (DeepStack image rows) needs graphs "
                              "with a qkv graph of its own there (graph_specs(unfused=N)): rebuild them")
        if spec.kind == QKV_N:
            (y,) = self._call(spec, [rms_norm(x, self.side.in_gain[layer], self.eps)])
            return self._split(y * self.side.qkv_scale[layer])
        (y,) = self._call(spec, [x])
        return self._split(y)

    def post(self, layer: int, attn: np.ndarray, x: np.ndarray,
             fuse_next: bool = True) -> tuple[np.ndarray, QKVArrays | None]:
        spec = self.post_g[layer]
        if spec.kind == STEP:  # h = x + attn_out + mlp_out in the graph (float32 there too)
            outs = self._call(spec, [attn, x])
            # a step with a qkv output computes it whether or not the caller will use it
            return outs[0], (self._split(outs[1]) if fuse_next and len(outs) > 1 else None)
        if spec.kind == O:  # norms and scales on the CPU (cpu_side.py): (x + o) + m as below
            side = self.side
            (o,) = self._call(spec, [attn * side.attn_scale[layer]])
            out = x + o
            (m,) = self._call(self.mlp_g[layer], [rms_norm(out, side.post_gain[layer], self.eps)])
            out += m * side.out_scale[layer]
            return out, None
        o, m = self._call(spec, [attn, x])
        out = x + o  # the residual stream stays float32: (x + o) + m, as the CPU backend adds
        out += m
        return out, None

    def _split(self, y: np.ndarray) -> QKVArrays:
        q, kv = self.q_dim, self.kv_dim
        return y[:, :q], y[:, q:q + kv], y[:, q + kv:]

    def logits(self, x: np.ndarray) -> np.ndarray:
        if self.head_g[0].kind == HEAD_N:
            x = rms_norm(x, self.side.final_gain, self.eps)
        parts = [self._call(spec, [x])[0] for spec in self.head_g]
        return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=1)

    # ---- static shapes --------------------------------------------------------------------
    def _call(self, spec: GraphSpec, inputs: list[np.ndarray]) -> list[np.ndarray]:
        """Run `spec` over T rows: split/pad onto its static shapes, drop the padding."""
        T = inputs[0].shape[0]
        pieces = []
        for a, b, rows in row_plan(T, spec.rows, self.max_rows):
            xs = []
            for x in inputs:
                if b - a == rows:
                    xs.append(np.ascontiguousarray(x[a:b], dtype=np.float32))
                else:
                    buf = np.zeros((rows, x.shape[1]), dtype=np.float32)
                    buf[:b - a] = x[a:b]
                    xs.append(buf)
            key = (spec.name, rows)
            self.calls[key] = self.calls.get(key, 0) + 1
            pieces.append([o[:b - a] for o in self.runner.run(spec, xs)])
        if len(pieces) == 1:
            return pieces[0]
        return [np.concatenate(outs, axis=0) for outs in zip(*pieces)]
