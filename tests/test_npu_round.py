"""The NPU engine's round in C (edge_llm/backends/npu/matmul/_rounds.c; docs/npu.md, "A round in C") under
ThreadSanitizer: tests/c/npurun_check.c drives it with a stand-in for rknn_matmul_run (a C
function that writes a known pattern; no NPU and no librknnrt are needed to check the threads)
through thousands of rounds, with the helpers waiting both ways: spinning (rounds back to back)
and asleep on their condition variable (a pause longer than the spin). Every round's output (the
copies, and the sum of the part that cuts K), the zero padding and every injected failure are
checked; a data race, a lost wake-up (a hang: the timeout) or a wrong sum fails. The bits through
the real engine over the fake library are tests/test_rknn_matmul.py's and tests/test_mm8.py's."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def checker(tmp_path_factory) -> Path:
    cc = shutil.which("cc") or shutil.which("gcc")
    assert cc, "no C compiler (the operator library needs one too)"
    exe = tmp_path_factory.mktemp("npurun") / "npurun_check"
    build = subprocess.run([cc, "-O1", "-g", "-fsanitize=thread", "-pthread", "-Wall", "-Werror", "-o", str(exe),
                            str(REPO / "tests/c/npurun_check.c"), str(REPO / "edge_llm/backends/npu/matmul/_rounds.c")],
                           capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr
    return exe


# the limits bound a hang (a lost wake-up) only: thousands of rounds of three threads under
# ThreadSanitizer on a busy two-core machine are slow; the mark covers the checker's build (the
# first case sets up the fixture) and the run
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("rounds,spin_ns,pause_ns", [(3000, 200_000, 0), (2000, 0, 0), (200, 20_000, 100_000)],
                         ids=["spinning", "sleeping", "spin-then-sleep"])
def test_rounds_are_race_free_and_exact(checker, rounds, spin_ns, pause_ns):
    r = subprocess.run([str(checker), str(rounds), str(spin_ns), str(pause_ns)], capture_output=True, text=True,
                       timeout=600, env={**os.environ, "TSAN_OPTIONS": "halt_on_error=1 exitcode=66"})
    assert r.returncode == 0 and "ThreadSanitizer" not in r.stderr, r.stdout + r.stderr[-3000:]
    ok, n, failures = r.stdout.split()
    assert ok == "ok" and int(n) == rounds and int(failures) == sum(t % 97 == 5 for t in range(rounds))
