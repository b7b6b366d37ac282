"""The CPU takes the GPU's path wherever torch allows, so that this suite tests what GPUs run: fused optimizers
(FSDP's SGD: foreach, torch has no fused SGD for sharded parameters), fp16 autocast with a GradScaler (loss scaling,
skipped steps, the scale in checkpoints, clipping after unscale_), apex's O1-O3 in float16, channels-last, in
every script under its own launcher. And what once took another path on CUDA: FSDP's loss in fp32, the preemption
group's timeout, apex's optimizer with apex installed."""
import datetime
import functools
import math
import sys
import types

import pytest
import torch
import torch.distributed as dist

from conftest import FAST, import_script, load, ok, python, spawn, torchrun
from test_horovod import horovodrun

# one run per script: fp16 (squeezenet: fp16's backward is slow on a CPU without fp16 arithmetic, resnet18's some
# 50 times slower), channels-last, clipping after unscale_, loader workers
GPU_PATH = [*FAST, "--dummy", "--dummy-size", "32", "-a", "squeezenet1_1", "-b", "8", "-j", "2", "--epochs", "1",
            "--channels-last", "--clip-grad-norm", "1"]
FP16 = ["--amp", "fp16"]
RUNS = {
    "distributed.py": lambda *a: torchrun("distributed.py", 2, *FP16, *a),
    "multiprocessing_distributed.py": lambda *a: spawn("multiprocessing_distributed.py", 2, *FP16, *a),
    "distributed_slurm_main.py": lambda *a: python("distributed_slurm_main.py", "--procs-per-node", 2, *FP16, *a),
    "dataparallel.py adamw": lambda *a: python("dataparallel.py", *FP16, "--opt", "adamw", *a),
    "horovod_distributed.py": lambda *a: horovodrun(2, *FP16, *a),
    "apex_distributed.py O1": lambda *a: torchrun("apex_distributed.py", 2, "--opt-level", "O1", *a),
    "apex_distributed.py O2": lambda *a: torchrun("apex_distributed.py", 2, "--opt-level", "O2", *a),
    "apex_distributed.py O3": lambda *a: torchrun("apex_distributed.py", 2, "--opt-level", "O3", *a),
    "fsdp_distributed.py sgd": lambda *a: torchrun("fsdp_distributed.py", 2, *FP16, *a),
    "fsdp_distributed.py adamw": lambda *a: torchrun("fsdp_distributed.py", 2, *FP16, "--opt", "adamw", *a),
}


# the quick tier (bash scripts/test.sh --quick) launches every script once under its own launcher: these runs; srun,
# with test_distributed_slurm_main.py's; unet3d_apex.py, with test_shutdown.py's
QUICK = {"distributed.py", "multiprocessing_distributed.py", "dataparallel.py adamw", "horovod_distributed.py",
         "apex_distributed.py O2", "fsdp_distributed.py sgd"}


@pytest.mark.parametrize("run", [pytest.param(run, marks=[pytest.mark.quick] if run in QUICK else []) for run in RUNS])
def test_every_script_trains_on_the_gpus_path_on_the_cpu(run, tmp_path):
    """fp16 with loss scaling, a fused optimizer, channels-last and clipping, as a GPU run makes them. FSDP crashed
    here on every GPU: fused SGD over DTensors, ShardedGradScaler's inf check with fused AdamW, channels-last
    weights that fully_shard refuses."""
    if run.startswith("horovod"):
        pytest.importorskip("horovod.torch")
    job = ok(RUNS[run](*GPU_PATH, "--output-dir", tmp_path), timeout=240)
    assert "Epoch 0: train loss" in job.output, job.output
    if run.startswith("fsdp"):
        return  # its checkpoint is a folder of shards: test_fsdp_step_runs_fused_or_foreach below looks at its step
    ckpt = load(tmp_path / "checkpoint.pth.tar")
    scaled = not run.endswith("O3")  # O3: pure half, no loss scaling (as apex's)
    assert (ckpt["scaler"].get("scale", 0) > 0) == scaled, ckpt["scaler"]
    group = ckpt["optimizer"]["param_groups"][0]
    assert group["fused"], group  # SGD with a scaled loss too: its momentum starts as zeros (build_optimizer)


def args_for(module, *argv):
    return module.parse_args(["--dummy", *argv])


def fsdp_step(opt, amp):
    """One training step of a sharded model (a one-process group) through the script's own pieces, fp16's gradients
    overflowing: (optimizer, scaler, weights before, weights after)."""
    fsdp = import_script("fsdp_distributed.py")
    args = args_for(fsdp, "--opt", opt, "--amp", amp, "--clip-grad-norm", "1", "--channels-last")
    model = fsdp.prepare_model(torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten(),
                                                   torch.nn.Linear(4 * 6 * 6, 3)), args, torch.device("cpu"), print)
    optimizer = fsdp.build_optimizer(model, args, torch.device("cpu"), print)
    _, scaler = fsdp.setup_precision(model, optimizer, args, torch.device("cpu"), print)
    images = torch.randn(4, 3, 8, 8).contiguous(memory_format=torch.channels_last)
    output = model(images)
    assert output.dtype == torch.float32  # the loss in fp32, as autocast gives it; fp16 logits overflowed it
    before = [p.full_tensor().clone() for p in model.parameters()]
    scaler.scale(torch.nn.functional.cross_entropy(output, torch.tensor([0, 1, 2, 0]))).backward()
    if scaler.is_enabled():  # an overflow for certain, whatever these inputs gave: one shard's gradient inf
        next(model.parameters()).grad.to_local().view(-1)[0] = float("inf")
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(list(model.parameters()), 1.0)
    scaler.step(optimizer)
    scaler.update()
    return optimizer, scaler, before, [p.full_tensor() for p in model.parameters()]


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
@pytest.mark.parametrize("amp", ["fp16", "bf16"])
def test_fsdp_step_runs_fused_or_foreach(opt, amp, process_group):
    """torch has fused AdamW for DTensors, not fused SGD (no sharding rule: every GPU run crashed at its first step):
    SGD takes the foreach path. fp16's GradScaler finds the overflow and skips the step on the sharded
    gradients (clipping unscaled them first); bf16 steps."""
    optimizer, scaler, before, after = fsdp_step(opt, amp)
    group = optimizer.param_groups[0]
    assert (group["fused"], bool(group["foreach"])) == ((False, True) if opt == "sgd" else (True, False))
    moved = any(not torch.equal(a, b) for a, b in zip(before, after))
    assert moved == (amp == "bf16")
    assert scaler.is_enabled() == (amp == "fp16") and scaler.get_scale() == (2.0 ** 15 if amp == "fp16" else 1.0)


def scaled_steps(optimizer, model):
    """Four fp16 steps with a GradScaler, the first two of them skipped (their gradients overflow fp16 at the scale
    of 2^16 and 2^15): the weights after, the scale, and the optimizer's state after the skipped steps."""
    scaler, skipped = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16), None
    for step, size in enumerate((1e4, 1e4, 1.0, 1.0)):
        if step == 2:
            skipped = {key: value.clone() for state in optimizer.state.values() for key, value in state.items()}
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(torch.full((2, 4), size)).float().square().sum()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
    return model.weight.detach(), scaler.get_scale(), skipped


class UnfilledIsNaN:
    """torch, whose empty_like gives NaNs: memory as a busy GPU may hand it out, where the CPU's is mostly zeros."""

    def __getattr__(self, name):
        return (lambda t, **kw: torch.full_like(t, math.nan, **kw)) if name == "empty_like" else getattr(torch, name)


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_skipped_fp16_steps_leave_the_optimizer_as_if_they_never_were(opt, monkeypatch):
    """The optimizer of every script with --amp fp16, fused (no .item() in GradScaler's step), against torch's plain
    for-loop one. torch's fused SGD (on GPUs too) skips the step but, on the first, makes its momentum buffer
    without filling it (whatever memory it got: another tensor's values on a busy GPU), which the next steps took
    up: the script's starts as zeros. Fused AdamW skips it whole."""
    module = import_script("distributed.py")
    args = args_for(module, "--opt", opt, "--amp", "fp16", "--lr", "0.1")
    models = [torch.nn.Linear(4, 2) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    optimizer = module.build_optimizer(models[0], args, torch.device("cpu"), print)
    monkeypatch.setattr(sys.modules["torch.optim.sgd"], "torch", UnfilledIsNaN())  # fused SGD's buffer, if made
    ours = scaled_steps(optimizer, models[0])
    assert optimizer.param_groups[0]["fused"]
    kind = torch.optim.AdamW if opt == "adamw" else functools.partial(torch.optim.SGD, momentum=0.9)
    plain = scaled_steps(kind(models[1].parameters(), lr=0.1, weight_decay=1e-4, foreach=False), models[1])
    assert ours[1] == plain[1] <= 2.0 ** 14  # two skipped steps at least
    # nothing of a skipped step stays: no momentum for the next step to take up; AdamW's moments and count at 0
    assert not any(value.any() for value in ours[2].values()), ours[2]
    assert torch.allclose(ours[0], plain[0], rtol=1e-5, atol=1e-6), (ours, plain)


def test_the_preemption_group_waits_dist_timeout():
    """With NCCL the processes agree on preemption in a gloo group of their own: it must wait --dist-timeout, not
    torch's 30 minutes (a long checkpoint write then ended the run as "a rank stopped answering"). "cpu:gloo" makes
    that second group on a CPU."""
    module = import_script("distributed.py")
    args = args_for(module, "--dist-backend", "cpu:gloo", "--dist-timeout", "77")
    group = module.join_process_group(args, dist.HashStore(), 0, 1, torch.device("cpu"))
    try:
        assert group is not dist.group.WORLD
        assert group._get_backend(torch.device("cpu")).options._timeout == datetime.timedelta(seconds=77)
    finally:
        dist.destroy_process_group()


def test_apex_installed_still_steps_with_torchs_fused_sgd(monkeypatch):
    """apex's FusedSGD lacks _step_supports_amp_scaling: GradScaler read its inf check with .item(), a wait for the
    GPU every step. With apex importable the script still builds torch's fused SGD."""
    class FusedSGD(torch.optim.SGD):  # apex's, as GradScaler sees it
        pass

    monkeypatch.setitem(sys.modules, "apex", types.ModuleType("apex"))
    monkeypatch.setitem(sys.modules, "apex.optimizers", types.SimpleNamespace(FusedSGD=FusedSGD))
    monkeypatch.setitem(sys.modules, "amp_C", types.ModuleType("amp_C"))
    module = import_script("apex_distributed.py")
    args = args_for(module, "--opt-level", "O2", "--half-dtype", "bfloat16")  # no loss scaling: fused SGD
    optimizer = module.build_optimizer(torch.nn.Linear(4, 2), args, torch.device("cuda"), print)
    assert type(optimizer) is torch.optim.SGD and optimizer._step_supports_amp_scaling
