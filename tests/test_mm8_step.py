"""The matmul path's row step (backends/npu/matmul/row_step.py) on the default model's real weights, converted
by `edge-llm convert npu-mm` (numpy only; round to nearest, `--gptq-tokens 0`, to keep the test
fast: the row step runs the backend's own linears, so the weights' rounding does not matter here)
over the host emulation.

Against the seam path (the model's per-layer loop, the same backend with its row step off) for the
same rows: not bitwise. Attention is the C kernel's (chunked online softmax, its own exp, another
summation order than numpy's matmuls), so a layer's attention output differs in the last bits,
and the next `quantize_rows` can then round one activation to the neighbouring int8 step (a change
of absmax / 127 in that element), which the later layers carry on. What is bitwise: layer 0's new
K/V rows (nothing attended before them), and every result across two calls (determinism). The
logits are held to a small KL against the seam's on every row, and to the seam's accuracy against
the F32 CPU backend over a text; a wrong RoPE, scale, causal mask or q/k norm moves layer 1's rows
and the logits far past that (shown by breaking it once: without `q *= scale`, layer 1's new K/V
rows differ by 1.8).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edge_llm.backends import kernels
from edge_llm.backends.npu.matmul.row_step import MmRowStep

pytestmark = pytest.mark.skipif(kernels.library() is None, reason="the operator library (_attn.c) is not built")

# nats per row, row step vs seam: a flipped int8 rounding in an early layer moves the rest by the
# size of the w8a8 path's own error against F32 (KL 0.003-0.005 on average). Measured up to 0.003
# per row on the round-to-nearest conversion with absmax scales, 0.025 (mean 0.0065) with the V/O
# rotation and MSE clip, the C ops or numpy's alike; a wrong RoPE, scale or mask gives KL above 1
KL_MAX = 0.05


@pytest.fixture(scope="module")
def model_dir(default_model_dir) -> Path:
    return default_model_dir


@pytest.fixture(scope="module")
def mm_dir(default_mm_rtn) -> Path:
    return default_mm_rtn


@pytest.fixture(scope="module")
def model(model_dir, mm_dir):
    from edge_llm.backends.npu.backend import open_rknn
    from edge_llm.models.qwen3 import Model

    m = Model.load(model_dir, backend=open_rknn(mm_dir, "host", model_dir=model_dir))
    yield m
    m.close()


PROMPT = list(range(300, 361))  # 61 prompt rows, then decode rows
ROWS = [7, 8, 9, 10, 11]  # a verify forward of 5 rows


def _run(model, rows, step_on: bool):
    """Prefill PROMPT through the seam, then `rows` as one decode forward with the row step on or
    off -> (logits, K/V rows of the whole cache)."""
    be = model.backend
    step = be.row_step
    cache = model.new_cache(128)
    model.prefill(PROMPT, cache, logits=False)
    if not step_on:
        be.row_step = None
    try:
        logits = model.forward(rows, cache, all_logits=True, decode=True)
    finally:
        be.row_step = step
    n = len(PROMPT) + len(rows)
    return logits, cache.data[:, :, :n].copy()


def _kl(p_logits: np.ndarray, q_logits: np.ndarray) -> np.ndarray:
    def logp(x):
        x = x.astype(np.float64) - x.max(axis=-1, keepdims=True)
        return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))
    lp, lq = logp(p_logits), logp(q_logits)
    return (np.exp(lp) * (lp - lq)).sum(axis=-1)


@pytest.mark.timeout(300)
def test_row_step_is_the_seam_up_to_rounding(model):
    be = model.backend
    assert isinstance(be.row_step, MmRowStep) and be.row_step.max_rows >= len(ROWS)  # MmBackend.load made it
    assert f"rowstep-{kernels.isa()}" in model.numerics  # restored K/V rows must come from the same kernel
    seam_logits, seam_kv = _run(model, ROWS, step_on=False)
    step_logits, step_kv = _run(model, ROWS, step_on=True)
    p = len(PROMPT)
    assert np.array_equal(step_kv[:, :, :p], seam_kv[:, :, :p])  # the prompt went through the seam
    assert np.array_equal(step_kv[0, :, p:], seam_kv[0, :, p:])  # layer 0: nothing attended before it
    # layer 1: one attention's rounding, and what it moves: a last-bit change of layer 0's attention
    # output can move a row scale by an ulp and round one int8 activation of a near tie to the
    # neighbouring step in a later quantization of the layer (measured: 0.025 with the C ops, one
    # such flip in o's dequantization + RMSNorm; < 1e-4 where none flips); without `q *= scale` 1.8
    assert np.abs(step_kv[1, :, p:] - seam_kv[1, :, p:]).max() < 0.1
    scale = np.abs(seam_kv[:, :, p:]).max(axis=(-1, -2), keepdims=True)
    # each layer's K and V rows within a tenth of their largest value (measured up to 0.065 of it, V
    # rows of late layers, after the flips above)
    assert (np.abs(step_kv[:, :, p:] - seam_kv[:, :, p:]) <= 0.1 * scale).all()
    kl = _kl(seam_logits, step_logits)
    assert kl.max() < KL_MAX, kl


@pytest.mark.timeout(300)
def test_row_step_is_deterministic(model):
    a_logits, a_kv = _run(model, ROWS, step_on=True)
    b_logits, b_kv = _run(model, ROWS, step_on=True)
    assert np.array_equal(a_logits.view(np.uint32), b_logits.view(np.uint32))
    assert np.array_equal(a_kv.view(np.uint32), b_kv.view(np.uint32))
    # a row's bits do not depend on the rows that came with it: the verify forward's rows are
    # bitwise the same rows run one at a time (the kernel's row t is its one-row call over S + t
    # rows, every other op is per row)
    be, step = model.backend, model.backend.row_step
    cache = model.new_cache(128)
    model.prefill(PROMPT, cache, logits=False)
    one = np.stack([model.forward([r], cache, decode=True) for r in ROWS])
    assert np.array_equal(one.view(np.uint32), a_logits.view(np.uint32))
    n = len(PROMPT) + len(ROWS)
    assert np.array_equal(cache.data[:, :, :n].view(np.uint32), a_kv.view(np.uint32))
    assert be.row_step is step


@pytest.mark.timeout(300)
def test_greedy_tokens_are_the_seams(model, model_dir):
    """24 greedy one-row steps after a text with the row step and through the seam: the same tokens."""
    from edge_llm.bench.accuracy import QUALITY_TEXT
    from edge_llm.tokenizer import Tokenizer

    prompt = Tokenizer.from_dir(model_dir).encode(QUALITY_TEXT)[:64]
    be = model.backend
    step = be.row_step
    answers = []
    for on in (True, False):
        be.row_step = step if on else None
        try:
            cache = model.new_cache(128)
            tok = int(model.prefill(prompt, cache).argmax())
            toks = [tok]
            for _ in range(23):
                tok = int(model.forward([tok], cache, decode=True).argmax())
                toks.append(tok)
            answers.append(toks)
        finally:
            be.row_step = step
    assert answers[0] == answers[1]


@pytest.mark.timeout(600)
def test_accuracy_is_the_seams(model, model_dir):
    """Teacher-forced over bench accuracy's text, 8-row verify forwards through the row step
    against the F32 CPU backend: top-1 and KL as the seam path's prefill of the same tokens (the
    two differ by rounding only, so neither is systematically better; measured on all 320 tokens:
    97.8 % / 0.0053 row step, 97.2 % / 0.0055 seam, on this round-to-nearest conversion)."""
    from edge_llm.bench.accuracy import QUALITY_TEXT
    from edge_llm.bench.quant import quality, teacher_logits
    from edge_llm.models.qwen3 import Model
    from edge_llm.tokenizer import Tokenizer

    ids = Tokenizer.from_dir(model_dir).encode(QUALITY_TEXT)[:160]
    ref = teacher_logits(Model.load(model_dir), ids)
    seam = quality(ref, teacher_logits(model, ids), ids)
    cache = model.new_cache(len(ids) + 8, check_memory=False)
    out = [model.forward(ids[:8], cache, all_logits=True)]
    out += [model.forward(ids[a:a + 8], cache, all_logits=True, decode=True) for a in range(8, len(ids), 8)]
    step = quality(ref, np.concatenate(out), ids)
    assert step["top1"] >= seam["top1"] - 0.02, (step, seam)
    assert step["kl"] <= 1.25 * seam["kl"], (step, seam)


def test_bad_calls_are_refused(model):
    step = model.backend.row_step
    args = model.args
    x = np.zeros((step.max_rows + 1, args.hidden_size), np.float32)
    half = np.zeros((step.max_rows + 1, args.head_dim // 2), np.float32)
    past = [(np.zeros((4, args.kv_dim), np.float32),) * 2] * args.num_hidden_layers
    with pytest.raises(ValueError, match="rows"):
        step(x, half, half, past)
    strided = np.zeros((4, 2 * args.kv_dim), np.float32)[:, ::2]
    with pytest.raises(ValueError, match="C-contiguous"):
        step(x[:1], half[:1], half[:1], [(strided, strided)] * args.num_hidden_layers)


@pytest.mark.timeout(600)
def test_restore_is_a_cold_run_with_the_row_step(model_dir, mm_dir, tmp_path):
    """tests/test_restore_recompute.py's property with the row step on (it is on whenever the
    library is built: the first test): a snapshot of m unaligned rows restored in a new process +
    the tail (its last prompt row and the decoded rows go through the row step) is bitwise a cold
    run."""
    from test_restore_recompute import check_restores

    rows = check_restores(model_dir, tmp_path, (45,), backend="rknn", chunk=32, n=150, rknn_dir=mm_dir,
                          runner="host")
    assert [r["restored"] for r in rows] == [32]
