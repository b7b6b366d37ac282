"""The GPU acceptance suite (tests/gpu, run by scripts/test_gpu.sh) as far as a machine without a GPU can check
it: the script refuses in one line, never with "0 passed"; every case collects, with the GPU's parameters and
with GPU_SUITE_ON_CPU=1; and the CPU suite leaves it out."""
import os
import re
import subprocess
import sys

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
