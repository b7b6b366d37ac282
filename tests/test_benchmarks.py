"""The README's quickstart demo and benchmarks run as shown (tiny settings here; the numbers in the
README come from full runs)."""
import re
import sys

import pytest

from conftest import ROOT, Job, load, ok

# script and arguments: what each prints when it works
BENCHMARKS = {
    "input_pipeline.py": (["--limit", "6", "--seconds", "0.2", "--rounds", "1", "--workers", "1"],
                          r"b / a = [\d.]+ \(target >= 1.8\)   b / c = [\d.]+ \(target >= 0.7\)"
                          r"[\s\S]*DataLoader with 1 worker[\s\S]*\nb / a = [\d.]+\n"),
    "loop_overhead.py": (["--steps", "3", "--rounds", "1"], r"\(2\) this repository.* ms/step  overhead +[-+][\d.]+%"),
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
    job = ok(Job(["bash", ROOT / "scripts" / "demo.sh", "--epochs", "1", "--dummy-size", "64", "--output-dir", tmp_path]),
             timeout=600)
    assert "world size 2" in job.output and load(tmp_path / "checkpoint.pth.tar")["epoch"] == 1
