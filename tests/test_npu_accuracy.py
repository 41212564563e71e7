"""The NPU graphs on a real model: the embedded default model (SmolLM2-135M, real weights, all 30
layers) converted by the real CLI with rknn-toolkit2 2.5.0, then the engine on the toolkit's fp16
simulator against the exact CPU backend; and cpu-q (which reuses the exporter) the same way.

Tiny random models never showed the problem this guards: SmolLM2's residual stream carries a
massive activation (about 24,900 in one channel from layer 12 on) whose square overflowed fp16 in
the old RMSNorm, and the simulator answered "The capital of France is called The Redrescent"
(docs/npu.md, "fp16 range"). The targets below are the floors the docs quote; measured values
are printed."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from edge_llm.backends.graph.manifest import Manifest
from edge_llm.backends.npu.graphs.sim import converter_python
from edge_llm.bench import accuracy
from edge_llm.convert.report import FP16_REL_LIMIT, range_summary, worst
from edge_llm.errors import ConfigError

try:
    converter_python()
except ConfigError as e:  # `make test` builds it; a bare pytest run may not have it
    pytestmark = pytest.mark.skip(reason=f"converter venv missing ({e}); run tools/setup-converter.sh")

SIM_COSINE, SIM_TOP1, SIM_KL = 0.999, 0.98, 1e-3  # fp16 simulator vs F32 (measured: 0.99999+, 100 %, 2e-5)
Q_TOP1, Q_KL = 0.95, 0.005  # cpu-q q4-int8 vs F32 (measured: 98.0 %, 0.0029)
Q4_KL = 0.0015  # cpu-q q4 vs F32, the bar of docs/quantization.md (measured: below 0.00001)
# w8a8 (rotated, the default) in the simulator vs F32: floors under what `bench accuracy` measures
# today (0.9963, 93.1 %, 0.024 on 320 tokens), not the targets of docs/npu.md "w8a8" (top-1 >= 95 %,
# KL <= 0.005), which it does not reach yet; unrotated graphs measure 90.0 % and 0.034, under them
W8_COSINE, W8_TOP1, W8_KL = 0.98, 0.90, 0.035


@pytest.fixture(scope="module")
def default_dir(edge_home):
    return next(edge_home.glob("models/*/config.json")).parent


@pytest.fixture(scope="module")
def converted(default_dir, edge_home, tmp_path_factory):
    out = tmp_path_factory.mktemp("rknn-default")
    work = tmp_path_factory.mktemp("cwd")  # nothing may be left in the working directory
    r = subprocess.run([sys.executable, "-m", "edge_llm", "convert", "rknn", str(default_dir), str(out)],
                       capture_output=True, text=True, timeout=1800, cwd=work,
                       env={**os.environ, "EDGE_LLM_HOME": str(edge_home)})
    assert r.returncode == 0, r.stderr[-3000:]
    assert not list(work.iterdir()), list(work.iterdir())  # the toolkit's check*.onnx dumps stay out
    return out, r.stdout


@pytest.fixture(scope="module")
def converted_w8a8(default_dir, edge_home, tmp_path_factory):
    out = tmp_path_factory.mktemp("rknn-default-w8a8")
    work = tmp_path_factory.mktemp("cwd8")
    r = subprocess.run([sys.executable, "-m", "edge_llm", "convert", "rknn", str(default_dir), str(out), "--dtype",
                        "w8a8"], capture_output=True, text=True, timeout=1800, cwd=work,
                       env={**os.environ, "EDGE_LLM_HOME": str(edge_home)})
    assert r.returncode == 0, r.stderr[-3000:]
    assert not list(work.iterdir()), list(work.iterdir())
    return out, r.stdout


def on_cpu(m: Manifest) -> set[tuple[str, int, str]]:
    """(graph, rows, op) of every op the compiler left to the CPU."""
    return {(g.name, int(t["rows"]), op) for g in m.graphs for t in g.cost for op in t["cpu_ops"]}


def verify_head_transposes(m: Manifest) -> set[tuple[str, int, str]]:
    """The one CPU op allowed: the output Transpose of a head part at its multi-row shape (the
    speculative verify forward's, schema.head_rows; docs/npu.md)."""
    return {(g.name, max(g.rows), "Transpose") for g in m.graphs if g.kind in ("head", "head_n") and len(g.rows) > 1}


def test_range_report_sees_the_massive_activation(converted):
    out, stdout = converted
    m = Manifest.read(out)
    # all of the shipped calibration text (2,420 tokens in SmolLM2's tokenizer), as a chat message
    assert 2000 < m.calibration["tokens"] < 4096 and "built-in calibration text as a chat user message" in \
        m.calibration["source"]
    ranges = {g.name: range_summary(g) for g in m.graphs}
    assert None not in ranges.values()
    # what broke the old norm is in the capture: layer 12's input row 0 carries ~24,900
    assert 2e4 < ranges["layer12.qkv"]["input"] < 32752
    worst_graph = min(ranges, key=lambda n: ranges[n]["headroom"])
    print(f"smallest headroom {ranges[worst_graph]['headroom']:.2f}x in {worst_graph} "
          f"({ranges[worst_graph]['worst']})")
    assert ranges[worst_graph]["headroom"] >= 2.0 and "smallest headroom" in stdout
    assert "Tensor ranges on real activations" in (out / "report.md").read_text()
    # every op of every graph on the NPU: no CPU round trip inside a graph (the norm's design),
    # but for the head's verify shape, whose output leaves the NPU's layout on the CPU
    assert on_cpu(m) <= verify_head_transposes(m)
    # per-graph simulator accuracy, on real activations (row 0 = the attention-sink token)
    for g in m.graphs:
        w = worst(g)
        assert w["max_rel"] <= FP16_REL_LIMIT and w["cosine"] >= 0.9999, (g.name, w)


NEAR_TIE = 0.1  # logits: the France prompt's first token is 'The' 25.325 vs 'L' 25.243 on the CPU


def _simulator_meets(out, default_dir, record_property, dtype: str, cosine: float, top1: float, kl: float,
                     near_ties: bool = False) -> None:
    """The engine on the simulator vs the CPU backend: floors on the prompts' last-token cosine
    and argmax, teacher-forced top-1 and KL, and the France answer token for token. With
    `near_ties` (int8 activations, as cpu-q's: test_cpu_q_agrees_with_cpu_on_the_default_model)
    an argmax may flip to the CPU's second choice where the CPU's own margin is below NEAR_TIE,
    and the France answer then goes its own way from its first token."""
    res = accuracy.run(str(default_dir), "rknn", str(out), "sim", teacher_tokens=256, greedy_tokens=0)
    print(accuracy.markdown(res))
    record_property("min_cosine", res["min_cosine"])
    assert f"rknn-sim-2.5.0-{dtype}" in res["numerics"]
    flips = [p for p in res["prompts"] if not p["argmax_equal"]]
    assert res["min_cosine"] >= cosine
    assert not flips or near_ties and all(p["ref_margin"] < NEAR_TIE and p["other_is_ref_second"] for p in flips)
    assert res["teacher"]["top1"] >= top1 and res["teacher"]["kl"] <= kl
    france = res["prompts"][0]  # the answer's question: its first token is that prompt's argmax
    assert france["prompt"] == res["answer"]["question"][:60]
    assert res["answer"]["same_tokens"] or not france["argmax_equal"]


def test_simulator_agrees_with_cpu_on_the_default_model(converted, default_dir, record_property):
    _simulator_meets(converted[0], default_dir, record_property, "fp16", SIM_COSINE, SIM_TOP1, SIM_KL)


def test_onnxruntime_runs_the_same_graphs_as_cpu(converted, default_dir):
    """The graphs themselves (F32): what the simulator adds on top of them is fp16 alone."""
    out, _ = converted
    res = accuracy.run(str(default_dir), "rknn", str(out), "onnxruntime", teacher_tokens=64, greedy_tokens=0)
    assert res["min_cosine"] >= 0.99999 and res["teacher"]["top1"] == 1.0
    assert res["answer"]["same_tokens"]


def test_cpu_q_agrees_with_cpu_on_the_default_model(default_dir, edge_home, monkeypatch):
    """cpu-q's graphs come from the same exporter. `q4` (float activations in prefill, two int8
    passes in decode) meets the bar of docs/quantization.md, "Where the error comes from": KL <=
    0.0015 and every acceptance prompt's greedy answer (bench/accuracy.py PROMPTS, the France
    question first) equal to F32's, token for token. `q4-int8` (int8 activations, what q4 was
    before) stays within its older floors but flips the France answer at its first token, a near
    tie on the CPU (25.325 'The' vs 25.243 'L'): that flip is the int8 activations'."""
    from edge_llm.bench import quant_variants

    monkeypatch.setenv("EDGE_LLM_HOME", str(edge_home))  # cpu-q's graph directories: the session's
    res = accuracy.run(str(default_dir), "cpu-q", teacher_tokens=256, greedy_tokens=0)
    print(accuracy.markdown(res))
    assert "acc0-x2" in res["numerics"]
    assert res["min_cosine"] >= 0.9999 and res["teacher"]["top1"] >= 0.99 and res["teacher"]["kl"] <= Q4_KL
    assert res["answer"]["same_tokens"] and "Paris" in res["answer"]["other"]
    json.dumps(res)  # what `bench accuracy` saves
    variants = quant_variants.run(str(default_dir), 256, emulate=False)
    rows = {r["variant"].split()[2]: r for r in variants["rows"]}
    print(quant_variants.markdown(variants))
    # the board's figures beside each row: the same 4-bit blocks in both modes, under a quarter of F32's bytes
    assert rows["q4"]["weight_bytes"] == rows["q4-int8"]["weight_bytes"] < variants["f32"]["weight_bytes"] / 4
    assert min(r["decode_tok_s"] for r in rows.values()) > 0 and variants["f32"]["decode_tok_s"] > 0
    assert rows["q4"]["kl"] <= Q4_KL and all(rows["q4"]["same_answers"])
    int8 = rows["q4-int8"]
    assert int8["top1"] >= Q_TOP1 and int8["kl"] <= Q_KL and not int8["same_answers"][0]


def test_w8a8_conversion_is_int8_where_it_holds_and_cheaper(converted, converted_w8a8):
    """The int8 builds that keep their calibration rows are kept, the others are fp16 (and named);
    the compiler predicts the int8 set cheaper than the fp16 one at every shape."""
    from edge_llm.convert.report import predicted_ms

    (out16, _), (out8, stdout) = converted, converted_w8a8
    m16, m8 = Manifest.read(out16), Manifest.read(out8)
    assert m8.dtype == "w8a8" and m8.identity() != m16.identity()
    assert (out8 / "cpu_side.npz").is_file() and all((out8 / "calib" / f"{g.name}.npz").is_file() for g in m8.graphs)
    fp16 = m8.quant["fp16_graphs"]
    assert set(fp16) == {g.name for g in m8.graphs if g.dtype == "float16"}
    assert all(v < m8.quant["min_cosine"] for v in fp16.values())
    kept = [g for g in m8.graphs if m8.graph_dtype(g) == "w8a8"]
    assert len(kept) >= 0.8 * len(m8.graphs), fp16
    for g in kept:
        per = g.accuracy[str(max(g.rows))]
        assert min(o["row_cosine_mean"] for o in per.values()) >= m8.quant["min_cosine"], g.name
    assert on_cpu(m8) <= verify_head_transposes(m8)
    for rows in m8.chunks:
        print(f"{rows} rows: fp16 {predicted_ms(m16, rows):.3f} ms, w8a8 {predicted_ms(m8, rows):.3f} ms")
        assert predicted_ms(m8, rows) < 0.8 * predicted_ms(m16, rows)
    assert sum(g.rknn_bytes for g in m8.graphs) < 0.8 * sum(g.rknn_bytes for g in m16.graphs)
    assert "w8a8:" in stdout and "graphs int8" in stdout


def test_w8a8_simulator_on_the_default_model(converted_w8a8, default_dir, record_property):
    assert Manifest.read(converted_w8a8[0]).quant["rotation"] == "hadamard"
    # measured with the one-row head: "The capital of France is Paris.", the CPU's tokens; with the
    # head also built for a verify forward's 32 rows (its int8 scales from the 32-row shape): 'L' for
    # 'The' at that near tie (margin 0.08 on the CPU), top-1 92.5 %, KL 0.027 (docs/npu.md "w8a8")
    _simulator_meets(converted_w8a8[0], default_dir, record_property, "w8a8", W8_COSINE, W8_TOP1, W8_KL,
                     near_ties=True)
