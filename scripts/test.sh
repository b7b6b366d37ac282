#!/usr/bin/env bash
# Fresh machine -> the whole test suite (launches the scripts for real on CPU; about 40 minutes on 2 cores,
# plus about 6 minutes the first time, to build Horovod).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
exec .venv/bin/python -m pytest tests "$@"
