"""Backend `cpu-q`: weight-only quantized linears on onnxruntime (docs/quantization.md). The
backend (`backend.py`), the `MatMulNBits` layout and GGUF blocks (`nbits.py`), their graph nodes
(`nbits_export.py`), the whole-decoder decode graph (`decode_export.py`) and its runner with the KV
rows bound in place (`decode_step.py`); `_qmatmul.c` is the 4/8-bit linear of the operator library
(`backends/kernels/`)."""
