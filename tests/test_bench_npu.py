"""`edge-llm bench npu`: refuses without an NPU; on a host its measurements run through a host runner."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from edge_llm.backends.graph.onnx_export import export_graph_set
from edge_llm.backends.npu.backend import npu_present


@pytest.mark.skipif(npu_present() is not None, reason="this machine has an NPU")
def test_without_npu_it_says_so_and_fails(tiny_synth_dir, tmp_path):
    r = subprocess.run([sys.executable, "-m", "edge_llm", "bench", "npu", "--model", str(tiny_synth_dir),
                        "--rknn-dir", str(tmp_path), "--out", str(tmp_path / "res")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "no RKNPU device on this machine" in r.stderr
    assert not (tmp_path / "res").exists()


def test_host_runner_measures_everything(tiny_synth_dir, tmp_path):
    export_graph_set(tiny_synth_dir, tmp_path / "g")
    r = subprocess.run([sys.executable, "-m", "edge_llm", "bench", "npu", "--model", str(tiny_synth_dir),
                        "--rknn-dir", str(tmp_path / "g"), "--runner", "onnxruntime", "--repeats", "2",
                        "--prefill-tokens", "64", "--decode-steps", "4", "--out", str(tmp_path / "res")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(next((tmp_path / "res").glob("*-bench-npu/npu.json")).read_text())
    assert {(g["graph"], g["rows"]) for g in res["graphs"]} >= {("layer00.qkv", 1), ("layer00.qkv", 128), ("head", 1)}
    assert [p["chunk"] for p in res["prefill"]] == [1, 32, 128] and all(p["tok_s"] > 0 for p in res["prefill"])
    assert res["decode_tok_s"] > 0 and res["ttft_128_ms"] > 0 and res["ratio_to_rkllm"]["decode"] > 0
    assert "onnxruntime" in res["numerics"] and "TTFT 128 tokens" in r.stdout
    # qkv + post per layer and the head: what a decode token costs in calls (no estimate: no overhead)
    layers = json.loads((tiny_synth_dir / "config.json").read_text())["text_config"]["num_hidden_layers"]
    assert res["calls_per_token"] == 2 * layers + 1 and res["per_call_overhead_ms"] is None
    assert "graph calls per decode token" in r.stdout


# ---- the matmul path -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def default_mm(default_model_dir, default_mm_rtn):
    """The default model (real weights) and its `convert npu-mm` directory, rounded to nearest
    (the bench measures speed, which the weights' values do not change)."""
    return default_model_dir, default_mm_rtn


@pytest.mark.timeout(900)
def test_matmul_path_through_the_fake_library(default_mm, fake_librknnrt, tmp_path):
    """`bench npu` on an npu-mm directory end to end, through the binding and the tests' fake
    librknnrt.so (C on this CPU standing in for Rockchip's closed library: no NPU here); the table
    says the figures are the fake's, and the prediction next to them is the model's arithmetic."""
    from edge_llm.bench.npu.predict import Plan, Rates
    from edge_llm.config import ModelArgs

    model, mm = default_mm
    r = subprocess.run([sys.executable, "-m", "edge_llm", "bench", "npu", "--model", str(model), "--rknn-dir", str(mm),
                        "--lib", str(fake_librknnrt), "--repeats", "1", "--contexts", "512,8192",
                        "--out", str(tmp_path / "res")],
                       capture_output=True, text=True, timeout=840)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(next((tmp_path / "res").glob("*-bench-npu/npu.json")).read_text())
    assert res["path"] == "matmul" and res["npu"] is None
    assert "NO NPU on this machine: the library is a stand-in" in r.stdout
    m = res["micro"]
    assert m["run_us"] > 0 and m["round_us"] > 0 and set(m["gbps"]["2048x6144"]) == {"1 core", "3 cores"}
    assert [d["context"] for d in res["decode"]] == [512, 8192] and all(d["tok_s"] > 0 for d in res["decode"])
    plan = Plan.of(ModelArgs.from_dir(model))
    # the 8K KV cache (30 layers x 2 x 192 floats x 4 B per row) and the int8 weights the fake holds
    assert res["rss_context"] == 8192 and res["rss_mb"] > (30 * 2 * 192 * 4 * 8192 + plan.weight_bytes) / 2**20
    assert [p["rows"] for p in res["prefill"]] == [32, 128] and all(p["tok_s"] > 0 for p in res["prefill"])
    pred = res["predicted"]["decode"][0]
    assert pred["npu_ms"] == pytest.approx(plan.npu_ms(1, Rates()), rel=1e-9)
    # the engine's own time per round (a round over the fake minus the fake's run alone) is counted
    # (a difference of two medians of timed loops: 0 when a busy machine preempts the shorter one,
    # so its sign is not judged, only that it is the difference and is what the prediction counts)
    assert m["engine_us"] == pytest.approx(max(m["round_us"] - m["lib_run_us"], 0)) and m["engine_us"] >= 0
    assert pred["engine_ms"] == pytest.approx(plan.rounds * m["engine_us"] / 1e3)
    assert pred["ms"] == pytest.approx(pred["npu_ms"] + pred["engine_ms"] + pred["cpu_ms"]) and pred["cpu_ms"] > 0
    mes = res["predicted_measured_rates"]["decode"][0]
    assert mes["cpu_ms"] == pred["cpu_ms"] and mes["npu_ms"] != pred["npu_ms"] and mes["engine_ms"] == pred["engine_ms"]
    assert "| decode at 8192 |" in r.stdout and "| prefill, 128-row prompt |" in r.stdout
    assert "RSS with a 8192-token KV cache written" in r.stdout
    # cpu-q's decode on the A76 cores predicted beside the NPU's (docs/npu.md, "NPU or CPU decode")
    assert "## NPU or CPU decode: cpu-q on the four A76 cores" in r.stdout and "rk-llama.cpp" in r.stdout
    from edge_llm.bench.npu.a76 import CPU_Q_BYTES_PER_WEIGHT, weights

    assert res["cpu_q"]["bytes_per_token"] == weights(ModelArgs.from_dir(model)) * CPU_Q_BYTES_PER_WEIGHT


@pytest.mark.timeout(600)
def test_predict_only_prints_the_prediction(tiny_synth_dir, edge_home, tmp_path, fake_librknnrt):
    """`--predict-only` on any machine: the CPU work measured here on a conversion, run at
    --npu-layers, the drafting rows of bench decode's answers (default model, cpu backend), the
    engine's own time per round measured over --lib (here the tests' fake librknnrt, C on this CPU
    standing in for Rockchip's library: only the engine's time around its call is used)."""
    from edge_llm.bench.npu.predict import Plan, Rates
    from edge_llm.config import ModelArgs
    from edge_llm.convert.npu_mm import convert_mm8

    convert_mm8(tiny_synth_dir, tmp_path / "mm", gptq_tokens=0)
    env = {**os.environ, "EDGE_LLM_HOME": str(edge_home)}
    r = subprocess.run([sys.executable, "-m", "edge_llm", "bench", "npu", "--model", str(tiny_synth_dir),
                        "--rknn-dir", str(tmp_path / "mm"), "--predict-only", "--npu-layers", "28",
                        "--drafting-tokens", "16", "--contexts", "256", "--repeats", "1", "--lib", str(fake_librknnrt),
                        "--out", str(tmp_path / "res")],
                       capture_output=True, text=True, timeout=540, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(next((tmp_path / "res").glob("*-bench-npu/npu.json")).read_text())
    args = ModelArgs.from_dir(tiny_synth_dir)
    plan_args = ModelArgs(**{**args.__dict__, "num_hidden_layers": 28})
    plan = Plan.of(plan_args)
    assert res["layers"] == 28 and res["weight_bytes"] == plan.weight_bytes and res["cpu"]["layers_converted"] == 2
    assert res["cpu"]["layers"] == 28 and res["cpu"]["recorded"] is True
    engine_us = res["micro"]["engine_us"]
    assert engine_us >= 0 and res["rates"]["engine_us"] == engine_us and "engine: " in r.stdout  # measured, counted
    for d in res["decode"]:
        assert d["npu_ms"] == pytest.approx(plan.npu_ms(1, Rates()), rel=1e-9) and d["cpu_ms"] > 0
        assert d["engine_ms"] == pytest.approx(plan.rounds * engine_us / 1e3)
        assert d["ms"] == pytest.approx(d["npu_ms"] + d["engine_ms"] + d["cpu_ms"])
    assert [f["family"] for f in res["drafting"]] == ["recall", "code"]
    assert all(f["tokens"] == 15 and f["forwards"] <= 15 for f in res["drafting"])
    assert [d["context"] for d in res["decode"]] == [256]
    assert "## Prediction: the matmul path, 28 layers" in r.stdout and "not scaled to the board's Cortex-A76" in r.stdout
    # cpu-q's decode on the A76 cores beside it, with its source: the 28-layer geometry's 4-bit bytes
    # over the bandwidth Gemma3-1B Q4_0's published rate implies (the ratio of bytes, not a clock)
    out = " ".join(r.stdout.split())
    assert "## NPU or CPU decode: cpu-q on the four A76 cores, 28 layers" in r.stdout and "rk-llama.cpp" in out
    from edge_llm.bench.npu.a76 import CPU_Q_BYTES_PER_WEIGHT, GEMMA3_1B, Q4_0_BYTES_PER_WEIGHT, weights

    q = res["cpu_q"]
    assert q["layers"] == 28 and q["bytes_per_token"] == weights(plan_args) * CPU_Q_BYTES_PER_WEIGHT
    assert q["tok_s"] / 28.3 == pytest.approx(weights(GEMMA3_1B) * Q4_0_BYTES_PER_WEIGHT / q["bytes_per_token"])
    assert f"cpu-q predicted {q['tok_s']:.2f} tok/s" in out
    assert f"the matmul path (NPU) predicted {res['decode'][0]['tok_s']:.2f} tok/s" in out
    bad = subprocess.run([sys.executable, "-m", "edge_llm", "bench", "npu", "--model", str(tiny_synth_dir),
                          "--rknn-dir", str(tmp_path), "--predict-only", "--out", str(tmp_path / "res2")],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "--predict-only needs an `edge-llm convert npu-mm` directory" in bad.stderr
