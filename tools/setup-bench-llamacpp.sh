#!/usr/bin/env bash
# The llama.cpp peer of `edge-llm bench llamacpp` in a venv of its own (never the runtime venv).
#
#   tools/setup-bench-llamacpp.sh [VENV]        # default: .venv-llamacpp next to the checkout
#
# llama-cpp-python compiles llama.cpp from source (several minutes on 2 cores; pip shows its
# downloads, and a line every 30 s says the compiler still runs). On a CPU that
# advertises Intel AMX the build leaves the AMX kernels out (-mno-amx-*: they crashed in a VM
# here); every other ISA extension of the CPU is used (GGML_NATIVE). A stamp file makes a second
# run a no-op. The version is pinned so same-run ratios compare against a known llama.cpp.
set -euo pipefail
LLAMA_CPP_PYTHON=${LLAMA_CPP_PYTHON:-llama-cpp-python==0.3.36}
here=$(cd "$(dirname "$0")/.." && pwd)
venv=${1:-$here/.venv-llamacpp}
py=${PYTHON:-python3}
stamp="$venv/.llamacpp-stamp"
want="$LLAMA_CPP_PYTHON"
if grep -q amx /proc/cpuinfo 2>/dev/null; then
    flags="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    cmake_args="-DGGML_NATIVE=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
    cmake_args="$cmake_args -DCMAKE_C_FLAGS='$flags' -DCMAKE_CXX_FLAGS='$flags'"
    want="$want no-amx"
else
    cmake_args="-DGGML_NATIVE=ON"
fi
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    echo "llama.cpp bench venv $venv is up to date ($want)"
    exit 0
fi
[ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
echo "building $LLAMA_CPP_PYTHON in $venv (CMAKE_ARGS: $cmake_args); this compiles for several minutes"
# the compiler prints nothing through pip: a line every PROGRESS_EVERY seconds says it still runs
start=$(date +%s)
( while sleep "${PROGRESS_EVERY:-30}" </dev/null >/dev/null 2>&1; do
      echo "  ... still building llama.cpp: $(( $(date +%s) - start )) s so far"
  done ) &
ticker=$!
trap 'kill "$ticker" 2>/dev/null || true' EXIT
CMAKE_ARGS="$cmake_args" CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2} \
    "$venv/bin/python" -m pip install --no-cache-dir "$LLAMA_CPP_PYTHON" numpy
kill "$ticker" 2>/dev/null || true
echo "llama.cpp built in $(( $(date +%s) - start )) s"
"$venv/bin/python" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__); \
print(llama_cpp.llama_print_system_info().decode())"
echo "$want" > "$stamp"
