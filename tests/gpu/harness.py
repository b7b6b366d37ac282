"""What the GPU acceptance suite adds to the CPU suite's harness (tests/conftest.py, which does the launching):
the device it runs on, the launch of every script on one GPU, srun's tasks, two ranks on one GPU (with
conftest's two_nodes: two torchrun agents, node 0 holding rank 0), and signalling a run mid-epoch on a GPU, which
trains an epoch of the tiny images in a fraction of a second.

GPU_SUITE_ON_CPU=1 runs the suite's code on the CPU where a case permits (gloo for NCCL, bf16 for fp16,
2 processes for 2 GPUs); what only CUDA can do is skipped, saying so."""
import contextlib
import fcntl
import functools
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from conftest import (BIN, LAUNCHER_FAILED, PREEMPTED, RESUME, ROOT, Job, free_port, load, metrics, python, spawn,
                      torchrun)

ON_CPU = os.environ.get("GPU_SUITE_ON_CPU") == "1"
if ON_CPU:  # this process (the in-process model steps) and every launch see no GPU
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
GPUS = 0 if ON_CPU else torch.cuda.device_count()
DEVICE = "cpu" if ON_CPU else "cuda"
NCCL = "gloo" if ON_CPU else "nccl"  # the backend the scripts choose by default
FP16 = "bf16" if ON_CPU else "fp16"  # --amp: on the CPU bfloat16 stands in for speed (fp16 runs, slowly)
HALF = "bfloat16" if ON_CPU else "float16"  # apex_distributed.py --half-dtype: likewise
CUDA_ONLY = "GPU_SUITE_ON_CPU=1: needs CUDA"
SHARED = os.environ.get("GPU_SUITE_SHARED")  # scripts/gpu_suite.py: a folder its concurrent pytest processes share
cuda_only = pytest.mark.skipif(ON_CPU, reason=CUDA_ONLY)
# several GPUs; on the CPU, as many processes stand in for them
two_gpus = pytest.mark.skipif(not ON_CPU and GPUS < 2, reason=f"needs 2 GPUs, {GPUS} visible")

DISTRIBUTED, SPAWN, DATAPARALLEL = "distributed.py", "multiprocessing_distributed.py", "dataparallel.py"
APEX, HOROVOD, SLURM = "apex_distributed.py", "horovod_distributed.py", "distributed_slurm_main.py"
UNET = "unet3d_apex.py"
TORCHRUN_SCRIPTS = (DISTRIBUTED, APEX, UNET)

# apex_distributed.py's reference: apex's usual level, master weights and dynamic loss scaling (fp16 on a GPU)
APEX_RESUME = [*RESUME, "--opt-level", "O2", "--half-dtype", HALF]
# a small 3D U-Net on generated volumes (as tests/test_unet3d_apex.py), 20 steps an epoch, deterministic
UNET_ARGS = ["--synthetic", "--synthetic-size", "20", "--synthetic-shape", "20", "24", "24", "--patch-size", "16", "16",
             "16", "--base-channels", "8", "--depth", "3", "-b", "4", "--lr", "3e-3", "-j", "0", "-p", "1",
             "--deterministic"]


def args_of(script):
    """The deterministic, bit-reproducible arguments of a script's reference run (without its data folder)."""
    return {APEX: APEX_RESUME, UNET: UNET_ARGS}.get(script, RESUME)


def gpus(ids):
    """--gpus for the scripts that take it (spawn, DataParallel); on the CPU they take none."""
    return [] if ON_CPU else ["--gpus", ids]


# ---------------------------------------------------------------------------------------------------------------
# Launching
# ---------------------------------------------------------------------------------------------------------------
@functools.cache
def horovod_missing():
    """Why Horovod cannot run here (None when it can): not installed, or without NCCL for the GPUs. Asked in a
    fresh interpreter: importing horovod.torch loads its libraries into this process for the rest of the session."""
    if not (BIN / "horovodrun").exists() and not shutil.which("horovodrun"):
        return "horovodrun not found (Horovod not installed: scripts/install_horovod.sh)"
    done = subprocess.run([sys.executable, "-c", "import horovod.torch as h; print(h.nccl_built())"],
                          capture_output=True, text=True, timeout=120)
    if done.returncode:
        lines = (done.stderr.strip() or "no output").splitlines()
        return f"import horovod.torch fails ({lines[-1]})"
    if not ON_CPU and done.stdout.strip() in ("0", "False"):
        return ("Horovod is built without NCCL: HOROVOD_GPU_OPERATIONS=NCCL bash scripts/install_horovod.sh "
                "(the CPU suite runs it with gloo)")
    return None


def horovodrun(np, *args, **kwargs):
    """horovodrun with its gloo controller (no MPI needed); on GPUs the gradients go through NCCL all the same."""
    runner = str(BIN / "horovodrun") if (BIN / "horovodrun").exists() else shutil.which("horovodrun")
    return Job([runner, "--gloo", "-np", np, "-H", f"localhost:{np}", sys.executable, ROOT / HOROVOD, *args], **kwargs)


def srun_tasks(ntasks, *args, env=None):
    """distributed_slurm_main.py as `srun -N1 -n N` starts it: N processes on this machine, each with the
    variables srun gives its task (there is no Slurm here; the CPU suite runs the real srun). Task i uses GPU i,
    or GPU 0 where only one is visible, as with --gpus-per-task=1. Returns the tasks' jobs, task 0's first."""
    port = free_port()
    common = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_NTASKS": ntasks, "SLURM_NNODES": "1",
              "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "127.0.0.1", "SLURM_STEP_NODELIST": "127.0.0.1",
              "SLURM_RESTART_COUNT": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
              "ENVIRONMENT": "",  # not a batch job: the script must never try to requeue it
              **(env or {})}
    return [python(SLURM, *args, env={**common, "SLURM_PROCID": task, "SLURM_LOCALID": task}) for task in range(ntasks)]


def launch(script, *args, env=None):
    """`script` as its users start it, one process on the first GPU (on the CPU: one process)."""
    if script in TORCHRUN_SCRIPTS:
        return torchrun(script, 1, *args, env=env)
    if script == SPAWN:
        return spawn(script, 1, *args, *gpus("0"), env=env)
    if script == DATAPARALLEL:
        return python(script, *args, *gpus("0"), env=env)
    if script == SLURM:
        return srun_tasks(1, *args, env=env)[0]
    if script == HOROVOD:
        return horovodrun(1, *args, env=env)
    raise ValueError(script)


def spawn_nodes(*args, env=None):
    """multiprocessing_distributed.py as on two nodes of one GPU each (--world-size 2, --node-rank 0 and 1, one
    process each): two ranks on this machine's first GPU, which --gpus cannot give (it lists each GPU once).
    Returns the two jobs, node 0's (rank 0's) first."""
    url = f"tcp://127.0.0.1:{free_port()}"
    return [spawn(SPAWN, 1, *args, "--world-size", 2, "--node-rank", node, "--dist-url", url, env=env)
            for node in (0, 1)]


class Finished:
    """What a test reads of a run that another pytest process made: its output."""
    returncode = 0

    def __init__(self, output):
        self.output = output


def made_once(name, tmp_path_factory, make):
    """make(folder) -> job: a run that several tests compare with. Without GPU_SUITE_SHARED, made in a folder of
    this session; with it, in a folder the processes share, by the first that asks while the others wait on its
    lock, and then read (its output: Finished). A run that failed fails the tests of the others at once; one that
    was interrupted is made again by the next that asks. Returns (job, folder)."""
    if not SHARED:
        folder = tmp_path_factory.mktemp(name)
        return make(folder), folder
    shared = Path(SHARED)
    folder, output, failed = shared / name, shared / f"{name}.output", shared / f"{name}.failed"
    with open(shared / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # let go when the file closes, or this process dies
        if failed.exists():
            pytest.fail(f"the run {name}, made by another process of the suite, failed there: {failed.read_text()}")
        if output.exists():
            return Finished(output.read_text()), folder
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir()
        try:
            job = make(folder)
        except (Exception, pytest.fail.Exception) as e:
            failed.write_text(f"{type(e).__name__}: {str(e)[-2000:]}")
            raise
        output.write_text(getattr(job, "output", ""))
        return job, folder


def finish_all(jobs, timeout=300):
    for job in jobs:
        job.finish(timeout)
    return jobs


def ok_all(jobs, timeout=300):
    for job in finish_all(jobs, timeout):
        assert job.returncode == 0, job.output
    return jobs


# ---------------------------------------------------------------------------------------------------------------
# Signalling a run mid-epoch
# ---------------------------------------------------------------------------------------------------------------
def find_process(job, rank, variable="RANK"):
    """The training process a launcher gave `variable`=rank, or None while there is none (yet)."""
    with contextlib.suppress(StopIteration, psutil.Error, AttributeError):
        return job.process_of_rank(rank, variable)
    return None


def worker(job, rank=0, variable="RANK", timeout=120):
    """Waits until the launcher of `job` has started the training process of `rank`, and returns it."""
    deadline = time.monotonic() + timeout
    while (process := find_process(job, rank, variable)) is None:
        if time.monotonic() > deadline or job.proc.poll() is not None:
            job.kill()
            pytest.fail(f"no process with {variable}={rank} in {' '.join(job.cmd)}:\n{job.output}")
        time.sleep(0.1)
    return process


def signal_target(script, job):
    """What to send SIGTERM to, as a user or a scheduler would: torchrun's or horovodrun's worker (the launcher
    itself would stop its workers and fail); spawn's parent, which passes it on; else the training process."""
    if script in TORCHRUN_SCRIPTS:
        return worker(job)
    if script == HOROVOD:
        return worker(job, 0, "HOROVOD_RANK")
    return job.proc


def preempted_code(script):
    """The exit code of a preempted run of `script`: torchrun's and horovodrun's for any process that exited
    non-zero (1); the other launchers pass on the scripts' own (75)."""
    return LAUNCHER_FAILED if script in (*TORCHRUN_SCRIPTS, HOROVOD) else PREEMPTED


def preempt(job, target, line):
    """SIGTERM to `target` the moment `job` prints `line`. The target is found before, and the line read as it
    comes: a GPU trains a step of these batches in milliseconds, twelve to an epoch, and the signal must arrive
    within epoch 0."""
    job.wait_for_line(line)
    target.send_signal(signal.SIGTERM)


def preempt_line(script):
    """When to signal a one-process run of `script` so that it stops inside epoch 0, after step 0. A script whose
    ranks agree on stopping (a process group, even of one) stops one step after the signal has arrived: signal it
    as soon as its handlers are in place, which it says with its first line ("distributed.py: world size ..."), well
    before its first step, so it stops after step 0. Without a group (DataParallel, a single Slurm task, Horovod
    with one process) it stops at the very next step: signal it after the first one."""
    return "Epoch 0 [ 1/12]" if script in (DATAPARALLEL, SLURM, HOROVOD) else f"{script}: world size"


# ---------------------------------------------------------------------------------------------------------------
# Assertions
# ---------------------------------------------------------------------------------------------------------------
def assert_trains(out, epochs, min_acc1=None):
    """A run that trains: one metrics row per epoch, finite losses, the training loss falling or already at half of
    chance's (ln 4: a run that learned in its first epoch, then wobbles), and with `min_acc1` a validation accuracy
    that reaches it (the image folder has 4 classes: chance is 25%)."""
    rows = metrics(out)
    assert [r["epoch"] for r in rows] == list(range(epochs)), rows
    assert all(r[k] == r[k] and abs(r[k]) != float("inf") for r in rows for k in ("train_loss", "val_loss")), rows
    assert rows[-1]["train_loss"] < max(rows[0]["train_loss"], math.log(4) / 2), rows
    if min_acc1 is not None:
        assert max(r["val_acc1"] for r in rows) >= min_acc1, rows
    return rows


def assert_scaler(ckpt, fp16):
    """fp16 runs on a GPU save the GradScaler's state (its scale); runs without loss scaling an empty one."""
    if fp16 and not ON_CPU:
        assert ckpt["scaler"] and ckpt["scaler"]["scale"] > 0, ckpt["scaler"]
    else:
        assert ckpt["scaler"] == {}, ckpt["scaler"]


def checkpoint_of(out):
    return load(out / "checkpoint.pth.tar")


def assert_multi_rank_run(case, jobs, says, processes, out):
    """A 2-epoch run of `processes` ranks (case names its script and options) finished and trained, said `says`,
    and on a GPU left no notice that a CUDA feature (SyncBatchNorm, float16) was off. Returns its checkpoint."""
    output = "".join(job.output for job in ok_all(jobs))
    assert says in output, output
    ckpt = checkpoint_of(out)
    assert (ckpt["epoch"], ckpt["world_size"], len(ckpt["rng_states"])) == (2, processes, processes)
    if not ON_CPU:
        assert "--sync-bn: off" not in output and "stands in" not in output and "bf16 autocast on CPU" not in output
    if case.startswith("unet3d"):
        rows = metrics(out)
        assert [r["epoch"] for r in rows] == [0, 1] and rows[-1]["val_dice"] > 0, rows
        assert_scaler(ckpt, fp16=True)
    else:
        assert_trains(out, 2)
    return ckpt
