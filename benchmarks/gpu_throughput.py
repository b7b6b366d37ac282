"""Training throughput on one GPU: distributed.py with and without its input pipeline, and the
pytorch/examples way of loading, side by side in one run on the same JPEGs.

    python benchmarks/gpu_throughput.py                        # generates ImageNet-sized JPEGs
    python benchmarks/gpu_throughput.py --images /data/imagenet/train --workers 16 4 --out results.json
    python benchmarks/gpu_throughput.py --allow-cpu -a resnet18 --crop-size 32 -b 4 --jpegs 12 \
        --steps 4 -p 2 --workers 1 --lr 0.01                  # CPU smoke run of the same code

Defaults: resnet50 at 224 px, batch 256, bf16 autocast, channels_last, the first visible GPU.
(a) `distributed.py --benchmark N`: synthetic batches already on the device, no input pipeline: what
    the GPU can do.
(b) `distributed.py DIR`, launched as users launch it: the whole script training on the JPEGs.
(c) the pytorch/examples imagenet/main.py way: ImageFolder's PIL loader, RandomResizedCrop, flip,
    ToTensor and Normalize in the workers, default collate, pinned memory, `.to(device,
    non_blocking=True)`, `loss.item()` every step (its AverageMeter), with the same model, batch,
    autocast, channels_last and cudnn autotuning as (b).
(d) decoding on the GPU, which the scripts do not do (they decode in the loader workers): here, on its own, until a
    GPU shows that it pays. The loader workers only read the files; the training process decodes them (torchcodec:
    nvJPEG, a batch per call), crops, flips and normalizes them on the GPU, and takes (b)'s step: the same model,
    fused SGD, autocast, channels_last and cudnn autotuning, no sync per step. Not run, saying why, where torchcodec
    does not load.
(b), (c) and (d) run once per --workers count: default every core (os.cpu_count()) and 4, a GPU's share of
a node short of cores. Each is a fresh process that trains two epochs of -p + --steps steps and times
the second after its first -p steps: the first epoch takes the warm-up (worker start, cudnn autotuning,
first reads), and the second starts from empty loader queues, so no batches made ahead during the slow
first steps inflate the timed ones. (b) is timed from distributed.py's progress lines (each gives img/s
since the previous one, after a GPU sync), (c) and (d) likewise, and (a) times --steps steps after its own
warm-up: every run times --steps x batch images. Prints img/s for each, the ratios b/a (target >= 0.9
with all cores), b/c (target >= 1.3 with 4 workers) and d/b (what decoding on the GPU gains), and the
machine.

The train set holds (-p + --steps) x batch images in 10 classes (the class count of --benchmark's
synthetic data, so that all three train the same model): links to --jpegs distinct files, each read
several times per epoch.
"""
import argparse
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch
import torchvision
from torch.utils.data import DataLoader
from torchvision import datasets, transforms
from torchvision.transforms import v2

from input_pipeline import make_jpegs

ROOT = Path(__file__).resolve().parents[1]
CLASSES = 10  # distributed.py --benchmark's synthetic data has 10 classes: (b) and (c) train the same model
# one line per -p steps of distributed.py's training, when stdout is not a terminal, e.g.
#   Epoch 1 [ 40/160] loss 2.3129 acc1 10.16 lr 0.1 2874 img/s    (img/s since the previous line)
PROGRESS = re.compile(r"^Epoch (\d+) \[ *(\d+)/(\d+)\] .* (\d+) img/s$", re.M)
# distributed.py --benchmark's result, e.g.  benchmark: 3012 img/s over 150 steps, 1 processes, ...
BENCHMARK = re.compile(r"^benchmark: (\d+) img/s over (\d+) steps", re.M)
RESULT = re.compile(r"^run-result (\{.*\})$", re.M)  # (c)'s and (d)'s, each run in a process of its own


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--images", metavar="DIR",
                   help="JPEGs to train on, searched recursively (e.g. /data/imagenet/train); default: generated ones")
    p.add_argument("--jpegs", type=int, default=1024, help="distinct JPEGs: generated, or taken evenly from --images")
    p.add_argument("-a", "--arch", default="resnet50")
    p.add_argument("--crop-size", type=int, default=224)
    p.add_argument("-b", "--batch-size", type=int, default=256)
    p.add_argument("--amp", choices=("bf16", "fp16", "none"), default="bf16")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--steps", type=int, default=150, help="timed steps of every run (an epoch is -p + --steps steps)")
    p.add_argument("-p", "--print-freq", type=int, default=10,
                   help="distributed.py's -p (its default), whose progress lines time (b); each epoch's first -p steps "
                   "are untimed")
    p.add_argument("--workers", type=int, nargs="+", default=sorted({os.cpu_count(), 4}, reverse=True),
                   help="loader workers for (b) and (c), one run of each per count (default: os.cpu_count() and 4)")
    p.add_argument("--launcher", choices=("python", "torchrun"), default="python",
                   help="how (a) and (b) start distributed.py: one plain process, or torchrun with one process (DDP)")
    p.add_argument("--allow-cpu", action="store_true", help="without CUDA, compare on the CPU (a smoke test)")
    p.add_argument("--out", metavar="FILE", help="also write the results as JSON")
    p.add_argument("--timeout", type=float, default=3600, help="seconds a run may take")
    p.add_argument("--examples-run", metavar="DIR", help=argparse.SUPPRESS)  # (c), in a process of its own
    p.add_argument("--gpu-decode-run", metavar="DIR", help=argparse.SUPPRESS)  # (d), likewise
    args = p.parse_args()
    problems = [f"--{name.replace('_', '-')} must be at least {least}" for name, least in
                (("steps", 1), ("print_freq", 1), ("batch_size", 1), ("jpegs", 1), ("crop_size", 8))
                if getattr(args, name) < least]
    if (args.print_freq + args.steps) * args.batch_size < CLASSES:
        problems.append(f"an epoch needs at least {CLASSES} images, one per class: raise --steps or -b")
    if args.arch not in torchvision.models.list_models(module=torchvision.models):
        problems.append(f"--arch {args.arch}: not a torchvision classification model")
    if min(args.workers) < 0:
        problems.append("--workers counts cannot be negative")
    if args.images and not os.path.isdir(args.images):
        problems.append(f"--images {args.images}: no such folder")
    if problems:
        p.error("; ".join(problems))
    args.workers = list(dict.fromkeys(args.workers))
    return args


# ---------------------------------------------------------------------------------------------
# (c) the pytorch/examples way: imagenet/main.py's train(), run in a process of its own
# ---------------------------------------------------------------------------------------------
class AverageMeter:
    """pytorch/examples' meter. Its __str__ formats the accuracies, device tensors, with .item()."""

    def __init__(self, name, fmt=":f"):
        self.name, self.fmt = name, fmt
        self.val = self.avg = self.sum = self.count = 0

    def update(self, val, n=1):
        self.val = val
        self.sum += val * n
        self.count += n
        self.avg = self.sum / self.count

    def __str__(self):
        return ("{name} {val" + self.fmt + "} ({avg" + self.fmt + "})").format(**self.__dict__)


def accuracy(output, target, topk=(1,)):
    with torch.no_grad():
        maxk = max(topk)
        batch_size = target.size(0)
        _, pred = output.topk(maxk, 1, True, True)
        pred = pred.t()
        correct = pred.eq(target.view(1, -1).expand_as(pred))
        return [correct[:k].reshape(-1).float().sum(0, keepdim=True).mul_(100.0 / batch_size) for k in topk]


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def examples_run(args):
    """Two epochs as pytorch/examples trains them; prints the second's img/s. Its own choices are kept
    (v1 transforms, default collate, shuffle, no persistent workers, pinned memory); added, so that only
    the input pipeline and the step's bookkeeping differ from distributed.py: autocast, channels_last
    (model and input) and cudnn autotuning, as distributed.py has them."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cudnn.benchmark = True
    normalize = transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    train_dataset = datasets.ImageFolder(os.path.join(args.examples_run, "train"), transforms.Compose([
        transforms.RandomResizedCrop(args.crop_size), transforms.RandomHorizontalFlip(), transforms.ToTensor(),
        normalize]))
    # examples pins memory always; without CUDA torch would only warn and not pin
    train_loader = DataLoader(train_dataset, batch_size=args.batch_size, shuffle=True, num_workers=args.workers[0],
                              pin_memory=device.type == "cuda")
    model = torchvision.models.get_model(args.arch, num_classes=len(train_dataset.classes))
    model.to(device, memory_format=torch.channels_last)
    criterion = torch.nn.CrossEntropyLoss().to(device)
    optimizer = torch.optim.SGD(model.parameters(), args.lr, momentum=0.9, weight_decay=1e-4)
    amp_dtype = {"none": None, "fp16": torch.float16, "bf16": torch.bfloat16}[args.amp]
    scaler = torch.amp.GradScaler("cuda", enabled=args.amp == "fp16")
    for epoch in range(2):
        result = examples_train(train_loader, model, criterion, optimizer, scaler, amp_dtype, epoch, device, args)
    print("run-result " + json.dumps(result), flush=True)


def examples_train(train_loader, model, criterion, optimizer, scaler, amp_dtype, epoch, device, args):
    """imagenet/main.py's train(), timed as distributed.py's progress lines time (b): from a GPU sync after
    the first -p steps to one after the last."""
    meters = [AverageMeter("Time", ":6.3f"), AverageMeter("Data", ":6.3f"), AverageMeter("Loss", ":.4e"),
              AverageMeter("Acc@1", ":6.2f"), AverageMeter("Acc@5", ":6.2f")]
    batch_time, data_time, losses, top1, top5 = meters
    model.train()
    started = end = time.monotonic()
    for i, (images, target) in enumerate(train_loader):
        data_time.update(time.monotonic() - end)
        images = images.to(device, non_blocking=True).contiguous(memory_format=torch.channels_last)
        target = target.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            output = model(images)
            loss = criterion(output, target)
        acc1, acc5 = accuracy(output, target, topk=(1, 5))
        losses.update(loss.item(), images.size(0))
        top1.update(acc1[0], images.size(0))
        top5.update(acc5[0], images.size(0))
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        batch_time.update(time.monotonic() - end)
        end = time.monotonic()
        if i % args.print_freq == 0:  # ProgressMeter.display
            digits = len(str(len(train_loader)))
            print(f"Epoch: [{epoch}][{i + 1:>{digits}}/{len(train_loader)}]\t" + "\t".join(map(str, meters)))
        if i + 1 == args.print_freq:
            synchronize(device)
            timed_from = time.monotonic()
    return rates(len(train_loader), started, timed_from, device, args)


def rates(steps, started, timed_from, device, args):
    """img/s of an epoch of `steps` steps, timed from a GPU sync after its first -p steps to one after its last (the
    run's), and over the whole epoch."""
    synchronize(device)
    done = time.monotonic()
    images = (steps - args.print_freq) * args.batch_size
    return {"img_per_s": images / (done - timed_from), "images": images,
            "epoch_img_per_s": steps * args.batch_size / (done - started)}


# ---------------------------------------------------------------------------------------------
# (d) decoding on the GPU: the loader workers read the files, the training process decodes and crops them
# ---------------------------------------------------------------------------------------------
class FileBytes(datasets.ImageFolder):
    """An image folder whose samples are their files' bytes (a uint8 tensor each), read in the loader workers."""

    def __getitem__(self, index):
        path, label = self.samples[index]
        with open(path, "rb") as f:
            return torch.frombuffer(bytearray(f.read()), dtype=torch.uint8), label


def file_batch(samples):
    files, labels = zip(*samples)
    return list(files), torch.tensor(labels)


def gpu_decode_run(args):
    """Two epochs of (b)'s step on batches decoded on the device, a batch per decode call; prints the second's img/s,
    timed as (c)."""
    from torchcodec.decoders import decode_jpeg
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cudnn.benchmark = True
    loader = DataLoader(FileBytes(os.path.join(args.gpu_decode_run, "train")), batch_size=args.batch_size,
                        shuffle=True, num_workers=args.workers[0], persistent_workers=args.workers[0] > 0,
                        collate_fn=file_batch, drop_last=True)
    crop = v2.Compose([v2.RandomResizedCrop(args.crop_size, antialias=True), v2.RandomHorizontalFlip()])
    mean, std = (torch.tensor(v, device=device).view(1, 3, 1, 1) * 255 for v in ((0.485, 0.456, 0.406),
                                                                                  (0.229, 0.224, 0.225)))
    model = torchvision.models.get_model(args.arch, num_classes=CLASSES)
    model.to(device, memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), args.lr, momentum=0.9, weight_decay=1e-4, fused=True)
    amp_dtype = {"none": None, "fp16": torch.float16, "bf16": torch.bfloat16}[args.amp]
    scaler = torch.amp.GradScaler(device.type, enabled=args.amp == "fp16")
    for _ in range(2):
        model.train()
        started = time.monotonic()
        for i, (files, target) in enumerate(loader):
            images = torch.stack([crop(image) for image in decode_jpeg(files, device=device)])
            images = images.contiguous(memory_format=torch.channels_last).float().sub_(mean).div_(std)
            target = target.to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                loss = torch.nn.functional.cross_entropy(model(images), target)
            optimizer.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            if i + 1 == args.print_freq:
                synchronize(device)
                timed_from = time.monotonic()
        result = rates(len(loader), started, timed_from, device, args)
    print("run-result " + json.dumps(result), flush=True)


# ---------------------------------------------------------------------------------------------
# The comparison
# ---------------------------------------------------------------------------------------------
def _make_jpegs(folder, count, seed):
    torch.set_num_threads(1)
    return make_jpegs(folder, count, seed)


def generate_jpegs(folder, count, chunk=64):
    """input_pipeline.py's photo-like ImageNet-sized JPEGs, made in chunks on every core."""
    jobs = [(Path(folder) / f"{c:04d}", min(chunk, count - start), c) for c, start in enumerate(range(0, count, chunk))]
    for path, _, _ in jobs:
        path.mkdir(parents=True)
    if len(jobs) == 1:
        return _make_jpegs(*jobs[0])
    with ProcessPoolExecutor(min(len(jobs), os.cpu_count())) as pool:
        return [path for part in pool.map(_make_jpegs, *zip(*jobs)) for path in part]


def find_jpegs(folder, count):
    paths = sorted(p for p in Path(folder).rglob("*") if p.suffix.lower() in (".jpg", ".jpeg"))
    if not paths:
        sys.exit(f"error: no .jpg/.jpeg files under {folder}")
    return [p.resolve() for p in paths[::max(len(paths) // count, 1)][:count]]  # spread over all classes


def lay_out(jpegs, root, train_images):
    """An ImageFolder root for both distributed.py and the examples loader: train/ with train_images links
    (the JPEGs in turn) over CLASSES classes, val/ with one per class (distributed.py validates each epoch)."""
    root = Path(root)
    for j in range(train_images):
        folder = root / "train" / f"class{j % CLASSES}"
        folder.mkdir(parents=True, exist_ok=True)
        os.symlink(jpegs[j % len(jpegs)], folder / f"{j:07d}.JPEG")
    for k in range(CLASSES):
        folder = root / "val" / f"class{k}"
        folder.mkdir(parents=True)
        os.symlink(jpegs[k % len(jpegs)], folder / "0.JPEG")
    return root


def launch(cmd, timeout):
    """Runs cmd (its output captured) in a session of its own, so that a timeout or Ctrl-C ends its
    loader workers too."""
    cmd = [str(c) for c in cmd]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except BaseException as e:
        for sig, grace in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
            try:
                os.killpg(proc.pid, sig)
                proc.communicate(timeout=grace)
                break
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        if isinstance(e, subprocess.TimeoutExpired):
            sys.exit(f"error: timed out after {timeout:.0f} s (--timeout): {' '.join(cmd)}")
        raise
    if proc.returncode:
        sys.exit(f"error: exit code {proc.returncode}: {' '.join(cmd)}\n{out[-4000:]}")
    return out


def distributed_cmd(args, *extra):
    torchrun = Path(sys.executable).with_name("torchrun")  # or, installed elsewhere, its module
    torchrun = [torchrun] if torchrun.exists() else [sys.executable, "-m", "torch.distributed.run"]
    launcher = [sys.executable] if args.launcher == "python" else [*torchrun, "--standalone", "--nproc_per_node=1"]
    return [*launcher, ROOT / "distributed.py", "-a", args.arch, "--crop-size", args.crop_size,
            "--val-resize", args.crop_size * 8 // 7, "-b", args.batch_size, "--amp", args.amp, "--channels-last",
            "--lr", args.lr, "-p", args.print_freq, *extra]


def run_benchmark(args, tmp):
    """(a): distributed.py warms up for N/10 steps, then times N."""
    out = launch(distributed_cmd(args, "--benchmark", args.steps, "-j", 0, "--output-dir", Path(tmp) / "out-a"),
                 args.timeout)
    found = BENCHMARK.search(out)
    if not found or int(found[2]) != args.steps:
        sys.exit(f"error: no 'benchmark: N img/s over {args.steps} steps' line from distributed.py:\n{out[-4000:]}")
    return {"img_per_s": float(found[1]), "images": args.steps * args.batch_size, "epoch_img_per_s": None}


def torchcodec_missing():
    """Why torchcodec's JPEG decoder, which (d) needs, does not load here; "" when it does."""
    try:
        from torchcodec.decoders import decode_jpeg  # noqa: F401
    except Exception as e:  # not installed, or built for another torch
        return f"{type(e).__name__}: {e}"
    return ""


def run_distributed(args, data, workers, tmp):
    """(b): two epochs; img/s of the second after its first -p steps, from the progress lines, and of the whole second
    epoch, from metrics.jsonl."""
    out_dir = Path(tmp) / f"out-{workers}"
    out = launch(distributed_cmd(args, data, "-j", workers, "--epochs", 2, "--output-dir", out_dir), args.timeout)
    total = args.print_freq + args.steps
    points = [(int(m[2]), int(m[3]), int(m[4])) for m in PROGRESS.finditer(out) if m[1] == "1"]
    steps = [step for step, _, _ in points]
    if steps[:1] != [args.print_freq] or steps[-1:] != [total] or any(n != total for _, n, _ in points):
        sys.exit(f"error: expected distributed.py's progress lines 'Epoch 1 [k/{total}] ... N img/s' from step "
                 f"{args.print_freq} to {total}, found steps {steps}:\n{out[-4000:]}")
    seconds = sum((step - previous) * args.batch_size / max(rate, 0.5)  # printed rounded: 0 means below 0.5
                  for (previous, _, _), (step, _, rate) in zip(points, points[1:]))
    epochs = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    images = args.steps * args.batch_size
    return {"img_per_s": images / seconds, "images": images, "epoch_img_per_s": epochs[1]["img_per_s"]}


def run_own(args, data, workers, run):
    """(c) or (d), whose `run` is --examples-run or --gpu-decode-run: in a process of its own."""
    cmd = [sys.executable, Path(__file__).resolve(), run, data, "--workers", workers, "-a", args.arch,
           "--crop-size", args.crop_size, "-b", args.batch_size, "--amp", args.amp, "--lr", args.lr,
           "--steps", args.steps, "-p", args.print_freq]
    out = launch(cmd, args.timeout)
    found = RESULT.search(out)
    if not found:
        sys.exit(f"error: no result from {run}:\n{out[-4000:]}")
    return json.loads(found[1])


def machine(device):
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:  # not Linux
        pass
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (no GPU, --allow-cpu)",
            "torch": torch.__version__, "cuda": torch.version.cuda, "torchvision": torchvision.__version__,
            "python": platform.python_version(), "cpu": cpu, "cpu_count": os.cpu_count(), "usable_cpus": usable}


def main():
    args = parse_args()
    if args.examples_run:
        return examples_run(args)
    if args.gpu_decode_run:
        return gpu_decode_run(args)
    if not torch.cuda.is_available() and not args.allow_cpu:
        print("error: no CUDA GPU is visible (torch.cuda.is_available() is False); this benchmark measures a GPU: "
              "run it on a GPU machine, or pass --allow-cpu for a CPU smoke run with tiny settings", file=sys.stderr)
        return 2
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    info = machine(device)
    usable = "" if info["usable_cpus"] == info["cpu_count"] else f", {info['usable_cpus']} usable here"
    print(f"machine: {info['device']} · torch {info['torch']} (CUDA {info['cuda']}), torchvision "
          f"{info['torchvision']}, Python {info['python']} · {info['cpu_count']} CPUs (os.cpu_count(){usable}), "
          f"{info['cpu']}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="gpu_throughput_") as tmp:
        if args.images:
            jpegs, source = find_jpegs(args.images, args.jpegs), args.images
        else:
            jpegs, source = generate_jpegs(Path(tmp) / "jpegs", args.jpegs), "generated, ImageNet-sized"
        kb = sum(p.stat().st_size for p in jpegs) / len(jpegs) / 1000
        data = lay_out(jpegs, Path(tmp) / "data", (args.print_freq + args.steps) * args.batch_size)
        print(f"{args.arch} at {args.crop_size} px, batch {args.batch_size}, --amp {args.amp}, channels_last, on "
              f"{device.type}; {len(jpegs)} distinct JPEGs ({source}, mean {kb:.0f} kB)\nevery run times "
              f"{args.steps} steps ({args.steps * args.batch_size} images); (b) and (c) in their second epoch, after "
              f"its first {args.print_freq} steps", flush=True)
        no_decoder = torchcodec_missing()
        if no_decoder:
            print(f"(d) not run: it needs torchcodec, which did not load ({no_decoder})", flush=True)
        runs = [("a", None, "distributed.py --benchmark (no input pipeline)", lambda: run_benchmark(args, tmp))]
        for w in args.workers:
            runs += [("b", w, "distributed.py on the JPEGs", lambda w=w: run_distributed(args, data, w, tmp)),
                     ("c", w, "pytorch/examples way", lambda w=w: run_own(args, data, w, "--examples-run"))]
            runs += [] if no_decoder else [("d", w, "decoded on the GPU, (b)'s step",
                                            lambda w=w: run_own(args, data, w, "--gpu-decode-run"))]
        for key, workers, name, measure in runs:
            print(f"running ({key}) {name}" + ("" if workers is None else f", {workers} loader workers") + " ...",
                  flush=True)
            rows.append({"run": key, "name": name, "workers": workers, **measure()})

    a = rows[0]["img_per_s"]
    rate = {(r["run"], r["workers"]): r["img_per_s"] for r in rows}
    ratios = [{"workers": w, "b/a": rate["b", w] / a, "b/c": rate["b", w] / rate["c", w],
               "d/b": rate["d", w] / rate["b", w] if ("d", w) in rate else None} for w in args.workers]
    print(f"\n{'run':52} {'workers':>7} {'img/s':>8} {'whole epoch':>11}")  # img/s of (b)'s and (c)'s 2nd epoch
    for r in rows:
        whole = "-" if r["epoch_img_per_s"] is None else f"{r['epoch_img_per_s']:.0f}"
        workers = "-" if r["workers"] is None else r["workers"]
        print(f"({r['run']}) {r['name']:48} {workers:>7} {r['img_per_s']:>8.0f} {whole:>11}")
    print(f"\n{'workers':>7} {'b/a':>6} {'b/c':>6} {'d/b':>6}")
    for r in ratios:
        d_b = "-" if r["d/b"] is None else f"{r['d/b']:.2f}"
        print(f"{r['workers']:>7} {r['b/a']:>6.2f} {r['b/c']:>6.2f} {d_b:>6}")
    most, fewest = ratios[args.workers.index(max(args.workers))], ratios[args.workers.index(min(args.workers))]
    print(f"b / a = {most['b/a']:.2f} with {most['workers']} workers (target >= 0.9 with all {os.cpu_count()} cores)")
    print(f"b / c = {fewest['b/c']:.2f} with {fewest['workers']} workers (target >= 1.3 with 4)")
    if fewest["d/b"] is not None:
        print(f"d / b = {fewest['d/b']:.2f} with {fewest['workers']} workers (decoding on the GPU over the workers')")
    if args.out:
        settings = {k: v for k, v in vars(args).items()
                    if k not in ("examples_run", "out", "allow_cpu", "images", "jpegs")}
        settings.update(device=device.type, jpegs=source, distinct_jpegs=len(jpegs), mean_kb=round(kb, 1))
        Path(args.out).write_text(json.dumps({"machine": info, "settings": settings, "runs": rows, "ratios": ratios},
                                             indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
