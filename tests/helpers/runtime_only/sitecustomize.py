"""Imported at start-up by a Python whose PYTHONPATH holds this directory (tests/helpers/runtime_deps.py):
every top-level module named in EDGE_LLM_TEST_NOT_INSTALLED (comma-separated) fails to import as
if it were not installed, so the process sees the venv `make serve` builds: edge-llm's runtime
dependencies only (no onnx, no onnxruntime, no torch)."""

import os
import sys

_GONE = frozenset(filter(None, os.environ.get("EDGE_LLM_TEST_NOT_INSTALLED", "").split(",")))


class _NotInstalled:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in _GONE:
            raise ModuleNotFoundError(f"No module named {name!r} (not a runtime dependency of edge-llm)", name=name)
        return None


if _GONE:
    sys.meta_path.insert(0, _NotInstalled())
