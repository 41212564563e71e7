"""`edge-llm bench npu`: refuses without an NPU; on a host its measurements run through a host runner."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from edge_llm.backends.onnx_export import export_graph_set
from edge_llm.backends.rknn import npu_present


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
