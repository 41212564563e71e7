"""The CPU work of the NPU matmul path, measured (docs/npu.md, "Prediction").

`measure` loads the real matmul backend (`backends/npu/matmul/decoder.MmBackend`) over an engine wrapped by
`predict.TimedMatmul` and times forwards in the calling thread's CPU time (`time.thread_time`,
numpy's BLAS held to one thread: a shared machine's load does not count, no thread split flatters
it, and the NPU engine's helper threads spinning between rounds are not the model's work); a
forward's time minus the time inside the engine's `run` is the CPU's share (quantize rows,
dequantize, norms, SwiGLU, RoPE, attention, the rotation of new rows, the online Hadamard if
converted with it, writing the KV rows, Python). `cpu_parts` times the larger of those ops one by
one. On a host the products are recorded once and replayed (`RecordedMatmul`): the host
emulation's float32 weight stream would evict the CPU side's data from the caches, which an
NPU does not. A prediction for more layers than were converted runs the converted ones again
(`deepened`), each layer with its own scales, products and KV rows, so the whole model's CPU-side
working set is what the caches hold. The KV rows of a long context are written directly
(attention's cost depends on the row count, not the values), so 8K needs no 8K prefill.

`replay_families` gives the drafting rows of `bench decode`'s recall and code answers on the
default model's CPU backend under the matmul path's own cost profile.
"""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from threadpoolctl import threadpool_limits

from edge_llm.backends.npu.matmul import row_step
from edge_llm.backends.cpu.backend import numpy_kernels
from edge_llm.backends.npu.matmul.int8 import HostInt8Matmul, Int8Matmul
from edge_llm.backends.npu.matmul.decoder import MmBackend, MmManifest
from edge_llm.bench.npu.predict import (CLOCK, CpuCost, CpuWork, Plan, Rates, Replayed, TimedMatmul, cost_profile,
                                        predict)
from edge_llm.config import ModelArgs
from edge_llm.models.qwen3 import Model, attention

DECODE_CONTEXTS = (128, 512, 2048, 8192)
VERIFY_ROWS = (2, 4, 8)  # a verify forward: 1 + the draft (draft_max 8: docs/speculative.md)
PROMPT_ROWS = (32, 128)


class RecordedMatmul:
    """An `Int8Matmul` for timing the CPU side on a host: each weight's product for a row count is
    computed once by `inner` (the host emulation) on the first call and returned as recorded
    afterwards (read-only), so the timed forwards read no weights on this CPU. On a board the NPU
    streams the weights and the CPU's caches keep the CPU side's own data; the host emulation
    instead streams 4 bytes per weight through them, which evicts everything the per-row ops and
    attention read (it tripled the 2B's figure at 128 rows of context: docs/npu.md, "Prediction").
    Each weight name keeps its own recorded array, as each NPU context has its own C buffer.

    `layers`: the converted layer count; a weight of layer L >= layers is computed with layer
    L % layers' weight (`aliased`), so a model of more layers than were converted has its own
    products, scales and KV rows per layer: the CPU side's real working set."""

    def __init__(self, inner: Int8Matmul, layers: int):
        self.inner, self.layers = inner, layers
        self.numerics = inner.numerics
        self.selftest = inner.selftest
        self.recorded: dict[tuple[str, int], np.ndarray] = {}

    def add(self, name: str, w: np.ndarray) -> None:
        self.inner.add(name, w)

    def aliased(self, name: str) -> str:
        kind, _, rest = name.partition(".")
        if kind != "layer":
            return name
        layer, _, what = rest.partition(".")
        return f"layer.{int(layer) % self.layers}.{what}"

    def run(self, name: str, a: np.ndarray) -> np.ndarray:
        key = (name, a.shape[0])
        out = self.recorded.get(key)
        if out is None:
            out = self.inner.run(self.aliased(name), a).copy()
            out.flags.writeable = False  # an op that wrote into its input would change the next forward
            self.recorded[key] = out
        return out

    def close(self) -> None:
        self.inner.close()


def deepened(model: Model, be: MmBackend, layers: int) -> Model:
    """`model` (over `be`, a conversion of fewer layers) as a model of `layers` layers: layer L
    runs layer L % converted's weights (its engine a `RecordedMatmul`) with its own copies of the
    scales, biases and q/k norm gains, and the row step rebuilt for that depth. For timing only."""
    conv = model.args.num_hidden_layers
    args = ModelArgs(**{**model.args.__dict__, "num_hidden_layers": layers})
    for L in range(conv, layers):
        for kind in ("qkv", "o", "gu", "down"):
            be.scales[f"layer.{L}.{kind}"] = be.scales[f"layer.{L % conv}.{kind}"].copy()
        if L % conv in be.bias:
            be.bias[L] = be.bias[L % conv].copy()
    q_norms = [model.q_norms[L % conv].copy() for L in range(layers)] if args.qk_norm else []
    k_norms = [model.k_norms[L % conv].copy() for L in range(layers)] if args.qk_norm else []
    if be.row_step is not None:
        be.row_step = row_step.MmRowStep(be, args, q_norms, k_norms, be.row_step.max_rows)
    return Model(args, be, q_norms, k_norms)


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
            prompt_rows: Sequence[int] = PROMPT_ROWS, repeats: int = 3, record: bool = False,
            step: Callable[[str], None] = lambda _m: None) -> Measured:
    """Forwards of MmBackend over `engine` at `layers` layers (default: the converted ones; more
    runs the converted layers again, `deepened`): the CPU ms (the forward's CPU time minus the
    time inside the engine's `run`; the least of `repeats`) and the wall ms (median). `record`
    (a host engine: the products computed on this CPU) times the forwards over a
    `RecordedMatmul`, so that no weight stream goes through this CPU's caches; deepening needs it."""
    from edge_llm.bench.procstat import proc_status

    converted = MmManifest.read(mm_dir).layers
    layers = layers or converted
    if layers != converted and not record:
        raise ValueError(f"{layers} layers from a conversion of {converted}: needs the recorded products (record=True)")
    timed = TimedMatmul(RecordedMatmul(engine, converted) if record else engine)
    be = MmBackend(mm_dir, MmManifest.read(mm_dir), timed)
    model = Model.load(model_dir, backend=be)
    if layers != converted:
        model = deepened(model, be, layers)
    rng = np.random.default_rng(0)
    extra = max(verify_rows, default=1)
    ids = rng.integers(0, min(model.args.vocab_size, 1000), max([*contexts, *prompt_rows]) + extra + 1)

    def one(rows: int, ctx: int, prompt: bool) -> tuple[float, float]:
        cpu, wall = [], []
        for _ in range(repeats + 1):  # the first one warms up (and records the products)
            cache.truncate(ctx)
            timed.reset()
            t, w = CLOCK(), time.perf_counter()
            model.forward(ids[ctx:ctx + rows], cache, all_logits=not prompt, decode=not prompt)
            wall.append((time.perf_counter() - w) * 1e3)
            cpu.append((CLOCK() - t - timed.seconds) * 1e3)
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
    return Measured(CpuWork(decode, prompt, cpu_isa(), converted, layers, record), decode_wall, prompt_wall, rss,
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
                   contexts: Sequence[int] = DECODE_CONTEXTS, lib: str | None = None,
                   step: Callable[[str], None] = lambda _m: None, at_rates: Mapping[str, Rates] = {}) -> dict:
    """The prediction for `model_dir`'s geometry at `layers` layers (default: its own), the CPU
    work measured on `mm_dir` (its conversion) over `engine` (default: the host emulation), the
    engine's own time per round measured over `lib` (a librknnrt, or a stand-in) when given;
    `at_rates`: more predictions of the same CPU work at other rates, by label (`res["at_rates"]`);
    `res["cpu_q"]`: cpu-q's decode on the board's A76 cores (`a76.predict_cpu_q`)."""
    from dataclasses import replace

    from edge_llm.bench.npu.matmul import bench_matmul

    from edge_llm.bench.npu.a76 import predict_cpu_q

    args = ModelArgs.from_dir(model_dir)
    layers = layers or args.num_hidden_layers
    args = ModelArgs(**{**args.__dict__, "num_hidden_layers": layers})
    plan = Plan.of(args, rates.cores)
    micro = None
    if lib is not None:
        step("the engine's time per round")
        micro = bench_matmul(lib, shapes={})
        rates = replace(rates, engine_us=micro.engine_us)
    got = measure(model_dir, mm_dir, engine or HostInt8Matmul(), layers, contexts, repeats=repeats,
                  record=engine is None, step=step)
    cpu = got.cpu
    drafting = replay_families(plan, rates, cpu, max_tokens=drafting_tokens, step=step) if drafting_tokens else []
    res = predict(plan, rates, cpu, contexts, drafting=drafting)
    for label, other in at_rates.items():  # the same CPU work at other NPU rates (bench board: measured ones)
        res.setdefault("at_rates", {})[label] = predict(plan, other, cpu, contexts)
    res["cpu_q"] = predict_cpu_q(args)  # the CPU decode next to it (docs/npu.md, "NPU or CPU decode")
    if micro is not None:
        res["engine_on"] = (f"{micro.numerics} on {micro.machine}, a round over {micro.round_cores} cores: "
                            f"{micro.round_us:.1f} us, rknn_matmul_run alone {micro.lib_run_us:.1f} us")
        res["micro"] = micro.as_dict()
    res["cpu"] = {"isa": cpu.isa, "layers_converted": cpu.layers_converted, "layers": cpu.layers,
                  "recorded": cpu.recorded,
                  "decode_ms": {f"{r}x{c}": v for (r, c), v in cpu.decode.items()}, "prompt_ms": cpu.prompt,
                  "parts_ms": got.parts}
    return res
