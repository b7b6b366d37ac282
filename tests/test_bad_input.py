"""Bad input: one line saying what is wrong and what to do, a non-zero exit, no hang, no process left."""
import math
import os
import re
import shutil
import socket
import subprocess
import sys

import pytest
import torch
import torchvision
from PIL import Image

from conftest import (FAST, OUTPUT_FILES, ROOT, Job, error_lines, free_port, load, ok, own_rows, python, spawn,
                      torchrun)

SCRIPT = "distributed.py"
MEMORY = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")  # this machine's, as the scripts read it


def broken_copy(image_data, tmp_path, change):
    data = tmp_path / "data"
    shutil.copytree(image_data, data)
    change(data)
    return data


def checkpoint(tmp_path, truncate=False, num_classes=4, drop=(), **content):
    path = tmp_path / "ckpt.pth.tar"
    weights = torchvision.models.resnet18(num_classes=num_classes).state_dict()
    weights = {k: v for k, v in weights.items() if k not in drop}
    torch.save({"arch": "resnet18", "state_dict": weights, **content}, path)
    if truncate:
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return path


def pickled_model(tmp_path):
    """A whole model saved with torch.save(model), as people do: its classes, not only tensors."""
    path = tmp_path / "model.pth"
    torch.save(torchvision.models.resnet18(num_classes=4), path)
    return path


def broken_checkpoint(tmp_path, make):
    """--resume auto in an --output-dir whose checkpoint make(path) left there: it must stop the run, never
    start it afresh over the training the checkpoint stands for."""
    folder = tmp_path / "resumed"
    folder.mkdir()
    make(folder / "checkpoint.pth.tar")
    return ["--resume", "auto", "--output-dir", folder]


def first_train_image(data):
    return data / "train" / "class0" / "0000.JPEG"


def named_pipe(tmp_path):
    """A FIFO: reading it waits for a writer that never comes (and a SIGTERM only sets the preemption flag)."""
    os.mkfifo(tmp_path / "pipe")
    return tmp_path / "pipe"


def piped_output_dir(tmp_path, name):
    """An --output-dir where a named pipe stands at one of the run's files: opened, it would wait for ever."""
    folder = tmp_path / "piped"
    folder.mkdir()
    os.mkfifo(folder / name)
    return ["--output-dir", folder]


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


def sgd_checkpoint(tmp_path, buffer=torch.zeros_like, **scheduler):
    """A checkpoint with resnet18's SGD state, momentum buffers buffer(weight), and LambdaLR's with `scheduler`'s
    changes. Momentum of another shape would crash a fused step (SIGSEGV)."""
    model = torchvision.models.resnet18(num_classes=4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.005, momentum=0.9)
    for p in model.parameters():
        optimizer.state[p]["momentum_buffer"] = buffer(p)
    state = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0).state_dict()
    return checkpoint(tmp_path, **{**TRAINING_STATE, "optimizer": optimizer.state_dict(),
                                   "scheduler": {**state, **scheduler}})


def diverged_checkpoint(tmp_path):
    path = checkpoint(tmp_path)
    ckpt = torch.load(path, weights_only=True)
    ckpt["state_dict"]["fc.weight"][0, 0] = float("nan")
    torch.save(ckpt, path)
    return path


def blocked_output_dir(tmp_path, folder_for="tb"):
    """An --output-dir where a folder of the run's is a file (found when it is written), or where one of its files
    is a folder (found at the start)."""
    folder = tmp_path / "blocked"
    folder.mkdir()
    if folder_for == "tb":
        (folder / "tb").touch()
    else:
        (folder / folder_for).mkdir()
    return ["--output-dir", folder]


TRAINING_STATE = {"epoch": 1, "scheduler": {}, "scaler": {}, "best_acc1": 0.0, "args": {}}
TORCH_SET_WRONG, TORCH_CACHE_IN_A_FILE = {"TORCH_COMPILE_DEBUG": "abc"}, {"TORCHINDUCTOR_CACHE_DIR": "/dev/null/c"}
TORCH_AT_FAULT = (r"^error: cannot import torch(vision)? \((invalid literal for int\(\) with base 10: 'abc'|"
                  r"\[Errno 20\] Not a directory: '/dev/null/c')\): fix what it names: a TORCH variable \(env \| "
                  r"grep TORCH\), or TORCHINDUCTOR_CACHE_DIR$")
TORCHRUN_ENV = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


# name: (processes, arguments given the dataset and a scratch folder, what the error line must say)
CASES = {
    "a value out of its range, on two ranks": (2, lambda d, t: [d, "-p", "0"],
                                                r"argument -p/--print-freq: 0 is out of range: give an integer >= 1"),
    "epochs 0 without -e": (1, lambda d, t: [d, "--epochs", "0"], r"--epochs 0 trains nothing: give at least 1"),
    "gpu decode of data that is not an image folder": (1, lambda d, t: ["--dummy", "--gpu-decode"],
                                                       r"--gpu-decode decodes image folders \(DATA/train, DATA/val\); "
                                                       r"this data is not one: leave --gpu-decode out"),
    "--dummy and --dataset": (1, lambda d, t: ["--dummy", "--dataset", "mine:table"],
                              r"^error: --dummy and --dataset both name the data: give one of them$"),
    "--dummy and a data folder": (1, lambda d, t: [d, "--dummy"],
                                  r"--dummy makes its own data, and .* names a folder: give one of them"),
    "missing data folder": (1, lambda d, t: [t / "nowhere"],
                            r"data folder '.*nowhere' not found: give a folder with train/ and val/"),
    "no val folder": (1, lambda d, t: [broken_copy(d, t, lambda x: shutil.rmtree(x / "val"))],
                      r"val not found: DIR must hold train/ and val/"),
    "a class folder in train/ only": (1, lambda d, t: [broken_copy(d, t, lambda x: shutil.rmtree(x / "val/class2"))],
                                      r"^error: build_datasets: its train and val sets have different "
                                      r"classes \(class2\): give both the same \(an image folder: the same class "
                                      r"folders\)"),
    "empty class folder": (1, lambda d, t: [broken_copy(d, t, lambda x: (x / "train" / "class9").mkdir())],
                           r"Found no valid file for the classes class9.*needs an image it can read$"),
    "a symbolic link that loops back": (1, lambda d, t: [broken_copy(d, t, lambda x: (x / "train" / "class1" / "up")
                                                          .symlink_to(".."))],
                                        r"^error: .*/train/class1/up/class0 is .*/train/class0 again, through a "
                                        r"symbolic link: the train set would hold its images twice; remove the link$"),
    "corrupt JPEG on one of two ranks": (2, lambda d, t: [broken_copy(d, t, lambda x: first_train_image(x)
                                                                      .write_bytes(b"junk"))],
                                         r"cannot read image .*class0/0000.JPEG .*replace or remove the file"),
    "truncated JPEG": (1, lambda d, t: [broken_copy(d, t, lambda x: first_train_image(x)
                                                    .write_bytes(first_train_image(x).read_bytes()[:300]))],
                       r"cannot read image .*class0/0000.JPEG \(.*[Tt]runcated.*\): replace or remove the file"),
    "a named pipe among the images": (1, lambda d, t: [broken_copy(d, t, lambda x: (first_train_image(x).unlink(),
                                                                                os.mkfifo(first_train_image(x))))],
                                      r"cannot read image .*class0/0000.JPEG \(not a file: a pipe, a device\): replace "
                                      r"or remove the file"),
    "an image too large to decode": (1, lambda d, t: [broken_copy(d, t, lambda x: Image.new("1", (14000, 14000))
                                                          .save(first_train_image(x), "PNG"))],
                                     r"cannot read image .*class0/0000.JPEG \(Image size \(196000000 pixels\) exceeds "
                                     r"limit .*\): replace or remove the file"),
    "unknown arch": (1, lambda d, t: [d, "-a", "resnet19"],
                     r"unknown --arch 'resnet19': use a torchvision classification model"),
    "dropout on a model without it": (1, lambda d, t: [d, "--dropout", "0"],
                                      r"--arch resnet18 does not take --dropout \(ResNet.*'dropout'\): drop it$"),
    "batch not divisible by world size": (2, lambda d, t: [d, "-b", "15"],
                                          r"--batch-size 15 is the global batch and must divide by the world size 2: "
                                          r"use e.g. 14"),
    "grad accumulation steps that do not divide a process's batch": (
        2, lambda d, t: [d, "-b", "16", "--grad-accum-steps", "3"],
        r"--grad-accum-steps 3 must divide each process's batch 8 \(-b 16 / 2 processes\)"),
    "a micro-batch of one for BatchNorm, on two ranks": (
        2, lambda d, t: [d, "-b", "4", "--grad-accum-steps", "2"],
        r"a BatchNorm layer got one value per channel in a training step \(input size torch.Size\(\[1, 512, 1, 1\]\)"
        r"\): give each process's \(micro-\)batch 2 or more samples \(a larger -b/--batch-size\), or larger inputs$"),
    "a batch larger than the machine's memory": (
        1, lambda d, t: [d, "-b", str(MEMORY // (3 * 32 * 32 * 4) + 1)],
        r"^error: -b \d+ at --crop-size 32: \d+ image\(s\) of 32x32 per process take \d+ GiB as floats, more than this "
        r"machine's \d+ GiB: give smaller -b, --crop-size$"),
    "a --val-resize larger than the machine's memory": (
        1, lambda d, t: [d, "--val-resize", str(math.isqrt(MEMORY // 12) + 1)],
        r"^error: --val-resize \d+: 1 image\(s\) of \d+x\d+ per process take \d+ GiB as floats, more than this "
        r"machine's \d+ GiB: give smaller --val-resize$"),
    "one class": (1, lambda d, t: [broken_copy(d, t, lambda x: [shutil.rmtree(folder) for split in ("train", "val")
                                                                 for folder in (x / split).iterdir()
                                                                 if folder.name != "class0"])],
                  r"build_datasets: its train set has 1 class, and a classifier needs 2 or more: give it the other "
                  r"classes \(ImageFolder: a folder each\), or --num-classes N"),
    "batch larger than the data": (1, lambda d, t: [d, "-b", "512"],
                                   r"192 training samples are fewer than one global batch of 512: lower -b"),
    "resume path missing": (1, lambda d, t: [d, "--resume", t / "none.pth.tar"],
                            r"--resume .*none.pth.tar: no such file"),
    "resume from a named pipe": (1, lambda d, t: [d, "--resume", named_pipe(t)],
                                 r"--resume .*pipe: .*pipe is not a file \(a pipe, a device\): give a checkpoint"),
    "a named pipe at --resume auto's checkpoint": (1, lambda d, t: [d, "--resume", "auto",
                                                                    *piped_output_dir(t, "checkpoint.pth.tar")],
                                                   r"--resume auto: .*piped/checkpoint.pth.tar is not a file \(a pipe, "
                                                   r"a device\): give a checkpoint, or move it away"),
    "a named pipe where the run writes a file": (1, lambda d, t: [d, *piped_output_dir(t, "metrics.jsonl")],
                                                 r"^error: .*piped/metrics.jsonl is not a file \(a pipe, a device\), "
                                                 r"where this run writes a file: move it away, or give another "
                                                 r"--output-dir$"),
    "-e with no weights to evaluate": (1, lambda d, t: [d, "-e"],
                                       r"^error: -e evaluates trained weights, and none are given: add --resume PATH "
                                       r"\(a checkpoint, or weights saved with torch.save\(model.state_dict\(\), "
                                       r"PATH\)\) or --pretrained$"),
    "-e --resume auto with no checkpoint": (2, lambda d, t: [d, "-e", "--resume", "auto"],
                                            r"-e --resume auto: --output-dir .*out holds no checkpoint to evaluate; "
                                            r"give the --output-dir of the run, or --resume PATH$"),
    "resume path a folder": (1, lambda d, t: [d, "--resume", t],
                             r"cannot load checkpoint .*: it is a folder, not a checkpoint file \(as "
                             r"fsdp_distributed.py saves: resume those with it\); give a file that a run saved, or "
                             r"move the folder away to start fresh"),
    "resume auto, the checkpoint a link to nothing": (
        1, lambda d, t: [d, *broken_checkpoint(t, lambda path: path.symlink_to("gone"))],
        r"cannot load checkpoint .*resumed/checkpoint.pth.tar \(.*No such file.*\): it is unreadable"),
    "resume auto, the checkpoint an empty file": (
        1, lambda d, t: [d, *broken_checkpoint(t, lambda path: path.write_bytes(b""))],
        r"cannot load checkpoint .*resumed/checkpoint.pth.tar \(.*\): it is unreadable"),
    "resume auto, the checkpoint a folder": (
        1, lambda d, t: [d, *broken_checkpoint(t, lambda path: path.mkdir())],
        r"cannot load checkpoint .*resumed/checkpoint.pth.tar: it is a folder, not a checkpoint file"),
    "resume checkpoint truncated": (1, lambda d, t: [d, "--resume", checkpoint(t, truncate=True)],
                                    r"cannot load checkpoint .*ckpt.pth.tar .*unreadable or truncated; "
                                    r"resume from another file"),
    "torchrun's variables half set": (1, lambda d, t: [d], r"WORLD_SIZE, MASTER_ADDR set but not RANK, LOCAL_RANK, "
                                                          r"MASTER_PORT: start the script with torchrun, or unset them",
                                      {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}),
    "LOCAL_RANK without RANK": (1, lambda d, t: [d], r"LOCAL_RANK set but not RANK, WORLD_SIZE, MASTER_ADDR, "
                                                    r"MASTER_PORT: start the script with torchrun",
                                {"LOCAL_RANK": "1"}),
    "resume from a pickled model": (1, lambda d, t: [d, "--resume", pickled_model(t)],
                                    r"cannot load checkpoint .*model.pth: it holds a pickled torchvision.models.resnet"
                                    r".ResNet, and checkpoints load as tensors only .*torch.save\(model.state_dict"
                                    r"\(\), PATH\), and evaluate those with -e$"),
    "resume checkpoint of other classes": (1, lambda d, t: [d, "--resume", checkpoint(t, num_classes=10)],
                                           r"ckpt.pth.tar has 10 classes, .*imagefolder0 has 4: resume with the data "
                                           r"it was trained on, or train without --resume"),
    "resume checkpoint of another script": (1, lambda d, t: [d, "--resume", checkpoint(t, arch="unet3d")],
                                            r"holds a unet3d model, not a torchvision classification model: it is "
                                            r"another script's checkpoint; resume it with that script"),
    "resume checkpoint without some weights": (1, lambda d, t: [d, "--resume", checkpoint(t, drop=("fc.bias",))],
                                               r"does not fit --arch resnet18: 1 weights missing \(e.g. fc.bias\); "
                                               r"resume from a checkpoint of this model"),
    "resume with another dropout": (1, lambda d, t: [d, "-a", "mobilenet_v3_small", "--resume",
                                                     checkpoint(t, arch="mobilenet_v3_small", args={"dropout": 0.5})],
                                    r"trained with --dropout 0.5, this run has the model's own dropout: continue it "
                                    r"with --dropout 0.5"),
    "resume from weights alone": (1, lambda d, t: [d, "--resume", checkpoint(t)],
                                  r"ckpt.pth.tar holds weights but no training state \(epoch, optimizer, scheduler, "
                                  r"scaler, best_acc1\): evaluate it with -e"),
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
                                         r"trained with --no-wd-norm-bias, this run has no --no-wd-norm-bias: "
                                         r"continue it with --no-wd-norm-bias"),
    "resume checkpoint with a part of another type": (1, lambda d, t: [d, "--resume", checkpoint(t, args="-b 16")],
                                                      r"ckpt.pth.tar: its args is a str, which these scripts never "
                                                      r"save: the file is damaged or made elsewhere"),
    "resume checkpoint whose weights are no tensors": (1, lambda d, t: [d, "--resume", checkpoint(
        t, drop=("fc.bias",), state_dict={"fc.weight": 1.0})], r"ckpt.pth.tar is not a checkpoint of these scripts "
                                                              r"\(no state_dict of named tensors\): resume from one"),
    "resume checkpoint whose optimizer state does not load": (
        1, lambda d, t: [d, "--resume", checkpoint(t, optimizer={"state": {}, "param_groups": []}, **TRAINING_STATE)],
        r"cannot resume from .*ckpt.pth.tar \(.*parameter groups\): the file is damaged or made elsewhere"),
    "resume checkpoint whose optimizer state has another shape": (
        1, lambda d, t: [d, "--resume", sgd_checkpoint(t, buffer=lambda p: torch.zeros(1))],
        r"cannot resume from .*ckpt.pth.tar \(its optimizer state momentum_buffer is unlike this run's\): the file is "
        r"damaged or made elsewhere"),
    "resume checkpoint whose scheduler state has another type": (
        1, lambda d, t: [d, "--resume", sgd_checkpoint(t, last_epoch="12")],
        r"cannot resume from .*ckpt.pth.tar \(its scheduler.last_epoch is unlike this run's\)"),
    "resume checkpoint at a step past any epoch": (1, lambda d, t: [d, "--resume", checkpoint(t, step=10**6)],
                                                   r"ckpt.pth.tar: its step is 1000000, which these scripts never "
                                                   r"save: the file is damaged or made elsewhere"),
    "resume checkpoint whose weights are not named": (1, lambda d, t: [d, "--resume", checkpoint(
        t, state_dict={0: torch.zeros(1)})], r"ckpt.pth.tar is not a checkpoint of these scripts \(no state_dict of "
                                            r"named tensors\)"),
    "evaluate a checkpoint of NaN weights": (1, lambda d, t: [d, "-e", "--resume", diverged_checkpoint(t)],
                                             r"ckpt.pth.tar holds NaN weights \(fc.weight\): the run had "
                                             r"diverged; use a checkpoint saved before"),
    "an output file that cannot be written": (1, lambda d, t: [d, *blocked_output_dir(t)],
                                              r"cannot write .*blocked/tb \(File exists\): give --output-dir a "
                                              r"folder where this run's files"),
    "a folder where the run writes a file": (1, lambda d, t: [d, *blocked_output_dir(t, "model_best.pth.tar")],
                                             r"^error: .*blocked/model_best.pth.tar is a folder, where this run writes "
                                             r"a file: move it away, or give another --output-dir$"),
    "a fresh run over an earlier run's checkpoint": (1, lambda d, t: [d, *earlier_run(t)],
                                                     r"--output-dir .*earlier holds the checkpoint of an earlier run "
                                                     r"\(checkpoint.pth.tar\), which this one would overwrite: "
                                                     r"continue that run with --resume auto \(by the script that saved "
                                                     r"it\), or give another --output-dir"),
    "a fresh run over fsdp_distributed.py's checkpoint": (1, lambda d, t: [d, *earlier_run(t, fsdp=True)],
                                                          r"holds the checkpoint of an earlier run \(checkpoint.dcp\), "
                                                          r"which this one would overwrite"),
    "torchrun's variables not numbers": (1, lambda d, t: [d], r"torchrun's variables are not numbers that fit "
                                                             r"together \(RANK='0', LOCAL_RANK='x', WORLD_SIZE='1', "
                                                             r"MASTER_PORT='29500'\)",
                                         {**TORCHRUN_ENV, "LOCAL_RANK": "x"}),
    "torchrun's port 0": (1, lambda d, t: [d], r"torchrun's variables are not numbers that fit together \(.*"
                                               r"MASTER_PORT='0'\)",
                          {**TORCHRUN_ENV, "LOCAL_RANK": "0", "MASTER_PORT": "0"}),
    "torchrun's rank past its world": (1, lambda d, t: [d], r"torchrun's variables are not numbers that fit together "
                                                           r"\(RANK='3', LOCAL_RANK='0', WORLD_SIZE='1'",
                                       {**TORCHRUN_ENV, "RANK": "3", "LOCAL_RANK": "0"}),
    "a rendezvous address that does not resolve": (1, lambda d, t: [d], r"MASTER_ADDR=no.such.host.invalid does not "
                                                                       r"resolve \(.*\): give the address of the node",
                                                   {**TORCHRUN_ENV, "LOCAL_RANK": "0",
                                                    "MASTER_ADDR": "no.such.host.invalid"}),
    "a rendezvous store nobody serves": (1, lambda d, t: [d, "--dist-timeout", "3"],
                                         r"cannot reach the rendezvous store within --dist-timeout 3s \(.*trying to "
                                         r"connect to .*\): start the node of rank 0 first",
                                         {**TORCHRUN_ENV, "RANK": "1", "LOCAL_RANK": "0", "WORLD_SIZE": "2",
                                          "MASTER_PORT": str(free_port())}),
    "a backend torch lacks": (1, lambda d, t: [d, "--dist-backend", "glo"],
                              r"--dist-backend glo: glo is not a backend of this torch; leave the flag out"),
    "nccl without a GPU, on two ranks": (2, lambda d, t: [d, "--dist-backend", "nccl"],
                                         r"--dist-backend nccl: nccl needs GPUs; leave the flag out \(nccl with GPUs, "
                                         r"gloo without\), or give gloo"),
    "a seed too large for torch": (1, lambda d, t: [d, "--seed", str(2**64)],
                                   r"argument --seed: 18446744073709551616 is too large: give an integer >= 0, below "
                                   r"2\*\*31"),
    "resume checkpoint of another arch": (1, lambda d, t: [d, "--resume", checkpoint(t, arch="resnet50")],
                                          r"ckpt.pth.tar holds a resnet50 model, not resnet18: pass -a resnet50"),
    "loss becomes NaN": (2, lambda d, t: [d, "--lr", "1e9", "-p", "2"],
                         r"loss became NaN/inf at epoch 0 step \d+; stopped without saving it"),
    "pretrained weights out of reach": (1, lambda d, t: [d, "--pretrained"],
                                        r"cannot load pretrained weights .*resnet18-.*\.pth.*"
                                        r"put the file into /nonexistent/hub/checkpoints/$",
                                        {"TORCH_HOME": "/nonexistent"}),
    # torch reads the one and makes the other as it loads: the line blamed the install (the first names no variable)
    "a variable torch reads set to a value it does not take": (1, lambda d, t: [d], TORCH_AT_FAULT, TORCH_SET_WRONG),
    "a cache folder torch cannot make": (1, lambda d, t: [d], TORCH_AT_FAULT, TORCH_CACHE_IN_A_FILE),
    # Python decodes such a path with surrogates, which TensorBoard's writer cannot encode: a traceback
    "a non-ASCII output folder where the locale is not UTF-8": (1, lambda d, t: [d, "--output-dir", t / "out_ü"],
                                                                r"a path holds bytes this locale cannot decode \(.*"
                                                                r"surrogates not allowed\): set PYTHONUTF8=1 or a "
                                                                r"UTF-8 locale \(LANG=C.UTF-8\), or use ASCII paths$",
                                                                {"LANG": "C", "LC_ALL": "C", "PYTHONUTF8": "0"}),
}


SPAWN, DATAPARALLEL, SLURM = "multiprocessing_distributed.py", "dataparallel.py", "distributed_slurm_main.py"
FSDP = "fsdp_distributed.py"
# The siblings run the same checks (byte-identical helpers): here each gets one case per way an error
# surfaces - found by the parent or by one process, by every rank alike, by the rank that reads a file,
# or mid-training.
SIBLINGS = {SPAWN: ["a value out of its range, on two ranks", "missing data folder",
                    "batch not divisible by world size", "corrupt JPEG on one of two ranks",
                    "resume checkpoint of another arch", "loss becomes NaN"],
            DATAPARALLEL: ["missing data folder", "truncated JPEG", "resume checkpoint truncated",
                           "resume auto, the checkpoint a link to nothing"],
            SLURM: ["corrupt JPEG on one of two ranks", "a value out of its range, on two ranks"],
            # its checkpoints are its own: tests/test_fsdp_distributed.py has those cases
            FSDP: ["a value out of its range, on two ranks", "batch not divisible by world size",
                   "corrupt JPEG on one of two ranks", "loss becomes NaN"]}


def launch(script, processes, *args, env=None):
    if script == SPAWN:
        return spawn(script, processes, *args, env=env)
    if script == SLURM and processes > 1:  # outside Slurm, one task that starts its processes itself
        return python(script, "--procs-per-node", processes, *args, env=env)
    return python(script, *args, env=env) if processes == 1 else torchrun(script, processes, *args, env=env)


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
    processes, make_args, expected, *env = CASES[name]
    args = [*FAST, "--epochs", "1", "--output-dir", tmp_path / "out", *make_args(image_data, tmp_path)]
    job = launch(script, processes, *args, env=env[0] if env else None).finish(timeout=120)
    assert_one_clear_line(job, expected, launcher_reports=processes > 1 and script in (SCRIPT, FSDP))
    assert not (tmp_path / "out" / "checkpoint.pth.tar").exists()


SLOW_RANK_0 = """
import os, runpy, sys, time
import torch
if os.environ.get("ONE_FAKE_GPU"):  # this machine has none: make torch see one, so rank 1 lacks its own
    torch.cuda.is_available, torch.cuda.device_count, torch.cuda.set_device = lambda: True, lambda: 1, lambda d: None
if os.environ["LOCAL_RANK"] == "0":
    time.sleep(3)
runpy.run_path(sys.argv.pop(1), run_name="__main__")
"""


def slow_rank_0(script, tmp_path, *args, env=None):
    """torchrun with 2 processes, local rank 0 (the reporting rank) starting 3 s after the other."""
    wrapper = tmp_path / "slow_rank_0.py"
    wrapper.write_text(SLOW_RANK_0)
    return torchrun(wrapper, 2, script, *FAST, "--epochs", "1", "--output-dir", tmp_path / "out", *args,
                    env=env).finish(120)


def test_the_reporting_rank_prints_even_when_a_silent_rank_fails_first(image_data, tmp_path):
    """Local rank 0 reports; here it starts last. The other rank finds the error first and must not exit
    before rank 0 has printed, since torchrun stops every process as soon as one exits."""
    _, make_args, expected = CASES["batch not divisible by world size"]
    assert_one_clear_line(slow_rank_0(SCRIPT, tmp_path, *make_args(image_data, tmp_path)), expected,
                          launcher_reports=True)


@pytest.mark.parametrize("script", [SCRIPT, "apex_distributed.py"])
def test_more_processes_than_gpus_is_reported_by_the_rank_without_one(script, image_data, tmp_path):
    """Only local ranks >= the GPU count meet this, so they report it themselves, not local rank 0."""
    job = slow_rank_0(script, tmp_path, image_data, env={"ONE_FAKE_GPU": "1"})
    assert_one_clear_line(job, r"LOCAL_RANK 1 but only 1 GPUs are visible: start at most that many processes per node "
                               r"\(--nproc_per_node\)", launcher_reports=True)


def test_spawn_rendezvous_port_already_in_use(image_data, tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        job = spawn(SPAWN, 2, image_data, *FAST, "--dist-url", f"tcp://127.0.0.1:{port}",
                    "--output-dir", tmp_path).finish(60)
    assert_one_clear_line(job, rf"--dist-url tcp://127.0.0.1:{port}: cannot listen on port {port} \(address already "
                               r"in use\); another job may use it: choose a free port")


@pytest.mark.parametrize("url, nodes, expected", [
    ("tcp://127.0.0.1:99999", 1, r"give tcp://HOST:PORT, HOST being node 0's address, PORT a number below 65536"),
    ("tcp://127.0.0.1:0", 2, r"port 0 is a free port of this node's, and the 2 nodes meet at one port: give PORT "
                             r"from 1 to 65535$"),
    ("tcp://no.such.host.invalid:29500", 1, r"no.such.host.invalid does not resolve \(.*\): give the address of the "
                                            r"node of rank 0")])
def test_spawn_dist_url_that_cannot_be_met_at_is_one_clear_line(url, nodes, expected, image_data, tmp_path):
    """A port past 65535 was a traceback; a host that does not resolve, a wait until --dist-timeout (30 minutes), as
    was port 0 on several nodes (each listened on a free port of its own)."""
    job = spawn(SPAWN, 2, image_data, *FAST, "--dist-url", url, "--world-size", nodes, "--output-dir", tmp_path
                ).finish(60)
    assert_one_clear_line(job, rf"--dist-url {re.escape(url)}: {expected}")


def test_a_batch_that_does_not_fit_in_memory_is_one_line_naming_the_size(tmp_path):
    """Out of memory was a traceback. Here the CPU's: --benchmark's batch of 2500 images of 224 px passes the check
    against the machine's memory (1.5 GB as floats), and the first convolution's 8 GB output is refused by the
    address-space limit that prlimit sets, before much is touched; the GPU's: tests/gpu."""
    job = Job(["prlimit", f"--as={8 << 30}", sys.executable, ROOT / SCRIPT, "--dummy", "--dummy-size", "2500",
               "--benchmark", "1", "-b", "2500", "-j", "0", "--output-dir", tmp_path]).finish(120)
    assert_one_clear_line(job, r"^error: out of memory on this rank \(you tried to allocate \d+ bytes\): use a "
                               r"smaller -b/--batch-size \(--grad-accum-steps K: the same global batch in K passes\)$")


def test_a_limit_on_open_files_too_low_for_the_loader_workers_is_one_line(image_data, tmp_path):
    """Each loader worker holds pipes, and a batch crosses as file descriptors: under a low `ulimit -n` a fork, or
    a batch, failed in a traceback. torch's own threads and finalizers may still print theirs; the script none."""
    job = Job(["prlimit", "--nofile=24", sys.executable, ROOT / SCRIPT, image_data, *FAST, "-j", "2", "--epochs", "1",
               "--output-dir", tmp_path]).finish(120)
    assert_one_clear_line(job, r"^error: this process has reached its limit of open files \(ulimit -n\): raise it "
                               r"where the job starts \(ulimit -n 65536\), or use fewer -j/--workers$",
                          launcher_reports=True)  # (the rest checked here: torch's tracebacks allowed)
    assert job.returncode == 2 and f'File "{ROOT / SCRIPT}"' not in job.output, job.output


def test_a_thread_that_cannot_start_is_one_line(image_data, tmp_path):
    """A thread's stack as large as half the address space the process may have: the loader's first thread cannot
    start, as under a limit on processes (ulimit -u, a container's pids limit: neither binds root, who runs this),
    which failed alike, in a traceback. Nothing more after the line: the loader's cleanup failed in tracebacks too."""
    job = Job(["prlimit", f"--stack={4 << 30}", f"--as={8 << 30}", sys.executable, ROOT / SCRIPT, image_data, *FAST,
               "-j", "2", "--epochs", "1", "--output-dir", tmp_path]).finish(120)
    assert_one_clear_line(job, r"^error: this process cannot start another process or thread \(a limit on processes: "
                               r"ulimit -u, .*\): raise it where the job starts, or use fewer -j/--workers$")


def test_spawn_batch_that_does_not_divide_is_refused_before_a_process_starts(image_data, tmp_path):
    """Checked in the parent: 256 workers, each importing torch to find the same, took minutes on 2 cores."""
    job = spawn(SPAWN, 256, image_data, *FAST, "--output-dir", tmp_path).finish(30)
    assert_one_clear_line(job, r"--batch-size 16 is the global batch and must divide by the world size 256: use e\.g\. "
                               r"256$")


def test_spawn_node_that_never_joins_ends_the_job_within_the_timeout(image_data, tmp_path):
    url = f"tcp://127.0.0.1:{free_port()}"
    job = spawn(SPAWN, 2, image_data, *FAST, "--world-size", "2", "--node-rank", "0", "--dist-url", url,
                "--dist-timeout", "5", "--output-dir", tmp_path).finish(60)
    assert_one_clear_line(job, rf"only 2 of 4 ranks arrived at {url} within --dist-timeout 5s: start every node "
                               r"\(--node-rank 0 to 1\) with the same --dist-url and --world-size 2")


@pytest.mark.parametrize("script", [SPAWN, DATAPARALLEL])
def test_gpus_on_a_machine_without_cuda(script, image_data, tmp_path):
    job = python(script, image_data, *FAST, "--gpus", "0,2", "--output-dir", tmp_path).finish(60)
    assert_one_clear_line(job, r"--gpus 0,2: CUDA is not available on this machine; drop --gpus to train on the CPU")


@pytest.mark.parametrize("script", [SPAWN, DATAPARALLEL])
def test_gpus_naming_one_gpu_twice(script, image_data, tmp_path):
    """Two processes (or DataParallel replicas) on one GPU: NCCL's "Duplicate GPU detected" deep in a
    traceback before; checked before CUDA is looked at, so this machine without GPUs sees it too."""
    job = python(script, image_data, *FAST, "--gpus", "1,0,1", "--output-dir", tmp_path).finish(60)
    assert_one_clear_line(job, r"--gpus 1,0,1 names GPU 1 more than once: list each GPU once")


@pytest.mark.parametrize("script, case", [(SCRIPT, "a file"), (SCRIPT, "under a file"), (SCRIPT, "read-only"),
                                          ("unet3d_apex.py", "a file")])
def test_an_output_folder_that_cannot_be_used_is_one_clear_line(script, case, small_disk, image_data, tmp_path):
    (tmp_path / "file").write_text("")
    folder = {"a file": tmp_path / "file", "under a file": tmp_path / "file" / "out",
              "read-only": small_disk("1m", read_only=True) if case == "read-only" else None}[case]
    reason = {"a file": "a file of that name is in the way", "under a file": "Not a directory",
              "read-only": "Read-only file system"}[case]
    data = [image_data, *FAST] if script == SCRIPT else ["--synthetic"]  # stopped before any data is read
    job = python(script, *data, "--epochs", "1", "--output-dir", folder).finish(120)
    assert_one_clear_line(job, rf"--output-dir {re.escape(str(folder))} cannot be used \({reason}\): give a folder "
                               r"this user can write to")


def test_a_disk_that_fills_up_keeps_the_last_checkpoint_and_says_how_much_room_is_needed(small_disk, image_data):
    """resnet18's checkpoint (weights and momentum) takes 85 MiB: epoch 0 writes it and its copy as the best,
    epoch 1 runs out of room while it writes the next beside them."""
    out = small_disk("200m")
    job = python(SCRIPT, image_data, *FAST, "--epochs", "2", "--output-dir", out).finish(120)
    assert_one_clear_line(job, rf"cannot write a checkpoint to {out} \(no space left\): a checkpoint takes about "
                               r"85 MiB \(twice that while it replaces the last one\), \d+ MiB are free there; make "
                               r"room or give another --output-dir \(the last checkpoint is kept\)")
    assert load(out / "checkpoint.pth.tar")["epoch"] == 1
    assert sorted(p.name for p in out.iterdir()) == OUTPUT_FILES  # no partial file left


def test_a_read_only_tensorboard_folder_is_one_line_without_the_writer_threads_traceback(small_disk, image_data,
                                                                                         tmp_path):
    """TensorBoard's writer thread meets the error first and prints its traceback, then the training process meets
    it again at the flush (and says it in one line)."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "tb").symlink_to(small_disk("1m", read_only=True))
    job = python(SCRIPT, image_data, *FAST, "--epochs", "1", "--output-dir", out).finish(120)
    assert_one_clear_line(job, r"cannot write .*/tb/events.out.tfevents.* \(Read-only file system\): give --output-dir "
                               r"a folder where this run's files")


@pytest.mark.parametrize("args", [["nowhere"], ["--no-such-flag"]])
def test_bad_input_exits_2_when_stderr_cannot_take_the_line(args, tmp_path):
    """stderr on a full disk (a job's log file): the line is lost, not the exit code, which was 1 (print's error)."""
    with open("/dev/full", "w") as full:
        done = subprocess.run([sys.executable, ROOT / SCRIPT, *args, "--output-dir", tmp_path], stdout=full,
                              stderr=full, timeout=120)
    assert done.returncode == 2


FULL_AT_METRICS = """
def linear(num_classes):
    resource.setrlimit(resource.RLIMIT_FSIZE, (2**20, 2**20))  # no file past 1 MiB: EFBIG, as a disk that is full
    return torch.nn.Linear(20, num_classes)
"""


def test_a_metrics_row_that_cannot_be_written_is_one_clear_line_after_the_checkpoint(tmp_path):
    """The append to metrics.jsonl fails as it is flushed, in an error that names no file (a full disk, a quota, a
    file size limit): it used to end in a traceback."""
    flags, env = own_rows(tmp_path, FULL_AT_METRICS)
    out = tmp_path / "out"
    out.mkdir()
    (out / "metrics.jsonl").write_text("\n" * 2**20)
    job = python(SCRIPT, *flags, "-j", "2", "--epochs", "1", "--output-dir", out, env=env).finish(120)
    assert_one_clear_line(job, rf"cannot write {out}/metrics.jsonl \(File too large\): give --output-dir a folder "
                               r"where this run's files \(checkpoints, metrics.jsonl, tb/\) can be written")
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
