"""`edge-llm convert npu-mm` killed with SIGKILL at one point of its publication (run as a
subprocess by tests/test_mm8_verify.py; docs/npu.md, "Publication").

The CLI runs unchanged in this process; one function of the publication is replaced by a
SIGKILL of the process itself at the moment named by POINT:

- weights: weights.npz is written into the new directory, its manifest not yet;
- swap:    the new directory is complete, not yet renamed into place;
- aside:   on a filesystem without RENAME_EXCHANGE: the old directory moved aside, the new one
           not yet renamed in;
- old:     the new directory is in place, the old one not yet removed.

usage: killed_convert.py POINT MODEL_DIR OUT_DIR [convert npu-mm options...]
"""

from __future__ import annotations

import os
import runpy
import signal
import sys

from edge_llm import files
from edge_llm.backends.npu.matmul import decoder


def die(*_args) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


point, model_dir, out_dir, *options = sys.argv[1:]
target = os.path.abspath(out_dir)
if point == "weights":
    decoder.MmManifest.write = die
elif point == "swap":
    files._swap_in = die
elif point == "aside":
    files._exchange = lambda a, b: False
    real_rename = os.rename

    def rename(src, dst, *args, **kw):
        if os.path.abspath(dst) == target and os.path.basename(os.fspath(src)).startswith(".tmp-"):
            die()
        real_rename(src, dst, *args, **kw)

    os.rename = rename
elif point == "old":
    real_fsync_dir = files.fsync_dir

    def fsync_dir(path):
        if os.path.abspath(path) == os.path.dirname(target):
            die()
        real_fsync_dir(path)

    files.fsync_dir = fsync_dir
else:
    sys.exit(f"unknown point {point!r}")
sys.argv = ["edge-llm", "convert", "npu-mm", model_dir, out_dir, *options]
runpy.run_module("edge_llm", run_name="__main__")
