"""Every --arch name trains, or is refused up front in one line: each torchvision classification model takes an
optimizer step and an evaluation through distributed.py's own build_model at the smallest --crop-size that its
check accepts, and the check names the size a model needs when --crop-size is wrong for it."""
import math
import re

import pytest
import torch
import torch.nn.functional as F
import torchvision

from conftest import FAST, import_script, metrics, ok, python, torchrun

SCRIPT = import_script("distributed.py")
NUM_CLASSES = 3


def parse(arch, crop_size, *more):
    return SCRIPT.parse_args(["--dummy", "-a", arch, "--crop-size", str(crop_size), *more])


def refusal(arch, crop_size, *more):
    """check_model's error line for this --arch and --crop-size; None if it accepts them."""
    try:
        SCRIPT.check_model(parse(arch, crop_size, *more))
    except SCRIPT.UserError as e:
        return str(e)
    return None


def smallest_size(arch):
    """The smallest --crop-size the check accepts, read from its refusal of 1 px; whether it is the only one."""
    error = refusal(arch, 1)
    if error is None:
        return 1, False
    only = re.fullmatch(rf"--arch {arch} takes (\d+)x\1 images only: use --crop-size \1", error)
    least = re.fullmatch(rf"--crop-size 1 is too small for --arch {arch}: use at least (\d+)", error)
    assert only or least, error
    return int((only or least)[1]), bool(only)


@pytest.mark.parametrize("arch", SCRIPT.MODEL_NAMES)
def test_every_arch_trains_at_the_smallest_size_the_check_accepts(arch):
    size, only = smallest_size(arch)
    assert refusal(arch, size) is None
    if only:  # a model built for one image size: every other size gets the same line, naming that one
        for other in (size // 2, size + 1):
            assert refusal(arch, other) == f"--arch {arch} takes {size}x{size} images only: use --crop-size {size}"
    elif size > 1:
        assert refusal(arch, size - 1) == f"--crop-size {size - 1} is too small for --arch {arch}: use at least {size}"
    args = parse(arch, size)
    model = SCRIPT.build_model(args, NUM_CLASSES)
    optimizer = torch.optim.SGD(SCRIPT.param_groups(model, args), lr=0.01)
    # 2 images where BatchNorm needs them to train (1x1 features at the smallest sizes), else 1: the ViTs are slow
    batch = 2 if any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules()) else 1
    images, target = torch.randn(batch, 3, size, size), torch.tensor([0, 2][:batch])
    model.train()
    output = model(images)
    assert isinstance(output, torch.Tensor) and output.shape == (batch, NUM_CLASSES), type(output)
    loss = F.cross_entropy(output, target)
    assert math.isfinite(loss.item())
    loss.backward()
    assert all(p.grad is not None for p in model.parameters()), "parameters without a gradient: DDP would fail"
    optimizer.step()
    # its numbers are no test: BatchNorm over 2 images of 1x1 features can make any gradient explode
    assert SCRIPT.evaluate(model, [(images, target)], None)["count"] == batch


def test_pretrained_vit_takes_the_size_of_its_weights():
    """vit_h_14's default weights are for 518 px images: with --pretrained it is built for them."""
    assert refusal("vit_h_14", 224, "--pretrained") == ("--arch vit_h_14 --pretrained takes 518x518 images only: "
                                                       "use --crop-size 518")
    assert refusal("vit_h_14", 518, "--pretrained") is None


@pytest.mark.parametrize("arch", ["googlenet", "inception_v3"])
def test_pretrained_models_with_auxiliary_classifiers(arch, tmp_path, monkeypatch):
    """Their weights hold auxiliary classifiers, which the model trains without, and expect inputs scaled to
    [-1, 1] (transform_input), as torchvision builds them with these weights. A stand-in for the download."""
    weights = torchvision.models.get_model_weights(arch).DEFAULT
    stored = torchvision.models.get_model(arch, aux_logits=True, transform_input=True, init_weights=False).state_dict()
    (tmp_path / "hub" / "checkpoints").mkdir(parents=True)
    torch.save(stored, tmp_path / "hub" / "checkpoints" / weights.url.split("/")[-1])
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    args = parse(arch, 75, "--pretrained")
    for num_classes, fresh in ((1000, set()), (NUM_CLASSES, {"fc.weight", "fc.bias"})):
        model = SCRIPT.build_model(args, num_classes)
        assert model.transform_input and not model.aux_logits
        state = model.state_dict()
        assert {k for k in state if not torch.equal(state[k], stored[k])} == fresh
        assert any(k.startswith(("aux", "AuxLogits")) for k in stored) and set(state) < set(stored)


def test_googlenet_trains_an_epoch_with_torchrun(tmp_path):
    ok(torchrun("distributed.py", 1, "--dummy", "--dummy-size", "64", *FAST, "-a", "googlenet", "--epochs", "1",
                "--output-dir", tmp_path))
    assert [row["epoch"] for row in metrics(tmp_path)] == [0]


def test_a_wrong_size_is_refused_in_one_line(tmp_path):
    job = python("distributed.py", "--dummy", *FAST, "-a", "inception_v3", "--output-dir", tmp_path).finish(120)
    assert job.returncode == 2 and "Traceback" not in job.output, job.output
    assert [line for line in job.output.splitlines() if line.startswith("error: ")] == [
        "error: --crop-size 32 is too small for --arch inception_v3: use at least 75"], job.output
