"""The official `openai` client against a real `edge-llm serve` process on the default model."""

from __future__ import annotations

import re
import time

import httpx
import openai
import pytest
from serverutil import ServerProc

KEY = "sk-edge-test-0123456789"
MAX_SEQ = 1024
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(edge_home, tmp_path_factory):
    work = tmp_path_factory.mktemp("srv-openai")
    (work / "api-key").write_text(f"# clients of this test\n{KEY}\n")
    srv = ServerProc(edge_home, work, "--model", "default", "--max-seq", str(MAX_SEQ),
                     "--api-key-file", str(work / "api-key"))
    srv.api_key = KEY
    srv.start(wait=False)
    # the socket is bound before the model is loaded: /health answers 503 "loading" meanwhile
    seen = []
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            r = httpx.get(srv.url + "/health", timeout=5)
        except httpx.HTTPError:
            assert srv.proc.poll() is None, srv.stderr()
            time.sleep(0.05)
            continue
        seen.append((r.status_code, r.json()["status"]))
        if r.status_code == 200:
            break
        time.sleep(0.05)
    srv.loading_seen = seen
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return server.openai(api_key=KEY)


def test_health_loading_then_ready(server):
    assert (503, "loading") in server.loading_seen
    assert server.loading_seen[-1] == (200, "ok")
    h = server.health().json()
    assert h["model"] == "default" and h["backend"] == "cpu"
    assert len(h["namespace"]) == 16 and h["snapshots"]["enabled"] is True
    assert h["queue_size"] == 16 and h["max_seq"] == MAX_SEQ and h["degraded"] == []


def test_models(client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["default"]


def test_omitted_sampling_fields_get_the_models_recommendation(server, client):
    """The default model recommends temperature 0.2 / top_p 0.9 (its generation_config.json):
    /v1/models and /health show it, and a request that omits them samples exactly as one that
    sends them (same seed)."""
    want = {"temperature": 0.2, "top_p": 0.9, "top_k": 0, "source": "generation_config.json"}
    card = httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).json()
    assert card["data"][0]["sampling_defaults"] == want
    assert server.health().json()["sampling_defaults"] == want
    ask = [{"role": "user", "content": "Name three colours."}]
    omitted = client.chat.completions.create(model="default", messages=ask, max_tokens=24, seed=7)
    explicit = client.chat.completions.create(model="default", messages=ask, max_tokens=24, seed=7,
                                              temperature=0.2, top_p=0.9)
    assert omitted.choices[0].message.content == explicit.choices[0].message.content


def test_completion_text_and_token_ids(client):
    r = client.completions.create(model="default", prompt="The capital of France is", max_tokens=4,
                                  temperature=0)
    assert r.object == "text_completion" and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 4 and r.usage.prompt_tokens > 0
    assert "Paris" in r.choices[0].text
    t = r.model_extra["timings"]
    assert t["decode_tokens"] == 4 and t["prefill_tokens"] + t["ram_cached_tokens"] == r.usage.prompt_tokens
    # the same prompt as token ids: greedy gives the same text
    ids = httpx.post(client.base_url.join("completions").__str__(), timeout=600,
                     headers={"Authorization": f"Bearer {KEY}"},
                     json={"prompt": "The capital of France is", "max_tokens": 1}).json()
    assert ids["usage"]["prompt_tokens"] == r.usage.prompt_tokens


def test_chat_repeat_uses_cached_tokens(client):
    first = client.chat.completions.create(model="default", messages=QUESTION, max_tokens=12, temperature=0)
    second = client.chat.completions.create(messages=QUESTION, max_tokens=12, temperature=0, model="default")
    assert "Paris" in first.choices[0].message.content
    assert second.choices[0].message.content == first.choices[0].message.content
    assert second.usage.prompt_tokens == first.usage.prompt_tokens
    cached = second.usage.prompt_tokens_details.cached_tokens
    # everything but the last prompt token is reused (it is always recomputed for the logits)
    assert cached == second.usage.prompt_tokens - 1
    t = second.model_extra["timings"]
    assert t["cache_source"] == "ram" and t["ram_cached_tokens"] == cached and t["prefill_tokens"] == 1


def test_streaming_chat_matches_and_reports(client):
    plain = client.chat.completions.create(model="default", messages=QUESTION, max_tokens=10, temperature=0)
    stream = client.chat.completions.create(model="default", messages=QUESTION, max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].model_extra["timings"]["decode_tokens"] >= 1
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage.total_tokens == plain.usage.total_tokens
    assert usage_chunk.usage.prompt_tokens_details.cached_tokens > 0


def test_error_statuses_through_the_client(server, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="default", prompt="hello there", max_tokens=MAX_SEQ)
    msg = e.value.body["message"]
    assert e.value.status_code == 400 and e.value.body["code"] == "context_length_exceeded"
    assert f"maximum context length is {MAX_SEQ} tokens" in msg and f"{MAX_SEQ} for the completion" in msg
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=QUESTION, max_tokens=1)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.AuthenticationError):
        server.openai(api_key="sk-wrong").models.list()
    with pytest.raises(openai.AuthenticationError):
        server.openai(api_key=KEY[:-1]).completions.create(model="default", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="default", prompt="x", max_tokens=1, echo=True)
    assert e.value.body["param"] == "echo"
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(model="default", prompt="x" * (33 * 1024 * 1024), max_tokens=1)  # > max_body_bytes
    assert e.value.status_code == 413
    r = httpx.post(server.url + "/v1/chat/completions", content=b'{"messages": [', timeout=60,
                   headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    # health stays reachable without a key (liveness only); metrics need it (docs/api.md)
    assert server.health().status_code == 200
    metrics = httpx.get(server.url + "/metrics", timeout=30, headers={"Authorization": f"Bearer {KEY}"}).text
    for status in ("400", "401", "404", "413"):
        assert f'status="{status}"' in metrics
    assert 'edge_llm_cached_tokens_total{source="ram"}' in metrics
    for series in ("edge_llm_snapshot_saves_total", "edge_llm_snapshot_bytes_written_total",
                   "edge_llm_snapshot_files", "edge_llm_rss_bytes", "edge_llm_ttft_seconds_count"):
        assert re.search(rf"^{series} [1-9]", metrics, re.M), series
