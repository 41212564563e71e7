"""Backend `cpu-q`: weight-only quantized linears on onnxruntime (docs/quantization.md). The
backend (`backend.py`), the `MatMulNBits` layout and GGUF blocks (`nbits.py`), their graph nodes
(`nbits_export.py`), the whole-decoder decode graph (`decode_export.py`) and its runner with the KV
rows bound in place (`decode_step.py`). Its two C operators, `AttnRow` and the 4/8-bit linear
`MatMulQ`, are the onnxruntime operator library's (`backends/kernels/`), which registers them."""
