#!/usr/bin/env bash
# Create the converter venv: Rockchip's host toolkit (rknn-toolkit2) in its own environment.
#
# rknn-toolkit2 2.5.0 pins old numpy/onnx/protobuf and a full torch; installed with its own
# dependency resolution it would drag the runtime venv back by years. So it goes into a venv of
# its own, installed --no-deps, next to exactly the packages it imports (pinned below). The
# runtime venv never gets these; `edge-llm convert rknn` drives this venv's python as a
# subprocess (docs/npu.md).
#
# usage: tools/setup-converter.sh [VENV_DIR]      (default: .venv-converter; env PY=python3.11)
# Idempotent: a stamp file holding the pin list's hash skips a venv that is already complete.
set -euo pipefail

VENV="${1:-${CONVERTER_VENV:-.venv-converter}}"
PY="${PY:-python3}"
TOOLKIT="rknn-toolkit2==2.5.0"
# what rknn-toolkit2 2.5.0 imports (its requirements_cp311-2.5.0.txt, versions that work together)
PINS=(
  "numpy==1.26.4"
  "onnx==1.18.0"
  "protobuf==4.25.8"
  "onnxruntime==1.22.1"
  "scipy==1.13.1"
  "psutil==7.0.0"
  "ruamel.yaml==0.18.14"
  "tqdm==4.67.1"
  "opencv-python-headless==4.11.0.86"
  "fast-histogram==0.14"
  "torch==2.13.0"           # only so that `import rknn.api` succeeds; the simulator never uses it
  "setuptools<81"           # rknn imports pkg_resources (removed in setuptools 81)
)
STAMP="$VENV/.edge-llm-converter"
want="$(printf '%s\n' "$TOOLKIT" "${PINS[@]}" | sha256sum | cut -c1-16)"

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]] && "$VENV/bin/python" -c "import rknn.api" 2>/dev/null; then
  echo "converter venv $VENV is up to date ($TOOLKIT)"
  exit 0
fi

start=$(date +%s)
[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "${PINS[@]}"
"$VENV/bin/python" -m pip install -q --no-deps "$TOOLKIT"
# the import check is the real test: a missing transitive import shows up here, not mid-convert
"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
from rknn.api import RKNN  # noqa: F401
print("rknn-toolkit2", md.version("rknn-toolkit2"), "imports; numpy", md.version("numpy"),
      "onnx", md.version("onnx"), "onnxruntime", md.version("onnxruntime"))
PY
echo "$want" > "$STAMP"
echo "converter venv ready in $(( $(date +%s) - start )) s: $VENV"
