"""unet3d_apex.py launched by torchrun (and plain python) on CPU with tiny volumes: learning, exact
whole-volume evaluation, a run from .npy files with resume and preemption, and bad input."""
import re
import shutil
import signal

import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from conftest import (LAUNCHER_FAILED, OUTPUT_FILES, assert_same_tensors, import_script, load, metrics, ok, python,
                      torchrun)
from test_bad_input import broken_copy
from test_cuts import cut

SCRIPT = "unet3d_apex.py"
# a small U-Net on 16³ patches, no loader workers, no progress lines unless a test asks
TINY = ["--patch-size", "16", "16", "16", "--base-channels", "8", "--depth", "3", "-b", "4", "--lr", "3e-3",
        "-j", "0", "-p", "1000"]
# 20 training volumes, 5 (odd) validation volumes; 24 is no multiple of 16, so evaluation tiles pad the borders
SYNTHETIC = ["--synthetic", "--synthetic-size", "20", "--synthetic-shape", "20", "24", "24"]
CHECKPOINT_KEYS = {"epoch", "step", "arch", "model", "state_dict", "optimizer", "scheduler", "scaler", "best_dice",
                   "args", "world_size", "rng_states", "train_sums", "train_samples"}
# the first training volume is smaller than a 16³ patch along D: its patches are padded, not refused
TRAIN_SHAPES = [(12, 20, 20), (16, 20, 24), (18, 24, 20), (20, 16, 18), (16, 18, 16), (20, 20, 20)]
VAL_SHAPES = [(18, 20, 22), (16, 24, 16), (20, 18, 20)]


def ellipsoids(shape, gen):
    """An image (noise + bright ellipsoids) and its uint8 mask, as a user's files would hold them."""
    grid, size = np.indices(shape), np.array(shape)[:, None, None, None]
    mask = np.zeros(shape, dtype=bool)
    for _ in range(gen.integers(1, 3, endpoint=True)):
        centre = (gen.random((3, 1, 1, 1)) * 0.5 + 0.25) * size
        radius = (gen.random((3, 1, 1, 1)) * 0.15 + 0.15) * size
        mask |= (((grid - centre) / radius) ** 2).sum(0) <= 1
    return (gen.normal(size=shape) * 20 + 100 + 40 * mask).astype(np.float32), mask.astype(np.uint8)


@pytest.fixture(scope="module")
def npy_data(tmp_path_factory):
    root, gen = tmp_path_factory.mktemp("volumes"), np.random.default_rng(0)
    for split, shapes in (("train", TRAIN_SHAPES), ("val", VAL_SHAPES)):
        for kind in ("images", "labels"):
            (root / split / kind).mkdir(parents=True)
        for i, shape in enumerate(shapes):
            image, mask = ellipsoids(shape, gen)
            np.save(root / split / "images" / f"vol{i}.npy", image)
            np.save(root / split / "labels" / f"vol{i}.npy", mask)
    return root


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("trained")
    job = ok(torchrun(SCRIPT, 2, *SYNTHETIC, *TINY, "--epochs", "4", "-p", "5", "--output-dir", out), timeout=240)
    return job, out


@pytest.mark.xdist_group("unet3d_trained")
def test_two_processes_learn_synthetic_spheres(trained):
    job, out = trained
    assert ("world size 2, device cpu, backend gloo, global batch 4 = 2 x 2 patches of 16×16×16, 3D U-Net "
            "(base 8, depth 3, batch norm") in job.output
    assert re.search(r"^Epoch 0 \[ 5/20\] loss [\d.]+ dice [\d.]+ lr 0.003 [\d.]+ img/s$", job.output, re.M), job.output
    rows = metrics(out)
    assert [r["epoch"] for r in rows] == [0, 1, 2, 3]  # rank 1 wrote nothing
    assert set(rows[0]) == {"epoch", "train_loss", "train_dice", "val_loss", "val_dice", "val_iou",
                            "val_dice_per_volume", "lr", "img_per_s", "seconds"}
    assert max(r["val_dice"] for r in rows) >= 0.8, rows
    assert rows[-1]["train_loss"] < rows[0]["train_loss"], rows
    assert all(0 < r["val_iou"] < r["val_dice"] <= 1 for r in rows), rows
    events = list((out / "tb").iterdir())
    assert len(events) == 1, events
    tb = EventAccumulator(str(events[0])).Reload()
    assert [e.value for e in tb.Scalars("val_dice")] == pytest.approx([r["val_dice"] for r in rows])
    assert sorted(p.name for p in out.iterdir()) == OUTPUT_FILES


@pytest.mark.xdist_group("unet3d_trained")
def test_checkpoint_is_complete_and_loads_into_a_plain_model(trained):
    _, out = trained
    ckpt = load(out / "checkpoint.pth.tar")
    assert set(ckpt) == CHECKPOINT_KEYS
    assert (ckpt["epoch"], ckpt["step"], ckpt["arch"], ckpt["world_size"]) == (4, 0, "unet3d", 2)
    assert ckpt["model"] == {"in_channels": 1, "base_channels": 8, "depth": 3, "norm": "batch"}
    model = import_script(SCRIPT).UNet3D(**ckpt["model"])
    model.load_state_dict(ckpt["state_dict"])  # strict: no "module." prefix, nothing missing
    best = load(out / "model_best.pth.tar")
    assert best["best_dice"] == max(r["val_dice"] for r in metrics(out))


def val_line(job):
    m = re.search(r"val: loss ([\d.]+) dice ([\d.]+) iou ([\d.]+) dice_per_volume ([\d.]+) \(intersection (\d+), "
                  r"predicted (\d+), true (\d+), union (\d+), volumes (\d+)\)", job.output)
    assert m, job.output
    return [float(x) for x in m.groups()[:4]], m.groups()[4:]


@pytest.mark.xdist_group("unet3d_trained")
def test_evaluation_is_exact_for_any_number_of_processes(trained):
    """5 whole volumes: one rank takes 3, the other 2, and the voxel counts are summed, so the result
    is the single-process one, and the one logged in training for the same weights."""
    _, out = trained
    args = [*SYNTHETIC, *TINY, "-e", "--resume", out / "model_best.pth.tar"]
    (one, one_counts), (two, two_counts) = (val_line(ok(job, timeout=120)) for job in (python(SCRIPT, *args),
                                                                                       torchrun(SCRIPT, 2, *args)))
    assert one_counts == two_counts and one_counts[-1] == "5"
    assert one == pytest.approx(two, rel=1e-6, abs=1e-6)
    best = max(metrics(out), key=lambda r: r["val_dice"])
    assert one == pytest.approx([best[k] for k in ("val_loss", "val_dice", "val_iou", "val_dice_per_volume")], abs=2e-6)
    intersection, predicted, true, union = map(int, one_counts[:4])
    assert one[1] == pytest.approx(2 * intersection / (predicted + true), abs=1e-6)
    assert one[2] == pytest.approx(intersection / union, abs=1e-6)


NPY = [*TINY, "--patches-per-volume", "4"]  # bit-identical reruns on the CPU without --deterministic


@pytest.fixture(scope="module")
def uninterrupted(npy_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("npy_uninterrupted")
    job = ok(torchrun(SCRIPT, 2, npy_data, *NPY, "--epochs", "2", "--output-dir", out), timeout=180)
    return job, out


def assert_same_run(out, reference):
    a, b = load(out / "checkpoint.pth.tar"), load(reference / "checkpoint.pth.tar")
    assert a["epoch"] == b["epoch"] == 2
    for key in a["state_dict"]:
        assert torch.equal(a["state_dict"][key], b["state_dict"][key]), key
    drop = ("img_per_s", "seconds")
    assert [{k: v for k, v in r.items() if k not in drop} for r in metrics(out)] == \
        [{k: v for k, v in r.items() if k not in drop} for r in metrics(reference)]


@pytest.mark.xdist_group("unet3d_uninterrupted")
def test_npy_folder_trains_and_pads_volumes_smaller_than_a_patch(uninterrupted):
    job, out = uninterrupted
    assert "6 train / 3 val volumes" in job.output
    assert [r["epoch"] for r in metrics(out)] == [0, 1] and metrics(out)[-1]["val_dice"] > 0


@pytest.mark.xdist_group("unet3d_uninterrupted")
def test_resume_auto_continues_an_npy_run_exactly(npy_data, tmp_path, uninterrupted):
    ok(torchrun(SCRIPT, 2, npy_data, *NPY, "--epochs", "1", "--output-dir", tmp_path), timeout=180)
    job = ok(torchrun(SCRIPT, 2, npy_data, *NPY, "--epochs", "2", "--resume", "auto", "--output-dir", tmp_path),
             timeout=180)
    assert "resumed from" in job.output and "(epoch 1, step 0)" in job.output
    assert_same_run(tmp_path, uninterrupted[1])


@pytest.mark.xdist_group("unet3d_uninterrupted")
def test_sigterm_checkpoints_and_resume_continues_exactly(npy_data, tmp_path, uninterrupted):
    job = torchrun(SCRIPT, 2, npy_data, *NPY, "-p", "1", "--epochs", "2", "--output-dir", tmp_path)
    job.wait_for_line("Epoch 0 [1/6]")
    job.process_of_rank(1).send_signal(signal.SIGTERM)  # one rank only: the others must agree to stop with it
    job.finish(timeout=120)
    assert job.returncode == LAUNCHER_FAILED and "exitcode  : 75" in job.output, job.output
    stop = re.search(r"preempted: saved .* (at epoch 0 step (\d+)|after epoch 0);", job.output)
    assert stop, job.output
    ckpt = load(tmp_path / "checkpoint.pth.tar")
    assert (ckpt["epoch"], ckpt["step"]) == ((0, int(stop[2])) if stop[2] else (1, 0))
    resumed = ok(torchrun(SCRIPT, 2, npy_data, *NPY, "--epochs", "2", "--resume", "auto", "--output-dir", tmp_path),
                 timeout=180)
    assert f"(epoch {ckpt['epoch']}, step {ckpt['step']})" in resumed.output
    assert_same_run(tmp_path, uninterrupted[1])


@pytest.mark.xdist_group("unet3d_uninterrupted")
def test_the_core_trains_on_a_volume_folder_and_resumes_to_the_weights_of_the_whole_script(npy_data, tmp_path,
                                                                                           uninterrupted):
    """The copier's cut (README: Copy only what you need): every block deleted, what is left (--synthetic with it)
    trains on a volume folder under torchrun with loader workers, resumes, and ends with the whole script's weights."""
    core = cut(SCRIPT, tmp_path / "core")
    assert not re.search(r"^ *# (end)?region \[", core.read_text(), re.M) and "SyntheticVolumes" in core.read_text()
    ok(torchrun(core, 2, npy_data, *NPY, "-j", "2", "--epochs", "1", "--output-dir", tmp_path), timeout=180)
    job = ok(torchrun(core, 2, npy_data, *NPY, "-j", "2", "--epochs", "2", "--resume", "auto", "--output-dir",
                      tmp_path), timeout=180)
    assert "(epoch 1, step 0)" in job.output
    ours, whole = (load(out / "checkpoint.pth.tar") for out in (tmp_path, uninterrupted[1]))
    assert ours["epoch"] == whole["epoch"] == 2
    assert_same_tensors(ours["state_dict"], whole["state_dict"])


def test_cpu_notices_for_amp_and_sync_bn_and_group_norm_trains(tmp_path):
    job = ok(python(SCRIPT, *SYNTHETIC, *TINY, "--epochs", "1", "--amp", "--sync-bn", "--norm", "group",
                    "--output-dir", tmp_path), timeout=120)
    assert "--sync-bn: off on CPU" in job.output
    assert load(tmp_path / "checkpoint.pth.tar")["scaler"]["scale"] > 0  # fp16 with loss scaling, as on a GPU
    assert "group norm" in job.output and metrics(tmp_path)[0]["val_dice"] > 0


# ------------------------------------------------------------------------------------------------
def replace(path, array):
    np.save(path, array)


def first_label(data, split="train"):
    return data / split / "labels" / "vol0.npy"


def add_pair(data, name, content=b"not a volume"):
    for kind in ("images", "labels"):
        (data / "train" / kind / name).write_bytes(content)


# name: (processes, arguments given the dataset and a scratch folder, what the error line must say)
CASES = {
    "--synthetic and a data folder": (1, lambda d, t: [d, "--synthetic"],
                                      r"--synthetic generates its volumes, and .* names a folder: give one of them"),
    "-e with no weights to evaluate": (1, lambda d, t: [d, "-e"],
                                       r"^error: -e evaluates trained weights, and no --resume PATH is given: give "
                                       r"--resume PATH, or the --output-dir of the run$"),
    "-e --resume auto with no checkpoint": (1, lambda d, t: [d, "-e", "--resume", "auto"],
                                            r"-e evaluates trained weights, and --output-dir .* holds no checkpoint"),
    "missing data folder": (1, lambda d, t: [t / "nowhere"],
                            r"nowhere is no folder with train/ and val/, each with images/ and labels/: give one, or "
                            r"--synthetic$"),
    "no val labels folder": (1, lambda d, t: [broken_copy(d, t, lambda x: shutil.rmtree(x / "val" / "labels"))],
                             r"is no folder with train/ and val/, each with images/ and labels/"),
    "image without label": (1, lambda d, t: [broken_copy(d, t, lambda x: first_label(x).unlink())],
                            r"^error: cannot read volume .*train/labels/vol0.npy: .*No such file or directory"),
    "non-binary label": (1, lambda d, t: [broken_copy(d, t, lambda x: replace(
        x / "train" / "labels" / "vol1.npy", np.arange(16 * 20 * 24).reshape(16, 20, 24) % 3))],
        r"train/labels/vol1.npy holds values other than 0 and 1: a label is a binary mask$"),
    "corrupt .npy": (1, lambda d, t: [broken_copy(d, t, lambda x: add_pair(x, "vol9.npy"))],
                     r"^error: cannot read volume .*train/images/vol9.npy: \S"),
    "patch not divisible for the depth": (1, lambda d, t: [d, "--patch-size", "16", "10", "16"],
                                          r"--patch-size: with --depth 3 each side must be a multiple of 4$"),
    "batch not divisible by world size": (2, lambda d, t: [d, "-b", "3"],
                                          r"--batch-size 3 is the global batch and must divide by the world size 2"),
    "resume checkpoint of another model": (1, lambda d, t: [d, "--resume", other_model_checkpoint(t)],
                                           r"ckpt.pth.tar holds unet3d \{.*'base_channels': 16.*\}, not a 3D U-Net of "
                                           r"\{.*'base_channels': 8, 'depth': 3.*\}: give the flags it was trained "
                                           r"with"),
    "resume with another global batch": (
        1, lambda d, t: [d, "--resume", other_model_checkpoint(t, base_channels=8, depth=3, args={"batch_size": 8})],
        r"ckpt.pth.tar was trained with --batch-size 8, this run has --batch-size 4: continue it with --batch-size 8"),
    "resume with other lr milestones": (
        1, lambda d, t: [d, "--resume", other_model_checkpoint(t, base_channels=8, depth=3, args={"milestones": [5]})],
        r"ckpt.pth.tar was trained with --milestones \[5\], this run has --milestones \[60, 80\]: continue it with "
        r"--milestones \[5\], or train without --resume"),
    "resume on a training set of another size": (
        1, lambda d, t: [d, "--resume", other_model_checkpoint(t, base_channels=8, depth=3, train_samples=9)],
        r"ckpt.pth.tar was trained on 9 training volumes, this run has 6: resume with the data it was trained on"),
    "fewer patches than a batch": (1, lambda d, t: [d, "-b", "512"],
                                   r"^error: \d+ training volumes x \d+ patches are fewer than one global batch of "
                                   r"512: lower -b or raise --patches-per-volume$"),
    "resume a checkpoint of distributed.py": (1, lambda d, t: [d, "--resume", other_model_checkpoint(
        t, arch="resnet18")], r"ckpt.pth.tar holds resnet18 .*, not a 3D U-Net of "),
    "a NaN voxel": (1, lambda d, t: [broken_copy(d, t, lambda x: replace(x / "train" / "images" / "vol0.npy",
                                                                        nan_volume()))],
                    r"^error: .*train/images/vol0.npy holds NaN or inf values: replace them \(numpy.nan_to_num\)$"),
    "a learning rate that makes the loss NaN": (1, lambda d, t: [d, "--lr", "1e30"],
                                                r"loss became NaN/inf in epoch 0 by step \d+; stopped without saving"),
}


def nan_volume():
    volume = np.zeros((12, 20, 20), np.float32)
    volume[5, 5, 5] = np.nan
    return volume


def other_model_checkpoint(tmp_path, base_channels=16, depth=4, **content):
    path = tmp_path / "ckpt.pth.tar"
    model = {"in_channels": 1, "base_channels": base_channels, "depth": depth, "norm": "batch"}
    torch.save({"arch": "unet3d", "model": model, "state_dict": {}, **content}, path)  # content's arch wins
    return path


def test_volumes_of_any_finite_float32_values_are_standardized():
    """Values whose sum or squares pass float32's range (3.4e38) became NaN as they were standardized, and a validation
    volume of them a silent Dice of 0: torch.std_mean takes any finite float32 volume."""
    volume_tensors = import_script(SCRIPT).volume_tensors
    mask = np.zeros((18, 20, 22), np.uint8)
    for volume in (np.full(mask.shape, 3e37, "f4"), np.random.default_rng(0).uniform(-3e38, 3e38, mask.shape)):
        image, label = volume_tensors(volume.astype("f4"), mask)
        assert image.shape == (1, 18, 20, 22) and image.isfinite().all() and label.dtype == torch.uint8


@pytest.mark.parametrize("name", CASES)
def test_bad_input_gets_one_clear_line(name, npy_data, tmp_path):
    processes, make_args, expected = CASES[name]
    args = [*TINY, "--epochs", "1", "--output-dir", tmp_path / "out", *make_args(npy_data, tmp_path)]
    job = (python(SCRIPT, *args) if processes == 1 else torchrun(SCRIPT, processes, *args)).finish(timeout=120)
    errors = [line.removeprefix(f"{SCRIPT}: ") for line in job.output.splitlines()  # argparse's: the script's name
              if line.startswith(("error: ", f"{SCRIPT}: error: "))]
    assert job.returncode != 0, job.output
    assert len(errors) == 1 and re.search(expected, errors[0]), job.output
    if processes == 1:  # under torchrun, torchrun adds its own report
        assert job.returncode == 2 and "Traceback" not in job.output, job.output
    assert not (tmp_path / "out" / "checkpoint.pth.tar").exists()
