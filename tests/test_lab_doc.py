"""docs/lab-a.md cannot rot: its x86 command blocks (```bash lab) run in order, as one bash
script, against the default model with the short 512-token prompt files."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from serverutil import free_port

from edge_llm.settings import DEFAULTS
from edge_llm.snapshot.layout import SNAPSHOT_NAME

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "lab-a.md"
BLOCK_RE = re.compile(r"^```bash lab\n(.*?)^```", re.S | re.M)


def lab_blocks() -> list[str]:
    return BLOCK_RE.findall(DOC.read_text())


def test_doc_has_the_walkthrough_steps():
    blocks = lab_blocks()
    assert len(blocks) >= 6
    text = "\n".join(blocks)
    for needle in ("edge-llm serve", "--disk-kv", "kill -9", "edge-llm kv inspect", "turn1.json", "turn2.json"):
        assert needle in text
    for name in re.findall(r"lab-\$CTX-(turn\d)\.json", text):
        for ctx in ("512", "2k", "8k"):
            body = json.loads((ROOT / "docs" / "prompts" / f"lab-{ctx}-{name}.json").read_text())
            assert body["temperature"] == 0 and "Bob lives in Tokyo" in body["prompt"]


def test_prompt_files_share_their_history():
    for ctx in ("512", "2k", "8k"):
        t1, t2 = (json.loads((ROOT / "docs" / "prompts" / f"lab-{ctx}-turn{i}.json").read_text())["prompt"]
                  for i in (1, 2))
        head = t1[: t1.rindex("Question:")]
        assert t2.startswith(head) and len(head) > 1000


@pytest.mark.parametrize("prefetch", [False, True], ids=["on-demand", "prefetch"])
def test_lab_walkthrough_runs(edge_home, tmp_path, prefetch):
    """The walkthrough as written; with EDGE_LLM_DISK_KV_PREFETCH=latest the evidence is what the
    lab's prefetch section says: S2's prefix comes from S1's file, named by the request's line."""
    lab = tmp_path / "lab"
    script = "set -euo pipefail\n" + "\n".join(lab_blocks())
    env = {**os.environ, "EDGE_LLM_HOME": str(edge_home), "LAB": str(lab), "PORT": str(free_port()),
           "CTX": "512", "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           **({"EDGE_LLM_DISK_KV_PREFETCH": "latest"} if prefetch else {})}
    try:
        r = subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=1500)
    finally:
        _kill_leftover(lab / "serve.pid")
    out = r.stdout
    assert r.returncode == 0, f"{out}\n{r.stderr[-3000:]}"
    assert "S1 prompt" in out and "cache none" in out
    saved = re.search(rf"\[KV-DISK\] saved (\d+)-token KV -> ({SNAPSHOT_NAME})", out)
    loaded = re.search(rf"\[KV-DISK\] loaded (\d+)-token KV prefix from disk file ({SNAPSHOT_NAME})", out)
    assert saved and loaded and saved[2] == loaded[2], out  # S2 read S1's file
    from edge_llm.snapshot.layout import snapshot_size

    size = int(re.search(rf"\[KV-DISK\] saved \d+-token KV -> {SNAPSHOT_NAME} \((\d+) bytes", out)[1])
    assert size == snapshot_size(30, int(saved[1]), 3 * 64, 64)  # a real run gives the formula's bytes
    assert "[KV-DISK] index: 1 checkpoint(s)" in out
    n, aligned = map(int, re.search(r"\[PREFILL-TIMING\] n=(\d+) total=[\d.]+ms aligned=(\d+)", out).groups())
    source = "disk-prefetch" if prefetch else "disk"
    m = re.search(rf"S2 prompt (\d+) tokens, cached (\d+) from {source} \| prefilled (\d+)", out)
    assert m, out
    if prefetch:  # the prefetch's read names S1's file at start; the request's own line counts its rows
        reused = re.search(rf"\[KV-DISK\] reused (\d+)-token KV prefix read from disk file ({SNAPSHOT_NAME}) at start",
                           out)
        assert reused and reused[2] == saved[2] and int(loaded[1]) >= int(reused[1]), out
        loaded = reused
    assert int(m[3]) == n == int(m[1]) - int(m[2]) and int(m[2]) == int(loaded[1])
    # only the follow-up tail, not the ~500-token history, and the rows recomputed for alignment
    assert n - aligned < 40 and aligned < DEFAULTS.prefill_chunk
    assert re.search(r"speed-up \d+\.\dx", out)
    assert "exit pid=" in out  # the last block stopped S2 cleanly


def _kill_leftover(pid_file: Path) -> None:
    """If the script failed midway, stop the server it started (by its recorded pid)."""
    try:
        pid = int(pid_file.read_text())
        os.kill(pid, signal.SIGKILL)
    except (OSError, ValueError):
        pass


def test_evidence_is_read_after_a_marker_and_names_its_file():
    """On a board the log holds earlier runs and the kv dir older files: every block (x86 and
    board) reads log lines only after a byte marker and never picks 'some' snapshot file."""
    blocks = re.findall(r"^```bash (?:lab|board)\n(.*?)^```", DOC.read_text(), re.S | re.M)
    for block in blocks:
        for line in block.splitlines():
            assert not re.search(r"grep[^|]*\"\$LOG\"", line), f"greps the whole log: {line}"
            assert "| head -n 1\" " not in line and not re.search(r"ls [^|]*\*\.kv\"? *\| *head", line), line


def test_lab_folder_is_ignored_by_git():
    """docs/lab-a.md runs in the checkout with LAB=$PWD/lab: its snapshots and logs never show up
    as changes to commit."""
    assert 'LAB="${LAB:-$PWD/lab}"' in (ROOT / "docs" / "lab-a.md").read_text()
    r = subprocess.run(["git", "check-ignore", "-q", "lab/kv/x/kv_0000000000000000.kv"], cwd=ROOT, timeout=60)
    assert r.returncode == 0, "lab/ is not ignored by .gitignore"


def test_the_docs_example_numbers_follow_the_size_formula():
    """Every example size in docs/lab-a.md is what the formula (and so the store) produces."""
    from edge_llm.snapshot.layout import snapshot_size

    text = (ROOT / "docs" / "lab-a.md").read_text()
    m = re.search(r"saved (\d+)-token KV -> kv_\S+ \((\d+) bytes, ([\d.]+) ms, ([\d.]+) MB/s\)", text)
    n, size, ms, mbs = int(m[1]), int(m[2]), float(m[3]), float(m[4])
    assert size == snapshot_size(30, n, 3 * 64, 64)  # the default model: 30 layers, 3 KV heads x 64
    assert abs(size / 1e6 / (ms / 1e3) - mbs) < 0.1
    m = re.search(r"a (\d+)-token snapshot is ([\d,]+) bytes", text)
    assert int(m[2].replace(",", "")) == snapshot_size(28, int(m[1]), 8 * 128, 64)  # Qwen3-VL-2B
