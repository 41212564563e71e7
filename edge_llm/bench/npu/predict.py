"""The prediction model of the NPU matmul path (docs/npu.md, "Prediction").

A forward of T rows through the w8a8 matmul path (docs/npu.md, "The matmul path") costs

    NPU   sum over linears of max(weight bytes / bandwidth, T x multiply-adds / NPU peak)
  + calls rounds x per-call cost   (one context per core, each a part of the weight: the cores'
                                    calls of one linear overlap, so a linear costs one call's time)
  + engine rounds x the engine's own time per round (copies in and out, the hand-off to the
          cores' threads, Python: measured by `matmul.bench_matmul` over a library)
  + CPU   the CPU work of T rows at the context length (measured: `cpu.measure`)

Inputs, each with its source (`Rates`): bandwidth ~11 GB/s on one NPU core and ~26.6 GB/s over
the three (community probes, as issue 36 cites them); ~33 us per `rknn_matmul_run` (reported);
1024 int8 multiply-adds per cycle per core at 1 GHz (rknn-toolkit2's own cost model: docs/npu.md's
w8a8 compiler estimate is exactly that rate at 128 rows; 3 cores = Rockchip's 6 TOPS). The bytes
and calls come from the model geometry (`Plan.of`). The CPU work is measured on this machine by
running the real matmul backend on the host engine with the time inside `Int8Matmul.run`
subtracted (`TimedMatmul`); it is x86-64 time, not A76 time (`markdown` says so next to it).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from edge_llm.backends.npu.matmul.int8 import ALIGN, MAX_K, Int8Matmul
from edge_llm.backends.npu.matmul.engine import M_SHAPES, split_weight
from edge_llm.config import ModelArgs
from edge_llm.bench.rkllm import RKLLM, RKLLM_PREFILL_ROWS
from edge_llm.convert.report import NPU_HZ

M_MAX = M_SHAPES[-1]  # rows per round: the engine cuts larger forwards into chunks of this many
# the CPU work is the calling thread's CPU time (bench/npu/cpu.py), and so is TimedMatmul's: the NPU
# engine's helper threads (backends/npu/matmul/rounds.py) spin between rounds, which is not work of the model's
CLOCK = time.thread_time
SOURCES = {
    "bandwidth": "community probes (issue 36): ~11 GB/s per NPU core, ~26.6 GB/s over three",
    "call": "reported fixed cost of one rknn_matmul_run (issue 36)",
    "peak": "rknn-toolkit2's cost model: 1024 int8 MACs/cycle/core at 1 GHz (docs/npu.md w8a8 estimate; "
            "3 cores = Rockchip's 6 TOPS)",
    "engine": "measured: NpuInt8Matmul.run over a round minus rknn_matmul_run alone (bench/npu/matmul.py)",
}


@dataclass(frozen=True)
class Rates:
    """The NPU figures the prediction assumes (SOURCES names where each comes from)."""

    bw_core_gbs: float = 11.0  # one NPU core alone
    bw_all_gbs: float = 26.6  # the three cores together
    call_us: float = 33.0  # per rknn_matmul_run
    macs_per_cycle: int = 1024  # int8, per core
    hz: float = NPU_HZ
    cores: int = 3
    engine_us: float | None = None  # the engine's own time per round (measured; None: not measured)

    def bandwidth(self, cores: int) -> float:
        """Bytes per second `cores` cores read together."""
        return (self.bw_core_gbs if cores == 1 else self.bw_all_gbs) * 1e9


@dataclass(frozen=True)
class Linear:
    """One weight the matmul path multiplies by, `count` times per forward (per layer: the layers)."""

    kind: str
    k: int
    n: int
    count: int


def _up(x: int, to: int = ALIGN) -> int:
    return -(-x // to) * to


def linears(args: ModelArgs) -> list[Linear]:
    """A forward's weights as the matmul path fuses them: q/k/v, o, gate/up, down per layer, the head."""
    h, hd, L = args.hidden_size, args.head_dim, args.num_hidden_layers
    return [Linear("qkv", h, (args.num_attention_heads + 2 * args.num_key_value_heads) * hd, L),
            Linear("o", args.num_attention_heads * hd, h, L),
            Linear("gate_up", h, 2 * args.intermediate_size, L),
            Linear("down", args.intermediate_size, h, L),
            Linear("head", h, args.vocab_size, 1)]


@dataclass(frozen=True)
class Part:
    """What one linear costs on the NPU: its weight bytes, the largest core's share, its calls."""

    kind: str
    count: int
    k_parts: int  # K above MAX_K is split into parts, each a call summed on the CPU
    k_part: int  # rows of K per part, padded to ALIGN
    n: int  # columns, padded to ALIGN
    cores: int  # contexts, one per core, each a part of the weight (`engine.split_weight`)

    @property
    def bytes(self) -> int:
        """int8 weight bytes of one run of this linear (all cores, all K parts)."""
        return self.k_parts * self.k_part * self.n

    @property
    def widest(self) -> int:
        """int8 bytes of the largest core's part of one K part, as the engine cuts the weight
        (`engine.split_weight`): the core that finishes last."""
        return max(b.size for b in split_weight(self.k_part, self.n, self.cores))

    @property
    def calls(self) -> int:
        return self.k_parts * self.cores

    def macs(self, rows: int) -> int:
        return rows * self.bytes

    def seconds(self, rows: int, rates: Rates) -> float:
        """The slowest core's time: its share of the bytes at its share of the bandwidth, or its
        multiply-adds at one core's peak rate, whichever is longer."""
        mine = self.k_parts * self.widest
        bw = rates.bandwidth(self.cores) / self.cores
        return max(mine / bw, rows * mine / (rates.macs_per_cycle * rates.hz))


@dataclass(frozen=True)
class Plan:
    """A model geometry on the matmul path: parts, bytes per token, calls per token."""

    parts: tuple[Part, ...]
    layers: int

    @classmethod
    def of(cls, args: ModelArgs, cores: int = 3) -> Plan:
        parts = []
        for lin in linears(args):
            kp = math.ceil(lin.k / MAX_K)
            parts.append(Part(lin.kind, lin.count, kp, _up(math.ceil(lin.k / kp)), _up(lin.n), cores))
        return cls(tuple(parts), args.num_hidden_layers)

    @property
    def weight_bytes(self) -> int:
        return sum(p.count * p.bytes for p in self.parts)

    @property
    def scale_bytes(self) -> int:
        """float32 per-channel weight scales, read on the CPU by `dequantize` (in the CPU work)."""
        return sum(p.count * 4 * p.n for p in self.parts)

    @property
    def calls(self) -> int:
        """rknn_matmul_run calls per forward (any number of rows: only M varies)."""
        return sum(p.count * p.calls for p in self.parts)

    @property
    def rounds(self) -> int:
        """Calls one after another per forward: a linear's per-core calls run together."""
        return sum(p.count * p.k_parts for p in self.parts)

    def npu_ms(self, rows: int, rates: Rates, head_rows: int | None = None) -> float:
        """The NPU's time for a forward of `rows` rows (the head on `head_rows`, default all: a
        prompt's forward needs the last row's logits only): per linear its slowest core
        (`Part.seconds`), plus the per-call cost of each round."""
        t = sum(p.count * p.seconds((head_rows or rows) if p.kind == "head" else rows, rates) for p in self.parts)
        return t * 1e3 + self.rounds * rates.call_us / 1e3


@dataclass
class CpuWork:
    """CPU ms of one forward (measured on this machine, `cpu.measure`) of a model of `layers`
    layers (a conversion of `layers_converted` run deeper: `cpu.deepened`): `decode[(rows,
    context)]` for decode rows (one, or a verify forward's, logits of every row), linear in context
    between and beyond the measured contexts of a row count; `prompt[rows]` for a prompt's forward
    from row 0 (the last row's logits). `recorded`: timed over recorded products
    (`cpu.RecordedMatmul`: no weight stream through this CPU's caches, as on a board)."""

    decode: dict[tuple[int, int], float]
    prompt: dict[int, float]
    isa: str
    layers_converted: int
    layers: int
    recorded: bool = False

    def __call__(self, rows: int, context: int, prompt: bool = False) -> float:
        if prompt:
            near = min(self.prompt, key=lambda r: abs(r - rows))
            return self.prompt[near] * rows / near
        pts = sorted((c, v) for (r, c), v in self.decode.items() if r == rows)
        if not pts:  # rows never measured: the nearest measured row count, per row
            near = min({r for r, _ in self.decode}, key=lambda r: abs(r - rows))
            return self(near, context) * rows / near
        if len(pts) == 1 or context <= pts[0][0]:  # below the shortest measured context: its value
            return pts[0][1]
        cs = [c for c, _ in pts]
        i = min(max(int(np.searchsorted(cs, context)), 1), len(cs) - 1)
        (c0, v0), (c1, v1) = pts[i - 1], pts[i]
        return v0 + (v1 - v0) * (context - c0) / (c1 - c0)


CpuCost = Callable[..., float]  # (rows, context, prompt=False) -> ms: a CpuWork or a stand-in


def forward_ms(plan: Plan, rates: Rates, cpu: CpuCost, rows: int, context: int,
               prompt: bool = False) -> dict:
    """One forward of `rows` rows at `context`: decode rows (logits of every row) or a prompt's."""
    npu = plan.npu_ms(rows, rates, 1 if prompt else None)
    engine = plan.rounds * math.ceil(rows / M_MAX) * (rates.engine_us or 0.0) / 1e3
    c = cpu(rows, context, prompt)
    return {"rows": rows, "context": context, "npu_ms": npu, "engine_ms": engine, "cpu_ms": c, "ms": npu + engine + c}


@dataclass(frozen=True)
class Replayed:
    """A greedy answer's decode under drafting: `tokens` decoded after the prompt's forward, in
    forwards of `rows` rows each (bench.decode.replay under `cost_profile`), at about `context`."""

    family: str
    context: int
    tokens: int
    rows: tuple[int, ...]


def predict(plan: Plan, rates: Rates, cpu: CpuCost, contexts: Sequence[int] = (512, 2048, 8192),
            prefill_rows: Sequence[int] = (32, 128), drafting: Sequence[Replayed] = ()) -> dict:
    """Decode tok/s at each context, prefill tok/s of a prompt of `rows` rows (one chunk), and
    decode with prompt-lookup drafting for each replayed answer."""
    res: dict = {"weight_bytes": plan.weight_bytes, "scale_bytes": plan.scale_bytes, "calls": plan.calls,
                 "rounds": plan.rounds, "layers": plan.layers, "rates": dict(rates.__dict__),
                 "decode": [], "prefill": [], "drafting": []}
    for ctx in contexts:
        f = forward_ms(plan, rates, cpu, 1, ctx)
        res["decode"].append({**f, "tok_s": 1e3 / f["ms"], "vs_rkllm": 1e3 / f["ms"] / RKLLM["decode_tok_s"]})
    rk_prefill = RKLLM_PREFILL_ROWS / (RKLLM["ttft_128_ms"] / 1e3)
    res["rkllm_prefill_tok_s"] = rk_prefill
    for rows in prefill_rows:
        f = forward_ms(plan, rates, cpu, rows, rows, prompt=True)
        tps = rows / f["ms"] * 1e3
        res["prefill"].append({**f, "tok_s": tps, "vs_rkllm": tps / rk_prefill})
    for r in drafting:
        total = sum(forward_ms(plan, rates, cpu, n, r.context)["ms"] for n in r.rows)
        plain = forward_ms(plan, rates, cpu, 1, r.context)["ms"]
        tps = r.tokens / total * 1e3
        res["drafting"].append({"family": r.family, "context": r.context, "forwards": len(r.rows),
                                "tokens": r.tokens, "verify_rows": sum(n for n in r.rows if n > 1), "ms": total,
                                "tok_s": tps, "plain_tok_s": 1e3 / plain, "vs_rkllm": tps / RKLLM["decode_tok_s"]})
    return res


def cost_profile(plan: Plan, rates: Rates, cpu: CpuCost, context: int) -> Callable[[int], float]:
    """The drafting cost profile (edge_llm/backends/__init__.py): T rows relative to one row."""
    one = forward_ms(plan, rates, cpu, 1, context)["ms"]
    return lambda rows: forward_ms(plan, rates, cpu, rows, context)["ms"] / one


class TimedMatmul:
    """An `Int8Matmul` that counts the time spent inside the engine's `run`, so a forward's time
    minus it is the CPU work around the matmuls (quantize, dequantize, norms, attention, ...)."""

    def __init__(self, inner: Int8Matmul):
        self.inner = inner
        self.numerics = inner.numerics
        self.selftest = inner.selftest
        self.seconds = 0.0
        self.calls = 0

    def add(self, name: str, w: np.ndarray) -> None:
        self.inner.add(name, w)

    def run(self, name: str, a: np.ndarray) -> np.ndarray:
        t = CLOCK()
        try:
            return self.inner.run(name, a)
        finally:
            self.seconds += CLOCK() - t
            self.calls += 1

    def close(self) -> None:
        self.inner.close()

    def reset(self) -> None:
        self.seconds, self.calls = 0.0, 0


def _ms(x: float) -> str:
    return f"{x:.1f}"


def markdown(res: dict, cpu_isa: str, parts: dict[str, float] | None = None) -> str:
    """The prediction table, each figure next to RKLLM's (docs/npu.md, "Prediction")."""
    r = res["rates"]
    rk = RKLLM["decode_tok_s"]
    lines = [f"## Prediction: the matmul path, {res['layers']} layers", "",
             f"- int8 weights per token {res['weight_bytes'] / 1e9:.3f} GB (+ {res['scale_bytes'] / 1e6:.1f} MB of "
             f"float32 channel scales, read by the CPU); {res['calls']} rknn_matmul_run calls per forward in "
             f"{res['rounds']} rounds (one context per core)",
             f"- NPU: {r['bw_all_gbs']} GB/s over {r['cores']} cores, {r['bw_core_gbs']} GB/s on one ({SOURCES['bandwidth']}); "
             f"{r['call_us']} us per call ({SOURCES['call']}); {r['macs_per_cycle']} MACs/cycle/core at "
             f"{r['hz'] / 1e9:.1f} GHz ({SOURCES['peak']})",
             (f"- engine: {r['engine_us']:.1f} us per round ({SOURCES['engine']}; {res.get('engine_on', '')})"
              if r.get("engine_us") is not None else
              "- engine: its own time per round NOT measured (no library given: --lib) and counted as 0"),
             f"- CPU work measured on {cpu_isa}, not scaled to the board's Cortex-A76 cores"
             + (f"; {res['cpu']['layers']} layers timed over recorded products (no weight stream through this "
                "CPU's caches)" if res.get("cpu", {}).get("recorded") else ""), "",
             "| forward | context | NPU ms | engine ms | CPU ms | ms | predicted tok/s | RKLLM tok/s | vs RKLLM |",
             "|---|---|---|---|---|---|---|---|---|"]
    for d in res["decode"]:
        lines.append(f"| decode, 1 row | {d['context']} | {_ms(d['npu_ms'])} | {_ms(d['engine_ms'])} | "
                     f"{_ms(d['cpu_ms'])} | {_ms(d['ms'])} | {d['tok_s']:.2f} | {rk} | {d['vs_rkllm']:.2f}x |")
    for d in res["drafting"]:
        lines.append(f"| decode + drafting, {d['family']} ({d['tokens']} tokens in {d['forwards']} forwards, "
                     f"{d['verify_rows']} verify rows) | {d['context']} | | | | {_ms(d['ms'] / d['forwards'])} per forward | "
                     f"{d['tok_s']:.2f} | {rk} | {d['vs_rkllm']:.2f}x |")
    for p in res["prefill"]:
        lines.append(f"| prefill, {p['rows']}-row prompt | {p['context']} | {_ms(p['npu_ms'])} | {_ms(p['engine_ms'])} | "
                     f"{_ms(p['cpu_ms'])} | "
                     f"{_ms(p['ms'])} | {p['tok_s']:.0f} | {res['rkllm_prefill_tok_s']:.0f} (128-token TTFT) | "
                     f"{p['vs_rkllm']:.2f}x |")
    if parts:
        lines += ["", "CPU ms op by op (one thread): " + "; ".join(f"{k} {v:.3f}" for k, v in parts.items())]
    return "\n".join(lines) + "\n"
