"""Your own data and model, the way a user brings them: a script copied alone into a project folder next to the
user's module, run with --arch/--dataset MODULE:FUNCTION (or with build_model and build_datasets edited), under
torchrun, spawn and FSDP, preempted and resumed, evaluated; bad data as one clear line, a model that does not take
the data as torch's own error."""
import re
import shutil
import signal

import numpy as np
import pytest

from conftest import (LAUNCHER_FAILED, assert_preempted, assert_same_run, load, metrics, ok, python, spawn, torchrun)
from test_bad_input import assert_one_clear_line

# the user's module: nothing from torchvision, no Sequential or ModuleList (FSDP shards it by its layers)
USER_MODULE = '''
import os
import time

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset


class Table(Dataset):
    """Rows of 20 float features, 3 classes, each row slow to read (as from a disk: preemption lands mid-epoch)."""

    def __init__(self, size, seed):
        g = torch.Generator().manual_seed(seed)
        self.labels = torch.arange(size) % 3
        self.rows = torch.randn(size, 20, generator=g) + nn.functional.one_hot(self.labels, 20).float() * 3
        self.num_classes = 3

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        time.sleep(0.005)
        return self.rows[index], int(self.labels[index])


class MLP(nn.Module):
    def __init__(self, num_classes, features=20):
        super().__init__()
        self.hidden = nn.Linear(features, 32)
        self.out = nn.Linear(32, num_classes)

    def forward(self, x):
        return self.out(torch.relu(self.hidden(x)))


def table(args):
    return Table(192, 0), Table(40, 1)


def mlp(num_classes):
    return MLP(num_classes)


def wide_mlp(num_classes):
    return MLP(num_classes, features=30)


class Images(Dataset):
    """uint8 RGB images from an .npz: the repository crops and normalizes them."""

    def __init__(self, path, split):
        data = np.load(path)
        self.images, self.labels = torch.from_numpy(data[f"{split}_x"]), torch.from_numpy(data[f"{split}_y"])
        self.classes = list(data["classes"])

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        return self.images[index], int(self.labels[index])


def npz_images(args):
    return Images(args.data, "train"), Images(args.data, "val")


class CNN(nn.Module):
    def __init__(self, num_classes):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.fc = nn.Linear(8, num_classes)

    def forward(self, x):
        return self.fc(torch.relu(self.conv(x)).mean((2, 3)))


def cnn(num_classes):
    return CNN(num_classes)


def compiled_mlp(num_classes):
    return torch.compile(MLP(num_classes))


LABELS = {"numpy int64": np.int64, "numpy int32": np.int32, "1-element tensor": lambda y: torch.tensor([y]),
          "int32 tensor": lambda y: torch.tensor(y, dtype=torch.int32),
          "uint8 tensor": lambda y: torch.tensor(y, dtype=torch.uint8)}


class Labelled(Table):
    """Table's rows with labels of the kind LABELS names."""

    def __init__(self, size, seed, kind=None):
        super().__init__(size, seed)
        self.kind = LABELS[kind or os.environ["LABELS"]]

    def __getitem__(self, index):
        row, label = super().__getitem__(index)
        return row, self.kind(label)


def labelled(args):
    return Labelled(192, 0), Labelled(40, 1)


# what goes wrong
def row_labels(args):
    return Labelled(192, 0, "1-element tensor"), Labelled(40, 1, "1-element tensor")


def double_mlp(num_classes):
    return MLP(num_classes).double()


def lazy_mlp(num_classes):
    return nn.Sequential(nn.LazyLinear(16), nn.ReLU(), nn.Linear(16, num_classes))


class EvalPair(MLP):
    """Logits in training, (logits, inputs) in eval mode."""

    def forward(self, x):
        logits = super().forward(x)
        return logits if self.training else (logits, x)


def eval_pair(num_classes):
    return EvalPair(num_classes)


def rank_mlp(num_classes):  # a layer more on rank 1
    return MLP(num_classes) if os.environ.get("RANK") != "1" else nn.Sequential(MLP(num_classes), nn.Linear(3, 3))


class DetachedMLP(MLP):
    """Logits without the graph that backward() goes back through."""

    def forward(self, x):
        return super().forward(x).detach()


def detached_mlp(num_classes):
    return DetachedMLP(num_classes)


class Unused(MLP):
    """A layer that forward never calls: DDP waits for its gradient."""

    def __init__(self, num_classes):
        super().__init__(num_classes)
        self.spare = nn.Linear(32, num_classes)


def unused_mlp(num_classes):
    return Unused(num_classes)


class Stops(Table):
    """Row 100 raises StopIteration, as a next() on a spent iterator does: a for loop takes it for the end."""

    def __getitem__(self, index):
        if index == 100:
            raise StopIteration
        return super().__getitem__(index)


def stops(args):
    return Stops(192, 0), Table(40, 1)


def short_rows(args):
    train, val = table(args)
    train.rows, val.rows = train.rows[:, :7], val.rows[:, :7]
    return train, val


class Ragged(Table):
    """Row 5 of the training set cut short: the one item check_datasets reads (the first of the val set) is fine."""

    def __getitem__(self, index):
        row, label = super().__getitem__(index)
        return (row[:7] if index == 5 else row), label


def ragged_rows(args):
    return Ragged(192, 0), Table(40, 1)


class HalfLabel(Table):
    """Row 5 of the training set labelled 1.5: the item check_datasets reads (the first) is fine."""

    def __getitem__(self, index):
        row, label = super().__getitem__(index)
        return row, (1.5 if index == 5 else label)


def half_label(args):
    return HalfLabel(192, 0), Table(40, 1)


def bytes_as_mean(args):  # 0-255 units: DeviceBatches would scale them again
    train, val = gray(args)
    train.mean, train.std = (115.0,), (64.0,)
    return train, val


def no_classes(args):
    train, val = table(args)
    del train.num_classes
    return train, val


class Gray(Table):
    """1x12x12 uint8 images, as MNIST's: class k has brightness 60 + 70k, every image its own noise."""

    def __init__(self, size, seed):
        super().__init__(size, seed)
        g = torch.Generator().manual_seed(seed)
        noise = torch.randn(size, 1, 12, 12, generator=g) * 20
        self.rows = (60 + 70 * self.labels[:, None, None, None] + noise).clamp(0, 255).to(torch.uint8)


def gray(args):
    return Gray(96, 0), Gray(30, 1)


def gray_normalized(args):  # with the data's own normalization, as a dataset may carry it
    sets = gray(args)
    for data in sets:
        data.mean, data.std = (0.5,), (0.25,)
    return sets


class GrayCNN(CNN):
    def __init__(self, num_classes, channels=1):
        super().__init__(num_classes)
        self.conv = nn.Conv2d(channels, 8, 3)


def gray_cnn(num_classes):
    return GrayCNN(num_classes)


def small_rgb(args):  # 3x12x12 images
    train, val = gray(args)
    for data in (train, val):
        data.rows = data.rows.expand(-1, 3, -1, -1).contiguous()
    return train, val


class FlatCNN(GrayCNN):
    """A fixed flatten: 3x12x12 inputs only."""

    def __init__(self, num_classes):
        super().__init__(num_classes, channels=3)
        self.fc = nn.Linear(8 * 10 * 10, num_classes)

    def forward(self, x):
        return self.fc(torch.relu(self.conv(x)).flatten(1))


def flat_cnn(num_classes):
    return FlatCNN(num_classes)


def tensors(args):  # a TensorDataset: no num_classes, no classes
    return (torch.utils.data.TensorDataset(Table(192, 0).rows, Table(192, 0).labels),
            torch.utils.data.TensorDataset(Table(40, 1).rows, Table(40, 1).labels))


def volumes(args):  # 1x4x6x6 float volumes, the class in their mean
    train, val = table(args)
    for data in (train, val):
        data.rows = data.labels[:, None, None, None, None].float() + torch.randn(len(data.labels), 1, 4, 6, 6) * 0.3
    return train, val


class Conv3d(nn.Module):
    def __init__(self, num_classes):
        super().__init__()
        self.conv = nn.Conv3d(1, 4, 3)
        self.fc = nn.Linear(4, num_classes)

    def forward(self, x):
        return self.fc(torch.relu(self.conv(x)).mean((2, 3, 4)))


def conv3d(num_classes):
    return Conv3d(num_classes)
'''
TABLE = ["--dataset", "mine:table", "-a", "mine:mlp", "-b", "16", "--lr", "0.05", "-j", "2", "-p", "1",
         "--deterministic"]
EPOCHS = 2


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """A user's project: their module, their .npz of images, and a copy of each script they took."""
    folder = tmp_path_factory.mktemp("project")
    (folder / "mine.py").write_text(USER_MODULE)
    rng = np.random.default_rng(0)
    colours = np.array([[220, 40, 40], [40, 200, 60], [50, 70, 230]], dtype=np.float32)
    arrays = {}
    for split, size in (("train", 48), ("val", 20)):
        labels = np.arange(size) % 3
        pixels = colours[labels][:, :, None, None] + rng.normal(0, 30, (size, 3, 12, 12))
        arrays.update({f"{split}_x": pixels.clip(0, 255).astype(np.uint8), f"{split}_y": labels})
    np.savez(folder / "images.npz", classes=np.array(["red", "green", "blue"]), **arrays)
    for script in ("distributed.py", "multiprocessing_distributed.py", "fsdp_distributed.py", "dataparallel.py"):
        shutil.copy(script, folder)
    return folder


@pytest.fixture(scope="module")
def reference(project, tmp_path_factory):
    """torchrun, 2 processes with 2 loader workers each, uninterrupted: what the other runs must equal."""
    out = tmp_path_factory.mktemp("own_reference")
    ok(torchrun(project / "distributed.py", 2, *TABLE, "--epochs", EPOCHS, "--output-dir", out, cwd=project))
    return out


@pytest.mark.xdist_group("own_model_reference")
def test_your_model_and_data_train_and_the_checkpoint_names_them(reference):
    rows = metrics(reference)
    assert [r["epoch"] for r in rows] == [0, 1] and rows[-1]["val_acc1"] >= 70, rows  # 3 classes: chance 33%
    ckpt = load(reference / "checkpoint.pth.tar")
    assert ckpt["arch"] == "mine:mlp" and ckpt["args"]["dataset"] == "mine:table"
    assert set(ckpt["state_dict"]) == {"hidden.weight", "hidden.bias", "out.weight", "out.bias"}


@pytest.mark.xdist_group("own_model_reference")
def test_sigterm_to_torchrun_mid_epoch_then_resume_auto_is_the_uninterrupted_run(project, reference, tmp_path):
    job = torchrun(project / "distributed.py", 2, *TABLE, "--epochs", EPOCHS, "--output-dir", tmp_path, cwd=project)
    job.wait_for_line("Epoch 0 [ 1/12]")
    job.proc.send_signal(signal.SIGTERM)
    step = assert_preempted(job, tmp_path, code=LAUNCHER_FAILED)
    resumed = ok(torchrun(project / "distributed.py", 2, *TABLE, "--epochs", EPOCHS, "--resume", "auto",
                          "--output-dir", tmp_path, cwd=project))
    assert f"(epoch 0, step {step})" in resumed.output
    assert_same_run(tmp_path, reference, epochs=EPOCHS)


@pytest.mark.xdist_group("own_model_reference")
def test_evaluate_gives_the_last_epochs_accuracy(project, reference, tmp_path):
    job = ok(python(project / "distributed.py", *TABLE, "-e", "--resume", reference / "checkpoint.pth.tar",
                    "--output-dir", tmp_path, cwd=project))
    acc1 = float(re.search(r"^val: loss \S+ acc1 (\S+)", job.output, re.M)[1])
    assert acc1 == pytest.approx(metrics(reference)[-1]["val_acc1"], abs=1e-3)


@pytest.mark.parametrize("script", ["multiprocessing_distributed.py", "fsdp_distributed.py"])
@pytest.mark.xdist_group("own_model_reference")
def test_other_launchers_take_the_same_model(script, project, reference, tmp_path):
    """spawn equals torchrun bit for bit; FSDP shards a model without Sequential or ModuleList by its layers."""
    args = [*TABLE, "--epochs", EPOCHS, "--output-dir", tmp_path]
    if script == "fsdp_distributed.py":
        job = ok(torchrun(project / script, 2, *args, cwd=project))
        assert "FSDP: 2 blocks and the root sharded" in job.output, job.output
        for ours, theirs in zip(metrics(tmp_path), metrics(reference)):
            assert ours["val_acc1"] == pytest.approx(theirs["val_acc1"], abs=5) and ours["val_acc1"] >= 70
    else:
        ok(spawn(project / script, 2, *args, cwd=project))
        assert_same_run(tmp_path, reference, epochs=EPOCHS)


def test_npz_images_through_the_crop_with_ema_accumulation_and_benchmark(project, tmp_path):
    """uint8 images of the user's dataset are cropped (--crop-size) and normalized like ImageFolder's."""
    images = ["--dataset", "mine:npz_images", "images.npz", "-a", "mine:cnn", "--crop-size", "10", "--val-resize", "12",
              "-b", "8", "--lr", "0.05", "-j", "0"]
    ok(python(project / "distributed.py", *images, "--epochs", "1", "--model-ema", "--grad-accum-steps", "2",
              "--output-dir", tmp_path, cwd=project))
    assert "val_acc1_ema" in metrics(tmp_path)[0] and load(tmp_path / "checkpoint.pth.tar")["arch"] == "mine:cnn"
    job = ok(python(project / "distributed.py", *TABLE, "-j", "0", "--benchmark", "2", "--output-dir", tmp_path / "b",
                    cwd=project))
    assert re.search(r"benchmark: \d+ img/s over 2 steps", job.output), job.output


@pytest.mark.parametrize("labels", ["numpy int64", "numpy int32", "int32 tensor", "uint8 tensor"])
def test_integer_labels_of_any_kind_train(labels, project, tmp_path):
    """What indexing an .npz gives, and what default_collate batches: numpy integers, integer tensors of any dtype
    (cross_entropy takes int64 only: DeviceBatches converts them on the device)."""
    ok(python(project / "distributed.py", *TABLE, "--dataset", "mine:labelled", "-j", "0", "--epochs", "1",
              "--output-dir", tmp_path, cwd=project, env={"LABELS": labels}))
    assert metrics(tmp_path)[0]["val_acc1"] >= 70


def test_a_compiled_model_resumes_and_evaluates(project, tmp_path):
    """A torch.compile'd model names its weights _orig_mod.*; its checkpoint holds the plain model's names, which
    --resume and -e load back into it (and the uncompiled model takes too)."""
    args = [*TABLE, "-a", "mine:compiled_mlp", "-j", "0", "--output-dir", tmp_path]
    ok(python(project / "distributed.py", *args, "--epochs", "1", cwd=project), timeout=480)
    resumed = ok(python(project / "distributed.py", *args, "--epochs", "2", "--resume", "auto", cwd=project),
                 timeout=480)
    assert "(epoch 1, step 0)" in resumed.output and [r["epoch"] for r in metrics(tmp_path)] == [0, 1]
    ckpt = load(tmp_path / "checkpoint.pth.tar")
    assert set(ckpt["state_dict"]) == {"hidden.weight", "hidden.bias", "out.weight", "out.bias"}
    job = ok(python(project / "distributed.py", *args, "-e", "--resume", tmp_path / "checkpoint.pth.tar",
                    cwd=project), timeout=480)
    acc1 = float(re.search(r"^val: loss \S+ acc1 (\S+)", job.output, re.M)[1])
    assert acc1 == pytest.approx(metrics(tmp_path)[-1]["val_acc1"], abs=1e-3)


@pytest.mark.parametrize("dataset", ["gray", "gray_normalized"])
def test_grayscale_images_train(dataset, project, tmp_path):
    """1xHxW uint8 images (MNIST's kind) are cropped and normalized as RGB ones: by the data's own mean and std
    when it has them, else by the mean of ImageNet's."""
    ok(python(project / "distributed.py", "--dataset", f"mine:{dataset}", "-a", "mine:gray_cnn", "--crop-size", "10",
              "--val-resize", "12", "-b", "8", "--lr", "0.05", "-j", "0", "--epochs", "2", "--output-dir", tmp_path,
              cwd=project))
    assert metrics(tmp_path)[-1]["val_acc1"] >= 70


def test_a_tensor_dataset_takes_num_classes(project, tmp_path):
    """A TensorDataset has no num_classes to give: --num-classes N (timm's flag) says it."""
    ok(python(project / "distributed.py", *TABLE, "--dataset", "mine:tensors", "--num-classes", "3", "-j", "0",
              "--epochs", "1", "--output-dir", tmp_path, cwd=project))
    assert metrics(tmp_path)[0]["val_acc1"] >= 70 and load(tmp_path / "checkpoint.pth.tar")["state_dict"][
        "out.bias"].shape == (3,)


@pytest.mark.parametrize("script", ["distributed.py", "dataparallel.py"])  # their own prepare_model each
def test_channels_last_with_a_conv3d_model(script, project, tmp_path):
    """--channels-last takes the 4-D weights only: a Conv3d's 5-D weights and inputs stay as they are."""
    ok(python(project / script, *TABLE, "--dataset", "mine:volumes", "-a", "mine:conv3d", "--channels-last",
              "-j", "0", "--epochs", "1", "--output-dir", tmp_path, cwd=project))
    assert metrics(tmp_path)[0]["val_acc1"] >= 50


def edit(source, name, body):
    """The script with function `name` replaced: what a user who edits the copy does."""
    start = source.index(f"\ndef {name}(")
    end = source.index("\n\n\n", start + 1)
    return source[:start] + f"\ndef {name}(" + body + source[end:]


def test_or_edit_build_model_and_build_datasets_only(project, tmp_path):
    source = (project / "distributed.py").read_text()
    source = edit(source, "build_model", "args, num_classes, load_weights=True):\n    return mine.MLP(num_classes)")
    source = edit(source, "build_datasets", "args):\n    return mine.Table(192, 0), mine.Table(40, 1)")
    (tmp_path / "mine.py").write_text(USER_MODULE)
    (tmp_path / "train.py").write_text(source.replace("\nimport torch\n", "\nimport mine\nimport torch\n", 1))
    ok(python(tmp_path / "train.py", "-b", "16", "--lr", "0.05", "-j", "0", "--epochs", "1", "--output-dir",
              tmp_path / "out", cwd=tmp_path))
    assert metrics(tmp_path / "out")[0]["val_acc1"] >= 70


# name: (arguments, what the one error line must say)
BAD = {
    "a training item of another shape": (["--dataset", "mine:ragged_rows", "-a", "mine:mlp"],
                                         r"the data's items differ within a batch \(inputs 20 float32, 7 float32\)"),
    "a mean and std in 0-255 units": (["--dataset", "mine:bytes_as_mean", "-a", "mine:mlp"],
                                      r"the train set's mean \(115.0,\) and std \(64.0,\) must be in 0-1 units"),
    "a fraction as a training label": (["--dataset", "mine:half_label", "-a", "mine:mlp"],
                                       r"a label is 1.5; with 3 classes \(--num-classes, or the data's count\) labels "
                                       r"are integers from 0 to 2"),
    "labels that batch to Nx1": (["--dataset", "mine:row_labels", "-a", "mine:mlp"],
                                 r"a label is tensor\(\[\d\]\); with 3 classes"),
    "a label past the class count": (["--dataset", "mine:tensors", "-a", "mine:mlp", "--num-classes", "2"],
                                     r"a label is tensor\(2\); with 2 classes \(--num-classes, or the data's count\) "
                                     r"labels are integers from 0 to 1"),
    "no number of classes": (["--dataset", "mine:no_classes", "-a", "mine:mlp"],
                             r"the train set has no number of classes \(None\): give --num-classes N"),
    "pretrained weights for your model": (["--dataset", "mine:table", "-a", "mine:mlp", "--pretrained"],
                                          r"--pretrained loads torchvision's weights.*load its weights inside mlp"),
    "a checkpoint of another model": (["--dataset", "mine:table", "-a", "mine:wide_mlp", "--resume", "REFERENCE"],
                                      r"holds a mine:mlp model, not mine:wide_mlp: pass -a mine:mlp"),
}


def run_bad(args, project, reference, tmp_path):
    """The script on what goes wrong, one process: its job, ended."""
    args = [str(reference / "checkpoint.pth.tar") if a == "REFERENCE" else a for a in args]
    return python(project / "distributed.py", *args, "-b", "16", "-j", "0", "--output-dir", tmp_path,
                  cwd=project).finish(120)


@pytest.mark.parametrize("name", BAD)
@pytest.mark.xdist_group("own_model_reference")
def test_bad_input_gets_one_clear_line(name, project, reference, tmp_path):
    args, expected = BAD[name]
    assert_one_clear_line(run_bad(args, project, reference, tmp_path), expected)


# A model that does not take the data's inputs, or trains nothing: torch's own error, which names the cause, stops
# the run before it saves anything. name: (arguments, torch's words)
TORCH_SAYS = {
    "inputs of the wrong shape": (["--dataset", "mine:short_rows", "-a", "mine:mlp"],
                                  r"mat1 and mat2 shapes cannot be multiplied \(16x7 and 20x32\)"),
    "an image model on a table": (["--dataset", "mine:table"], r"Expected 3D \(unbatched\) or 4D \(batched\) input "
                                                               r"to conv2d, but got input of size: \[16, 20\]"),
    "a model in another dtype than the data": (["--dataset", "mine:table", "-a", "mine:double_mlp"],
                                               r"mat1 and mat2 must have the same dtype"),
    "a model with lazy parameters": (["--dataset", "mine:table", "-a", "mine:lazy_mlp"],
                                     r"Attempted to use an uninitialized parameter"),
    "a model whose logits have no gradient": (["--dataset", "mine:table", "-a", "mine:detached_mlp"],
                                              r"element 0 of tensors does not require grad"),
    "a model that returns no logits in eval mode": (["--dataset", "mine:table", "-a", "mine:eval_pair"],
                                                    r"'tuple' object has no attribute 'float'"),
}


@pytest.mark.parametrize("name", TORCH_SAYS)
def test_a_model_that_does_not_fit_the_data_stops_with_torchs_error(name, project, tmp_path):
    args, expected = TORCH_SAYS[name]
    job = run_bad(args, project, None, tmp_path)
    assert job.returncode != 0 and re.search(expected, job.output), job.output
    assert not (tmp_path / "checkpoint.pth.tar").exists()


def test_small_images_train_at_their_own_size(project, tmp_path):
    """12 px images and a model that takes 12 px only (a fixed flatten): --crop-size defaults to the images' size."""
    ok(python(project / "distributed.py", *TABLE, "--dataset", "mine:small_rgb", "-a", "mine:flat_cnn", "-j", "0",
              "--epochs", "2", "--output-dir", tmp_path, cwd=project))
    assert metrics(tmp_path)[-1]["val_acc1"] >= 70


def ddp(project, tmp_path, *args):
    """The script under torchrun, 2 processes, on the table: its job, ended."""
    return torchrun(project / "distributed.py", 2, "--dataset", "mine:table", "-a", "mine:mlp", "-b", "16", "-j", "0",
                    *args, "--epochs", "1", "--output-dir", tmp_path, cwd=project).finish(120)


def test_a_sample_that_raises_stop_iteration_is_one_clear_line(project, tmp_path):
    """A rank whose data ends early (in a loader worker) would leave its peer waiting."""
    job = ddp(project, tmp_path, "--dataset", "mine:stops", "-j", "2")
    assert_one_clear_line(job, r"the data ended after \d+ of 12 batches: a sample raised StopIteration, which ends a "
                               r"loop without an error; raise another one \(IndexError\)$", launcher_reports=True)


# what DDP meets over two ranks, in its own words: the spare layer's gradient it waits for, at the second step; the
# ranks' models, which it compares as it wraps them
DDP_SAYS = {"a parameter without a gradient": (["-a", "mine:unused_mlp"],
                                              r"your module has parameters that were not used in producing loss"),
            "models that differ between ranks": (["-a", "mine:rank_mlp"], r"DDP expects same model across all ranks")}


@pytest.mark.parametrize("name", DDP_SAYS)
def test_what_ddp_meets_stops_the_job_with_ddps_error(name, project, tmp_path):
    args, expected = DDP_SAYS[name]
    job = ddp(project, tmp_path, *args)
    assert job.returncode != 0 and re.search(expected, job.output), job.output
