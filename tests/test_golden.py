"""Golden greedy tokens of the default model (SmolLM2-135M-Instruct, as llama2.c pins its test
model's): the exact ids of 24 argmax steps after two fixed prompts, one through the chat template
and one raw, on the CPU backend under both of numpy's x86 OpenBLAS kernel families (the default
pick and Haswell, whose logits differ in the last bits: greedy tokens must not), and on cpu-q with
1 and 2 threads (its kernels give the same bits on any thread count, docs/quantization.md).

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
# cpu-q (4-bit weights, int8 activations) leaves the F32 answer after 8 tokens:
# " the primary colors of the RGB color model, which are:\n\n* Red (R"
# (measured with AVX2 alone, qemu-x86_64 -cpu Haswell: cpu-q gives RAW, the F32 ids, instead; under
# qemu-user kernel_isa() reads the host's /proc/cpuinfo, so it cannot tell such a run apart)
CPU_Q_ISA = "x86_64-avx2-avx512f-avx512_vnni"  # cpuq.kernel_isa() where CPU_Q_RAW was taken
CPU_Q_RAW = [260, 3003, 4683, 282, 260, 35526, 2380, 1743, 28, 527, 359, 42, 198, 198, 26, 3950, 365, 66, 727, 378,
             3003, 2380, 338, 314]


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


def test_cpu_q_greedy_ids_are_pinned_on_any_thread_count(default_dir, edge_home, monkeypatch):
    """The same ids on 1 and 2 threads everywhere; the pinned ids where onnxruntime picks the
    kernels they were taken with (its int8 kernels differ per ISA in the last bits, docs/store.md:
    an AVX2-only CPU or the board's NEON may leave the pinned path at a close call)."""
    from edge_llm.backends import cpuq
    from edge_llm.checkpoints.gguf_blocks import gguf_blocks

    monkeypatch.setenv("EDGE_LLM_HOME", str(edge_home))  # the session's quantized graphs, not the user's
    cpuq.ensure_quantized(default_dir, cpuq.mode("q4"), blocks=gguf_blocks(default_dir))  # built once, here
    got = {t: greedy(default_dir, "cpu-q", t, {"raw": PROMPTS["raw"]})["ids"]["raw"] for t in (1, 2)}
    assert got[1] == got[2]
    if cpuq.kernel_isa() == CPU_Q_ISA:
        assert got[1] == CPU_Q_RAW
