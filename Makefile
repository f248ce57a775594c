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

# Two more environments hold the declared version ranges to what was tested (tests/test_versions.py says why):
#   make test-production   torch 2.8.0 and transformers 5.13.0, the [neuron] extra's (constraints-production.txt)
#   make test-lowest       every dependency at the lowest version its range allows (constraints-lowest.txt)
# Both pin every package; regenerate the pins with `make constraints` after changing a range in pyproject.toml.
VENV_PRODUCTION ?= .venv-production
VENV_LOWEST ?= .venv-lowest
# The inf2 DLAMI's Python (Ubuntu 22.04's): the production environment runs it, and its pins and the base lock are
# resolved for it. PYTHON_PRODUCTION is python$(INF2_PYTHON) on PATH, else the newest pyenv has; set it to choose one.
# (Each candidate is run: a pyenv shim of that name exists whether or not it can run one.)
INF2_PYTHON := 3.10
IS_INF2_PYTHON := -c 'import sys; sys.exit("%d.%d" % sys.version_info[:2] != "$(INF2_PYTHON)")'
PYTHON_PRODUCTION ?= $(shell for p in python$(INF2_PYTHON) $$(ls -d \
	$${PYENV_ROOT:-$$HOME/.pyenv}/versions/$(INF2_PYTHON).*/bin/python$(INF2_PYTHON) 2>/dev/null | sort -rV); do \
	"$$p" $(IS_INF2_PYTHON) 2>/dev/null && { command -v "$$p"; break; }; done)
# What differs between versions is marked across_versions in the tests (pyproject.toml says which marker means what):
# the recipe, the cpu backend against transformers' reference, validation's numerics and one variant end to end; the
# neuron backend on the stand-in SDK and its contract checks (an inf2 host runs torch 2.8); serve (FastAPI, uvicorn,
# the openai client); the preflight's measured peaks against its estimates (each torch's allocator); publishing to the
# test Hub (each huggingface_hub's upload path); and, marked slow too, the same bytes from two checkouts (each
# torch's TorchScript writer).
VERSION_MARKS := across_versions and not cluster and not container
# Every pytest run below uses both cores (pytest-xdist; tests/conftest.py builds what tests share once per run).
# worksteal: a worker that runs out of tests takes some of the other's, so a few long tests at the end of a run (the
# slow ones are minutes each) do not leave a core idle. The 15 slowest are printed: where a target's time goes.
# PYTEST_WORKERS=0 runs in one process.
PYTEST_WORKERS ?= 2
XDIST = -n $(PYTEST_WORKERS) --dist worksteal --durations=15

.PHONY: demo test test-full test-slow test-rehearsal rehearse-e4b rehearse-e2b test-production check-base-lock test-xla test-lowest \
	test-cluster slurm-packages \
	constraints lock lint dvc-demo clean-artifacts container-packages container-base container-images \
	test-container test-loadtools

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH_INDEX) "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e '.[dev]' -c constraints.txt
	touch $@

demo: $(VENV)/.installed
	$(PY) -m pipeline --multirun '+variant=glob(*)' backend=cpu

# PYTEST_ARGS=--reverse runs the tests in reverse order (every test must pass alone and in any subset).
PYTEST_ARGS ?=

test: $(VENV)/.installed
	$(PY) -m pytest -q $(XDIST) $(PYTEST_ARGS)

# The tools users point at an OpenAI endpoint, each in its own environment (their dependencies are theirs): lm-eval
# with the pipeline (the [eval] extra: python -m pipeline eval), guidellm and aiperf at the versions tested here.
# make test-loadtools runs tests/test_loadtools.py against serve of the tiny build.
VENV_EVAL ?= .venv-eval
VENV_GUIDELLM ?= .venv-guidellm
VENV_AIPERF ?= .venv-aiperf
GUIDELLM_SPEC := guidellm==0.8.1
AIPERF_SPEC := aiperf==0.13.0

$(VENV_EVAL)/.installed: pyproject.toml constraints.txt
	rm -rf $(VENV_EVAL)
	$(PYTHON) -m venv $(VENV_EVAL)
	$(VENV_EVAL)/bin/python -m pip install --quiet --upgrade pip
	$(VENV_EVAL)/bin/python -m pip install --quiet $(TORCH_INDEX) "$(TORCH_SPEC)"
	$(VENV_EVAL)/bin/python -m pip install --quiet -e '.[dev,eval]' -c constraints.txt
	touch $@

# torch is named with each tool (they pull it in): a looser requirement takes a multi-GB CUDA build
$(VENV_GUIDELLM)/.installed:
	rm -rf $(VENV_GUIDELLM)
	$(PYTHON) -m venv $(VENV_GUIDELLM)
	$(VENV_GUIDELLM)/bin/python -m pip install --quiet $(TORCH_INDEX) "$(TORCH_SPEC)" "$(GUIDELLM_SPEC)"
	touch $@

$(VENV_AIPERF)/.installed:
	rm -rf $(VENV_AIPERF)
	$(PYTHON) -m venv $(VENV_AIPERF)
	$(VENV_AIPERF)/bin/python -m pip install --quiet $(TORCH_INDEX) "$(TORCH_SPEC)" "$(AIPERF_SPEC)"
	touch $@

test-loadtools: $(VENV_EVAL)/.installed $(VENV_GUIDELLM)/.installed $(VENV_AIPERF)/.installed
	GUIDELLM=$(CURDIR)/$(VENV_GUIDELLM)/bin/guidellm AIPERF=$(CURDIR)/$(VENV_AIPERF)/bin/aiperf \
		$(VENV_EVAL)/bin/python -m pytest -q -p no:cacheprovider $(XDIST) -m loadtools tests/test_loadtools.py

# The two version environments are byte-compiled at install (pip's default), though .ci/run installs them beside the
# tests: with --no-compile (tried) an environment that sets PYTHONDONTWRITEBYTECODE=1, as these machines' shells do,
# compiled torch again in every process, and make test-production took 8:26 instead of 4:47.
$(VENV_PRODUCTION)/.installed: pyproject.toml constraints-production.txt
	@"$(PYTHON_PRODUCTION)" $(IS_INF2_PYTHON) 2>/dev/null || { echo "make: no Python $(INF2_PYTHON) for" \
		"$(VENV_PRODUCTION), the inf2 DLAMI's Python (looked for python$(INF2_PYTHON) on PATH and in pyenv's" \
		"versions/$(INF2_PYTHON).*; tried: $(or $(PYTHON_PRODUCTION),none)): install one (pyenv install" \
		"$(INF2_PYTHON), or apt-get install python$(INF2_PYTHON)-venv) or set PYTHON_PRODUCTION=/path/to/it" >&2; \
		exit 1; }
	rm -rf $(VENV_PRODUCTION)
	"$(PYTHON_PRODUCTION)" -m venv $(VENV_PRODUCTION)
	$(VENV_PRODUCTION)/bin/python -m pip install --quiet --upgrade pip
	$(VENV_PRODUCTION)/bin/python -m pip install --quiet -e '.[dev,xla]' -c constraints-production.txt
	touch $@

$(VENV_LOWEST)/.installed: pyproject.toml constraints-lowest.txt
	$(PYTHON) -m venv $(VENV_LOWEST)
	$(VENV_LOWEST)/bin/python -m pip install --quiet --upgrade pip
	$(VENV_LOWEST)/bin/python -m pip install --quiet -e '.[dev]' -c constraints-lowest.txt
	touch $@

# deploy/install-inf2.sh's first step at the inf2 host's Python, as a dry run: the base lock resolves there with every
# file pinned by its hash (pip install --require-hashes --no-deps), nothing installed.
BASE_LOCK ?= deploy/lock/inf2-base.txt
check-base-lock: $(VENV_PRODUCTION)/.installed
	$(VENV_PRODUCTION)/bin/python -m pip install --dry-run --quiet --disable-pip-version-check --require-hashes \
		--no-deps --ignore-installed -r $(BASE_LOCK) --report /dev/null

test-production: $(VENV_PRODUCTION)/.installed check-base-lock
	EXPECT_PYTHON=$(INF2_PYTHON) $(VENV_PRODUCTION)/bin/python -m pytest -q -p no:cacheprovider $(XDIST) -m "$(VERSION_MARKS)"

# backend=xla (tests/test_xla.py): the recipe's graphs lowered by torch-xla 2.8 on its CPU device, checked, and run
# through validate. torch-xla needs the production pins' torch 2.8, so it lives in that environment ([xla] extra).
test-xla: $(VENV_PRODUCTION)/.installed
	REQUIRE_TORCH_XLA=1 $(VENV_PRODUCTION)/bin/python -m pytest -q -p no:cacheprovider $(XDIST) tests/test_xla.py

# A test whose across_versions mark names the distributions it depends on (torch, transformers, safetensors) runs here
# only where one of them is at another version than the production pins: where all are the same (torch 2.8 and
# transformers 5.13 in both today), make test-production has run it already at exactly these versions.
test-lowest: $(VENV_LOWEST)/.installed
	$(VENV_LOWEST)/bin/python -m pytest -q -p no:cacheprovider $(XDIST) -m "$(VERSION_MARKS)" \
		--already-tested-with=constraints-production.txt

# Across hosts (tests/test_slurm.py, tests/test_s3.py, marked cluster): a one-node Slurm cluster with accounting, and
# moto's S3 server, started on this machine by the tests. Needs root; installs Debian's packages when missing.
SLURM_PACKAGES := slurm-wlm slurmdbd munge mariadb-server
slurm-packages:
	@if ! command -v slurmctld >/dev/null || ! command -v slurmdbd >/dev/null || ! command -v munged >/dev/null \
		|| ! command -v mariadbd >/dev/null; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
			$(SLURM_PACKAGES); fi

$(VENV)/.installed-cluster-tests: $(VENV)/.installed
	$(PY) -m pip install --quiet -e '.[dev,cluster-tests]' -c constraints.txt
	touch $@

test-cluster: slurm-packages $(VENV)/.installed-cluster-tests
	REQUIRE_SLURM=1 $(PY) -m pytest -q -p no:cacheprovider -m cluster tests/test_slurm.py tests/test_s3.py

# deploy/Containerfile's two images, built and run here (tests/test_container.py, marked container): the base made with
# debootstrap from Debian's packages, the images built with podman, their commands run with buildah (chroot isolation:
# no OCI runtime can start a container on these machines, docs/containers.md says why). Needs root.
CONTAINER_PACKAGES := podman buildah debootstrap fuse-overlayfs
container-packages:
	@if ! command -v podman >/dev/null || ! command -v buildah >/dev/null || ! command -v debootstrap >/dev/null; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
			$(CONTAINER_PACKAGES); fi

container-base: container-packages
	deploy/container-base.sh

# Both images, as tests/test_container.py builds them (the same script; podman's layer cache makes a second build a
# lookup). .ci/run does not build them in the background: tried beside the tests at nice 19, the build starved (the
# base's debootstrap took 19 minutes instead of 1:38) and two timing gates of make test-slow failed under the load.
container-images: container-base
	deploy/container-images.sh

test-container: container-base $(VENV)/.installed
	REQUIRE_CONTAINERS=1 $(PY) -m pytest -q -p no:cacheprovider -m container tests/test_container.py

# Resolve the two pin files again (uv's resolver: lowest-direct for the floors; the production pins for INF2_PYTHON,
# which .venv-production runs).
constraints: $(VENV)/.installed
	$(PY) -m pip install --quiet uv
	$(PY) -c "import tomllib; x = tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']; \
		print('\n'.join(r for r in x['neuron'] if r.startswith(('torch==', 'transformers=='))))" > .production-input.txt
	$(VENV)/bin/uv pip compile pyproject.toml --extra dev --extra xla --python-version $(INF2_PYTHON) \
		--python-platform x86_64-manylinux_2_28 --constraint .production-input.txt \
		--no-emit-package gemma4-neuron-pipeline -o constraints-production.txt
	$(VENV)/bin/uv pip compile pyproject.toml --extra dev --resolution lowest-direct --python-version 3.11 \
		--python-platform x86_64-manylinux_2_28 --no-emit-package gemma4-neuron-pipeline -o constraints-lowest.txt
	rm -f .production-input.txt

# The inf2 host's base lock (deploy/lock/inf2-base.txt, which deploy/install-inf2.sh installs with --require-hashes):
# the pipeline's dependencies with its [s3] and [serve] extras, torch and transformers at the [neuron] extra's pins,
# and the build backend (the pipeline installs with --no-build-isolation), every file by sha256, for any platform
# (uv --universal). The Neuron packages are not in it: each release has its own lock (pipeline/cli/neuron_lock.py).
lock: $(VENV)/.installed
	$(PY) -m pip install --quiet uv
	$(PY) -c "import tomllib; x = tomllib.load(open('pyproject.toml', 'rb')); n = x['project']['optional-dependencies']; \
		print('\n'.join([r for r in n['neuron'] if r.startswith(('torch==', 'transformers=='))] \
		+ x['build-system']['requires']))" > .lock-input.txt
	$(VENV)/bin/uv pip compile pyproject.toml .lock-input.txt --extra s3 --extra serve --generate-hashes --universal \
		--python-version $(INF2_PYTHON) --no-emit-package gemma4-neuron-pipeline --custom-compile-command 'make lock' \
		-o deploy/lock/inf2-base.txt
	rm -f .lock-input.txt

# The production path rehearsed (tests/test_rehearsal.py): deploy/rebuild.sh on a checkout set up for release (E4B's
# checkpoint layout, the neuron stand-in, hardware=inf2_8xlarge, signing, the test Hub, a DVC remote).
test-rehearsal: $(VENV)/.installed
	$(PY) -m pytest -q -m slow -p no:cacheprovider tests/test_rehearsal.py

# The full-size rehearsal (bench/rehearse_e4b.py, docs/full-size.md): a Gemma-4-E4B-shaped checkpoint with random
# weights (15 GB, written here), then every stage of 512_bf16 and 512_bf16_host at tp_degree 2 on the cpu backend, a
# local publish, pull, serve through the openai client, and the baselines (transformers' bf16 generate, tar with zstd),
# every process's peak memory and the disk's high-water mark measured. Needs about 100 GB of free disk (its time:
# docs/testing.md); not part of .ci/run. Writes $(REHEARSAL_DIR)/artifacts/rehearsal.json.
REHEARSAL_DIR ?= /tmp/rehearse-e4b
rehearse-e4b: $(VENV)/.installed
	$(PY) bench/rehearse_e4b.py --out $(REHEARSAL_DIR)

# The same for Gemma-4-E2B at one NeuronCore and at two (docs/models.md, docs/full-size.md); not part of .ci/run.
E2B_REHEARSAL_DIR ?= /tmp/rehearse-e2b
rehearse-e2b: $(VENV)/.installed
	$(PY) bench/rehearse_e4b.py --model e2b --out $(E2B_REHEARSAL_DIR)

# Every test marked slow: the rehearsal, and the checks that take a minute or more each (the same bytes from two
# checkouts, DVC through a compiler upgrade, interrupted traces, rebuilds compared with what was published).
# `make test` plus `make test-slow` is `make test-full`; CI runs them as two steps.
test-slow: $(VENV)/.installed
	$(PY) -m pytest -q -m slow -p no:cacheprovider $(XDIST)

test-full: $(VENV)/.installed
	$(PY) -m pytest -q -m "" $(XDIST)

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check pipeline tests bench hydra_plugins

dvc-demo: $(VENV)/.installed
	. $(VENV)/bin/activate && dvc repro
	@. $(VENV)/bin/activate && if [ -z "$$(dvc remote default 2>/dev/null)" ]; then \
		echo "dvc-demo: no DVC remote is set, so dvc push has nowhere to go: the builds stay in .dvc/cache" \
			"(dvc remote add -d storage s3://BUCKET/PATH adds one: docs/rebuilds.md)"; fi

clean-artifacts:
	rm -rf artifacts
