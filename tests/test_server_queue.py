"""The bounded FIFO queue (503 + Retry-After beyond it) and cancellation on client disconnect."""

from __future__ import annotations

import json
import re
import signal
import threading

import httpx
import pytest
from serverutil import ServerProc, wait_for

QUEUE = 2
CLIENTS = 6
LONG = 1500  # far more tokens than a test could wait for: only a cancel ends these early
# a test's running request must reach its natural end after SIGTERM however slow the machine: the
# grace period is only a hang bound here (test_grace_period_over_cancels_running_request has its own)
GRACE_S = 600


@pytest.fixture(scope="module")
def server(edge_home, tmp_path_factory):
    srv = ServerProc(edge_home, tmp_path_factory.mktemp("srv-queue"), "--model", "default",
                     "--max-seq", "2048", "--queue-size", str(QUEUE), "--grace-seconds", str(GRACE_S)).start()
    yield srv
    assert srv.stop() == 0


def idle(srv: ServerProc) -> bool:
    h = srv.health().json()
    return not h["busy"] and h["queue_depth"] == 0


def test_more_clients_than_the_queue_holds(server):
    """With the worker busy, exactly `QUEUE` more requests are admitted (they wait) and every other
    one is refused at once with 503 + Retry-After; the admitted ones are served once the worker is
    free. The worker is held by a long streaming request that runs until this test hangs up, so
    every client arrives while it computes, however the machine schedules the threads."""
    # counting on from 10 (greedy): no end of text before max_tokens, only the hang-up ends it
    long_body = {"prompt": "Count: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10,", "max_tokens": 2000, "temperature": 0,
                 "stream": True}
    results: list[httpx.Response] = []
    lock = threading.Lock()

    def client(i: int) -> None:
        body = {"prompt": f"Client {i} says: count from one to twenty.", "max_tokens": 12, "temperature": 0}
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=900)
        with lock:
            results.append(r)

    def all_placed() -> bool:
        """Every client has its answer or waits in the queue (a refusal comes back at once)."""
        with lock:
            answered = len(results)
        return answered + server.health().json()["queue_depth"] == CLIENTS

    threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
    with httpx.stream("POST", server.url + "/v1/completions", json=long_body, timeout=900) as long_r:
        assert long_r.status_code == 200
        lines = long_r.iter_lines()  # kept until the end of the block: a dropped iterator hangs up
        for line in lines:
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                break  # a token arrived: the long request holds the worker
        else:
            pytest.fail("the long request ended before its first token")
        for t in threads:
            t.start()
        wait_for(all_placed, timeout=300, what="every client answered or queued")
        # leaving the block hangs up: the long request is cancelled and the queued ones run
    for t in threads:
        t.join()
    ok = [r for r in results if r.status_code == 200]
    busy = [r for r in results if r.status_code == 503]
    assert len(ok) + len(busy) == CLIENTS, [r.text for r in results]
    assert len(ok) == QUEUE and len(busy) == CLIENTS - QUEUE, [r.status_code for r in results]
    for r in busy:
        assert int(r.headers["Retry-After"]) > 0
        assert r.json()["error"]["code"] == "queue_full"
    for r in ok:
        assert 1 <= r.json()["usage"]["completion_tokens"] <= 12
    metrics = httpx.get(server.url + "/metrics", timeout=30).text
    assert f"edge_llm_queue_rejections_total {float(len(busy))}" in metrics


def test_disconnected_stream_frees_the_worker(server):
    wait_for(lambda: idle(server), what="idle server")
    mark = server.log_size()
    body = {"messages": [{"role": "user", "content": "Write a very long story about the sea."}],
            "max_tokens": LONG, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=900) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if '"content":"' in line and '"content":""' not in line:
                break  # one real token arrived: the generation is running; now hang up
    # the worker stops at the next token and becomes free for the next client
    line = wait_for(lambda: re.search(r"job (\d+) cancelled after (\d+) token\(s\): client disconnected",
                                      server.log(mark)), what="cancel log line")
    assert int(line.group(2)) < LONG
    wait_for(lambda: idle(server), what="worker free")
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 2}, timeout=900)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_disconnected_plain_request_is_cancelled(server):
    wait_for(lambda: idle(server), what="idle server")
    mark = server.log_size()
    body = {"prompt": "Once upon a time, far away,", "max_tokens": LONG, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        # the client gives up (closing its connection) long before 1500 tokens are generated
        httpx.post(server.url + "/v1/completions", json=body, timeout=httpx.Timeout(900, read=3))
    found = wait_for(lambda: re.search(r"job \d+ (cancelled after (\d+) token\(s\)|skipped: cancelled while "
                                       r"queued) ?:? ?\(?client disconnected", server.log(mark)),
                     what="cancel log line")
    if found.group(2) is not None:
        assert int(found.group(2)) < LONG
    wait_for(lambda: idle(server), what="worker free")
    metrics = httpx.get(server.url + "/metrics", timeout=30).text
    assert re.search(r"edge_llm_cancelled_requests_total [1-9]", metrics)


def test_sigterm_finishes_running_refuses_queued(server):
    """Runs last in this module: it stops the module's server."""
    wait_for(lambda: idle(server), what="idle server")
    mark = server.log_size()
    # 300 tokens (or its natural end, a few hundred tokens here): still running when the second
    # request is queued and SIGTERM sent, even when this process is descheduled for a while after
    # the first token; GRACE_S lets it finish on any machine
    body = {"messages": [{"role": "user", "content": "Tell me about lighthouses."}], "max_tokens": 300,
            "temperature": 0, "stream": True}
    queued: list[httpx.Response] = []
    events: list[dict] = []
    done = False
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=900) as r:
        lines = r.iter_lines()
        for line in lines:
            if '"content":"' in line and '"content":""' not in line:
                break
        t = threading.Thread(target=lambda: queued.append(httpx.post(
            server.url + "/v1/completions", json={"prompt": "queued", "max_tokens": 2}, timeout=900)))
        t.start()
        wait_for(lambda: server.health().json()["queue_depth"] == 1, what="second request queued")
        server.send(signal.SIGTERM)
        for line in lines:  # the running request streams on to its natural end
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
            done = done or line == "data: [DONE]"
        t.join()
    assert done and events[-1]["choices"][0]["finish_reason"] in ("length", "stop")
    assert events[-1]["timings"]["decode_tokens"] >= 1
    assert queued[0].status_code == 503 and queued[0].json()["error"]["code"] == "shutting_down"
    assert server.proc.wait(300) == 0
    log = server.log(mark)
    assert "shutdown: refused 1 queued request(s)" in log and "reason=SIGTERM code=0" in log


def test_grace_period_over_cancels_running_request(tiny_synth_dir, tmp_path):
    srv = ServerProc(tmp_path / "home", tmp_path, "--model", str(tiny_synth_dir), "--max-seq", "8192",
                     "--grace-seconds", "1").start()
    result: list = []

    def long_request() -> None:
        try:
            result.append(httpx.post(srv.url + "/v1/completions", timeout=900,
                                     json={"prompt": "go", "max_tokens": 8000, "temperature": 0}))
        except httpx.HTTPError as e:  # the server may close the connection when it gives up
            result.append(e)

    t = threading.Thread(target=long_request)
    t.start()
    wait_for(lambda: srv.health().json()["busy"], what="request running")
    assert srv.stop(signal.SIGTERM) == 0
    t.join()
    m = re.search(r"job \d+ cancelled after (\d+) token\(s\)", srv.log())
    assert m and int(m.group(1)) < 8000
    assert "reason=SIGTERM code=0" in srv.log()
