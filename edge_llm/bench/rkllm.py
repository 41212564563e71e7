"""The peer on the NPU: RKLLM's published figures (rknn-llm's benchmark.md), which `bench npu`
and `bench decode` print their own figures next to."""

# RKLLM's published figures for Qwen3-VL-2B w8a8 on RK3588 (rknn-llm benchmark.md): TTFT of a
# 128-token prompt, decode, memory; every NPU benchmark prints its figures next to these
RKLLM = {"ttft_128_ms": 383.6, "decode_tok_s": 14.98, "memory_mb": 1869.0}
RKLLM_PREFILL_ROWS = 128
