"""Backend `cpu`: the decoder (`backend.py`) and the vision tower (`tower.py`) in numpy float32 on
BLAS, the reference every other backend is measured against (docs/architecture.md)."""
