"""Benchmark and evidence drivers: raw disk limits, restore, restart recovery (used by `edge-llm bench` and tools/)."""
