# `make demo` and `make test` set up everything they need in .venv on a fresh machine
# (a Rust toolchain and CPython 3.10+ are the only prerequisites: torch 2.11 needs 3.10; the
# wheel itself runs on 3.9+). Lightning and transformers (with accelerate, which its Trainer
# needs) are there for the callbacks' tests and examples.

PYTHON ?= python3
VENV   := .venv
BIN    := $(abspath $(VENV))/bin
PY     := $(BIN)/python
DEMO_DEPS := $(VENV)/.demo-deps-installed
DEPS   := $(VENV)/.deps-installed
DOCS_DEPS := $(VENV)/.docs-deps-installed
# What each command installs, each bounded: from a release that installs on CPython 3.10 to
# below the next major (the next minor for 0.x packages, whose minors break: ruff's rules, zig's
# linker). The tests ran with versions inside these: torch 2.11 on the GPU machine and 2.15 on
# the CPU one, the others' newest. `make demo` needs the build, the notebook runner and the
# notebook's imports; `make test` adds the rest (tests/test_make_packages.py checks both).
DEMO_PACKAGES := "maturin>=1.5,<2" "ziglang>=0.17,<0.18" "nbclient>=0.10,<1" "nbformat>=5.10,<6" \
	"ipykernel>=7,<8" "numpy>=2,<3" "torch>=2.11,<3"
TEST_PACKAGES := "pytest>=9,<10" "hypothesis>=6.100,<7" "pandas>=2.2,<4" "matplotlib>=3.8,<4" \
	"ruff>=0.17,<0.18" "mypy>=2,<3" "auditwheel>=6,<7" "jupyterlab>=4,<5" "selenium>=4.20,<5" \
	"lightning>=2.4,<3" "transformers>=5,<6" "accelerate>=1,<2"
# An abi3 wheel for CPython 3.9+ on glibc 2.17 and newer (manylinux2014): pyproject.toml's
# [tool.maturin] sets the tag and links through zig (rust/zig-linker), so a plain
# `maturin build --release` and `pip install .` give it too.
WHEEL  := --release
# The venv's bin first, so the Jupyter kernel that nbclient starts is the venv's Python.
export PATH := $(BIN):$(PATH)

.PHONY: all venv build demo docs docs-captures lint rust-linters test test-rust test-python browser screenshots wheel-check gpu-wheel bench fuzz clean

all: test

$(DEMO_DEPS): Makefile
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 10))' || { \
		echo "make: $(PYTHON) is CPython $$($(PYTHON) -c 'import platform; print(platform.python_version())'); the set-up needs 3.10 or newer (torch 2.11's), e.g. make PYTHON=python3.11"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(DEMO_PACKAGES)
	touch $@

# The demo's packages again, so that the resolver keeps them within their bounds.
$(DEPS): $(DEMO_DEPS)
	$(PY) -m pip install -q $(DEMO_PACKAGES) $(TEST_PACKAGES)
	touch $@

venv: $(DEPS)

# Builds the abi3 wheel and installs it into the venv, so tests exercise what users install.
build: $(DEMO_DEPS)
	rm -rf dist
	$(BIN)/maturin build $(WHEEL) --quiet -o dist
	$(PY) -m pip install -q --force-reinstall --no-deps dist/gpuexp-*.whl

# The wheel's platform tag as auditwheel sees it, and an install and import on CPython 3.9 to 3.13.
wheel-check: build $(DEPS)
	tests/wheel_check.sh dist/gpuexp-*.whl

demo: build
	$(PY) notebooks/run.py notebooks/quickstart.ipynb

# The documentation site (mkdocs.yml, docs/) into site/, in strict mode: a broken link, a missing
# page or an API reference that doesn't resolve fails it. mkdocs-material for the pages,
# mkdocstrings' Python handler for the reference: it reads the sources and _core.pyi statically,
# so it needs neither the build nor the native module. mkdocs stays below 2, which these plugins
# don't support. Never `--quiet`: it hides the warnings that strict mode counts, so nothing fails
# (tests/test_docs.py plants a broken link and runs this recipe's command to prove it).
$(DOCS_DEPS): $(DEMO_DEPS)
	$(PY) -m pip install -q "mkdocs>=1.6,<2" "mkdocs-material>=9.5,<10" "mkdocstrings[python]>=0.26,<2"
	touch $@

docs: $(DOCS_DEPS)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# Retakes the outputs the documentation shows that need no GPU (docs/capture.py --gpu on a GPU
# machine retakes the others), and the README's example.
docs-captures: build $(DEPS)
	$(PY) docs/capture.py --cpu --readme

# rustfmt and clippy come with rustup's default profile; a minimal one gets them added here.
rust-linters:
	@cargo fmt --version >/dev/null 2>&1 || rustup component add rustfmt
	@cargo clippy --version >/dev/null 2>&1 || rustup component add clippy

# Formatting and lints, enforced: `make test` (and so CI) fails on any of them.
lint: $(DEPS) rust-linters
	cargo fmt --all --check
	cargo clippy --workspace --all-targets --quiet -- -D warnings
	cargo clippy --workspace --all-targets --features python --quiet -- -D warnings
	$(BIN)/ruff check

test-rust:
	cargo test --workspace --quiet

# The docs' dependencies first: tests/test_docs.py builds the site, and skips without mkdocs.
test-python: $(DEPS) build browser $(DOCS_DEPS)
	$(PY) -m pytest -q tests

# The browser tests (tests/test_browser*.py) drive JupyterLab in Debian's Chromium through its
# chromedriver. As root with apt (CI), this installs both when chromedriver is missing, without
# apt's recommended packages (about 26 packages instead of 131, and no avahi, which would change
# the system's default browser); elsewhere it says how, and those tests skip. Chromium's package
# makes itself the default x-www-browser; the one before (or none) is put back. apt's own output
# (over a hundred lines) goes to APT_LOG: a heading and a one-line summary show, the log on failure.
APT_LOG ?= target/apt-browser.log
browser:
	@command -v chromedriver >/dev/null || \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "make test: installing Chromium and chromedriver with apt for the browser tests (about 26 packages; log: $(APT_LOG))"; \
		mkdir -p "$$(dirname $(APT_LOG))"; \
		before=$$(if [ -e /etc/alternatives/x-www-browser ]; then readlink -f /etc/alternatives/x-www-browser; fi); \
		if { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium chromium-driver; } >$(APT_LOG) 2>&1; then \
			echo "make test: apt installed $$(grep -c '^Setting up ' $(APT_LOG)) packages"; \
		else \
			status=$$?; echo "make test: apt failed (status $$status); its log, $(APT_LOG):"; cat $(APT_LOG); exit $$status; \
		fi; \
		if [ -n "$$before" ]; then update-alternatives --quiet --set x-www-browser "$$before"; \
		else update-alternatives --quiet --remove x-www-browser /usr/bin/chromium 2>/dev/null || true; fi; \
	else \
		echo "no chromedriver: the browser tests will skip (sudo apt-get install --no-install-recommends chromium chromium-driver)"; \
	fi

# Retakes the documentation's JupyterLab screenshots (docs/jupyterlab-*.png).
screenshots: $(DEPS) build browser
	GPUEXP_SCREENSHOTS=docs $(PY) -m pytest -q -m browser tests

test: lint test-rust test-python docs

# The wheel for the GPU machine (see ../shared/gpu/README.md): .whl/ travels with `carry`.
gpu-wheel: $(DEMO_DEPS)
	mkdir -p .whl
	rm -f .whl/gpuexp-*.whl
	$(BIN)/maturin build $(WHEEL) --quiet -o .whl

bench: build
	$(PY) bench/snapshot_cost.py

# libFuzzer on the snapshot reader (rust/fuzz) for FUZZ_SECONDS, seeded with the real snapshots
# of rust/src/trace/testdata: at most 2 GiB resident, 1 GiB in one allocation and 10 s an input.
# It needs the nightly toolchain and cargo-fuzz (rustup toolchain install nightly; cargo install
# cargo-fuzz). What it finds lands in rust/fuzz/artifacts/snapshot. `make test` runs the stable
# property tests of the same reader (rust/tests/snapshot_bytes.rs) instead.
FUZZ_SECONDS ?= 60
fuzz:
	mkdir -p rust/fuzz/corpus/snapshot
	cp rust/src/trace/testdata/*.pickle rust/fuzz/corpus/snapshot/
	cd rust/fuzz && cargo +nightly fuzz run snapshot -O -- -max_total_time=$(FUZZ_SECONDS) \
		-rss_limit_mb=2048 -malloc_limit_mb=1024 -timeout=10 -print_final_stats=1

clean:
	rm -rf $(VENV) dist target site
