#!/usr/bin/env bash
# Fresh machine -> the whole test suite (launches the scripts for real on CPU; about 10 minutes on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
exec .venv/bin/python -m pytest tests "$@"
