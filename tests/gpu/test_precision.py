"""Mixed precision and memory format on one GPU: --amp fp16 (GradScaler) and bf16, --channels-last, apex's opt
levels O0-O3, resuming an fp16 run exactly, resuming a checkpoint without loss scaling under --amp fp16, and
--deterministic with a model whose backward has no deterministic CUDA kernel."""
import shutil

import pytest
import torch

from conftest import (EPOCHS, FAST, LAUNCHER_FAILED, RESUME, assert_learned, assert_preempted, assert_same_run, metrics,
                      ok, torchrun)

from .harness import (APEX, DATAPARALLEL, DEVICE, DISTRIBUTED, FP16, HALF, HOROVOD, NCCL, ON_CPU, SLURM, SPAWN,
                      assert_scaler, assert_trains, checkpoint_of, horovod_missing, launch, preempt, preempt_line,
                      signal_target)


def test_fp16_learns_and_saves_its_loss_scale(fp16_reference):
    job, out = fp16_reference
    assert f"world size 1, device {DEVICE}, backend {NCCL}" in job.output
    assert_scaler(assert_learned(out, EPOCHS), fp16=True)


def test_fp16_run_resumes_bit_for_bit_after_sigterm(image_data, tmp_path, fp16_reference):
    """The GradScaler's state (scale, growth tracker) is part of the checkpoint, so the resumed run skips and
    scales the same steps as the uninterrupted one."""
    args = [image_data, *RESUME, "--amp", FP16, "--epochs", EPOCHS, "--output-dir", tmp_path]
    job = torchrun(DISTRIBUTED, 1, *args)
    preempt(job, signal_target(DISTRIBUTED, job), preempt_line(DISTRIBUTED))
    step = assert_preempted(job, tmp_path, code=LAUNCHER_FAILED)
    assert_scaler(checkpoint_of(tmp_path), fp16=True)
    resumed = ok(torchrun(DISTRIBUTED, 1, *args, "--resume", "auto"))
    assert f"(epoch 0, step {step})" in resumed.output
    assert_same_run(tmp_path, fp16_reference[1])


@pytest.mark.parametrize("flags", [["--amp", "bf16"], ["--channels-last"], ["--channels-last", "--amp", FP16]],
                         ids=["bf16", "channels-last", f"channels-last-{FP16}"])
def test_precision_and_memory_format_learn(flags, image_data, tmp_path):
    job = ok(torchrun(DISTRIBUTED, 1, image_data, *FAST, *flags, "--epochs", EPOCHS, "--output-dir", tmp_path))
    assert f"device {DEVICE}" in job.output
    assert_trains(tmp_path, EPOCHS, min_acc1=50)  # 4 classes: chance is 25%
    assert_scaler(checkpoint_of(tmp_path), fp16="fp16" in flags)


AMP = {APEX: ["--opt-level", "O1", "--half-dtype", HALF]}  # apex_distributed.py's --amp


@pytest.mark.parametrize("script", [DISTRIBUTED, SPAWN, DATAPARALLEL, APEX, HOROVOD, SLURM])
def test_a_checkpoint_without_loss_scaling_resumes_under_fp16(script, image_data, tmp_path, reference):
    """The scaler's state is empty in a checkpoint saved without fp16: it must not be restored into the enabled
    GradScaler of an fp16 run (distributed_slurm_main.py did, and crashed). One more epoch, in fp16."""
    if script == HOROVOD and (why := horovod_missing()):
        pytest.skip(why)
    shutil.copy(reference[1] / "checkpoint.pth.tar", tmp_path / "checkpoint.pth.tar")
    job = ok(launch(script, image_data, *FAST, *AMP.get(script, ["--amp", FP16]), "--epochs", EPOCHS + 1,
                    "--resume", "auto", "--output-dir", tmp_path))
    assert f"(epoch {EPOCHS}, step 0)" in job.output
    rows = metrics(tmp_path)
    assert [r["epoch"] for r in rows] == [EPOCHS] and rows[0]["train_loss"] == rows[0]["train_loss"], rows
    ckpt = checkpoint_of(tmp_path)
    assert ckpt["epoch"] == EPOCHS + 1
    assert_scaler(ckpt, fp16=True)


def test_an_fp16_checkpoint_resumes_without_amp(image_data, tmp_path, fp16_reference):
    shutil.copy(fp16_reference[1] / "checkpoint.pth.tar", tmp_path / "checkpoint.pth.tar")
    job = ok(torchrun(DISTRIBUTED, 1, image_data, *FAST, "--epochs", EPOCHS + 1, "--resume", "auto",
                      "--output-dir", tmp_path))
    assert f"(epoch {EPOCHS}, step 0)" in job.output
    assert [r["epoch"] for r in metrics(tmp_path)] == [EPOCHS]


def opt_level_line(level, half):
    """What apex_distributed.py says it does at `level` with --half-dtype `half` (float16 has loss scaling)."""
    scaling = "dynamic loss scaling" if level in ("O1", "O2") and half == "float16" else "no loss scaling"
    return {"O0": "opt level O0: fp32 throughout, no loss scaling",
            "O1": f"opt level O1: fp32 weights, autocast to {half}, {scaling}",
            "O2": f"opt level O2: {half} model, fp32 BatchNorm, fp32 master weights, {scaling}",
            "O3": f"opt level O3: pure {half} (weights, BatchNorm, optimizer state), no loss scaling"}[level]


# float16 on a GPU (bfloat16 on the CPU), and on a GPU also O3 in bfloat16, where apex's FusedSGD cannot serve
LEVELS = [(level, HALF) for level in ("O0", "O1", "O2", "O3")] + ([] if ON_CPU else [("O3", "bfloat16")])


@pytest.mark.parametrize("level, half", LEVELS, ids=[f"{level}-{half}" for level, half in LEVELS])
def test_apex_opt_levels(level, half, image_data, tmp_path):
    job = ok(torchrun(APEX, 1, image_data, *FAST, "--opt-level", level, "--half-dtype", half, "--epochs", 3,
                      "--channels-last", "--output-dir", tmp_path))
    assert opt_level_line(level, half) in job.output, job.output
    assert_trains(tmp_path, 3, min_acc1=None if level == "O3" else 50)
    ckpt = checkpoint_of(tmp_path)
    assert all(group["fused"] for group in ckpt["optimizer"]["param_groups"])  # torch's fused SGD at every level
    weights = {k: v for k, v in ckpt["state_dict"].items() if v.is_floating_point()}
    assert {v.dtype for v in weights.values()} == {torch.float32}  # fp32 at every level, loadable anywhere
    dtype = getattr(torch, half)
    if level == "O2":  # the fp32 master weights, not upcast half ones
        conv = weights["layer1.0.conv1.weight"]
        assert not torch.equal(conv, conv.to(dtype).float())
    if level == "O3":  # half throughout, BatchNorm too
        assert all(torch.equal(v, v.to(dtype).float()) for v in weights.values())
    assert_scaler(ckpt, fp16=level in ("O1", "O2") and half == "float16")


@pytest.mark.parametrize("arch, size", [("alexnet", 64), ("vgg11", 32)])
def test_deterministic_warns_where_cuda_has_no_deterministic_kernel(arch, size, image_data, tmp_path):
    """AdaptiveAvgPool2d to 6x6 / 7x7 has no deterministic CUDA backward: --deterministic warns and trains on."""
    job = ok(torchrun(DISTRIBUTED, 1, image_data, *FAST, "-a", arch, "--crop-size", size, "--val-resize",
                      size + size // 8, "--lr", "0.001", "--deterministic", "--epochs", 1, "--output-dir", tmp_path))
    if not ON_CPU:
        warning = "adaptive_avg_pool2d_backward_cuda does not have a deterministic implementation"
        assert warning in job.output, job.output
    assert len(metrics(tmp_path)) == 1 and checkpoint_of(tmp_path)["arch"] == arch
