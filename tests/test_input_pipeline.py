"""The fast input path (libjpeg-turbo through torchvision.io, uint8 tensors through transforms.v2) keeps
the meaning of the PIL path: every odd file still loads as RGB, and the same seed gives the same crop
of the same image with the same label."""
import argparse

import numpy as np
import pytest
import torch
import torchvision
from PIL import Image
from torchvision.transforms.v2.functional import pil_to_tensor

from conftest import import_script


@pytest.fixture(scope="module")
def script():
    return import_script("distributed.py")


def photo(height=60, width=80):
    y, x = np.mgrid[0:height, 0:width]
    return np.stack([(np.sin(x / 7 + c) * 90 + np.cos(y / 5) * 30 + 128) for c in range(3)], -1).astype(np.uint8)


ODD_FILES = {  # name: how it is written; all are named .JPEG, as ImageNet's are
    "rgb": lambda p: Image.fromarray(photo()).save(p, format="JPEG", quality=90),
    "grayscale": lambda p: Image.fromarray(photo()).convert("L").save(p, format="JPEG", quality=90),
    "cmyk": lambda p: Image.fromarray(photo()).convert("CMYK").save(p, format="JPEG", quality=90),
    "png named .JPEG": lambda p: Image.fromarray(photo()).save(p, format="PNG"),
    "rgba png named .JPEG": lambda p: Image.fromarray(photo()).convert("RGBA").save(p, format="PNG"),
}


@pytest.mark.parametrize("kind", ODD_FILES)
def test_every_kind_of_file_loads_as_rgb_like_pil(kind, script, tmp_path):
    path = tmp_path / "image.JPEG"
    ODD_FILES[kind](path)
    image = script.load_image(str(path))
    with Image.open(path) as img:
        expected = pil_to_tensor(img.convert("RGB"))
    assert image.dtype == torch.uint8 and image.shape == (3, 60, 80)
    assert (image.int() - expected.int()).abs().float().mean() < 1.0  # the same decoder underneath


def test_the_same_seed_gives_the_same_crop_and_label_as_the_pil_path(script, image_data):
    """Crops are cut from the decoded tensor here and from the PIL image there: the same boxes (the
    geometry depends only on the seed and the image size), resampled alike."""
    args = argparse.Namespace(data=str(image_data), crop_size=24, val_resize=28, dummy=False)
    fast, _ = script.build_datasets(args)
    pil_loader = torchvision.datasets.ImageFolder(image_data / "train", fast.transform,
                                                  loader=lambda p: Image.open(p).convert("RGB"))
    assert fast.samples == pil_loader.samples  # same files, same labels
    for index in range(0, len(fast), 17):
        torch.manual_seed(index)
        image, label = fast[index]
        torch.manual_seed(index)
        pil_image, pil_label = pil_loader[index]
        assert label == pil_label and image.shape == (3, 24, 24)
        assert (image.int() - pil_to_tensor(pil_image).int()).abs().float().mean() < 3  # resampling differs in rounding


def test_the_train_transform_resizes_like_v2(script):
    """RandomResizedCropUint8's fast kernel against torchvision's own, on the same crop."""
    image = torch.from_numpy(photo(120, 160)).permute(2, 0, 1)  # channels-last memory, as decode_jpeg returns it
    fast = script.RandomResizedCropUint8(32, antialias=True)
    reference = torchvision.transforms.v2.RandomResizedCrop(32, antialias=True)
    for seed in range(5):
        torch.manual_seed(seed)
        ours = fast(image)
        torch.manual_seed(seed)
        theirs = reference(image.contiguous())
        assert (ours.int() - theirs.int()).abs().max() <= 1
