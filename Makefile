# `make demo` and `make test` set up everything they need in .venv on a fresh machine
# (Rust toolchain and CPython 3.9+ are the only prerequisites).

PYTHON ?= python3
VENV   := .venv
BIN    := $(abspath $(VENV))/bin
PY     := $(BIN)/python
DEPS   := $(VENV)/.deps-installed
# The venv's bin first, so the Jupyter kernel that nbclient starts is the venv's Python.
export PATH := $(BIN):$(PATH)

.PHONY: all venv build demo test test-rust test-python browser screenshots gpu-wheel bench clean

all: test

$(DEPS): Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "maturin>=1.5,<2" pytest nbclient nbformat ipykernel numpy torch pandas matplotlib \
		jupyterlab selenium
	touch $@

venv: $(DEPS)

# Builds the abi3 wheel and installs it into the venv, so tests exercise what users install.
build: $(DEPS)
	rm -rf dist
	$(BIN)/maturin build --release --quiet -o dist
	$(PY) -m pip install -q --force-reinstall --no-deps dist/gpuexp-*.whl

demo: build
	$(PY) notebooks/run.py notebooks/quickstart.ipynb

test-rust:
	cargo test --workspace --quiet

test-python: build browser
	$(PY) -m pytest -q tests

# The browser tests (tests/test_browser.py) drive JupyterLab in Debian's Chromium through its
# chromedriver. As root with apt (CI), this installs both when chromedriver is missing; elsewhere
# it says how, and those tests skip.
browser:
	@command -v chromedriver >/dev/null || \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver; \
	else \
		echo "no chromedriver: the browser tests will skip (sudo apt-get install chromium chromium-driver)"; \
	fi

# Retakes the README's JupyterLab screenshots (docs/jupyterlab-*.png).
screenshots: build browser
	GPUEXP_SCREENSHOTS=docs $(PY) -m pytest -q -m browser tests

test: test-rust test-python

# The wheel for the GPU machine (see ../shared/gpu/README.md): .whl/ travels with `carry`.
gpu-wheel: $(DEPS)
	mkdir -p .whl
	rm -f .whl/gpuexp-*.whl
	$(BIN)/maturin build --release --quiet -o .whl

bench: build
	$(PY) bench/snapshot_cost.py

clean:
	rm -rf $(VENV) dist target
