"""edge-llm: a single-process LLM runtime for RK3588 boards with bit-exact disk KV snapshots."""

__version__ = "0.1.0"
