"""Measure what an oversized request costs a running server (docs/benchmarks/request-limits.md).

Starts `python -m edge_llm serve` in a subprocess (the edge_llm that PYTHONPATH gives, so the
same script measures two checkouts) and reports, as JSON:
- the image bomb: a chat request of 8 PNGs of 4096x4096 zeros to a vision model; the server's
  VmHWM (peak RSS) reset before the request (/proc/<pid>/clear_refs) and read after it;
- a 4 MB completion prompt: seconds to its refusal;
- six 4 MB prompts in flight at once: the slowest /health answer while they are processed;
- the same for 650 KB of digits (650,000 tokens): under the byte bound, so it is tokenized.

    python tools/bench_request_limits.py --vision-model DIR [--home DIR]
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import re
import select
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from PIL import Image


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def status(pid: int) -> dict[str, int]:
    text = Path(f"/proc/{pid}/status").read_text()
    return {k: int(v) * 1024 for k, v in re.findall(r"^(VmRSS|VmHWM):\s+(\d+) kB", text, re.M)}


class Server:
    def __init__(self, *args: str, work: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, "-m", "edge_llm", "serve", "--host", "127.0.0.1",
                                      "--port", str(self.port), "--no-disk-kv", "--log-file",
                                      str(work / f"log-{self.port}"), *args],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError("server not ready")

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(120)


def raw_post(port: int, body: dict) -> socket.socket:
    data = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode() + data)
    return s


def bomb(srv: Server) -> dict:
    buf = io.BytesIO()
    Image.new("L", (4096, 4096)).save(buf, "PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    msg = {"role": "user", "content": [*({"type": "image_url", "image_url": {"url": url}} for _ in range(8)),
                                       {"type": "text", "text": "Describe."}]}
    pid = srv.proc.pid
    Path(f"/proc/{pid}/clear_refs").write_text("5")
    before = status(pid)
    t0 = time.perf_counter()
    r = httpx.post(srv.url + "/v1/chat/completions", json={"messages": [msg], "max_tokens": 8}, timeout=600)
    dt = time.perf_counter() - t0
    after = status(pid)
    return {"png_bytes": len(buf.getvalue()), "status": r.status_code, "seconds": round(dt, 3),
            "rss_before_mib": round(before["VmRSS"] / 2**20, 1), "peak_mib": round(after["VmHWM"] / 2**20, 1),
            "message": r.json()["error"]["message"] if r.status_code != 200 else ""}


def big_prompts(srv: Server, prompt: str) -> dict:
    t0 = time.perf_counter()
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 16}, timeout=600)
    single = time.perf_counter() - t0
    socks = [raw_post(srv.port, {"prompt": prompt, "max_tokens": 16}) for _ in range(6)]
    t0 = time.perf_counter()
    worst, probes, open_ = 0.0, 0, list(socks)
    while open_:
        h0 = time.perf_counter()
        httpx.get(srv.url + "/health", timeout=600)
        worst, probes = max(worst, time.perf_counter() - h0), probes + 1
        for s in select.select(open_, [], [], 0)[0]:
            while s.recv(65536):
                pass
            s.close()
            open_.remove(s)
        time.sleep(0.05)
    return {"bytes": len(prompt), "one_prompt_seconds": round(single, 3), "status": r.status_code,
            "six_in_flight_seconds": round(time.perf_counter() - t0, 3),
            "health_max_latency_seconds": round(worst, 3), "health_probes": probes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vision-model", required=True, help="a Qwen3-VL model directory (e.g. `model synth`)")
    ap.add_argument("--home", default=os.environ.get("EDGE_LLM_HOME"), help="EDGE_LLM_HOME (the default model)")
    a = ap.parse_args()
    if a.home:
        os.environ["EDGE_LLM_HOME"] = a.home
    out = {}
    with tempfile.TemporaryDirectory() as work:
        srv = Server("--model", a.vision_model, work=Path(work))
        try:
            out["image_bomb"] = bomb(srv)
        finally:
            srv.close()
        srv = Server("--model", "default", work=Path(work))
        try:
            out["prompt_4mb"] = big_prompts(srv, "x" * 4_000_000)
            # under the byte bound at max_seq 8192 (at least 8025 tokens): tokenized, then refused
            out["prompt_650kb_digits"] = big_prompts(srv, "0123456789" * 65_000)
        finally:
            srv.close()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
