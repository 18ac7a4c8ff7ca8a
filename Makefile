# Fresh machine: `make demo` or `make test`. Each creates .venv with a Python >= 3.12
# and installs the project from pyproject.toml.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

# python3.12, else a python3 that is new enough, else a pyenv-installed 3.12+.
FIND_PYTHON = for c in python3.12 python3 $$HOME/.pyenv/versions/3.1[2-9]*/bin/python3; do \
	  if command -v $$c >/dev/null 2>&1 && $$c -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then \
	    echo $$c; exit 0; fi; done; exit 1

.PHONY: demo test test-full test-interop lint clean

# On a machine with an NVIDIA driver the CUDA build of JAX comes too (the `cuda` extra).
CUDA_EXTRA := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo ",cuda")

$(STAMP): pyproject.toml
	@PYTHON=$$($(FIND_PYTHON)) || { echo "error: need Python >= 3.12 (python3.12 or python3 on PATH)" >&2; exit 1; }; \
	  echo "using $$PYTHON ($$($$PYTHON --version))"; \
	  $$PYTHON -m venv $(VENV)
	@# uv installs the same requirements in seconds where pip takes half a minute; pip where uv
	@# cannot be had. Byte-compiled on first import instead (only the modules used).
	$(PY) -m pip install -q uv && $(VENV)/bin/uv pip install -q --python $(PY) -e '.[test,dev,notebooks$(CUDA_EXTRA)]' \
	  || { $(PY) -m pip install -q --upgrade pip && $(PY) -m pip install -q --no-compile -e '.[test,dev,notebooks$(CUDA_EXTRA)]'; }
	@touch $(STAMP)

demo: $(STAMP)
	$(PY) -m humming_jax demo

# The test processes (the workers, the notebooks' kernel) write the byte code the install left
# out, so that each after the first imports JAX compiled, even where the environment says not to.
# A test file runs whole in one worker: its cases share the programs that worker traced and compiled.
test: $(STAMP)
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -n 2 --dist loadfile -q --durations=12

# Every case of the sweeps (make test runs a chosen case for each path they cover).
test-full: $(STAMP)
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -n 2 --dist loadfile -q --full

# Parity with Hugging Face transformers (PyTorch, a few GB): its own virtualenv.
INTEROP := .venv-interop
$(INTEROP)/.installed: pyproject.toml
	@PYTHON=$$($(FIND_PYTHON)) || { echo "error: need Python >= 3.12" >&2; exit 1; }; $$PYTHON -m venv $(INTEROP)
	$(INTEROP)/bin/python -m pip install -q --upgrade pip
	$(INTEROP)/bin/python -m pip install -q --no-compile -e '.[test,interop]'
	@touch $@

test-interop: $(INTEROP)/.installed
	$(INTEROP)/bin/python -m pytest -q tests_interop

lint: $(STAMP)
	$(VENV)/bin/ruff check humming_jax pallas_kernels tests tests_interop benchmarks

clean:
	rm -rf $(VENV) $(INTEROP) build *.egg-info
