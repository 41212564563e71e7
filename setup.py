"""Build of the one C file (edge_llm/backends/_attn.c, cpu-q's attention kernel); everything else
is in pyproject.toml. The extension is optional: without a C compiler the package installs, and
cpu-q runs its one-row steps on the per-layer graphs (docs/quantization.md)."""

from setuptools import Extension, setup

setup(ext_modules=[Extension(
    "edge_llm.backends._attn", ["edge_llm/backends/_attn.c"],
    extra_compile_args=["-O3", "-fopenmp", "-Wno-psabi"], extra_link_args=["-fopenmp"], optional=True,
)])
