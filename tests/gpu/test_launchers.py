"""Each of the seven scripts under its own launcher, one process on the first GPU with NCCL: it learns, writes a
complete checkpoint, and a SIGTERM mid-epoch followed by --resume auto ends with the weights, optimizer state and
metrics of an uninterrupted run, bit for bit (--deterministic). The siblings that share distributed.py's trainer
also equal distributed.py bit for bit, as they do on the CPU."""
import re

import pytest
import torch

from conftest import EPOCHS, assert_learned, assert_preempted, assert_same_run, metrics, ok, started, threads_started

from .harness import (APEX, DATAPARALLEL, DEVICE, DISTRIBUTED, HOROVOD, NCCL, ON_CPU, SLURM, SPAWN, UNET, args_of,
                      assert_scaler, checkpoint_of, cuda_only, horovod_missing, launch, preempt, preempt_line,
                      preempted_code, signal_target)

SCRIPTS = [DISTRIBUTED, SPAWN, DATAPARALLEL, APEX, HOROVOD, SLURM, UNET]
# what each one says about where it runs
ONE_GPU = {
    DISTRIBUTED: f"world size 1, device {DEVICE}, backend {NCCL}, global batch 16 = 1 x 16",
    SPAWN: f"world size 1, device {DEVICE}, backend {NCCL}, global batch 16 = 1 x 16",
    APEX: f"world size 1, device {DEVICE}, backend {NCCL}, global batch 16 = 1 x 16",
    HOROVOD: f"world size 1, device {DEVICE}, backend horovod/gloo",
    SLURM: f"world size 1, device {DEVICE}, backend none, global batch 16 = 1 x 16",  # one task: no process group
    DATAPARALLEL: ("one process, device cpu, plain model, global batch 16 = 1 x 16" if ON_CPU else
                   "one process, device cuda, DataParallel over GPUs [0], global batch 16 split over 1 GPUs"),
    UNET: f"world size 1, device {DEVICE}, backend {NCCL}, global batch 4 = 1 x 4 patches",
}


@pytest.fixture(params=SCRIPTS)
def script(request):
    if request.param == HOROVOD and (why := horovod_missing()):
        pytest.skip(why)
    return request.param


def assert_unet_learned(out, epochs):
    rows = metrics(out)
    assert [r["epoch"] for r in rows] == list(range(epochs)), rows
    assert max(r["val_dice"] for r in rows) >= 0.8 and rows[-1]["train_loss"] < rows[0]["train_loss"], rows
    ckpt = checkpoint_of(out)
    assert (ckpt["epoch"], ckpt["step"], ckpt["arch"]) == (epochs, 0, "unet3d")
    return ckpt


def test_learns_and_writes_a_complete_checkpoint(script, uninterrupted_on_gpu):
    job, out = uninterrupted_on_gpu(script)
    assert ONE_GPU[script] in job.output, job.output
    ckpt = assert_unet_learned(out, EPOCHS) if script == UNET else assert_learned(out, EPOCHS)
    assert ckpt["world_size"] == 1 and len(ckpt["rng_states"]) == 1
    assert ON_CPU or ckpt["rng_states"][0]["cuda"].numel() > 0  # the GPU's random state, to resume exactly
    assert_scaler(ckpt, fp16=script == APEX)  # apex's reference is O2 with float16: dynamic loss scaling


def test_cuda_tensors_are_saved_as_such(uninterrupted_on_gpu):
    """A GPU run saves its tensors from the GPU; every script must load them to the CPU first (map_location),
    which the cross-device tests check. Here: the file really holds CUDA tensors, so those tests mean something."""
    _, out = uninterrupted_on_gpu(DISTRIBUTED)
    raw = torch.load(out / "checkpoint.pth.tar", map_location=None if not ON_CPU else "cpu", weights_only=True)
    assert raw["state_dict"]["fc.weight"].device.type == DEVICE


@pytest.mark.parametrize("script", [SPAWN, DATAPARALLEL, SLURM])
def test_gives_the_bits_of_distributed_py(script, uninterrupted_on_gpu, reference):
    """The same trainer, the same single process on the same GPU: the launcher changes nothing."""
    assert_same_run(uninterrupted_on_gpu(script)[1], reference[1])


def test_sigterm_mid_epoch_then_resume_auto_equals_the_uninterrupted_run(script, image_data, tmp_path,
                                                                         uninterrupted_on_gpu):
    args = [*([] if script == UNET else [image_data]), *args_of(script), "--epochs", EPOCHS, "--output-dir", tmp_path]
    job = launch(script, *args)
    preempt(job, signal_target(script, job), preempt_line(script))
    step = assert_preempted(job, tmp_path, code=preempted_code(script))
    resumed = ok(launch(script, *args, "--resume", "auto"))
    assert re.search(rf"resumed from .*checkpoint.pth.tar \(epoch 0, step {step}\)", resumed.output), resumed.output
    assert_same_run(tmp_path, uninterrupted_on_gpu(script)[1])


@cuda_only
@pytest.mark.parametrize("script", [DISTRIBUTED, UNET])  # their build_loaders: the ImageNet scripts' and the U-Net's
def test_no_loader_worker_is_forked_beside_a_pin_memory_thread(script, image_data, tmp_path):
    """pytorch#130610: a worker forked while a loader's pin-memory thread starts can inherit a lock that thread holds
    and hang for good. Only the training loader pins, and it forks its workers last: its thread, the only one, starts
    after every loader worker."""
    job = launch(script, *([] if script == UNET else [image_data]), *args_of(script), "-j", "2", "--epochs", "1000",
                 "--output-dir", tmp_path)
    job.wait_for_line("Epoch 0 [ 1/")
    trainer = job.process_of_rank(0)
    pinning = threads_started(trainer, "pt_data_pin")
    workers = [started(child.pid) for child in trainer.children()]
    job.kill()
    assert len(pinning) == 1 and len(workers) == 4 and max(workers) <= pinning[0], (pinning, workers)
