#!/usr/bin/env python3
"""The first requests after a server start: what the warm-up before the ready line buys.

    python tools/bench_first_request.py [--model default] [--backend cpu-q] [--starts 5]
                                        [--requests 4] [--max-tokens 6] [-- serve flags]

Starts `python -m edge_llm serve` (snapshots off) `--starts` times; after each ready line it sends
`--requests` short greedy completions one after another (each its own prompt, so none reuses
another's rows) and times each at the client; then SIGTERM. Prints one JSON line per start (the
wall ms of request 1..N and the seconds of the `warm-up:` log line) and a last line with the
medians per request index over the starts, the load average before and after, the BLAS library
and kernel family numpy runs on (threadpoolctl) and MLAS's kernel family (`cpuq.kernel_isa`).
docs/logs.md quotes its medians with the warm-up and without it: for "without", run it with
PYTHONPATH pointing at a scratch checkout whose `AppState._load` skips the `warm_up` call (the
servers it starts inherit PYTHONPATH), alternating with runs of this checkout.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import sys
import tempfile
from pathlib import Path

from edge_llm.bench.client import LocalServer, complete, read_since, wait_ready

WARM_UP_RE = re.compile(r"warm-up: a \d+-token prompt and a decode step in ([\d.]+)s")


def one_start(args: argparse.Namespace, work: Path, start: int) -> dict:
    log_file = work / f"serve-{start}.log"
    srv = LocalServer(args.model, work / "kv", log_file, stderr_file=work / f"serve-{start}.stderr",
                      extra_args=["--backend", args.backend, "--disk-kv", "off", *args.serve_args])
    srv.start()
    try:
        ready_s = wait_ready(srv.base_url, args.ready_timeout, srv.proc, stderr_file=srv.stderr_file)
        wall = [complete(srv.base_url, f"Name a color. ({start}.{j})", args.max_tokens).wall_ms
                for j in range(args.requests)]
    finally:
        srv.stop(signal.SIGTERM)
    m = WARM_UP_RE.search(read_since(log_file, 0))
    return {"start": start, "ready_s": round(ready_s, 2), "request_wall_ms": [round(w, 1) for w in wall],
            "warm_up_s": float(m.group(1)) if m else None}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--backend", default="cpu-q")
    p.add_argument("--starts", type=int, default=5)
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=6)
    p.add_argument("--ready-timeout", type=float, default=600.0)
    p.add_argument("serve_args", nargs="*", help="more `serve` flags, after --")
    args = p.parse_args()
    load_before = os.getloadavg()
    runs = []
    with tempfile.TemporaryDirectory(prefix="first-request-") as tmp:
        for start in range(args.starts):
            runs.append(one_start(args, Path(tmp), start))
            print(json.dumps(runs[-1]), flush=True)
    from edge_llm.bench.procstat import kernels

    warm = [r["warm_up_s"] for r in runs if r["warm_up_s"] is not None]
    print(json.dumps({
        "backend": args.backend, "starts": args.starts,
        "median_request_wall_ms": [round(statistics.median(r["request_wall_ms"][j] for r in runs), 1)
                                   for j in range(args.requests)],
        "median_warm_up_s": statistics.median(warm) if warm else None,
        "loadavg_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)], **kernels()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
