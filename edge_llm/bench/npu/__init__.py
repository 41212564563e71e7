"""`edge-llm bench npu` (docs/npu.md): the run on a board or over a library (`run.py`), the
matmul API's micro-benchmark (`matmul.py`), the CPU side timed on this machine (`cpu.py`) and the
prediction built from those rates (`predict.py`)."""
