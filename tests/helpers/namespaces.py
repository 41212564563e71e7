"""The default model's snapshot namespace on every backend, with this machine's kernel names as
placeholders (tests/test_namespaces.py). A subprocess, because numpy's BLAS picks its kernel family
(OPENBLAS_CORETYPE) once at import.

usage: namespaces.py MODEL_DIR WORK_DIR   (EDGE_LLM_HOME: where cpu-q builds or finds its graphs)
Converts MODEL_DIR into WORK_DIR/mm (npu-mm without rotations, clip or GPTQ: elementwise float32,
no BLAS) and WORK_DIR/graphs (the graph export of the F32 weights as they are), loads each backend
and prints one JSON line: {"blas": numpy's BLAS kernel family, backend: [numerics with
placeholders, namespace], ...}.
"""

import json
import sys
from pathlib import Path

import onnxruntime as ort
from threadpoolctl import threadpool_info

from edge_llm.backends import kernels
from edge_llm.backends.cpu.backend import CPUBackend, numpy_kernels
from edge_llm.backends.cpuq.backend import kernel_isa, open_cpu_q
from edge_llm.backends.graph.onnx_export import export_graph_set
from edge_llm.backends.npu.backend import open_rknn
from edge_llm.checkpoints.gguf_blocks import gguf_blocks
from edge_llm.convert.npu_mm import convert_mm8
from edge_llm.models.qwen3 import Model
from edge_llm.settings import Settings
from edge_llm.snapshot.identity import Identity


def portable(numerics: str) -> str:
    """`numerics` with this machine's kernel names and the dependencies' releases as placeholders."""
    for part, name in ((numpy_kernels(), "NUMPY"), (kernel_isa(), "MLAS"), (kernels.isa(), "ATTN"),
                       (ort.__version__, "ORT")):
        numerics = numerics.replace(part, name)
    return numerics


def main(model_dir: Path, work: Path) -> dict:
    convert_mm8(model_dir, work / "mm", rotation="none", down_rotation="none", vo_rotation="none",
                clip="none", gptq_tokens=0)
    export_graph_set(model_dir, work / "graphs")
    backends = {
        "cpu": lambda: CPUBackend(),
        "cpu-q": lambda: open_cpu_q(model_dir, "q4", blocks=gguf_blocks(model_dir)),
        "rknn-graphs": lambda: open_rknn(work / "graphs", "onnxruntime", model_dir=model_dir, threads=1),
        "rknn-mm": lambda: open_rknn(work / "mm", "host", model_dir=model_dir),
    }
    out = {"blas": [i.get("architecture") for i in threadpool_info() if i["user_api"] == "blas"]}
    for name, make in backends.items():
        model = Model.load(model_dir, backend=make())
        try:
            numerics = portable(model.backend.numerics)
            ident = Identity.for_model(model_dir, model.args, numerics,
                                       prefill_chunk=model.chunk_size(Settings().prefill_chunk))
            out[name] = [numerics, ident.namespace]
        finally:
            model.close()
    return out


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]), Path(sys.argv[2]))))
