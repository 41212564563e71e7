"""The w8a8 matmul path on librknnrt's int8 matmul API (docs/npu.md, "The matmul path"), low to
high: `int8.py` (the engine seam, its exact host emulation, the quantization around it),
`binding.py` (ctypes mirror of `rknn_matmul_api.h`), `rounds.py` + `_rounds.c` (one product's
parts on the cores at once), `engine.py` (the engine over the NPU cores), `row_ops.py` +
`_row_ops.c` (the per-row float32 ops between matmuls), `row_step.py` (a decode forward in one
call) and `decoder.py` (the backend)."""
