"""The bounded FIFO queue (503 + Retry-After beyond it) and cancellation on client disconnect."""

from __future__ import annotations

import re
import threading

import httpx
import pytest
from serverutil import ServerProc, edge_home, wait_for  # noqa: F401  (fixture)

QUEUE = 2
CLIENTS = 6
LONG = 1500  # far more tokens than a test could wait for: only a cancel ends these early


@pytest.fixture(scope="module")
def server(edge_home, tmp_path_factory):  # noqa: F811
    srv = ServerProc(edge_home, tmp_path_factory.mktemp("srv-queue"), "--model", "default",
                     "--max-seq", "2048", "--queue-size", str(QUEUE)).start()
    yield srv
    assert srv.stop() == 0


def idle(srv: ServerProc) -> bool:
    h = srv.health().json()
    return not h["busy"] and h["queue_depth"] == 0


def test_more_clients_than_the_queue_holds(server):
    barrier = threading.Barrier(CLIENTS)
    results: list[httpx.Response] = []
    lock = threading.Lock()

    def client(i: int) -> None:
        body = {"prompt": f"Client {i} says: count from one to twenty.", "max_tokens": 12, "temperature": 0}
        barrier.wait()
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=900)
        with lock:
            results.append(r)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ok = [r for r in results if r.status_code == 200]
    busy = [r for r in results if r.status_code == 503]
    assert len(ok) + len(busy) == CLIENTS, [r.text for r in results]
    # at most one running + QUEUE waiting can be admitted; all arrive while the first computes
    assert 1 <= len(ok) <= QUEUE + 1 and len(busy) >= CLIENTS - QUEUE - 1
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
