# Two commands set everything up on a fresh machine:
#   make demo   build, validate and publish every variant of the embedded tiny model (cpu backend)
#   make test   run the test suite
# Both create .venv and install the pipeline first.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch; pip on these machines takes it from the local wheel cache. Elsewhere, add
# TORCH_INDEX=--index-url=https://download.pytorch.org/whl/cpu to avoid a multi-GB CUDA download.
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=

.PHONY: demo test test-full lint dvc-demo clean-artifacts

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH_INDEX) "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e '.[dev]' -c constraints.txt
	touch $@

demo: $(VENV)/.installed
	$(PY) -m pipeline --multirun '+variant=glob(*)' backend=cpu

test: $(VENV)/.installed
	$(PY) -m pytest -q

test-full: $(VENV)/.installed
	$(PY) -m pytest -q -m ""

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check pipeline tests bench

dvc-demo: $(VENV)/.installed
	. $(VENV)/bin/activate && dvc repro

clean-artifacts:
	rm -rf artifacts
