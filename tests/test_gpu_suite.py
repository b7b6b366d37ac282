"""The GPU acceptance suite (tests/gpu, run by scripts/test_gpu.sh) as far as a machine without a GPU can check
it: the script refuses in one line, never with "0 passed"; every case collects, with the GPU's parameters and
with GPU_SUITE_ON_CPU=1; the CPU suite leaves it out; and its runner (scripts/gpu_suite.py) runs groups of cases
at the same time, counts them in one last line, fails when one fails, ends what runs when stopped and names the
cases it did not run, and cuts the cases into shards that together hold each once; and one real case of it passes
on the CPU against today's scripts."""
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

import torchvision

from conftest import ROOT

NO_GPU = {"CUDA_VISIBLE_DEVICES": ""}  # also on a machine that has one


def run(cmd, env=None, timeout=120):
    full = {k: v for k, v in os.environ.items() if k not in ("GPU_SUITE", "GPU_SUITE_ON_CPU")}
    return subprocess.run([str(c) for c in cmd], cwd=ROOT, env={**full, **(env or {})}, capture_output=True, text=True,
                          timeout=timeout)


def test_gpu_script_without_cuda_says_so_in_one_line_and_fails():
    done = run(["bash", "scripts/test_gpu.sh", "-x"], env={**NO_GPU, "PYTHON": sys.executable})
    output = (done.stdout + done.stderr).strip()
    assert done.returncode != 0 and len(output.splitlines()) == 1, output
    assert re.match(r"test_gpu: no GPU: CUDA is not available to torch \S+ with \S+python", output), output
    assert "passed" not in output


def test_gpu_script_without_torch_says_so_in_one_line_and_fails(tmp_path):
    fake = tmp_path / "torch"
    fake.mkdir()
    (fake / "__init__.py").write_text('raise ImportError("libcudart.so.12: cannot open shared object file")\n')
    done = run(["bash", "scripts/test_gpu.sh"], env={"PYTHON": sys.executable, "PYTHONPATH": tmp_path})
    output = (done.stdout + done.stderr).strip()
    assert done.returncode != 0 and len(output.splitlines()) == 1, output
    assert output.startswith("test_gpu: cannot import torch with ") and "libcudart.so.12" in output, output


def collect(*args, env=None):
    """`pytest --collect-only` started in the background; .result() waits and gives (process, collected ids)."""
    full = {k: v for k, v in os.environ.items() if k not in ("GPU_SUITE", "GPU_SUITE_ON_CPU")}
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
                            cwd=ROOT, env={**full, **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)

    def result():
        out = proc.communicate(timeout=120)[0]
        assert proc.returncode == 0 and "ERROR" not in out, out  # a module that fails to import: ERROR collecting
        return re.findall(r"^(tests/\S+::\S+)", out, re.M)

    return result


def test_the_gpu_suite_collects_every_case_and_the_cpu_suite_leaves_it_out():
    on_gpu, on_cpu = collect("tests/gpu", env={"GPU_SUITE": "1"}), collect("tests/gpu", env={"GPU_SUITE_ON_CPU": "1"})
    cpu_suite = collect("tests", "--ignore", "tests/test_gpu_suite.py")
    cases = on_gpu()
    models = {m[1] for m in (re.match(r".*test_models.py::\w+\[(.+)\]$", c) for c in cases) if m}
    assert models == set(torchvision.models.list_models(module=torchvision.models))  # every model, on a GPU
    files = {c.split("::")[0] for c in cases}
    names = ("launchers", "precision", "shared_gpu", "multi_gpu", "cross_device", "models")
    assert {f"tests/gpu/test_{name}.py" for name in names} <= files, files
    assert len(on_cpu()) > 40  # its own parameters (bf16 for fp16, a sample of models)
    suite = cpu_suite()
    assert suite and not [c for c in suite if c.startswith("tests/gpu/")]


# Loaded with -p by the runner's tests: the suite's cases keep their fixtures but do no work of their own; each
# writes its process id and waits until STUB_TOGETHER cases are running at once, the one whose name holds STUB_FAIL
# fails, and one whose name holds STUB_HANG announces itself and sleeps.
STUB = """
import os, time
from pathlib import Path

import pytest


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    folder, name = Path(os.environ["STUB_FOLDER"]), pyfuncitem.name
    if os.environ.get("STUB_HANG", "-") in name:
        (folder / "hanging").write_text(str(os.getpid()))
        time.sleep(600)
    (folder / f"{os.getpid()}.running").touch()
    deadline = time.monotonic() + 90
    while len(list(folder.glob("*.running"))) < int(os.environ.get("STUB_TOGETHER", 1)):
        assert time.monotonic() < deadline, "the other case never ran at the same time"
        time.sleep(0.1)
    assert os.environ.get("STUB_FAIL", "-") not in name, "failing on purpose"
    return True
"""
# two cases of the CPU's sample of models: cheap fixtures
TWO = ["-k", "squeezenet1_1 or shufflenet", "tests/gpu/test_models.py"]


def stubbed(tmp_path, **env):
    (tmp_path / "stub_cases.py").write_text(STUB)
    return {"GPU_SUITE_ON_CPU": "1", "PYTHON": sys.executable, "PYTHONPATH": tmp_path, "STUB_FOLDER": tmp_path,
            "TMPDIR": tmp_path, **env}  # TMPDIR: the runner's folder, which it keeps when a case fails


def test_runner_runs_groups_at_once_counts_them_and_fails_when_one_fails(tmp_path):
    done = run(["bash", "scripts/test_gpu.sh", "--jobs", "2", "-p", "stub_cases", *TWO],
               env=stubbed(tmp_path, STUB_TOGETHER="2", STUB_FAIL="shufflenet"), timeout=240)
    output = done.stdout + done.stderr
    assert done.returncode == 1, output
    assert len(list(tmp_path.glob("*.running"))) == 2, output  # two pytest processes, both running at once
    assert "test_gpu: 2 cases in 2 groups, 2 at a time" in output, output
    assert "AssertionError: failing on purpose" in output, output  # the failed group's log
    # (with CI set, pytest adds the failure's message to the line)
    assert re.search(r"^FAILED tests/gpu/test_models.py::\S+\[shufflenet_v2_x0_5\]( - .*)?$", output, re.M), output
    last = output.strip().splitlines()[-1]
    assert re.fullmatch(r"test_gpu: 1 passed, 1 failed, 0 skipped in \d+ s \(2 jobs, 2 groups\)", last), output


def test_runner_stopped_midway_ends_its_cases_and_counts_them_as_not_run(tmp_path):
    proc = subprocess.Popen([sys.executable, "scripts/gpu_suite.py", "--jobs", "1", "-p", "stub_cases", *TWO], cwd=ROOT,
                            env={**os.environ, "GPU_SUITE": "1", **{k: str(v) for k, v in stubbed(
                                tmp_path, STUB_HANG="squeezenet").items()}},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    hanging = tmp_path / "hanging"
    deadline = time.monotonic() + 120
    while not hanging.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert hanging.exists(), proc.communicate(timeout=60)[0] if proc.poll() is not None else "no case hangs"
    proc.send_signal(signal.SIGINT)  # as Ctrl-C; --time-limit ends the groups the same way
    output = proc.communicate(timeout=90)[0]
    assert proc.returncode == 1, output
    assert "stopped by signal 2" in output and not psutil.pid_exists(int(hanging.read_text())), output
    assert re.fullmatch(r"test_gpu: 1 passed, 0 failed, 0 skipped, 1 not run in \d+ s \(1 jobs, 1 groups\)",
                        output.strip().splitlines()[-1]), output
    rest = re.search(r"^test_gpu: the cases not run: bash scripts/test_gpu.sh \$\(cat (\S+)\)$", output, re.M)
    assert rest and re.fullmatch(r"tests/gpu/test_models.py::\S+\[squeezenet1_1\]\n", Path(rest[1]).read_text()), output


def test_a_real_case_of_the_gpu_suite_passes_on_the_cpu(tmp_path):
    """resnet18's case of test_models.py, not stubbed: the suite's code still fits the scripts. (When -e came to
    need weights, every model case failed, unseen until a GPU ran them.)"""
    done = run(["bash", "scripts/test_gpu.sh", "--jobs", "1", "-k", "resnet18", "tests/gpu/test_models.py"],
               env={"GPU_SUITE_ON_CPU": "1", "PYTHON": sys.executable, "TMPDIR": tmp_path}, timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert re.fullmatch(r"test_gpu: 1 passed, 0 failed, 0 skipped in \d+ s \(1 jobs, 1 groups\)",
                        output.strip().splitlines()[-1]), output


def test_runner_shards_hold_every_case_once(tmp_path):
    def listing(*args):
        return subprocess.Popen([sys.executable, "scripts/gpu_suite.py", "--list", "--jobs", "2", *args, "tests/gpu"],
                                cwd=ROOT, env={**os.environ, "GPU_SUITE": "1"}, stdout=subprocess.PIPE, text=True)

    def cases(proc):
        out = proc.communicate(timeout=120)[0]
        assert proc.returncode == 0, out
        groups = re.findall(r"^group \d+ \(expected \d+ s\): (.*)$", out, re.M)
        return [case for group in groups for case in group.split()]

    everything, first, second = listing(), listing("--shard", "1/2"), listing("--shard=2/2")
    everything, first, second = cases(everything), cases(first), cases(second)
    assert len(everything) > 100 and first and second
    assert sorted(first + second) == sorted(everything)
    bad = run([sys.executable, "scripts/gpu_suite.py", "--shard", "3/2"])
    assert bad.returncode == 2 and bad.stderr.startswith("test_gpu: --jobs takes 1 or more, --shard I/N"), bad.stderr
