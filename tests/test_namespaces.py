"""The snapshot namespace of the default model on every backend, pinned: moving or renaming a
backend's code must not move its snapshots (docs/identity.md). A namespace is a hash over the
model's identity and the backend's `numerics`; the parts of `numerics` that name this machine's
kernels and the dependencies' releases (numpy's SIMD loops and BLAS family, the operator
library's attention clone, MLAS's kernel family, onnxruntime's version) are replaced by
placeholders first, so the pins hold on every CPU: what is left is what the code composes (the
backend's prefix, its manifest identity over the converted weights, the runner's and engine's
names), and that is what a refactor could change.

The converted directories are made so that their bytes are the same on every CPU: the npu-mm
conversion without rotations, clip or GPTQ (elementwise float32 only, no BLAS), the graph
export of the F32 weights as they are, cpu-q's graphs from the GGUF's blocks and elementwise
re-quantization."""

from __future__ import annotations

import onnx
import pytest

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

# {onnx release: {backend: namespace}}: the ONNX files' bytes (cpu-q's and the graph path's
# manifest identities hash them) are onnx's serialization. Measured before and after the backends
# were moved into one folder each: the same values from both trees, and with OpenBLAS's SkylakeX
# and Haswell kernels.
PINS = {
    "1.18.0": {
        "cpu": "c8e57c5af5a66001",
        "cpu-q": "302a2b752cc5b74f",
        "rknn-graphs": "52eea38051c2e41a",
        "rknn-mm": "c059be4f4302ac96",
    },
}


def portable(numerics: str) -> str:
    """`numerics` with this machine's kernel names and the dependencies' releases as placeholders."""
    import onnxruntime as ort

    for part, name in ((numpy_kernels(), "NUMPY"), (kernel_isa(), "MLAS"), (kernels.isa(), "ATTN"),
                       (ort.__version__, "ORT")):
        numerics = numerics.replace(part, name)
    return numerics


@pytest.fixture(scope="module")
def namespaces(edge_home, default_model_dir, tmp_path_factory):
    work = tmp_path_factory.mktemp("namespaces")
    convert_mm8(default_model_dir, work / "mm", rotation="none", down_rotation="none", vo_rotation="none",
                clip="none", gptq_tokens=0)
    export_graph_set(default_model_dir, work / "graphs")
    backends = {
        "cpu": lambda: CPUBackend(),
        "cpu-q": lambda: open_cpu_q(default_model_dir, "q4", blocks=gguf_blocks(default_model_dir)),
        "rknn-graphs": lambda: open_rknn(work / "graphs", "onnxruntime", model_dir=default_model_dir, threads=1),
        "rknn-mm": lambda: open_rknn(work / "mm", "host", model_dir=default_model_dir),
    }
    out = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EDGE_LLM_HOME", str(edge_home))  # cpu-q builds (or finds) its graphs in the session's home
        for name, make in backends.items():
            model = Model.load(default_model_dir, backend=make())
            try:
                numerics = portable(model.backend.numerics)
                ident = Identity.for_model(default_model_dir, model.args, numerics,
                                           prefill_chunk=model.chunk_size(Settings().prefill_chunk))
                out[name] = (numerics, ident.namespace)
            finally:
                model.close()
    return out


@pytest.mark.parametrize("backend", ["cpu", "cpu-q", "rknn-graphs", "rknn-mm"])
def test_namespace_of_the_default_model_is_pinned(namespaces, backend):
    numerics, ns = namespaces[backend]
    assert "NUMPY" in numerics or backend == "rknn-graphs", numerics  # the placeholders did replace something
    if onnx.__version__ not in PINS:
        pytest.skip(f"no namespaces pinned for onnx {onnx.__version__} (its serialization decides the "
                    f"graph files' bytes); these are {dict((k, v[1]) for k, v in namespaces.items())}")
    assert ns == PINS[onnx.__version__][backend], numerics
