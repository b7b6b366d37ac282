"""The README's quickstart demo and benchmarks run as shown (tiny settings here; the numbers in the
README come from full runs)."""
import json
import re
import sys

import pytest

from conftest import ROOT, Job, load, ok

# script and arguments: what each prints when it works
BENCHMARKS = {
    "input_pipeline.py": (["--limit", "6", "--seconds", "0.2", "--rounds", "1", "--workers", "1"],
                          r"b / a = [\d.]+ \(target >= 1.8\)   b / c = [\d.]+ \(target >= 0.7\)\n"
                          r"torchcodec: c / d = [\d.]+ of torchvision.io's speed, c / e = [\d.]+ of PIL's"
                          r"[\s\S]*DataLoader with 1 worker[\s\S]*\nb / a = [\d.]+\n"),
    "loop_overhead.py": (["--steps", "3", "--rounds", "1"], r"\(2\) this repository.* ms/step  overhead +[-+][\d.]+%"),
    "training_loop.py": (["--allow-cpu", "-a", "resnet18", "--crop-size", "32", "-b", "16", "--steps", "2",
                          "--rounds", "1", "--variants", "baseline", "all-loop-flags"],
                         r"\nall-loop-flags +\d+ +[\d.]+ +--grad-accum-steps 2 .*\nmachine: "),
    "memory.py": (["-a", "resnet50", "--crop-size", "32", "--steps", "1"],
                  r"\nfsdp_distributed.py +\d+ +0\.[45]\d [\s\S]*\nmodel state FSDP / DDP = 0\.[45]\d \(target <= 0.6"),
    "scaling.py": (["--steps", "2", "--dummy-size", "32", "--crop-size", "32", "-b", "16"],
                   r"\n +2 +\d+ +\d+% +\d+ +\d+%"),
}


@pytest.mark.parametrize("name", BENCHMARKS)
def test_benchmark_runs_and_reports(name):
    args, expected = BENCHMARKS[name]
    job = ok(Job([sys.executable, ROOT / "benchmarks" / name, *args]), timeout=600)
    assert re.search(expected, job.output), job.output


def test_quickstart_demo_trains(tmp_path):
    """bash scripts/demo.sh, shortened through the arguments it passes on to distributed.py."""
    job = ok(Job(["bash", ROOT / "scripts" / "demo.sh", "--epochs", "1", "--dummy-size", "64",
                  "--output-dir", tmp_path]),
             timeout=600)
    assert "world size 2" in job.output and load(tmp_path / "checkpoint.pth.tar")["epoch"] == 1


GPU_THROUGHPUT = ROOT / "benchmarks" / "gpu_throughput.py"


def test_gpu_throughput_runs_on_cpu_when_allowed(tmp_path):
    """The whole comparison, (a) distributed.py --benchmark, (b) distributed.py on JPEGs, (c) the
    pytorch/examples way, (d) (b)'s step on JPEGs decoded in the training process, on the CPU with tiny settings:
    every run measures the same images."""
    job = ok(Job([sys.executable, GPU_THROUGHPUT, "--allow-cpu", "-a", "resnet18", "--crop-size", "32", "-b", "4",
                  "--jpegs", "12", "--steps", "2", "-p", "1", "--workers", "1", "--lr", "0.01",
                  "--out", tmp_path / "results.json"]), timeout=300)
    assert re.search(r"\nb / a = [\d.]+ with 1 workers \(target >= 0.9 with all \d+ cores\)\n"
                     r"b / c = [\d.]+ with 1 workers \(target >= 1.3 with 4\)\n"
                     r"d / b = [\d.]+ with 1 workers \(decoding on the GPU over the workers'\)\n",
                     job.output), job.output
    for row in (r"\(a\) distributed.py --benchmark .* - +\d+ +-", r"\(b\) distributed.py on the JPEGs +1 +\d+ +\d+",
                r"\(c\) pytorch/examples way +1 +\d+ +\d+", r"\(d\) decoded on the GPU, \(b\)'s step +1 +\d+",
                r"machine: CPU .* torch .* \d+ CPUs"):
        assert re.search(row, job.output), (row, job.output)
    results = json.loads((tmp_path / "results.json").read_text())
    assert [(r["run"], r["workers"]) for r in results["runs"]] == [("a", None), ("b", 1), ("c", 1), ("d", 1)]
    assert all(r["img_per_s"] > 0 and r["images"] == 2 * 4 for r in results["runs"]), results["runs"]
    a, b, c, d = (r["img_per_s"] for r in results["runs"])
    assert results["ratios"] == [{"workers": 1, "b/a": pytest.approx(b / a), "b/c": pytest.approx(b / c),
                                  "d/b": pytest.approx(d / b)}]


def test_gpu_throughput_without_cuda_says_so():
    """No GPU and no --allow-cpu: one line that says why, a non-zero exit, nothing run."""
    job = Job([sys.executable, GPU_THROUGHPUT], env={"CUDA_VISIBLE_DEVICES": ""}).finish(120)
    assert job.returncode != 0
    lines = job.output.strip().splitlines()
    assert len(lines) == 1 and "CUDA" in lines[0] and "--allow-cpu" in lines[0], job.output
