"""Image input for Qwen3-VL: decoding + preprocessing (`preprocess`), the vision encoder with its
DeepStack mergers (`encoder`), and MRoPE positions + image-safe prefix keys (`positions`).

The engine hands this package opaque `PreparedImage`s and gets back embeddings and positions; it
never sees pixels. See docs/architecture.md.
"""
