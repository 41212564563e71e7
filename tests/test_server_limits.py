"""Requests that would exhaust memory or stall the server, through a real server process: images
are sized from their headers and refused past max_seq before any pixel is decoded (the server's
peak RSS stays far below one decoded image), the per-request image cap, a prompt refused from its
byte length without being tokenized, /health answering while large prompts are tokenized, and
the decode gate (max_image_decodes)."""

from __future__ import annotations

import io
import json
import re
import select
import socket
from pathlib import Path

import httpx
from PIL import Image
from serverutil import ServerProc, wait_for
from test_vision_server import PHOTO_A, QUESTION, data_url, ok, post, user

LONGEST = "\n" + " " * 80  # SmolLM2's longest token (81 bytes): the byte bound is exact on it


def proc_status(pid: int) -> dict[str, int]:
    """VmRSS / VmHWM (peak RSS) of a process, in bytes."""
    text = Path(f"/proc/{pid}/status").read_text()
    return {k: int(v) * 1024 for k, v in re.findall(r"^(VmRSS|VmHWM):\s+(\d+) kB", text, re.M)}


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100  # utime + stime, in USER_HZ (100 on Linux)


def completion(srv: ServerProc, prompt: str, max_tokens: int = 16) -> httpx.Response:
    return httpx.post(srv.url + "/v1/completions", timeout=600,
                      json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0})


def test_image_bomb_is_refused_from_headers_without_decoding(tiny_synth_dir, edge_home, tmp_path):
    """8 PNGs of 4096x4096 zeros (a few KB each; 402 MB of float32 each once preprocessed, and
    16,384 tokens each): refused with the context-length 400 before one is decoded."""
    buf = io.BytesIO()
    Image.new("L", (4096, 4096)).save(buf, "PNG")
    bomb = data_url(buf.getvalue())
    decoded_rgb = 4096 * 4096 * 3  # the RGB source of ONE such image, before any float array
    with ServerProc(edge_home, tmp_path / "srv", "--model", str(tiny_synth_dir)).start() as srv:
        pid = srv.proc.pid
        Path(f"/proc/{pid}/clear_refs").write_text("5")  # reset the peak RSS to the current RSS
        before = proc_status(pid)["VmRSS"]
        r = post(srv, [user(QUESTION, *[bomb] * 8)])
        peak = proc_status(pid)["VmHWM"]
        assert r.status_code == 400, r.text
        print(f"peak RSS growth for the 8-image bomb: {(peak - before) / 2**20:.1f} MiB "
              f"(one decoded RGB source: {decoded_rgb / 2**20:.0f} MiB)")
        assert peak - before < decoded_rgb, "the server decoded an image it had to refuse"
        err = r.json()["error"]
        assert err["code"] == "context_length_exceeded" and err["type"] == "invalid_request_error", err
        # refused at the first image, from its header: 16384 image tokens + the 8 completion tokens
        assert "maximum context length is 8192" in err["message"] and "at least 16392" in err["message"], err

        # over the per-request cap (max_images, default 8): refused before any image is read
        r = post(srv, [user(QUESTION, *[data_url(PHOTO_A)] * 9)])
        assert r.status_code == 400 and r.json()["error"]["code"] == "too-many-images", r.text
        assert "at most 8" in r.json()["error"]["message"]
        # a valid image request is served as before: 64 image tokens from the header and the decode
        body = ok(srv, [user(QUESTION, data_url(PHOTO_A))])
        assert body["timings"]["images"] == 1 and body["timings"]["image_tokens"] == 64
        assert srv.health().json()["status"] == "ok"


def test_image_cap_is_a_setting(tiny_synth_dir, edge_home, tmp_path):
    with ServerProc(edge_home, tmp_path / "srv", "--model", str(tiny_synth_dir), "--max-seq", "1024",
                    "--max-images", "2").start() as srv:
        r = post(srv, [user(QUESTION, data_url(PHOTO_A)), user("And this?", *[data_url(PHOTO_A)] * 2)])
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "too-many-images" and err["param"] == "messages" and "3 images" in err["message"]
        assert ok(srv, [user(QUESTION, *[data_url(PHOTO_A)] * 2)])["timings"]["image_tokens"] == 128
        # an image that leaves no room for max_tokens: refused from its header (64 tokens)
        many = [user(QUESTION, data_url(PHOTO_A))]
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=600,
                       json={"messages": many, "max_tokens": 1000, "temperature": 0})
        assert r.status_code == 400 and "at least 1064" in r.json()["error"]["message"], r.text


def test_prompt_refused_from_its_bytes_before_tokenizing(edge_home, tmp_path):
    with ServerProc(edge_home, tmp_path / "srv", "--model", "default", "--max-seq", "1024").start() as srv:
        # 4 MB: at least 4e6 / 81 tokens whatever its text; "at least" is the byte bound's wording
        # (the exact check after tokenizing says how many tokens there were)
        huge = "x" * 4_000_000
        r = completion(srv, huge)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "context_length_exceeded" and err["param"] == "max_tokens"
        assert "at least 49399 tokens (at least 49383 in the prompt, 16 for the completion)" in err["message"], err
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=600,
                       json={"messages": [{"role": "user", "content": huge}], "max_completion_tokens": 4})
        assert r.status_code == 400 and "at least" in r.json()["error"]["message"], r.text
        assert r.json()["error"]["param"] == "max_completion_tokens"
        # under the byte bound but over by its exact count: refused after tokenizing, with the count
        r = completion(srv, "0" * 2000)  # one token per digit
        assert r.status_code == 400 and "(2000 in the prompt, 16 for the completion)" in r.text, r.text
        # the tightest prompt that fits is not refused: 1000 tokens of the longest token
        r = completion(srv, LONGEST * 1000, 2)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == 1000


def _raw_post(port: int, path: str, body: dict, hold_last_byte: bool = False) -> socket.socket:
    """POST `body` on a plain socket; with `hold_last_byte`, all but the body's last byte (send it
    with `sock.sendall(b"}")`): the server cannot start on the request before that byte."""
    data = json.dumps(body).encode()
    assert data.endswith(b"}")
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode()
              + (data[:-1] if hold_last_byte else data))
    return s


def _read_all(s: socket.socket) -> bytes:
    s.settimeout(600)
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    s.close()
    return out


def test_health_answers_while_large_prompts_are_tokenized(edge_home, tmp_path):
    """Six 650 KB prompts that pass the byte bound (8025 tokens at least, max_seq 8192) and are
    tokenized (650,000 digit tokens each, then refused): /health answers while all six are still
    being tokenized, once the server has spent a CPU-second on them."""
    prompt = "0123456789" * 65_000
    with ServerProc(edge_home, tmp_path / "srv", "--model", "default").start() as srv:
        pid = srv.proc.pid
        # All six bodies are in but for their last byte, then the six last bytes go out together:
        # the six tokenizations (each ~1 CPU-second quiet) start together and share the CPU, so
        # after the first CPU-second each has most of its work ahead (~5 CPU-seconds in all), far
        # more than the checks below take even when this process is descheduled. Sent one after
        # the other, the first prompt could have had that whole CPU-second to itself and be
        # answered before the check.
        socks = [_raw_post(srv.port, "/v1/completions", {"prompt": prompt, "max_tokens": 16}, hold_last_byte=True)
                 for _ in range(6)]
        cpu0 = cpu_seconds(pid)
        for s in socks:
            s.sendall(b"}")
        wait_for(lambda: cpu_seconds(pid) - cpu0 >= 1.0, what="the server tokenizing")
        assert not select.select(socks, [], [], 0)[0], "a large prompt was answered before /health was asked"
        r = httpx.get(srv.url + "/health", timeout=600)
        pending = not select.select(socks, [], [], 0)[0]
        assert r.status_code == 200 and pending, "/health waited for the tokenizer"
        for s in socks:
            head, _, body = _read_all(s).partition(b"\r\n\r\n")
            assert b" 400 " in head.split(b"\r\n")[0], head
            assert b"(650000 in the prompt, 16 for the completion)" in body, body[:300]


def test_image_decodes_are_bounded_by_the_gate(tiny_synth_dir, tmp_path):
    """Four concurrent image requests decode at most `max_image_decodes` images at a time. The
    app runs in-process on a real socket (uvicorn) with the real engine; the one instrument is a
    wrapper around VisionModel.prepare that counts the decodes in progress and holds each one
    for a moment, so that unbounded decodes would overlap."""
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    import uvicorn

    from edge_llm.runtime import load_runtime
    from edge_llm.server.app import create_app
    from edge_llm.settings import load_settings

    port = __import__("serverutil").free_port()
    settings = load_settings({"model": str(tiny_synth_dir), "log_file": "", "disk_kv": "off", "max_seq": 1024,
                              "max_image_decodes": 2, "port": port}, env={})
    lock, now, peak = threading.Lock(), [0], [0]

    def loader():
        engine = load_runtime(settings)
        real = engine.vision.prepare

        def counted(data: bytes):
            with lock:
                now[0] += 1
                peak[0] = max(peak[0], now[0])
            try:
                time.sleep(0.3)
                return real(data)
            finally:
                with lock:
                    now[0] -= 1

        engine.vision.prepare = counted
        return engine

    server = uvicorn.Server(uvicorn.Config(create_app(settings, loader=loader), host="127.0.0.1", port=port,
                                           log_config=None, lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        def ready():
            try:
                return httpx.get(url + "/health", timeout=5).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(ready, timeout=600, what="in-process server ready")
        body = {"messages": [user(QUESTION, data_url(PHOTO_A), data_url(PHOTO_A))], "max_tokens": 1}
        with ThreadPoolExecutor(4) as pool:
            rs = list(pool.map(lambda _: httpx.post(url + "/v1/chat/completions", json=body, timeout=600),
                               range(4)))
        assert [r.status_code for r in rs] == [200] * 4, [r.text for r in rs]
        assert peak[0] <= 2, f"{peak[0]} images were decoded at once (max_image_decodes 2)"
    finally:
        server.should_exit = True
        thread.join(120)
