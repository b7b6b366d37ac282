"""Every torchvision classification model takes training steps and an evaluation step on the GPU, at 224 px or the
size it takes, under bf16 autocast: distributed.py's own main_worker, called in this process for speed (--benchmark 1: a
warm-up step and a timed one on a batch already on the device, with the script's model, fused optimizer and
training step; -e: evaluation of two generated images through the script's loader and prefetcher)."""
import gc
import math
import re
import signal

import pytest
import torch
import torchvision

from conftest import import_script

from .harness import DEVICE, ON_CPU

MODELS = sorted(torchvision.models.list_models(module=torchvision.models))
# on the CPU, a sample: small models, the two with auxiliary classifiers, a fixed-size transformer
CPU_SAMPLE = ["alexnet", "efficientnet_b0", "googlenet", "inception_v3", "mobilenet_v3_small", "regnet_x_400mf",
              "resnet18", "shufflenet_v2_x0_5", "squeezenet1_1", "swin_t"]


@pytest.fixture(scope="module")
def script():
    return import_script("distributed.py")


def input_size(script, arch):
    """ImageNet's 224, unless the script's check of --crop-size (check_model) refuses it for `arch` and names the
    size the model takes (vit_* with the size built in, for one)."""
    check = getattr(script, "check_model", None)
    if check is None:
        return 224
    try:
        check(script.parse_args(["--dummy", "-a", arch, "--crop-size", "224"]))
    except script.UserError as e:
        named = re.search(r"use --crop-size (\d+)|use at least (\d+)|; (\d+) works", str(e))
        assert named, str(e)
        return int(next(size for size in named.groups() if size))
    return 224


@pytest.fixture
def in_process(monkeypatch):
    """main_worker in this process as in a single process started with python: no torchrun variables; the
    signal handlers it installs (preemption) are put back afterwards, and the GPU's memory freed."""
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    yield
    for sig, handler in handlers.items():
        signal.signal(sig, handler)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@pytest.mark.parametrize("arch", CPU_SAMPLE if ON_CPU else MODELS)
def test_every_model_trains_and_evaluates(arch, script, in_process, capsys, tmp_path):
    size = input_size(script, arch)
    common = ["--dummy", "--dummy-size", "8", "-a", arch, "-b", "2", "--crop-size", size, "--val-resize", size,
              "-j", "0", "--amp", "bf16", "--lr", "0.001", "--output-dir", tmp_path]
    script.main_worker(script.parse_args([str(a) for a in [*common, "--benchmark", "1"]]))
    script.main_worker(script.parse_args([str(a) for a in [*common, "-e"]]))
    out = capsys.readouterr().out
    assert f"device {DEVICE}" in out, out
    assert re.search(rf"^benchmark: \d+ img/s over 1 steps, 1 processes, global batch 2, {arch} at {size} px", out,
                     re.M), out
    val = re.search(r"^val: loss (\S+) acc1 .*images 2\)$", out, re.M)
    assert val and math.isfinite(float(val[1])), out
    assert not tmp_path.exists() or not any(tmp_path.iterdir())  # neither mode writes anything
