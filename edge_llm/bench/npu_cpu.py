"""The CPU work of the NPU matmul path, measured (docs/npu.md, "Prediction").

`measure` loads the real matmul backend (`backends/mm8.MmBackend`) over an engine wrapped by
`npu_predict.TimedMatmul` and times forwards in CPU time (`time.process_time`, numpy's BLAS held
to one thread: a shared machine's load does not count, and no thread split flatters it); a
forward's time minus the time inside the engine's `run` is the CPU's share (quantize rows,
dequantize, norms, SwiGLU, RoPE, attention, the rotation of new rows, the online Hadamard if
converted with it, Python). `cpu_parts` times the larger of those ops one by one. The decoder layers' share is
timed apart (from a layer's `qkv` to the end of its `post`) and scaled to the predicted layer
count; the rest (embedding, head, sampling's logits) is counted once. The KV rows of a long
context are written directly (attention's cost depends on the row count, not the values), so
8K needs no 8K prefill.

`replay_families` gives the drafting rows of `bench decode`'s recall and code answers on the
default model's CPU backend under the matmul path's own cost profile.
"""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from threadpoolctl import threadpool_limits

from edge_llm.backends import QKVArrays
from edge_llm.backends.cpu import numpy_kernels
from edge_llm.backends.int8mm import HostInt8Matmul, Int8Matmul
from edge_llm.backends.mm8 import MmBackend, MmManifest
from edge_llm.bench.npu_predict import (CLOCK, CpuCost, CpuWork, Plan, Rates, Replayed, TimedMatmul, cost_profile,
                                        predict)
from edge_llm.config import ModelArgs
from edge_llm.models.qwen3 import Model, attention

DECODE_CONTEXTS = (128, 512, 2048, 8192)
VERIFY_ROWS = (2, 4, 8)  # a verify forward: 1 + the draft (draft_max 8: docs/speculative.md)
PROMPT_ROWS = (32, 128)


class TimedMmBackend(MmBackend):
    """MmBackend that adds up the wall time of its decoder layers (qkv of a layer to the end of
    its post, attention included) and of its logits."""

    def __init__(self, root: str | Path, manifest: MmManifest, engine: TimedMatmul):
        super().__init__(root, manifest, engine)
        self.timed = engine
        self.layer_s = self.head_s = 0.0
        self.layer_engine_s = self.head_engine_s = 0.0
        self._start = (0.0, 0.0)

    def qkv(self, layer: int, x: np.ndarray) -> QKVArrays:
        self._start = (CLOCK(), self.timed.seconds)
        return super().qkv(layer, x)

    def post(self, layer: int, attn: np.ndarray, x: np.ndarray,
             fuse_next: bool = True) -> tuple[np.ndarray, QKVArrays | None]:
        out = super().post(layer, attn, x, fuse_next)
        self.layer_s += CLOCK() - self._start[0]
        self.layer_engine_s += self.timed.seconds - self._start[1]
        return out

    def logits(self, x: np.ndarray) -> np.ndarray:
        t, e = CLOCK(), self.timed.seconds
        out = super().logits(x)
        self.head_s += CLOCK() - t
        self.head_engine_s += self.timed.seconds - e
        return out

    def reset_times(self) -> None:
        self.layer_s = self.head_s = self.layer_engine_s = self.head_engine_s = 0.0
        self.timed.reset()


def cpu_isa() -> str:
    """Where the CPU work was measured: the machine and numpy's kernels (its BLAS family)."""
    return f"{platform.machine()} {numpy_kernels()}"


def _fill(cache, n: int, rng: np.random.Generator) -> None:
    """Rows [0, n) of every layer written with random K/V and declared valid."""
    g = cache.geometry
    for layer in range(g.n_layers):
        k = rng.standard_normal((n, g.kv_dim), dtype=np.float32)
        cache.write(layer, 0, k, k)
    cache.set_tokens(list(range(n)))


@dataclass
class Measured:
    """What `measure` took from one load: the CPU work, the wall ms of the same forwards (median of
    the repeats: on a board, the path's real speed), and RSS with the KV cache of the longest
    context allocated (KVCache commits its pages up front) and its rows written."""

    cpu: CpuWork
    decode_ms: dict[tuple[int, int], float]
    prompt_ms: dict[int, float]
    rss_mb: float
    context: int
    parts: dict[str, float]


def _least_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = CLOCK()
        fn()
        best = min(best, CLOCK() - t)
    return best * 1e3


def cpu_parts(be: MmBackend, args: ModelArgs, contexts: Sequence[int], prompt_rows: int,
              repeats: int) -> dict[str, float]:
    """Where the CPU time goes, op by op (CPU ms, the least of `repeats`), through the backend's own
    per-row ops (`be.ops`: the C ops when built, else numpy's): the residual rotation of new rows,
    the MLP's middle (dequantize gate/up, SwiGLU, the online Hadamard if converted with it,
    quantize), the rest of a layer's quantize / dequantize / RMSNorm / residual adds, and attention
    of one row per layer at each context."""
    rng = np.random.default_rng(0)
    h, inter, ops, eps = args.hidden_size, args.intermediate_size, be.ops, np.float32(args.rms_norm_eps)
    out: dict[str, float] = {}
    for rows in (1, prompt_rows):
        x = rng.standard_normal((rows, h), dtype=np.float32)
        out[f"residual rotation, {rows} rows"] = _least_ms(lambda: be.residual(x), repeats)
        ones = np.ones(rows, np.float32)
        gu = rng.integers(-2**20, 2**20, (rows, 2 * inter), dtype=np.int32)
        gu_s = np.full(2 * inter, 1e-5, np.float32)
        out[f"SwiGLU{' + online Hadamard' if be.down_block is not None else ''} + quantize, {rows} rows, "
            "per layer"] = _least_ms(lambda: ops.swiglu_quant(gu, ones, gu_s, inter, be.down_block), repeats)
        qkv = rng.integers(-2**20, 2**20, (rows, args.q_dim + 2 * args.kv_dim), dtype=np.int32)
        attn = rng.standard_normal((rows, args.q_dim), dtype=np.float32)
        ch = rng.integers(-2**20, 2**20, (rows, h), dtype=np.int32)
        qkv_s, h_s = np.ones(qkv.shape[1], np.float32), np.ones(h, np.float32)

        def scaling() -> None:  # MmBackend.qkv and post around their products, the MLP's middle apart
            ops.norm_quant(x, eps)
            ops.dequant(qkv, ones, qkv_s, None)
            ops.quant(attn)
            ops.dequant_add_norm_quant(ch, ones, h_s, x, eps)
            ops.dequant_add(ch, ones, h_s, x)

        out[f"norms, quantize, dequantize, residual adds, {rows} rows, per layer"] = _least_ms(scaling, repeats)
    for ctx in contexts:
        q = rng.standard_normal((1, args.num_attention_heads, args.head_dim), dtype=np.float32)
        kv = rng.standard_normal((ctx, args.kv_dim), dtype=np.float32)
        out[f"attention, 1 row at {ctx}, per layer"] = _least_ms(
            lambda: attention(q, kv, kv, ctx - 1, args.num_key_value_heads), repeats)
    return out


def measure(model_dir: str | Path, mm_dir: str | Path, engine: Int8Matmul, layers: int | None = None,
            contexts: Sequence[int] = DECODE_CONTEXTS, verify_rows: Sequence[int] = VERIFY_ROWS,
            prompt_rows: Sequence[int] = PROMPT_ROWS, repeats: int = 3,
            step: Callable[[str], None] = lambda _m: None) -> Measured:
    """Forwards of MmBackend over `engine`: the CPU ms (its `run` time subtracted, the layers' share
    scaled from the converted layers to `layers`, default the same; the least of `repeats`) and
    the wall ms (median)."""
    from edge_llm.bench.procstat import proc_status

    timed = TimedMatmul(engine)
    be = TimedMmBackend(mm_dir, MmManifest.read(mm_dir), timed)
    model = Model.load(model_dir, backend=be)
    measured = model.args.num_hidden_layers
    layers = layers or measured
    rng = np.random.default_rng(0)
    extra = max(verify_rows, default=1)
    ids = rng.integers(0, min(model.args.vocab_size, 1000), max([*contexts, *prompt_rows]) + extra + 1)

    def one(rows: int, ctx: int, prompt: bool) -> tuple[float, float]:
        cpu, wall = [], []
        for _ in range(repeats + 1):  # the first one warms up
            cache.truncate(ctx)
            be.reset_times()
            t, w = CLOCK(), time.perf_counter()
            model.forward(ids[ctx:ctx + rows], cache, all_logits=not prompt, decode=not prompt)
            wall.append((time.perf_counter() - w) * 1e3)
            total = CLOCK() - t
            layer_cpu = be.layer_s - be.layer_engine_s
            rest_cpu = total - be.layer_s - (timed.seconds - be.layer_engine_s)
            cpu.append((rest_cpu + layer_cpu * layers / measured) * 1e3)
        # CPU time only grows with interference (cache misses): the least
        return min(cpu[1:]), statistics.median(wall[1:])

    prompt, decode, prompt_wall, decode_wall = {}, {}, {}, {}
    try:
        with threadpool_limits(1):
            cache = model.new_cache(max([*contexts, *prompt_rows]) + extra + 1, check_memory=False)
            for rows in prompt_rows:
                step(f"a {rows}-row prompt")
                cache.reset()
                prompt[rows], prompt_wall[rows] = one(rows, 0, True)
            for ctx in contexts:
                _fill(cache, ctx, rng)
                for rows in (1, *verify_rows):
                    step(f"{rows} decode rows at context {ctx}")
                    decode[(rows, ctx)], decode_wall[(rows, ctx)] = one(rows, ctx, False)
            rss = proc_status()["VmRSS"] / 2**20
            step("CPU work op by op")
            parts = cpu_parts(be, model.args, contexts, max(prompt_rows), max(repeats, 3))
    finally:
        model.close()
    return Measured(CpuWork(decode, prompt, cpu_isa(), measured, layers), decode_wall, prompt_wall, rss,
                    max(contexts), parts)


def replay_families(plan: Plan, rates: Rates, cpu: CpuCost, families: Sequence[str] = ("recall", "code"),
                    max_tokens: int = 128, step: Callable[[str], None] = lambda _m: None) -> list[Replayed]:
    """Greedy answers of `bench decode`'s families on the default model's CPU backend, and the
    rows of each forward the engine's drafting runs for them under this prediction's cost profile
    (`bench.decode.replay`: the real Drafter, greedy verification)."""
    from edge_llm.bench.decode import FAMILIES, chat_ids, replay
    from edge_llm.drafting import DraftConfig
    from edge_llm.engine import GenerationRequest
    from edge_llm.runtime import load_runtime
    from edge_llm.settings import Settings, resolve

    eng = load_runtime(resolve(Settings(backend="cpu", disk_kv=None, log_file=None, max_seq=4096, draft="off")))
    out = []
    try:
        for fam in families:
            step(f"greedy answer: {fam}")
            ids = chat_ids(eng.tokenizer, FAMILIES[fam])
            eng.cache.reset()
            tokens = list(list(eng.generate(GenerationRequest(list(ids), max_tokens=max_tokens)))[-1].completion_ids)
            rows = replay(ids, tokens, cost_profile(plan, rates, cpu, len(ids)), DraftConfig())
            out.append(Replayed(fam, len(ids), len(tokens) - 1, tuple(rows)))
    finally:
        eng.close()
    return out


def run_prediction(model_dir: str | Path, mm_dir: str | Path, layers: int | None = None, rates: Rates = Rates(),
                   drafting_tokens: int = 128, repeats: int = 3, engine: Int8Matmul | None = None,
                   contexts: Sequence[int] = DECODE_CONTEXTS, step: Callable[[str], None] = lambda _m: None) -> dict:
    """The prediction for `model_dir`'s geometry at `layers` layers (default: its own), the CPU
    work measured on `mm_dir` (its conversion) over `engine` (default: the host emulation)."""
    args = ModelArgs.from_dir(model_dir)
    layers = layers or args.num_hidden_layers
    plan = Plan.of(ModelArgs(**{**args.__dict__, "num_hidden_layers": layers}), rates.cores)
    got = measure(model_dir, mm_dir, engine or HostInt8Matmul(), layers, contexts, repeats=repeats, step=step)
    cpu = got.cpu
    drafting = replay_families(plan, rates, cpu, max_tokens=drafting_tokens, step=step) if drafting_tokens else []
    res = predict(plan, rates, cpu, contexts, drafting=drafting)
    res["cpu"] = {"isa": cpu.isa, "layers_measured": cpu.layers_measured, "layers": cpu.layers,
                  "decode_ms": {f"{r}x{c}": v for (r, c), v in cpu.decode.items()}, "prompt_ms": cpu.prompt,
                  "parts_ms": got.parts}
    return res
