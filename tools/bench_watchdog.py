"""The systemd watchdog during long work: the largest gap between pings, and what feeding it costs.

    python tools/bench_watchdog.py gap [--model default] [--tokens 6800] [--watchdog-usec 2000000]
                                       [--backend cpu] [--prefill-chunk 128] [--after 5] [-- serve flags]
    python tools/bench_watchdog.py decode [--model default] [--backend cpu] [--rows 2048] [--tokens 64]

gap:    starts `python -m edge_llm serve` with NOTIFY_SOCKET set to a unix datagram socket this
        script listens on (what systemd does) and WATCHDOG_USEC set, sends one cold prompt of
        `--tokens` random token ids, keeps listening `--after` seconds after the answer (the
        snapshot save), and prints the largest gap between two WATCHDOG=1 pings in that window,
        where it fell (the STATUS= line before it) and whether systemd would have killed the
        service (a gap >= WatchdogSec). Fresh kv dir in a temporary directory; SIGTERM at the end.
decode: decode tok/s of --tokens one-row steps after a --rows prefill, with nobody listening
        (NO_WORK) and with the server's listener (the worker's progress callback pinging a notify
        socket, a cancel event), alternated, best of --repeats; and the cost of one layer report.
        Prints one JSON line with the CPU's ISA and the BLAS kernel family.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from edge_llm.bench.client import complete, free_port, wait_ready


class Listener:
    """NOTIFY_SOCKET's other end: every datagram with its arrival time."""

    def __init__(self, path: str):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path)
        self.sock.settimeout(0.2)
        self.got: list[tuple[float, str]] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.got.append((time.monotonic(), self.sock.recv(65536).decode()))
            except socket.timeout:
                continue

    def close(self) -> None:
        self._stop.set()
        self._t.join()
        self.sock.close()


def gap(args) -> None:
    rng = random.Random(args.seed)
    prompt = [rng.randrange(1000, 30000) for _ in range(args.tokens)]
    with tempfile.TemporaryDirectory(prefix="edge-llm-watchdog-") as tmp:
        listener = Listener(os.path.join(tmp, "notify.sock"))
        port = free_port()
        cmd = [sys.executable, "-m", "edge_llm", "serve", "--model", args.model, "--host", "127.0.0.1",
               "--port", str(port), "--disk-kv", os.path.join(tmp, "kv"), "--log-file", os.path.join(tmp, "log"),
               "--max-seq", str(args.tokens + 64)]
        cmd += ["--backend", args.backend] if args.backend else []
        cmd += ["--prefill-chunk", str(args.prefill_chunk)] if args.prefill_chunk else []
        env = {**os.environ, "NOTIFY_SOCKET": listener.sock.getsockname(), "WATCHDOG_USEC": str(args.watchdog_usec)}
        env.pop("WATCHDOG_PID", None)
        stderr = Path(tmp, "stderr")
        with open(stderr, "wb") as err:
            proc = subprocess.Popen([*cmd, *args.serve_args], env=env, stdout=err, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL)
        try:
            wait_ready(f"http://127.0.0.1:{port}", 600, proc, stderr_file=stderr)
            t0 = time.monotonic()
            c = complete(f"http://127.0.0.1:{port}", prompt, max_tokens=4)
            t_answer = time.monotonic()
            time.sleep(args.after)
            t1 = time.monotonic()
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            listener.close()
    wd = args.watchdog_usec / 1e6
    got = [(t, m) for t, m in listener.got if t0 <= t <= t1]
    pings = [t for t, m in got if "WATCHDOG=1" in m.splitlines()]
    edges = [t0, *pings, t1]
    gap, at = max((b - a, a) for a, b in zip(edges, edges[1:]))
    before = [m for t, m in got if t <= at and "STATUS=" in m]
    where = before[-1].split("STATUS=", 1)[1].splitlines()[0] if before else "request start"
    tm = c.timings
    print(f"model {args.model}, backend {args.backend or 'default'}, chunk {args.prefill_chunk or 'default'}, "
          f"prompt {c.prompt_tokens} tokens, WATCHDOG_USEC {args.watchdog_usec}")
    print(f"  prefill {tm.get('prefill_ms', 0) / 1e3:.2f} s, answer after {t_answer - t0:.2f} s, "
          f"{len(pings)} WATCHDOG=1 pings in {t1 - t0:.1f} s (request + {args.after:g} s after)")
    print(f"  largest gap {gap:.3f} s, from +{at - t0:.2f} s (answer at +{t_answer - t0:.2f} s), "
          f"after STATUS {where!r}: {'WOULD BE KILLED' if gap >= wd else 'ok'} (WatchdogSec {wd:g} s)")


def decode(args) -> None:
    import numpy as np
    from threadpoolctl import threadpool_info

    from edge_llm.backends.cpuq.backend import kernel_isa
    from edge_llm.progress import DECODE, NO_WORK, Work
    from edge_llm.runtime import load_runtime
    from edge_llm.sdnotify import Notifier
    from edge_llm.server.worker import Worker
    from edge_llm.settings import Settings

    eng = load_runtime(Settings(model=args.model, backend=args.backend or "cpu", disk_kv=None,
                                max_seq=args.rows + args.tokens + 8))
    ids = np.random.default_rng(args.seed).integers(100, min(eng.model.args.vocab_size, 20000), args.rows).tolist()
    first = eng.model.prefill(ids, eng.cache, chunk=eng.align)
    with tempfile.TemporaryDirectory(prefix="edge-llm-watchdog-") as tmp:
        listener = Listener(os.path.join(tmp, "notify.sock"))
        notifier = Notifier({"NOTIFY_SOCKET": listener.sock.getsockname(), "WATCHDOG_USEC": str(args.watchdog_usec)})
        server = Work(threading.Event(), Worker(eng, notifier=notifier)._progress)  # what a request gets
        best = {"none": float("inf"), "server": float("inf")}
        for _ in range(args.repeats):
            for name, work in (("none", NO_WORK), ("server", server)):
                eng.cache.truncate(args.rows)
                logits = first
                t0 = time.perf_counter()
                for i in range(args.tokens):
                    logits = eng.model.forward([int(np.argmax(logits))], eng.cache, work=work)
                    work.report(DECODE, i + 1, args.tokens)
                best[name] = min(best[name], time.perf_counter() - t0)
        n = 200_000
        layer = getattr(server, "layer", None)  # absent before per-layer reports existed
        t0 = time.perf_counter()
        for i in range(n if layer else 0):
            layer(i % 30 + 1, 30)
        per_call_us = (time.perf_counter() - t0) / n * 1e6 if layer else None
        listener.close()
    blas = [i for i in threadpool_info() if i.get("user_api") == "blas"]
    print(json.dumps({"what": "decode", "model": eng.model_dir.name, "backend": eng.model.backend.name,
                      "rows": args.rows, "tokens": args.tokens, "repeats": args.repeats,
                      "layers": eng.model.args.num_hidden_layers, "layer_reports": layer is not None,
                      "decode_tok_per_s": {k: round(args.tokens / v, 2) for k, v in best.items()},
                      "layer_report_us": None if per_call_us is None else round(per_call_us, 3),
                      "isa": kernel_isa(),
                      "blas": f"{blas[0].get('internal_api')} {blas[0].get('architecture')}" if blas else "none"}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["gap", "decode"])
    ap.add_argument("--model", default="default")
    ap.add_argument("--tokens", type=int, default=None, help="gap: prompt tokens (6800); decode: steps (64)")
    ap.add_argument("--rows", type=int, default=2048, help="decode: rows prefilled before the steps")
    ap.add_argument("--repeats", type=int, default=5, help="decode: best of")
    ap.add_argument("--watchdog-usec", type=int, default=2_000_000, help="WATCHDOG_USEC")
    ap.add_argument("--backend", default=None, help="--backend (gap: default the server's own; decode: cpu)")
    ap.add_argument("--prefill-chunk", type=int, default=None, help="gap: --prefill-chunk of the server")
    ap.add_argument("--after", type=float, default=5.0, help="gap: seconds to keep listening after the answer")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("serve_args", nargs="*", help="gap: more `serve` flags (after --)")
    args = ap.parse_args()
    args.tokens = args.tokens or (6800 if args.what == "gap" else 64)
    if args.what == "gap":
        gap(args)
    else:
        decode(args)


if __name__ == "__main__":
    main()
