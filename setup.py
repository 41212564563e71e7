"""Build of the operator library, the C files (edge_llm/backends/_attn.c, the attention; _qmatmul.c,
the 4/8-bit weights' matmul; _ortop.h, what both declare to onnxruntime; _mm8ops.c, the matmul path's
per-row ops, and _npurun.c, the NPU engine's rounds, both called through ctypes only), an onnxruntime custom
operator library compiled against the vendored C API header in third_party/onnxruntime;
everything else is in pyproject.toml. The extension is optional: without a C compiler the
package installs, and cpu-q runs one-row steps on its per-layer graphs (docs/quantization.md)."""

from setuptools import Extension, setup

setup(ext_modules=[Extension(
    "edge_llm.backends._attn", ["edge_llm/backends/_attn.c", "edge_llm/backends/_qmatmul.c",
                                "edge_llm/backends/_mm8ops.c", "edge_llm/backends/_npurun.c"],
    include_dirs=["third_party/onnxruntime/include"],
    depends=["edge_llm/backends/_ortop.h"],
    extra_compile_args=["-O3", "-fopenmp-simd", "-Wno-psabi", "-pthread"], extra_link_args=["-pthread"],
    optional=True,
)])
