"""What cpu-q's `numerics` (its snapshot identity, docs/identity.md) names of the kernels outside its
graph files: onnxruntime's release, the kernel family MLAS picks on the CPU, numpy's kernels.

The MLAS family follows MLAS's own platform rules (docs/quantization.md, "Bits and CPUs"): flags
that pick no other kernel for cpu-q's ops (AVX-VNNI beside AVX-512 VNNI, AMX) leave it alone; flags
that do (VNNI or not, AVX-512 core or not, AVX-VNNI on an AVX2 CPU) change it. The CPUs below are
given by their /proc/cpuinfo flags (the relevant ones).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from edge_llm.backends.cpuq import backend as cpuq

BASE = {"sse2", "avx", "avx2", "fma", "f16c"}
AVX512_CORE = {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd"}
CPUS = {
    "haswell": BASE,
    "alder-lake": BASE | {"avx_vnni"},  # AVX-VNNI, no AVX-512
    "skylake-x": BASE | AVX512_CORE,  # AVX-512 without VNNI
    "cascade-lake": BASE | AVX512_CORE | {"avx512_vnni"},
    "zen4": BASE | AVX512_CORE | {"avx512_vnni", "avx512_bf16", "avx512vbmi"},  # no AVX-VNNI
    "sapphire-rapids": BASE | AVX512_CORE | {"avx512_vnni", "avx512_bf16", "avx_vnni", "amx_int8", "amx_tile"},
    "knights-landing": BASE | {"avx512f", "avx512cd"},  # AVX-512 F without BW/DQ/VL
    "sandy-bridge": {"sse2", "avx"},
    "core2": {"sse2"},
}


def isa(cpu: str) -> str:
    return cpuq.kernel_isa(frozenset(CPUS[cpu]), "x86_64")


def test_mlas_family_per_cpu():
    assert isa("haswell") == "x86_64-mlas-avx2-fma3"
    assert isa("alder-lake") == "x86_64-mlas-avx2vnni-fma3"
    assert isa("skylake-x") == "x86_64-mlas-avx512-avx512f"
    assert isa("cascade-lake") == "x86_64-mlas-avx512vnni-avx512f"
    assert isa("knights-landing") == "x86_64-mlas-avx2-avx512f"
    assert isa("sandy-bridge") == "x86_64-mlas-none-avx"
    assert isa("core2") == "x86_64-mlas-none-sse2"
    assert cpuq.kernel_isa(frozenset(CPUS["cascade-lake"]), "riscv64") == "riscv64-mlas"  # no x86 rule elsewhere


def test_flags_that_pick_no_other_kernel_keep_the_family():
    """The issue's AMD EPYC (AVX-512 VNNI, no AVX-VNNI) and a Xeon with AVX-VNNI and AMX run the
    same MatMulNBits kernels: one family (the flag list before named them apart)."""
    assert isa("zen4") == isa("sapphire-rapids") == isa("cascade-lake")


def test_every_kernel_change_is_a_new_family():
    families = [isa(c) for c in ("haswell", "alder-lake", "skylake-x", "cascade-lake", "knights-landing",
                                 "sandy-bridge", "core2")]
    assert len(set(families)) == len(families)


def test_aarch64_family():
    assert cpuq.kernel_isa(frozenset({"fp", "asimd", "asimddp"}), "aarch64") == "aarch64-mlas-asimddp"  # Cortex-A76
    assert cpuq.kernel_isa(frozenset({"fp", "asimd"}), "aarch64") == "aarch64-mlas"  # Cortex-A53
    assert cpuq.kernel_isa(frozenset({"asimddp", "i8mm", "sve"}), "aarch64") == "aarch64-mlas-asimddp-i8mm-sve"


def test_kernel_key_names_the_onnxruntime_release_and_numpy():
    from edge_llm.backends.cpu.backend import numpy_kernels

    a, b = cpuq.kernel_key("1.32.0"), cpuq.kernel_key("1.31.1")
    assert a != b and a.startswith("onnxruntime-1.32.0:") and b.startswith("onnxruntime-1.31.1:")
    assert a.endswith(numpy_kernels()) and cpuq.kernel_isa() in a


@pytest.mark.skipif(sys.platform != "linux", reason="OpenBLAS kernel families of numpy's Linux wheels")
def test_numpy_kernels_change_with_the_blas_family_and_the_simd_loops():
    """numpy picks its BLAS kernels and its SIMD loops when it loads: each switch is another key."""
    code = "from edge_llm.backends.cpu.backend import numpy_kernels; print(numpy_kernels())"

    def key(**env) -> str:
        import os

        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                           env={k: v for k, v in os.environ.items() if not k.startswith(("OPENBLAS_", "NPY_"))} | env)
        assert r.returncode == 0, r.stderr
        return r.stdout.strip()

    base = key()
    assert base.startswith("numpy-") and ":" in base
    if "openblas" in base and "-Haswell" not in base:
        assert key(OPENBLAS_CORETYPE="Haswell").endswith("-Haswell")
    if "X86_V4" in base:
        assert "X86_V4" not in key(NPY_DISABLE_CPU_FEATURES="X86_V4 AVX512_ICL AVX512_SPR")


@pytest.mark.skipif(sys.platform != "linux", reason="OpenBLAS kernel families of numpy's Linux wheels")
def test_the_cpu_backends_numerics_name_numpys_kernels():
    """The F32 backend's rows differ in the last bits under OpenBLAS's Haswell and SkylakeX kernels
    (docs/store.md, "Restore and recompute"): its snapshots must not restore across them."""
    import os

    code = ("from edge_llm.backends.cpu.backend import CPUBackend; from edge_llm.backends.cpu.tower import "
            "CPUVisionBackend; print(CPUBackend().numerics); print(CPUVisionBackend().numerics)")

    def numerics(**env) -> list[str]:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                           env={k: v for k, v in os.environ.items() if not k.startswith(("OPENBLAS_", "NPY_"))} | env)
        assert r.returncode == 0, r.stderr
        return r.stdout.split()

    text, vision = numerics()
    assert text == vision and text.startswith("cpu-f32:numpy-")
    if "openblas" in text and "-Haswell" not in text:
        assert numerics(OPENBLAS_CORETYPE="Haswell")[0] != text
