#!/usr/bin/env bash
# Fresh machine -> a short DDP training on synthetic data: all GPUs if there are any, else 2 CPU processes.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
NPROC=$(.venv/bin/python -c "import torch; print(torch.cuda.device_count() or 2)")
if [ "$(.venv/bin/python -c 'import torch; print(torch.cuda.is_available())')" = True ]; then
    ARGS="--dummy --dummy-size 25600 --epochs 3 -b $((64 * NPROC)) --lr 0.1"
else
    ARGS="--dummy --dummy-size 1024 --epochs 3 --crop-size 32 --val-resize 40 -b 32 --lr 0.02 -j 1"
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
rm -rf output/demo  # a fresh demo each time (a run never overwrites another's checkpoint)
# shellcheck disable=SC2086
exec .venv/bin/torchrun --standalone --nproc_per_node="$NPROC" distributed.py $ARGS --output-dir output/demo "$@"
