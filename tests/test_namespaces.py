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
re-quantization. Each set is computed in a subprocess (tests/helpers/namespaces.py): with this
environment's kernels and, on x86, with numpy's BLAS forced to its Haswell kernels."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import onnx
import pytest

HELPER = Path(__file__).parent / "helpers" / "namespaces.py"
BACKENDS = ("cpu", "cpu-q", "rknn-graphs", "rknn-mm")
# {onnx release: {backend: namespace}}: the ONNX files' bytes (cpu-q's and the graph path's
# manifest identities hash them) are onnx's serialization. Measured before and after the backends
# were moved into one folder each: the same values from both trees, and with OpenBLAS's SkylakeX
# and Haswell kernels. cpu-q's moved once on purpose, with its quant format 5 (q4's near-float
# activations: other graphs, other numerics, so snapshots of the int8-activation graphs are not
# restored into it); measured with SkylakeX and Haswell kernels alike.
PINS = {
    "1.18.0": {
        "cpu": "c8e57c5af5a66001",
        "cpu-q": "7ff61a36a10124b7",
        "rknn-graphs": "52eea38051c2e41a",
        "rknn-mm": "c059be4f4302ac96",
    },
}



@pytest.fixture(scope="module", params=[None, pytest.param("Haswell", marks=pytest.mark.skipif(
    platform.machine() != "x86_64", reason="an x86 OpenBLAS kernel family"))], ids=lambda f: f or "default-kernels")
def namespaces(request, edge_home, default_model_dir, tmp_path_factory) -> dict:
    env = {**os.environ, "EDGE_LLM_HOME": str(edge_home)}  # cpu-q builds (or finds) its graphs there
    if request.param:
        env["OPENBLAS_CORETYPE"] = request.param
    work = tmp_path_factory.mktemp("namespaces")
    r = subprocess.run([sys.executable, str(HELPER), str(default_model_dir), str(work)], env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.splitlines()[-1])
    if request.param:  # the variable was honoured: this run really used the other kernels
        assert out["blas"] == [request.param], out["blas"]
    return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_namespace_of_the_default_model_is_pinned(namespaces, backend):
    numerics, ns = namespaces[backend]
    assert "NUMPY" in numerics or backend == "rknn-graphs", numerics  # the placeholders did replace something
    if onnx.__version__ not in PINS:
        pytest.skip(f"no namespaces pinned for onnx {onnx.__version__} (its serialization decides the "
                    f"graph files' bytes); these are {dict((k, namespaces[k][1]) for k in BACKENDS)}")
    assert ns == PINS[onnx.__version__][backend], numerics
