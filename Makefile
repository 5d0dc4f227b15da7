# Two commands: `make train` runs the embedded default job; `make test` runs the tests.
# Both bootstrap .venv on a fresh clone. Where no torch is installed, the pinned CPU build is
# installed first so that the `torch>=2.6` range does not pull a multi-GB CUDA build.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_PIN ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: install train test test-full lint bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(TORCH_PIN)
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

# The trainer sets the host allocator itself (training.host_allocator, train/host_malloc.py).
train: $(STAMP)
	$(VENV)/bin/densetrain train $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

test-full: $(STAMP)
	$(PY) -m pytest -q --runslow $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
