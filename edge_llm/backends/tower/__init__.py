"""The vision tower's side of the backend seam (`seam.py`), its export to ONNX (`export.py`) and
the tower as one graph on a runner (`graph.py`: onnxruntime for cpu-q, the NPU for rknn). The
numpy tower is backend cpu's (`backends/cpu/tower.py`)."""
