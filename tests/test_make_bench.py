"""`make bench` says what it does while it does it (README, "make bench"), and its installs leave
what `make serve` runs as it was. The Makefile is read by make itself (`make -n`: the commands,
none run); the llama.cpp setup script runs for real with a stand-in for its venv's python."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
needs_make = pytest.mark.skipif(shutil.which("make") is None, reason="make not installed")


def dry_run(*targets: str) -> str:
    """The commands of `targets` as a first run has them: -B takes every stamp as out of date (in a
    checkout whose .venv is installed, `make -n` alone would list no pip install at all)."""
    r = subprocess.run(["make", "-n", "-B", *targets], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout


@needs_make
def test_make_bench_announces_its_steps_and_shows_pip():
    out = dry_run("bench")
    steps = [out.index(f"make bench, step {i} of 3") for i in (1, 2, 3)]
    assert steps == sorted(steps), out
    assert out.index("setup-bench-llamacpp.sh") > steps[1] and out.index("edge-llm bench all") > steps[2]
    pips = [line for line in out.splitlines() if "pip install" in line]
    assert len(pips) >= 3, out  # the runtime, its data packages, the extras
    for line in pips:  # no silent pip: every install shows its progress
        assert " -q " not in line, line


@needs_make
def test_make_serve_names_its_backend_whatever_is_installed():
    """`auto` would pick cpu-q once `make bench` or `make test` installed the quant extra;
    `make serve` passes --backend, cpu unless BACKEND says otherwise."""
    serve = [ln for ln in dry_run("serve").splitlines() if "edge-llm serve" in ln]
    assert serve and all("--backend cpu " in ln for ln in serve), serve


def test_llamacpp_setup_prints_progress_while_it_builds(tmp_path):
    """The compile is silent through pip: the script prints a line every PROGRESS_EVERY seconds
    while pip runs (here a stand-in python that takes 8 s), then the build time, then stops its
    ticker (nothing printed after the script ends)."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    fake = venv / "bin" / "python"
    # 8 s of "build" for a 1 s ticker: two lines are asked for, eight are due; on a busy machine
    # the ticker's sleeps and forks drift (and it may start late), so the margin is wide
    fake.write_text('#!/bin/sh\necho "stand-in python $*"\ncase "$*" in *"pip install"*) sleep 8;; esac\n')
    fake.chmod(0o755)
    r = subprocess.run([str(ROOT / "tools" / "setup-bench-llamacpp.sh"), str(venv)], capture_output=True, text=True,
                       timeout=180, env={**os.environ, "PROGRESS_EVERY": "1"})  # bounds a hang
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "stand-in python -m pip install --no-cache-dir llama-cpp-python==" in out, out
    assert out.count("still building llama.cpp") >= 2 and "llama.cpp built in" in out, out
    assert out.index("still building") < out.index("llama.cpp built in")
    assert (venv / ".llamacpp-stamp").is_file()
    again = subprocess.run([str(ROOT / "tools" / "setup-bench-llamacpp.sh"), str(venv)], capture_output=True,
                           text=True, timeout=180)
    assert "is up to date" in again.stdout and "still building" not in again.stdout
