"""`edge-llm serve` with hooks on its snapshot I/O: a test hook, not product code.

- SLOW_LAYER_S: each snapshot read sleeps that many seconds per layer. It imitates a slow flash
  (the board's eMMC) so that a request arrives while a restore is still reading; a real throttled
  device needs root and a blkio cgroup (`edge-llm bench recovery --throttle-mbps`).
- READ_GATE=PATH: a read's layers after the first wait until PATH exists. A test holds a restore
  (the prefetch's read) mid-way until its request is queued, then creates PATH: the request is
  certain to arrive during the read, however slow the machine is.
- SAVE_GATE=PATH: a snapshot save (not a compaction) writes its layers after the first only while
  PATH exists. With PATH removed, the next save stays in flight, its temp file on disk, until the
  test kills the process.

Every read and write still goes through the real reader and writer and their CRCs. Usage:
python slow_disk_serve.py serve [serve flags...]
"""

import os
import sys
import threading
import time

from edge_llm.snapshot import chain_read, saver
from edge_llm.snapshot import format as fmt

SLOW_LAYER_S = float(os.environ.get("SLOW_LAYER_S", "0"))
READ_GATE = os.environ.get("READ_GATE")
SAVE_GATE = os.environ.get("SAVE_GATE")
_real_read_layer = chain_read.ChainRead.read_layer
_real_save_write = saver.Saver._write
_real_write_layer = fmt.SnapshotWriter.write_layer
_saving = threading.local()  # set on the writer thread while a save (not a compaction) writes


def _wait_for(path: str) -> None:
    while not os.path.exists(path):
        time.sleep(0.02)


def read_layer(self, layer, k, v):
    if READ_GATE and layer >= 1:
        _wait_for(READ_GATE)
    if SLOW_LAYER_S:
        time.sleep(SLOW_LAYER_S)
    return _real_read_layer(self, layer, k, v)


def save_write(self, *args, **kw):
    _saving.on = True
    try:
        return _real_save_write(self, *args, **kw)
    finally:
        _saving.on = False


def write_layer(self, layer, k_rows, v_rows):
    if SAVE_GATE and layer >= 1 and getattr(_saving, "on", False):
        _wait_for(SAVE_GATE)
    return _real_write_layer(self, layer, k_rows, v_rows)


chain_read.ChainRead.read_layer = read_layer
saver.Saver._write = save_write
fmt.SnapshotWriter.write_layer = write_layer

if __name__ == "__main__":
    from edge_llm.cli import main

    sys.argv = ["edge-llm", *sys.argv[1:]]
    main()
