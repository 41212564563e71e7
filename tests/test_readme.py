"""The README followed literally: its request examples (curl, the official openai client) against
a real server on a real socket, its first CLI example, and the make variables it documents."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from serverutil import ServerProc

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
DOCUMENTED_URL = "http://127.0.0.1:8080"


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, re.S)


def test_request_examples_answer(edge_home, tmp_path):
    (curl,) = [b for b in blocks("sh") if b.lstrip().startswith("curl")]
    (client,) = [b for b in blocks("python") if "OpenAI(" in b]
    assert DOCUMENTED_URL in curl and DOCUMENTED_URL in client
    with ServerProc(edge_home, tmp_path, "--model", "default", "--no-disk-kv").start() as srv:
        r = subprocess.run(["bash", "-c", curl.replace(DOCUMENTED_URL, srv.url)], capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, r.stderr
        assert "Paris" in json.loads(r.stdout)["choices"][0]["message"]["content"], r.stdout
        r = subprocess.run([sys.executable, "-c", client.replace(DOCUMENTED_URL, srv.url)], capture_output=True,
                           text=True, timeout=300)
        assert r.returncode == 0 and "Paris" in r.stdout, r.stdout + r.stderr


def test_first_cli_example_answers(edge_home):
    (line,) = [ln for b in blocks("sh") for ln in b.splitlines() if "generate --model default" in ln]
    cmd = line.split("#")[0].replace(".venv/bin/edge-llm", f"{sys.executable} -m edge_llm")
    r = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "EDGE_LLM_HOME": str(edge_home)})
    assert r.returncode == 0 and "Paris" in r.stdout, r.stdout + r.stderr


def test_every_make_variable_is_documented():
    names = re.findall(r"^([A-Z_]+) \?=", (REPO / "Makefile").read_text(), re.M)
    user_facing = [n for n in names if n not in ("PY", "VENV", "CONVERTER_VENV", "LLAMACPP_VENV")]
    assert {"HOST", "PORT", "BACKEND", "SERVE_ARGS", "BENCH_ARGS"} <= set(user_facing)
    for n in user_facing:
        assert f"`{n}`" in README, f"README does not document make variable {n}"
    dry = subprocess.run(["make", "-n", "serve", "BACKEND=cpu-q", "PORT=9000"], cwd=REPO, capture_output=True,
                         text=True, timeout=60)
    assert "--backend cpu-q" in dry.stdout and "--port 9000" in dry.stdout, dry.stdout
    assert ".[quant]" in dry.stdout or (REPO / ".venv" / ".quant-stamp").exists()


def test_one_convention_for_commands_in_the_docs():
    """README: literal .venv/bin/ commands; the other pages: installed-package commands, and the
    pages that start with commands say how to run them from a checkout."""
    assert "### Commands in the docs" in README and ". .venv/bin/activate" in README
    for b in blocks("sh"):
        for line in b.splitlines():
            word = line.split()[0] if line.split() else ""
            assert word not in ("edge-llm", "pip"), f"README runs a bare {word!r}: {line}"
    for page in ("npu.md", "quantization.md"):
        text = (REPO / "docs" / page).read_text()
        first = re.search(r"```sh\n(.*?)```", text, re.S).group(1)
        assert first.startswith("# in a checkout: . .venv/bin/activate"), page
