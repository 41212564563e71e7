"""Build of the operator library: one shared object from every backend's C sources, each beside the
Python that loads it: backends/kernels/_attn.c (the attention over the cache's rows) and _ortop.h
(what the onnxruntime operators declare) and _qmatmul.c (cpu-q's 4/8-bit weights' matmul),
backends/npu/matmul/_row_ops.c (the matmul path's per-row ops) and _rounds.c (the NPU engine's
rounds), the last two called through ctypes only. It is an onnxruntime custom operator library
compiled against the vendored C API header in third_party/onnxruntime; `backends/kernels/` finds
and loads it. Everything else is in pyproject.toml. The extension is optional: without a C
compiler the package installs, and cpu-q runs one-row steps on its per-layer graphs
(docs/quantization.md)."""

from setuptools import Extension, setup

SOURCES = ["edge_llm/backends/kernels/_attn.c", "edge_llm/backends/kernels/_qmatmul.c",
           "edge_llm/backends/npu/matmul/_row_ops.c", "edge_llm/backends/npu/matmul/_rounds.c"]

setup(ext_modules=[Extension(
    "edge_llm.backends.kernels._ops", SOURCES,
    include_dirs=["third_party/onnxruntime/include"],
    depends=["edge_llm/backends/kernels/_ortop.h"],
    extra_compile_args=["-O3", "-fopenmp-simd", "-Wno-psabi", "-pthread"], extra_link_args=["-pthread"],
    optional=True,
)])
