"""What metric handling costs in a training loop: 2 processes on CPU with gloo, a small model.

    python benchmarks/loop_overhead.py        # starts itself under torchrun, 2 processes

Three loops over the same kind of step take turns:
  (0) no metrics at all
  (1) what many tutorials do: a barrier, then loss, acc@1 and acc@5 each all-reduced and read with
      .item(), every step
  (2) this repository: distributed.py's Metrics (running sums on the device, no sync), reduced once
      every --print-freq steps
Prints ms per step and the overhead of (1) and (2) over (0); the target for (2) is <= 2%.
"""
import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from input_pipeline import reference_script



def small_model(classes):
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(32, 64, 3, padding=1), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(), torch.nn.Linear(64, classes))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=200, help="steps per loop and round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--batch", type=int, default=32, help="per process")
    p.add_argument("--print-freq", type=int, default=10)
    args = p.parse_args()
    if "LOCAL_RANK" not in os.environ:
        torchrun = Path(sys.executable).with_name("torchrun")
        os.environ["OMP_NUM_THREADS"] = "1"
        os.execv(torchrun, [str(torchrun), "--standalone", "--nproc_per_node=2", __file__, *sys.argv[1:]])
    script = reference_script()  # the repository's Metrics, exactly as the scripts carry it
    dist.init_process_group("gloo")
    torch.manual_seed(dist.get_rank())
    model = torch.nn.parallel.DistributedDataParallel(small_model(100))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    images, target = torch.randn(args.batch, 3, 32, 32), torch.randint(100, (args.batch,))

    def step():
        output = model(images)
        loss = F.cross_entropy(output, target)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        return loss, output

    def plain():
        for _ in range(args.steps):
            step()

    def tutorial():
        for _ in range(args.steps):
            loss, output = step()
            dist.barrier()
            correct = script.accuracy(output.detach(), target).float() / target.numel()
            for value in (loss.detach(), correct[0], correct[1]):
                value = value.clone()
                dist.all_reduce(value)
                (value / dist.get_world_size()).item()

    def repository():
        metrics = script.Metrics(torch.device("cpu"))
        for i in range(args.steps):
            loss, output = step()
            metrics.update(loss.detach() * target.numel(), output, target)
            if (i + 1) % args.print_freq == 0:
                metrics.summary()

    loops = {"(0) no metrics": plain, "(1) tutorial: barrier + 3 x all_reduce + .item()": tutorial,
             "(2) this repository: device sums, reduced every -p": repository}
    times = {name: [] for name in loops}
    plain()  # warm-up
    for _ in range(args.rounds):
        for name, loop in loops.items():
            dist.barrier()
            start = time.perf_counter()
            loop()
            times[name].append((time.perf_counter() - start) / args.steps * 1000)
    if dist.get_rank() == 0:
        base = statistics.median(times["(0) no metrics"])
        print(f"2 processes, gloo, CPU, batch {args.batch} per process, "
              f"{args.steps} steps x {args.rounds} rounds (medians)")
        for name, values in times.items():
            ms = statistics.median(values)
            print(f"{name:52s} {ms:7.2f} ms/step  overhead {100 * (ms - base) / base:+6.1f}%")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
