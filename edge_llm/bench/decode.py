"""`edge-llm bench decode`: plain vs speculative decoding (docs/speculative.md) on three prompt
families, for backends cpu and cpu-q, next to llama.cpp's plain decode in the same run, and the
NPU's effective decode predicted from the compiler's cycle estimates and the measured acceptance.

Families (greedy, the default model through the chat template):
- recall: answering from a long context by quoting it (the lab's kind of follow-up);
- code: a code file sent back with an edit;
- chat: open chat, where the answer is not in the conversation.
Each (backend, family) runs plain (`draft = "off"`) and speculative (`draft = "ngram"`, the real
adaptive policy, costs measured as it runs) `repeats` times alternately; the best decode speed
of each counts. The text of both is compared (it can differ only at a near-tie of batched vs
one-row rounding: docs/speculative.md).

The NPU column replays the engine's drafting (`replay`: the real `Drafter`, greedy verification)
on the plain run's text with the NPU's own cost profile, the compiler's cycle estimates of the
converted graphs (`rknn.compiler_cycles`; a conversion of the first N layers is extrapolated to
the model's layer count with `npu_layers`): the forwards the NPU would run for that answer, and
their predicted time. Greedy text does not depend on drafting, so the replay needs no NPU.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np

from edge_llm.backends.cost import ForwardCost
from edge_llm.backends.graph.schema import HEAD, HEAD_N
from edge_llm.backends.graph.manifest import Manifest
from edge_llm.backends.npu.backend import compiler_cycles
from edge_llm.bench.rkllm import RKLLM
from edge_llm.convert.report import NPU_HZ
from edge_llm.drafting import DraftConfig, Drafter

_LOG = "".join(f"On day {d + 1} the {w} warehouse received {3 * d + 7} crates of {g}.\n"
               for d, (w, g) in enumerate([("north", "copper wire"), ("south", "steel bolts"),
                                           ("east", "glass panes"), ("west", "machine oil")] * 10))
_CODE = '''def moving_average(values, window):
    """The mean of each run of `window` consecutive values."""
    if window < 1:
        raise ValueError("window must be at least 1")
    total = 0.0
    out = []
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            out.append(total / window)
    return out


def clamp(value, low, high):
    """`value` limited to the range [low, high]."""
    if low > high:
        raise ValueError("low must not exceed high")
    return max(low, min(high, value))
'''
FAMILIES = {
    "recall": f"{_LOG}\nCopy the lines about the east warehouse exactly as they are written above.",
    "code": f"```python\n{_CODE}```\nRewrite this code with the parameter `values` renamed to `samples`. "
            "Output the whole code.",
    "chat": "Write a short poem about the sea.",
}


def chat_ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n")


def _one(eng, ids: list[int], mode: str, max_tokens: int) -> dict:
    from edge_llm.drafting import DraftConfig
    from edge_llm.engine import GenerationRequest

    eng.draft = DraftConfig(mode, eng.draft.max_tokens, eng.draft.ngram)
    eng.cache.reset()  # every run prefills cold: only the decode differs
    last = list(eng.generate(GenerationRequest(list(ids), max_tokens=max_tokens)))[-1]
    t, n = last.timings, len(last.completion_ids)
    return {"tokens": n, "decode_tps": (n - 1) / (t.decode_ms / 1e3), "forwards": t.decode_forwards,
            "drafted": t.drafted_tokens, "accepted": t.accepted_tokens, "draft_forwards": t.draft_forwards,
            "ids": last.completion_ids}


def replay(prompt: list[int], tokens: list[int], cost: ForwardCost | Callable[[int], float],
           config: DraftConfig = DraftConfig()) -> list[int]:
    """The rows of each decode forward the engine runs for a greedy answer `tokens` (its first
    token comes from the prompt's forward) with drafting by `config` under `cost`: each draft is
    verified against the answer itself, as greedy verification would (Engine._step)."""
    d = Drafter(config, cost, np.asarray(prompt, np.int64), len(tokens))
    d.append(tokens[0])
    rows, i = [], 1
    while i < len(tokens):
        draft = d.propose(len(tokens) - i - 1)
        k = 0
        while k < draft.size and draft[k] == tokens[i + k]:
            k += 1
        if draft.size:
            d.verified(int(draft.size), k)
        for t in tokens[i:i + k + 1]:
            d.append(t)
        rows.append(1 + int(draft.size))
        i += k + 1
    return rows


def npu_forward_ms(m: Manifest, rows: int, layers: int | None = None) -> float:
    """Compiler-predicted time of one forward of `rows` rows (`rknn.compiler_cycles`), NPU at NPU_HZ."""
    c = compiler_cycles(m, rows, layers)
    if c is None:
        raise ValueError(f"{m.model.get('name', 'the model')}: no compiler estimate for {rows} rows")
    return c / NPU_HZ * 1e3


def npu_prediction(m: Manifest, prompt: list[int], tokens: list[int], layers: int | None = None,
                   config: DraftConfig = DraftConfig()) -> dict:
    """The NPU's decode of a greedy answer: plain (one row per token) and speculative (`replay`
    under the compiler's profile: what backend rknn's drafting would do)."""
    plain_ms = npu_forward_ms(m, 1, layers)
    cache: dict[int, float] = {}

    def ms(rows: int) -> float:
        if rows not in cache:
            cache[rows] = npu_forward_ms(m, rows, layers)
        return cache[rows]

    rows = replay(prompt, tokens, lambda r: ms(r) / plain_ms, config)
    total = sum(ms(r) for r in rows)
    eff = (len(tokens) - 1) / (total / 1e3) if total else 0.0
    head_rows = sorted({r for g in m.graphs if g.kind in (HEAD, HEAD_N) for r in g.rows})
    verify = [r for r in rows if r > 1]
    return {"plain_tps": 1e3 / plain_ms, "effective_tps": eff, "forwards": len(rows), "verify_forwards": len(verify),
            "drafted": sum(verify) - len(verify), "tokens_per_forward": (len(tokens) - 1) / len(rows) if rows else 0.0,
            "plain_ms": plain_ms, "verify_ms": {r: cache[r] for r in sorted(cache) if r > 1}, "head_rows": head_rows,
            "layers": layers or m.layers, "vs_rkllm": eff / RKLLM["decode_tok_s"]}


def run(backends=("cpu", "cpu-q"), families=tuple(FAMILIES), max_tokens: int = 128, threads: int = 2,
        repeats: int = 2, peer_py: str | None = None, rknn_dir: str | None = None,
        step: Callable[[str], None] = lambda _m: None, npu_layers: int | None = None, model: str = "default",
        settings: Mapping[str, Mapping[str, object]] = {}) -> dict:
    """Plain vs drafted decode of each family on each backend of `model`; `settings`: more settings of a
    backend's runtime by backend name (bench board: backend rknn's rknn_dir and runner)."""
    from threadpoolctl import threadpool_info

    from edge_llm.backends.cpuq.backend import kernel_isa
    from edge_llm.bench.quant import Peer, peer_python
    from edge_llm.checkpoints.packaged import default_gguf_path
    from edge_llm.runtime import load_runtime
    from edge_llm.settings import Settings, resolve

    manifest = Manifest.read(rknn_dir) if rknn_dir else None
    res: dict = {"max_tokens": max_tokens, "threads": threads, "repeats": repeats, "cpu": os.cpu_count(),
                 "isa": kernel_isa(), "rows": [],
                 "blas": [f"{i.get('internal_api')} {i.get('version')} {i.get('architecture', '')}"
                          for i in threadpool_info() if i.get("user_api") == "blas"]}
    py = peer_python(peer_py)
    peer = None
    prompts: dict[str, list[int]] = {}
    try:
        for backend in backends:
            step(f"loading {backend}")
            name, _, quant = backend.partition(":")  # "cpu-q:q4-int8": backend cpu-q in that quant mode
            eng = load_runtime(resolve(Settings(backend=name, model=model, disk_kv=None, log_file=None,
                                                threads=threads, max_seq=4096,
                                                **({"quant": quant} if quant else {}), **settings.get(backend, {}))))
            if not prompts:
                prompts = {f: chat_ids(eng.tokenizer, FAMILIES[f]) for f in families}
                if py is not None:
                    peer = Peer(py, default_gguf_path(), threads, max(map(len, prompts.values())) + max_tokens + 8)
                    res["peer"] = peer.call(op="info")
            res.setdefault("numerics", {})[backend] = eng.model.numerics
            _one(eng, prompts[families[0]], "ngram", 8)  # warm-up: a first one-row step measured
            for fam in families:
                ids = prompts[fam]
                best: dict[str, dict] = {}
                for r in range(repeats):
                    for mode in ("off", "ngram"):
                        step(f"{backend} {fam}: {mode} ({r + 1}/{repeats})")
                        got = _one(eng, ids, mode, max_tokens)
                        if mode not in best or got["decode_tps"] > best[mode]["decode_tps"]:
                            best[mode] = got
                plain, spec = best["off"], best["ngram"]
                diff = next((i for i, (a, b) in enumerate(zip(plain["ids"], spec["ids"])) if a != b), None)
                row = {"backend": backend, "family": fam, "prompt_tokens": len(ids),
                       "plain": {k: v for k, v in plain.items() if k != "ids"},
                       "spec": {k: v for k, v in spec.items() if k != "ids"},
                       "speedup": spec["decode_tps"] / plain["decode_tps"],
                       "acceptance": spec["accepted"] / spec["drafted"] if spec["drafted"] else 0.0,
                       "tokens_per_forward": spec["tokens"] / (spec["forwards"] + 1),
                       "same_text": plain["ids"] == spec["ids"], "first_difference": diff}
                if manifest is not None:
                    row["npu"] = npu_prediction(manifest, ids, plain["ids"], npu_layers, eng.draft)
                res["rows"].append(row)
            eng.close()
        if peer is not None:
            for fam in families:
                step(f"llama.cpp {fam}")
                with tempfile.TemporaryDirectory(prefix="edge-llm-bench-decode-") as tmp:
                    got = min((peer.call(op="speed", ids=prompts[fam], decode=max_tokens, tail=8,
                                         state=str(Path(tmp) / "llama.state")) for _ in range(repeats)),
                              key=lambda g: g["decode_s"])
                res.setdefault("llamacpp", {})[fam] = max_tokens / got["decode_s"]
    finally:
        if peer is not None:
            peer.close()
    return res


def markdown(res: dict) -> str:
    lines = [f"## bench decode: plain vs speculative (prompt lookup), {res['max_tokens']} greedy tokens", "",
             f"- CPU: {res['cpu']} cores, kernels {res['isa']}; BLAS {'; '.join(res['blas']) or '-'}; "
             f"threads {res['threads']}; best of {res['repeats']}",
             f"- llama.cpp: {res.get('peer', {}).get('version', 'not run')} (plain decode of the same prompt ids)", "",
             "| backend | family | prompt | plain tok/s | spec tok/s | speedup | accepted / drafted | "
             "tokens / forward | same text | llama.cpp tok/s | plain / llama.cpp | NPU predicted tok/s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        plain, spec = r["plain"]["decode_tps"], r["spec"]["decode_tps"]
        peer = res.get("llamacpp", {}).get(r["family"])
        peer_s, ratio = (f"{peer:.1f}", f"{plain / peer:.2f}x") if peer else ("-", "-")
        npu = f"{r['npu']['effective_tps']:.1f}" if "npu" in r else "-"
        same = "yes" if r["same_text"] else f"no (token {r['first_difference']})"
        lines.append(f"| {r['backend']} | {r['family']} | {r['prompt_tokens']} | {plain:.1f} | {spec:.1f} | "
                     f"{r['speedup']:.2f}x | {r['spec']['accepted']} / {r['spec']['drafted']} | "
                     f"{r['tokens_per_forward']:.2f} | {same} | {peer_s} | {ratio} | {npu} |")
    if any("npu" in r for r in res["rows"]):
        n = next(r["npu"] for r in res["rows"] if "npu" in r)
        verify = ", ".join(f"{r} rows {t:.1f} ms" for r, t in n["verify_ms"].items())
        lines += ["", f"NPU: compiler estimate at 1 GHz for {n['layers']} layers, one-row step {n['plain_ms']:.1f} ms "
                      f"({n['plain_tps']:.1f} tok/s); verify forwards {verify or '-'}; head graph shapes "
                      f"{n['head_rows']}; the drafting replayed on the plain text with this profile; "
                      f"RKLLM w8a8: {RKLLM['decode_tok_s']} tok/s"]
    return "\n".join(lines) + "\n"
