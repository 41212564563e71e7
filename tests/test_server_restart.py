"""Restart recovery through the real process and real signals, on the default model.

SIGTERM flushes the pending snapshot; the next process restores the history from disk and only
the new tail is prefilled. A SIGKILL in the middle of a save leaves debris that the next start
removes; no partial snapshot is ever loaded. The save that is killed is held in flight by
tests/helpers/slow_disk_serve.py (a save gate on the real writer), so the kill lands in it
whatever the machine's speed.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
from pathlib import Path

import httpx
import pytest
from serverutil import ServerProc, wait_for

from edge_llm.kvcache import lcp
from edge_llm.settings import DEFAULTS
from edge_llm.snapshot.format import (
    SNAPSHOT_GLOB,
    SNAPSHOT_NAME,
    read_header,
    verify_file,
)

SYSTEM = {"role": "system", "content": "You are a careful assistant. Answer briefly."}
STORY = " ".join(f"Note {i}: the lighthouse keeper counted {i * 7} ships passing the northern cape."
                 for i in range(1, 27))
ARGS = ("--model", "default", "--max-seq", "2048")
HELPERS = Path(__file__).parent / "helpers"
TMP_SNAPSHOT = re.compile(rf"^{SNAPSHOT_NAME}\..*\.tmp$")  # a snapshot's temp file (not io-stats.json's)


def chat(srv: ServerProc, messages: list[dict], max_tokens: int = 8) -> dict:
    r = httpx.post(srv.url + "/v1/chat/completions", timeout=900,
                   json={"messages": messages, "max_tokens": max_tokens, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def namespace(kv: Path) -> Path:
    (ident,) = kv.glob("*/identity.json")
    return ident.parent


def snapshots(ns: Path) -> dict[str, list[int]]:
    out = {}
    for p in sorted(ns.glob(SNAPSHOT_GLOB)):
        with open(p, "rb") as f:
            out[p.name] = [int(t) for t in read_header(f, None, None, None)[1]]
    return out


@pytest.fixture()
def tokenizer(edge_home, monkeypatch):
    from edge_llm.checkpoints.default import resolve_model_dir
    from edge_llm.tokenizer import Tokenizer

    monkeypatch.setenv("EDGE_LLM_HOME", str(edge_home))
    return Tokenizer.from_dir(resolve_model_dir("default"))


def expected_prefill(tok, messages: list[dict], stored: dict[str, list[int]]) -> tuple[int, int]:
    """(prompt tokens, tokens left to prefill after the best restore) computed independently: the
    match, cut back to a multiple of the prefill chunk (the engine's alignment rule)."""
    ids = tok.apply_chat_template_ids(messages, add_generation_prompt=True)
    m = min(max(lcp(s, ids) for s in stored.values()), len(ids) - 1)
    m = m // DEFAULTS.prefill_chunk * DEFAULTS.prefill_chunk
    return len(ids), len(ids) - m


# four server processes (model loads) and a flush under SIGTERM: the mark bounds a hang on a busy machine
@pytest.mark.timeout(1800)
def test_sigterm_restore_then_sigkill_mid_save(edge_home, tmp_path, tokenizer):
    kv, log_file = tmp_path / "kv", tmp_path / "edge-llm.log"
    save_gate = tmp_path / "save-gate"  # while it exists, saves are written (slow_disk_serve.py)

    def server(gated: bool = False) -> ServerProc:
        hook = dict(env={"SAVE_GATE": str(save_gate)}, entry=[sys.executable, str(HELPERS / "slow_disk_serve.py")])
        return ServerProc(edge_home, tmp_path, *ARGS, kv_dir=kv, log_file=log_file, **(hook if gated else {})).start()

    # ---- 1. cold request, SIGTERM right after it: the pending save is flushed --------------
    srv = server()
    history = [SYSTEM, {"role": "user", "content": STORY + " How many ships did note 3 count?"}]
    r1 = chat(srv, history)
    assert r1["timings"]["cache_source"] == "none" and r1["usage"]["prompt_tokens"] >= 500
    assert srv.stop(signal.SIGTERM, timeout=600) == 0  # the flush waits behind the disk's other writers
    text = log_file.read_text()
    assert re.search(rf"\[KV-DISK\] saved \d+-token KV -> {SNAPSHOT_NAME}", text)
    assert "reason=SIGTERM code=0" in text
    ns = namespace(kv)
    stored = snapshots(ns)
    assert len(stored) == 1 and not list(ns.glob("*.tmp"))
    for name in stored:
        verify_file(ns / name)

    # ---- 2. new process, history + follow-up: restored from disk, only the tail prefilled ----
    mark = log_file.stat().st_size
    save_gate.touch()  # r2's save is written as usual
    srv = server(gated=True)
    history2 = history + [{"role": "assistant", "content": r1["choices"][0]["message"]["content"]},
                          {"role": "user", "content": "And how many did note 4 count?"}]
    n_prompt, tail = expected_prefill(tokenizer, history2, stored)
    r2 = chat(srv, history2)
    t2 = r2["timings"]
    assert t2["cache_source"] == "disk" and r2["usage"]["prompt_tokens"] == n_prompt
    assert t2["prefill_tokens"] == tail and t2["disk_cached_tokens"] == n_prompt - tail
    # the whole first prompt came from disk, but for the rows recomputed for alignment
    assert t2["disk_cached_tokens"] + t2["align_rows"] >= r1["usage"]["prompt_tokens"]
    assert 0 <= t2["align_rows"] < DEFAULTS.prefill_chunk
    assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] == n_prompt - tail
    assert t2["restore_bytes"] > 0
    after = srv.log(mark)
    assert "[KV-DISK] loaded" in after and f"[PREFILL-TIMING] n={tail} " in after
    wait_for(lambda: len(re.findall(r"\[KV-DISK\] saved", srv.log(mark))) >= 1, 600, what="r2's save")

    # ---- 3. SIGKILL while the next snapshot is being written ----------------------------------
    history3 = history2 + [{"role": "assistant", "content": r2["choices"][0]["message"]["content"]},
                           {"role": "user", "content": "Thanks. Which note mentions 70 ships?"}]
    seen_tmp: list[str] = []
    stop = threading.Event()
    # the next save writes its first layer and then waits for the gate, which stays shut: its temp
    # file is on disk until the kill (no window to catch in time)
    save_gate.unlink()

    def kill_on_tmp() -> None:
        while not stop.is_set():
            tmps = [e.name for e in os.scandir(ns) if TMP_SNAPSHOT.match(e.name)]
            if tmps:
                srv.proc.send_signal(signal.SIGKILL)
                seen_tmp.extend(tmps)
                return
            stop.wait(0.01)

    killer = threading.Thread(target=kill_on_tmp, daemon=True)
    killer.start()
    try:
        httpx.post(srv.url + "/v1/chat/completions", timeout=900,
                   json={"messages": history3, "max_tokens": 8, "temperature": 0})
    except httpx.HTTPError:
        pass  # killed before the response was sent: fine, the save was already under way
    killer.join(600)  # bounds a hang only: the held save's temp file is there until the kill
    stop.set()
    assert srv.proc.wait(60) == -signal.SIGKILL and seen_tmp, "the save was not caught in flight"
    complete_before = snapshots(ns)

    # ---- 4. restart: debris removed, nothing partial indexed or loaded --------------------------
    mark3 = log_file.stat().st_size
    srv = server()
    try:
        boot = srv.log(mark3)
        m = re.search(r"\[KV-DISK\] index: (\d+) checkpoint\(s\)", boot)
        assert m and int(m.group(1)) == len(complete_before)
        assert not [e.name for e in os.scandir(ns) if e.name.endswith(".tmp")]
        assert "rejected" not in boot
        for name in snapshots(ns):
            verify_file(ns / name)  # every file the index holds passes every CRC
        assert srv.health().json()["snapshots"]["count"] == len(complete_before)
        n3, tail3 = expected_prefill(tokenizer, history3, snapshots(ns))
        r3 = chat(srv, history3)
        assert r3["timings"]["cache_source"] == "disk" and r3["timings"]["prefill_tokens"] == tail3
        assert r3["usage"]["prompt_tokens"] == n3
    finally:
        assert srv.stop(signal.SIGTERM, timeout=600) == 0
    # the log kept every run: three banners, two clean exits, one run that ended without one
    text = log_file.read_text()
    assert len(re.findall(r"=== edge-llm \S+ start pid=", text)) == 3
    assert len(re.findall(r"=== edge-llm exit pid=\d+ reason=SIGTERM code=0", text)) == 2
