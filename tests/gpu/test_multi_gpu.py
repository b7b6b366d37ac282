"""Two GPUs: NCCL between two of them under every launcher, DataParallel over two, and a peer that NCCL loses. Skipped
on a machine of one GPU (saying so: NCCL refuses two ranks on one GPU); with GPU_SUITE_ON_CPU=1, two processes stand
in for the two GPUs (gloo for NCCL)."""
import re
import signal
import time

import pytest

from conftest import (EPOCHS, FAST, LAUNCHER_FAILED, RESUME, TIMED_OUT, assert_learned, assert_preempted,
                      assert_same_run, error_lines, ok, python, spawn, torchrun)

from .harness import (APEX, DATAPARALLEL, DEVICE, DISTRIBUTED, HALF, NCCL, ON_CPU, SLURM, SPAWN, UNET, UNET_ARGS,
                      assert_multi_rank_run, free_port, gpus, horovod_missing, horovodrun, made_once, preempt,
                      srun_tasks, two_gpus, worker)

pytestmark = two_gpus


@pytest.fixture(scope="module")
def two_gpu_reference(image_data, tmp_path_factory):
    return made_once("two_gpus", tmp_path_factory, lambda out: ok(
        torchrun(DISTRIBUTED, 2, image_data, *RESUME, "--epochs", EPOCHS, "--output-dir", out)))


def test_torchrun_with_nccl_across_two_gpus_learns(two_gpu_reference):
    job, out = two_gpu_reference
    assert f"world size 2, device {DEVICE}, backend {NCCL}, global batch 16 = 2 x 8" in job.output, job.output
    ckpt = assert_learned(out, EPOCHS)
    assert ckpt["world_size"] == 2 and len(ckpt["rng_states"]) == 2


def test_sigterm_on_rank_1_then_resume_auto_equals_the_uninterrupted_run(image_data, tmp_path, two_gpu_reference):
    args = [image_data, *RESUME, "--epochs", EPOCHS, "--output-dir", tmp_path]
    job = torchrun(DISTRIBUTED, 2, *args)
    preempt(job, worker(job, 1), "Epoch 0 [ 1/12]")  # one rank only, once both are training
    step = assert_preempted(job, tmp_path, code=LAUNCHER_FAILED)
    resumed = ok(torchrun(DISTRIBUTED, 2, *args, "--resume", "auto"))
    assert f"(epoch 0, step {step})" in resumed.output
    assert_same_run(tmp_path, two_gpu_reference[1])


TWO = f"world size 2, device {DEVICE}, backend {NCCL}, global batch 16 = 2 x 8"
# name: (start(data, output folder) -> jobs, what rank 0 says, processes)
CASES = {
    "dataparallel-gpus-0,1": (
        lambda d, o: [python(DATAPARALLEL, d, *FAST, *gpus("0,1"), "--amp", "bf16", "--epochs", 2, "--output-dir", o)],
        "one process, device cpu, plain model, global batch 16 = 1 x 16" if ON_CPU else
        "one process, device cuda, DataParallel over GPUs [0, 1], global batch 16 split over 2 GPUs", 1),
    "spawn-gpus-0,1": (
        lambda d, o: [spawn(SPAWN, 2, d, *FAST, *gpus("0,1"), "--epochs", 2, "--output-dir", o)], TWO, 2),
    "slurm-two-tasks": (
        lambda d, o: srun_tasks(2, d, *FAST, "--epochs", 2, "--output-dir", o), TWO, 2),
    "slurm-one-task-two-processes": (
        lambda d, o: [python(SLURM, d, *FAST, "--procs-per-node", 2, "--epochs", 2, "--output-dir", o,
                             env={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": free_port()})], TWO, 2),
    "apex-O2-sync-bn": (
        lambda d, o: [torchrun(APEX, 2, d, *FAST, "--opt-level", "O2", "--half-dtype", HALF, "--sync-bn",
                               "--channels-last", "--epochs", 2, "--output-dir", o)], TWO, 2),
    "unet3d-amp-sync-bn": (
        lambda d, o: [torchrun(UNET, 2, *UNET_ARGS, "--amp", "--sync-bn", "--epochs", 2, "--output-dir", o)],
        f"world size 2, device {DEVICE}, backend {NCCL}, global batch 4 = 2 x 2 patches", 2),
    "horovod": (
        lambda d, o: [horovodrun(2, d, *FAST, "--epochs", 2, "--output-dir", o)],
        f"world size 2, device {DEVICE}, backend horovod/gloo", 2),
}


@pytest.mark.parametrize("case", CASES)
def test_every_launcher_across_two_gpus(case, image_data, tmp_path):
    if case == "horovod" and (why := horovod_missing()):
        pytest.skip(why)
    start, says, processes = CASES[case]
    assert_multi_rank_run(case, start(image_data, tmp_path), says, processes, tmp_path)


TIMEOUT = 20  # --dist-timeout
# 1000 steps of 2 x 8 in epoch 0, printing each, with loader workers: rank 1 is signalled well within it
MID_EPOCH = ["--dummy", "--dummy-size", 16000, *FAST, "-j", 2, "-p", 1, "--epochs", 1, "--dist-timeout", TIMEOUT]


def signal_rank_1(tmp_path, signum, ends_within):
    """distributed.py on two GPUs with NCCL, rank 1 given `signum` mid-epoch: the job fails within `ends_within` s and
    leaves no process (Job.finish checks). NCCL's watchdog (TORCH_NCCL_ASYNC_ERROR_HANDLING, which torchrun sets) may
    abort rank 0 first, in a collective that waits for rank 1: this says whether it does. Returns the job."""
    job = torchrun(DISTRIBUTED, 2, *MID_EPOCH, "--output-dir", tmp_path)
    rank_1 = worker(job, 1)
    job.wait_for_line("Epoch 0 [   2/1000]")
    rank_1.send_signal(signum)
    started = time.monotonic()
    job.finish(timeout=ends_within + 60)
    assert job.returncode != 0 and time.monotonic() - started < ends_within, job.output
    return job


def test_a_peer_killed_mid_epoch_leaves_rank_0_one_line_that_a_peer_ended(tmp_path):
    """SIGKILL (the out-of-memory killer): torchrun stops rank 0 at once, which must first say why, in one line with
    no traceback but torchrun's report."""
    job = signal_rank_1(tmp_path, signal.SIGKILL, ends_within=TIMEOUT + 15)
    errors = error_lines(job.output)
    assert len(errors) == 1 and re.match(r"error: a peer ended, so this rank stops too \(.+\): the error line of the "
                                         r"rank that ended first says why", errors[0]), job.output
    tracebacks = job.output.count("Traceback (most recent call last)")
    assert tracebacks == job.output.count("errors.ChildFailedError:"), job.output


def test_a_peer_frozen_mid_epoch_ends_the_job_after_the_timeout(tmp_path):
    """SIGSTOP (stuck in I/O or a driver call): rank 0 gives up after --dist-timeout, in the backend's words; torchrun
    then kills rank 1 30 s after asking it to stop."""
    job = signal_rank_1(tmp_path, signal.SIGSTOP, ends_within=TIMEOUT + 30 + 15)
    assert re.search(TIMED_OUT, job.output), job.output
