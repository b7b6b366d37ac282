"""Scaling of distributed.py from 1 to 2 processes on this machine (CPU, gloo), side by side.

    python benchmarks/scaling.py                 # resnet18 at 64 px, 1 and 2 processes
    python benchmarks/scaling.py --nprocs 1 2 4 --arch resnet50 --crop-size 224   # on a GPU node

For each process count, two runs under torchrun: --benchmark (synthetic batches already on the
device: model, optimizer step and gradient all-reduce only) and one epoch of --dummy training (the
whole pipeline: loader, prefetcher, metrics). Prints img/s and the scaling efficiency,
img/s(N) / (N x img/s(1)). On a CPU each process gets one thread (OMP_NUM_THREADS=1), so N
processes need N cores.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def torchrun(nprocs, *args):
    cmd = [str(Path(sys.executable).with_name("torchrun")), "--standalone", f"--nproc_per_node={nprocs}",
           str(ROOT / "distributed.py"), *map(str, args)]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode:
        sys.exit(f"failed: {' '.join(cmd)}\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return done.stdout


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nprocs", type=int, nargs="+", default=[1, 2])
    p.add_argument("--arch", default="resnet18")
    p.add_argument("--crop-size", type=int, default=64)
    p.add_argument("-b", "--batch-size", type=int, default=64, help="global batch (the same for every process count)")
    p.add_argument("--steps", type=int, default=40, help="--benchmark steps")
    p.add_argument("--dummy-size", type=int, default=1280, help="images in the one epoch of --dummy training")
    args = p.parse_args()
    common = ["-a", args.arch, "--crop-size", args.crop_size, "--val-resize", args.crop_size, "-b", args.batch_size,
              "-p", 10**6]
    rows = []
    for n in args.nprocs:
        out = torchrun(n, *common, "--benchmark", args.steps)
        model_only = float(re.search(r"benchmark: (\d+) img/s", out)[1])
        with tempfile.TemporaryDirectory() as tmp:
            torchrun(n, *common, "--dummy", "--dummy-size", args.dummy_size, "--epochs", 1, "-j", 0,
                     "--output-dir", tmp)
            pipeline = json.loads((Path(tmp) / "metrics.jsonl").read_text().splitlines()[-1])["img_per_s"]
        rows.append((n, model_only, pipeline))
    print(f"distributed.py, {args.arch} at {args.crop_size} px, global batch {args.batch_size}")
    print(f"{'processes':>9}  {'model img/s':>11}  {'efficiency':>10}  "
          f"{'whole pipeline img/s':>20}  {'efficiency':>10}")
    for n, model_only, pipeline in rows:
        print(f"{n:>9}  {model_only:>11.0f}  {model_only / (n * rows[0][1]):>10.0%}  {pipeline:>20.0f}  "
              f"{pipeline / (n * rows[0][2]):>10.0%}")


if __name__ == "__main__":
    main()
