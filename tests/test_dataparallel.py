"""dataparallel.py on CPU (one process, the plain model): learns, equals distributed.py with one
process, resumes after SIGTERM, and shares checkpoints with distributed.py both ways."""
import os
import re
import signal
import sys

import pytest

from conftest import (FAST, RESUME, ROOT, Job, assert_learned, assert_preempted, assert_same_run, load, metrics, ok,
                      python)

SCRIPT = "dataparallel.py"


def val_loss(job):
    m = re.search(r"val: loss ([\d.]+) acc1", job.output)
    assert m, job.output
    return float(m[1])


def test_learns_and_writes_a_checkpoint_distributed_py_evaluates_alike(image_data, tmp_path):
    job = ok(python(SCRIPT, image_data, *FAST, "--epochs", "4", "--output-dir", tmp_path))
    assert "one process, device cpu, plain model, global batch 16 = 1 x 16" in job.output
    ckpt = assert_learned(tmp_path, epochs=4)
    assert ckpt["world_size"] == 1 and len(ckpt["rng_states"]) == 1
    evaluated = ok(python("distributed.py", image_data, *FAST, "-e", "--resume", tmp_path / "checkpoint.pth.tar"))
    assert val_loss(evaluated) == pytest.approx(metrics(tmp_path)[-1]["val_loss"], abs=1e-6)  # printed to 6 places


def test_evaluates_a_checkpoint_of_distributed_py(image_data, uninterrupted):
    job = ok(python(SCRIPT, image_data, *FAST, "-e", "--resume", uninterrupted / "checkpoint.pth.tar"))
    assert val_loss(job) == pytest.approx(metrics(uninterrupted)[-1]["val_loss"], abs=1e-6)


def test_under_nohup_a_hangup_changes_nothing(image_data, tmp_path):
    """`nohup python dataparallel.py ...`: SIGHUP is ignored from the start and stays so, in the training process and
    its loader workers: the run goes on to its end (without nohup, a hangup stops it with a checkpoint, as SIGTERM
    does)."""
    job = Job(["nohup", sys.executable, ROOT / SCRIPT, image_data, *FAST, "-j", "2", "-p", "1", "--epochs", "2",
               "--output-dir", tmp_path])
    job.wait_for_line("Epoch 0 [ 1/12]")
    os.killpg(job.proc.pid, signal.SIGHUP)  # the terminal's hangup reaches the whole foreground process group
    ok(job)
    assert "preempted" not in job.output and load(tmp_path / "checkpoint.pth.tar")["epoch"] == 2


def test_equals_distributed_py_with_one_process_also_when_preempted_and_resumed(image_data, tmp_path):
    """Same TrainSampler (one replica), same seeds: the same samples, crops and steps, so bit for bit
    the same weights, even across a SIGTERM and --resume auto."""
    args = [image_data, *RESUME, "--epochs", "2"]
    ok(python("distributed.py", *args, "--output-dir", tmp_path / "reference"))
    job = python(SCRIPT, *args, "-j", "2", "--output-dir", tmp_path / "dp")
    job.wait_for_line("Epoch 0 [ 1/12]")
    os.killpg(job.proc.pid, signal.SIGTERM)  # loader workers get it too
    step = assert_preempted(job, tmp_path / "dp")
    resumed = ok(python(SCRIPT, *args, "--resume", "auto", "--output-dir", tmp_path / "dp"))
    assert f"(epoch 0, step {step})" in resumed.output
    assert_same_run(tmp_path / "dp", tmp_path / "reference", epochs=2)
