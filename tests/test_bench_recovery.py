"""`edge-llm bench recovery` on the tiny synthetic model: two real server processes, a SIGKILL,
a restore; the result files are well-formed and the numbers consistent with each other."""

from __future__ import annotations

import json

from click.testing import CliRunner

from edge_llm.cli.bench import bench


def test_bench_recovery_on_tiny_model(tiny_synth_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("EDGE_LLM_HOME", str(tmp_path / "home"))
    out = tmp_path / "results"
    r = CliRunner().invoke(bench, ["recovery", "--model", str(tiny_synth_dir), "--contexts", "300",
                                   "--max-tokens", "4", "--out", str(out)])
    assert r.exit_code == 0, r.output
    (res,) = out.iterdir()
    data = json.loads((res / "recovery.json").read_text())
    (row,) = data["rows"]
    assert "error" not in row, row
    assert row["snapshot_bytes"] == row["formula_bytes"]
    assert row["disk_read_line"] and row["cache_source"] == "disk"
    # S2 reused the history from S1's file and prefilled only the follow-up tail
    assert row["cached_tokens"] + row["tail_tokens"] == row["prompt_tokens_s2"]
    # the tail: the new tokens, plus the matched rows recomputed for alignment (fewer than the chunk)
    assert row["prefill_timing_n"] == row["tail_tokens"] and row["tail_tokens"] - row["align_rows"] < 40
    assert 0 <= row["align_rows"] < 128
    assert 200 < row["prompt_tokens_s1"] <= 300
    assert row["restore_bytes"] > 0 and row["raw_cold_read_mb_s"] > 0 and row["lower_bound_ms"] > 0
    assert row["speedup"] == row["cold_ttft_ms"] / row["restored_ttft_ms"]
    # one S2 per restore mode on the same files: the same greedy text, read and tail apart
    assert set(row["modes"]) == {"sequential", "pipelined"} and row["restore_mode"] == "pipelined"
    assert all(m["loaded"] and m["restore_mode"] == k for k, m in row["modes"].items())
    assert row["same_text"] and row["read_ms"] > 0 and row["tail_ms"] > 0
    assert row["sum_ms"] == row["read_ms"] + row["tail_ms"] and row["pipe_bound_ms"] == max(row["read_ms"], row["tail_ms"])
    assert row["gate"] == "unmeasured"  # a fresh process has no estimates: it restores
    md = (res / "recovery.md").read_text()
    assert "| 300 |" in md and "lower bound" in md.lower() and "max(read, tail)" in md
    assert (res / "recovery.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (res / "kv-300").exists()  # snapshots removed after the run
