"""`edge-llm bench split` on the tiny synthetic model: real store, real files, every split path
loads exactly its rows, and its distance from the bitwise path stays at rounding level."""

from __future__ import annotations

import json

from click.testing import CliRunner

from edge_llm.cli.bench import bench


def test_split_distance_on_a_tiny_model(tiny_synth_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("EDGE_LLM_HOME", str(tmp_path / "home"))
    out = tmp_path / "results"
    r = CliRunner().invoke(bench, ["split", "--models", str(tiny_synth_dir), "--contexts", "200",
                                   "--max-tokens", "6", "--kv-bs", "16", "--out", str(out)])
    assert r.exit_code == 0, r.output
    (res,) = out.iterdir()
    rows = json.loads((res / "split.json").read_text())["rows"]
    m = rows[0]["matched"]
    assert 150 < m <= 220 and [x["loaded"] for x in rows] == [m // 4 // 16 * 16, m // 2 // 16 * 16,
                                                              3 * m // 4 // 16 * 16, 0]
    for x in rows:
        assert x["loaded"] + x["recomputed"] == x["prompt"] and x["greedy_n"] == 6
        assert 0 <= x["greedy_agree"] <= 6 and x["logit_scale"] > 0
        # rows computed in another batch shape round differently, by float32 rounding only
        assert x["max_rel"] < 1e-3, x
    assert "recompute all" in (res / "split.md").read_text()
