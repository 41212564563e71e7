"""Click options shared by commands that load a runtime (generate, bench)."""

from __future__ import annotations

import functools

import click

from edge_llm.runtime import RuntimeOptions


def runtime_options(fn):
    """Add model / backend / KV / disk-KV flags; the command receives `opts: RuntimeOptions`."""
    d = RuntimeOptions()

    @click.option("--model", default=d.model, show_default=True, help="HF model directory or 'default'.")
    @click.option("--backend", default=d.backend, show_default=True, type=click.Choice(["cpu", "rknn", "auto"]),
                  help="auto: rknn when an NPU and a matching --rknn-dir exist, else cpu.")
    @click.option("--rknn-dir", default=None, metavar="DIR", help="`edge-llm convert rknn` output (backend rknn).")
    @click.option("--rknn-runner", default=d.rknn_runner, show_default=True,
                  type=click.Choice(["auto", "rknnlite", "sim", "onnxruntime"]),
                  help="What runs the graphs: the NPU, the toolkit simulator, or onnxruntime (F32).")
    @click.option("--max-seq", default=d.max_seq, show_default=True, type=click.IntRange(1))
    @click.option("--kv-bs", default=d.kv_bs, show_default=True, type=click.IntRange(1),
                  help="KV rows per snapshot block.")
    @click.option("--prefill-chunk", default=d.prefill_chunk, show_default=True, type=click.IntRange(1))
    @click.option("--disk-kv", default=None, metavar="DIR", help="Snapshot directory (disk KV on).")
    @click.option("--disk-kv-min-lcp", default=d.disk_kv_min_lcp, show_default=True, type=click.IntRange(1))
    @click.option("--disk-kv-max-files", default=d.disk_kv_max_files, show_default=True, type=click.IntRange(1))
    @click.option("--disk-kv-max-bytes", default=None, type=click.IntRange(1), help="Byte cap of a namespace.")
    @click.option("--disk-kv-max-tokens", default=d.disk_kv_max_tokens, show_default=True, type=click.IntRange(1))
    @functools.wraps(fn)
    def wrapper(*args, **kw):
        opts = RuntimeOptions(**{k: kw.pop(k) for k in list(kw) if k in RuntimeOptions.__dataclass_fields__})
        return fn(*args, opts=opts, **kw)

    return wrapper
