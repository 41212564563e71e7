"""Backend `rknn`: the RK3588 NPU (docs/npu.md). `backend.py` opens a converted directory and
picks its path: compiled fp16 graphs (`graphs/`: RKNNLite on the board, the rknn-toolkit2
simulator on a host) or int8 matmuls on librknnrt's matmul API (`matmul/`)."""
