"""`edge-llm bench restore` on a tiny geometry: real files, real fsync/fadvise, bitwise check."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from click.testing import CliRunner

from edge_llm.bench import restore as B
from edge_llm.bench.disk import cold_read, measure_raw, new_results_dir, raw_write
from edge_llm.cli.bench import bench
from edge_llm.config import Geometry
from edge_llm.kvcache import KVCache

TINY = Geometry(2, 2, 16)


def test_restore_bench_cli_writes_wellformed_results(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGE_LLM_HOME", str(tmp_path / "home"))
    out = tmp_path / "results"
    r = CliRunner().invoke(bench, ["restore", "--contexts", "100,300", "--layers", "2", "--repeats", "2",
                                   "--scan-files", "3", "--dir", str(tmp_path / "data"), "--out", str(out)])
    assert r.exit_code == 0, r.output
    (res,) = out.iterdir()
    data = json.loads((res / "restore.json").read_text())
    assert data["geometry"]["bytes_per_token"] == 2 * 2 * 8 * 128 * 4 and data["layers_reduced"]
    assert [c["tokens"] for c in data["contexts"]] == [100, 300]
    for c in data["contexts"]:
        assert c["restored_bitwise_equal"] is True
        assert c["snapshot_bytes"] == c["formula_bytes"]
        for k in ("raw_write", "raw_read", "save", "restore", "restore_fresh"):
            assert c[k]["nbytes"] == c["snapshot_bytes"] and c[k]["seconds"] > 0 and c[k]["mb_s"] > 0
        assert len(c["all_mb_s"]["save"]) == 2 and c["save_vs_raw"] > 0 and c["restore_vs_raw"] > 0
    scan = data["scan"]
    assert scan["files"] == 3 and scan["payload_bytes"] == 3 * 100 * data["geometry"]["bytes_per_token"]
    if scan["device_read_bytes"] is not None:  # the scan must not read payload
        assert scan["reads_no_payload"] == (scan["device_read_bytes"] < scan["payload_bytes"] / 10)
    md = (res / "restore.md").read_text()
    assert "| 100 |" in md and "| 300 |" in md and "Index scan of 3 files" in md
    assert not list((tmp_path / "data").rglob("*.kv"))  # benchmark files are removed


def test_restore_is_bitwise_and_a_corrupted_row_is_caught(tmp_path):
    store = B.bench_store(tmp_path, TINY, 8, 64, "t")
    src = KVCache(TINY, max_seq=40, kv_bs=8)
    B.fill_random(src, 40, np.random.default_rng(1))
    path, save = B.save_snapshot(store, src)
    assert save.nbytes == path.stat().st_size
    dst = KVCache(TINY, max_seq=40, kv_bs=8)
    B.restore_cold(store, path, dst, src.tokens)
    assert B.rows_equal(src, dst, 40) and dst.tokens == src.tokens
    dst.data[1, 1, 39, 5] = np.nextafter(dst.data[1, 1, 39, 5], np.float32(np.inf))  # one ulp
    assert not B.rows_equal(src, dst, 40)
    store.close()


def test_raw_disk_measurement(tmp_path):
    w = raw_write(tmp_path / "f.bin", 3 << 20, chunk=1 << 20)
    assert w.nbytes == 3 << 20 and os.path.getsize(tmp_path / "f.bin") == 3 << 20 and w.mb_s > 0
    r = cold_read(tmp_path / "f.bin", chunk=1 << 20)
    assert r.nbytes == 3 << 20 and r.seconds > 0
    raw = measure_raw(tmp_path / "d", 1 << 20)
    assert raw.write.nbytes == raw.read.nbytes == 1 << 20
    assert list((tmp_path / "d").iterdir()) == []  # the probe file is removed


def test_results_dirs_are_never_reused(tmp_path):
    dirs = {new_results_dir(tmp_path, "restore") for _ in range(3)}
    assert len(dirs) == 3 and all(d.is_dir() for d in dirs)


def test_not_enough_space_is_a_clear_error(tmp_path):
    huge = Geometry(28, 8, 128)
    with pytest.raises(OSError, match="needs"):
        B.run(tmp_path, huge, [10_000_000], repeats=1)
