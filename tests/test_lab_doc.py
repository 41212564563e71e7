"""docs/lab-a.md cannot rot: its x86 command blocks (```bash lab) run in order, as one bash
script, against the default model: at 512 tokens, then after the doc's repeat line (```bash repeat)
at 2k in the same shell with the prefetch setting on, as a student pastes them into one terminal."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
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


def repeat_block() -> str:
    """The doc's "repeat with a longer context" line: the new context and a fresh $LAB."""
    (block,) = re.findall(r"^```bash repeat\n(.*?)^```", DOC.read_text(), re.S | re.M)
    return block


def lab_root(tmp_path: Path) -> Path:
    """A directory that looks like the repository root to the lab's blocks (docs/ and .venv/), so
    the doc's own default folders ($PWD/lab, $PWD/lab-2k) land in tmp_path."""
    root = tmp_path / "repo"
    root.mkdir()
    for name in ("docs", ".venv"):
        if (ROOT / name).exists():
            (root / name).symlink_to(ROOT / name)
    return root


def run_lab(script: str, root: Path, env: dict[str, str], timeout: float) -> tuple[int, str, str]:
    """The blocks as one bash script, as a student pastes them into one terminal; the exit code,
    stdout and stderr. A wait that never ends is a failure at `timeout`; a server a failed script
    left running is stopped by its recorded pid."""
    env = {k: v for k, v in env.items() if k not in ("LAB", "CTX", "LOG", "KV", "WAIT_S", "MARK")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    with open(root / "stdout", "w+") as out, open(root / "stderr", "w+") as err:
        # files, not pipes: a server the script left running would hold a pipe open
        proc = subprocess.Popen(["bash", "-c", "set -euo pipefail\n" + script], cwd=root, env=env,
                                stdout=out, stderr=err, stdin=subprocess.DEVNULL)
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            code = None
        finally:
            if proc.returncode != 0:
                for pid_file in root.glob("lab*/serve.pid"):
                    _kill_leftover(pid_file)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if code is None:
        pytest.fail(f"the lab's blocks did not finish within {timeout:.0f} s (a wait that never ends)\n"
                    f"{stdout[-3000:]}\n{stderr[-3000:]}")
    return code, stdout, stderr


def check_walkthrough(out: str, prefetch: bool) -> re.Match:
    """One pass of steps 0-6: S2's prefix came from the file S1 wrote, only the tail was
    prefilled, and the server stopped cleanly. Returns the `saved` line's match."""
    from edge_llm.snapshot.layout import snapshot_size

    assert "S1 prompt" in out and "cache none" in out, out
    saved = re.search(rf"\[KV-DISK\] saved (\d+)-token KV -> ({SNAPSHOT_NAME}) \((\d+) bytes", out)
    loaded = re.search(rf"\[KV-DISK\] loaded (\d+)-token KV prefix from disk file ({SNAPSHOT_NAME})", out)
    assert saved and loaded and saved[2] == loaded[2], out  # S2 read S1's file
    assert int(saved[3]) == snapshot_size(30, int(saved[1]), 3 * 64, 64)  # a real run gives the formula's bytes
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
    # only the follow-up tail, not the history, and the rows recomputed for alignment
    assert n - aligned < 40 and aligned < DEFAULTS.prefill_chunk
    assert re.search(r"speed-up \d+\.\dx", out)
    assert "exit pid=" in out  # step 6 stopped S2 cleanly
    return saved


# two full passes of the lab (four server starts, a kill, restores) on a busy machine: the script's
# bound and the test's only catch a wait that never ends
@pytest.mark.timeout(1800)
def test_lab_runs_twice_in_one_shell(edge_home, tmp_path):
    """As a student does it: steps 0-6 at 512 tokens, then the doc's repeat line (2k, a fresh
    $LAB), the prefetch section's setting (EDGE_LLM_DISK_KV_PREFETCH=latest before step 0) and
    steps 0-6 again, all in one bash process. Each pass reads its own folder's log and kv dir
    (once the repeat waited forever for a save line in the first folder's log); the second pass's
    evidence is what the prefetch section says: S2's prefix comes from S1's file, named by the
    request's line."""
    root = lab_root(tmp_path)
    blocks = "\n".join(lab_blocks())
    env = {**os.environ, "EDGE_LLM_HOME": str(edge_home), "PORT": str(free_port())}
    env.pop("EDGE_LLM_DISK_KV_PREFETCH", None)
    script = f"{blocks}\n{repeat_block()}\nexport EDGE_LLM_DISK_KV_PREFETCH=latest\n{blocks}"
    code, out, err = run_lab(script, root, env, timeout=1500)
    assert code == 0, f"{out}\n{err[-3000:]}"
    first, second = out.split("S1 ready (pid ")[1:]
    saved = check_walkthrough(first, prefetch=False)
    saved2 = check_walkthrough(second, prefetch=True)
    assert int(re.search(r"S1 prompt (\d+) tokens", first)[1]) < 600 < 1900 < int(
        re.search(r"S1 prompt (\d+) tokens", second)[1])
    assert (root / "lab-2k" / "kv").is_dir() and saved2[2] in (root / "lab-2k" / "edge-llm.log").read_text()
    assert saved2[2] not in (root / "lab" / "edge-llm.log").read_text()  # the first folder saw nothing of it
    # the doc's example line is what its own prompt gives at 512 (greedy, on the cpu backend it pins)
    example = re.search(r"saved (\d+)-token KV -> kv_\S+ \((\d+) bytes", DOC.read_text())
    assert (example[1], example[2]) == (saved[1], saved[3]), (example.group(0), saved.group(0))


def test_lab_says_when_its_server_died(edge_home, tmp_path):
    """The port is taken (a socket of this test listens on it): S1 cannot bind it and exits.
    Step 0's wait ends at once with "the server died" and the reason from serve.stderr, instead
    of waiting for a server that is gone (or believing the port's other owner)."""
    root = lab_root(tmp_path)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        env = {**os.environ, "EDGE_LLM_HOME": str(edge_home), "PORT": str(busy.getsockname()[1])}
        code, out, err = run_lab("\n".join(lab_blocks()), root, env, timeout=120)
    assert code != 0 and "S1 ready" not in out, out
    assert f"the server died, see {root}/lab/serve.stderr" in err and "address already in use" in err, err


def _kill_leftover(pid_file: Path) -> None:
    """If the script failed midway, stop the server it started (by its recorded pid, if that pid
    still runs `edge-llm serve`)."""
    try:
        pid = int(pid_file.read_text())
        if b"serve" in Path(f"/proc/{pid}/cmdline").read_bytes():
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
    for folder in ("lab", "lab-2k", "lab-8k"):  # the first run's, and the repeats' (CTX=2k; LAB="$PWD/lab-$CTX")
        r = subprocess.run(["git", "check-ignore", "-q", f"{folder}/edge-llm.log"], cwd=ROOT, timeout=60)
        assert r.returncode == 0, f"{folder}/ is not ignored by .gitignore"
    assert 'LAB="$PWD/lab-$CTX"' in repeat_block()


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
