"""Crash safety: a real writer process killed with SIGKILL at random moments (docs/store.md, Faults).

The writer saves deltas (chains of up to MAX_CHAIN files) and compacts chains. After every kill
a fresh store must find only complete files whose chains restore bitwise what the writer meant to
save, must remove the temp debris of the interrupted write, and must still restore the last
snapshot the writer reported published.
"""

from __future__ import annotations

import importlib.util
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from edge_llm.kvcache import KVCache
from edge_llm.snapshot import format as fmt
from edge_llm.snapshot.store import Hit, SnapshotStore

HELPER = Path(__file__).parent / "helpers" / "kv_crash_writer.py"
_spec = importlib.util.spec_from_file_location("kv_crash_writer", HELPER)
W = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(W)

TRIALS = 30


def check_namespace(kv_dir: Path, last_saved: tuple[int, int] | None, seed: int) -> tuple[int, int, int]:
    """Scan as a restarted service would; verify every accepted file and its chain, and that the
    last published save still restores. Returns (files, deltas, rows checked)."""
    store = SnapshotStore(kv_dir, W.IDENTITY, W.GEOMETRY, min_lcp=16, max_files=3, kv_bs=W.KV_BS,
                          max_chain=W.MAX_CHAIN, compact_idle=None)
    try:
        store.scan()
        assert store.stats()["rejections"] == 0, "a killed writer left a bad file under a final name"
        assert not list(store.ns.glob("*.tmp")), "scan must remove temp debris"
        cache = KVCache(W.GEOMETRY, max_seq=W.MAX_SEQ, kv_bs=W.KV_BS, check_memory=False)
        rows = 0
        for e in store.entries():
            fmt.verify_file(e.path, W.GEOMETRY, W.IDENTITY.model_id)
            f_seed, f_branch = W.origin(int(e.tokens[0]))  # the files of earlier trials stay too
            n = e.n_tokens
            assert e.tokens.tolist() == W.tokens_for(f_seed, f_branch, n)
            cache.data[:] = np.nan
            res = store.restore(Hit(e, n), cache)
            assert res.n_tokens == n and cache.tokens == e.tokens.tolist()
            want = W.rows_for(f_seed, f_branch, n).view(np.uint32)
            assert np.array_equal(cache.data[:, :, :n].view(np.uint32), want)
            rows += n
        if last_saved is not None:  # published before the kill: it (or a longer extension) must restore
            branch, n = last_saved
            hit = store.lookup(W.tokens_for(seed, branch, n) + [0])
            assert hit is not None and hit.m == n, f"published snapshot {last_saved} lost"
        deltas = sum(e.base is not None for e in store.entries())
        assert store.stats()["chains"] <= 3  # max_files caps conversations (chains), deltas included
        return len(store.entries()), deltas, rows
    finally:
        store.close()


def stop(proc: subprocess.Popen) -> None:
    """SIGSTOP the writer and wait until it is stopped: its files stay as they are until the kill."""
    proc.send_signal(signal.SIGSTOP)
    deadline = time.monotonic() + 60  # bounds a hang only
    while time.monotonic() < deadline:
        stat = Path(f"/proc/{proc.pid}/stat").read_text()
        if stat[stat.rindex(")") + 2] in "Tt":
            return
        time.sleep(0.001)
    raise TimeoutError("the writer did not stop")


def write_in_progress(ns: Path) -> bool:
    """A snapshot temp file (a save or a compaction being written) is in the namespace."""
    return bool(list(ns.glob(fmt.SNAPSHOT_GLOB + ".*.tmp")))


def delta_on_disk(ns: Path) -> bool:
    """A published delta file is in the namespace (call with the writer stopped: no file changes)."""
    for path in ns.glob(fmt.SNAPSHOT_GLOB):
        with open(path, "rb") as f:
            hdr, _ = fmt.read_header(f, W.GEOMETRY, W.IDENTITY.model_id)
        if hdr.base is not None:
            return True
    return False


def stop_when(proc: subprocess.Popen, ns: Path, moment) -> None:
    """Stop the writer at a moment `moment(ns)` holds: look while it runs (cheap), then stop it and
    look again (the files cannot change while it is stopped); go on if the moment passed."""
    deadline = time.monotonic() + 300  # bounds a hang only: the writer loops through such moments
    while time.monotonic() < deadline:
        if moment is not delta_on_disk and not moment(ns):  # a delta is only read while stopped
            time.sleep(0.0005)
            continue
        stop(proc)
        if moment(ns):
            return
        proc.send_signal(signal.SIGCONT)
        time.sleep(0.01)
    raise TimeoutError(f"the writer never reached {moment.__name__}")


# each trial starts a process (cold on a busy machine) and verifies every file: a hang bound only
@pytest.mark.timeout(1800)
def test_sigkill_at_random_moments_never_leaves_a_bad_snapshot(tmp_path):
    """Kills are placed by the writer's work, not by a clock (a busy machine's slow disk may not
    publish a save within any fixed time): each trial kills after a random number of published
    saves; two trials in three first stop the writer at a moment the test wants covered, a write
    in progress (temp debris) or a delta on disk, so the coverage asserts at the end hold whatever
    the speed. The kill is a SIGKILL either way (a stopped process gets no chance to clean up)."""
    rng = random.Random(20240901)
    kv_dir = tmp_path / "kv"
    ns = kv_dir / W.IDENTITY.namespace
    debris, files_seen, rows_checked, deltas_seen = 0, 0, 0, 0
    for trial in range(TRIALS):
        moment = (None, write_in_progress, delta_on_disk)[trial % 3]
        k = rng.randint(1, 12)  # published saves before the kill (the first one is "ready"'s)
        proc = subprocess.Popen([sys.executable, str(HELPER), str(kv_dir), str(trial + 1)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            line = proc.stdout.readline()
            assert line.strip() == "ready", f"writer did not start: {proc.stderr.read()}"
            lines = [proc.stdout.readline() for _ in range(k)]
            assert all(ln.startswith("saved ") for ln in lines), (lines, proc.stderr.read())
            if moment is None:
                time.sleep(rng.uniform(0.0, 0.05))  # somewhere in the next save or compaction
            else:
                stop_when(proc, ns, moment)
            proc.send_signal(signal.SIGKILL)
            proc.wait(60)
            lines += proc.stdout.read().splitlines()
            saved = [tuple(map(int, ln.split()[1:])) for ln in lines if ln.startswith("saved ")]
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert proc.returncode == -signal.SIGKILL
        left = write_in_progress(ns)
        assert left or moment is not write_in_progress  # stopped with a temp file: it stays
        debris += left
        n_files, n_deltas, rows = check_namespace(kv_dir, saved[-1] if saved else None, trial + 1)
        assert n_files >= 1
        files_seen += n_files
        deltas_seen += n_deltas
        rows_checked += rows
    # the kills must actually have hit writes in progress, or the test proved nothing
    assert debris > 0, "no kill landed during a write"
    assert deltas_seen > 0, "no delta file was ever on disk at a kill"
    print(f"{TRIALS} kills: {debris} left temp debris, {files_seen} files ({deltas_seen} deltas) and "
          f"{rows_checked} token rows verified")
