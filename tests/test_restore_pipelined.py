"""Pipelined restore, the cost gate and the write budget through the engine on a real tiny model:
pipelined = sequential bitwise (rows, logits, text); a block CRC failure in the middle of the
pipeline ends in a clean recompute; the gate picks recompute for a slow disk and restore for a
fast one (injected estimates); a multi-turn conversation writes ~only its new KV (docs/store.md)."""

from __future__ import annotations

import json

import shutil

import numpy as np
import pytest

from edge_llm.costgate import CostGate
from edge_llm.engine import GenerationRequest
from edge_llm.runtime import load_runtime
from edge_llm.settings import Settings
from edge_llm.snapshot import format as fmt


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from edge_llm.checkpoints.synth import synth_checkpoint

    d = tmp_path_factory.mktemp("tiny") / "model"
    synth_checkpoint(d, preset="tiny", seed=11)
    return d


def engine(model, kv, mode="pipelined", **kw):
    return load_runtime(Settings(model=str(model), backend="cpu", disk_kv=str(kv), max_seq=1024, kv_bs=16,
                                 disk_kv_restore=mode, disk_kv_compact_idle=None, **kw))


def turn(eng, ids, n=6):
    last = list(eng.generate(GenerationRequest(list(ids), max_tokens=n)))[-1]
    return last


HISTORY = [(7 * i) % 5000 + 300 for i in range(300)]
FOLLOW = [4000 + i for i in range(40)]


def snapshot_of_history(tiny, kv):
    eng = engine(tiny, kv)
    first = turn(eng, HISTORY)
    eng.store.close()
    return HISTORY + first.completion_ids + FOLLOW


def test_pipelined_restore_is_bitwise_the_sequential_one(tiny, tmp_path):
    kv = tmp_path / "kv"
    prompt = snapshot_of_history(tiny, kv)
    out = {}
    for mode in ("sequential", "pipelined"):
        shutil.copytree(kv, tmp_path / mode)  # the same files for both (each run saves its own turn)
        eng = engine(tiny, tmp_path / mode, mode)
        eng.gate.read_bps = eng.gate.prefill_tps = None  # unmeasured: always restore
        logits, t = eng.prefill_prompt(prompt)
        assert t.restore_mode == mode  # the path that ran (Restore.mode), not an echo of the setting
        n = len(prompt)
        out[mode] = (logits.copy(), eng.cache.data[:, :, :n].copy(), t)
        last = turn(eng, prompt)  # RAM reuse after the restore: the text
        out[mode] += (last.completion_ids,)
        eng.store.close()
    (ls, rs, ts, xs), (lp, rp, tp, xp) = out["sequential"], out["pipelined"]
    assert ts.cache_source == tp.cache_source == "disk" and ts.disk_cached_tokens == tp.disk_cached_tokens > 200
    assert tp.restore_mode == "pipelined" and tp.gate == "unmeasured" and tp.restore_bytes == ts.restore_bytes
    assert np.array_equal(rs.view(np.uint32), rp.view(np.uint32))
    assert np.array_equal(ls.view(np.uint32), lp.view(np.uint32))
    assert xs == xp


def test_crc_failure_mid_pipeline_recomputes_cleanly(tiny, tmp_path):
    kv = tmp_path / "kv"
    prompt = snapshot_of_history(tiny, kv)
    cold = engine(tiny, tmp_path / "cold-kv")
    want_logits, _ = cold.prefill_prompt(prompt)
    (snap,) = kv.rglob(fmt.SNAPSHOT_GLOB)
    hdr, _ = fmt.read_header(open(snap, "rb"), None, None, None)
    last_layer = hdr.n_layers - 1  # the reader fails late: the tail has already used earlier layers
    with open(snap, "r+b") as f:
        f.seek(hdr.block_offset(last_layer, 1, 1) + 6)
        b = f.read(1)
        f.seek(hdr.block_offset(last_layer, 1, 1) + 6)
        f.write(bytes([b[0] ^ 0x20]))
    eng = engine(tiny, kv)
    logits, t = eng.prefill_prompt(prompt)
    assert t.cache_source == "none" and t.prefill_tokens == len(prompt)
    assert np.array_equal(logits.view(np.uint32), want_logits.view(np.uint32))  # a cold run, bitwise
    assert not snap.exists() and list(snap.parent.glob("quarantine/*.reason"))
    eng.store.close()


@pytest.mark.parametrize("when", ["before-lookup", "after-lookup"])
def test_a_snapshot_that_cannot_be_opened_keeps_the_ram_rows(tiny, tmp_path, caplog, when):
    """A file gone under the running store: removed before the request, the lookup's stat drops it
    (`vanished`); removed between the lookup and the open (the race), the store quarantines it at
    `open`, before any cache row is touched. Either way the request reuses what RAM holds and is
    bitwise a cold run."""
    kv = tmp_path / "kv"
    prompt = snapshot_of_history(tiny, kv)
    want, _ = engine(tiny, tmp_path / "cold-kv").prefill_prompt(prompt)
    eng = engine(tiny, kv)
    eng.prefill_prompt(prompt[:200])  # RAM: a 200-token prefix of the prompt
    (snap,) = kv.rglob("kv_*.kv")
    if when == "before-lookup":
        snap.unlink()
    else:
        lookup = eng.store.lookup

        def lookup_then_unlink(*args, **kwargs):
            hit = lookup(*args, **kwargs)
            snap.unlink(missing_ok=True)  # the file goes after the lookup found it
            return hit

        eng.store.lookup = lookup_then_unlink
    eng.gate.read_bps = eng.gate.prefill_tps = None  # unmeasured: the gate restores
    logits, t = eng.prefill_prompt(prompt)
    assert t.cache_source == "ram" and t.ram_cached_tokens > 100 and t.disk_cached_tokens == 0
    stats = eng.store.stats()
    assert t.restore_mode == ""
    if when == "before-lookup":
        assert stats["vanished"] == 1 and stats["load_failures"] == 0
        assert "vanished from" in caplog.text
    else:
        assert stats["load_failures"] == 1
        assert "restore of" in caplog.text and "not started" in caplog.text
    assert np.array_equal(logits.view(np.uint32), want.view(np.uint32))
    eng.store.close()


def test_cost_gate_decisions_with_injected_estimates():
    g = CostGate(bytes_per_token=229_376, mode="pipelined", chunk=128)
    assert g.decide(2100, 0, 2048, 64, 16).action == "unmeasured"  # no estimates: restore
    g.read_bps, g.prefill_tps = 200e6, 300.0  # eMMC vs an NPU at RKLLM's rate
    d = g.decide(2100, 0, 2048, 64, 16)
    # loading 2048 rows: 470 MB / 200 MB/s = 2.35 s; recomputing 2100 rows at 300 rows/s: 7 s
    assert d.action == "restore" and d.load_rows == 2048 and d.recompute_rows == 52
    assert d.restore_ms == pytest.approx(2048 * 229_376 / 200e6 * 1e3) and d.recompute_ms == pytest.approx(7000)
    g.read_bps = 20e6  # a disk slow enough: 23.5 s to load, 7 s to compute
    d = g.decide(2100, 0, 2048, 64, 16)
    assert d.action == "recompute" and d.load_rows == 0 and d.recompute_rows == 2100
    # RAM rows are free: recompute counts only the rows after them
    assert g.decide(2100, 1000, 2048, 64, 16).recompute_ms == pytest.approx(1100 / 300 * 1e3)
    # split (Cake-style): load a block-aligned front, compute the rest, when that beats both
    def split(chunk: int):
        return CostGate(bytes_per_token=229_376, mode="split", chunk=chunk, read_bps=100e6,
                        prefill_tps=300.0).decide(4000, 0, 3968, 64, 16)

    d = split(64)
    assert d.action == "split" and 0 < d.load_rows < 3968 and d.load_rows % 64 == 0
    assert d.predicted_ms < min(d.restore_ms, d.recompute_ms)
    # split points are multiples of the gate's chunk too (the engine's alignment unit): the rows
    # after them are recomputed in a cold run's chunks; a chunk longer than the prompt allows none
    assert split(384).action == "split" and split(384).load_rows % 384 == 0
    assert split(4096).action == "restore"
    seq = CostGate(bytes_per_token=229_376, mode="sequential", read_bps=200e6, prefill_tps=300.0)
    assert seq.decide(2100, 0, 2048, 64, 16).predicted_ms == pytest.approx(2048 * 229_376 / 200e6 * 1e3 + 52 / 0.3)


def test_engine_follows_the_gate(tiny, tmp_path):
    kv = tmp_path / "kv"
    prompt = snapshot_of_history(tiny, kv)
    eng = engine(tiny, kv)
    eng.gate.read_bps, eng.gate.prefill_tps = 1.0, 1e9  # a disk slow enough: recompute
    _, t = eng.prefill_prompt(prompt)
    assert t.gate == "recompute" and t.restore_mode == "" and t.cache_source == "none" and t.restore_bytes == 0
    assert t.gate_rows_loaded == 0 and t.gate_rows_recomputed == len(prompt)
    assert t.gate_restore_ms > t.gate_recompute_ms and t.gate_actual_ms > 0
    eng.cache.reset()
    eng.gate.read_bps, eng.gate.prefill_tps = 1e12, 1.0  # a fast disk, a slow backend: restore
    _, t = eng.prefill_prompt(prompt)
    assert t.gate == "restore" and t.cache_source == "disk" and t.gate_rows_loaded == t.disk_cached_tokens > 200
    assert eng.gate.counts["recompute"] == 1 and eng.gate.counts["restore"] == 1
    eng.store.close()


def test_multi_turn_write_budget_from_the_store_counters(tiny, tmp_path):
    """Six turns of one conversation: bytes written / bytes of new KV <= 1.1 (deltas), against
    the full rewrite of every turn measured the same way."""
    ratios = {}
    for chain in (8, 1):
        eng = engine(tiny, tmp_path / f"kv{chain}", disk_kv_max_chain=chain)
        ids = list(HISTORY[:120])
        per_turn = []
        for i in range(6):
            last = turn(eng, ids, n=8)
            eng.store.flush()
            per_turn.append(dict(eng.store.last_save))
            ids = ids + last.completion_ids + FOLLOW[: 20 + 5 * i]
        st = eng.store.stats()
        ratios[chain] = st["bytes_written"] / st["new_kv_bytes"]
        assert st["new_kv_bytes"] == per_turn[-1]["tokens"] * eng.cache.geometry.kv_bytes_per_token
        if chain == 8:
            assert st["saves_delta"] == 5
            assert all(p["bytes"] / p["new_kv_bytes"] <= 1.1 for p in per_turn), per_turn
        eng.store.close()
    print(f"\nwrite budget over 6 turns (tiny model): delta {ratios[8]:.3f}, full rewrite {ratios[1]:.3f}")
    assert ratios[8] <= 1.1 and ratios[1] > 2.5


def test_gate_estimates_survive_a_restart(tiny, tmp_path):
    """A new runtime on the same namespace starts with the last run's estimates (gate.json), so
    the first request after a restart is decided on this machine's numbers, not 'unmeasured'."""
    kv = tmp_path / "kv"
    prompt = snapshot_of_history(tiny, kv)  # its request measured the prefill rate: written then
    state = tmp_path / "kv" / next(p.name for p in kv.iterdir() if p.is_dir()) / "gate.json"
    assert json.loads(state.read_text())["prefill_rows_per_s"] > 0
    eng = engine(tiny, kv)
    eng.gate.observe_read(10, 1.0)  # a very slow disk: 10 B/s
    eng.gate.observe_prefill(1000, 0.001)  # a very fast backend
    turn(eng, [5, 6, 7])  # a request ends: the estimates moved, gate.json is rewritten
    assert json.loads(state.read_text())["read_bytes_per_s"] == eng.gate.read_bps == 10
    mtime = state.stat().st_mtime_ns
    turn(eng, [5, 6, 7])  # too short to measure a rate: nothing moved, no rewrite
    assert state.stat().st_mtime_ns == mtime
    eng.store.close()
    again = engine(tiny, kv)  # a restart
    assert again.gate.read_bps == eng.gate.read_bps and again.gate.prefill_tps == eng.gate.prefill_tps
    _, t = again.prefill_prompt(prompt)
    assert t.gate == "recompute" and t.cache_source == "none"
    again.store.close()
    (again.store.ns / "gate.json").write_text("{not json")
    third = engine(tiny, kv)  # a damaged file is ignored, never fatal
    assert third.gate.read_bps is None
    third.store.close()


def test_restart_log_says_what_was_not_measured(tmp_path, caplog):
    """A gate.json with only the prefill rate (no restore yet) logs 'not measured yet', not 0 MB/s."""
    (tmp_path / "gate.json").write_text(json.dumps({"read_bytes_per_s": None, "prefill_rows_per_s": 812.5}))
    with caplog.at_level("INFO", logger="edge_llm.costgate"):
        g = CostGate(1000, state_dir=tmp_path)
    assert g.read_bps is None and g.prefill_tps == 812.5
    assert "read not measured yet, prefill 812.5 rows/s" in caplog.text and "0 MB/s" not in caplog.text
