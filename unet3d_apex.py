r"""3D U-Net segmentation with DistributedDataParallel and mixed precision, one process per GPU, started by torchrun.

The complete program behind apex's 3D U-Net example (which imported its model, data, loss and evaluation from
elsewhere): volumes cut into random patches, a 3D U-Net, BCE + soft Dice loss, Adam + MultiStepLR (per epoch),
SyncBatchNorm, fp16 autocast with a GradScaler (--amp, the CPU too), and Dice/IoU exact over every voxel of whole
validation volumes, tiled by patches. How the processes start, the process group, DDP, checkpoints and preemption are
distributed.py's (the same text); the training flow has its shape, with the U-Net's loss and metrics.

    # one node, 4 GPUs; DATA holds train/images, train/labels, val/images, val/labels (a mask: its image's name)
    torchrun --standalone --nproc_per_node=4 unet3d_apex.py /data/volumes --sync-bn --amp
    # two nodes (run on each, R = 0 or 1)
    torchrun --nnodes=2 --node-rank=R --nproc_per_node=8 --rdzv-backend=c10d \
        --rdzv-endpoint=HOST:29400 unet3d_apex.py /data/volumes
    # CPU demo, no dataset needed (gloo backend)
    torchrun --standalone --nproc_per_node=2 unet3d_apex.py --synthetic --synthetic-shape 24 48 48 \
        --patch-size 16 32 32 --base-channels 8 --depth 3 -b 4 --lr 3e-3 --epochs 5 -j 0
    # no launcher: one process
    python unet3d_apex.py --synthetic

Read it top to bottom, in three parts: the lesson, which every copier keeps (the command line, the launcher part, the
training flow main -> main_worker -> train_one_epoch / evaluate, what every run needs; the task: volumes and patches,
the U-Net, its loss and metrics); optional features, a block each; the safety net. Every block lies between a line
`# region [NAME]` and a line `# endregion [NAME]`, and every line elsewhere that exists only for it ends with the
comment `# [NAME]` (`# [a] [b]`: for a and for b). Delete a block and its tagged lines, nothing else, and the rest runs;
delete every block for the core. For the block logs (README: Copy only what you need):

  sed -E -i '/^ *# region \[logs\]/,/^ *# endregion \[logs\]/d; /#( \[[a-z0-9-]+\])* \[logs\]( \[[a-z0-9-]+\])*$/d' FILE
"""
import argparse
import contextlib  # [safety]
import ctypes  # [preemption]
import datetime
import gc
import fcntl  # [safety]
import hashlib  # [safety]
import itertools
import json  # [logs]
import math
import multiprocessing  # [preemption]
import os
import random
import shutil
import signal
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch._dynamo  # noqa: F401 (before any process group: see end_process_group)
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler


# =============================================================================================
# Part 1, the lesson every copier keeps: command line, the two seams, launcher part, training flow, what runs need.
# =============================================================================================
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    add = p.add_argument
    add("data", nargs="?", metavar="DIR", help="train/images, train/labels, val/images, val/labels (or --synthetic)")
    add("--synthetic", action="store_true", help="train on generated ellipsoids in noise instead of DIR")
    add("--synthetic-size", type=number(int, 1), default=40, metavar="N", help="train volumes (val: N/4)")
    add("--synthetic-shape", type=number(int, 1), nargs=3, default=(40, 176, 176), metavar=("D", "H", "W"))
    add("--patch-size", type=number(int, 1), nargs=3, default=(32, 160, 160), metavar=("D", "H", "W"),
        help="training patch and evaluation tile, each side a multiple of 2**(depth-1); smaller volumes are padded")
    add("--patches-per-volume", type=number(int, 1), default=4, help="random patches per volume and epoch")
    add("--base-channels", type=number(int, 1), default=16, help="first level's channels (x2 per level)")
    add("--depth", type=number(int, 1), default=4, help="U-Net levels (depth-1 poolings)")
    add("--norm", choices=("batch", "group"), default="batch", help="normalization layer after every convolution")
    add("-j", "--workers", type=number(int, 0), default=4, help="loader processes per training process")
    add("--epochs", type=number(int, 0), default=100)
    add("-b", "--batch-size", type=number(int, 1), default=4, help="global batch of patches")
    add("--eval-batch", type=number(int, 1), default=2, help="tiles per forward pass when evaluating whole volumes")
    add("--lr", type=number(float, 0), default=2e-4, help="Adam learning rate")
    add("--wd", "--weight-decay", type=number(float, 0), default=1e-4, dest="weight_decay")
    add("--milestones", type=number(int, 1), nargs="*", default=[60, 80], help="epochs at which lr *= gamma")
    add("--gamma", type=number(float, 0), default=0.1)
    add("--amp", action="store_true", help="autocast to fp16 with a GradScaler (on a CPU: for tests, slow)")
    add("--sync-bn", action="store_true", help="SyncBatchNorm across processes (CUDA only)")  # [sync-bn]
    add("--resume", default="", metavar="PATH|auto", help="checkpoint to resume from; auto: the one in --output-dir")
    add("-e", "--evaluate", action="store_true", help="evaluate the model (e.g. with --resume) and exit")
    add("--output-dir", default="output", help="checkpoints, metrics.jsonl and tb/")
    add("--seed", type=number(int, 0), default=0, help="same seed, same data and world-size-independent patches")
    add("--deterministic", action="store_true", help="use deterministic algorithms (slower)")  # [deterministic]
    add("-p", "--print-freq", type=number(int, 1), default=10, help="steps between progress lines")
    add("--dist-backend", default=None, help="default: nccl with CUDA, else gloo")
    add("--dist-timeout", type=number(float, 1), default=1800, help="seconds a collective waits on a peer")
    add("--local-rank", "--local_rank", type=int, help=argparse.SUPPRESS)  # torch.distributed.launch's
    args = p.parse_args(argv)
    unit = 2 ** (args.depth - 1)  # [safety]
    if any(side % unit for side in args.patch_size):  # [safety]
        p.error(f"--patch-size: with --depth {args.depth} each side must be a multiple of {unit}")  # [safety]
    if args.synthetic and args.data:  # [safety]
        p.error(f"--synthetic generates its volumes, and {args.data} names a folder: give one of them")  # [safety]
    return args


def number(kind, low, high=float("inf")):
    """An argparse type: a `kind` (int or float) in [low, high); argparse's error line names the flag."""
    def convert(text):
        if not low <= kind(text) < high:  # (NaN is not)
            raise argparse.ArgumentTypeError(f"{text} is out of range: give {kind.__name__} >= {low}, < {high}")
        return kind(text)
    convert.__name__ = kind.__name__  # argparse's "invalid int value: 'x'"
    return convert


def build_datasets(args):
    """(training volumes, validation volumes): generated with --synthetic, else DIR's volume folders."""
    if args.synthetic:
        train = SyntheticVolumes(args.synthetic_size, args.synthetic_shape)
        return train, SyntheticVolumes(max(args.synthetic_size // 4, 1), args.synthetic_shape, offset=10**9)
    if not (args.data and all(os.path.isdir(os.path.join(args.data, split, kind))  # [safety]
                              for split in ("train", "val") for kind in ("images", "labels"))):  # [safety]
        raise UserError(f"{args.data} is no folder with train/ and val/, each with images/ and labels/: "  # [safety]
                        f"give one, or --synthetic")  # [safety]
    return VolumeFolder(os.path.join(args.data, "train")), VolumeFolder(os.path.join(args.data, "val"))


# =============================================================================================
# The launcher part: distributed.py's (torchrun, the process group, DDP), but the batch description, the model's
# preparation, Adam, --amp and the step are the U-Net's. Every sibling has its own (README: How every script reads).
# =============================================================================================
def find_processes(args, local_index):
    """(rank, local_rank, world_size, device): from torchrun's environment, or one process without it."""
    rank, local_rank, world_size = (int(os.environ.get(k, d)) for k, d in
                                    (("RANK", 0), ("LOCAL_RANK", 0), ("WORLD_SIZE", 1)))
    if "TORCHELASTIC_RUN_ID" in os.environ:  # [preemption]
        die_with_parent(signal.SIGKILL)  # [preemption]
    if not torch.cuda.is_available():
        return rank, local_rank, world_size, torch.device("cpu")
    torch.cuda.set_device(local_rank)  # before anything touches CUDA, or every rank crowds GPU 0
    return rank, local_rank, world_size, torch.device("cuda", local_rank)


def start_process_group(args, rank, world_size, device, log):
    """Starts the process group (none for one process); returns its group, or None."""
    if "WORLD_SIZE" not in os.environ:
        return None
    timeout = datetime.timedelta(seconds=args.dist_timeout)
    store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))  # torchrun's store
    group = join_process_group(args, store, rank, world_size, device)
    if "TORCHELASTIC_RUN_ID" in os.environ:  # [preemption]
        die_with_parent(signal.SIGTERM)  # [preemption]
    return group


def end_process_group():
    """Frees the process group while Python is whole (at shutdown, gloo's threads can abort it), FSDP's cycles gone."""
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP):  # [preemption]
        signal.signal(sig, signal.SIG_IGN)  # [preemption]
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


def describe_processes(args, world_size, device, group):
    """How this run is spread, for the first line of the log; the global batch is one of patches."""
    return (f"world size {world_size}, device {device.type}, backend {dist.get_backend() if group else 'none'}, "
            f"global batch {args.batch_size} = {world_size} x {args.batch_size // world_size} patches of "
            f"{'×'.join(map(str, args.patch_size))}")


def prepare_model(model, args, device, log):
    """The model on this process's device; with --sync-bn, BatchNorm layers that compute their statistics over
    the whole global batch: with the 1-2 patches a GPU holds, per-process statistics are noise."""
    model = sync_batchnorm(model, args, device, log)  # [sync-bn]
    return model.to(device)


def build_optimizer(model, args, device, log):
    # fused (the CPU too): one kernel for all parameters, and GradScaler's inf check without waiting for the GPU
    return torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=args.weight_decay, fused=True)


def setup_precision(model, optimizer, args, device, log):
    """(autocast dtype or None, GradScaler) for --amp: fp16 with loss scaling, on the CPU too (slow there: for
    tests, which so run the GPU's path)."""
    return torch.float16 if args.amp else None, torch.amp.GradScaler(device.type, enabled=args.amp)


def wrap_model(model, args, device, amp_dtype):
    """(the model that trains: DDP all-reduces its gradients in backward, the model that evaluates: no collective)."""
    if not dist.is_initialized():
        return model, model
    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None), model


def train_step(run, images, labels):
    """One optimizer step on this process's batch of patches. Returns the loss summed over the batch (float64,
    as SegMetrics sums it), and the logits."""
    target = labels[:, None].float()
    with torch.autocast(images.device.type, dtype=run.amp_dtype, enabled=run.amp_dtype is not None):
        logits = run.train_model(images)
    loss = bce_dice_loss(logits.float(), target)  # outside autocast: the Dice sums run over every voxel
    run.optimizer.zero_grad(set_to_none=True)
    run.scaler.scale(loss).backward()
    run.scaler.step(run.optimizer)  # unscales, and skips the step if a gradient is inf/NaN
    run.scaler.update()
    return loss.detach().double() * target.shape[0], logits.detach().float()


def reduce_tensor(tensor):
    """Sum over all processes (a copy): sums, not means, keep ratios exact however ranks split the samples."""
    tensor = tensor.clone()
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(tensor)
    return tensor


def gather_objects(obj):
    """obj from every rank, in rank order (one, without a process group)."""
    if not dist.is_initialized():
        return [obj]
    objects = [None] * dist.get_world_size()
    dist.all_gather_object(objects, obj)
    return objects


def gather_rng_states():
    """Every rank's random states, in rank order, for the checkpoint (every rank takes part)."""
    return gather_objects(rng_state())


def sync_buffers(model):
    """BatchNorm statistics drift apart per rank; evaluate and save rank 0's, as a checkpoint holds."""
    if dist.is_initialized():
        for buf in model.buffers():
            dist.broadcast(buf, 0)


def main():
    first_on_node = os.environ.get("LOCAL_RANK", "0") == "0"  # [safety]
    try:
        sys.exit(main_worker(parse_args()))  # None (0): finished
    except UserError as e:  # [safety]
        exit_bad_input(e, reporter=first_on_node)  # [safety]
    except KeyboardInterrupt:  # [safety]
        exit_ctrl_c()  # [safety]
    finally:
        end_process_group()  # left to interpreter exit, a gloo thread can abort the process
        end_loader_workers()  # [preemption]


def main_worker(args, local_index=None):
    """One training process, from finding its peers to its last checkpoint; returns None, or the exit code of a run
    stopped early (PREEMPTED)."""
    torch.backends.cudnn.benchmark = True  # cuDNN times its kernels for each new input shape, keeps the fastest
    set_deterministic(args)  # [deterministic]
    rank, local_rank, world_size, device = find_processes(args, local_index)
    log = (lambda *text: print(*text, flush=True)) if rank == 0 else (lambda *_: None)
    log = print_or_drop if rank == 0 else log  # [safety]
    preemption = Preemption()  # [preemption]

    train_set, val_set = build_datasets(args)
    check_run(args, world_size, device, train_set)  # [safety]
    # the loaders fork their workers now: before the process group's threads start (fork_loader_workers says why),
    # and before the model and the checkpoint are read, whose memory every worker would keep for the whole run
    train_sampler, train_batches, val_volumes = build_loaders(args, train_set, val_set, rank, world_size, device)
    config = model_config(args, train_set.channels)
    ckpt_path = resume_path(args)
    ckpt = read_checkpoint(ckpt_path) if ckpt_path else None
    check_checkpoint(ckpt_path, ckpt, config, train_set, args)  # [safety]
    claim_output_dir(args, rank)  # [safety]
    set_seed(args.seed)
    model = UNet3D(**config)  # the same initial weights on every rank
    set_seed(args.seed + rank)  # but each rank its own random draws
    preemption.catch(False)  # [preemption]
    ctrl_c = signal.getsignal(signal.SIGINT)  # Ctrl-C ends the rendezvous' wait at once: no Python handler runs there
    signal.signal(signal.SIGINT, signal.SIG_IGN if ctrl_c is signal.SIG_IGN else signal.SIG_DFL)
    group = start_process_group(args, rank, world_size, device, log)
    signal.signal(signal.SIGINT, ctrl_c)
    preemption.group = group  # [preemption]
    preemption.catch(True)  # [preemption]
    check_ranks_agree(args, (train_set, val_set), ckpt)  # [safety]
    patch = tuple(args.patch_size)
    log(f"{os.path.basename(__file__)}: {describe_processes(args, world_size, device, group)}, 3D U-Net (base "
        f"{args.base_channels}, depth {args.depth}, {args.norm} norm, {sum(p.numel() for p in model.parameters())} "
        f"parameters), {train_set.channels} input channel(s), {len(train_set)} train / {len(val_set)} val volumes")

    model = prepare_model(model, args, device, log)
    optimizer = build_optimizer(model, args, device, log)
    amp_dtype, scaler = setup_precision(model, optimizer, args, device, log)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=args.milestones, gamma=args.gamma)
    run = RunState(model, optimizer, scheduler, scaler, amp_dtype, config)
    run.preemption = preemption  # [preemption]
    run.train_samples = len(train_set)  # [safety]
    if ckpt:
        run.load_state_dict(ckpt, args, rank, world_size)
        moved = "" if args.evaluate or ckpt["world_size"] == world_size else (  # a job resized, a node lost
            f", world size {ckpt['world_size']} -> {world_size}: the same samples, fresh random states")
        log(f"resumed from {ckpt_path} (epoch {ckpt['epoch']}, step {ckpt['step']}){moved}")
        ckpt = None  # all of it is in place now: keep no second copy of the weights
    run.train_model, run.eval_model = wrap_model(model, args, device, amp_dtype)

    if args.evaluate:
        val = evaluate(run.eval_model, val_volumes, patch, args.eval_batch, amp_dtype)
        log(f"val: loss {val['loss']:.6f} dice {val['dice']:.6f} iou {val['iou']:.6f} dice_per_volume "
            f"{val['dice_per_volume']:.6f} (intersection {val['intersection']}, predicted {val['predicted']}, "
            f"true {val['true']}, union {val['union']}, volumes {val['volumes']})")
        return None

    writer = open_writer(args, rank, run.epoch)  # [logs]
    while run.epoch < args.epochs:
        epoch, started = run.epoch, time.monotonic()
        train_sampler.set_epoch(epoch)
        train_sampler.start = run.step * (args.batch_size // world_size)  # [preemption]
        train = train_one_epoch(run, train_batches, args, log)
        if train is None:  # [preemption]
            return run.preemption.stop(run, args, rank, log, f"at epoch {epoch} step {run.step}")  # [preemption]
        train_seconds = time.monotonic() - started
        lr = optimizer.param_groups[0]["lr"]  # [logs]
        scheduler.step()  # per epoch, after it: the rate the epoch trained with is logged
        sync_buffers(model)
        val = evaluate(run.eval_model, val_volumes, patch, args.eval_batch, amp_dtype)
        is_best = val["dice"] > run.best_dice
        run.epoch, run.best_dice = epoch + 1, max(run.best_dice, val["dice"])
        run.save(args, rank, is_best)
        row = {"epoch": epoch, "train_loss": train["loss"], "train_dice": train["dice"],  # [logs]
               **{f"val_{key}": val[key] for key in ("loss", "dice", "iou", "dice_per_volume")},  # [logs]
               "lr": lr, "img_per_s": train["count"] / train_seconds, "seconds": time.monotonic() - started}  # [logs]
        if writer:  # [logs]
            write_epoch(row, writer, args.output_dir)  # [logs]
        log(f"Epoch {epoch}: train loss {train['loss']:.4f} dice {train['dice']:.4f} | val loss {val['loss']:.4f} "
            f"dice {val['dice']:.4f} iou {val['iou']:.4f} dice/volume {val['dice_per_volume']:.4f} | "
            f"{train['count'] / train_seconds:.1f} img/s")
        if run.preemption.agreed(now=True) and run.epoch < args.epochs:  # [preemption]
            return run.preemption.stop(run, args, rank, log, f"after epoch {epoch}", saved=True)  # [preemption]
    return None


class RunState:
    """What a run carries from step to step and resumes: the model, optimizer, scheduler and loss scaler, where
    it is (epoch, step within it), the best validation Dice, and the random states. The one place that writes the
    checkpoint format and reads it back (README: unet3d_apex.py). `config` is the U-Net's shape (model_config)."""

    def __init__(self, model, optimizer, scheduler, scaler, amp_dtype, config):
        self.model, self.optimizer, self.scheduler, self.scaler = model, optimizer, scheduler, scaler
        self.amp_dtype, self.train_model, self.eval_model, self.config = amp_dtype, model, model, config
        # below any Dice: the first epoch's model is the best so far, even one that predicts nothing
        self.epoch, self.step, self.best_dice = 0, 0, -1.0
        self.train_sums = None  # [preemption]

    def save(self, args, rank, is_best):
        """Every rank takes part (their random states are gathered); rank 0 writes."""
        rng_states = gather_rng_states()
        if rank == 0:
            save_checkpoint({
                "epoch": self.epoch, "step": self.step, "arch": "unet3d", "model": self.config,
                "state_dict": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict(),
                "best_dice": self.best_dice, "args": vars(args), "world_size": len(rng_states),
                "rng_states": rng_states,
                "train_sums": self.train_sums,  # [preemption]
                "train_samples": self.train_samples,  # [safety]
            }, is_best, args.output_dir)

    def load_state_dict(self, ckpt, args, rank, world_size):
        """Everything back from a checkpoint (load_checkpoint's); only the weights for --evaluate."""
        self.model.load_state_dict(ckpt["state_dict"])
        if args.evaluate:
            return
        self.optimizer.load_state_dict(ckpt["optimizer"])
        self.scheduler.load_state_dict(ckpt["scheduler"])
        if ckpt["scaler"]:  # empty when saved without fp16 loss scaling: the scaler starts afresh
            self.scaler.load_state_dict(ckpt["scaler"])
        self.epoch, self.step, self.best_dice = ckpt["epoch"], ckpt["step"], ckpt["best_dice"]
        self.train_sums = ckpt["train_sums"] if rank == 0 else None  # [preemption]
        if ckpt["world_size"] == world_size:
            set_rng_state(ckpt["rng_states"][rank])


def train_one_epoch(run, batches, args, log):
    """One pass over this rank's share of the patches, from step run.step on. Returns the epoch's summary (loss,
    dice, count), or None when every rank agreed to stop: run.step and run.train_sums then say where."""
    run.train_model.train()
    device = next(run.model.parameters()).device
    metrics = SegMetrics(device)
    steps_per_epoch = run.step + len(batches)
    last_time, last_count = time.monotonic(), 0
    if run.train_sums is not None:  # [preemption]
        metrics.sums += run.train_sums.to(device)  # [preemption]
        last_count = run.train_sums[1].item()  # [preemption]

    def report(step):
        nonlocal last_time, last_count
        s = metrics.summary()
        check_finite(s, run.epoch, step)  # [safety]
        now = time.monotonic()
        text = (f"loss {s['loss']:.4f} dice {s['dice']:.4f} lr {run.optimizer.param_groups[0]['lr']:.4g} "
                f"{(s['count'] - last_count) / max(now - last_time, 1e-9):.1f} img/s")
        last_time, last_count = now, s["count"]
        log(f"Epoch {run.epoch} [{step:>{len(str(steps_per_epoch))}}/{steps_per_epoch}] {text}")
        return s

    for step, (images, labels) in enumerate(batches, start=run.step):
        if run.preemption.agreed():  # [preemption]
            run.step, run.train_sums = step, reduce_tensor(metrics.sums).cpu()  # [preemption]
            return None  # [preemption]
        loss_sum, logits = train_step(run, images, labels)
        metrics.update(loss_sum, logits, labels[:, None])
        if (step + 1) % args.print_freq == 0 and step + 1 < steps_per_epoch:
            report(step + 1)
    summary = report(steps_per_epoch)
    run.step = 0
    run.train_sums = None  # [preemption]
    return summary


def evaluate(model, volumes, patch, tiles_per_pass, amp_dtype):
    """Whole volumes, each on one rank. Sums (loss, per-volume Dice, volumes, intersection, predicted,
    true, union) are all-reduced once: the result equals a single-process evaluation."""
    model.eval()
    device = next(model.parameters()).device
    sums = torch.zeros(7, dtype=torch.float64, device=device)
    with torch.inference_mode(), torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
        for image, label in volumes:
            logits = predict_volume(model, image[0], patch, tiles_per_pass)
            target = label.float()
            counts = overlap(logits, target)
            sizes = counts[1] + counts[2]
            dice = torch.where(sizes > 0, 2 * counts[0] / sizes.clamp_min(1), 1.0)  # empty mask, empty prediction: 1
            loss = bce_dice_loss(logits, target).double()
            sums += torch.cat([torch.stack([loss, dice, torch.ones_like(dice)]), counts])
    loss, dice, n, inter, pred, true, union = reduce_tensor(sums).tolist()
    return {"loss": loss / max(n, 1), "dice": 2 * inter / (pred + true) if pred + true else 1.0,
            "iou": inter / union if union else 1.0, "dice_per_volume": dice / max(n, 1), "volumes": int(n),
            "intersection": int(inter), "predicted": int(pred), "true": int(true), "union": int(union)}


def predict_volume(model, image, patch, tiles_per_pass):
    """Logits (1×D×H×W) for a whole C×D×H×W volume: zero-pad its far borders up to a multiple of the
    patch, run the model on the non-overlapping tiles, crop the padding off again."""
    size = image.shape[1:]
    padded = pad_to(image, [math.ceil(s / p) * p for s, p in zip(size, patch)])
    logits = torch.empty((1, *padded.shape[1:]), device=image.device)
    windows = [tuple(slice(c, c + p) for c, p in zip(corner, patch))
               for corner in itertools.product(*(range(0, s, p) for s, p in zip(padded.shape[1:], patch)))]
    for i in range(0, len(windows), tiles_per_pass):
        group = windows[i:i + tiles_per_pass]
        output = model(torch.stack([padded[(slice(None), *w)] for w in group])).float()
        for w, tile in zip(group, output):
            logits[(slice(None), *w)] = tile
    return logits[(slice(None), *(slice(0, s) for s in size))]


def join_process_group(args, store, rank, world_size, device):
    """The process group, on a rendezvous store; returns the CPU group the preemption flag is summed over."""
    backend = args.dist_backend or ("nccl" if device.type == "cuda" else "gloo")
    timeout = datetime.timedelta(seconds=args.dist_timeout)  # a new group would wait torch's default 30 minutes
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout,
                            device_id=device if device.type == "cuda" else None)
    if backend != "gloo":  # [preemption]
        return dist.new_group(backend="gloo", timeout=timeout)  # [preemption]
    return dist.group.WORLD


def build_loaders(args, train_set, val_set, rank, world_size, device):
    """(train sampler, train batches, validation volumes): each rank takes its share of the patches and of
    the whole volumes, on the device."""
    loader_args = dict(num_workers=args.workers, pin_memory=device.type == "cuda", persistent_workers=args.workers > 0)
    loader_args.update(worker_init_fn=start_loader_worker)  # [preemption]
    train_data = SeededSamples(RandomPatches(train_set, args.patch_size, args.patches_per_volume))
    train_sampler = TrainSampler(train_data, num_replicas=world_size, rank=rank, seed=args.seed)
    train_loader = DataLoader(train_data, batch_size=args.batch_size // world_size, sampler=train_sampler,
                              drop_last=True, **loader_args)
    # one whole volume per batch (volumes differ in shape), each volume once over all ranks, unpadded
    val_loader = DataLoader(val_set, batch_size=1, sampler=range(rank, len(val_set), world_size),
                            **{**loader_args, "pin_memory": False})  # fork_loader_workers says why
    fork_loader_workers(val_loader, train_loader)
    return train_sampler, OnDevice(train_loader, device), OnDevice(val_loader, device)


class OnDevice:
    """A loader's batches, moved to the device: from pinned memory, a copy that the GPU queues without waiting.
    Volumes arrive standardized: nothing left to convert."""

    def __init__(self, loader, device):
        self.loader, self.device = loader, device

    def __len__(self):
        return len(self.loader)

    def __iter__(self):
        for batch in self.loader:
            yield [t.to(self.device, non_blocking=True) for t in batch]


def conv_block(cin, cout, norm):
    def normalization(c):
        return nn.BatchNorm3d(c) if norm == "batch" else nn.GroupNorm(math.gcd(8, c), c)
    return nn.Sequential(nn.Conv3d(cin, cout, 3, padding=1, bias=False), normalization(cout), nn.ReLU(inplace=True),
                         nn.Conv3d(cout, cout, 3, padding=1, bias=False), normalization(cout), nn.ReLU(inplace=True))


class UNet3D(nn.Module):
    """Çiçek et al. 2016: at each of `depth` levels two 3×3×3 convolutions; max-pooling down,
    transposed convolution up, skip connections across; one logit per voxel (sigmoid outside)."""

    def __init__(self, in_channels, base_channels=16, depth=4, norm="batch"):
        super().__init__()
        widths = [base_channels * 2**i for i in range(depth)]
        self.encoders = nn.ModuleList(conv_block(cin, cout, norm) for cin, cout in zip([in_channels] + widths, widths))
        self.upsamplers = nn.ModuleList(nn.ConvTranspose3d(widths[i + 1], widths[i], 2, stride=2)
                                        for i in range(depth - 1))
        self.decoders = nn.ModuleList(conv_block(2 * widths[i], widths[i], norm) for i in range(depth - 1))
        self.head = nn.Conv3d(widths[0], 1, 1)

    def forward(self, x):
        skips = []
        for i, encoder in enumerate(self.encoders):
            x = encoder(F.max_pool3d(x, 2) if i else x)
            skips.append(x)
        for i in reversed(range(len(self.decoders))):
            x = self.decoders[i](torch.cat([skips[i], self.upsamplers[i](x)], dim=1))
        return self.head(x)


def model_config(args, in_channels):
    return {"in_channels": in_channels, "base_channels": args.base_channels, "depth": args.depth, "norm": args.norm}


def bce_dice_loss(logits, target, smooth=1.0):
    """BCEDiceLoss: binary cross-entropy per voxel plus 1 - soft Dice of the probabilities over the batch."""
    prob = torch.sigmoid(logits)
    dice = (2 * (prob * target).sum() + smooth) / (prob.sum() + target.sum() + smooth)
    return F.binary_cross_entropy_with_logits(logits, target) + 1 - dice


def overlap(logits, target):
    """(intersection, predicted, true, union) voxel counts, the prediction being logit > 0 (p > 0.5)."""
    pred, true = logits > 0, target > 0.5
    return torch.stack([(pred & true).sum(), pred.sum(), true.sum(), (pred | true).sum()]).double()


class SegMetrics:
    """Running sums on the device (loss, patches, intersection, predicted, true voxels); `summary` reduces them
    over all ranks, so Dice is over every voxel of every rank."""

    def __init__(self, device):
        self.sums = torch.zeros(5, dtype=torch.float64, device=device)

    def update(self, loss_sum, logits, target):
        """loss_sum: the batch's loss summed over its patches (train_step's); target: N×1×D×H×W masks."""
        n = torch.full((1,), target.shape[0], dtype=torch.float64, device=target.device)
        self.sums += torch.cat([loss_sum.reshape(1), n, overlap(logits, target)[:3]])

    def summary(self):
        loss, n, inter, pred, true = reduce_tensor(self.sums).tolist()
        return {"loss": loss / max(n, 1), "dice": 2 * inter / max(pred + true, 1), "count": int(n)}


def fork_loader_workers(*loaders):
    """Forks the loaders' workers now, idle, before other threads start (pytorch#130610: a fork can hang on a lock a
    thread holds); the last loader alone may pin memory (a thread)."""
    for loader in loaders:
        if loader.num_workers and sys.platform.startswith("linux"):
            loader.multiprocessing_context = "fork"
            batches, sampler = loader.batch_sampler, loader.batch_sampler.sampler
            batches.sampler = ()  # nothing to load, this once
            with torch.random.fork_rng(devices=[]):
                iter(loader)
            batches.sampler = sampler


class TrainSampler(DistributedSampler):
    """DistributedSampler of (index, seed) pairs: a sample's augmentation comes from its own seed (SeededSamples)."""

    def __init__(self, dataset, **kwargs):
        super().__init__(dataset, shuffle=True, drop_last=True, **kwargs)
        self.start = 0  # [preemption]

    def __iter__(self):
        base = (self.seed * 100_003 + self.epoch) * 1_000_000_007
        keys = [(i, (base + i) % 2**63) for i in super().__iter__()]
        keys = keys[self.start:]  # [preemption]
        return iter(keys)

    def __len__(self):  # [preemption]
        return max(super().__len__() - self.start, 0)  # [preemption]


class SeededSamples(Dataset):
    """Takes TrainSampler's (index, seed) keys and draws the sample's random augmentation from its seed."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, key):
        index, seed = key
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return self.dataset[index]


CHECKPOINT = "checkpoint.pth.tar"


def set_seed(seed):
    random.seed(seed)
    torch.manual_seed(seed)


def rng_state():
    return {"python": random.getstate(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else torch.empty(0, dtype=torch.uint8)}


def set_rng_state(state):
    """Restores rng_state()'s states, from CPU tensors (torch refuses a random state on a GPU: map_location="cpu")."""
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if torch.cuda.is_available() and state["cuda"].numel():
        torch.cuda.set_rng_state(state["cuda"])


def atomic_write(path, write):
    """write(file) to path.tmp, fsync, rename over `path`: a crash leaves the old file or the new one (and path.tmp)."""
    with open(f"{path}.tmp", "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(f"{path}.tmp", path)


def save_checkpoint(state, is_best, output_dir):
    """checkpoint.pth.tar, and before it (it commits the epoch) model_best.pth.tar, a copy when the epoch is best."""
    path, best = os.path.join(output_dir, CHECKPOINT), os.path.join(output_dir, "model_best.pth.tar")
    os.makedirs(output_dir, exist_ok=True)
    atomic_write(best if is_best else path, lambda f: torch.save(state, f))
    if is_best:
        with open(best, "rb") as src:
            atomic_write(path, lambda f: shutil.copyfileobj(src, f))


def resume_path(args):
    """The checkpoint to resume, or None; --resume auto: --output-dir's if anything is there (a broken link stops)."""
    path = os.path.join(args.output_dir, CHECKPOINT) if args.resume == "auto" else args.resume
    return path if path and (args.resume != "auto" or os.path.lexists(path)) else None


def read_checkpoint(path):
    """The file's content on the CPU: set_rng_state takes CPU tensors; load_state_dict copies to the device itself."""
    return torch.load(path, map_location="cpu", weights_only=True)


def read_volume(path):
    """The array in a volume file: .npy (memory-mapped), .tif/.tiff (tifffile), .nii/.nii.gz (nibabel; arrays as
    stored, x y z: keep images and labels in one format). The readers are optional: only their volumes need them."""
    if path.lower().endswith(".npy"):
        return np.load(path, mmap_mode="r")
    if path.lower().endswith((".tif", ".tiff")):
        import tifffile
        return tifffile.imread(path)
    import nibabel
    return np.asanyarray(nibabel.load(path).dataobj)


def volume_tensors(image, label):
    """float32 C×D×H×W image, standardized per channel over the whole volume (std_mean: any finite float32 values);
    uint8 D×H×W mask."""
    image = torch.from_numpy(np.array(image, dtype=np.float32))
    image = image[None] if image.dim() == 3 else image
    std, mean = torch.std_mean(image, dim=(1, 2, 3), keepdim=True)
    label = torch.from_numpy(np.asarray(label) != 0).reshape(image.shape[1:])  # (any byte order: a bool array)
    return (image - mean) / std.clamp_min(1e-6), label.to(torch.uint8)


class VolumeFolder(Dataset):
    """root/images/NAME and its mask root/labels/NAME (hidden files left out); item i is one whole volume."""

    def __init__(self, root):
        names = sorted(name for name in os.listdir(os.path.join(root, "images")) if not name.startswith("."))
        self.pairs = [(os.path.join(root, "images", name), os.path.join(root, "labels", name)) for name in names]
        shape = read_volume(self.pairs[0][0]).shape
        self.channels = shape[0] if len(shape) == 4 else 1

    def __len__(self):
        return len(self.pairs)

    def __getitem__(self, index):
        image_path, label_path = self.pairs[index]
        image, label = read_volume(image_path), read_volume(label_path)
        if not np.isin(label, (0, 1)).all():  # [safety]
            raise RankError(f"{label_path} holds values other than 0 and 1: a label is a binary mask")  # [safety]
        image, label = volume_tensors(image, label)
        if not image.isfinite().all():  # [safety]
            raise RankError(f"{image_path} holds NaN or inf values: replace them (numpy.nan_to_num)")  # [safety]
        return image, label


def pad_to(tensor, size):
    """Zero-pads the last three dimensions at their far end up to at least `size`."""
    pads = [max(s - t, 0) for t, s in zip(tensor.shape[-3:], size)]
    return F.pad(tensor, [x for p in reversed(pads) for x in (0, p)]) if any(pads) else tensor


class RandomPatches(Dataset):
    """Sample i is a random patch of volume i % len(volumes), flipped at random along each axis; a volume smaller
    than a patch is zero-padded (label 0). The randomness comes from the torch generator, which SeededSamples seeds
    per sample."""

    def __init__(self, volumes, patch_size, per_volume):
        self.volumes, self.patch_size, self.per_volume = volumes, tuple(patch_size), per_volume

    def __len__(self):
        return len(self.volumes) * self.per_volume

    def __getitem__(self, index):
        image, label = self.volumes[index % len(self.volumes)]
        image, label = pad_to(image, self.patch_size), pad_to(label, self.patch_size)
        starts = [int(torch.randint(s - p + 1, ())) for s, p in zip(label.shape, self.patch_size)]
        window = tuple(slice(s, s + p) for s, p in zip(starts, self.patch_size))
        image, label = image[(slice(None), *window)], label[window]
        flips = [axis for axis in range(3) if torch.rand(()) < 0.5]
        return image.flip([a + 1 for a in flips]).contiguous(), label.flip(flips).contiguous()


class SyntheticVolumes(Dataset):
    """--synthetic: 1 to 3 random ellipsoids of random brightness in noise, and their mask: learnable, and volume i
    is the same on every call, rank and run."""

    def __init__(self, size, shape, offset=0):
        self.size, self.shape, self.offset, self.channels = size, tuple(shape), offset, 1

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        g = torch.Generator().manual_seed(self.offset + index)
        grid = torch.stack(torch.meshgrid(*(torch.arange(s, dtype=torch.float32) for s in self.shape), indexing="ij"))
        size = torch.tensor(self.shape, dtype=torch.float32).view(3, 1, 1, 1)
        image, mask = torch.randn(self.shape, generator=g), torch.zeros(self.shape, dtype=torch.bool)
        for _ in range(int(torch.randint(1, 4, (), generator=g))):
            centre = (torch.rand(3, 1, 1, 1, generator=g) * 0.6 + 0.2) * size
            radius = (torch.rand(3, 1, 1, 1, generator=g) * 0.15 + 0.12) * size
            inside = (((grid - centre) / radius) ** 2).sum(0) <= 1
            image += inside * (1.0 + 0.5 * torch.rand((), generator=g))
            mask |= inside
        return volume_tensors(image.numpy(), mask.numpy())
# =============================================================================================
# Part 2, features: a block each, for the flags its first line names. Keep what you use, delete the rest by markers.
# =============================================================================================
# region [sync-bn]: --sync-bn: BatchNorm statistics over every process's batch (CUDA only)
def sync_batchnorm(model, args, device, log):
    """SyncBatchNorm in place of every BatchNorm, with --sync-bn on CUDA; on the CPU the statistics stay per process."""
    if args.sync_bn and device.type == "cuda":
        return torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    if args.sync_bn:
        log("--sync-bn: off on CPU (SyncBatchNorm needs CUDA); BatchNorm statistics stay per process")
    return model
# endregion [sync-bn]
# region [preemption]: SIGTERM / SIGUSR1 / SIGHUP (a scheduler, a launcher or terminal gone): all stop at a step, save
PREEMPTED = 75  # the exit code of a run stopped early, its checkpoint saved: "resume me" (sysexits.h's EX_TEMPFAIL)


def sum_async(tensor, group):
    """Starts summing a CPU tensor in place over `group`; returns what waits for the sum (Horovod: its own way)."""
    return dist.all_reduce(tensor, group=group, async_op=True).wait


class Preemption:
    """SIGTERM / SIGUSR1 / SIGHUP set a flag; ranks agree on it one step later through a non-blocking sum on the CPU
    group `group` (sum_async): checked every step, it costs no barrier and no GPU sync."""

    signum = None  # the signal that stopped the run (the Slurm script requeues after SIGUSR1 only)

    def __init__(self):
        self.group, self.requested, self.wait = None, False, None
        self.flag = torch.zeros(1)
        self.signals = [sig for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP)  # nohup's SIGHUP stays ignored
                        if sig != signal.SIGHUP or signal.getsignal(sig) is not signal.SIG_IGN]
        self.catch(True)

    def catch(self, on):
        """Stop requests set the flag; not on (in the rendezvous, where no handler runs): SIGTERM, SIGHUP end it."""
        for sig in self.signals:
            signal.signal(sig, self._handler if on or sig == signal.SIGUSR1 else signal.SIG_DFL)

    def _handler(self, signum, frame):
        self.requested, Preemption.signum = True, signum

    def agreed(self, now=False):
        """Every rank, every step: True on all ranks at one step, the one after the signal; now: at once, blocking."""
        if self.group is None:
            return self.requested
        if self.wait is not None:
            self.wait()
            if self.flag.item() > 0 and not now:
                self.wait = None
                return True
        self.flag.fill_(float(self.requested))
        self.wait = sum_async(self.flag, self.group)
        if not now:
            return False
        self.wait()
        self.wait = None
        return self.flag.item() > 0

    def stop(self, run, args, rank, log, where, saved=False):
        """Every rank saves where it stopped (unless it just did), then waits for all; returns PREEMPTED."""
        if not saved:
            sync_buffers(run.model)  # rank 0's BatchNorm statistics, as an epoch's end saves (FSDP saves any rank's)
            run.save(args, rank, is_best=False)
        if self.group is not None:
            sum_async(self.flag, self.group)()
        log(f"preempted: saved {os.path.join(args.output_dir, CHECKPOINT)} {where}; continue with --resume auto "
            f"(exit code {PREEMPTED})")
        return PREEMPTED


def start_loader_worker(worker_id):
    """The loaders' worker_init_fn: launchers signal a whole process group, and a worker that a stop request ended
    would end its training process before its checkpoint. Workers ignore them, and die with their process."""
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    die_with_parent(signal.SIGKILL)
    report = sys.excepthook  # (multiprocessing's threads report through it: the pipes to a killed process close)
    sys.excepthook = lambda kind, *rest: None if issubclass(kind, (ConnectionError, EOFError)) else report(kind, *rest)


def die_with_parent(signum):
    """`signum` once the parent is gone (PR_SET_PDEATHSIG; now, if it is): a launcher killed with -9 leaves no process.
    SIGTERM (it saves) once the process group is up; SIGKILL in the rendezvous, whose store died with the launcher."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signum))
        parent = multiprocessing.parent_process()
        if parent is not None and not parent.is_alive():
            os.kill(os.getpid(), signum)


def end_loader_workers():
    """Kills the loader workers as a training process ends: they ignore the SIGTERM of multiprocessing's exit hook."""
    workers = [child for child in multiprocessing.active_children() if child.daemon]  # spawn's are not daemonic
    if workers:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # DataLoader's handler would call their end a failure
    for worker in workers:
        worker.kill()
# endregion [preemption]
# region [deterministic]: --deterministic: the same results from the same run on a GPU, at some cost in speed
def set_deterministic(args):
    """Deterministic kernels where torch has them (a few, 3D pooling's backward among them, have none on CUDA: a
    warning), the fixed cuBLAS workspace they need, and no cuDNN autotuning, whose timings may pick other kernels."""
    if args.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False
# endregion [deterministic]
# region [logs]: metrics.jsonl and TensorBoard in --output-dir, an entry per epoch
def open_writer(args, rank, epoch):
    """Rank 0's TensorBoard writer, which replaces older entries from `epoch` on (None elsewhere)."""
    from torch.utils.tensorboard import SummaryWriter  # (an optional package: only with this block)
    return SummaryWriter(os.path.join(args.output_dir, "tb"), purge_step=epoch) if rank == 0 else None


def write_epoch(row, writer, output_dir):
    """One JSON line per epoch in metrics.jsonl (NaN, inf: null, as in strict JSON), and the scalars in TensorBoard."""
    with open(os.path.join(output_dir, "metrics.jsonl"), "a") as f:
        f.write(json.dumps({key: value if abs(value) < float("inf") else None for key, value in row.items()}) + "\n")
    for key in row.keys() - {"epoch"}:
        writer.add_scalar(key, row[key], row["epoch"])
    writer.flush()
# endregion [logs]
# region [safety]
# =============================================================================================
# Part 3, the safety net: checks before training, failures made one line. Delete its region and lines tagged [safety].
# =============================================================================================
class UserError(Exception):
    """Bad input that every rank finds alike: the safety net reports it in one line from one rank, exit code 2."""


class RankError(UserError):
    """Bad input that only some ranks meet (a file one rank reads): each of them reports it."""


def one_line(error):
    """UserError's text: on one line, whatever it quotes; raised in a loader worker, it ends the worker's traceback,
    after "UserError: " (RankError: ...)."""
    return " ".join(Exception.__str__(error).split()).split(f"{type(error).__name__}: ")[-1]


def exit_bad_input(error, reporter):
    """Exit code 2, with one `error:` line from the reporting rank (each rank, for a RankError). A silent rank waits up
    to 30 s to be stopped: a launcher that saw it exit would stop the reporting rank before it printed."""
    if reporter or isinstance(error, RankError):
        print(f"error: {error}\n", end="", file=sys.stderr, flush=True)  # one write: other ranks' cannot split it
    else:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the launcher's stop ends the wait, preemption handler or not
        time.sleep(30)
    sys.exit(2)


def exit_ctrl_c():
    """Ctrl-C reaches every process of a job: each exits 130 (a shell's for Ctrl-C), without a traceback, and a second
    Ctrl-C cannot cut its cleanup short."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.exit(130)


def print_or_drop(*values):
    """Rank 0's log: print, flushed. When whoever read it is gone (a launcher killed with -9), the rest goes to
    /dev/null, instead of an error that would end the run before its preemption checkpoint."""
    try:
        print(*values, flush=True)
    except OSError:  # BrokenPipeError
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def check_launch_args(args, world_size, device):
    """The flags this launcher reads its own way, checked before any process waits for another: none here. Part of
    the launcher interface (each sibling checks its own), called by check_run alone."""


def check_run(args, world_size, device, train_set):
    """Flags that would train on other batches than asked, before the loaders start: a global batch the world size
    does not divide, or more patches than an epoch holds (it would take no step); the launcher's flags."""
    if args.batch_size % world_size:
        raise UserError(f"--batch-size {args.batch_size} is the global batch and must divide by the world size "
                        f"{world_size}: use e.g. {max(args.batch_size // world_size, 1) * world_size}")
    check_launch_args(args, world_size, device)
    if len(train_set) * args.patches_per_volume < args.batch_size and not args.evaluate:
        raise UserError(f"{len(train_set)} training volumes x {args.patches_per_volume} patches are fewer than one "
                        f"global batch of {args.batch_size}: lower -b or raise --patches-per-volume")


def explain_unreadable_volume(read_volume):
    """read_volume, naming the file it cannot read (a truncated or damaged one, a missing label, a reader that is not
    installed), in one line from the rank that reads it: numpy's and the readers' errors name no file."""
    def named(path):
        try:
            return read_volume(path)
        except Exception as e:
            reason = " ".join(str(e).split())[:200] or type(e).__name__  # on one line
            raise RankError(f"cannot read volume {path}: {reason}") from None
    return named


def check_checkpoint(path, ckpt, config, train_set, args):
    """distributed.py's check_resume, for the U-Net: -e with no trained weights to evaluate, and a checkpoint the
    command line does not fit: another U-Net (--base-channels, --depth, --norm, input channels), flags whose values its
    state holds (given anew, they would be ignored; --seed drew the order of an epoch it goes on with), or a training
    set of another size (its step and schedule count that set's patches)."""
    if args.evaluate and not ckpt:
        where = f"--output-dir {args.output_dir} holds no checkpoint" if args.resume else "no --resume PATH is given"
        raise UserError(f"-e evaluates trained weights, and {where}: give --resume PATH, or the --output-dir of "
                        f"the run")
    if not ckpt:
        return
    if ckpt.get("arch") != "unet3d" or ckpt.get("model") != config:
        raise UserError(f"{path} holds {ckpt.get('arch')} {ckpt.get('model')}, not a 3D U-Net of {config}: give "
                        f"the flags it was trained with, or another checkpoint")
    trained = ckpt.get("args", {}) if not args.evaluate else {}
    for flag in ("batch_size", "lr", "weight_decay", "milestones", "gamma", "seed"):
        if flag in trained and trained[flag] != getattr(args, flag):
            name = "--" + flag.replace("_", "-")
            raise UserError(f"{path} was trained with {name} {trained[flag]}, this run has {name} "
                            f"{getattr(args, flag)}: continue it with {name} {trained[flag]}, or train without "
                            f"--resume")
    if ckpt.get("train_samples", len(train_set)) != len(train_set) and not args.evaluate:
        raise UserError(f"{path} was trained on {ckpt['train_samples']} training volumes, this run has "
                        f"{len(train_set)}: resume with the data it was trained on, or train without --resume")


def explain_failed_save(save_checkpoint):
    """save_checkpoint; a failed write (disk full, folder gone) stops the run in one line: the room needed."""
    def save(state, is_best, output_dir):
        try:
            save_checkpoint(state, is_best, output_dir)
        except (OSError, RuntimeError) as e:  # torch.save reports a failed write as a RuntimeError
            need = sum(t.untyped_storage().nbytes() for t in torch.utils._pytree.tree_leaves(state)
                       if isinstance(t, torch.Tensor)) / 2**20
            free = shutil.disk_usage(output_dir).free / 2**20 if os.path.isdir(output_dir) else 0.0  # or gone
            reason = "no space left" if free < need else str(e).strip().splitlines()[-1][:100]
            raise RankError(f"cannot write a checkpoint to {os.path.abspath(output_dir)} ({reason}): a checkpoint "
                            f"takes about {need:.0f} MiB (twice that while it replaces the last one), {free:.0f} MiB "
                            f"are free there; make room or give another --output-dir (the last checkpoint is kept)"
                            ) from None
    return save


def explain_short_loader(batches):
    """DeviceBatches.__iter__; a loader that ends before its length stops the run in one line. A dataset's __getitem__
    that raises StopIteration does that: a for loop takes it for the end, and this rank would wait for its peers."""
    def checked(self):
        count = 0
        for count, batch in enumerate(batches(self), 1):
            yield batch
        if count < len(self.loader):
            raise RankError(f"the data ended after {count} of {len(self.loader)} batches: a sample raised "
                            f"StopIteration, which ends a loop without an error; raise another one (IndexError)")
    return checked


PER_NODE = {"data", "output_dir", "resume", "workers", "local_rank", "node_rank", "gpus", "dist_url"}  # paths, devices


def check_ranks_agree(args, sets, ckpt):
    """Once the process group is up, the ranks compare what every node must have alike: the script, torch, the flags
    (PER_NODE's aside), the data's sizes and labels (an image folder's class names and each image's label: a copy of
    it on every node), the checkpoint found. Apart, they would hang at the first collective that one of them skips
    (another epoch length), or train apart without a word (another --lr, or other labels, on one node)."""
    with open(__file__, "rb") as f:
        view = {"script sha256 {}": hashlib.sha256(f.read()).hexdigest()[:12], "torch {}": torch.__version__}
    view.update({f"--{name.replace('_', '-')} {{}}": v for name, v in vars(args).items() if name not in PER_NODE})
    pairs = [[getattr(data, name, None) for name in ("classes", "targets")] for data in sets]  # ImageFolder's: lists
    labels = repr([pair for pair in pairs if all(isinstance(x, list) for x in pair)]).encode()  # (a set's order varies)
    view.update({"{} training samples": len(sets[0]), "{} validation samples": len(sets[1]),
                 "labels sha256 {}": hashlib.sha256(labels).hexdigest()[:12],
                 "checkpoint {}": f"epoch {ckpt.get('epoch', 0)} step {ckpt.get('step', 0)}" if ckpt else "none"})
    views = gather_objects(view)
    other = next((rank for rank, theirs in enumerate(views) if theirs != views[0]), None)  # the same on every rank
    if other is None:
        return
    keys = {**views[0], **views[other]}  # rank 0's order first, the same on every rank
    apart = [key for key in keys if views[other].get(key) != views[0].get(key)][:4]  # the first few, in one line
    seen = "; ".join(f"rank {rank}: " + ", ".join(key.format(views[rank].get(key, "none")) for key in apart)
                     for rank in (0, other))
    fix = "start every node with the same script, torch, flags and data"
    if apart == ["checkpoint {}"]:
        fix = "--output-dir and --resume must be on a filesystem that every node shares and sees up to date"
    raise UserError(f"the ranks differ ({seen}): {fix}")


def check_finite(summary, epoch, step):
    """Stops every rank (they all see the same summary) when the loss is NaN/inf, before it is saved."""
    if not math.isfinite(summary["loss"]):
        raise UserError(f"loss became NaN/inf in epoch {epoch} by step {step}; stopped without saving it: lower --lr, "
                        f"or check the data")


PEER_GONE = ("closed by peer", "closed by remote peer", "reset by peer", "broken pipe", "socket closed", "got 0 bytes",
             "communicator was aborted", "remote process exited", "ncclremoteerror", "horovod has been shut down")


def explain_failure(error):
    """What to raise for an error that ends training on this rank: one line (RankError) where the error's own words
    blame the wrong thing, a DataLoader worker killed (the out-of-memory killer, a full /dev/shm), whichever error
    its death surfaced as first, and a peer's death, which its survivors meet as a connection error; any other error
    stays itself, traceback and all."""
    if isinstance(error, UserError):
        return error
    try:  # a killed worker's batch fails (a pipe, a socket, a batch cut short) a moment before its death is seen
        for pause in [0] + [0.05] * 20:
            time.sleep(pause)
            torch.utils.data._utils.signal_handling._error_if_any_worker_fails()
    except RuntimeError as killed:
        error = killed
    causes = [error, error.__cause__, error.__context__]
    text = " ".join(str(cause) for cause in causes if cause is not None)
    if "DataLoader worker (pid" in text:
        killed = text.split("killed by signal: ", 1)[1].split(".")[0] if "killed by signal: " in text else None
        why = {"Killed": "most likely by the out-of-memory killer: use fewer -j/--workers, or give the job more memory",
               "Bus error": "most likely out of shared memory: give the job more (/dev/shm; docker run --shm-size), "
                            "or use fewer -j/--workers"}
        return RankError(f"a data loader worker was killed (signal: {killed}), "
                         + why.get(killed, "or exited: -j 0 shows its error in the training process"))
    line = next((line for line in text.splitlines() if any(words in line.lower() for words in PEER_GONE)), None)
    if line is None:
        return error
    return RankError(f"a peer ended, so this rank stops too ({line.split('] ')[-1].strip()[:120]}): the error line of "
                     f"the rank that ended first says why; with none, it was killed (the launcher names the signal; "
                     f"SIGKILL: often the out-of-memory killer)")


def safety_net(main_worker):
    """main_worker, with any failure on a rank made one line where explain_failure can."""
    def guarded(args, local_index=None):
        try:
            return main_worker(args, local_index)
        except Exception as e:
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # stopping: DataLoader's handler would raise a dead worker
            raise explain_failure(e) from None
        finally:
            with contextlib.suppress(AttributeError):  # the output folder's lock, if this rank took it: the run is over
                claim_output_dir.lock.close()
    return guarded


def claim_output_dir(args, rank):
    """Rank 0 of a training run locks --output-dir until it ends (lockf: a killed run holds it no more), so that a
    second run given it stops at once; and a fresh run stops before it overwrites an earlier run's checkpoint."""
    if rank != 0 or args.evaluate or getattr(args, "benchmark", 0):
        return
    os.makedirs(args.output_dir, exist_ok=True)
    lock = open(os.path.join(args.output_dir, "run.lock"), "a+")
    try:
        fcntl.lockf(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except (BlockingIOError, PermissionError):
        lock.seek(0)
        raise UserError(f"--output-dir {args.output_dir} is in use by another run ({lock.read().strip()}): give "
                        f"another --output-dir, or wait for that run to end") from None
    except OSError:  # a filesystem without locks: no guard
        pass
    resumed = resume_path(args)
    for name in ("checkpoint.pth.tar", "checkpoint.dcp"):  # this script's, or a sibling's: they share model_best
        theirs = os.path.join(args.output_dir, name)
        if os.path.lexists(theirs) and not (resumed and os.path.realpath(resumed) == os.path.realpath(theirs)):
            raise UserError(f"--output-dir {args.output_dir} holds the checkpoint of an earlier run ({name}), which "
                            f"this one would overwrite: continue that run with --resume auto (by the script that "
                            f"saved it), or give another --output-dir")
    lock.truncate(0)
    lock.write(f"pid {os.getpid()} on {os.uname().nodename}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    lock.flush()
    claim_output_dir.lock = lock  # held until the process ends


# the safety net wraps these: deleted with it, each is what part 1 says
UserError.__str__ = one_line
main_worker = safety_net(main_worker)
save_checkpoint = explain_failed_save(save_checkpoint)
read_volume = explain_unreadable_volume(read_volume)
OnDevice.__iter__ = explain_short_loader(OnDevice.__iter__)
# endregion [safety]


if __name__ == "__main__":
    main()
