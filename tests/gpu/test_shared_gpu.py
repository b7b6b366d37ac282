"""Two ranks on one GPU, so that the multi-rank CUDA paths run on a machine of one GPU: two torchrun agents as two
nodes (torchrun takes LOCAL_RANK only below the GPU count), spawn likewise as two nodes, two srun tasks that see
the same GPU. Over gloo (CUDA tensors) they train: DDP, SyncBatchNorm, fp16 with its GradScaler, checkpoints and the
agreement on a preemption. Over NCCL, which cannot put two ranks on one GPU, they stop, in NCCL's words."""
import os
import re

import pytest

from conftest import (EPOCHS, FAST, LAUNCHER_FAILED, RESUME, assert_learned, assert_preempted, assert_same_run, metrics,
                      ok, python, torchrun, two_nodes)

from .harness import (APEX, DEVICE, DISTRIBUTED, FP16, HALF, ON_CPU, SLURM, SPAWN, UNET, UNET_ARGS,
                      assert_multi_rank_run, assert_scaler, cuda_only, finish_all, free_port, ok_all, preempt,
                      spawn_nodes, srun_tasks, worker)

GLOO = ["--dist-backend", "gloo"]
SHARED = f"world size 2, device {DEVICE}, backend gloo, global batch 16 = 2 x 8"
# the first visible GPU alone, for launches that would otherwise give each rank a GPU of its own
FIRST_GPU = {} if ON_CPU else {"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]}


def test_two_ranks_on_one_gpu_learn_over_gloo(shared_gpu_reference):
    job, out = shared_gpu_reference
    assert SHARED in job.output, job.output
    ckpt = assert_learned(out, EPOCHS)
    assert ckpt["world_size"] == 2 and len(ckpt["rng_states"]) == 2


def test_sigterm_on_rank_1_then_resume_auto_equals_the_uninterrupted_run(image_data, tmp_path, shared_gpu_reference):
    args = [image_data, *RESUME, *GLOO, "--epochs", EPOCHS, "--output-dir", tmp_path]
    first, second = two_nodes(DISTRIBUTED, *args)
    # one rank only, once both are training: the other must agree to stop at the same step
    preempt(first, worker(second, 1), "Epoch 0 [ 1/12]")
    step = assert_preempted(first, tmp_path, code=LAUNCHER_FAILED)
    assert second.finish().returncode == LAUNCHER_FAILED, second.output
    resumed = ok_all(two_nodes(DISTRIBUTED, *args, "--resume", "auto"))
    assert f"(epoch 0, step {step})" in resumed[0].output, resumed[0].output
    assert_same_run(tmp_path, shared_gpu_reference[1])


# float images without augmentation, the same tensors however many ranks read them (random crops differ with the count)
FIXED_IMAGES = """import torch


def images(args):
    labels = torch.arange(192) % 4
    pixels = labels[:, None, None, None] * 0.5 + torch.randn(192, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    return (torch.utils.data.TensorDataset(pixels[:160], labels[:160]),
            torch.utils.data.TensorDataset(pixels[160:], labels[160:]))
"""


def test_sync_bn_over_two_ranks_equals_batch_norm_over_their_global_batch(tmp_path):
    """SyncBatchNorm takes the statistics over both ranks' 8 images: 2 x 8 with --sync-bn trains as one process with
    plain BatchNorm over all 16 (same samples and steps; fp32, no TF32). The losses of the first two steps (the
    forward, then the first step's backward through the shared statistics) agree to the printed digits: measured on
    an H200, 1.4264 and 1.4052 both ways, where BatchNorm of each rank's own 8 gives 1.5169 and 1.5137. After that,
    rounding grows (layer4's statistics are over 16 values at 32 px): 0.9483 against 0.9455 at the epoch's end."""
    (tmp_path / "fixed.py").write_text(FIXED_IMAGES)
    run = ["--dataset", "fixed:images", "--num-classes", "4", "-a", "resnet18", "-b", "16", "--lr", "0.005", "-j", "0",
           "-p", "1", "--deterministic", "--no-tf32", "--epochs", 1]
    env = {"PYTHONPATH": tmp_path}
    jobs = ok_all(two_nodes(DISTRIBUTED, *run, *GLOO, "--sync-bn", "--output-dir", tmp_path / "sync", env=env))
    assert SHARED in jobs[0].output, jobs[0].output
    if ON_CPU:
        assert "--sync-bn: off on CPU" in jobs[0].output
        pytest.skip("GPU_SUITE_ON_CPU=1: SyncBatchNorm needs CUDA; the run went through, with per-process BatchNorm")
    assert "--sync-bn: off" not in jobs[0].output
    one = ok(torchrun(DISTRIBUTED, 1, *run, "--output-dir", tmp_path / "one", env=env))
    steps = [[float(loss) for loss in re.findall(r"^Epoch 0 \[ *\d+/10\] loss (\S+)", job.output, re.M)]
             for job in (jobs[0], one)]
    assert len(steps[0]) == len(steps[1]) == 10 and steps[0][:2] == pytest.approx(steps[1][:2], abs=2e-4), steps
    assert metrics(tmp_path / "sync")[0]["train_loss"] == pytest.approx(metrics(tmp_path / "one")[0]["train_loss"],
                                                                         rel=0.01)


# name: (start(data, output folder) -> jobs, what rank 0 says)
CASES = {
    f"distributed-{FP16}-sync-bn-channels-last": (
        lambda d, o: two_nodes(DISTRIBUTED, d, *FAST, *GLOO, "--amp", FP16, "--sync-bn", "--channels-last",
                               "--epochs", 2, "--output-dir", o),
        SHARED),
    "spawn-two-nodes": (
        lambda d, o: spawn_nodes(d, *FAST, *GLOO, "--epochs", 2, "--output-dir", o),
        SHARED),
    "slurm-two-tasks": (
        lambda d, o: srun_tasks(2, d, *FAST, *GLOO, "--epochs", 2, "--output-dir", o, env=FIRST_GPU),
        SHARED),
    "slurm-one-task-two-processes": (
        lambda d, o: [python(SLURM, d, *FAST, *GLOO, "--procs-per-node", 2, "--epochs", 2, "--output-dir", o,
                             env={**FIRST_GPU, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": free_port()})],
        SHARED),
    "apex-O2-sync-bn-channels-last": (
        lambda d, o: two_nodes(APEX, d, *FAST, *GLOO, "--opt-level", "O2", "--half-dtype", HALF, "--sync-bn",
                               "--channels-last", "--epochs", 2, "--output-dir", o),
        SHARED),
    "unet3d-amp-sync-bn": (
        lambda d, o: two_nodes(UNET, *UNET_ARGS, *GLOO, "--amp", "--sync-bn", "--epochs", 2, "--output-dir", o),
        f"world size 2, device {DEVICE}, backend gloo, global batch 4 = 2 x 2 patches"),
}


@pytest.mark.parametrize("case", CASES)
def test_multi_rank_cuda_paths_of_every_script_on_one_gpu(case, image_data, tmp_path):
    start, says = CASES[case]
    ckpt = assert_multi_rank_run(case, start(image_data, tmp_path), says, 2, tmp_path)
    if not case.startswith("unet3d"):
        assert_scaler(ckpt, fp16=FP16 in case or "O2" in case and HALF == "float16")


NCCL_CASES = {
    DISTRIBUTED: lambda d, o: two_nodes(DISTRIBUTED, d, *FAST, "--epochs", 1, "--output-dir", o),
    APEX: lambda d, o: two_nodes(APEX, d, *FAST, "--epochs", 1, "--output-dir", o),
    UNET: lambda d, o: two_nodes(UNET, *UNET_ARGS, "--epochs", 1, "--output-dir", o),
    SPAWN: lambda d, o: spawn_nodes(d, *FAST, "--epochs", 1, "--output-dir", o),
    SLURM: lambda d, o: srun_tasks(2, d, *FAST, "--epochs", 1, "--output-dir", o, env=FIRST_GPU),
}


@cuda_only
@pytest.mark.parametrize("script", NCCL_CASES)
def test_nccl_refuses_two_ranks_on_one_gpu_and_the_job_ends(script, image_data, tmp_path):
    """NCCL's own error names the cause; every rank stops (none waits for the others until --dist-timeout)."""
    jobs = finish_all(NCCL_CASES[script](image_data, tmp_path / "out"), timeout=180)
    output = "".join(job.output for job in jobs)
    assert all(job.returncode != 0 for job in jobs) and "Duplicate GPU detected" in output, output
    assert not (tmp_path / "out" / "checkpoint.pth.tar").exists()
