"""Model conversion for the NPU backend (`edge-llm convert rknn`); see docs/npu.md."""
