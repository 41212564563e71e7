"""`edge-llm serve` whose snapshot reads take SLOW_LAYER_S seconds per layer: a test hook, not product code.

It imitates a slow flash (the board's eMMC) so that a request reliably arrives while a restore is
still reading; a real throttled device needs root and a blkio cgroup (`edge-llm bench recovery
--throttle-mbps`). Every read still goes through the real reader and its CRC checks. Usage:
python slow_disk_serve.py serve [serve flags...]
"""

import os
import sys
import time

from edge_llm.snapshot import chain_read

SLOW_LAYER_S = float(os.environ["SLOW_LAYER_S"])
_real_read_layer = chain_read.ChainRead.read_layer


def read_layer(self, layer, k, v):
    time.sleep(SLOW_LAYER_S)
    return _real_read_layer(self, layer, k, v)


chain_read.ChainRead.read_layer = read_layer

if __name__ == "__main__":
    from edge_llm.cli import main

    sys.argv = ["edge-llm", *sys.argv[1:]]
    main()
