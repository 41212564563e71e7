"""`edge-llm serve` with a deliberately stuck engine: a test hook, not product code.

The model's forward blocks forever once the KV cache holds STALL_AFTER_ROWS rows, the way a
wedged driver or a deadlock would leave the worker thread. Everything else (HTTP, signals,
sd_notify) is the real server. Usage: python stuck_serve.py serve [serve flags...]
"""

import os
import sys
import threading

from edge_llm.models import qwen3

STALL_AFTER_ROWS = int(os.environ["STALL_AFTER_ROWS"])
_real_run = qwen3.Model._run


def _run(self, tokens, cache, *args, **kw):
    if cache.length >= STALL_AFTER_ROWS:
        print(f"test hook: engine stalled at {cache.length} rows", file=sys.stderr, flush=True)
        threading.Event().wait()
    return _real_run(self, tokens, cache, *args, **kw)


qwen3.Model._run = _run

if __name__ == "__main__":
    from edge_llm.cli import main

    sys.argv = ["edge-llm", *sys.argv[1:]]
    main()
