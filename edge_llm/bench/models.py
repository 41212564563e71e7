"""The models the benchmarks run on, by name: synthetic checkpoints are written on first use.

`synth`: the Qwen3-VL-2B text geometry with fewer layers (random weights, real tokenizer);
`tiny`: the tiny synthetic preset; `default`: the embedded default model; anything else: a model
directory. Synthetic checkpoints live in `$EDGE_LLM_HOME/models/`.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

log = logging.getLogger(__name__)


def synth_model(layers: int, vision: bool = False) -> Path:
    """$EDGE_LLM_HOME/models/synth-qwen3-vl-2b-<N>l[-vision], written by `edge-llm model synth` if
    missing (the vision tower only when asked: it adds ~0.8 GB)."""
    from edge_llm.settings import home_dir

    path = home_dir() / "models" / f"synth-qwen3-vl-2b-{layers}l{'-vision' if vision else ''}"
    if not (path / "config.json").is_file():
        log.warning("writing synthetic checkpoint %s ...", path)
        subprocess.run([sys.executable, "-m", "edge_llm", "model", "synth", "--preset", "qwen3-vl-2b",
                        "--layers", str(layers), "--vision" if vision else "--no-vision", str(path)], check=True)
    return path


def bench_model(spec: str, layers: int) -> tuple[str, Path]:
    """(label, model dir) of a benchmark's model name (see the module docstring)."""
    from edge_llm.checkpoints.default import resolve_model_dir

    if spec == "synth":
        return f"Qwen3-VL-2B geometry, {layers} of 28 layers", synth_model(layers)
    if spec == "tiny":
        from edge_llm.checkpoints.synth import synth_checkpoint
        from edge_llm.settings import home_dir

        path = home_dir() / "models" / "synth-tiny"
        if not (path / "config.json").is_file():
            synth_checkpoint(path, preset="tiny")
        return "tiny (synthetic, 2 layers)", path
    path = Path(resolve_model_dir(spec))
    return path.name, path
