"""The fast input path (libjpeg-turbo through torchcodec, the crop in one step) keeps the meaning of the plain one (PIL,
transforms.v2): every kind of file loads as the same RGB pixels with either decoder, and the crop and flip are drawn
as v2 draws them and resampled as v2 resamples."""
import sys
import types

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps
from torch.utils.data import DataLoader, default_collate
from torchvision.transforms import v2
from torchvision.transforms.v2.functional import pil_to_tensor

from conftest import import_script


@pytest.fixture(scope="module")
def script():
    return import_script("distributed.py")


def photo(height=60, width=80):
    y, x = np.mgrid[0:height, 0:width]
    return np.stack([(np.sin(x / 7 + c) * 90 + np.cos(y / 5) * 30 + 128) for c in range(3)], -1).astype(np.uint8)


TURNED = Image.Exif()
TURNED[0x0112] = 6  # Orientation: shown turned 90 degrees clockwise (a phone held upright)
ODD_FILES = {  # name: how it is written; all are named .JPEG, as ImageNet's are
    "rgb": lambda p: Image.fromarray(photo()).save(p, format="JPEG", quality=90),
    "rgb, chroma at full size (4:4:4)": lambda p: Image.fromarray(photo()).save(p, format="JPEG", subsampling=0),
    "rgb, chroma at half width (4:2:2)": lambda p: Image.fromarray(photo()).save(p, format="JPEG", subsampling=1),
    "rgb, progressive": lambda p: Image.fromarray(photo()).save(p, format="JPEG", progressive=True),
    "grayscale": lambda p: Image.fromarray(photo()).convert("L").save(p, format="JPEG", quality=90),
    "cmyk": lambda p: Image.fromarray(photo()).convert("CMYK").save(p, format="JPEG", quality=90),
    "rgb, turned by its EXIF orientation": lambda p: Image.fromarray(photo()).save(p, format="JPEG", quality=90,
                                                                                 exif=TURNED),
    "png named .JPEG": lambda p: Image.fromarray(photo()).save(p, format="PNG"),
    "rgba png named .JPEG": lambda p: Image.fromarray(photo()).convert("RGBA").save(p, format="PNG"),
}


@pytest.mark.parametrize("decoder", ["torchcodec", "PIL"])
@pytest.mark.parametrize("kind", ODD_FILES)
def test_every_kind_of_file_loads_as_the_same_rgb_pixels_with_either_decoder(kind, decoder, script, tmp_path,
                                                                               monkeypatch):
    """Both decode JPEGs with libjpeg-turbo and its default (accurate) settings, and turn them upright as their EXIF
    orientation says: not a pixel differs, so results do not depend on which one a machine has. torchcodec is what
    scripts/setup.sh installs: it must be the one here."""
    assert script.JPEG_DECODER == "torchcodec"
    if decoder == "PIL":
        monkeypatch.setattr(script, "decode_jpeg", None)
    path = tmp_path / "image.JPEG"
    ODD_FILES[kind](path)
    image = script.load_image(str(path))
    with Image.open(path) as img:
        expected = pil_to_tensor(ImageOps.exif_transpose(img).convert("RGB"))
    upright = (3, 80, 60) if "EXIF" in kind else (3, 60, 80)
    assert image.dtype == torch.uint8 and image.shape == upright and torch.equal(image, expected)


def test_pixels_wider_than_8_bits_are_scaled_or_refused_never_clipped(script, tmp_path):
    """PIL's RGB conversion clips: a 16-bit gray PNG's gradient came out almost white (mean 254 of 255), a float
    TIFF's values in [0, 1] black. 16 bits keep their top 8; 32-bit pixels, whose range is unknown, are refused."""
    gradient = np.arange(0, 65536, 64, dtype=np.uint16).reshape(32, 32)
    Image.fromarray(gradient).save(tmp_path / "gray16.png")
    Image.frombytes("I;16B", (32, 32), gradient.astype(">u2").tobytes()).save(tmp_path / "gray16_big_endian.tif")
    top_8_bits = torch.from_numpy(gradient >> 8).byte().expand(3, -1, -1)
    for name in ("gray16.png", "gray16_big_endian.tif"):
        image = script.load_image(str(tmp_path / name))
        assert image.dtype == torch.uint8 and torch.equal(image, top_8_bits)
    Image.fromarray(np.linspace(0, 1, 1024, dtype=np.float32).reshape(32, 32)).save(tmp_path / "float.tif")
    Image.fromarray(np.arange(1024, dtype=np.int32).reshape(32, 32) * 99).save(tmp_path / "int.tif")
    for name in ("float.tif", "int.tif"):
        with pytest.raises(script.RankError, match=rf"cannot read image .*{name} \(its 32-bit pixels \(PIL mode "
                                                     r"[IF]\) have no range to map to 8 bits\): replace or remove"):
            script.load_image(str(tmp_path / name))


class Unloadable(types.ModuleType):
    """A module whose every name raises `error`, as a library built for another torch does when it loads."""
    def __init__(self, error):
        super().__init__("torchcodec.decoders")
        self.error = error

    def __getattr__(self, name):
        raise self.error


@pytest.mark.parametrize("error", [None, OSError("libtorchcodec_core8.so: cannot open shared object file"),
                                   RuntimeError("libtorchcodec_core8.so: undefined symbol: _ZN3c10"),
                                   RuntimeError("Could not load libtorchcodec. Likely causes:\n  1. FFmpeg is not "
                                                "properly installed.\n  2. The PyTorch version is not compatible.")])
def test_without_torchcodec_jpegs_go_to_pil_and_the_log_says_why(error, monkeypatch):
    """Not installed (None: ImportError), or a build for another torch or FFmpeg whose library does not load: PIL
    decodes every JPEG, and rank 0's first line says so (JPEG_DECODER), and why (on that line, however many lines
    torchcodec's own message takes)."""
    monkeypatch.setitem(sys.modules, "torchcodec.decoders", error and Unloadable(error))  # None: not installed
    module = import_script("distributed.py")
    why = " ".join(str(error or "import of torchcodec.decoders halted; None in sys.modules").split())
    assert module.decode_jpeg is None
    assert module.JPEG_DECODER == f"PIL, slower: torchcodec did not load ({why})"


def boxes_drawn(script, height, width, draws, monkeypatch):
    """(top, left, height, width, flipped) of `draws` fast crops of an image whose channels 0 and 1 hold each pixel's
    row and column: read off the crop that reaches the resize, and the order of the columns that leave it."""
    rows, cols = np.mgrid[0:height, 0:width]
    image = torch.from_numpy(np.stack([rows, cols, rows]).astype(np.uint8))
    crops, resize = [], torch.nn.functional.interpolate
    monkeypatch.setattr(torch.nn.functional, "interpolate", lambda crop, **kw: crops.append(crop) or resize(crop, **kw))
    boxes = []
    for _ in range(draws):
        out = script.random_resized_crop_flip(image, 4)
        crop = crops.pop()
        boxes.append((crop[0, 0, 0, 0].item(), crop[0, 1, 0, 0].item(), *crop.shape[2:], out[1, 0, 0] > out[1, 0, -1]))
    return np.array(boxes, dtype=float)


def ks_distance(x, y):
    """Two-sample Kolmogorov-Smirnov statistic: the largest gap between the two empirical CDFs."""
    x, y = np.sort(x), np.sort(y)
    points = np.concatenate([x, y])
    return np.abs(np.searchsorted(x, points, side="right") / len(x)
                  - np.searchsorted(y, points, side="right") / len(y)).max()


def box_features(boxes):
    """Area, aspect ratio and centre of (top, left, height, width) boxes."""
    top, left, height, width = boxes.T
    return height * width, width / height, top + height / 2, left + width / 2


@pytest.mark.parametrize("height, width", [(120, 160), (160, 120), (30, 250)])
def test_crops_and_flips_are_drawn_as_v2_draws_them(script, height, width, monkeypatch):
    """The boxes of v2.RandomResizedCrop (area, aspect ratio, position) and v2.RandomHorizontalFlip's flips, in
    distribution: 4000 draws each; two samples of one distribution stay below the KS bound (0.045, about the 0.1%
    critical value), a wrong scale or ratio lands far above it. 30x250 takes the fallback in 60% of the draws."""
    torch.manual_seed(0)
    ours = boxes_drawn(script, height, width, 4000, monkeypatch)
    reference = v2.RandomResizedCrop(32)
    boxes = [reference.make_params([torch.empty(3, height, width)]) for _ in range(4000)]
    theirs = np.array([(b["top"], b["left"], b["height"], b["width"]) for b in boxes], dtype=float)
    for a, b in zip(box_features(ours[:, :4]), box_features(theirs)):
        assert ks_distance(a, b) < 0.045
    assert abs(ours[:, 4].mean() - 0.5) < 0.03


def test_an_image_too_long_for_any_draw_gets_v2s_fallback_exactly(script, monkeypatch):
    torch.manual_seed(0)
    box = v2.RandomResizedCrop(32).make_params([torch.empty(3, 12, 250)])
    assert tuple(boxes_drawn(script, 12, 250, 1, monkeypatch)[0, :4]) == (box["top"], box["left"], box["height"],
                                                                          box["width"])


def test_the_fast_crop_resizes_and_flips_as_v2_does(script, monkeypatch):
    """On the same boxes and flips, the channels-last kernel gives v2.functional's pixels, but for rounding."""
    image = torch.from_numpy(photo(120, 160)).permute(2, 0, 1)  # channels-last memory, as decode_jpeg returns it
    for seed in range(8):
        torch.manual_seed(seed)
        [(top, left, height, width, flip)] = boxes_drawn(script, 120, 160, 1, monkeypatch).astype(int)
        torch.manual_seed(seed)
        ours = script.random_resized_crop_flip(image, 32)
        theirs = v2.functional.resized_crop(image.contiguous(), top, left, height, width, [32, 32], antialias=True)
        theirs = v2.functional.horizontal_flip(theirs) if flip else theirs
        assert ours.shape == (3, 32, 32) and (ours.int() - theirs.int()).abs().max() <= 1


@pytest.mark.parametrize("channels_last", [False, True])
def test_batches_reach_the_model_normalized_in_its_memory_format(script, channels_last):
    """collate (here in a loader worker) keeps the crops' channels-last order; DeviceBatches hands the
    model the values default_collate and one normalization give, in the model's memory format."""
    image = torch.from_numpy(photo(48, 64)).permute(2, 0, 1)
    torch.manual_seed(0)
    samples = [(script.random_resized_crop_flip(image, 32), label) for label in range(6)]
    assert script.collate(samples)[0].is_contiguous(memory_format=torch.channels_last)
    loader = DataLoader(samples, batch_size=6, num_workers=1, collate_fn=script.collate)
    [(images, labels)] = list(script.DeviceBatches(loader, torch.device("cpu"), channels_last, script.NORMALIZE))
    raw, expected_labels = default_collate(samples)
    mean, std = (torch.tensor(v).view(1, 3, 1, 1) * 255 for v in script.NORMALIZE[3])
    assert torch.equal(labels, expected_labels) and torch.allclose(images, (raw.float() - mean) / std)
    assert images.is_contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)


@pytest.mark.parametrize("normalize", [None, {1: ((0.5,), (0.25,))}])
def test_gray_images_normalized_by_the_datas_mean_or_imagenets_and_float_inputs_channels_last(script, normalize):
    """1xHxW uint8 images: the data's own mean and std, else the mean of ImageNet's three (0.449, 0.226); float
    inputs pass unchanged, in the model's memory format (FSDP and Horovod keep the weights contiguous and rely on
    channels-last inputs)."""
    gray = torch.randint(0, 256, (4, 1, 8, 8), dtype=torch.uint8)
    floats = torch.randn(4, 3, 8, 8)
    [(images, _), (same, _)] = list(script.DeviceBatches([(gray, torch.zeros(4)), (floats, torch.zeros(4))],
                                                         torch.device("cpu"), True, normalize or script.NORMALIZE))
    mean, std = (normalize or {1: ((0.449,), (0.226,))})[1]
    assert torch.allclose(images, (gray.float() - mean[0] * 255) / (std[0] * 255))
    assert torch.equal(same, floats) and same.is_contiguous(memory_format=torch.channels_last)
