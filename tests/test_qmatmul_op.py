"""MatMulQ, cpu-q's 4/8-bit weight operator (edge_llm/backends/kernels/_qmatmul.c): the record layout, the
same bits on every code path (AVX-512 VNNI, AVX-VNNI, AVX2, C here; NEON sdot and C for aarch64
under qemu), rows independent of each other, the thread count out of the bits, accuracy on the
default model's own Q4_1 and Q8_0 blocks against float64 and against onnxruntime's MatMulNBits, and bad
shapes refused."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from edge_llm.backends import kernels
from edge_llm.backends.cpuq import nbits as Q
from edge_llm.backends.cpuq.nbits_export import qmatmul_records, write_nbits, write_qmatmul
from modelutil import f32_bits

REPO = Path(__file__).resolve().parents[1]
LIB = kernels.library()
pytestmark = pytest.mark.skipif(LIB is None, reason="the operator library was not built at install (no C compiler)")
PATHS = ("avx512vnni", "avxvnni", "avx2", "sdot", "c")


@pytest.fixture
def paths():
    """The code paths this CPU has; the library's own choice is restored afterwards (onnxruntime
    sessions of other tests load the same library)."""
    native = LIB.edge_qmatmul_isa()
    have = [p for p in PATHS if LIB.edge_qmatmul_force(p.encode()) == 0]
    yield have
    assert LIB.edge_qmatmul_force(native) == 0


def qmatmul(x: np.ndarray, qw: Q.QuantWeight, rec: np.ndarray | None = None, passes: int = 1) -> np.ndarray:
    """The operator's computation on this thread (edge_qmatmul; passes 2: edge_qmatmul_passes)."""
    rec = qmatmul_records(qw) if rec is None else rec
    x = np.ascontiguousarray(x, np.float32)
    y = np.empty((x.shape[0], qw.N), np.float32)
    mins = int(qw.mins is not None)
    if passes == 1:
        work = np.empty(LIB.edge_qmatmul_work_size(x.shape[0], qw.K), np.uint8)
        assert LIB.edge_qmatmul(x.ctypes.data, rec.ctypes.data, x.shape[0], qw.K, qw.N, qw.bits, mins,
                                y.ctypes.data, work.ctypes.data) == 0
        return y
    work = np.empty(LIB.edge_qmatmul_passes_work_size(x.shape[0], qw.K, qw.N, passes), np.uint8)
    assert LIB.edge_qmatmul_passes(x.ctypes.data, rec.ctypes.data, x.shape[0], qw.K, qw.N, qw.bits, mins, passes,
                                   y.ctypes.data, work.ctypes.data) == 0
    return y


@pytest.mark.parametrize("bits,mins", [(4, False), (4, True), (8, False), (8, True)])
def test_exact_where_every_float_step_is_exact(paths, bits, mins):
    """Activations that int8 holds exactly (integers, 127 in every block), dyadic scales and
    minimums: every product and sum is exact, so each path must give x @ W to the last bit. A
    level, zero point or minimum read from the wrong place, or a column in the wrong lane, fails."""
    rng = np.random.default_rng(3)
    T, K, N = 3, 96, 40  # 3 blocks; 40 columns: two whole tiles and a part
    x = rng.integers(-127, 128, (T, K)).astype(np.float32)
    x[:, ::32] = 127
    d = (2.0 ** rng.integers(-4, -1, (N, K // 32))).astype(np.float32)
    m = (rng.integers(-15, 16, (K // 32, N)) * 2.0 ** -6).astype(np.float32) if mins else None
    top = 1 << bits
    qw = Q.QuantWeight(bits, 32, K, N, rng.integers(0, top, (N, K // 32, 32)).astype(np.uint8), d,
                       rng.integers(0, top, (N, K // 32)).astype(np.uint8), m, "test", True)
    qw.q[0, 0, :] = top - 1  # the extremes (8-bit: 255 - z with x = 127, where AVX2 could saturate)
    qw.q[1, 0, :] = 0
    want = (x.astype(np.float64) @ Q.dequantize(qw).astype(np.float64)).astype(np.float32)
    assert np.abs(want).max() > 1000
    for p in paths:
        LIB.edge_qmatmul_force(p.encode())
        assert np.array_equal(qmatmul(x, qw), want), p


@pytest.fixture(scope="module")
def layer0(edge_home):
    """The default model's layer 0 q/k/v and down blocks (Q4_1, centred as cpu-q does) and its
    head (the tied embedding, Q8_0) from the GGUF, and the inputs those matmuls get for real tokens
    (RMSNorm of the embeddings; the SwiGLU product; the head takes the normed rows too)."""
    from edge_llm.checkpoints.gguf_blocks import gguf_blocks
    from edge_llm.config import ModelArgs
    from edge_llm.weights import load_weights

    model_dir = next(edge_home.glob("models/*/config.json")).parent
    args, src = ModelArgs.from_dir(model_dir), gguf_blocks(model_dir)
    p = args.weight_prefix

    def blocks(*names: str, kind: str = "Q4_1") -> Q.QuantWeight:
        parts = []
        for n in names:
            t = src.tensor(n if n.startswith(p) else f"{p}layers.0.{n}.weight")
            assert t.type_name == kind
            qw = Q.from_gguf(t.type_name, t.data, t.K, t.N)
            parts.append(Q.permute_rows(qw, t.order) if t.order is not None else qw)
        return Q.center(Q.concat(parts))

    w = load_weights(model_dir, args)
    ids = np.array([1, 504, 3000, 12, 9001, 77, 250, 4100, 16, 2, 31000, 401, 8, 999, 120, 45])
    e = w[f"{p}embed_tokens.weight"][ids].astype(np.float32)
    x = e / np.sqrt((e * e).mean(-1, keepdims=True) + args.rms_norm_eps) * w[f"{p}layers.0.input_layernorm.weight"]
    gate, up = x @ w[f"{p}layers.0.mlp.gate_proj.weight"].T, x @ w[f"{p}layers.0.mlp.up_proj.weight"].T
    act = (gate / (1 + np.exp(-gate)) * up).astype(np.float32)
    return {"qkv": (blocks("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), x.astype(np.float32)),
            "down": (blocks("mlp.down_proj"), act),
            "head": (blocks(f"{p}embed_tokens.weight", kind="Q8_0"), x.astype(np.float32))}


@pytest.mark.parametrize("passes", [1, 2])
@pytest.mark.parametrize("which", ["qkv", "down", "head"])
def test_paths_agree_and_rows_are_independent(layer0, paths, which, passes):
    """On the model's own weights: every path gives the same bits, and row t of a call with T rows
    is bitwise row t called alone (what speculative verify relies on), in one activation pass and
    in two (q4's decode)."""
    qw, x = layer0[which]
    rec = qmatmul_records(qw)
    LIB.edge_qmatmul_force(paths[0].encode())
    ref = qmatmul(x, qw, rec, passes)
    alone = np.concatenate([qmatmul(x[t:t + 1], qw, rec, passes) for t in range(len(x))])
    assert np.array_equal(f32_bits(ref), f32_bits(alone))
    assert np.array_equal(f32_bits(ref[:5]), f32_bits(qmatmul(x[:5], qw, rec, passes)))
    for p in paths[1:]:
        LIB.edge_qmatmul_force(p.encode())
        assert np.array_equal(f32_bits(qmatmul(x, qw, rec, passes)), f32_bits(ref)), p


@pytest.mark.parametrize("which", ["qkv", "down", "head"])
def test_two_passes_are_near_float(layer0, which, record_property):
    """passes = 2 (the remainder of the int8 rounding rounded again): against float64 on the model's
    own blocks, the error is at least 50x below one pass (measured: about 200x; an activation
    then carries ~15 bits instead of 8), and it is exactly one pass's result on x plus one pass's
    result on the remainder, added once."""
    qw, x = layer0[which]
    want = x.astype(np.float64) @ Q.dequantize(qw).astype(np.float64)
    scale = np.abs(want).max()
    one, two = qmatmul(x, qw), qmatmul(x, qw, passes=2)
    err1, err2 = np.abs(one - want).max() / scale, np.abs(two - want).max() / scale
    record_property("rel_err", {"passes=1": float(err1), "passes=2": float(err2)})
    print(which, "max error / max |y|: one pass", err1, "two passes", err2)
    assert err2 * 50 < err1
    # the remainder as the kernel forms it: x - dx q per 32-block, with one fma per element
    xb = x.reshape(len(x), -1, 32)
    dx = np.abs(xb).max(-1, keepdims=True) / np.float32(127)
    q = np.rint(xb * np.where(dx > 0, np.float32(1) / np.where(dx > 0, dx, 1), 0))
    rem = (xb.astype(np.float64) - dx.astype(np.float64) * q).astype(np.float32).reshape(x.shape)
    no_min = Q.QuantWeight(qw.bits, qw.block, qw.K, qw.N, qw.q, qw.scales, qw.zp, None, qw.origin, qw.exact)
    if qw.mins is None:  # the minimum's term is the first pass's alone
        assert np.array_equal(f32_bits(two), f32_bits(one + qmatmul(rem, no_min)))


def _session(tmp_path: Path, qw: Q.QuantWeight, threads: int, nbits: bool = True, passes: int = 1):
    """One graph, both forms of x @ W: MatMulQ (y_q4) and MatMulNBits with int8 activations plus
    the minimum's block-sum term (y_nbits, what the per-layer graphs run). `nbits=False`: MatMulQ
    alone, x of any width (for the operator's own checks)."""
    import onnxruntime as ort

    from edge_llm.backends.graph.onnx_export import GraphBuilder

    g = GraphBuilder("q4", tmp_path / "q4.onnx.data")
    write_qmatmul(g, "x", qw, "y_q4", passes)
    outs = [("y_q4", ["T", qw.N])]
    if nbits:
        write_nbits(g, "x", qw, 4, "y_nbits")
        outs.append(("y_nbits", ["T", qw.N]))
    g.write([("x", ["T", qw.K if nbits else "K"])], outs, tmp_path / "q4.onnx", opset=21)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads, opts.inter_op_num_threads = threads, 1
    kernels.register(opts)
    return ort.InferenceSession(str(tmp_path / "q4.onnx"), opts, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("which", ["qkv", "down", "head"])
def test_in_onnxruntime_threads_and_accuracy(layer0, tmp_path, which, record_property):
    """The operator in a session on 1 and 2 threads gives edge_qmatmul's bits; its error against
    float64 is at most MatMulNBits' (both quantize activations to int8 per 32-block)."""
    qw, x = layer0[which]
    want = x.astype(np.float64) @ Q.dequantize(qw).astype(np.float64)
    ref = qmatmul(x, qw)
    for threads in (1, 2):
        y_q4, y_nb = _session(tmp_path, qw, threads).run(None, {"x": x})
        assert np.array_equal(f32_bits(y_q4), f32_bits(ref)), threads
    scale = np.abs(want).max()
    err_q4, err_nb = np.abs(y_q4 - want).max() / scale, np.abs(y_nb - want).max() / scale
    record_property("rel_err", {"MatMulQ": float(err_q4), "MatMulNBits": float(err_nb)})
    print(which, "max error / max |y|: MatMulQ", err_q4, "MatMulNBits", err_nb)
    assert err_q4 <= 1.1 * err_nb and err_q4 < 0.02
    for threads in (1, 2):  # two passes (q4's decode graph): the same bits as edge_qmatmul_passes
        (y2,) = _session(tmp_path, qw, threads, nbits=False, passes=2).run(None, {"x": x})
        assert np.array_equal(f32_bits(y2), f32_bits(qmatmul(x, qw, passes=2))), threads


def test_bad_shapes_are_refused(layer0, tmp_path):
    """Records of another layout, or an x of another width, are an error naming the operator;
    edge_qmatmul refuses a K that is not whole blocks."""
    from onnxruntime.capi.onnxruntime_pybind11_state import InvalidArgument

    qw, x = layer0["down"]
    s = _session(tmp_path, qw, 1, nbits=False)
    with pytest.raises(InvalidArgument, match="MatMulQ: x must be"):
        s.run(None, {"x": x[:, :-32]})
    y, work = np.empty((1, 16), np.float32), np.empty(1 << 16, np.uint8)
    assert LIB.edge_qmatmul(x.ctypes.data, qmatmul_records(qw).ctypes.data, 1, 48, 16, 4, 1, y.ctypes.data,
                            work.ctypes.data) == -1
    assert LIB.edge_qmatmul(x.ctypes.data, qmatmul_records(qw).ctypes.data, 1, 64, 16, 6, 1, y.ctypes.data,
                            work.ctypes.data) == -1


def _check_under_qemu(layer0, tmp_path, cc: str, qemu: list[str]) -> list[list[str]]:
    """tests/c/qmatmul_check.c built by `cc` with setup.py's flags and run under `qemu` on the
    model's own q/k/v (Q4_1) and head (Q8_0, 1000 of the vocabulary: qemu is slow) blocks: every run
    (the path the CPU picks, then each path it has) must give this library's bits. Returns the
    paths each input ran."""
    exe = tmp_path / "qmatmul_check"
    build = subprocess.run([cc, "-O3", "-fopenmp-simd", "-Wno-psabi", "-Wall", "-Werror",
                            f"-I{REPO / 'third_party/onnxruntime/include'}", "-o", str(exe),
                            str(REPO / "tests/c/qmatmul_check.c"), str(REPO / "edge_llm/backends/kernels/_qmatmul.c"), "-lm"],
                           capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr
    ran = []
    for which in ("qkv", "head"):
        qw, x = layer0[which]
        qw = Q.rows(qw, 0, 1000) if which == "head" else qw
        x, rec = x[:5], qmatmul_records(qw)
        for passes in (1, 2):
            (tmp_path / "in.bin").write_bytes(np.array([len(x), qw.K, qw.N, qw.bits, qw.mins is not None, passes],
                                                       np.int64).tobytes() + x.tobytes() + rec.tobytes())
            run = subprocess.run([*qemu, str(exe), str(tmp_path / "in.bin"), str(tmp_path / "out.bin")],
                                 capture_output=True, text=True, timeout=300)
            assert run.returncode == 0, run.stdout + run.stderr
            paths = run.stdout.split()
            got = np.fromfile(tmp_path / "out.bin", np.float32).reshape(len(paths), len(x), qw.N)
            ref = qmatmul(x, qw, rec, passes)
            for p, g in zip(paths, got):
                assert np.array_equal(f32_bits(g), f32_bits(ref)), (which, p, passes)
        ran.append(paths)
    return ran


def test_aarch64_build_under_qemu_gives_the_same_bits(layer0, tmp_path):
    """The board's build: _qmatmul.c cross-compiled for aarch64, run under qemu-user on a CPU with
    the dot-product extension (it picks sdot) and on a Cortex-A53 (without: it picks C); every run
    gives the x86 library's bits, for 4-bit and 8-bit blocks. The cross compiler and qemu come
    with `make board-deps`."""
    cc, qemu = shutil.which("aarch64-linux-gnu-gcc"), shutil.which("qemu-aarch64-static")
    if cc is None or qemu is None:
        pytest.skip("no aarch64 cross compiler or qemu-user (`make board-deps` as root installs them)")
    for cpu, want in (("max", ["sdot", "sdot", "c"]), ("cortex-a53", ["c", "c"])):
        ran = _check_under_qemu(layer0, tmp_path, cc, [qemu, "-cpu", cpu, "-L", "/usr/aarch64-linux-gnu"])
        assert ran == [want, want], cpu


def test_x86_cpus_this_host_is_not_pick_their_path_and_give_the_same_bits(layer0, tmp_path):
    """The x86-64 build run under qemu-user as an AVX2-only CPU (Haswell: the library must pick its
    AVX2 path by itself, from CPUID) and as a CPU without AVX (Nehalem: plain C): the bits of this
    machine's library, whatever path it picked here (the library's own dispatch, not a forced
    path). qemu comes with `make board-deps`."""
    import platform

    qemu = shutil.which("qemu-x86_64-static")
    if platform.machine() != "x86_64" or qemu is None:
        pytest.skip("needs an x86_64 host with qemu-user (`make board-deps` as root installs it)")
    for cpu, want in (("Haswell", ["avx2", "avx2", "c"]), ("Nehalem", ["c", "c"])):
        ran = _check_under_qemu(layer0, tmp_path, "gcc", [qemu, "-cpu", cpu])
        assert ran == [want, want], cpu


def test_the_path_can_be_named_for_a_benchmark(paths):
    """EDGE_QMATMUL_ISA picks a path the CPU has (benchmarks of AVX2 on an AVX-512 machine); a path
    it lacks, or an unknown name, leaves the CPU's own choice."""
    import sys

    code = "from edge_llm.backends import kernels; print(kernels.qmatmul_isa())"

    def isa(env: str) -> str:
        import os

        r = subprocess.run([sys.executable, "-c", code], env={**os.environ, "EDGE_QMATMUL_ISA": env},
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        return r.stdout.strip()

    native = isa("")
    assert native == paths[0]  # the first path this CPU has
    assert isa("c") == "c" and isa("no-such-path") == native
    lacking = [p for p in PATHS if p not in paths]
    if lacking:
        assert isa(lacking[0]) == native
    if len(paths) > 2:
        assert isa(paths[1]) == paths[1]
