"""Input pipeline throughput on one core, pipelines and JPEG decoders side by side on the same JPEGs.

    python benchmarks/input_pipeline.py                  # generates ImageNet-sized test JPEGs
    python benchmarks/input_pipeline.py /data/imagenet/train --limit 500   # or real photos

Each pipeline does what a loader worker does with a batch of files: for (a) and (b), loading and
augmenting every image, then collating the batch.
(a) pytorch/examples: PIL decode, RandomResizedCrop, flip, ToTensor, Normalize (float out of the
    worker), default_collate
(b) this repository: distributed.py's load_image (libjpeg-turbo via torchcodec), train transform
    and the loaders' collate with its checks (uint8 out; normalization happens once, on the device)
(c) decode only, with torchcodec (what load_image uses), (d) with torchvision.io (deprecated), (e) with PIL
    (what load_image falls back to), each to the same uint8 RGB tensor
Prints img/s for each and the ratios b/a (target >= 1.8), b/c (target >= 0.7), and torchcodec's over
the other decoders, c/d and c/e. With --workers N, it also times (a) and (b) through a DataLoader with
N worker processes, as training runs them.
"""
import argparse
import functools
import importlib.util
import random
import sys
import tempfile
import time
from pathlib import Path

import torch
import torchvision
from PIL import Image
from torch.utils.data import DataLoader, Dataset, default_collate
from torchvision import transforms
from torchvision.transforms.v2.functional import pil_to_tensor

ROOT = Path(__file__).resolve().parents[1]
BATCH = 32
SIZES = [(500, 375), (375, 500), (500, 333), (333, 500), (500, 400), (400, 300), (640, 480), (300, 225)]


def reference_script():
    spec = importlib.util.spec_from_file_location("distributed", ROOT / "distributed.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_jpegs(folder, count, seed=0):
    """Photo-like JPEGs at ImageNet's common sizes (mean about 70 kB at quality 90): smooth shapes,
    edges and sensor noise, so that the decoder does the work a real photo asks of it."""
    gen = torch.Generator().manual_seed(seed)
    paths = []
    for i in range(count):
        w, h = SIZES[i % len(SIZES)]
        y, x = torch.meshgrid(torch.arange(h, dtype=torch.float32), torch.arange(w, dtype=torch.float32), indexing="ij")
        freq = torch.rand(3, 2, generator=gen) * 0.2 + 0.02
        img = torch.stack([torch.sin(x * fx + c) * 70 + torch.cos(y * fy) * 50 + 128
                           for c, (fx, fy) in enumerate(freq)])
        img += (x > w * torch.rand(1, generator=gen)).float() * 40  # an edge
        img += torch.randn(3, h, w, generator=gen) * 10
        path = Path(folder) / f"{i:05d}.JPEG"
        Image.fromarray(img.clamp(0, 255).to(torch.uint8).permute(1, 2, 0).numpy()).save(path, quality=90)
        paths.append(path)
    return paths


def examples_pipeline():
    tf = transforms.Compose([transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(),
                             transforms.ToTensor(),
                             transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])

    def load(path):
        with open(path, "rb") as f:
            return tf(Image.open(f).convert("RGB"))
    return load, default_collate


def repository_pipeline(script):
    args = argparse.Namespace(crop_size=224, val_resize=256, dummy=True, dummy_size=1, dataset=None)
    train_tf = script.build_datasets(args)[0].transform
    return (lambda path: train_tf(script.load_image(path))), functools.partial(script.check_items, num_classes=1000)


def decode_only(decoder):
    """Reads and decodes a file to a uint8 RGB CxHxW tensor, nothing else."""
    if decoder == "torchcodec":
        from torchcodec.decoders import decode_jpeg
        return (lambda path: decode_jpeg(Path(path).read_bytes())), None
    if decoder == "torchvision.io":
        mode = torchvision.io.ImageReadMode.RGB
        return (lambda path: torchvision.io.decode_jpeg(torchvision.io.read_file(str(path)), mode=mode)), None
    return (lambda path: pil_to_tensor(Image.open(path).convert("RGB"))), None


def best_rate(one_pass, images, seconds):
    """img/s of the best of several timed passes (the one least disturbed by anything else running)."""
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        one_pass()
        best = max(best, images / (time.perf_counter() - start))
    return best


def images_per_second(pipeline, paths, seconds):
    load, collate = pipeline

    def one_pass():
        for first in range(0, len(paths), BATCH):
            samples = [(load(path), 0) for path in paths[first:first + BATCH]]
            if collate:
                collate(samples)
    return best_rate(one_pass, len(paths), seconds)


class Files(Dataset):
    def __init__(self, paths, load):
        self.paths, self.load = paths, load

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, index):
        return self.load(self.paths[index]), 0


def loader_images_per_second(pipeline, paths, seconds, workers):
    """The same work done by a DataLoader's worker processes (forked, so that they inherit the pipeline);
    this process only receives the batches."""
    load, collate = pipeline
    loader = DataLoader(Files(paths, load), batch_size=BATCH, num_workers=workers, collate_fn=collate,
                        persistent_workers=True, multiprocessing_context="fork")
    return best_rate(lambda: sum(1 for _ in loader), len(paths), seconds)


def compare(rates, paths, args, **kwargs):
    """Best img/s of each pipeline, the pipelines taking turns so that a slow moment of the machine hits all."""
    best = dict.fromkeys(rates, 0.0)
    for _ in range(args.rounds):
        for name, rate in rates.items():
            best[name] = max(best[name], rate(paths, args.seconds / args.rounds, **kwargs))
    for name, rate in best.items():
        print(f"{name:20s} {rate:7.0f} img/s")
    return list(best.values())


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("folder", nargs="?", help="JPEGs to read (searched recursively); default: generated ones")
    p.add_argument("--limit", type=int, default=200, help="at most this many files")
    p.add_argument("--seconds", type=float, default=6, help="time per pipeline, shared among the rounds")
    p.add_argument("--rounds", type=int, default=2, help="the pipelines take turns this many times")
    p.add_argument("--workers", type=int, default=0,
                   help="also time (a) and (b) through a DataLoader with this many workers")
    args = p.parse_args()
    torch.set_num_threads(1)
    random.seed(0)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        if args.folder:
            paths = sorted(p for p in Path(args.folder).rglob("*")
                           if p.suffix.lower() in (".jpg", ".jpeg"))[:args.limit]
        else:
            paths = make_jpegs(tmp, args.limit)
        kb = sum(p.stat().st_size for p in paths) / len(paths) / 1000
        print(f"{len(paths)} JPEGs, mean {kb:.0f} kB, one core (torch threads 1)")
        pipelines = {"a pytorch/examples": examples_pipeline(),
                     "b this repository": repository_pipeline(reference_script()),
                     "c decode torchcodec": decode_only("torchcodec"),
                     "d decode tv.io": decode_only("torchvision.io"),
                     "e decode PIL": decode_only("PIL")}
        a, b, c, d, e = compare({name: functools.partial(images_per_second, pipeline)
                                 for name, pipeline in pipelines.items()},
                                paths, args)
        print(f"b / a = {b / a:.2f} (target >= 1.8)   b / c = {b / c:.2f} (target >= 0.7)")
        print(f"torchcodec: c / d = {c / d:.2f} of torchvision.io's speed, c / e = {c / e:.2f} of PIL's")
        if args.workers:
            print(f"through a DataLoader with {args.workers} worker(s):")
            a, b = compare({name: functools.partial(loader_images_per_second, pipelines[name])
                            for name in list(pipelines)[:2]},
                           paths, args, workers=args.workers)
            print(f"b / a = {b / a:.2f}")

if __name__ == "__main__":
    sys.exit(main())
