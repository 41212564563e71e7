"""Golden greedy tokens of the default model (SmolLM2-135M-Instruct, as llama2.c pins its test
model's): the exact ids of 24 argmax steps after two fixed prompts, one through the chat template
and one raw, on the CPU backend under both of numpy's x86 OpenBLAS kernel families (the default
pick and Haswell, whose logits differ in the last bits: greedy tokens must not), and on cpu-q with
1 and 2 threads (its kernels give the same bits on any thread count, docs/quantization.md).

cpu-q's ids are pinned per kernel key, not across machines: a last-bit difference can turn into a
changed greedy token at a close call (with int8 activations it did), and what decides those bits outside the
code is onnxruntime's release, the kernel family its MLAS picks on the CPU, numpy's kernels (its
SIMD dispatch and its BLAS's kernel family: the prompt rows' attention runs in numpy) and
AttnRow's path; the helper prints that key (`cpuq.kernel_key` + `kernels.isa()`). A key
without pinned ids skips the pin with its reason (the key, so it can be added after checking the
text) and still checks the 1-vs-2-thread equality; it never passes silently. The same runs check
that `numerics`, the snapshot identity, separates kernels whose ids differ.

Any change to the numerics of the decoder, the backends, the tokenizer or the chat template that
moves a greedy token shows here as a changed id. To re-pin after an intended change, print the
helper's output (tests/helpers/golden_ids.py) and check the text still reads right.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

HELPER = Path(__file__).parent / "helpers" / "golden_ids.py"
N = 24
PROMPTS = {"chat": ["chat", "Why is the sky blue? Answer in two sentences."],
           "raw": ["raw", "The three primary colors are"]}
# "The sky blue is a result of the Earth's atmosphere scattering sunlight in different
#  wavelengths. When sunlight reaches our planet, it"
CHAT = [504, 6376, 4461, 314, 253, 966, 282, 260, 2591, 506, 5264, 24484, 8118, 281, 896, 20518, 30, 1550, 8118,
        9732, 653, 3925, 28, 357]
# " the primary colors of the RGB color model: red, blue, and green. These colors are fundamental
#  to the RGB color"
RAW = [260, 3003, 4683, 282, 260, 35526, 2380, 1743, 42, 2382, 28, 4461, 28, 284, 2654, 30, 1216, 4683, 359, 4959,
       288, 260, 35526, 2380]
# cpu-q's ids per kernel key (tests/helpers/golden_ids.py prints it), measured on an x86-64 AVX-512
# VNNI CPU without AVX512-FP16 (AMD EPYC, so numpy has no AVX512_SPR loops), onnxruntime 1.32.0,
# numpy 2.4.6 with its OpenBLAS's SkylakeX and Haswell kernels (OPENBLAS_CORETYPE), with numpy's
# X86_V4 loops and without (NPY_DISABLE_CPU_FEATURES="X86_V4 AVX512_ICL AVX512_SPR"). Since quant
# format 5 (q4's activations in float for prompt rows and in two int8 passes for decode,
# docs/quantization.md) all four give RAW, the F32 ids. With int8 activations (q4-int8, and q4
# before) the SkylakeX and Haswell kernels had left them at token 9 and parted from each other at
# token 20 (" ... color model, which are:\n\n* Red (R): 255 in" against "... The primary color that
# is"), also with numpy's AVX512_SPR loops on a Xeon; those keys are not re-measured on the new
# weights, so they are not pinned (a run there skips, naming its key and ids). The AVX2 family: the
# helper run under `qemu-x86_64-static -cpu Haswell` (every kernel takes its AVX2 path by CPUID:
# MLAS, MatMulQ, AttnRow, numpy X86_V3 loops, OpenBLAS Haswell) gave RAW too; qemu-user shows the
# host's /proc/cpuinfo, so that run printed the host's MLAS family, and the key an AVX2-only CPU
# prints (`x86_64-mlas-avx2-fma3`) is pinned from it.
_ORT = "onnxruntime-1.32.0:x86_64-mlas-avx512vnni-avx512f"
_NP = "numpy-2.4.6-{}baseline(X86_V2):openblas-0.3.31.188.0-{}:attn-x86_64-avx512f-c256"
CPU_Q_RAW = {f"{_ORT}:{_NP.format(loops, blas)}": RAW
             for loops in ("X86_V3.X86_V4.", "X86_V3.") for blas in ("SkylakeX", "Haswell")}
CPU_Q_RAW["onnxruntime-1.32.0:x86_64-mlas-avx2-fma3:numpy-2.4.6-X86_V3.baseline(X86_V2):openblas-0.3.31.188.0-Haswell:"
          "attn-x86_64-avx2-c256"] = RAW


@pytest.fixture(scope="module")
def default_dir(edge_home):
    return next(edge_home.glob("models/*/config.json")).parent


def greedy(model_dir: Path, backend: str = "cpu", threads: int = 2, prompts=PROMPTS, **env) -> dict:
    """The helper's {"blas", "ids"} in a fresh process: this environment's kernels (OPENBLAS_* as
    set), unless `env` forces a family."""
    e = dict(os.environ) | env
    r = subprocess.run([sys.executable, str(HELPER), str(model_dir), backend, str(threads), str(N),
                        json.dumps(prompts)], capture_output=True, text=True, env=e, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


X86_ONLY = pytest.mark.skipif(platform.machine() != "x86_64", reason="an x86 OpenBLAS kernel family")


@pytest.mark.parametrize("family", [None, pytest.param("Haswell", marks=X86_ONLY)], ids=lambda f: f or "default-kernels")
def test_cpu_greedy_ids_are_pinned(default_dir, family):
    got = greedy(default_dir, **({"OPENBLAS_CORETYPE": family} if family else {}))
    if family:  # the variable was honoured: this run really used the other kernels
        assert got["blas"] == family
    assert got["ids"] == {"chat": CHAT, "raw": RAW}


@pytest.fixture(scope="module")
def cpu_q_runs(default_dir, edge_home):
    """cpu-q's raw-prompt run on 1 and 2 threads in this environment's kernels, and on 2 threads
    with numpy's BLAS forced to its Haswell kernels and with numpy's X86_V4 loops disabled (x86)."""
    from edge_llm.backends.cpuq import backend as cpuq
    from edge_llm.checkpoints.gguf_blocks import gguf_blocks

    mp = pytest.MonkeyPatch()
    mp.setenv("EDGE_LLM_HOME", str(edge_home))  # the session's quantized graphs, not the user's
    cpuq.ensure_quantized(default_dir, cpuq.mode("q4"), blocks=gguf_blocks(default_dir))  # built once, here
    raw = {"raw": PROMPTS["raw"]}
    runs = {t: greedy(default_dir, "cpu-q", t, raw) for t in (1, 2)}
    if platform.machine() == "x86_64":
        runs["haswell-blas"] = greedy(default_dir, "cpu-q", 2, raw, OPENBLAS_CORETYPE="Haswell")
        runs["no-x86-v4-loops"] = greedy(default_dir, "cpu-q", 2, raw, NPY_DISABLE_CPU_FEATURES="X86_V4 AVX512_ICL AVX512_SPR")
    yield runs
    mp.undo()


def test_cpu_q_greedy_ids_are_the_same_on_1_and_2_threads(cpu_q_runs):
    assert cpu_q_runs[1]["ids"] == cpu_q_runs[2]["ids"]
    assert cpu_q_runs[1]["numerics"] == cpu_q_runs[2]["numerics"]  # threads are not part of the identity


@pytest.mark.parametrize("run", [2, pytest.param("haswell-blas", marks=X86_ONLY),
                                 pytest.param("no-x86-v4-loops", marks=X86_ONLY)])
def test_cpu_q_greedy_ids_are_pinned_for_the_kernel_key(cpu_q_runs, run):
    """Every run of the fixture against the pin of its own key: this environment's kernels and, on
    x86, the other two numpy set-ups it ran (so the Haswell pin is checked wherever the suite runs
    on x86, not only under OPENBLAS_CORETYPE=Haswell)."""
    got = cpu_q_runs[run]
    if got["key"] not in CPU_Q_RAW:
        pytest.skip(f"no cpu-q ids pinned for kernel key {got['key']!r} (these kernels gave {got['ids']['raw']}: "
                    "check the text, then add them to CPU_Q_RAW)")
    assert got["ids"]["raw"] == CPU_Q_RAW[got["key"]]


@X86_ONLY
def test_cpu_q_numerics_separate_kernels_whose_ids_differ(cpu_q_runs):
    """numpy's BLAS kernel family and its SIMD loops move cpu-q's greedy ids here: the snapshot
    identity must change with them (a snapshot never restores under other bits, docs/identity.md)."""
    base = cpu_q_runs[2]
    differ = [n for n in ("haswell-blas", "no-x86-v4-loops") if cpu_q_runs[n]["ids"] != base["ids"]]
    for name in differ:
        assert cpu_q_runs[name]["numerics"] != base["numerics"] and cpu_q_runs[name]["key"] != base["key"], name
    if not differ:  # q4 gives F32's ids under every kernel key measured (CPU_Q_RAW); an AVX2-only CPU switches nothing
        pytest.skip("neither numpy switch changed cpu-q's ids on this CPU: nothing to separate (q4's near-float "
                    "activations give the same ids under every kernel key pinned in CPU_Q_RAW)")
