"""`edge-llm bench split` on the tiny synthetic model: real store, real files, every split path
loads exactly its rows (cut back to the prefill chunk), and every path is bitwise the full restore."""

from __future__ import annotations

import json

from click.testing import CliRunner

from edge_llm.cli.bench import bench


def test_split_distance_on_a_tiny_model(tiny_synth_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("EDGE_LLM_HOME", str(tmp_path / "home"))
    out = tmp_path / "results"
    r = CliRunner().invoke(bench, ["split", "--models", str(tiny_synth_dir), "--contexts", "400",
                                   "--max-tokens", "6", "--kv-bs", "16", "--out", str(out)])
    assert r.exit_code == 0, r.output
    (res,) = out.iterdir()
    rows = json.loads((res / "split.json").read_text())["rows"]
    m = rows[0]["matched"]
    # a quarter, a half, three quarters of the match, cut back to the prefill chunk (128); then none
    want = sorted({int(m * f) // 128 * 128 for f in (0.25, 0.5, 0.75)} - {0}) + [0]
    assert 300 < m <= 440 and [x["loaded"] for x in rows] == want and len(want) >= 3
    for x in rows:
        assert x["loaded"] + x["recomputed"] == x["prompt"] and x["greedy_n"] == 6
        # the history's rows are prefill rows: every path batches as the cold run, bitwise
        assert x["bitwise"] and x["max_abs"] == 0 and x["greedy_agree"] == 6, x
    assert "recompute all" in (res / "split.md").read_text()
