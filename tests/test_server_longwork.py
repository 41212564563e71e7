"""Long work on a real server: progress-driven watchdog pings and STATUS= lines (also inside one
long prefill chunk), a prefill that a client hang-up or SIGTERM cancels within a chunk, and a
restart that resumes the interrupted prefill from the rows of its complete chunks (docs/board.md,
"Long requests and the stop budget")."""

from __future__ import annotations

import json
import re
import signal
import socket
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from serverutil import ServerProc, wait_for

pytestmark = pytest.mark.slow

HELPERS = Path(__file__).parent / "helpers"
WATCHDOG_S = 3.0
LONG = 24000  # tokens: the tiny model needs a few seconds (quiet machine) to prefill this
CHUNK = 128


class NotifyListener:
    """A unix datagram socket standing in for systemd's NOTIFY_SOCKET; records (time, message).

    The socket queues datagrams in the order they were sent, so `got` keeps the server's order,
    and `mark()` puts a datagram of ours after everything sent before it: the tests
    judge what the server sent by its order against its own STATUS= lines and our marks, never by
    the times this thread happened to read them."""

    def __init__(self, path: Path):
        self.path = str(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.sock.settimeout(0.2)
        self.got: list[tuple[float, str]] = []
        self._marks = 0
        self._done = threading.Event()
        self._t = threading.Thread(target=self._listen, daemon=True)
        self._t.start()

    def mark(self) -> int:
        """Queue a marker datagram behind everything sent so far and wait until it is read: every
        datagram sent before this call is in `got` then, before the index returned (the marker's)."""
        self._marks += 1
        text = f"TEST_MARK={self._marks}"
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.sendto(text.encode(), self.path)

        def after_marker() -> int | None:  # the marker's index + 1 (never 0, so a found one is truthy)
            return next((i + 1 for i, (_, m) in enumerate(list(self.got)) if m == text), None)

        return wait_for(after_marker, timeout=60, what="the listener reading our marker") - 1

    def messages(self, start: int = 0, end: int | None = None) -> list[str]:
        """The datagrams got[start:end], in the order they were sent."""
        return [m for _, m in list(self.got)[start:end]]

    def _listen(self) -> None:
        while not self._done.is_set():
            try:
                self.got.append((time.monotonic(), self.sock.recv(4096).decode()))
            except socket.timeout:
                continue

    def times(self, message: str) -> list[float]:
        return [t for t, m in list(self.got) if message in m.splitlines()]

    def status(self, prefix: str) -> list[tuple[float, str]]:
        return [(t, line[7:]) for t, m in list(self.got) for line in m.splitlines()
                if line.startswith("STATUS=" + prefix)]

    def close(self) -> None:
        self._done.set()
        self._t.join()
        self.sock.close()


def long_prompt(n: int = LONG, seed: int = 0) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(1000, 100000, n)]


def server(tmp_path: Path, model: Path, listener: NotifyListener | None, *args: str, name: str = "s",
           watchdog_s: float = WATCHDOG_S, **kw) -> ServerProc:
    env = {"WATCHDOG_USEC": str(int(watchdog_s * 1e6))}
    if listener is not None:
        env["NOTIFY_SOCKET"] = listener.path
    env.update(kw.pop("env", {}))
    return ServerProc(tmp_path / "home", tmp_path / name, "--model", str(model), "--max-seq", str(LONG + 64),
                      "--prefill-chunk", str(CHUNK), *args, env=env, **kw)


def complete(srv: ServerProc, prompt: list[int], max_tokens: int = 6, timeout: float = 600) -> dict:
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens,
                                                      "temperature": 0}, timeout=timeout)
    assert r.status_code == 200, r.text
    return r.json()


def post_in_background(srv: ServerProc, prompt: list[int]) -> None:
    """A client whose request the server will abandon (stuck engine, SIGTERM): errors are expected."""
    def run() -> None:
        try:
            httpx.post(srv.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 6,
                                                          "temperature": 0}, timeout=600)
        except httpx.HTTPError:
            pass

    threading.Thread(target=run, daemon=True).start()


def prefill_rows(listener: NotifyListener) -> int:
    rows = [int(m.group(1)) for _, s in listener.status("prefill ") if (m := re.match(r"prefill (\d+)/", s))]
    return max(rows, default=0)


def cancel_requested_at(log: str, reason: str) -> int:
    """The prefill row the server had reported when the cancel arrived (worker.Job.cancel_with)."""
    m = re.search(rf"cancel requested \({re.escape(reason)}\) at prefill (\d+)/\d+", log)
    assert m, log[-3000:]
    return int(m.group(1))


def measured_prefill_s(model: Path, prompt: list[int], chunk: int = CHUNK) -> float:
    """This machine's time for the long prefill right now (same engine, in this process)."""
    from edge_llm.engine import GenerationRequest
    from edge_llm.runtime import load_runtime
    from edge_llm.settings import Settings

    eng = load_runtime(Settings(model=str(model), backend="cpu", disk_kv=None, max_seq=LONG + 64,
                                prefill_chunk=chunk))
    (last,) = [e for e in eng.generate(GenerationRequest(prompt, max_tokens=1)) if e.finish_reason]
    return last.timings.prefill_ms / 1e3


def pings(messages: list[str]) -> int:
    return sum("WATCHDOG=1" in m.splitlines() for m in messages)


def prefill_statuses(messages: list[str]) -> list[tuple[int, str]]:
    """(index in `messages`, "prefill i/N") of each STATUS=prefill line, in the order sent."""
    return [(i, line[7:]) for i, m in enumerate(messages) for line in m.splitlines()
            if line.startswith("STATUS=prefill ")]


STEPS_PER_PING = 16  # a ping at least every 16 prefill steps (far more than the design needs)


def test_watchdog_pings_follow_prefill_progress_and_stop_when_stuck(tiny_synth_dir, tmp_path):
    """The pings follow the work: in a long prefill there is a WATCHDOG=1 among the datagrams of
    every few STATUS=prefill steps; with pings only while idle (or at a request's start and end)
    there would be none between them. Judged by the order of the datagrams, not by their times."""
    prompt = long_prompt()
    n_steps = -(-(LONG - 1) // CHUNK) + 1  # the chunks of the prompt but its last token, then that token
    # The rate limit (an eighth of the interval) is half of this machine's average prefill step
    # now: at the same speed the server pings about every step, and a window of STEPS_PER_PING
    # steps from the second half of the prompt (each step at least an average one: attention grows
    # with the rows) would have no ping only if the server ran ~30x faster than this measurement.
    watchdog_s = 8 * measured_prefill_s(tiny_synth_dir, prompt) / n_steps / 2
    listener = NotifyListener(tmp_path / "n.sock")
    try:
        with server(tmp_path, tiny_synth_dir, listener, "--no-disk-kv", watchdog_s=watchdog_s) as srv:
            srv.start()
            body = complete(srv, prompt, max_tokens=2)
        got = listener.messages(0, listener.mark())  # all the server sent, in its order
        statuses = prefill_statuses(got)
        texts = [s for _, s in statuses]
        assert f"prefill {CHUNK}/{LONG - 1}" in texts and f"prefill {LONG}/{LONG}" in texts, texts
        assert len(statuses) == n_steps, texts
        # the second half of the prompt: runs of steps with no ping between two STATUS= lines
        late = [i for i, s in statuses if int(s.split()[1].split("/")[0]) >= LONG // 2]
        assert len(late) > 4 * STEPS_PER_PING
        run = longest = 0
        for a, b in zip(late, late[1:]):
            run = 0 if pings(got[a + 1:b]) else run + 1
            longest = max(longest, run)
        t = listener.times("WATCHDOG=1")
        print(f"prefill {body['timings']['prefill_ms'] / 1e3:.1f} s in {n_steps} steps, "
              f"{pings(got[statuses[0][0]:statuses[-1][0]])} pings during it, longest run of late steps "
              f"without one {longest}; watchdog {watchdog_s:.3f} s; (informative only: largest gap "
              f"between pings as read here {max(np.diff(t), default=0):.3f} s)")
        assert longest < STEPS_PER_PING, f"{longest} prefill steps in a row without a watchdog ping"
    finally:
        listener.close()

    # the same server with an engine that hangs after 1024 rows (test hook): pings stop
    listener = NotifyListener(tmp_path / "n2.sock")
    stuck = server(tmp_path, tiny_synth_dir, listener, "--no-disk-kv", "--grace-seconds", "0", name="stuck",
                   entry=[__import__("sys").executable, str(HELPERS / "stuck_serve.py")],
                   env={"STALL_AFTER_ROWS": "1024"})
    try:
        stuck.start()
        post_in_background(stuck, long_prompt())
        wait_for(lambda: "engine stalled" in stuck.stderr(), timeout=300, what="the stall")
        # the hook prints after the last progress (ping included) and then blocks: every ping sent
        # before the stall is queued before our first mark, so any ping after it came while stuck
        stalled = listener.mark()
        time.sleep(3 * WATCHDOG_S)  # the window: a ping not driven by progress would come 24 times
        after = pings(listener.messages(stalled + 1, listener.mark()))
        assert after == 0, f"{after} pings while the engine was stuck"
        assert stuck.health().json()["busy"]  # the HTTP side still answers; only progress stopped
    finally:
        stuck.kill()
        listener.close()


@pytest.fixture(scope="module")
def deep_synth(tmp_path_factory) -> Path:
    """The tiny random model with 8 decoder layers: one long chunk is several layers' work."""
    from edge_llm.checkpoints.synth import synth_checkpoint

    return synth_checkpoint(tmp_path_factory.mktemp("deep") / "tiny-8", preset="tiny", layers=8, seed=6)


def test_watchdog_is_fed_inside_one_long_prefill_chunk(deep_synth, tmp_path):
    """A prompt of two long prefill chunks: WATCHDOG=1 still arrives during the second chunk (each
    decoder layer is progress), between the STATUS= lines of the first chunk and of the second;
    with pings only between chunks there would be at most one there (the second chunk's own)."""
    chunk, layers = 2048, 8
    n = 2 * chunk + 1
    prompt = long_prompt(n, seed=6)
    # the watchdog's rate limit (an eighth of it) is an eighth of one layer's average time on this
    # machine now; a layer of the second chunk has more work than the average (more rows to attend
    # to), so each of its layers pings at the same speed, and at least two of them would still ping
    # if the server ran some 30x faster than this measurement
    watchdog_s = measured_prefill_s(deep_synth, prompt, chunk) / (2 * layers)
    listener = NotifyListener(tmp_path / "n.sock")
    try:
        with server(tmp_path, deep_synth, listener, "--no-disk-kv", "--prefill-chunk", str(chunk),
                    "--backend", "cpu", watchdog_s=watchdog_s) as srv:  # the backend measured above
            srv.start()
            complete(srv, prompt, max_tokens=2)
        got = listener.messages(0, listener.mark())  # all the server sent, in its order
        statuses = prefill_statuses(got)
        # two chunks of rows [0, n-1), then the last token alone: no status inside a chunk
        assert [s for _, s in statuses] == [f"prefill {chunk}/{n - 1}", f"prefill {n - 1}/{n - 1}",
                                            f"prefill {n}/{n}"], statuses
        (first, _), (second, _) = statuses[:2]
        during = pings(got[first + 1:second])
        print(f"{during} pings during the second {chunk}-row chunk ({layers} layers, watchdog {watchdog_s:.3f} s)")
        assert during >= 2
    finally:
        listener.close()


def test_client_hangup_during_prefill_frees_the_worker_within_a_chunk(tiny_synth_dir, tmp_path):
    listener = NotifyListener(tmp_path / "n.sock")
    try:
        with server(tmp_path, tiny_synth_dir, listener) as srv:
            srv.start()
            prompt = long_prompt()
            client = httpx.Client(timeout=600)
            req = client.build_request("POST", srv.url + "/v1/completions",
                                       json={"prompt": prompt, "max_tokens": 4, "temperature": 0, "stream": True})
            resp = client.send(req, stream=True)
            wait_for(lambda: prefill_rows(listener) >= 2048, timeout=300, what="prefill progress")
            seen = prefill_rows(listener)
            resp.close()
            client.close()
            # the worker is free again: a short request is answered
            wait_for(lambda: "cancelled during prefill" in srv.log(), timeout=120, what="the cancel")
            short = complete(srv, long_prompt(40, seed=1), max_tokens=3)
            assert short["usage"]["completion_tokens"] == 3
            log = srv.log()
            asked = cancel_requested_at(log, "client disconnected")
            m = re.search(r"cancelled during prefill at (\d+)/\d+: (\d+) prompt row", log)
            done = int(m.group(2))
            print(f"hang-up seen at {seen} rows, noticed at {asked}; the prefill stopped at {done} rows "
                  f"(chunk {CHUNK})")
            assert seen <= asked <= done <= asked + CHUNK  # at most the chunk in flight
            assert done % CHUNK == 0
            wait_for(lambda: f"saved {done}-token KV" in srv.log(), timeout=120, what="the partial save")
    finally:
        listener.close()


def test_sigterm_during_prefill_saves_completed_rows_and_a_restart_resumes(tiny_synth_dir, tmp_path):
    # LONG, as the other prefill tests: after the 1024 rows we wait for, the rest of the prefill is
    # nearly all of its work (attention grows with the rows), seconds even on a quiet fast machine,
    # so the signal lands during it however this process is scheduled (12000 tokens took 0.9 s here)
    prompt = long_prompt(LONG, seed=2)
    with server(tmp_path, tiny_synth_dir, None, "--no-disk-kv", name="reference") as ref:
        ref.start()
        want = complete(ref, prompt)
    kv = tmp_path / "kv"
    listener = NotifyListener(tmp_path / "n.sock")
    try:
        a = server(tmp_path, tiny_synth_dir, listener, "--grace-seconds", "0", name="a", kv_dir=kv)
        a.start()
        post_in_background(a, prompt)
        wait_for(lambda: prefill_rows(listener) >= 1024, timeout=300, what="prefill progress")
        at_sigterm = prefill_rows(listener)
        assert a.stop(signal.SIGTERM) == 0
        log = a.log()
        m = re.search(r"cancelled during prefill at \d+/\d+: (\d+) prompt row", log)
        assert m, log[-3000:]
        done = int(m.group(1))
        # the stop budget's middle term: with grace 0, at most the chunk in flight after the
        # cancel (how many chunks a fast machine computes between our status read and the
        # signal's handling is not the server's business)
        asked = cancel_requested_at(log, "shutdown grace period over")
        assert at_sigterm <= asked <= done <= asked + CHUNK, (at_sigterm, asked, done)
        assert done % CHUNK == 0 and done < len(prompt) - 1
        saved = log.index(f"[KV-DISK] saved {done}-token KV")
        assert saved < log.index("=== edge-llm exit", saved)  # on disk before the process ended
    finally:
        listener.close()
    with server(tmp_path, tiny_synth_dir, None, name="b", kv_dir=kv) as b:
        b.start()
        mark = b.log_size()
        got = complete(b, prompt)
        log = b.log(mark)
    assert f"[KV-DISK] loaded {done}-token KV prefix from disk" in log
    assert f"[PREFILL-TIMING] n={len(prompt) - done} " in log
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == done
    assert got["choices"][0]["text"] == want["choices"][0]["text"]


def test_long_prefill_is_logged_outside_systemd(tiny_synth_dir, tmp_path):
    """No NOTIFY_SOCKET (a terminal, a container): the log still shows the job, its prompt size and
    its progress every PROGRESS_LOG_EVERY seconds, so a long prefill is not minutes of silence."""
    from edge_llm.server.worker import PROGRESS_LOG_EVERY

    n = 36000  # ~13 s of prefill here: several progress lines
    with server(tmp_path, tiny_synth_dir, None, "--max-seq", str(n + 64), env={"WATCHDOG_USEC": ""}) as srv:
        srv.start()
        prompt = long_prompt(n, seed=4)
        t = complete(srv, prompt, max_tokens=2)["timings"]
        log = srv.log()
    m = re.search(rf"job (\d+) started \(completion\): prompt {n} token\(s\), max_tokens 2", log)
    assert m, log[-3000:]
    lines = re.findall(rf"job {m.group(1)}: prefill (\d+)/{n - 1}", log)
    if t["prefill_ms"] < PROGRESS_LOG_EVERY * 1e3 + 1000:
        pytest.skip(f"the prefill took {t['prefill_ms']:.0f} ms: too fast here for a progress line every "
                    f"{PROGRESS_LOG_EVERY} s")
    rows = [int(x) for x in lines]
    assert rows and rows == sorted(rows) and rows[-1] < n - 1, log[-3000:]
    assert len(rows) <= t["prefill_ms"] / 1e3 / PROGRESS_LOG_EVERY + 1  # a sane rate, not a line per chunk


def completion_in_thread(srv: ServerProc, body: dict, got: dict) -> threading.Thread:
    """POST `body` to /v1/completions in a started thread; the answer's status, content type and
    text land in `got` (or `got["error"]` when the connection breaks, e.g. a stream cut off)."""

    def run() -> None:
        try:
            with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=600) as r:
                got["status"], got["type"] = r.status_code, r.headers.get("content-type", "")
                got["body"] = r.read().decode()
        except httpx.HTTPError as e:
            got["error"] = repr(e)

    t = threading.Thread(target=run)
    t.start()
    return t


def assert_answered_cancelled(got: dict, stream: bool) -> None:
    """A whole answer with finish_reason "cancelled": a JSON body, or a stream's last chunk and [DONE]."""
    assert got.get("status") == 200 and "error" not in got, got
    if stream:
        events = [ln[6:] for ln in got["body"].splitlines() if ln.startswith("data: ")]
        assert events[-1] == "[DONE]", got["body"][-500:]
        assert json.loads(events[-2])["choices"][0]["finish_reason"] == "cancelled"
    else:
        assert got["type"].startswith("application/json"), got
        assert json.loads(got["body"])["choices"][0]["finish_reason"] == "cancelled", got["body"][:500]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_sigterm_past_the_grace_period_answers_cancelled(tiny_synth_dir, tmp_path, stream):
    """A request still running when the grace period ends gets a proper answer: a JSON body (or
    the stream's last chunk and [DONE]) with finish_reason "cancelled", never a bare 500 or a cut
    stream (its completed rows are saved as well)."""
    listener = NotifyListener(tmp_path / "n.sock")
    got: dict = {}
    try:
        srv = server(tmp_path, tiny_synth_dir, listener, "--grace-seconds", "1", name="g", kv_dir=tmp_path / "kv")
        srv.start()
        # LONG: still prefilling when the 1 s grace ends, also on a fast machine (12000 took 0.9 s here)
        t = completion_in_thread(srv, {"prompt": long_prompt(LONG, seed=5), "max_tokens": 4, "temperature": 0,
                                       "stream": stream}, got)
        wait_for(lambda: prefill_rows(listener) >= 1024, timeout=300, what="prefill progress")
        assert srv.stop(signal.SIGTERM) == 0
        t.join(60)
    finally:
        listener.close()
    assert_answered_cancelled(got, stream)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_second_ctrl_c_cuts_the_grace_short_and_still_answers(tiny_synth_dir, tmp_path, stream):
    """Ctrl-C twice during a request: the second one ends the (here 600 s) grace period at once. The
    request is still answered as after the grace period (finish_reason "cancelled", a JSON body or the
    stream's last chunk and [DONE]), not with a text/plain 500; the process exits 0 without a traceback."""
    listener = NotifyListener(tmp_path / "n.sock")
    got: dict = {}
    try:
        srv = server(tmp_path, tiny_synth_dir, listener, "--grace-seconds", "600", name="c", kv_dir=tmp_path / "kv")
        srv.start()
        # a decode of up to 20000 tokens: still running when the signals come, also on a fast machine
        t = completion_in_thread(srv, {"prompt": long_prompt(64, seed=9), "max_tokens": 20000, "temperature": 0,
                                       "stream": stream}, got)
        wait_for(lambda: listener.status("decode "), timeout=300, what="decoding")
        srv.send(signal.SIGINT)
        wait_for(lambda: "shutdown requested (SIGINT)" in srv.log(), timeout=60, what="the first SIGINT handled")
        t0 = time.monotonic()
        srv.send(signal.SIGINT)
        assert srv.proc.wait(120) == 0
        stopped_s = time.monotonic() - t0
        t.join(60)
    finally:
        listener.close()
    assert stopped_s < 60, stopped_s  # the grace period was 600 s
    assert_answered_cancelled(got, stream)
    log = srv.log()
    assert "second SIGINT: grace period cut short" in log and "reason=SIGINT code=0" in log, log[-3000:]
    assert "Traceback" not in log + srv.stderr(), (log + srv.stderr())[-3000:]
