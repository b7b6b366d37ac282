"""Bad input: one line saying what is wrong and what to do, a non-zero exit, no hang, no process left."""
import re
import shutil
import socket

import pytest
import torch
import torchvision
from PIL import Image

from conftest import FAST, error_lines, free_port, load, ok, python, spawn, torchrun

SCRIPT = "distributed.py"


def broken_copy(image_data, tmp_path, change):
    data = tmp_path / "data"
    shutil.copytree(image_data, data)
    change(data)
    return data


def checkpoint(tmp_path, **content):
    path = tmp_path / "ckpt.pth.tar"
    weights = torchvision.models.resnet18(num_classes=4).state_dict()
    torch.save({"arch": "resnet18", "state_dict": weights, **content}, path)
    return path


def first_train_image(data):
    return data / "train" / "class0" / "0000.JPEG"


def earlier_run(tmp_path, fsdp=False):
    """An --output-dir that holds the checkpoint of an earlier run: this script's, or fsdp_distributed.py's folder
    (they would overwrite each other's model_best.pth.tar)."""
    folder = tmp_path / "earlier"
    folder.mkdir()
    if fsdp:
        (folder / "checkpoint.dcp").mkdir()
    else:
        checkpoint(tmp_path).rename(folder / "checkpoint.pth.tar")
    return ["--output-dir", folder]


TRAINING_STATE = {"epoch": 1, "scheduler": {}, "scaler": {}, "best_acc1": 0.0, "args": {}}


# name: (processes, arguments given the dataset and a scratch folder, what the error line must say)
CASES = {
    "--dummy and a data folder": (1, lambda d, t: [d, "--dummy"],
                                  r"--dummy makes its own data, and .* names a folder: give one of them"),
    "missing data folder": (1, lambda d, t: [t / "nowhere"],
                            r"data folder '.*nowhere' not found: give a folder with train/ and val/"),
    "no val folder": (1, lambda d, t: [broken_copy(d, t, lambda x: shutil.rmtree(x / "val"))],
                      r"val not found: DIR must hold train/ and val/"),
    "a class folder in train/ only": (1, lambda d, t: [broken_copy(d, t, lambda x: shutil.rmtree(x / "val/class2"))],
                                      r"^error: the train and val sets have different classes \(class2\): give "
                                      r"both the same \(an image folder: the same class folders\)"),
    "corrupt JPEG on one of two ranks": (2, lambda d, t: [broken_copy(d, t, lambda x: first_train_image(x)
                                                                      .write_bytes(b"junk"))],
                                         r"cannot read image .*class0/0000.JPEG .*replace or remove the file"),
    "truncated JPEG": (1, lambda d, t: [broken_copy(d, t, lambda x: first_train_image(x)
                                                    .write_bytes(first_train_image(x).read_bytes()[:300]))],
                       r"cannot read image .*class0/0000.JPEG \(.*[Tt]runcated.*\): replace or remove the file"),
    "an image too large to decode": (1, lambda d, t: [broken_copy(d, t, lambda x: Image.new("1", (14000, 14000))
                                                          .save(first_train_image(x), "PNG"))],
                                     r"cannot read image .*class0/0000.JPEG \(Image size \(196000000 pixels\) exceeds "
                                     r"limit .*\): replace or remove the file"),
    "batch not divisible by world size": (2, lambda d, t: [d, "-b", "15"],
                                          r"--batch-size 15 is the global batch and must divide by the world size 2: "
                                          r"use e.g. 14"),
    "grad accumulation steps that do not divide a process's batch": (
        2, lambda d, t: [d, "-b", "16", "--grad-accum-steps", "3"],
        r"--grad-accum-steps 3 must divide each process's batch 8 \(-b 16 / 2 processes\)"),
    "--val-resize under --crop-size": (1, lambda d, t: [d, "--crop-size", "32", "--val-resize", "30"],
                                       r"--val-resize 30 is smaller than --crop-size 32: the center crop would be "
                                       r"padded with black; give --val-resize 32 or more$"),
    "batch larger than the data": (1, lambda d, t: [d, "-b", "512"],
                                   r"192 training samples are fewer than one global batch of 512: lower -b"),
    "-e with no weights to evaluate": (1, lambda d, t: [d, "-e"],
                                       r"^error: -e evaluates trained weights, and no --resume PATH is given: give "
                                       r"--resume PATH \(a checkpoint, or weights saved with "
                                       r"torch.save\(model.state_dict\(\), PATH\)\), or the --output-dir of the run$"),
    "-e --resume auto with no checkpoint": (2, lambda d, t: [d, "-e", "--resume", "auto"],
                                            r"^error: -e evaluates trained weights, and --output-dir .*out holds no "
                                            r"checkpoint: give --resume PATH"),
    "resume with another dropout": (1, lambda d, t: [d, "-a", "mobilenet_v3_small", "--resume",
                                                     checkpoint(t, arch="mobilenet_v3_small", args={"dropout": 0.5})],
                                    r"trained with --dropout 0.5, this run has --dropout None: continue it with "
                                    r"--dropout 0.5"),
    "resume with another optimizer": (1, lambda d, t: [d, "--resume", checkpoint(t, args={"opt": "adamw"})],
                                      r"ckpt.pth.tar was trained with --opt adamw, this run has --opt sgd: continue it "
                                      r"with --opt adamw, or train without --resume"),
    "resume with another global batch": (1, lambda d, t: [d, "--resume", checkpoint(t, args={"batch_size": 64})],
                                        r"ckpt.pth.tar was trained with --batch-size 64, this run has --batch-size "
                                        r"16: continue it with --batch-size 64, or train without --resume"),
    "resume with another learning rate": (1, lambda d, t: [d, "--resume", checkpoint(t, args={"lr": 0.4})],
                                         r"ckpt.pth.tar was trained with --lr 0.4, this run has --lr 0.005: continue "
                                         r"it with --lr 0.4, or train without --resume"),
    "resume on a training set of another size": (
        1, lambda d, t: [d, "--resume", checkpoint(t, train_samples=640, **TRAINING_STATE)],
        r"ckpt.pth.tar was trained on 640 training samples, this run has 192: resume with the data it was trained on, "
        r"or train without --resume$"),
    "resume with another seed": (1, lambda d, t: [d, "--resume", checkpoint(t, args={"seed": 3})],
                                 r"ckpt.pth.tar was trained with --seed 3, this run has --seed 0: continue it with "
                                 r"--seed 3, or train without --resume"),
    "resume without --no-wd-norm-bias": (1, lambda d, t: [d, "--resume", checkpoint(t, args={"no_wd_norm_bias": True})],
                                         r"trained with --no-wd-norm-bias True, this run has --no-wd-norm-bias False: "
                                         r"continue it with --no-wd-norm-bias True"),
    "a fresh run over an earlier run's checkpoint": (1, lambda d, t: [d, *earlier_run(t)],
                                                     r"--output-dir .*earlier holds the checkpoint of an earlier run "
                                                     r"\(checkpoint.pth.tar\), which this one would overwrite: "
                                                     r"continue that run with --resume auto \(by the script that saved "
                                                     r"it\), or give another --output-dir"),
    "a fresh run over fsdp_distributed.py's checkpoint": (1, lambda d, t: [d, *earlier_run(t, fsdp=True)],
                                                          r"holds the checkpoint of an earlier run \(checkpoint.dcp\), "
                                                          r"which this one would overwrite"),
    "resume checkpoint of another arch": (1, lambda d, t: [d, "--resume", checkpoint(t, arch="resnet50")],
                                          r"ckpt.pth.tar holds a resnet50 model, not resnet18: pass -a resnet50 "),
    "loss becomes NaN": (2, lambda d, t: [d, "--lr", "1e9", "-p", "2"],
                         r"loss became NaN/inf at epoch 0 step \d+; stopped without saving it"),
}


SPAWN, DATAPARALLEL, SLURM = "multiprocessing_distributed.py", "dataparallel.py", "distributed_slurm_main.py"
FSDP = "fsdp_distributed.py"
# The siblings run the same checks (byte-identical helpers): here each gets one case per way an error
# surfaces - found by one process or by every rank alike, by the rank that reads a file, or mid-training.
SIBLINGS = {SPAWN: ["missing data folder", "batch not divisible by world size", "corrupt JPEG on one of two ranks",
                    "resume checkpoint of another arch", "loss becomes NaN"],
            DATAPARALLEL: ["missing data folder", "truncated JPEG", "resume checkpoint of another arch"],
            SLURM: ["corrupt JPEG on one of two ranks", "batch not divisible by world size"],
            # its checkpoints are its own: tests/test_fsdp_distributed.py has those cases
            FSDP: ["batch not divisible by world size", "corrupt JPEG on one of two ranks", "loss becomes NaN"]}


def launch(script, processes, *args):
    if script == SPAWN:
        return spawn(script, processes, *args)
    if script == SLURM and processes > 1:  # outside Slurm, one task that starts its processes itself
        return python(script, "--procs-per-node", processes, *args)
    return python(script, *args) if processes == 1 else torchrun(script, processes, *args)


def assert_one_clear_line(job, expected, launcher_reports=False):
    """Exit code 2 and one `error:` line; a launcher (torchrun) may add its own report and exit code. Where one
    rank met the error mid-run, the others say in one line that a peer ended (tests/test_peer_failure.py)."""
    errors = [line for line in error_lines(job.output) if not line.startswith("error: a peer ended, so this rank")]
    assert job.returncode != 0, job.output
    assert len(errors) == 1 and re.search(expected, errors[0]), job.output
    if not launcher_reports:
        assert job.returncode == 2 and "Traceback" not in job.output, job.output


@pytest.mark.parametrize("script,name", [(SCRIPT, name) for name in CASES] +
                         [(script, name) for script, names in SIBLINGS.items() for name in names])
def test_bad_input_gets_one_clear_line(script, name, image_data, tmp_path):
    processes, make_args, expected = CASES[name]
    args = [*FAST, "--epochs", "1", "--output-dir", tmp_path / "out", *make_args(image_data, tmp_path)]
    job = launch(script, processes, *args).finish(timeout=120)
    assert_one_clear_line(job, expected, launcher_reports=processes > 1 and script in (SCRIPT, FSDP))
    assert not (tmp_path / "out" / "checkpoint.pth.tar").exists()


SLOW_RANK_0 = """
import os, runpy, sys, time
if os.environ["LOCAL_RANK"] == "0":
    time.sleep(3)
runpy.run_path(sys.argv.pop(1), run_name="__main__")
"""


def slow_rank_0(tmp_path, *args):
    """torchrun with 2 processes, local rank 0 (the reporting rank) starting 3 s after the other."""
    wrapper = tmp_path / "slow_rank_0.py"
    wrapper.write_text(SLOW_RANK_0)
    return torchrun(wrapper, 2, SCRIPT, *FAST, "--epochs", "1", "--output-dir", tmp_path / "out", *args).finish(120)


def test_the_reporting_rank_prints_even_when_a_silent_rank_fails_first(image_data, tmp_path):
    """Local rank 0 reports; here it starts last. The other rank finds the error first and must not exit
    before rank 0 has printed, since torchrun stops every process as soon as one exits."""
    _, make_args, expected = CASES["batch not divisible by world size"]
    assert_one_clear_line(slow_rank_0(tmp_path, *make_args(image_data, tmp_path)), expected,
                          launcher_reports=True)


@pytest.mark.parametrize("url, nodes, expected", [
    ("tcp://127.0.0.1:0", 2, r"--world-size 2 needs --dist-url tcp://HOST:PORT, the same on every node: HOST node 0, "
                             r"PORT a free port there \(not 0\)$"),
    ("tcp://no.such.host.invalid:29500", 1, r"--dist-url tcp://no.such.host.invalid:29500: no.such.host.invalid does "
                                            r"not resolve \(.*\): give the address of the node of rank 0$")])
def test_spawn_dist_url_that_cannot_be_met_at_is_one_clear_line(url, nodes, expected, image_data, tmp_path):
    """A host that does not resolve, or port 0 on several nodes (each would listen on a free port of its own): every
    rank waited until --dist-timeout (30 minutes)."""
    job = spawn(SPAWN, 2, image_data, *FAST, "--dist-url", url, "--world-size", nodes, "--output-dir", tmp_path
                ).finish(60)
    assert_one_clear_line(job, expected)


def test_spawn_node_that_never_joins_ends_the_job_within_the_timeout(image_data, tmp_path):
    """Node 1 never starts: node 0's ranks stop after --dist-timeout, in the rendezvous store's words, and its parent
    with them."""
    url = f"tcp://127.0.0.1:{free_port()}"
    job = spawn(SPAWN, 2, image_data, *FAST, "--world-size", "2", "--node-rank", "0", "--dist-url", url,
                "--dist-timeout", "5", "--output-dir", tmp_path).finish(60)
    assert job.returncode != 0 and "wait timeout after 5000ms" in job.output, job.output


def test_a_disk_that_fills_up_keeps_the_last_checkpoint_and_says_how_much_room_is_needed(small_disk, image_data):
    """resnet18's checkpoint (weights and momentum) takes 85 MiB: epoch 0 writes it and its copy as the best,
    epoch 1 runs out of room while it writes the next beside them."""
    out = small_disk("200m")
    job = python(SCRIPT, image_data, *FAST, "--epochs", "2", "--output-dir", out).finish(120)
    assert_one_clear_line(job, rf"cannot write a checkpoint to {out} \(no space left\): a checkpoint takes about "
                               r"85 MiB \(twice that while it replaces the last one\), \d+ MiB are free there; make "
                               r"room or give another --output-dir \(the last checkpoint is kept\)")
    assert load(out / "checkpoint.pth.tar")["epoch"] == 1


def test_a_second_run_in_the_same_output_folder_is_refused_and_a_killed_run_leaves_no_lock(image_data, tmp_path):
    first = python(SCRIPT, image_data, *FAST, "-p", "1", "--epochs", "50", "--output-dir", tmp_path)
    first.wait_for_line("Epoch 0 [ 1/12]")
    second = torchrun(SCRIPT, 2, image_data, *FAST, "--epochs", "1", "--output-dir", tmp_path).finish(120)
    holder = rf"pid {first.proc.pid} on {re.escape(socket.gethostname())}, since [\d: -]+"
    assert_one_clear_line(second, rf"--output-dir {tmp_path} is in use by another run \({holder}\): give another "
                                  r"--output-dir, or wait for that run to end", launcher_reports=True)
    # rank 1, waiting for rank 0 to start the process group, ends at torchrun's SIGTERM, not at its SIGKILL 30 s on
    assert "SIGKILL" not in second.output, second.output
    first.kill()
    ok(python(SCRIPT, image_data, *FAST, "--epochs", "1", "--resume", "auto", "--output-dir", tmp_path))
