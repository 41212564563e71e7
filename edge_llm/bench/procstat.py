"""This process's memory as the kernel counts it (/proc/self/status), a fresh child process
to measure one phase in (its peak is its own), and the kernels a timing ran on."""

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


def kernels() -> dict[str, list[str] | str]:
    """The BLAS libraries numpy loaded (version, kernel family, threads) and the kernel family
    onnxruntime's MLAS picks on this CPU: what a speed figure is named with."""
    from threadpoolctl import threadpool_info

    from edge_llm.backends.cpuq.backend import kernel_isa

    return {"blas": [f"{i['internal_api']} {i['version']} {i.get('architecture')}, {i['num_threads']} threads"
                     for i in threadpool_info() if i["user_api"] == "blas"],
            "mlas": kernel_isa()}
