"""The exported-graph family shared by backend cpu-q and the NPU's compiled graphs: the graph
schema (`schema.py`: names, shapes, row plans), the converted directory's `manifest.py`, the ONNX
exporter (`onnx_export.py`), the runner protocol with its onnxruntime runner (`runners.py`), the
CPU's part of int8 graphs (`cpu_side.py`) and `GraphBackend` over them (`backend.py`)."""
