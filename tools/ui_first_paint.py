#!/usr/bin/env python3
"""The page's first paint while the server is busy decoding, and its weight (docs/ui.md).

    python tools/ui_first_paint.py [--backend cpu] [--loads 5] [--max-tokens 4000]

Starts `python -m edge_llm serve` (snapshots off) and Debian's headless chromium (the browser test's
set-up, tests/uibrowser.py). Loads `/ui/` `--loads` times on the idle server, then starts one long
streamed completion and, once its first token arrived, loads the page `--loads` times more while it
decodes (the state endpoint must say busy before and after each load). The browser's cache is off:
every load is a first visit, every file is transferred. Per load: the browser's paint
timing (`performance.getEntriesByType('paint')`: first-paint, first-contentful-paint) and the time
until the server-state panel holds the backend (the first data shown), all from navigation start.
Prints one JSON line per load, then the medians idle and busy, the bytes the page loaded (resource
timing) and those of the static folder, the CPU, the load average and numpy's BLAS kernels.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import threading
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import uibrowser as ub  # noqa: E402  (the browser test's driver set-up)

from edge_llm.bench.client import LocalServer, wait_ready  # noqa: E402

STATIC = Path(__file__).resolve().parents[1] / "edge_llm" / "server" / "static"
# resolves with ms from navigation start once the state panel shows the backend (the first data)
DATA_SHOWN_JS = """
const done = arguments[arguments.length - 1];
const ready = () => document.querySelector('#state dd[data-key=backend]')?.textContent;
if (ready()) { done(performance.now()); return; }
new MutationObserver((_, obs) => { if (ready()) { obs.disconnect(); done(performance.now()); } })
    .observe(document.body, {childList: true, subtree: true});
"""


def one_load(driver, url: str) -> dict:
    driver.get(url + "/ui/")
    shown = driver.execute_async_script(DATA_SHOWN_JS)
    paint = {e["name"]: e["startTime"] for e in driver.execute_script(
        "return performance.getEntriesByType('paint').map(e => ({name: e.name, startTime: e.startTime}))")}
    weight = driver.execute_script(
        "return [...performance.getEntriesByType('navigation'), ...performance.getEntriesByType('resource')]"
        ".filter(e => new URL(e.name).pathname.startsWith('/ui/'))"
        ".reduce((a, e) => a + e.decodedBodySize, 0)")
    return {"first_paint_ms": round(paint.get("first-paint", -1), 1),
            "first_contentful_paint_ms": round(paint.get("first-contentful-paint", -1), 1),
            "state_shown_ms": round(shown, 1), "page_bytes": weight}


def busy(url: str) -> bool:
    return bool(httpx.get(url + "/v1/edge/state", timeout=30).json()["busy"])


def decode_in_background(url: str, max_tokens: int, first_token: threading.Event, stop: threading.Event):
    body = {"prompt": "Count from one to ten thousand in words: one, two, three,", "max_tokens": max_tokens,
            "temperature": 0, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=3600) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                first_token.set()
            if stop.is_set():
                return  # closing the stream cancels the job (docs/api.md)


def medians(rows: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in rows) for k in ("first_paint_ms", "first_contentful_paint_ms",
                                                              "state_shown_ms")}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--backend", default="cpu")
    p.add_argument("--loads", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=4000)
    args = p.parse_args()
    if ub.missing():
        print(ub.missing(), file=sys.stderr)
        return 2
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="ui-first-paint-") as tmp:
        srv = LocalServer(args.model, Path(tmp) / "kv", Path(tmp) / "serve.log", stderr_file=Path(tmp) / "stderr",
                          extra_args=["--backend", args.backend, "--disk-kv", "off"])
        srv.start()
        driver = None
        stop = threading.Event()
        try:
            wait_ready(srv.base_url, 600, srv.proc, stderr_file=srv.stderr_file)
            driver = ub.start_browser()
            driver.execute_cdp_cmd("Network.enable", {})
            driver.execute_cdp_cmd("Network.setCacheDisabled", {"cacheDisabled": True})  # a first visit each time
            one_load(driver, srv.base_url)  # the browser's own first start, not counted
            idle = []
            for _ in range(args.loads):
                idle.append({"server": "idle", **one_load(driver, srv.base_url)})
                print(json.dumps(idle[-1]), flush=True)
            first = threading.Event()
            t = threading.Thread(target=decode_in_background, args=(srv.base_url, args.max_tokens, first, stop),
                                 daemon=True)
            t.start()
            if not first.wait(600):
                raise SystemExit("the long completion produced no token")
            loaded = []
            for _ in range(args.loads):
                before = busy(srv.base_url)
                row = one_load(driver, srv.base_url)
                if not (before and busy(srv.base_url)):
                    raise SystemExit("the completion ended during the measurement: raise --max-tokens")
                loaded.append({"server": "busy decoding", **row})
                print(json.dumps(loaded[-1]), flush=True)
        finally:
            stop.set()
            if driver is not None:
                driver.quit()
            srv.stop(signal.SIGTERM)
    from edge_llm.bench.procstat import kernels

    files = {f.name: f.stat().st_size for f in sorted(STATIC.rglob("*")) if f.is_file()}
    print(json.dumps({
        "backend": args.backend, "loads": args.loads, "median_idle": medians(idle),
        "median_busy": medians(loaded), "page_bytes_loaded": loaded[-1]["page_bytes"],
        "static_bytes": sum(files.values()), "static_files": files,
        "loadavg_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)], **kernels()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
