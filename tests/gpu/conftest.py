"""Fixtures of the GPU acceptance suite: the runs that several tests compare with, each made once: once per pytest
session, or, under scripts/gpu_suite.py (concurrent pytest processes), once for all of them."""
import importlib

import pytest
import torch

from conftest import EPOCHS, RESUME, make_image_folder, ok, torchrun, two_nodes

from .harness import DISTRIBUTED, FP16, ON_CPU, UNET, args_of, launch, made_once, ok_all

def pytest_report_header(config):
    if ON_CPU:
        return "GPU suite on the CPU (GPU_SUITE_ON_CPU=1): gloo for NCCL, bf16 for fp16, CUDA-only cases skipped"
    if not torch.cuda.is_available():
        return "GPU suite: CUDA is not available"
    names = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    try:
        version = importlib.import_module("torch.cuda.nccl").version()
        nccl = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    except Exception as e:  # a build without NCCL
        nccl = f"unavailable ({type(e).__name__})"
    return (f"GPU suite: {torch.cuda.device_count()} GPU(s) ({names}), torch {torch.__version__}, "
            f"CUDA {torch.version.cuda}, NCCL {nccl}")


@pytest.fixture(scope="session", autouse=True)
def _cuda():
    if not ON_CPU and not torch.cuda.is_available():
        pytest.exit("tests/gpu needs CUDA: run bash scripts/test_gpu.sh on a machine with an NVIDIA GPU, or set "
                    "GPU_SUITE_ON_CPU=1 to run its code on the CPU", returncode=1)


@pytest.fixture(scope="session")
def image_data(tmp_path_factory):
    """The CPU suite's image folder (tests/conftest.py), the same one for every process of the suite."""
    return made_once("imagefolder", tmp_path_factory, make_image_folder)[1]


@pytest.fixture(scope="session")
def uninterrupted_on_gpu(image_data, tmp_path_factory):
    """uninterrupted_on_gpu(script): that script's run of EPOCHS epochs, deterministic, one process on the first
    GPU under its own launcher; made once. (job, output folder)."""
    runs = {}

    def run(script):
        if script not in runs:
            data = [] if script == UNET else [image_data]
            runs[script] = made_once(
                f"uninterrupted_{script.split('.')[0]}", tmp_path_factory,
                lambda out: ok(launch(script, *data, *args_of(script), "--epochs", EPOCHS, "--output-dir", out)))
        return runs[script]

    return run


@pytest.fixture(scope="session")
def reference(uninterrupted_on_gpu):
    """distributed.py under torchrun, one process on one GPU with NCCL: what every launcher must equal."""
    return uninterrupted_on_gpu(DISTRIBUTED)


@pytest.fixture(scope="session")
def shared_gpu_reference(image_data, tmp_path_factory):
    """distributed.py as two ranks sharing the first GPU (two torchrun agents, gloo over CUDA tensors),
    EPOCHS epochs, deterministic. (rank 0's job, output folder)."""
    return made_once("shared_gpu", tmp_path_factory, lambda out: ok_all(two_nodes(
        DISTRIBUTED, image_data, *RESUME, "--epochs", EPOCHS, "--dist-backend", "gloo", "--output-dir", out))[0])


@pytest.fixture(scope="session")
def fp16_reference(image_data, tmp_path_factory):
    """distributed.py --amp fp16 (bf16 on the CPU), one GPU, EPOCHS epochs, deterministic."""
    return made_once("fp16", tmp_path_factory, lambda out: ok(torchrun(
        DISTRIBUTED, 1, image_data, *RESUME, "--amp", FP16, "--epochs", EPOCHS, "--output-dir", out)))
