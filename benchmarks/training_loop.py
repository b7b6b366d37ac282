"""What each flag of the training loop costs or gains, side by side in one run: `distributed.py --benchmark N`
(synthetic batches already on the device: the model, the optimizer step and the all-reduce, no input
pipeline) once per variant, each in a fresh process, the variants taking turns for --rounds rounds.

    python benchmarks/training_loop.py                  # the first GPU: resnet50, 224 px, batch 128, fp32
    python benchmarks/training_loop.py --nproc 8        # torchrun, 8 processes, the global batch -b
    python benchmarks/training_loop.py --allow-cpu -a resnet18 --crop-size 32 -b 16 --steps 4 \
        --variants baseline clip ema                    # CPU smoke run of the same code

Variants: the defaults (TF32 on where the GPU has it), --no-tf32, --compile, --grad-accum-steps 2,
--clip-grad-norm 1, --model-ema, and all of the loop's flags at once (without --compile). fp32 by default,
where TF32 matters; --amp bf16 to measure under autocast. Prints the median img/s of each and its ratio to
the defaults'.
"""
import argparse
import platform
import re
import statistics
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {"baseline": [], "no-tf32": ["--no-tf32"], "compile": ["--compile"],
            "grad-accum-2": ["--grad-accum-steps", "2"], "clip": ["--clip-grad-norm", "1"], "ema": ["--model-ema"],
            "all-loop-flags": ["--grad-accum-steps", "2", "--clip-grad-norm", "1", "--label-smoothing", "0.1",
                               "--model-ema"]}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("-a", "--arch", default="resnet50")
    p.add_argument("--crop-size", type=int, default=224)
    p.add_argument("-b", "--batch-size", type=int, default=128, help="global batch")
    p.add_argument("--amp", choices=("none", "fp16", "bf16"), default="none")
    p.add_argument("--steps", type=int, default=50, help="timed steps per run (after a tenth as many of warm-up)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--nproc", type=int, default=1, help="processes (more than 1: under torchrun)")
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    p.add_argument("--allow-cpu", action="store_true", help="run on the CPU when there is no GPU (a smoke run)")
    return p.parse_args()


def img_per_s(args, flags):
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}"]
                if args.nproc > 1 else [sys.executable])
    cmd = [*launcher, str(ROOT / "distributed.py"), "--benchmark", str(args.steps), "-a", args.arch,
           "--crop-size", str(args.crop_size), "-b", str(args.batch_size), "--amp", args.amp, *flags]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    found = re.search(r"^benchmark: (\d+) img/s", done.stdout, re.M)
    if done.returncode or not found:
        output = (done.stdout + done.stderr)[-2000:]
        sys.exit(f"training_loop: {' '.join(cmd)} failed (exit {done.returncode}):\n{output}")
    return int(found[1])


def main():
    args = parse_args()
    if not torch.cuda.is_available() and not args.allow_cpu:
        sys.exit("training_loop: CUDA is not available: run on a machine with an NVIDIA GPU, or pass --allow-cpu "
                 "for a smoke run on the CPU")
    runs = {name: [] for name in args.variants}
    for _ in range(args.rounds):
        for name in args.variants:
            runs[name].append(img_per_s(args, VARIANTS[name]))
            print(f"{name}: {runs[name][-1]} img/s", flush=True)  # as it goes: a run cut short still shows these
    base = statistics.median(runs["baseline"]) if "baseline" in runs else None
    print(f"{'variant':<16} {'img/s':>8} {'x baseline':>11}   flags")
    for name, values in runs.items():
        ratio = f"{statistics.median(values) / base:.2f}" if base else "-"
        print(f"{name:<16} {statistics.median(values):>8.0f} {ratio:>11}   {' '.join(VARIANTS[name]) or '(defaults)'}")
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"CPU ({platform.processor() or 'cpu'})"
    print(f"machine: {device}, torch {torch.__version__}, {args.nproc} process(es), {args.arch} at {args.crop_size} "
          f"px, global batch {args.batch_size}, --amp {args.amp}, {args.steps} steps x {args.rounds} rounds")


if __name__ == "__main__":
    main()
