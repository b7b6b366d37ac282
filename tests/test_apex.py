"""apex_distributed.py under torchrun on CPU, in bfloat16 (float16's backward is slow on a CPU; tests/test_one_path.py
runs O2 and O3 in float16): apex's opt levels O0-O3, O2's fp32 master weights, their clipped gradients and their
bit-exact resume, and a broken apex on the path."""
import math
from types import SimpleNamespace

import pytest
import torch
import torchvision

from conftest import CHECKPOINT_KEYS, EPOCHS, FAST, assert_same_tensors, import_script, load, metrics, ok, torchrun

SCRIPT = "apex_distributed.py"
BF16 = ["--half-dtype", "bfloat16"]
RESUME = [*FAST, "--deterministic", "--opt-level", "O2", *BF16]
# a build of apex for another CUDA or torch fails like this on import; the script imports nothing from apex
BROKEN_APEX = 'raise OSError("libcudart.so.11.0: cannot open shared object file: No such file or directory")'


def floating(state_dict):
    return {k: v for k, v in state_dict.items() if v.is_floating_point()}


def assert_trains(out, epochs):
    rows = metrics(out)
    assert [r["epoch"] for r in rows] == list(range(epochs))
    assert all(math.isfinite(r[k]) for r in rows for k in ("train_loss", "val_loss")), rows
    assert rows[-1]["train_loss"] < rows[0]["train_loss"], rows
    return rows


@pytest.fixture(scope="module")
def o2(image_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("o2")
    return ok(torchrun(SCRIPT, 2, image_data, *RESUME, "--epochs", "2", "--output-dir", out)), out


def test_o0_trains_in_fp32_despite_a_broken_apex(image_data, tmp_path):
    fake = tmp_path / "site" / "apex"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(BROKEN_APEX)
    job = ok(torchrun(SCRIPT, 2, image_data, *FAST, "--opt-level", "O0", "--epochs", "2",
                      "--output-dir", tmp_path / "out", env={"PYTHONPATH": tmp_path / "site"}))
    assert "opt level O0: fp32 throughout" in job.output
    assert_trains(tmp_path / "out", 2)


def test_o1_autocast_learns_without_apex(image_data, tmp_path):
    job = ok(torchrun(SCRIPT, 2, image_data, *FAST, "--opt-level", "O1", *BF16, "--epochs", EPOCHS,
                      "--output-dir", tmp_path))
    assert "world size 2, device cpu, backend gloo, global batch 16 = 2 x 8" in job.output
    assert "opt level O1: fp32 weights, autocast to bfloat16, no loss scaling" in job.output
    rows = assert_trains(tmp_path, EPOCHS)
    assert max(r["val_acc1"] for r in rows) >= 70 and rows[-1]["train_acc1"] >= 60, rows  # 4 classes: chance is 25%
    ckpt = load(tmp_path / "checkpoint.pth.tar")
    assert set(ckpt) == CHECKPOINT_KEYS and ckpt["args"]["opt_level"] == "O1"
    assert ckpt["scaler"] == {}  # no loss scaling for bfloat16: an empty scaler state, restored as such


@pytest.mark.xdist_group("apex_o2")
def test_o2_keeps_fp32_master_weights_and_fp32_batchnorm(o2):
    job, out = o2
    assert "opt level O2: bfloat16 model, fp32 BatchNorm, fp32 master weights, no loss scaling" in job.output
    assert_trains(out, 2)
    ckpt = load(out / "checkpoint.pth.tar")
    weights = floating(ckpt["state_dict"])
    assert {v.dtype for v in weights.values()} == {torch.float32}
    # master weights, not upcast bfloat16 ones: trained values that bfloat16 cannot hold
    conv = weights["layer1.0.conv1.weight"]
    assert not torch.equal(conv, conv.bfloat16().float())
    assert all(s["momentum_buffer"].dtype == torch.float32 for s in ckpt["optimizer"]["state"].values())
    torchvision.models.resnet18(num_classes=4).load_state_dict(ckpt["state_dict"])  # a plain fp32 model takes them


@pytest.mark.xdist_group("apex_o2")
def test_o2_resume_continues_bit_for_bit(image_data, tmp_path, o2):
    _, reference = o2
    ok(torchrun(SCRIPT, 2, image_data, *RESUME, "--epochs", "1", "--output-dir", tmp_path))
    job = ok(torchrun(SCRIPT, 2, image_data, *RESUME, "--epochs", "2", "--resume", "auto", "--output-dir", tmp_path))
    assert "(epoch 1, step 0)" in job.output
    a, b = load(tmp_path / "checkpoint.pth.tar"), load(reference / "checkpoint.pth.tar")
    assert a["epoch"] == b["epoch"] == 2
    assert_same_tensors(a["state_dict"], b["state_dict"])
    assert_same_tensors(a["optimizer"], b["optimizer"])
    for x, y in zip(metrics(tmp_path), metrics(reference), strict=True):
        assert {k: v for k, v in x.items() if k not in ("img_per_s", "seconds")} == pytest.approx(
            {k: v for k, v in y.items() if k not in ("img_per_s", "seconds")}, rel=1e-9)


def test_o3_trains_in_pure_half_with_loader_workers_and_channels_last(image_data, tmp_path):
    job = ok(torchrun(SCRIPT, 2, image_data, *FAST, "--opt-level", "O3", *BF16, "--epochs", "2", "-j", "1",
                      "--channels-last",
                      "--output-dir", tmp_path))
    assert "opt level O3: pure bfloat16" in job.output
    assert_trains(tmp_path, 2)
    weights = floating(load(tmp_path / "checkpoint.pth.tar")["state_dict"])
    # saved as fp32, every value one that bfloat16 holds exactly: the model was half throughout, BatchNorm too
    assert all(v.dtype == torch.float32 and torch.equal(v, v.bfloat16().float()) for v in weights.values())


def test_o2_clips_the_gradients_of_the_master_weights():
    """--clip-grad-norm at O2: once unscaled, the gradients are the fp32 masters' (the model's are freed), and theirs
    is the norm capped. SGD with --lr 1 and neither momentum nor decay: the step is the clipped gradient."""
    script = import_script(SCRIPT)
    args = script.parse_args(["--dummy", "--opt-level", "O2", *BF16, "--clip-grad-norm", "0.001", "--lr", "1",
                              "--momentum", "0", "--wd", "0"])
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    optimizer = script.build_optimizer(model, args, torch.device("cpu"), print)
    amp_dtype, scaler = script.setup_precision(model, optimizer, args, torch.device("cpu"), print)
    before = [master.detach().clone() for _, master in scaler.masters.values()]
    run = SimpleNamespace(model=model, train_model=model, optimizer=optimizer, scaler=scaler, amp_dtype=amp_dtype,
                          scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0), ema=None)
    script.train_step(run, torch.randn(16, 4) * 100, torch.randint(0, 2, (16,)), args)
    step = torch.cat([(master - old).flatten() for (_, master), old in zip(scaler.masters.values(), before)])
    assert 0 < step.norm() <= 0.001 * 1.001, step.norm()
