"""The prediction model of the NPU matmul path (docs/npu.md, "Prediction"): its arithmetic against
a hand computation for the Qwen3-VL-2B geometry, and the timing wrapper over a real engine."""

from __future__ import annotations

import time

import numpy as np
import pytest

from edge_llm.backends.npu.matmul.int8 import HostInt8Matmul
from edge_llm.bench.npu.predict import CpuWork, Plan, Rates, Replayed, TimedMatmul, cost_profile, predict
from edge_llm.checkpoints.synth import QWEN3_VL_2B_TEXT
from edge_llm.config import ModelArgs

ARGS_2B = ModelArgs.from_dict({"model_type": "qwen3_vl", "text_config": QWEN3_VL_2B_TEXT})


def test_bytes_and_calls_of_the_2b_by_hand():
    p = Plan.of(ARGS_2B)
    layer = 2048 * (16 + 2 * 8) * 128 + 16 * 128 * 2048 + 2048 * 2 * 6144 + 6144 * 2048  # qkv, o, gate_up, down
    head = 2048 * 151936
    assert p.weight_bytes == 28 * layer + head == 1_720_451_072  # issue 36: "~1.72 GB of int8 weights per token"
    assert p.calls == 3 * (4 * 28 + 1) and p.rounds == 4 * 28 + 1
    assert p.scale_bytes == 4 * (28 * (4096 + 2048 + 12288 + 2048) + 151936)


def test_npu_time_by_hand():
    p, r = Plan.of(ARGS_2B), Rates()
    # the largest core's part (engine.split_weight): qkv by N, 43 of 128 blocks of 32 columns; o
    # mixed, two halves of N over 43 of K's 64 blocks; gate/up by N, a third; down by K, a third;
    # the head by N, 1583 of 4748 blocks
    widest = 28 * (2048 * 1376 + 1376 * 1024 + 2048 * 4096 + 2048 * 2048) + 2048 * 50656
    bw_core = 26.6e9 / 3
    decode = (widest / bw_core + 113 * 33e-6) * 1e3
    assert p.npu_ms(1, r) == pytest.approx(decode, rel=1e-12)
    assert p.npu_ms(32, r) == p.npu_ms(1, r)  # 32 rows: still the weight bytes, not the multiply-adds
    # 128 rows: past 1024 MACs/cycle at 1 GHz / (8.87 GB/s per core) = 115.5 rows, compute-bound
    assert p.npu_ms(128, r) == pytest.approx((128 * widest / 1024e9 + 113 * 33e-6) * 1e3, rel=1e-12)
    one = Plan.of(ARGS_2B, cores=1)
    assert one.rounds == one.calls == 113
    assert one.npu_ms(1, r) == pytest.approx((one.weight_bytes / 11e9 + 113 * 33e-6) * 1e3, rel=1e-12)


def test_k_above_the_limit_is_split():
    big = ModelArgs.from_dict({**QWEN3_VL_2B_TEXT, "model_type": "qwen3", "intermediate_size": 12288})
    down = next(x for x in Plan.of(big).parts if x.kind == "down")
    assert (down.k_parts, down.k_part, down.calls) == (2, 6144, 6)
    assert Plan.of(big).rounds == 5 * 28 + 1


def test_cpu_work_interpolates_and_scales_rows():
    cpu = CpuWork({(1, 512): 2.0, (1, 2048): 5.0, (4, 512): 6.0}, {32: 10.0}, "x86-64", 2, 28)
    assert cpu(1, 512) == 2.0 and cpu(1, 1280) == pytest.approx(3.5) and cpu(1, 8192) == pytest.approx(17.0)
    assert cpu(128, 128, prompt=True) == pytest.approx(40.0)  # nearest measured rows (32), per row
    assert cpu(4, 999) == 6.0  # one context measured: that value
    assert cpu(8, 512) == pytest.approx(12.0)  # nearest measured decode rows (4), per row


def test_prediction_adds_its_parts():
    p, r = Plan.of(ARGS_2B), Rates()
    cpu = CpuWork({(1, 512): 3.0, (1, 2048): 3.0, (1, 8192): 3.0, (2, 512): 3.5}, {32: 30.0, 128: 100.0},
                  "x86-64", 2, 28)
    res = predict(p, r, cpu, contexts=(512,), drafting=[Replayed("recall", 512, 10, (1, 2, 2, 1))])
    d = res["decode"][0]
    assert d["ms"] == pytest.approx(p.npu_ms(1, r) + 3.0) and d["tok_s"] == pytest.approx(1e3 / d["ms"])
    pre = {x["rows"]: x for x in res["prefill"]}
    assert pre[128]["tok_s"] == pytest.approx(128e3 / (p.npu_ms(128, r, head_rows=1) + 100.0))
    # a prompt's head runs on its last row only: 128 rows of it would be compute-bound
    assert p.npu_ms(128, r, head_rows=1) < p.npu_ms(128, r)
    assert res["rkllm_prefill_tok_s"] == pytest.approx(128 / 0.3836)
    dr = res["drafting"][0]
    assert dr["ms"] == pytest.approx(2 * (p.npu_ms(1, r) + 3.0) + 2 * (p.npu_ms(2, r) + 3.5))
    assert dr["tok_s"] == pytest.approx(10e3 / dr["ms"]) and dr["verify_rows"] == 4
    prof = cost_profile(p, r, cpu, 512)
    assert prof(1) == 1.0 and prof(2) == pytest.approx((p.npu_ms(2, r) + 3.5) / (p.npu_ms(1, r) + 3.0))


def test_the_engines_time_per_round_is_counted():
    """Rates.engine_us: the engine's own time per round (copies, hand-off, Python), per round of a
    forward, once per chunk of 128 rows; None (not measured) counts nothing and the table says so."""
    from edge_llm.bench.npu.predict import forward_ms, markdown

    p = Plan.of(ARGS_2B)
    cpu = CpuWork({(1, 512): 3.0}, {128: 100.0}, "x86-64", 2, 28)
    measured = Rates(engine_us=10.0)
    one = forward_ms(p, measured, cpu, 1, 512)
    assert one["engine_ms"] == pytest.approx(113 * 10.0 / 1e3)
    assert one["ms"] == pytest.approx(p.npu_ms(1, measured) + 1.13 + 3.0)
    assert forward_ms(p, measured, cpu, 129, 129, prompt=True)["engine_ms"] == pytest.approx(2 * 1.13)
    assert forward_ms(p, Rates(), cpu, 1, 512)["engine_ms"] == 0.0
    text = markdown(predict(p, Rates(), cpu, contexts=(512,), prefill_rows=(128,)), "x86-64")
    assert "NOT measured" in text
    text = markdown(predict(p, measured, cpu, contexts=(512,), prefill_rows=(128,)), "x86-64")
    assert "engine: 10.0 us per round" in text and "| decode, 1 row | 512 |" in text and "| 1.1 |" in text


def _busy(seconds: float) -> None:
    """CPU time spent (the wrapper counts CPU time, so a sleep would not do)."""
    t = time.thread_time()
    while time.thread_time() - t < seconds:
        pass


def test_timed_matmul_counts_only_the_engine():
    class Slow(HostInt8Matmul):
        def run(self, name, a):
            _busy(0.02)
            return super().run(name, a)

    rng = np.random.default_rng(0)
    w = rng.integers(-127, 128, (64, 32), dtype=np.int8)
    a = rng.integers(-127, 128, (3, 64), dtype=np.int8)
    t = TimedMatmul(Slow())
    t.add("w", w)
    c = t.run("w", a)
    _busy(0.03)  # time outside the engine is not counted
    c2 = t.run("w", a)
    assert np.array_equal(c, a.astype(np.int64) @ w.astype(np.int64)) and np.array_equal(c, c2)
    # the two runs' 0.04 s of this thread's CPU time, not the 0.03 s between them (CPU time against
    # CPU time: a thread left spinning by an earlier test makes CPU time run ahead of the wall clock)
    assert t.calls == 2 and 0.04 <= t.seconds < 0.065
    assert t.numerics == "host-exact"
    t.reset()
    assert (t.calls, t.seconds) == (0, 0.0)
    with pytest.raises(KeyError):
        t.run("missing", a)
    assert t.calls == 1  # a failing call is timed and counted too
    t.close()


def test_recorded_products_read_no_weights_after_the_first_call():
    """cpu.RecordedMatmul: the inner engine's exact product on a weight's first call for a row
    count, then that array again without the inner engine (the timed forwards read no weights),
    read-only, and a layer past the conversion computed with layer L % converted's weight."""
    from edge_llm.bench.npu.cpu import RecordedMatmul

    class Counting(HostInt8Matmul):
        calls: list[str] = []

        def run(self, name, a):
            self.calls.append(name)
            return super().run(name, a)

    rng = np.random.default_rng(1)
    inner = Counting()
    rec = RecordedMatmul(inner, layers=2)
    ws = {f"layer.{i}.o": rng.integers(-127, 128, (64, 32), dtype=np.int8) for i in range(2)}
    for name, w in ws.items():
        rec.add(name, w)
    a = rng.integers(-127, 128, (1, 64), dtype=np.int8)
    first = rec.run("layer.1.o", a)
    assert np.array_equal(first, a.astype(np.int64) @ ws["layer.1.o"].astype(np.int64))
    assert rec.run("layer.1.o", a) is first and inner.calls == ["layer.1.o"]  # replayed, not recomputed
    deep = rec.run("layer.5.o", a)  # layer 5 of a 2-layer conversion: layer 1's weight, its own array
    assert inner.calls == ["layer.1.o", "layer.1.o"] and deep is not first and np.array_equal(deep, first)
    assert rec.run("layer.1.o", rng.integers(-127, 128, (3, 64), dtype=np.int8)).shape == (3, 32)  # per row count
    with pytest.raises(ValueError):
        first[0, 0] = 1  # an op writing into its input would change every later forward
    assert rec.aliased("head") == "head" and rec.aliased("layer.4.gu") == "layer.0.gu"


def test_a_deepened_model_runs_every_layer_with_its_own_data(tiny_synth_dir, tmp_path):
    """cpu.deepened: a 2-layer conversion timed as a 5-layer model: the cache, the row step and
    the per-layer loop run 5 layers, each layer's scales and q/k norm gains its own arrays (the
    CPU side's working set of the deeper model); and deepening needs recorded products."""
    from edge_llm.backends.npu.matmul.decoder import MmBackend, MmManifest
    from edge_llm.bench.npu.cpu import RecordedMatmul, deepened, measure
    from edge_llm.convert.npu_mm import convert_mm8
    from edge_llm.models.qwen3 import Model

    mm = tmp_path / "mm"
    convert_mm8(tiny_synth_dir, mm, gptq_tokens=0)
    be = MmBackend(mm, MmManifest.read(mm), RecordedMatmul(HostInt8Matmul(), 2))
    model = deepened(Model.load(tiny_synth_dir, backend=be), be, 5)
    try:
        assert model.args.num_hidden_layers == 5 and be.row_step is not None and len(be.row_step.q_norms) == 5
        assert not np.shares_memory(be.scales["layer.4.gu"], be.scales["layer.0.gu"])
        assert np.array_equal(be.scales["layer.4.gu"], be.scales["layer.0.gu"])
        cache = model.new_cache(64, check_memory=False)
        model.forward(list(range(1, 9)), cache)  # the per-layer loop
        logits = model.forward([9], cache, all_logits=True, decode=True)  # the row step
        assert cache.length == 9 and np.isfinite(logits).all()
        assert all(np.any(cache.valid(layer, 9)[0] != 0) for layer in range(5))
    finally:
        model.close()
    with pytest.raises(ValueError, match="needs the recorded products"):
        measure(tiny_synth_dir, mm, HostInt8Matmul(), layers=5)


def test_cpu_q_on_the_a76_by_hand():
    """cpu-q's decode on the A76 cores (docs/npu.md, "NPU or CPU decode"): Gemma3-1B's weights counted
    by hand, the bandwidth its published Q4_0 rate implies, and the 2B's prediction as the ratio of
    bytes per token (4.5 bits a weight for Q4_0, 5 for cpu-q's blocks of 32 with float32 scales)."""
    from edge_llm.bench.npu.a76 import GEMMA3_1B, SOURCE, a76_bandwidth, predict_cpu_q, weights

    layer = 1152 * (4 + 2 * 1) * 256 + 4 * 256 * 1152 + 1152 * 2 * 6912 + 6912 * 1152  # qkv, o, gate_up, down
    assert weights(GEMMA3_1B) == 26 * layer + 1152 * 262144 == 999_751_680
    gemma_bytes = 999_751_680 * 18 / 32
    assert a76_bandwidth() == pytest.approx(gemma_bytes * 28.3) and 15.9e9 < a76_bandwidth() < 15.95e9
    p = predict_cpu_q(ARGS_2B)
    assert p["bytes_per_token"] == 1_720_451_072 * 20 / 32  # the matmul path's int8 weights, at 5 bits each
    assert p["tok_s"] / 28.3 == pytest.approx(gemma_bytes / p["bytes_per_token"])
    assert "rk-llama.cpp" in SOURCE and "28.3" in SOURCE and p["source"] == SOURCE
