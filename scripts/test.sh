#!/usr/bin/env bash
# Fresh machine -> the tests, which launch the scripts for real on CPU (plus about 6 minutes the first time, to build
# Horovod). Other arguments pass through to pytest.
#
#   bash scripts/test.sh                 # the whole suite on 2 pytest-xdist workers: 40 to 60 minutes on 2 cores
#   bash scripts/test.sh --quick         # the quick tier (pytest -m quick), after each edit: 2 to 3 minutes
#   bash scripts/test.sh -k bad_input    # pytest arguments pass through; -n 0 runs the tests one by one
#
# The workers: 2, or 1 on a machine with one core (each test's jobs run 2 processes or more). --dist loadgroup keeps
# each xdist_group on one worker (tests/conftest.py's pytest_configure says why).
set -euo pipefail
cd "$(dirname "$0")/.."
tier=()
if [ "${1:-}" = --quick ]; then
    tier=(-m quick)
    shift
fi
bash scripts/setup.sh --test
cores=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)  # nproc obeys OMP_NUM_THREADS=1
exec .venv/bin/python -m pytest tests -n "$(( cores < 2 ? 1 : 2 ))" --dist loadgroup ${tier[@]+"${tier[@]}"} "$@"
