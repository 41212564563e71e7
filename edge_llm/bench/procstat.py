"""This process's memory as the kernel counts it (/proc/self/status), and a fresh child process
to measure one phase in (its peak is its own)."""

from __future__ import annotations

import multiprocessing as mp
from concurrent.futures import ProcessPoolExecutor

FIELDS = ("VmHWM", "VmRSS", "RssAnon", "RssFile")


def proc_status() -> dict[str, int]:
    """VmHWM (peak), VmRSS, RssAnon and RssFile of this process, in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in FIELDS:
                out[key] = int(rest.split()[0]) * 1024
    return out


def in_child(fn, *args):
    """`fn(*args)` in a fresh spawned process (picklable function and arguments)."""
    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as ex:
        return ex.submit(fn, *args).result()
