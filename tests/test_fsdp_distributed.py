"""fsdp_distributed.py under torchrun on CPU (gloo): the weights distributed.py reaches, sharded checkpoints that
resume on another number of processes and after a preemption, full weights that distributed.py evaluates alike,
hybrid sharding over two nodes, and its own bad input."""
import os
import re
import shutil
import signal
from types import SimpleNamespace

import pytest
import torch
import torchvision

from conftest import (FAST, LAUNCHER_FAILED, NO_BN, assert_same_tensors, error_lines, import_script, load, metrics, ok,
                      own_rows, python, torchrun, two_nodes)
from test_bad_input import assert_one_clear_line

SCRIPT = "fsdp_distributed.py"
# no BatchNorm, no dropout (the weights do not depend on how a batch is split), 12 images a step: 1, 2 and 3
# processes split it evenly; 16 steps an epoch; a progress line every step to wait for
BASE = [*NO_BN, "-b", "12", "--deterministic", "-p", "1"]
# SGD with the loop's flags (DTensor gradients clipped, reduce-scatters held back over micro-batches) and loader
# workers; AdamW plain
OPTIMIZERS = {"sgd": ["--opt", "sgd", "-j", "2", "--grad-accum-steps", "2", "--clip-grad-norm", "0.05",
                      "--label-smoothing", "0.1"],
              "adamw": ["--opt", "adamw", "--lr", "0.001"]}
SGD = [*BASE, *OPTIMIZERS["sgd"]]


def export(out):
    return out / "full.pth.tar"


def fsdp(nproc, out, *args, **kwargs):
    """fsdp_distributed.py on nproc processes, writing its full weights to export(out) when training ends."""
    return torchrun(SCRIPT, nproc, *args, "--output-dir", out, "--export", export(out), **kwargs)


def weights(out):
    return load(export(out))["state_dict"]


@pytest.fixture(scope="module")
def pairs(image_data, tmp_path_factory):
    """pairs(opt): one epoch of distributed.py and of fsdp_distributed.py, 2 processes each, same seed and global
    batch, run once for the module."""
    done = {}

    def pair(opt):
        if opt not in done:
            args = [image_data, *BASE, *OPTIMIZERS[opt]]
            ddp, sharded = (tmp_path_factory.mktemp(f"{name}_{opt}") for name in ("ddp", "fsdp"))
            jobs = [torchrun("distributed.py", 2, *args, "--output-dir", ddp), fsdp(2, sharded, *args)]
            for job in jobs:
                ok(job)
            done[opt] = SimpleNamespace(opt=opt, args=args, ddp=ddp, out=sharded, job=jobs[1])
        return done[opt]

    return pair


@pytest.fixture(scope="module")
def two_epochs(image_data, tmp_path_factory):
    """fsdp_distributed.py, 2 processes, 2 epochs without a stop: what resumed runs must equal."""
    out = tmp_path_factory.mktemp("fsdp_two_epochs")
    ok(fsdp(2, out, image_data, *SGD, "--epochs", "2"))
    return weights(out)


def copy_of(out, tmp_path):
    """A copy of a finished run's --output-dir to go on from (its checkpoint link points into the copy)."""
    shutil.copytree(out, tmp_path / "out", symlinks=True)
    return tmp_path / "out"


@pytest.mark.parametrize("opt", list(OPTIMIZERS))
@pytest.mark.xdist_group("fsdp_references")
def test_the_sharded_model_ends_with_the_weights_of_distributed(opt, pairs):
    """The same training as DDP's, sharded: all-gathered weights, reduce-scattered gradients (averaged: with gloo
    some torch releases summed them, pytorch/pytorch#162338, and this pins the torch in use), SGD and AdamW on
    each rank's half of every tensor, clipping by the norm over both halves, accumulation with the
    reduce-scatter held back until the last micro-batch."""
    pair = pairs(opt)
    assert "FSDP: 10 blocks and the root sharded over 2 processes (shard), reshard after forward on" in pair.job.output
    ours, theirs = weights(pair.out), load(pair.ddp / "checkpoint.pth.tar")["state_dict"]
    assert_same_tensors(ours, theirs, exact=False)
    torch.manual_seed(0)
    initial = torchvision.models.squeezenet1_1(num_classes=4, dropout=0.0).state_dict()
    assert not torch.allclose(initial["classifier.1.weight"], ours["classifier.1.weight"])  # it did train
    ours, theirs = metrics(pair.out)[0], metrics(pair.ddp)[0]
    assert ours.keys() == theirs.keys()
    for key in ours.keys() - {"epoch", "img_per_s", "seconds"}:
        assert ours[key] == pytest.approx(theirs[key], rel=1e-5), key


@pytest.mark.parametrize("opt", list(OPTIMIZERS))
@pytest.mark.xdist_group("fsdp_references")
def test_the_checkpoint_is_a_folder_of_shards_and_model_best_holds_the_full_weights(opt, pairs):
    pair = pairs(opt)
    link = pair.out / "checkpoint.dcp"
    assert link.is_symlink() and sorted(os.listdir(pair.out)) == sorted(
        ["checkpoint.dcp", os.readlink(link), "full.pth.tar", "metrics.jsonl", "model_best.pth.tar", "run.lock", "tb"])
    assert sorted(os.listdir(link)) == [".metadata", "__0_0.distcp", "__1_0.distcp", "train_state.pt"]
    state = load(link / "train_state.pt")
    assert set(state) == {"epoch", "step", "arch", "scheduler", "scaler", "best_acc1", "args", "world_size",
                          "rng_states", "train_sums", "train_samples"}
    assert (state["epoch"], state["step"], state["world_size"], len(state["rng_states"])) == (1, 0, 2, 2)
    best = load(pair.out / "model_best.pth.tar")
    assert set(best) == {"epoch", "arch", "state_dict", "best_acc1", "args"}
    assert_same_tensors(best["state_dict"], weights(pair.out))


@pytest.mark.parametrize("opt", list(OPTIMIZERS))
@pytest.mark.xdist_group("fsdp_references")
def test_distributed_evaluates_the_exported_weights_to_the_numbers_fsdp_printed(opt, pairs):
    pair = pairs(opt)
    job = ok(torchrun("distributed.py", 2, *pair.args, "-e", "--resume", export(pair.out)))
    found = re.search(r"val: loss ([\d.]+) .*\(correct1 (\d+), correct5 (\d+), images (\d+)\)", job.output)
    loss, correct1, correct5, count = float(found[1]), *(int(found[i]) for i in (2, 3, 4))
    row = metrics(pair.out)[-1]
    assert (100 * correct1 / count, 100 * correct5 / count) == (row["val_acc1"], row["val_acc5"])
    assert loss == pytest.approx(row["val_loss"], abs=1e-6)  # printed to 6 places


@pytest.mark.parametrize("nproc", [1, 3])
@pytest.mark.xdist_group("fsdp_references")
def test_a_sharded_checkpoint_of_2_processes_resumes_on(nproc, pairs, two_epochs, image_data, tmp_path):
    """torch.distributed.checkpoint reshards: each of nproc ranks reads its part of the 2 ranks' shards."""
    out = copy_of(pairs("sgd").out, tmp_path)
    job = ok(fsdp(nproc, out, image_data, *SGD, "--epochs", "2", "--resume", "auto"))
    assert f"resumed from {out / 'checkpoint.dcp'} (epoch 1, step 0), world size 2 -> {nproc}" in job.output
    assert_same_tensors(weights(out), two_epochs, exact=False)


@pytest.mark.xdist_group("fsdp_references")
def test_sigterm_to_torchrun_mid_epoch_then_resume_auto_equals_an_uninterrupted_run(image_data, tmp_path):
    """SIGTERM to torchrun, as `kill` or a scheduler sends it, with loader workers: every rank writes its shards at
    the step they agreed on; --resume auto goes on from there to the weights and BatchNorm statistics (resnet18's,
    which each rank keeps its own of) of a run that never stopped."""
    run = [*FAST, "-a", "resnet18", "-b", "12", "--deterministic", "-p", "1", *OPTIMIZERS["sgd"], "--epochs", "1"]
    uninterrupted = tmp_path / "uninterrupted"
    ok(fsdp(2, uninterrupted, image_data, *run))
    out = tmp_path / "out"
    job = fsdp(2, out, image_data, *run)
    job.wait_for_line("Epoch 0 [ 3/16]")
    job.proc.send_signal(signal.SIGTERM)
    job.finish()
    assert job.returncode == LAUNCHER_FAILED, job.output
    stop = re.search(r"preempted: saved .*checkpoint.dcp at epoch 0 step (\d+);", job.output)
    assert stop and 0 < int(stop[1]) < 16, job.output
    assert not export(out).exists() and not (out / "metrics.jsonl").exists()
    resumed = ok(fsdp(2, out, image_data, *run, "--resume", "auto"))
    assert f"(epoch 0, step {stop[1]})" in resumed.output
    assert_same_tensors(weights(out), weights(uninterrupted))
    assert len([name for name in os.listdir(out) if name.startswith("checkpoint.dcp.")]) == 1  # the old ones gone


@pytest.mark.xdist_group("fsdp_references")
def test_replicate_nodes_shards_within_each_node_and_replicates_across_them(pairs, image_data, tmp_path):
    """Two nodes of one process each (two torchrun agents, as on two hosts), a 2-D mesh: the gradients are
    all-reduced across the nodes; the weights are those of one node sharding over both."""
    jobs = two_nodes(SCRIPT, image_data, *SGD, "--replicate-nodes", "--output-dir", tmp_path / "out",
                     "--export", tmp_path / "full.pth.tar")
    for job in jobs:
        ok(job)
    assert "sharded over 2x1 processes (replicate, shard)" in jobs[0].output
    assert_same_tensors(load(tmp_path / "full.pth.tar")["state_dict"], weights(pairs("sgd").out), exact=False)


# name: (processes, arguments given a finished run's output copy and a scratch folder, what the error line says)
BAD = {
    "--model-ema": (1, lambda out, t: ["--model-ema"], r"--model-ema: fsdp_distributed.py keeps no whole copy"),
    "--compile": (1, lambda out, t: ["--compile"], r"--compile: inductor fails on FSDP2's hooks"),
    "a file of full weights to train on": (1, lambda out, t: ["--resume", out / "model_best.pth.tar"],
                                           r"model_best.pth.tar is a file: fsdp_distributed.py resumes training "
                                           r"from its folders of shards \(checkpoint.dcp\); evaluate a file of "
                                           r"full weights with -e"),
}


@pytest.mark.parametrize("name", BAD)
@pytest.mark.xdist_group("fsdp_references")
def test_bad_input_gets_one_clear_line(name, pairs, image_data, tmp_path):
    processes, make_args, expected = BAD[name]
    out = copy_of(pairs("sgd").out, tmp_path)
    args = [image_data, *SGD, "--epochs", "2", "--output-dir", tmp_path / "fresh", *make_args(out, tmp_path)]
    job = (torchrun(SCRIPT, processes, *args) if processes > 1 else python(SCRIPT, *args)).finish(timeout=120)
    assert_one_clear_line(job, expected, launcher_reports=processes > 1)
    assert os.readlink(out / "checkpoint.dcp") == os.readlink(pairs("sgd").out / "checkpoint.dcp")  # kept


FSDP = import_script(SCRIPT)


@pytest.mark.parametrize("arch", torchvision.models.list_models(module=torchvision.models))
def test_every_arch_is_cut_into_groups_that_leave_the_root_almost_nothing(arch):
    """The block rule, on each torchvision classifier: a process holds a whole group's weights while it computes
    it, so the root group (gathered for the whole step) must be small."""
    try:
        with torch.device("meta"):  # shapes without memory
            model = torchvision.models.get_model(arch, num_classes=10)
    except NotImplementedError:  # regnet_* compute their widths with tensors
        model = torchvision.models.get_model(arch, num_classes=10)
    grouped = {id(p) for block in FSDP.blocks(model) for p in block.parameters()}
    root = sum(p.numel() for p in model.parameters() if id(p) not in grouped)
    assert len(FSDP.blocks(model)) >= 4 and root <= 0.05 * sum(p.numel() for p in model.parameters())


@pytest.mark.xdist_group("fsdp_references")
def test_a_full_disk_while_the_shards_are_written_keeps_the_last_checkpoint(pairs, small_disk, image_data):
    """The next checkpoint folder does not fit beside the last: the save fails on every rank, one line says so,
    the half-written folder is removed, and the link still leads to the last checkpoint, which resumes."""
    finished = pairs("sgd").out
    size = sum(f.stat().st_size for f in (finished / "checkpoint.dcp").iterdir())
    used = sum(f.stat().st_size for f in finished.rglob("*") if f.is_file() and not f.is_symlink())
    out = small_disk(f"{(used + size // 2) // 1024 + 64}k")
    shutil.copytree(finished, out, symlinks=True, dirs_exist_ok=True)
    before = sorted(os.listdir(out))
    job = torchrun(SCRIPT, 2, image_data, *SGD, "--epochs", "2", "--resume", "auto", "--output-dir", out).finish(180)
    assert_one_clear_line(job, rf"cannot write a checkpoint to {out} \(.*\): each rank's shards take about \d+ MiB, "
                               r"\d+ MiB are free there; make room or give another --output-dir \(the last checkpoint "
                               r"is kept\)", launcher_reports=True)
    assert sorted(os.listdir(out)) == before
    ok(torchrun(SCRIPT, 2, image_data, *SGD, "-e", "--resume", out / "checkpoint.dcp"))


DIES_IN_SAVE = """
def linear(num_classes):
    model = torch.nn.Linear(20, num_classes)
    def die(module, prefix, keep_vars):  # rank 1, as it writes its first shards
        if os.environ["RANK"] == "1":
            os.fsync = lambda fd: os.kill(os.getpid(), signal.SIGKILL)
    model.register_state_dict_pre_hook(die)
    return model
"""


def test_a_peer_killed_as_the_shards_are_written_is_no_full_disk(tmp_path):
    """Rank 1 killed (the OOM killer, a node lost) as it writes its shards: rank 0's collective fails with gloo's
    "connection reset", which used to be told as a checkpoint that could not be written (the disk)."""
    flags, env = own_rows(tmp_path, DIES_IN_SAVE)
    job = torchrun(SCRIPT, 2, *flags, "--epochs", "1", "--output-dir", tmp_path / "out", env=env).finish(120)
    assert job.returncode != 0 and "cannot write a checkpoint" not in job.output, job.output
    assert [line[:45] for line in error_lines(job.output)] == ["error: a peer ended, so this rank stops too ("], \
        job.output
    assert not (tmp_path / "out" / "checkpoint.dcp").exists()  # (the half-written folder: the next save removes it)


NO_EMPTY_BATCHES = """
import runpy, sys, torch
def refuse(module, inputs):
    if inputs and isinstance(inputs[0], torch.Tensor) and inputs[0].shape[0] == 0:
        raise RuntimeError(f"{type(module).__name__} was given a batch of 0 rows")
torch.nn.modules.module.register_module_forward_pre_hook(refuse)
runpy.run_path(sys.argv.pop(1), run_name="__main__")
"""


@pytest.mark.xdist_group("fsdp_references")
def test_evaluation_never_gives_the_model_a_batch_of_0_rows(pairs, tmp_path):
    """With -b 4 the 101 validation images are 26 batches on rank 0 and 25 on rank 1, which runs one more forward
    (a collective) whose output it drops: on one input, never on none (CUDA's flash attention rejects a batch of 0,
    pytorch/pytorch#133780). The numbers are those the training run printed."""
    pair = pairs("sgd")
    wrapper = tmp_path / "no_empty_batches.py"
    wrapper.write_text(NO_EMPTY_BATCHES)
    job = ok(torchrun(wrapper, 2, SCRIPT, *pair.args, "-b", "4", "-e", "--resume", pair.out / "checkpoint.dcp"))
    found = re.search(r"val: loss ([\d.]+) acc1 ([\d.]+) ", job.output)
    assert found, job.output
    row = metrics(pair.out)[-1]
    assert (float(found[1]), float(found[2])) == pytest.approx((row["val_loss"], row["val_acc1"]), abs=1e-3)
