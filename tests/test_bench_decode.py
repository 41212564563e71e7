"""`edge-llm bench decode` (edge_llm/bench/decode.py): the NPU prediction's arithmetic on a
hand-made manifest, and the bench end to end on the default model (backend cpu, one family)."""

import json

import pytest
from click.testing import CliRunner

from edge_llm.backends.graph.manifest import GraphEntry, Manifest
from edge_llm.bench.decode import npu_forward_ms, npu_prediction, replay


def graph(name, kind, rows, cyc):
    return GraphEntry(name, kind, 0, rows, [["x", 8]], [["y", 8]], [0, 0], f"onnx/{name}.onnx", "k",
                      cost=[{"rows": r, "cycles": c} for r, c in cyc.items()])


def test_replay_runs_the_engines_drafting_on_a_known_answer():
    """The forwards the engine would run for a greedy answer: a free profile drafts the repeated
    text and verifies it in few forwards; a profile where drafts never pay runs one row per token."""
    from edge_llm.backends.cost import NEVER_PAYS, ForwardCost

    text = [5, 6, 7, 8, 9, 10, 11, 12]
    prompt, answer = text * 2, text * 2  # the answer repeats the prompt
    free = replay(prompt, answer, ForwardCost(1.0, 0.0))
    assert sum(free) > len(free) and len(free) < len(answer) - 1
    plain = replay(prompt, answer, NEVER_PAYS)
    assert plain == [1] * (len(answer) - 1)


def test_npu_prediction_with_a_one_row_head_runs_it_once_per_row():
    m = Manifest({}, [1, 32], 1, 1, [graph("layer00.qkv", "qkv", [1, 32], {1: 100_000, 32: 200_000}),
                                      graph("head", "head", [1], {1: 1_000_000})])
    assert npu_forward_ms(m, 1) == pytest.approx(1.1)  # cycles at 1 GHz -> ms
    assert npu_forward_ms(m, 5) == pytest.approx(0.2 + 5 * 1.0)  # the 32-row layer shape, the head 5 times
    assert npu_forward_ms(m, 40) == pytest.approx(2 * 0.2 + 40 * 1.0)  # 32 + 8 (padded to 32)
    assert npu_forward_ms(m, 1, layers=28) == pytest.approx(28 * 0.1 + 1.0)  # a 1-layer conversion scaled
    text = list(range(100, 120))
    p = npu_prediction(m, text * 2, text, layers=1)
    assert p["head_rows"] == [1] and p["verify_forwards"] == 0  # 5 rows cost 4.7 steps: never pays
    assert p["effective_tps"] == pytest.approx(p["plain_tps"])


def test_npu_prediction_with_a_head_that_batches_the_verify_rows():
    """What `convert rknn` builds now (schema.head_rows): the head also at the smallest multi-row
    chunk, so a verify forward of up to 32 rows runs it once, and drafting pays."""
    from edge_llm.backends.graph.schema import graph_specs, head_rows
    from edge_llm.config import ModelArgs

    assert head_rows((1, 32, 128)) == (1, 32) and head_rows((1,)) == (1,)
    args = ModelArgs(vocab_size=64, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1, head_dim=4, rms_norm_eps=1e-6,
                     rope_theta=1e4, model_type="qwen3")
    assert [s.rows for s in graph_specs(args, (1, 32, 128)) if s.kind == "head"] == [(1, 32)]
    m = Manifest({}, [1, 32], 1, 1, [graph("layer00.qkv", "qkv", [1, 32], {1: 100_000, 32: 200_000}),
                                      graph("head", "head", [1, 32], {1: 1_000_000, 32: 1_300_000})])
    assert npu_forward_ms(m, 5) == pytest.approx(0.2 + 1.3)
    text = list(range(100, 180))
    p = npu_prediction(m, text * 2, text)  # the answer is in the prompt: every draft is kept
    assert p["head_rows"] == [1, 32] and p["verify_forwards"] > 0 and p["tokens_per_forward"] > 3
    assert p["effective_tps"] > 2 * p["plain_tps"]


def test_bench_decode_end_to_end(edge_home, tmp_path, monkeypatch):
    from edge_llm.cli import cli

    monkeypatch.setenv("EDGE_LLM_HOME", str(edge_home))
    monkeypatch.delenv("EDGE_LLM_LLAMACPP_PYTHON", raising=False)
    r = CliRunner().invoke(cli, ["bench", "decode", "--backends", "cpu", "--families", "code", "--max-tokens", "24",
                                 "--repeats", "1", "--llamacpp-python", str(tmp_path / "none"), "--out", str(tmp_path)])
    assert r.exit_code == 0, r.output
    res = json.loads(next(tmp_path.glob("*-bench-decode/decode.json")).read_text())
    (row,) = res["rows"]
    assert row["backend"] == "cpu" and row["family"] == "code" and row["prompt_tokens"] > 150
    for mode in ("plain", "spec"):
        assert row[mode]["tokens"] == 24 and row[mode]["decode_tps"] > 0
    assert row["plain"]["drafted"] == 0 and row["plain"]["forwards"] == 23
    assert row["spec"]["forwards"] + row["spec"]["accepted"] == 23
    assert row["same_text"] == (row["first_difference"] is None)
    assert "| cpu | code |" in r.output and "llama.cpp: not run" in r.output


def test_bench_decode_runs_a_cpu_q_mode_by_name(edge_home, tmp_path, monkeypatch):
    """`--backends cpu-q:q4-int8` runs backend cpu-q in that quant mode (its numerics say so); a
    mode that does not exist is refused before anything loads."""
    from edge_llm.cli import cli

    monkeypatch.setenv("EDGE_LLM_HOME", str(edge_home))
    args = ["bench", "decode", "--families", "chat", "--max-tokens", "4", "--repeats", "1",
            "--llamacpp-python", str(tmp_path / "none"), "--out", str(tmp_path)]
    bad = CliRunner().invoke(cli, args + ["--backends", "cpu-q:q9"])
    assert bad.exit_code != 0 and "cpu-q:q9" in bad.output
    r = CliRunner().invoke(cli, args + ["--backends", "cpu-q:q4-int8"])
    assert r.exit_code == 0, r.output
    res = json.loads(next(tmp_path.glob("*-bench-decode/decode.json")).read_text())
    assert [row["backend"] for row in res["rows"]] == ["cpu-q:q4-int8"]
    assert ":q4-b32-acc4:" in res["numerics"]["cpu-q:q4-int8"]
