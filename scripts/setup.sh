#!/usr/bin/env bash
# Creates .venv beside this repository and installs what the scripts (and, with --test, the tests) need.
# torch is installed at the version this repository is tested with unless one is already there;
# set TORCH_SPEC (e.g. "torch==2.5.1 torchvision==0.20.1 torchcodec==0.1.0") to choose another build (torchcodec:
# the release made for that torch; the scripts decode JPEGs with PIL, and say so, where it does not load).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@"; }
if ! .venv/bin/python -c "import torch, torchvision" 2>/dev/null; then
    echo "setup: installing ${TORCH_SPEC:=torch==2.14.1 torchvision==0.29.1 torchcodec==0.17.0} into .venv (about a minute from a local copy, longer from PyPI)"
    # shellcheck disable=SC2086
    pip install $TORCH_SPEC
fi
pip install -r requirements.txt
if [ "${1:-}" = "--test" ]; then  # the tests launch every script for real: Horovod too
    pip install -r requirements-test.txt
    bash scripts/install_horovod.sh
fi
