"""cpu-q's one-row decode graph (backends/cpuq/decode_export.py, decode_step.py; docs/quantization.md):
it agrees with the per-layer cpu-q path, reads the cached rows in place without changing them,
gives the same bits on 1 and 2 threads, and a missing or broken graph file is a clear error.
Tiny random qwen3_vl model (MRoPE, q/k norm, GQA), re-quantized from BF16. The cross-process
restore of a cpu-q conversation (whose last prompt token and decode steps take this path) is in
test_restore_exact.py."""

from __future__ import annotations

import logging
import shutil

import numpy as np
import pytest

from edge_llm.backends.cpuq import backend as cpuq
from edge_llm.backends.cpuq.decode_step import OrtDecodeStep
from edge_llm.backends.graph.schema import DECODE
from edge_llm.errors import ConfigError
from edge_llm.models.qwen3 import Model
from modelutil import f32_bits

# measured on this model: logits equal, new K/V rows within 5e-8 of max|row| (the graph's float
# order differs: RMSNorm, RoPE, attention in onnxruntime). A difference that moves an activation
# across an int8 rounding step would show at ~1e-3 here (on the 30-layer default model: up to
# 4.5 % of the logits, test_cpu_q.py)
LOGIT_REL, ROW_REL = 0.01, 0.01


@pytest.fixture(scope="module")
def model(tiny_synth_dir, home):
    from edge_llm.convert.gptq import CpuqInputs

    # as the runtime opens it (GPTQ on calibration rows: the synthetic model has no GGUF blocks)
    return Model.load(tiny_synth_dir, cpuq.open_cpu_q(tiny_synth_dir, "q4", threads=2, blocks=None,
                                                      calibration=CpuqInputs(tiny_synth_dir)))


@pytest.fixture(scope="module")
def default_model(edge_home, home):
    """The default model (its GGUF's Q4_1 / Q8_0 blocks), cpu-q with the decode graph."""
    from edge_llm.checkpoints.gguf_blocks import gguf_blocks

    d = next(edge_home.glob("models/*/config.json")).parent
    return Model.load(d, cpuq.open_cpu_q(d, "q4", threads=2, blocks=gguf_blocks(d)))


PROMPT = list(range(1000, 1037))


def _per_layer(model):
    """The same backend with its row step switched off: every forward on the per-layer graphs."""
    class Off:
        def __init__(self, m):
            self.m, self.step = m, m.backend.row_step

        def __enter__(self):
            self.m.backend.row_step = None

        def __exit__(self, *exc):
            self.m.backend.row_step = self.step
    return Off(model)


class _Counted:
    """The backend's row step, counting its calls (a one-row forward must go through it)."""

    def __init__(self, step):
        self.step, self.calls, self.max_rows = step, 0, step.max_rows

    def __call__(self, *a, **kw):
        self.calls += 1
        return self.step(*a, **kw)


def test_one_row_step_agrees_with_per_layer_path(model, record_property, monkeypatch):
    assert model.backend.row_step is not None
    counted = _Counted(model.backend.row_step)
    monkeypatch.setattr(model.backend, "row_step", counted)
    cache = model.new_cache(max_seq=128)
    model.prefill(PROMPT, cache, chunk=16)
    S = cache.length
    worst_logit = worst_row = 0.0
    # the last case: an MRoPE position given explicitly (text after an image: t/h/w differ)
    for tok, pos in ((5, None), (77, None), (3000, None), (151000, np.array([[S - 9], [S - 12], [S - 7]]))):
        cache.truncate(S)
        fused = model.forward([tok], cache, positions=pos)
        rows = cache.data[:, :, S].copy()
        cache.truncate(S)
        with _per_layer(model):
            ref = model.forward([tok], cache, positions=pos)
        ref_rows = cache.data[:, :, S].copy()
        worst_logit = max(worst_logit, float(np.abs(fused - ref).max() / np.abs(ref).max()))
        worst_row = max(worst_row, float(np.abs(rows - ref_rows).max() / np.abs(ref_rows).max()))
    record_property("logit_rel", worst_logit)
    record_property("row_rel", worst_row)
    print(f"fused vs per-layer: logits {worst_logit:.4f}, new K/V rows {worst_row:.4f} of max")
    assert counted.calls == 4  # each fused forward ran the row step; the per-layer ones did not
    assert 0 < worst_logit <= LOGIT_REL and worst_row <= ROW_REL  # two graphs: close, not the same bits

    # greedy generation: the same tokens both ways
    def greedy(use_step: bool) -> list[int]:
        c = model.new_cache(max_seq=128)
        logits = model.prefill(PROMPT, c, chunk=16)
        out = []
        for _ in range(16):
            out.append(int(np.argmax(logits)))
            if use_step:
                logits = model.forward([out[-1]], c)
            else:
                with _per_layer(model):
                    logits = model.forward([out[-1]], c)
        return out

    before = counted.calls
    assert greedy(True) == greedy(False)
    assert counted.calls == before + 16


@pytest.mark.parametrize("which", ["model", "default_model"])
def test_a_verify_forward_is_the_one_row_steps_in_one_call(which, request, monkeypatch):
    """A speculative verify forward (`decode=True`, T rows) runs the decode graph once and gives
    each row bitwise what a one-row step after the rows before it gives, on every CPU: MatMulQ
    computes each row alone, AttnRow row t as a one-row call (docs/quantization.md, "Bits and
    batches"). The same holds, with the same bits, when MatMulQ runs its AVX2 path (and its C
    path), whichever path this CPU would pick. A prompt's rows never take the decode graph (they
    keep a cold prefill's batches), nor more rows than it takes. On the tiny model and on the
    default model's own blocks."""
    from edge_llm.backends import kernels

    model = request.getfixturevalue(which)
    counted = _Counted(model.backend.row_step)
    monkeypatch.setattr(model.backend, "row_step", counted)
    cache = model.new_cache(max_seq=128)
    model.prefill(PROMPT, cache, chunk=16)
    S, toks = cache.length, [5, 77, 3000, 42, 40000]
    steps = [model.forward([t], cache).copy() for t in toks]
    step_rows = cache.data[:, :, S:S + len(toks)].copy()
    cache.truncate(S)
    calls = counted.calls
    rows = model.forward(toks, cache, all_logits=True, decode=True)
    assert counted.calls == calls + 1 and rows.shape == (len(toks), model.args.vocab_size)
    assert np.array_equal(f32_bits(rows), f32_bits(np.stack(steps)))
    assert np.array_equal(f32_bits(cache.data[:, :, S:S + len(toks)]), f32_bits(step_rows))
    lib, native = kernels.library(), kernels.qmatmul_isa()
    try:
        for isa in ("avx2", "c"):
            if lib.edge_qmatmul_force(isa.encode()) != 0:
                continue
            cache.truncate(S)
            assert np.array_equal(f32_bits(model.forward(toks, cache, all_logits=True, decode=True)), f32_bits(rows)), isa
            assert np.array_equal(f32_bits(cache.data[:, :, S:S + len(toks)]), f32_bits(step_rows)), isa
    finally:
        lib.edge_qmatmul_force(native.encode())
    cache.truncate(S)
    calls = counted.calls
    model.forward(toks, cache, all_logits=True)  # a prompt's rows: the per-layer graphs
    model.forward(list(range(7, 7 + counted.max_rows + 1)), cache, decode=True)  # too many rows for a call
    assert counted.calls == calls


def test_cached_rows_are_read_in_place_and_never_written(model):
    cache = model.new_cache(max_seq=128)
    model.prefill(PROMPT, cache, chunk=16)
    S, buf = cache.length, cache.data
    before = buf.copy()
    seen = []
    step = model.backend.row_step

    def spy(x, cos, sin, past):
        seen.extend(past)
        return step(x, cos, sin, past)

    model.backend.row_step = spy
    try:
        model.forward([42], cache)
    finally:
        model.backend.row_step = step
    assert len(seen) == model.args.num_hidden_layers
    for layer, (k, v) in enumerate(seen):  # views of the cache's own rows [0, S), not copies
        assert k.shape == v.shape == (S, model.args.kv_dim)
        assert k.ctypes.data == buf[layer, 0].ctypes.data and v.ctypes.data == buf[layer, 1].ctypes.data
        assert k.base is not None and np.shares_memory(k, buf) and np.shares_memory(v, buf)
    assert cache.data is buf
    assert np.array_equal(buf[:, :, :S].view(np.uint32), before[:, :, :S].view(np.uint32))
    assert not np.array_equal(buf[:, :, S], before[:, :, S])  # the new row, written by the model
    assert np.array_equal(buf[:, :, S + 1:].view(np.uint32), before[:, :, S + 1:].view(np.uint32))


def test_bits_do_not_depend_on_threads_or_repeats(model, tiny_synth_dir):
    """cpu-q's numerics leaves the thread count out: the decode graph must give the same bits."""
    root, m = cpuq.ensure_quantized(tiny_synth_dir, cpuq.mode("q4"), blocks=None)
    path = m.onnx_files(root)[DECODE]
    rng = np.random.default_rng(1)
    a = model.args
    x = rng.standard_normal((1, a.hidden_size), dtype=np.float32)
    ang = rng.uniform(0, 6, (1, a.head_dim // 2)).astype(np.float32)
    past = [tuple(rng.standard_normal((300, a.kv_dim), dtype=np.float32) for _ in range(2))
            for _ in range(a.num_hidden_layers)]
    outs = []
    for threads in (1, 2, 2):
        step = OrtDecodeStep(path, a, threads, cpuq.DECODE_CONFIG)
        outs.append([o.copy() for o in step(x, np.cos(ang), np.sin(ang), past)])
    for other in outs[1:]:
        assert all(np.array_equal(p.view(np.uint32), q.view(np.uint32)) for p, q in zip(outs[0], other))


def test_missing_or_broken_decode_graph_is_a_clear_error(model, tiny_synth_dir, home, tmp_path, monkeypatch):
    broken = tmp_path / "home"
    shutil.copytree(home / "quant", broken / "quant")
    monkeypatch.setenv("EDGE_LLM_HOME", str(broken))
    root = cpuq.quant_dir(tiny_synth_dir, cpuq.mode("q4"))
    graph = root / "onnx" / f"{DECODE}.onnx"
    graph.write_bytes(b"not an onnx file")
    with pytest.raises(ConfigError, match=r"decode\.onnx cannot be loaded .*rebuild"):
        cpuq.open_cpu_q(tiny_synth_dir, "q4", blocks=None)
    graph.unlink()
    with pytest.raises(ConfigError, match=r"decode\.onnx is missing"):
        cpuq.open_cpu_q(tiny_synth_dir, "q4", blocks=None)
    # a graph of another geometry (here: a layer graph) is refused before any call
    shutil.copy(root / "onnx" / "head.onnx", graph)
    with pytest.raises(ConfigError, match="not a decode graph of this model"):
        cpuq.open_cpu_q(tiny_synth_dir, "q4", blocks=None)


def test_decode_graph_setting_off_has_its_own_numerics(model, tiny_synth_dir, home):
    """`decode_graph = false` (a 4 GB board: the graph holds a second copy of the weights) runs
    one-row steps on the per-layer graphs; other bits, so another snapshot namespace."""
    from edge_llm.backends.choice import choose_backend
    from edge_llm.runtime import make_backend
    from edge_llm.settings import Settings

    def backend(s: Settings):
        return make_backend(s, choose_backend(s, tiny_synth_dir), tiny_synth_dir)

    off = backend(Settings(model=str(tiny_synth_dir), backend="cpu-q", decode_graph=False))
    on = backend(Settings(model=str(tiny_synth_dir), backend="cpu-q"))
    assert off.row_step is None and on.row_step is not None
    assert on.numerics == model.numerics and off.numerics != on.numerics


def test_attention_and_linears_are_our_operators_and_old_directories_are_rebuilt(model, tiny_synth_dir, home, tmp_path,
                                                                           monkeypatch, caplog):
    """The decode graph's attention is one `ai.edge_llm.AttnRow` node per layer (backends/kernels/_attn.c)
    and the numerics names its code path; a graph directory of the previous format (attention
    as onnxruntime matmuls) is rebuilt on first use, not run under the new numerics."""
    import json

    import onnx

    from edge_llm.backends import kernels

    root, m = cpuq.ensure_quantized(tiny_synth_dir, cpuq.mode("q4"), blocks=None)
    graph = onnx.load(str(m.onnx_files(root)[DECODE]), load_external_data=False)
    ops = [n.op_type for n in graph.graph.node]
    assert ops.count(kernels.ATTN_OP) == model.args.num_hidden_layers
    assert "Softmax" not in ops and "Tile" not in ops
    # every linear (q/k/v, o, gate/up, down per layer, the head) is MatMulQ; no MatMulNBits and
    # no block-sum term of a float minimum
    assert ops.count(kernels.QMATMUL_OP) == 4 * model.args.num_hidden_layers + 1
    assert "MatMulNBits" not in ops and "ReduceSum" not in ops
    assert model.numerics.endswith(f":attn-{kernels.isa()}")

    old = tmp_path / "home"
    shutil.copytree(home / "quant", old / "quant")
    monkeypatch.setenv("EDGE_LLM_HOME", str(old))
    old_root = cpuq.quant_dir(tiny_synth_dir, cpuq.mode("q4"))
    manifest = json.loads((old_root / "manifest.json").read_text())
    del manifest["build"]["format"]  # what an edge-llm before the operator wrote
    (old_root / "manifest.json").write_text(json.dumps(manifest))
    caplog.set_level(logging.INFO, logger="edge_llm")
    # the memory estimate asks first (no exact size from a stale directory), then the build rebuilds:
    # one rebuild, one warning
    assert cpuq.built_weight_bytes(tiny_synth_dir, "q4") is None
    _, rebuilt = cpuq.ensure_quantized(tiny_synth_dir, cpuq.mode("q4"), blocks=None)
    assert rebuilt.build["format"] == cpuq.QUANT_FORMAT
    assert [r.levelname for r in caplog.records if "is stale" in r.getMessage()] == ["WARNING"]
    assert json.loads((old_root / "manifest.json").read_text())["build"]["format"] == cpuq.QUANT_FORMAT


def test_without_the_built_operator_one_row_steps_use_the_layer_graphs(model, tiny_synth_dir, monkeypatch, caplog):
    """A package installed without a C compiler has no `_attn` library: cpu-q still runs, one-row
    steps on the per-layer graphs, under their own numerics, and says so in the log."""
    from edge_llm.backends import kernels

    monkeypatch.setattr(kernels, "library_path", lambda: None)
    with caplog.at_level("WARNING"):
        be = cpuq.open_cpu_q(tiny_synth_dir, "q4", threads=2, blocks=None)
    assert be.row_step is None and be.numerics.endswith(":per-layer-decode")
    assert "attention operator" in caplog.text and "not built" in caplog.text
    m = Model.load(tiny_synth_dir, be)
    cache = m.new_cache(max_seq=64)
    m.prefill(PROMPT, cache, chunk=16)
    assert np.isfinite(m.forward([5], cache)).all()
