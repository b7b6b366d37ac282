"""Every --arch name trains: each torchvision classification model takes an optimizer step and an evaluation through
distributed.py's own build_model, at the --crop-size of its row in SIZES (32 px, the suite's own, where it has none)."""
import math

import pytest
import torch
import torch.nn.functional as F
import torchvision

from conftest import FAST, import_script, metrics, ok, torchrun

SCRIPT = import_script("distributed.py")
NUM_CLASSES = 3
# the models that take no 32 px images: the smallest size each takes, or the one it is built for
SIZES = {"alexnet": 63, "inception_v3": 75, "maxvit_t": 224, "vit_b_16": 224, "vit_b_32": 224, "vit_h_14": 224,
         "vit_l_16": 224, "vit_l_32": 224}


def parse(arch, crop_size, *more):
    return SCRIPT.parse_args(["--dummy", "-a", arch, "--crop-size", str(crop_size), *more])


@pytest.mark.parametrize("arch", torchvision.models.list_models(module=torchvision.models))
def test_every_arch_trains_and_evaluates(arch):
    size = SIZES.get(arch, 32)
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


def test_pretrained_vit_is_built_for_the_size_of_its_weights(monkeypatch):
    """vit_h_14's default weights are for 518 px images: with --pretrained it is built for them (built for 224 px, its
    position embedding would not take theirs). Built on the meta device, without the weights: the size is the test."""
    monkeypatch.setattr(SCRIPT, "load_pretrained", lambda model, args: None)
    with torch.device("meta"):
        model = SCRIPT.build_model(parse("vit_h_14", 518, "--pretrained"), NUM_CLASSES)
    assert model.image_size == 518


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

