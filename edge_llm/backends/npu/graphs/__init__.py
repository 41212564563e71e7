"""The NPU's compiled-graph runners: `rknnlite.py` (the `.rknn` files on the board through
rknn-toolkit-lite2) and `sim.py` (the rknn-toolkit2 simulator in the converter venv, driven over
a pipe: `toolkit_worker.py` runs there and speaks `wire.py`)."""
