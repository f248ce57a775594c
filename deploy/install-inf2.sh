#!/bin/sh
# Install the pipeline on an inf2 host: the one command docs/inf2-host.md gives and .github/workflows/rebuild.yml runs.
# Every file it installs is checked against a sha256 in deploy/lock/, and each comes from one source:
#   0. before anything is installed, the Neuron release's lock is made when it is missing: resolved against the base
#      lock as dry runs, so a release the base lock cannot hold (a Neuron package pinning numpy<2 against its
#      numpy==2.2.6) stops here with both pins named and nothing installed (pipeline/cli/install_neuron.py
#      --lock-only, run from this checkout with pip's own vendored `packaging`: the environment holds only pip yet);
#   1. the base lock (deploy/lock/inf2-base.txt, `make lock`), from PyPI: the pipeline's dependencies, torch 2.8.0
#      and transformers 5.13.0 among them (pip install --require-hashes: exactly these files, nothing resolved);
#   2. the pipeline itself, editable, adding nothing (--no-deps; setuptools is in the base lock: no build isolation);
#   3. the Neuron SDK release from its own lock, every file by URL and sha256, no index asked at all
#      (python -m pipeline install-neuron; a missing lock is made from the Neuron repository alone for every name it
#      serves, so a higher upload of a Neuron-only name elsewhere cannot win: commit the lock it writes).
# Settings (environment): PYTHON (python3), VENV (.venv), PUBLIC_INDEX (https://pypi.org/simple), NEURON_INDEX
# (https://pip.repos.neuron.amazonaws.com), NEURON_RELEASE (default: the tested release), BASE_LOCK, LOCK_DIR
# (deploy/lock). An existing VENV is reused: the locks are installed into it again (a no-op when nothing changed).
set -eu
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
PUBLIC_INDEX=${PUBLIC_INDEX:-https://pypi.org/simple}
NEURON_INDEX=${NEURON_INDEX:-https://pip.repos.neuron.amazonaws.com}
BASE_LOCK=${BASE_LOCK:-deploy/lock/inf2-base.txt}
LOCK_DIR=${LOCK_DIR:-deploy/lock}

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
VENDORED=$("$VENV/bin/python" -c 'import os, pip; print(os.path.join(os.path.dirname(pip.__file__), "_vendor"))')
# shellcheck disable=SC2086
PYTHONPATH="$PWD:$VENDORED" "$VENV/bin/python" -m pipeline.cli.install_neuron --lock-only \
    --neuron-index "$NEURON_INDEX" --base-lock "$BASE_LOCK" --lock-dir "$LOCK_DIR" \
    ${NEURON_RELEASE:+--release "$NEURON_RELEASE"}
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --require-hashes --no-deps \
    --index-url "$PUBLIC_INDEX" -r "$BASE_LOCK"
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .
# shellcheck disable=SC2086
"$VENV/bin/python" -m pipeline install-neuron --neuron-index "$NEURON_INDEX" --base-lock "$BASE_LOCK" \
    --lock-dir "$LOCK_DIR" ${NEURON_RELEASE:+--release "$NEURON_RELEASE"}
