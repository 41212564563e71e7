"""The matmul path's per-row ops in C (backends/npu/matmul/_row_ops.c through row_ops.COps) against their numpy
reference (row_ops.NumpyOps), on the default model's real activations: the inputs every op got
while the matmul path (round-to-nearest conversion, host emulation) ran a prompt of the accuracy
text, its first row's massive activations included.

What must hold, and how each test fails when the C ops break:
- quantize, dequantize (+ bias), dequantize + residual add: bitwise numpy's (the same float32
  operations in the same order); a swapped multiplication order or a multiply by 1/scale instead of
  the division breaks `test_ops_match_numpy_on_real_rows`;
- RMSNorm + quantize and SwiGLU + online Hadamard + quantize: the row scales within float32 rounding,
  the int8 values numpy's except a rare one-step difference where numpy's scaled value is a near tie
  (the C sums of squares, the Hadamard's small block and exp round differently in the last bit);
  a wrong eps, a missing 1/sqrt(s) or another block order moves scales and ints far past that;
- round half to even on ties built by hand (truncation or half-away-from-zero fail it), zero rows
  (scale 1, q 0: a division by a zero scale gives NaN and fails it);
- rows never mix: every op's row alone is bitwise that row in a batch (restore == recompute needs it;
  a reduction across rows breaks `test_rows_alone_are_bitwise_the_batch`);
- the residual rotation as a fast transform (butterflies + the converter's Hadamard block) equals the
  rows times the dense matrix within float32 rounding, for the default model's 576 (8 x 72) and the
  2B's 2048 (16 x 128); a wrong sign vector or block transpose gives errors of the rows' size;
- the bits do not depend on the CPU's vector width: the x86-64 baseline build (no clones,
  EDGE_MM8_ONE_ISA) gives bitwise this CPU's clone (AVX-512 here) on the same rows; a contraction into
  fused multiply-adds in one clone fails it (shown by building it with -march=skylake-avx512
  -ffp-contract=fast without the file's pragma: on 40 random rows 1 RMSNorm row scale and 15 SwiGLU
  row scales of 40 differ from the installed clone's);
- the backend's numerics name the C ops (`:ops-c1`), and the model's logits through them stay close
  to the numpy ops' (the two round differently, so not bitwise: the size of the path's own noise).
"""

from __future__ import annotations

import ctypes
import platform
import shutil
import subprocess
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

from edge_llm.backends.npu.matmul import row_ops
from edge_llm.backends.cpu.backend import swiglu
from edge_llm.backends.npu.matmul.int8 import dequantize, quantize_rows
from edge_llm.backends.npu.matmul.row_ops import COps, NumpyOps, fwht, rows_matmul
from edge_llm.convert.hadamard import orthogonal, orthogonal_factors

pytestmark = pytest.mark.skipif(row_ops.c_ops() is None, reason="the operator library is not built")

ROWS = 40  # prompt rows of the accuracy text: row 0's massive activations and ordinary rows


class Recorder(NumpyOps):
    """The numpy ops, keeping a copy of every call's arguments."""

    def __init__(self) -> None:
        self.calls: dict[str, list[tuple]] = defaultdict(list)

    def _keep(self, name: str, *args) -> None:
        self.calls[name].append(tuple(np.array(a, copy=True) if isinstance(a, np.ndarray) else a for a in args))

    def rotate(self, x, dense, factors):
        # the backend loaded for the C ops keeps only the rotation's factors: the converter's dense R
        return super().rotate(x, orthogonal(x.shape[1]) if dense is None else dense, factors)

    def norm_quant(self, x, eps):
        self._keep("norm_quant", x, eps)
        return super().norm_quant(x, eps)

    def quant(self, x):
        self._keep("quant", x)
        return super().quant(x)

    def dequant(self, c, rs, cs, bias):
        self._keep("dequant", c, rs, cs, bias)
        return super().dequant(c, rs, cs, bias)

    def dequant_add(self, c, rs, cs, x):
        self._keep("dequant_add", c, rs, cs, x)
        return super().dequant_add(c, rs, cs, x)

    def dequant_add_norm_quant(self, c, rs, cs, x, eps):
        self._keep("dequant_add_norm_quant", c, rs, cs, x, eps)
        return super().dequant_add_norm_quant(c, rs, cs, x, eps)

    def swiglu_quant(self, c, rs, cs, inter, block):
        self._keep("swiglu_quant", c, rs, cs, inter, block)
        return super().swiglu_quant(c, rs, cs, inter, block)


# no per-test timeout marks below the global one (900 s): pytest-timeout counts fixture setup, and
# the first test of the module pays for these (the default model's conversion, its load, a forward)
@pytest.fixture(scope="module")
def model(default_model_dir, default_mm_rtn):
    from edge_llm.backends.npu.backend import open_rknn
    from edge_llm.models.qwen3 import Model

    m = Model.load(default_model_dir, backend=open_rknn(default_mm_rtn, "host", model_dir=default_model_dir))
    yield m
    m.close()


@pytest.fixture(scope="module")
def prompt(default_model_dir) -> list[int]:
    from edge_llm.bench.accuracy import QUALITY_TEXT
    from edge_llm.tokenizer import Tokenizer

    return Tokenizer.from_dir(default_model_dir).encode(QUALITY_TEXT)[:ROWS]


@pytest.fixture(scope="module")
def recorded(model, prompt) -> tuple[dict[str, list[tuple]], np.ndarray]:
    """Every op's arguments while the numpy ops run the prompt, and the numpy ops' logits."""
    be = model.backend
    c_ops, rec = be.ops, Recorder()
    be.ops = rec
    try:
        logits = model.forward(prompt, model.new_cache(64), all_logits=True)
    finally:
        be.ops = c_ops
    return rec.calls, logits


def _near_tie_flips(x_ref: np.ndarray, q_ref: np.ndarray, s_ref: np.ndarray, q: np.ndarray, s: np.ndarray,
                    what: str) -> int:
    """Scales within float32 rounding; ints one step apart at most, only at near ties of numpy's
    scaled value; the number of differing ints."""
    np.testing.assert_allclose(s, s_ref, rtol=2e-6, err_msg=what)
    diff = q.astype(np.int16) - q_ref
    assert np.abs(diff).max() <= 1, what
    rows, cols = np.nonzero(diff)
    v = x_ref[rows, cols] / s_ref[rows]
    assert (np.abs(np.abs(v - np.trunc(v)) - 0.5) < 2e-3).all(), (what, v)
    return len(rows)


def test_ops_match_numpy_on_real_rows(model, recorded):
    calls, _ = recorded
    n, c = NumpyOps(), row_ops.c_ops()
    assert isinstance(c, COps) and model.backend.ops is c  # the backend runs the C ops when built
    for x, in calls["quant"]:
        for a, b in zip(n.quant(x), c.quant(x)):
            assert np.array_equal(a, b)
    for args in calls["dequant"]:
        assert np.array_equal(n.dequant(*args).view(np.uint32), c.dequant(*args).view(np.uint32))
    assert any(args[3] is None for args in calls["dequant"])  # the head (no bias)
    for args in calls["dequant_add"]:
        assert np.array_equal(n.dequant_add(*args).view(np.uint32), c.dequant_add(*args).view(np.uint32))
    flips, total = defaultdict(int), defaultdict(int)
    for x, eps in calls["norm_quant"]:
        x_ref = x * (np.float32(1.0) / np.sqrt(np.mean(np.square(x), axis=-1, keepdims=True) + eps))
        flips["norm"] += _near_tie_flips(x_ref, *n.norm_quant(x, eps), *c.norm_quant(x, eps), "norm_quant")
        total["norm"] += x.size
    for args in calls["dequant_add_norm_quant"]:
        h_ref, q_ref, s_ref = n.dequant_add_norm_quant(*args)
        h, q, s = c.dequant_add_norm_quant(*args)
        assert np.array_equal(h_ref.view(np.uint32), h.view(np.uint32))
        eps = args[4]
        x_ref = h_ref * (np.float32(1.0) / np.sqrt(np.mean(np.square(h_ref), axis=-1, keepdims=True) + eps))
        flips["norm"] += _near_tie_flips(x_ref, q_ref, s_ref, q, s, "dequant_add_norm_quant")
        total["norm"] += h.size
    for gu, rs, cs, inter, block in calls["swiglu_quant"]:
        assert block is not None  # the default conversion has the online Hadamard
        act = fwht(swiglu(dequantize(gu, rs, cs), inter), block)
        flips["swiglu"] += _near_tie_flips(act, *n.swiglu_quant(gu, rs, cs, inter, block),
                                           *c.swiglu_quant(gu, rs, cs, inter, block), "swiglu_quant")
        total["swiglu"] += act.size
    # measured: 3 of 2.1 M RMSNorm ints and 11 of 1.8 M SwiGLU ints differ, each by one step at a tie
    assert flips["norm"] <= 1e-4 * total["norm"] and flips["swiglu"] <= 1e-4 * total["swiglu"], (flips, total)


def test_rows_alone_are_bitwise_the_batch(recorded):
    calls, _ = recorded
    c = row_ops.c_ops()
    assert c is not None

    def same(batch, one_row, t: int) -> None:
        for a, b in zip(batch if isinstance(batch, tuple) else (batch,), one_row if isinstance(one_row, tuple)
                        else (one_row,)):
            assert np.array_equal(a[t:t + 1].view(np.uint8), b.view(np.uint8))

    x, eps = calls["norm_quant"][0]
    gu, rs, cs, inter, block = calls["swiglu_quant"][0]
    o, ors, ocs, ox, _ = calls["dequant_add_norm_quant"][0]
    for t in (0, 1, ROWS // 2, ROWS - 1):
        same(c.norm_quant(x, eps), c.norm_quant(x[t:t + 1], eps), t)
        same(c.quant(x), c.quant(x[t:t + 1]), t)
        same(c.swiglu_quant(gu, rs, cs, inter, block), c.swiglu_quant(gu[t:t + 1], rs[t:t + 1], cs, inter, block), t)
        same(c.dequant_add_norm_quant(o, ors, ocs, ox, eps),
             c.dequant_add_norm_quant(o[t:t + 1], ors[t:t + 1], ocs, ox[t:t + 1], eps), t)
    for n in (576, 2048):
        block, scale = orthogonal_factors(n)
        rows = np.random.default_rng(n).standard_normal((9, n), dtype=np.float32)
        full = c.rotate(rows, orthogonal(n), (block, scale))
        for t in (0, 4, 8):
            assert np.array_equal(full[t].view(np.uint32), c.rotate(rows[t:t + 1], orthogonal(n), (block, scale))[0]
                                  .view(np.uint32))


def test_round_half_to_even_and_zero_rows():
    c = row_ops.c_ops()
    assert c is not None
    ties = np.array([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 125.5, 126.5, -126.5, 3.49999976, 127.0], np.float32)
    x = np.zeros((3, 64), np.float32)
    x[0, :ties.size] = ties  # absmax 127: scale exactly 1, so x / scale are the ties themselves
    x[2, 5] = -127.0
    x[2, 6] = 63.5
    q, s = c.quant(x)
    assert np.array_equal(q[0, :ties.size], [0, 2, 2, 0, -2, -2, 126, 126, -126, 3, 127])
    assert q[2, 6] == 64 and q[2, 5] == -127  # 63.5 -> 64 (even)
    assert s[1] == 1.0 and not q[1].any()  # a zero row: scale 1, q 0
    qr, sr = quantize_rows(x)
    assert np.array_equal(q, qr) and np.array_equal(s, sr)
    qn, sn = c.norm_quant(x[1:2], np.float32(1e-6))
    assert sn[0] == 1.0 and not qn.any()
    gu = np.zeros((2, 128), np.int32)
    gu[1, :64] = 1000  # silu(gate) * 0: still a zero row
    qs, ss = c.swiglu_quant(gu, np.ones(2, np.float32), np.ones(128, np.float32), 64, None)
    assert np.array_equal(ss, [1.0, 1.0]) and not qs.any()


@pytest.mark.parametrize("n", [576, 2048])
def test_fast_rotation_is_the_dense_matrix(n):
    c = row_ops.c_ops()
    assert c is not None
    dense, factors = orthogonal(n), orthogonal_factors(n)
    assert factors is not None
    rows = np.random.default_rng(0).standard_normal((5, n), dtype=np.float32)
    rows[0, 3] = 2.5e4  # a massive activation, as row 0 of the default model has
    want = rows.astype(np.float64) @ dense.astype(np.float64)
    got, ref = c.rotate(rows, dense, factors), rows_matmul(rows, dense)
    norm = np.linalg.norm(rows, axis=1, keepdims=True)  # R is orthogonal: the outputs' size
    # float32 rounding (eps 1.2e-7) of the row's norm: measured 3e-8 of it for the fast transform and
    # about the same for numpy's sgemv; a flipped sign or a transposed block gives errors of order 1
    assert (np.abs(got - want) <= 1.2e-7 * norm).all(), (np.abs(got - want) / norm).max()
    assert (np.abs(ref - want) <= 1.2e-7 * norm).all()
    # without factors (an older conversion, or a QR rotation) the dense product, bitwise numpy's
    assert np.array_equal(c.rotate(rows, dense, None), ref)


def test_bad_input_is_refused():
    c = row_ops.c_ops()
    assert c is not None
    with pytest.raises(ValueError, match="int32"):
        c.dequant(np.zeros((2, 64), np.int64), np.ones(2, np.float32), np.ones(64, np.float32), None)
    with pytest.raises(ValueError, match="channel scales"):
        c.dequant(np.zeros((2, 64), np.int32), np.ones(2, np.float32), np.ones(32, np.float32), None)
    with pytest.raises(ValueError, match="Hadamard block"):
        c.swiglu_quant(np.zeros((1, 192), np.int32), np.ones(1, np.float32), np.ones(192, np.float32), 96,
                       np.eye(5, dtype=np.float32))
    with pytest.raises(ValueError, match="rotation block"):
        c.rotate(np.zeros((1, 96), np.float32), np.eye(96, dtype=np.float32), (np.eye(5, dtype=np.float32),
                                                                                 np.ones(96, np.float32)))


@pytest.mark.skipif(platform.machine() != "x86_64" or shutil.which("gcc") is None, reason="x86-64 with gcc")
def test_baseline_build_gives_the_same_bits(recorded, tmp_path):
    src = Path(row_ops.__file__).with_name("_row_ops.c")
    lib = tmp_path / "mm8ops_baseline.so"
    build = subprocess.run(["gcc", "-O3", "-fopenmp-simd", "-Wno-psabi", "-Wall", "-Werror", "-march=x86-64",
                            "-DEDGE_MM8_ONE_ISA", "-shared", "-fPIC", "-o", str(lib), str(src)],
                           capture_output=True, text=True, timeout=240)
    assert build.returncode == 0, build.stderr
    base, here = COps(ctypes.CDLL(str(lib))), row_ops.c_ops()
    assert here is not None
    calls, _ = recorded

    def same(a, b) -> None:
        for u, v in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,)):
            assert np.array_equal(u.view(np.uint8), v.view(np.uint8))

    for x, eps in calls["norm_quant"]:
        same(base.norm_quant(x, eps), here.norm_quant(x, eps))
    for args in calls["dequant_add_norm_quant"]:
        same(base.dequant_add_norm_quant(*args), here.dequant_add_norm_quant(*args))
    for args in calls["swiglu_quant"]:
        same(base.swiglu_quant(*args), here.swiglu_quant(*args))
    for n in (576, 2048):
        rows = np.random.default_rng(1).standard_normal((4, n), dtype=np.float32)
        same(base.rotate(rows, orthogonal(n), orthogonal_factors(n)), here.rotate(rows, orthogonal(n),
                                                                                  orthogonal_factors(n)))


def test_numerics_name_the_ops_and_logits_stay_close(model, recorded, prompt):
    be = model.backend
    assert be.ops.tag == "ops-c1" and be.numerics.endswith(f":ops-c1:rowstep-{be.numerics.rsplit('rowstep-', 1)[1]}")
    assert be.rotation_factors is not None  # the conversion wrote them: the fast transform runs
    assert be.rotation is None  # and the dense matrix, derivable from them, is not kept
    from edge_llm.backends.npu.matmul.decoder import MmBackend

    numpy_be = MmBackend(be.root, be.m, be.engine, ops=NumpyOps())
    assert "ops-c1" not in numpy_be.numerics and numpy_be.numerics != be.numerics.rsplit(":rowstep-", 1)[0]
    _, numpy_logits = recorded
    c_logits = model.forward(prompt, model.new_cache(64), all_logits=True)

    def logp(x):
        x = x.astype(np.float64) - x.max(axis=-1, keepdims=True)
        return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))

    lp, lq = logp(numpy_logits), logp(c_logits)
    kl = (np.exp(lp) * (lp - lq)).sum(axis=-1)
    # not bitwise: a last-bit difference (the C sums of squares, exp, Hadamard block and rotation) can
    # round one int8 activation of a near tie to the other step, and later layers carry it on, the
    # size of the w8a8 path's own rounding noise. Measured here: KL mean 0.0036, max 0.016 over the
    # 40 rows, top-1 97.5 % (over `bench accuracy`'s 319 tokens, round to nearest: C vs numpy ops 0.0030, top-1
    # 98.4 %; against the F32 CPU backend numpy's 0.0055 / 97.2 %, C's 0.0051 / 96.6 %)
    assert kl.mean() < 0.006 and kl.max() < 0.05, kl
    assert (numpy_logits.argmax(-1) == c_logits.argmax(-1)).mean() >= 0.9


def test_qk_rope_is_the_models_formula(model, recorded):
    """The row step's q/k RMSNorm + RoPE + q scale in one C call (`COps.qk_rope`) against the
    model's numpy (models/qwen3.py's per-layer loop: rms_norm, apply_rope, q *= scale) on the q/k/v
    rows of every layer: without q/k norms (the default model has none) bitwise, with them (gains
    drawn here: Qwen3's per-head norms, real rows) within float32 rounding (the sums of squares in
    the C order); v copied as it is; a row alone bitwise the row in a batch. A swapped sin sign or a
    missing gain moves values by their own size."""
    from edge_llm.backends.cpu.backend import rms_norm
    from edge_llm.models.rope import apply_rope

    calls, _ = recorded
    a, c = model.args, row_ops.c_ops()
    assert c is not None and not a.qk_norm
    H, n_kv, D = a.num_attention_heads, a.num_key_value_heads, a.head_dim
    layers = [args for args in calls["dequant"] if args[0].shape[1] == a.q_dim + 2 * a.kv_dim]
    assert len(layers) == a.num_hidden_layers
    T = layers[0][0].shape[0]
    cos, sin = model.rope.cos_sin(np.arange(T))
    eps, worst = np.float32(a.rms_norm_eps), 0.0
    rng = np.random.default_rng(0)
    for layer, args in enumerate(layers):
        y = NumpyOps().dequant(*args)
        q, k, v = y[:, :a.q_dim], y[:, a.q_dim:a.q_dim + a.kv_dim], y[:, a.q_dim + a.kv_dim:]
        gains = None if layer % 2 else (rng.uniform(0.2, 3.0, D).astype(np.float32),
                                        rng.uniform(0.2, 3.0, D).astype(np.float32))
        q_ref, k_ref = q.reshape(T, H, D), k.reshape(T, n_kv, D)
        if gains is not None:
            q_ref, k_ref = rms_norm(q_ref, gains[0], eps), rms_norm(k_ref, gains[1], eps)
        q_ref = apply_rope(q_ref, cos, sin)
        q_ref *= model.scale
        k_ref = apply_rope(k_ref, cos, sin)
        outs = np.empty((T, a.q_dim), np.float32), np.empty((T, a.kv_dim), np.float32), np.empty((T, a.kv_dim),
                                                                                                    np.float32)
        c.qk_rope(q, k, v, H, n_kv, gains, eps, cos[:, :D // 2], sin[:, :D // 2], model.scale, *outs)
        assert np.array_equal(outs[2], v)
        for got, ref in ((outs[0], q_ref.reshape(T, -1)), (outs[1], k_ref.reshape(T, -1))):
            if gains is None:
                assert np.array_equal(got.view(np.uint32), ref.view(np.uint32))
            worst = max(worst, float((np.abs(got - ref) / (np.abs(ref).max(axis=1, keepdims=True))).max()))
        one = tuple(np.empty((1, o.shape[1]), np.float32) for o in outs)
        t = T // 2
        c.qk_rope(q[t:t + 1], k[t:t + 1], v[t:t + 1], H, n_kv, gains, eps, cos[t:t + 1, :D // 2],
                  sin[t:t + 1, :D // 2], model.scale, *one)
        assert all(np.array_equal(o[t:t + 1].view(np.uint32), p.view(np.uint32)) for o, p in zip(outs, one))
    assert worst < 1e-6, worst  # relative to each row's largest value: a few float32 ulps (measured 2.4e-7)


# two subprocesses bounded at 300 s each, plus the module's fixtures (model load, recording):
# pytest-timeout counts the fixtures' setup too; the bound is for a hang, not a speed
@pytest.mark.timeout(1200)
def test_aarch64_build_under_qemu_gives_the_same_bits(model, recorded, tmp_path):
    """The board's build: _row_ops.c cross-compiled for aarch64 (NEON, no clones) with setup.py's
    flags, run under qemu-user by tests/c/mm8ops_check.c on the default model's real rows (RMSNorm +
    quantize, SwiGLU + Hadamard + quantize, the fast rotation, q/k RMSNorm + RoPE, dequantize +
    residual add + RMSNorm + quantize): bitwise this CPU's clone. A fused multiply-add contracted on
    aarch64 (its compiler contracts by default: the file's pragma stops it) would fail it."""
    cc, qemu = shutil.which("aarch64-linux-gnu-gcc"), shutil.which("qemu-aarch64-static")
    if cc is None or qemu is None:
        pytest.skip("no aarch64 cross compiler or qemu-user (`make board-deps` as root installs them)")
    repo = Path(__file__).resolve().parents[1]
    exe = tmp_path / "mm8ops_check"
    build = subprocess.run([cc, "-O3", "-fopenmp-simd", "-Wno-psabi", "-Wall", "-Werror", "-o", str(exe),
                            str(repo / "tests/c/mm8ops_check.c"), str(repo / "edge_llm/backends/npu/matmul/_row_ops.c"), "-lm"],
                           capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr
    calls, _ = recorded
    a, c = model.args, row_ops.c_ops()
    assert c is not None
    x, eps = calls["norm_quant"][0]
    gu, rs, gs, inter, block = calls["swiglu_quant"][0]
    o, _, os_, _, _ = calls["dequant_add_norm_quant"][0]
    rot_block, rot_scale = orthogonal_factors(a.hidden_size)
    qkv = NumpyOps().dequant(*calls["dequant"][0])
    T, n, H, K, D = x.shape[0], x.shape[1], a.num_attention_heads, a.num_key_value_heads, a.head_dim
    rng = np.random.default_rng(3)
    qg, kg = rng.uniform(0.2, 3.0, D).astype(np.float32), rng.uniform(0.2, 3.0, D).astype(np.float32)
    cos, sin = (t[:, :D // 2].copy() for t in model.rope.cos_sin(np.arange(T)))
    head = np.array([T, n, inter, block.shape[0], rot_block.shape[0], H, K, D], np.int64).tobytes()
    arrays = [x, gu, rs, gs, block, rot_block, rot_scale, qkv, qg, kg, cos, sin, o, os_]
    (tmp_path / "in.bin").write_bytes(head + np.float32(eps).tobytes() + b"".join(
        np.ascontiguousarray(v).tobytes() for v in arrays))
    run = subprocess.run([qemu, "-L", "/usr/aarch64-linux-gnu", str(exe), str(tmp_path / "in.bin"),
                          str(tmp_path / "out.bin")], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "aarch64 ok", run.stdout + run.stderr
    outs = [np.zeros((T, a.q_dim), np.float32), np.zeros((T, a.kv_dim), np.float32),
            np.zeros((T, a.kv_dim), np.float32)]
    q, k, v = qkv[:, :a.q_dim], qkv[:, a.q_dim:a.q_dim + a.kv_dim], qkv[:, a.q_dim + a.kv_dim:]
    c.qk_rope(q, k, v, H, K, (qg, kg), eps, cos, sin, np.float32(0.125), *outs)
    want = [*c.norm_quant(x, eps), *c.swiglu_quant(gu, rs, gs, inter, block),
            c.rotate(x, orthogonal(n), (rot_block, rot_scale)), *outs,
            *c.dequant_add_norm_quant(o, rs, os_, x, eps)]
    assert (tmp_path / "out.bin").read_bytes() == b"".join(w.tobytes() for w in want)
