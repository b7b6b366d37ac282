#!/usr/bin/env bash
# The GPU acceptance suite (tests/gpu): every script under its own launcher on this machine's NVIDIA GPUs, NCCL,
# fp16/bf16, channels-last, SyncBatchNorm, two ranks on one GPU, checkpoints across devices, every torchvision
# model. Runs with the Python on PATH (or $PYTHON) and the torch already installed there (torch >= 2.9 with
# CUDA, torchvision, tensorboard, pytest, psutil); it installs nothing. scripts/gpu_suite.py runs the cases as
# concurrent pytest processes (--jobs, default half the cores, at most 8) and ends with one line:
# "test_gpu: N passed, M failed, K skipped in X s". Other arguments go to pytest.
#
#   bash scripts/test_gpu.sh                      # one GPU or more; cases for two GPUs skip on one
#   bash scripts/test_gpu.sh --time-limit 540     # interrupt what still runs after 540 s, and count it "not run"
#   bash scripts/test_gpu.sh --shard 1/2          # half of the cases (then --shard 2/2), e.g. one call each
#   bash scripts/test_gpu.sh --jobs 1             # one pytest process
#   bash scripts/test_gpu.sh -k resume -x         # pytest arguments pass through
#   bash scripts/test_gpu.sh tests/gpu/test_models.py
#   PYTHON=.venv/bin/python bash scripts/test_gpu.sh
#   GPU_SUITE_ON_CPU=1 bash scripts/test_gpu.sh   # the suite's own code on the CPU (gloo, bf16; CUDA-only cases skip)
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$(command -v python3 || command -v python || true)}
if [ -z "$PYTHON" ]; then
    echo "test_gpu: no python3 or python on PATH: set PYTHON=/path/to/python (one with torch built for CUDA)" >&2
    exit 1
fi
# the time printed at the end counts from here, on the clock gpu_suite.py reads (the system's monotonic clock)
GPU_SUITE_T0=$("$PYTHON" -c "import time; print(time.monotonic())")
# one line saying why this machine cannot run the suite, or what it runs on
status=$("$PYTHON" - 2>&1 <<'EOF'
import importlib.util, os, re, sys, warnings
where = f"with {sys.executable}"
try:
    import torch
except Exception as e:
    reason = str(e).strip().splitlines()[-1] if str(e).strip() else ""
    sys.exit(f"test_gpu: cannot import torch {where} ({type(e).__name__}: {reason}); "
             f"set PYTHON to a Python whose torch is built for CUDA")
version = tuple(int(x) for x in re.findall(r"\d+", torch.__version__)[:2])
if version < (2, 9):
    sys.exit(f"test_gpu: torch {torch.__version__} {where} is older than 2.9, the oldest the scripts support "
             f"(requirements.txt)")
needed = ("torchvision", "tensorboard", "PIL", "pytest", "psutil")
missing = [m for m in needed if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"test_gpu: {', '.join(missing)} missing {where}: pip install -r requirements-test.txt "
             f"(keeps the installed torch)")
if os.environ.get("GPU_SUITE_ON_CPU") == "1":
    print(f"test_gpu: GPU_SUITE_ON_CPU=1: the suite on the CPU, torch {torch.__version__} {where}")
    sys.exit(0)
with warnings.catch_warnings(record=True) as caught:  # e.g. "CUDA initialization: The NVIDIA driver ... is too old"
    warnings.simplefilter("always")
    available = torch.cuda.is_available()
if not available:
    why = " ".join(str(caught[0].message).split())[:300] + "; " if caught else ""
    sys.exit(f"test_gpu: no GPU: CUDA is not available to torch {torch.__version__} {where} "
             f"({why}CUDA build: {torch.version.cuda or 'none'}); this suite needs an NVIDIA GPU "
             f"(on CPU: bash scripts/test.sh)")
names = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
print(f"test_gpu: {torch.cuda.device_count()} GPU(s) ({', '.join(names)}), torch {torch.__version__}, "
      f"CUDA {torch.version.cuda} {where}")
EOF
)
code=$?
if [ $code -ne 0 ]; then
    # the one line (a Python that crashed outright prints more: its last line says why)
    echo "${status##*$'\n'}" >&2
    exit 1
fi
echo "$status"
GPU_SUITE=1 GPU_SUITE_T0=$GPU_SUITE_T0 exec "$PYTHON" scripts/gpu_suite.py "$@"
