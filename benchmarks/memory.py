"""Memory per process of DDP (distributed.py) and FSDP (fsdp_distributed.py), side by side in one run: each script's
`--benchmark N` with AdamW on the same model and global batch, each in a fresh torchrun job, reporting what a process
holds of the weights, their gradients and the optimizer state, and its peak memory.

    python benchmarks/memory.py                          # 2 processes on the CPU, vit_l_16 (304M parameters)
    python benchmarks/memory.py --device cuda --nproc 8  # a GPU node: GPU memory (torch.cuda.max_memory_allocated)
    python benchmarks/memory.py -a resnet50 --crop-size 32 --steps 1   # a quick run

Model state: parameters + gradients + AdamW's two moments, counted tensor by tensor (a sharded model's shards only):
about 16 bytes a parameter under DDP, 16/N under FSDP. Peak: on a GPU the allocator's high-water mark; on the CPU
the process's resident size, which also counts Python, torch and the whole model each rank builds before sharding.
Prints each ratio FSDP / DDP; the target for the model state at 2 processes is <= 0.6.
"""
import argparse
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
LINE = re.compile(r"model state (\d+) MiB, peak memory (\d+) MiB per process")
VARIANTS = {"distributed.py": ("distributed.py", []), "fsdp_distributed.py": ("fsdp_distributed.py", []),
            "  --no-reshard-after-forward": ("fsdp_distributed.py", ["--no-reshard-after-forward"])}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("-a", "--arch", default="vit_l_16")
    p.add_argument("--crop-size", type=int, default=224)
    p.add_argument("-b", "--batch-size", type=int, default=4, help="global batch")
    p.add_argument("--amp", choices=("none", "fp16", "bf16"), default="none")
    p.add_argument("--steps", type=int, default=2, help="optimizer steps per run (after one of warm-up)")
    p.add_argument("--nproc", type=int, default=2, help="processes, under torchrun")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    return p.parse_args()


def measure(args, script, flags):
    """(model state MiB, peak MiB) of rank 0 of `script --benchmark`."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
           str(ROOT / script), "--benchmark", str(args.steps), "--opt", "adamw", "-a", args.arch,
           "--crop-size", str(args.crop_size), "-b", str(args.batch_size), "--amp", args.amp, *flags]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           **({"CUDA_VISIBLE_DEVICES": ""} if args.device == "cpu" else {})}
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    found = LINE.search(done.stdout)
    if done.returncode or not found:
        sys.exit(f"memory: {' '.join(cmd)} failed (exit {done.returncode}):\n{(done.stdout + done.stderr)[-2000:]}")
    return int(found[1]), int(found[2])


def main():
    args = parse_args()
    if args.device == "cuda" and torch.cuda.device_count() < args.nproc:
        sys.exit(f"memory: --device cuda --nproc {args.nproc} needs {args.nproc} GPUs, {torch.cuda.device_count()} "
                 f"visible: lower --nproc, or --device cpu")
    results = {name: measure(args, *VARIANTS[name]) for name in VARIANTS}
    ddp_state, ddp_peak = results["distributed.py"]
    print(f"{'script':<30} {'model state MiB':>16} {'x DDP':>6} {'peak MiB':>10} {'x DDP':>6}")
    for name, (state, peak) in results.items():
        print(f"{name:<30} {state:>16} {state / ddp_state:>6.2f} {peak:>10} {peak / ddp_peak:>6.2f}")
    print(f"model state FSDP / DDP = {results['fsdp_distributed.py'][0] / ddp_state:.2f} (target <= 0.6 at 2 "
          f"processes, about 1/{args.nproc})")
    device = torch.cuda.get_device_name(0) if args.device == "cuda" else f"CPU ({platform.processor() or 'cpu'})"
    print(f"machine: {device}, torch {torch.__version__}, {args.nproc} processes, {args.arch} at {args.crop_size} px, "
          f"AdamW, global batch {args.batch_size}, --amp {args.amp}, {args.steps} steps")


if __name__ == "__main__":
    main()
