"""The attention operator `ai.edge_llm.AttnRow` (backends/kernels/_attn.c, docs/quantization.md):
against a float64 numpy reference of GQA softmax attention, across head shapes (the specialized
D = 64 / 128 bodies and the generic loop), row counts on both sides of its 256-row chunks and
the empty cache; the same bits on 1, 2 and 3 onnxruntime threads and from the one-thread entry
point (cpu-q's numerics leaves the thread count out); only its output written; bad shapes
refused with onnxruntime's error, not a crash. T query rows (a speculative verify forward): row t
is bitwise a one-row call over the S cached rows + new rows 0..t-1 (so a verified token's row is
the row a plain decode step computes), causal among the new rows. Real onnxruntime sessions,
real compiled library."""

from __future__ import annotations

import numpy as np
import pytest

from edge_llm.backends import kernels

ort = pytest.importorskip("onnxruntime", reason="the quant extra (onnxruntime) is not installed")
from onnx import TensorProto, helper  # noqa: E402

pytestmark = pytest.mark.skipif(kernels.library_path() is None,
                                reason="the attention operator was not built (no C compiler at install)")

SHAPES = [(9, 3, 64), (16, 8, 128), (4, 1, 64), (12, 3, 32), (10, 2, 48)]  # last two: generic loop
ROWS = [0, 1, 255, 256, 257, 1000]


def session(H: int, n_kv: int, D: int, threads: int):
    kv = n_kv * D
    node = helper.make_node(kernels.ATTN_OP, ["q", "k", "v", "kn", "vn"], ["y"], domain=kernels.ATTN_DOMAIN,
                            num_heads=H, kv_heads=n_kv)
    ins = [helper.make_tensor_value_info(n, TensorProto.FLOAT, s)
           for n, s in (("q", ["T", H * D]), ("k", ["S", kv]), ("v", ["S", kv]), ("kn", ["T", kv]), ("vn", ["T", kv]))]
    graph = helper.make_graph([node], "attn", ins, [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["T", H * D])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid(kernels.ATTN_DOMAIN, 1)])
    model.ir_version = 8
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    kernels.register(opts)
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def reference(q, K, V, H, n_kv, D):
    rep, out = H // n_kv, np.empty((H, D))
    for h in range(H):
        g = h // rep
        s = K[:, g * D:(g + 1) * D].astype(np.float64) @ q[h]
        p = np.exp(s - s.max())
        out[h] = (p / p.sum()) @ V[:, g * D:(g + 1) * D]
    return out


def direct(q, K, V, S, H, n_kv, D):
    lib = kernels.library()
    out = np.full((H, D), np.nan, np.float32)
    work = np.empty(lib.edge_attn_work_size(S, H, D), np.float32)
    assert lib.edge_attn_row(q.ctypes.data, K.ctypes.data, V.ctypes.data, K[S:].ctypes.data, V[S:].ctypes.data,
                             S, n_kv * D, H, n_kv, D, out.ctypes.data, work.ctypes.data) == 0
    return out


@pytest.mark.parametrize("H,n_kv,D", SHAPES)
def test_matches_reference_and_threads_do_not_change_bits(H, n_kv, D):
    rng = np.random.default_rng(H * 1000 + D)
    sessions = [session(H, n_kv, D, t) for t in (1, 2, 3)]
    for S in ROWS:
        K = rng.standard_normal((S + 1, n_kv * D), dtype=np.float32)  # the last row: the new token's
        V = rng.standard_normal((S + 1, n_kv * D), dtype=np.float32)
        q = (rng.standard_normal((1, H * D)) * 0.3).astype(np.float32)
        q[0, :D] *= 20  # one head with a peaked softmax (scores up to ~100): exp of large negatives
        before = (K.copy(), V.copy(), q.copy())
        feeds = {"q": q, "k": K[:S], "v": V[:S], "kn": K[S:], "vn": V[S:]}
        outs = [s.run(None, feeds)[0] for s in sessions]
        ref = reference(q.reshape(H, D), K, V, H, n_kv, D)
        err = float(np.abs(outs[0].reshape(H, D) - ref).max())
        assert err < 5e-6, (S, err)  # measured <= 1.3e-6
        for o in outs[1:] + [direct(q, K, V, S, H, n_kv, D).reshape(1, H * D)]:
            assert np.array_equal(o.view(np.uint32), outs[0].view(np.uint32)), S
        assert all(np.array_equal(a, b) for a, b in zip(before, (K, V, q)))  # inputs only read


@pytest.mark.parametrize("H,n_kv,D", SHAPES)
def test_query_rows_are_one_row_calls_over_the_rows_before_them(H, n_kv, D):
    rng = np.random.default_rng(H * 7 + D)
    sessions = [session(H, n_kv, D, t) for t in (1, 2)]
    lib = kernels.library()
    # S across the chunk edges, T whose new rows cross them (255 + 2, 250 + 9, 500 + 17)
    for S, T in ((0, 2), (1, 5), (250, 9), (255, 2), (256, 9), (500, 17), (1000, 3)):
        K = rng.standard_normal((S + T, n_kv * D), dtype=np.float32)
        V = rng.standard_normal((S + T, n_kv * D), dtype=np.float32)
        q = (rng.standard_normal((T, H * D)) * 0.3).astype(np.float32)
        q[:, :D] *= 20
        feeds = {"q": q, "k": K[:S], "v": V[:S], "kn": K[S:], "vn": V[S:]}
        outs = [s.run(None, feeds)[0] for s in sessions]
        direct_out = np.full((T, H * D), np.nan, np.float32)
        work = np.empty(lib.edge_attn_rows_work_size(S, T, H, D), np.float32)
        assert lib.edge_attn_rows(q.ctypes.data, K.ctypes.data, V.ctypes.data, K[S:].ctypes.data, V[S:].ctypes.data,
                                  S, T, n_kv * D, H, n_kv, D, direct_out.ctypes.data, work.ctypes.data) == 0
        for o in outs[1:] + [direct_out]:
            assert np.array_equal(o.view(np.uint32), outs[0].view(np.uint32)), (S, T)
        for t in range(T):
            one = direct(np.ascontiguousarray(q[t:t + 1]), K, V, S + t, H, n_kv, D).reshape(-1)
            assert np.array_equal(one.view(np.uint32), outs[0][t].view(np.uint32)), (S, T, t)
            ref = reference(q[t].reshape(H, D), K[:S + t + 1], V[:S + t + 1], H, n_kv, D)  # causal
            assert float(np.abs(outs[0][t].reshape(H, D) - ref).max()) < 5e-5, (S, T, t)


def test_bad_shapes_are_refused_by_onnxruntime():
    s = session(9, 3, 64, 2)
    ok = {"q": np.zeros((1, 576), np.float32), "k": np.zeros((5, 192), np.float32),
          "v": np.zeros((5, 192), np.float32), "kn": np.zeros((1, 192), np.float32),
          "vn": np.zeros((1, 192), np.float32)}
    assert s.run(None, ok)[0].shape == (1, 576)
    with pytest.raises(Exception, match="k, v must be"):
        s.run(None, ok | {"v": np.zeros((4, 192), np.float32)})  # V rows != K rows
    with pytest.raises(Exception, match="k_new, v_new must be"):
        s.run(None, ok | {"q": np.zeros((2, 576), np.float32)})  # 2 query rows, 1 new row
    lib = kernels.library()
    assert lib.edge_attn_row(None, None, None, None, None, 5, 192, 9, 2, 64, None, None) == -1  # 9 % 2 heads


def test_isa_names_the_code_path():
    isa = kernels.isa()
    assert isa.endswith("-c256") and isa.split("-")[0] in ("x86_64", "aarch64", "generic")


@pytest.mark.parametrize("march,flag", [("haswell", "avx2"), ("x86-64", "sse2")])
def test_x86_clones_each_built_alone(tmp_path, march, flag):
    """The AVX2 and SSE2 code of the operator, which this CPU's clone dispatch may never pick
    (AVX-512 here): _attn.c built for that -march alone (EDGE_ATTN_ONE_ISA) and run natively
    against the float64 reference and the rows-vs-one-row-calls check (tests/c/attn_check.c)."""
    import platform
    import subprocess
    from pathlib import Path

    if platform.machine() != "x86_64" or flag not in Path("/proc/cpuinfo").read_text():
        pytest.skip(f"needs an x86_64 CPU with {flag}")
    repo = Path(__file__).resolve().parents[1]
    exe = tmp_path / "attn_check"
    build = subprocess.run(["gcc", "-O3", "-fopenmp-simd", "-Wno-psabi", "-Wall", "-Werror", f"-march={march}",
                            "-DEDGE_ATTN_ONE_ISA", f"-I{repo / 'third_party/onnxruntime/include'}", "-o", str(exe),
                            str(repo / "tests/c/attn_check.c"), str(repo / "edge_llm/backends/kernels/_attn.c"),
                            str(repo / "edge_llm/backends/kernels/_qmatmul.c"), "-lm"],
                           capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    print(march, run.stdout.strip())
    assert float(run.stdout.split()[-1]) < 5e-6


def test_aarch64_neon_build_under_qemu(tmp_path):
    """The board's build of the operator: _attn.c cross-compiled for aarch64 (NEON; the x86
    clones are not in it) with the same flags as setup.py, run under qemu-user against a float64
    reference (tests/c/attn_check.c). The cross compiler and qemu come with `make board-deps`."""
    import shutil
    import subprocess
    from pathlib import Path

    cc, qemu = shutil.which("aarch64-linux-gnu-gcc"), shutil.which("qemu-aarch64-static")
    if cc is None or qemu is None:
        pytest.skip("no aarch64 cross compiler or qemu-user (`make board-deps` as root installs them)")
    repo = Path(__file__).resolve().parents[1]
    exe = tmp_path / "attn_check"
    build = subprocess.run([cc, "-O3", "-fopenmp-simd", "-Wno-psabi", "-Wall", "-Werror",
                            f"-I{repo / 'third_party/onnxruntime/include'}", "-o", str(exe),
                            str(repo / "tests/c/attn_check.c"), str(repo / "edge_llm/backends/kernels/_attn.c"),
                            str(repo / "edge_llm/backends/kernels/_qmatmul.c"), "-lm"],
                           capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr
    run = subprocess.run([qemu, "-L", "/usr/aarch64-linux-gnu", str(exe)], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    print(run.stdout.strip())  # e.g. "aarch64-neon worst 9.06e-07"
    isa, _, worst = run.stdout.split()
    assert isa == "aarch64-neon" and float(worst) < 5e-6
