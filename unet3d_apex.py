r"""3D U-Net segmentation with DistributedDataParallel and mixed precision, one process per GPU, started by torchrun.

The complete program behind apex's 3D U-Net example (which imported its model, data, loss and
evaluation from elsewhere): volumes, a 3D U-Net, BCE + soft Dice loss, SyncBatchNorm, AMP, DDP,
exact whole-volume Dice/IoU, TensorBoard, checkpoints, preemption.

    # one node, 4 GPUs; DATA holds train/images, train/labels, val/images, val/labels
    torchrun --standalone --nproc_per_node=4 unet3d_apex.py /data/volumes --sync-bn --amp
    # two nodes (run on each, R = 0 or 1)
    torchrun --nnodes=2 --node-rank=R --nproc_per_node=8 --rdzv-backend=c10d \
        --rdzv-endpoint=HOST:29400 unet3d_apex.py /data/volumes
    # CPU demo, no dataset needed (gloo backend)
    torchrun --standalone --nproc_per_node=2 unet3d_apex.py --synthetic --synthetic-shape 24 48 48 \
        --patch-size 16 32 32 --base-channels 8 --depth 3 -b 4 --lr 3e-3 --epochs 5 -j 0
    # no launcher: one process
    python unet3d_apex.py --synthetic

Differs from distributed.py: volumes and random patches instead of ImageFolder, a 3D U-Net, Adam +
MultiStepLR (per epoch), --amp as one switch (fp16 with a GradScaler, the CPU too), and
evaluation of whole volumes tiled by patches, with Dice/IoU summed over all voxels of all validation
volumes. How the processes start, the process group, DDP, checkpoints and preemption are distributed.py's
(the same text); the training flow has its shape (RunState, train_one_epoch, evaluate) with the U-Net's
loss and metrics.

Read it top to bottom, in three parts: the lesson, which every copier keeps (the command line, the launcher part, the
training flow main -> main_worker -> train_one_epoch / evaluate, what every run needs; the task: volumes and patches,
the U-Net, its loss and metrics); optional features, a block each; the safety net. Every block lies between a line
`# region [NAME]` and a line `# endregion [NAME]`, and every line elsewhere that exists only for it ends with the
comment `# [NAME]` (`# [a] [b]`: for a and for b). Delete a block and its tagged lines, nothing else, and the rest runs;
delete every block for the core. For the block logs (README: Copy only what you need):

  sed -E -i '/^ *# region \[logs\]/,/^ *# endregion \[logs\]/d; /#( \[[a-z0-9-]+\])* \[logs\]( \[[a-z0-9-]+\])*$/d' FILE
"""
import argparse
import atexit  # [logs]
import contextlib
import ctypes  # [preemption]
import datetime
import functools  # [safety]
import gc
import fcntl  # [safety]
import hashlib  # [safety]
import inspect  # [sync-bn]
import itertools
import json  # [logs]
import math
import multiprocessing  # [preemption]
import os
import random
import shutil
import signal
import socket  # [safety]
import sys
import threading  # [logs]
import time
import traceback  # [safety]

import numpy as np
# torch missing, TORCH_LOGS=bogus, a cache folder it cannot make: one line; Ctrl-C: exit 130 as main does  # [safety]
try:  # [safety]
    import torch._dynamo  # [safety]
except Exception as e:  # [safety]
    fix = "install torch, the build for your CUDA driver (pip install -U torch)"  # [safety]
    if isinstance(e, ValueError) or getattr(e, "filename", None):  # [safety]
        fix = "fix what it names: a TORCH variable (env | grep TORCH), or TORCHINDUCTOR_CACHE_DIR"  # [safety]
    print(f"error: cannot import torch ({' '.join(str(e).split())[:200]}): {fix}", file=sys.stderr)  # [safety]
    sys.exit(2)  # [safety]
except KeyboardInterrupt:  # [safety]
    sys.exit(130)  # [safety]
import torch
import torch.distributed as dist
import torch._dynamo  # noqa: F401 (before any process group: see end_process_group)
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler

try:  # optional: only .tif volumes need it (missing, or made for another numpy: None)
    import tifffile
except Exception:
    tifffile = None
try:  # optional, for .nii volumes
    import nibabel
except Exception:
    nibabel = None


# =============================================================================================
# Part 1, the lesson, what every copier keeps: command line, the two seams, launcher part, training flow, needs.
# =============================================================================================
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.error = argument_error  # [safety]
    add = p.add_argument
    add("data", nargs="?", metavar="DIR",
        help="folder with train/images, train/labels, val/images, val/labels (not needed with --synthetic)")
    add("--synthetic", action="store_true", help="train on generated ellipsoids in noise instead of DIR")  # [synthetic]
    add("--synthetic-size", type=in_range(int, 1, below=10**7), default=40, metavar="N",  # [synthetic]
        help="with --synthetic: training volumes (validation N/4; an epoch's order is a list in memory)")  # [synthetic]
    add("--synthetic-shape", type=in_range(int, 1), nargs=3, default=(40, 176, 176),  # [synthetic]
        metavar=("D", "H", "W"), help="with --synthetic: volume size")  # [synthetic]
    add("--patch-size", type=in_range(int, 1), nargs=3, default=(32, 160, 160), metavar=("D", "H", "W"),
        help="training patch and evaluation tile; each must divide by 2**(depth-1); smaller volumes are zero-padded")
    add("--patches-per-volume", type=in_range(int, 1), default=4,
        help="random patches drawn from each training volume per epoch")
    add("--base-channels", type=in_range(int, 1), default=16,
        help="channels of the first U-Net level, doubled at every level below")
    add("--depth", type=in_range(int, 1), default=4, help="U-Net levels (depth-1 poolings)")
    add("--norm", choices=("batch", "group"), default="batch", help="normalization layer after every convolution")
    add("-j", "--workers", type=in_range(int, 0, below=256), default=4, help="loader processes per training process")
    add("--epochs", type=in_range(int, 0), default=100)
    add("-b", "--batch-size", type=in_range(int, 1), default=4,
        help="global batch of patches over all processes; must divide by the world size")
    add("--eval-batch", type=in_range(int, 1), default=2, help="tiles per forward pass when evaluating whole volumes")
    add("--lr", type=in_range(float, 0), default=2e-4, help="Adam learning rate")
    add("--wd", "--weight-decay", type=in_range(float, 0), default=1e-4, dest="weight_decay")
    add("--milestones", type=in_range(int, 1), nargs="*", default=(60, 80),
        help="epochs at which MultiStepLR multiplies the lr by --gamma")
    add("--gamma", type=in_range(float, above=0), default=0.1, help="the lr's factor at each milestone")
    add("--amp", action="store_true", help="autocast to fp16 with a GradScaler (on a CPU: for tests, slow)")
    add("--sync-bn", action="store_true", help="SyncBatchNorm across processes (CUDA only)")  # [sync-bn]
    add("--resume", default="", metavar="PATH|auto",
        help="checkpoint to resume from; auto: <output-dir>/checkpoint.pth.tar if it exists")
    add("-e", "--evaluate", action="store_true", help="evaluate the model (e.g. with --resume) and exit")
    add("--output-dir", default="output", help="checkpoints, metrics.jsonl and tb/")
    add("--seed", type=in_range(int, 0), default=0, help="same seed, same data and world-size-independent patches")
    add("--deterministic", action="store_true", help="use deterministic algorithms (slower)")  # [deterministic]
    add("-p", "--print-freq", type=in_range(int, 1), default=10, help="steps between progress lines")
    add("--dist-backend", default=None, help="default: nccl with CUDA, else gloo")
    add("--dist-timeout", type=in_range(float, 1, below=1e9), default=1800, help="seconds a collective waits on a peer")
    add("--local-rank", "--local_rank", type=in_range(int, 0), help=argparse.SUPPRESS)  # torch.distributed.launch's
    add_foreign_flags(p)  # [safety]
    args = p.parse_args(argv)
    check_args(args)  # [safety]
    return args


def build_datasets(args):
    if args.synthetic:  # [synthetic]
        return (SyntheticVolumes(args.synthetic_size, args.synthetic_shape),  # [synthetic]
                SyntheticVolumes(max(args.synthetic_size // 4, 1), args.synthetic_shape, offset=10**9))  # [synthetic]
    if not (args.data and os.path.isdir(args.data)):  # [safety]
        raise UserError(f"data folder {args.data!r} not found: give a folder with train/ and val/ inside, "  # [safety]
                        f"or --synthetic")  # [safety]
    for split, kind in itertools.product(("train", "val"), ("images", "labels")):  # [safety]
        folder = os.path.join(args.data, split, kind)  # [safety]
        if not os.path.isdir(folder):  # [safety]
            raise UserError(f"{folder} not found: DIR must hold train/images, train/labels, val/images and "  # [safety]
                            f"val/labels")  # [safety]
    train, val = (VolumeFolder(os.path.join(args.data, split)) for split in ("train", "val"))
    if train.channels != val.channels:  # [safety]
        raise UserError(f"{args.data}: train volumes have {train.channels} channels, val volumes "  # [safety]
                        f"{val.channels}; they must match")  # [safety]
    return train, val


# =============================================================================================
# The launcher part: distributed.py's (torchrun, the process group, DDP), but the batch description, the model's
# preparation, Adam, --amp and the step are the U-Net's. Every sibling has its own (README: How every script reads).
# =============================================================================================
def find_processes(args, local_index):
    """(rank, local_rank, world_size, device) of this process: from torchrun's environment, or one process
    without it. local_index: the process's index on its node, where the script starts the processes itself."""
    check_torchrun()  # [safety]
    rank, local_rank, world_size = (int(os.environ.get(k, d)) for k, d in
                                    (("RANK", 0), ("LOCAL_RANK", 0), ("WORLD_SIZE", 1)))
    if "TORCHELASTIC_RUN_ID" in os.environ:  # [preemption]
        die_with_parent(signal.SIGKILL)  # [preemption]
    if not torch.cuda.is_available():
        return rank, local_rank, world_size, torch.device("cpu")
    if local_rank >= torch.cuda.device_count():  # [safety]
        raise RankError(f"LOCAL_RANK {local_rank} but only {torch.cuda.device_count()} GPUs are visible: "  # [safety]
                        f"start at most that many processes per node (--nproc_per_node)")  # [safety]
    torch.cuda.set_device(local_rank)  # before anything touches CUDA, or every rank crowds GPU 0
    return rank, local_rank, world_size, torch.device("cuda", local_rank)


def start_process_group(args, rank, world_size, device, log):
    """Starts the process group (none for one process); returns the CPU group for preemption, or None."""
    if "WORLD_SIZE" not in os.environ:
        return None
    timeout = datetime.timedelta(seconds=args.dist_timeout)
    store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))  # torchrun's store
    group = join_process_group(args, store, rank, world_size, device)
    if "TORCHELASTIC_RUN_ID" in os.environ:  # [preemption]
        die_with_parent(signal.SIGTERM)  # [preemption]
    return group


def end_process_group():
    """Frees the process group while Python is whole (left to shutdown, gloo's threads can abort it) and nothing holds
    it: stop requests are ignored now (srun signals the rest once a rank exits 75), FSDP's cycles collected."""
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


def describe_processes(args, world_size, device, group):
    """How this run is spread, for the first line of the log; the global batch is one of patches."""
    return (f"world size {world_size}, device {device.type}, backend {dist.get_backend() if group else 'none'}, "
            f"global batch {args.batch_size} = {world_size} x {args.batch_size // world_size} patches of "
            f"{shape_text(args.patch_size)}")


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
    """(the model that trains, the model that evaluates). DDP all-reduces the gradients in backward(); evaluation,
    where ranks may have one batch more or less, must call no collective: it evaluates the plain model."""
    if not dist.is_initialized():
        return model, model
    options = {"device_ids": [device.index] if device.type == "cuda" else None}
    options.update(ddp_buffer_options(model))  # [sync-bn]
    return DistributedDataParallel(model, **options), model


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


# =============================================================================================
# The training flow: main runs main_worker this launcher's way; the rest is the same text in every ImageNet sibling.
# =============================================================================================
def main():
    first_on_node = os.environ.get("LOCAL_RANK", "0") == "0"  # [safety]
    try:
        sys.exit(main_worker(parse_args()))  # None (0): finished
    except UserError as e:  # [safety]
        exit_bad_input(e, reporter=first_on_node)  # [safety]
    except KeyboardInterrupt:  # [safety]
        exit_ctrl_c(reporter=first_on_node)  # [safety]
    finally:
        end_process_group()  # left to interpreter exit, a gloo thread can abort the process
        end_loader_workers()  # [preemption]


def main_worker(args, local_index=None):
    """One training process, from finding its peers to its last checkpoint; returns None, or the exit code of a run
    stopped early (PREEMPTED)."""
    torch.backends.cudnn.benchmark = True  # cuDNN times its kernels for each new input shape, keeps the fastest
    set_deterministic(args)  # [deterministic]
    rank, local_rank, world_size, device = find_processes(args, local_index)
    log = (lambda *text: print(*text, flush=True)) if rank == 0 else (lambda *text: None)
    log = print_or_drop if rank == 0 else log  # [preemption]
    preemption = Preemption()  # [preemption]

    train_set, val_set = build_datasets(args)
    check_run(args, world_size, device, (train_set, val_set), rank)  # [safety]
    # the loaders fork their workers now: before the process group's threads start (fork_loader_workers says why),
    # and before the model and the checkpoint are read, whose memory every worker would keep for the whole run
    train_sampler, train_batches, val_volumes = build_loaders(args, train_set, val_set, rank, world_size, device)
    config = model_config(args, train_set.channels)
    ckpt_path = resume_path(args)
    ckpt = load_checkpoint(ckpt_path, config, args) if ckpt_path else None
    check_evaluated(ckpt_path, args)  # [safety]
    check_train_samples(ckpt_path, ckpt, train_set, args)  # [safety]
    claim_output_dir(args, rank, log)  # [safety]
    set_seed(args.seed)
    model = UNet3D(**config)  # the same initial weights on every rank
    set_seed(args.seed + rank)  # but each rank its own random draws
    preemption.catch(False)  # [preemption]
    ctrl_c = signal.getsignal(signal.SIGINT)  # no handler runs while it waits for its peers: Ctrl-C ends the wait
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
    note_small_volumes(train_set, patch, log)

    model = prepare_model(model, args, device, log)
    optimizer = build_optimizer(model, args, device, log)
    amp_dtype, scaler = setup_precision(model, optimizer, args, device, log)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=list(args.milestones), gamma=args.gamma)
    run = RunState(model, optimizer, scheduler, scaler, amp_dtype, config)
    run.preemption = preemption  # [preemption]
    run.train_samples = len(train_set)  # [safety]
    if ckpt:
        run.load_state_dict(ckpt, args, rank, world_size, log)
        moved = "" if args.evaluate or ckpt.get("world_size") == world_size else (  # a job resized, a node lost
            f", world size {ckpt.get('world_size')} -> {world_size}: the same samples, fresh random states")
        log(f"resumed from {ckpt_path} (epoch {ckpt['epoch']}, step {ckpt.get('step', 0)}){moved}")
        ckpt = None  # all of it is in place now: keep no second copy of the weights
    run.train_model, run.eval_model = wrap_model(model, args, device, amp_dtype)

    if args.evaluate:
        val, _ = evaluate(run.eval_model, val_volumes, patch, args.eval_batch, amp_dtype)
        log(f"val: loss {val['loss']:.6f} dice {val['dice']:.6f} iou {val['iou']:.6f} dice_per_volume "
            f"{val['dice_per_volume']:.6f} (intersection {val['intersection']}, predicted {val['predicted']}, "
            f"true {val['true']}, union {val['union']}, volumes {val['volumes']})")
        return None

    if run.epoch >= args.epochs:  # [safety]
        log(f"nothing to train: the checkpoint has trained {run.epoch} epochs, --epochs is "  # [safety]
            f"{args.epochs}; give more --epochs to train on")  # [safety]
    writer = open_writer(args, rank, run.epoch)  # [logs]
    while run.epoch < args.epochs:
        epoch, started = run.epoch, time.monotonic()
        train_sampler.set_epoch(epoch)
        train_sampler.start = run.step * (args.batch_size // world_size)  # [preemption]
        train = train_one_epoch(run, train_batches, args, log)
        if train is None:  # [preemption]
            return run.preemption.stop(run, args, rank, log, f"at epoch {epoch} step {run.step}")  # [preemption]
        train_seconds, lr = time.monotonic() - started, optimizer.param_groups[0]["lr"]
        scheduler.step()  # per epoch, after it: the row keeps the rate the epoch trained with
        sync_buffers(model)
        val, slices = evaluate(run.eval_model, val_volumes, patch, args.eval_batch, amp_dtype)
        is_best = val["dice"] > run.best_dice
        run.epoch, run.best_dice = epoch + 1, max(run.best_dice, val["dice"])
        run.save(args, rank, is_best)
        row = {"epoch": epoch, "train_loss": train["loss"], "train_dice": train["dice"], "val_loss": val["loss"],
               "val_dice": val["dice"], "val_iou": val["iou"], "val_dice_per_volume": val["dice_per_volume"],
               "lr": lr, "img_per_s": train["count"] / train_seconds, "seconds": time.monotonic() - started}
        if writer:  # [logs]
            for name, picture in zip(("val/input", "val/ground_truth", "val/prediction"), slices):  # [logs]
                writer.add_image(name, picture, epoch, dataformats="HW")  # [logs]
        if writer is not None:  # [logs]
            write_epoch(row, writer, args.output_dir)  # [logs]
        log(f"Epoch {epoch}: train loss {train['loss']:.4f} dice {train['dice']:.4f} | val loss {val['loss']:.4f} "
            f"dice {val['dice']:.4f} iou {val['iou']:.4f} dice/volume {val['dice_per_volume']:.4f} | "
            f"{row['img_per_s']:.1f} img/s")
        if run.preemption.agreed(now=True) and run.epoch < args.epochs:  # [preemption]
            return run.preemption.stop(run, args, rank, log, f"after epoch {epoch}", saved=True)  # [preemption]
    return None


class RunState:
    """What a run carries from step to step and resumes: the model, optimizer, scheduler and loss scaler, where
    it is (epoch, step within it), the best validation Dice, the running sums of a preempted epoch, and the
    random states. The one place that writes the checkpoint format and reads it back (README: unet3d_apex.py).
    `config` is the U-Net's shape (model_config): a checkpoint resumes only into the same one."""

    def __init__(self, model, optimizer, scheduler, scaler, amp_dtype, config):
        self.model, self.optimizer, self.scheduler, self.scaler = model, optimizer, scheduler, scaler
        self.amp_dtype, self.train_model, self.eval_model, self.config = amp_dtype, model, model, config
        # below any Dice: the first epoch's model is the best so far, even one that predicts nothing
        self.epoch, self.step, self.best_dice, self.train_sums = 0, 0, -1.0, None

    def save(self, args, rank, is_best):
        """Every rank takes part (their random states are gathered); rank 0 writes."""
        rng_states = gather_rng_states()
        if rank == 0:
            save_checkpoint({
                "epoch": self.epoch, "step": self.step, "arch": "unet3d", "model": self.config,
                "state_dict": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict(),
                "best_dice": self.best_dice, "args": vars(args), "world_size": len(rng_states),
                "rng_states": rng_states, "train_sums": self.train_sums,
                "train_samples": self.train_samples,  # [safety]
            }, is_best, args.output_dir)

    def load_state_dict(self, ckpt, args, rank, world_size, log):
        """Everything back from a checkpoint (load_checkpoint's); only the weights for --evaluate."""
        self.model.load_state_dict(ckpt["state_dict"])
        if args.evaluate:
            return
        self.optimizer.load_state_dict(ckpt["optimizer"])
        self.scheduler.load_state_dict(ckpt["scheduler"])
        if ckpt["scaler"]:  # empty when saved without fp16 loss scaling: the scaler starts afresh
            self.scaler.load_state_dict(ckpt["scaler"])
        self.epoch, self.step, self.best_dice = ckpt["epoch"], ckpt.get("step", 0), ckpt["best_dice"]
        self.train_sums = ckpt.get("train_sums") if rank == 0 else None  # [preemption]
        if ckpt.get("world_size") == world_size:
            set_rng_state(ckpt["rng_states"][rank])


def train_one_epoch(run, batches, args, log):
    """One pass over this rank's share of the patches, from step run.step on. Returns the epoch's summary (loss,
    dice, count), or None when every rank agreed to stop: run.step and run.train_sums then say where."""
    run.train_model.train()
    device = next(run.model.parameters()).device
    metrics = SegMetrics(device)
    steps_per_epoch = run.step + len(batches)
    first_bad = torch.full((), -1, device=device)  # [safety]
    last_time, last_count = time.monotonic(), 0
    if run.train_sums is not None:  # [preemption]
        metrics.sums += run.train_sums.to(device)  # [preemption]
        last_count = run.train_sums[1].item()  # [preemption]

    def report(step):
        nonlocal last_time, last_count
        s = metrics.summary()
        check_finite(s, first_bad, run.epoch)  # [safety]
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
        first_bad = torch.where((first_bad < 0) & ~torch.isfinite(loss_sum), step, first_bad)  # [safety]
        if (step + 1) % args.print_freq == 0 and step + 1 < steps_per_epoch:
            report(step + 1)
    summary = report(steps_per_epoch)
    run.step = 0
    run.train_sums = None  # [preemption]
    return summary


def evaluate(model, volumes, patch, tiles_per_pass, amp_dtype):
    """Whole volumes, each on one rank. Sums (loss, per-volume Dice, volumes, intersection, predicted,
    true, union) are all-reduced once: the result equals a single-process evaluation. Also returns
    the middle slice of the first volume's input, mask and prediction, for TensorBoard."""
    model.eval()
    device = next(model.parameters()).device
    sums, slices = torch.zeros(7, dtype=torch.float64, device=device), None
    with torch.inference_mode(), torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
        for image, label in volumes:
            logits = predict_volume(model, image[0], patch, tiles_per_pass)
            target = label.float()
            counts = overlap(logits, target)
            sizes = counts[1] + counts[2]
            dice = torch.where(sizes > 0, 2 * counts[0] / sizes.clamp_min(1), 1.0)  # empty mask, empty prediction: 1
            loss = bce_dice_loss(logits, target).double()
            sums += torch.cat([torch.stack([loss, dice, torch.ones_like(dice)]), counts])
            if slices is None:
                middle = image.shape[2] // 2
                picture = image[0, 0, middle].float()
                slices = [(picture - picture.min()) / (picture.max() - picture.min()).clamp_min(1e-6),
                          target[0, middle], (logits[0, middle] > 0).float()]
    loss, dice, n, inter, pred, true, union = reduce_tensor(sums).tolist()
    return ({"loss": loss / max(n, 1), "dice": 2 * inter / (pred + true) if pred + true else 1.0,
             "iou": inter / union if union else 1.0, "dice_per_volume": dice / max(n, 1), "volumes": int(n),
             "intersection": int(inter), "predicted": int(pred), "true": int(true), "union": int(union)},
            [s.cpu() for s in slices] if slices else [])


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


# =============================================================================================
# What every run needs: errors, loaders, samplers, prefetcher, metrics, checkpoints; the same text in every script.
# =============================================================================================
class UserError(Exception):
    """Bad input that every rank finds alike: the safety net reports it in one line from one rank, exit code 2."""


class RankError(UserError):
    """Bad input that only some ranks meet (a file one rank reads, a GPU one rank lacks): each of them reports it."""


def in_range(kind, at_least=None, above=None, below=None):
    """An argparse type for a number flag: `kind`, int or float. The safety net checks the bounds too (check_range)."""
    return kind


def join_process_group(args, store, rank, world_size, device):
    """The process group, on a rendezvous store; returns a CPU group for the preemption flag (no GPU wait)."""
    backend = args.dist_backend or ("nccl" if device.type == "cuda" else "gloo")
    check_shared_gpus(store, world_size, device, backend)  # [safety]
    timeout = datetime.timedelta(seconds=args.dist_timeout)  # a new group would wait torch's default 30 minutes
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout,
                            device_id=device if device.type == "cuda" else None)
    return dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else dist.group.WORLD


def build_loaders(args, train_set, val_set, rank, world_size, device):
    """(train sampler, train batches, validation volumes): each rank takes its share of the patches and of
    the whole volumes, which DevicePrefetchers put on the device."""
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
    return train_sampler, DevicePrefetcher(train_loader, device), DevicePrefetcher(val_loader, device)


class DevicePrefetcher:
    """Yields a loader's batches on the device; the copy from pinned memory does not wait: the next batch's is
    queued while the GPU still runs this step. Volumes arrive standardized: nothing left to convert."""

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
    """Running sums on the device (loss, patches, intersection, predicted, true, non-finite losses);
    `summary` reduces them over all ranks, so Dice is over every voxel of every rank."""

    def __init__(self, device):
        self.sums = torch.zeros(6, dtype=torch.float64, device=device)

    def update(self, loss_sum, logits, target):
        """loss_sum: the batch's loss summed over its patches (train_step's); target: N×1×D×H×W masks."""
        loss_sum = loss_sum.detach().double().reshape(1)
        n = torch.full((1,), target.shape[0], dtype=torch.float64, device=target.device)
        bad = (~torch.isfinite(loss_sum)).double()
        self.sums += torch.cat([loss_sum, n, overlap(logits.detach(), target)[:3], bad])

    def summary(self):
        loss, n, inter, pred, true, bad = reduce_tensor(self.sums).tolist()
        return {"loss": loss / max(n, 1), "dice": 2 * inter / max(pred + true, 1), "count": int(n),
                "nonfinite": int(bad)}


def fork_loader_workers(*loaders):
    """Forks the loaders' persistent workers now, idle (batches drawn from nothing this once), before other threads
    start (gloo's, TensorBoard's; pytorch#130610: a fork can hang on a lock a thread holds). Only the last loader may
    pin memory: its pin thread starts after its workers. Fork: spawn would import torch anew in each worker."""
    for loader in loaders:
        if loader.num_workers and sys.platform.startswith("linux"):
            loader.multiprocessing_context = "fork"
            batches, sampler = loader.batch_sampler, loader.batch_sampler.sampler
            batches.sampler = ()  # nothing to load, this once
            with torch.random.fork_rng(devices=[]):
                iter(loader)
            batches.sampler = sampler


class TrainSampler(DistributedSampler):
    """DistributedSampler that can start mid-epoch and hands out (index, seed) pairs: each sample's augmentation
    follows from (--seed, epoch, index) alone, whatever the number of processes, workers, or the resume point."""

    def __init__(self, dataset, **kwargs):
        super().__init__(dataset, shuffle=True, drop_last=True, **kwargs)
        self.start = 0  # samples of this rank's share already trained on in this epoch

    def __iter__(self):
        base = (self.seed * 100_003 + self.epoch) * 1_000_000_007
        return iter([(i, (base + i) % 2**63) for i in list(super().__iter__())[self.start:]])

    def __len__(self):
        return max(super().__len__() - self.start, 0)  # a resume point past the end: nothing left of the epoch


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
    tmp = f"{path}.tmp"
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def tensor_bytes(obj):
    """Bytes of all the tensors in a nested state dict: about the size of its file."""
    if isinstance(obj, torch.Tensor):
        return obj.untyped_storage().nbytes()
    values = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
    return sum(tensor_bytes(v) for v in values)


def save_checkpoint(state, is_best, output_dir):
    """checkpoint.pth.tar, and a copy in model_best.pth.tar written before it: the checkpoint commits the epoch (a
    run killed before it trains the epoch again), and no committed epoch's best is lost."""
    path, best = os.path.join(output_dir, CHECKPOINT), os.path.join(output_dir, "model_best.pth.tar")
    os.makedirs(output_dir, exist_ok=True)
    atomic_write(best if is_best else path, lambda f: torch.save(state, f))
    if is_best:
        with open(best, "rb") as src:
            atomic_write(path, lambda f: shutil.copyfileobj(src, f))


def resume_path(args):
    """The checkpoint to resume, or None; --resume auto: --output-dir's if anything is there (a broken link stops)."""
    path = os.path.join(args.output_dir, CHECKPOINT) if args.resume == "auto" else args.resume
    if args.resume == "auto" and not os.path.lexists(path):
        return None
    if path and os.path.exists(path) and not (os.path.isfile(path) or os.path.isdir(path)):  # [safety]
        raise UserError(f"--resume {args.resume}: {path} is not a file (a pipe, a device): give a "  # [safety]
                        f"checkpoint, or move it away")  # [safety]
    if path and not os.path.lexists(path):  # [safety]
        raise UserError(f"--resume {path}: no such file; give an existing checkpoint, or --resume auto")  # [safety]
    return path or None


def read_checkpoint(path):
    """The file's content on the CPU: set_rng_state takes CPU tensors; load_state_dict copies to the device itself."""
    return torch.load(path, map_location="cpu", weights_only=True)


def load_checkpoint(path, config, args):
    """The checkpoint (read_checkpoint's), checked to be a 3D U-Net of this shape (and, to train on, of the flags its
    step, optimizer, schedule and the epoch's order hold: given anew, they would be ignored), without a wrapper's
    prefix."""
    ckpt = read_checkpoint(path)
    unet = isinstance(ckpt, dict) and ckpt.get("arch") == "unet3d" and isinstance(ckpt.get("model"), dict)  # [safety]
    weights = ckpt.get("state_dict") if unet else None  # [safety]
    if not (isinstance(weights, dict) and all(isinstance(key, str) for key in weights)):  # [safety]
        raise UserError(f"{path} is not a 3D U-Net training checkpoint of this script: give one it saved")  # [safety]
    check_kinds(path, ckpt, args)  # [safety]
    if ckpt["model"] != config:  # [safety]
        flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in ckpt["model"].items()  # [safety]
                         if k != "in_channels")  # [safety]
        raise UserError(f"{path} holds a U-Net with {ckpt['model']}, not {config}: pass {flags}, "  # [safety]
                        f"or another checkpoint")  # [safety]
    flags = ("batch_size", "lr", "weight_decay", "milestones", "gamma", "seed")  # [safety]
    for flag in flags if not args.evaluate else ():  # [safety]
        values = ckpt.get("args", {}).get(flag, getattr(args, flag)), getattr(args, flag)  # [safety]
        trained, given = (" ".join(map(str, v)) if isinstance(v, (list, tuple)) else str(v) for v in values)  # [safety]
        name = "--" + flag.replace("_", "-")  # [safety]
        if trained != given:  # [safety]
            raise UserError(f"{path} was trained with {name} {trained}, this run has {name} {given}: "  # [safety]
                            f"continue it with {name} {trained}, or train without --resume")  # [safety]
    consume_prefix_in_state_dict_if_present(ckpt["state_dict"], "module.")
    return ckpt


EXTENSIONS = (".nii.gz", ".npy", ".tif", ".tiff", ".nii")  # .nii.gz before .nii: the longest match wins


def split_name(filename):
    """(stem, extension) for a supported volume file, (filename, None) otherwise."""
    ext = next((e for e in EXTENSIONS if filename.lower().endswith(e)), None)
    return (filename[: -len(ext)], ext) if ext else (filename, None)


def read_volume(path, shape_only=False):
    """The array in a volume file (.npy memory-mapped), or only its shape (read from the header)."""
    ext = split_name(path)[1]
    if ext == ".npy":
        array = np.load(path, mmap_mode="r", allow_pickle=False)
    elif ext in (".tif", ".tiff"):
        if shape_only:
            with tifffile.TiffFile(path) as tif:
                return tuple(tif.series[0].shape)
        array = tifffile.imread(path)
    else:  # NIfTI arrays are taken as stored (x, y, z): keep images and labels in the same format
        volume = nibabel.load(path)
        array = volume if shape_only else np.asanyarray(volume.dataobj)
    return tuple(array.shape) if shape_only else array


def volume_tensors(image, label):
    """float32 C×D×H×W image, standardized per channel over the whole volume; uint8 D×H×W mask."""
    image = torch.from_numpy(np.array(image, dtype=np.float32))
    image = image[None] if image.dim() == 3 else image
    mean, std = image.mean(dim=(1, 2, 3), keepdim=True), image.std(dim=(1, 2, 3), keepdim=True)
    label = torch.from_numpy(np.asarray(label) != 0).reshape(image.shape[1:])  # (any byte order: a bool array)
    return (image - mean) / std.clamp_min(1e-6), label.to(torch.uint8)


def shape_text(shape):
    return "×".join(map(str, shape))


def volume_files(folder):
    """stem -> file name of every volume in `folder` (hidden files left out)."""
    return {split_name(name)[0]: name for name in sorted(os.listdir(folder)) if not name.startswith(".")}


class VolumeFolder(Dataset):
    """root/images/NAME.ext and root/labels/NAME.ext paired by NAME; item i is one whole volume."""

    def __init__(self, root):
        check_volume_folder(root)  # [safety]
        images, labels = (volume_files(os.path.join(root, kind)) for kind in ("images", "labels"))
        self.pairs = [(os.path.join(root, "images", images[stem]), os.path.join(root, "labels", labels[stem]))
                      for stem in sorted(images)]
        self.shapes = [read_volume(image, shape_only=True) for image, _ in self.pairs]
        self.channels = 1 if len(self.shapes[0]) == 3 else self.shapes[0][0]

    def __len__(self):
        return len(self.pairs)

    def __getitem__(self, index):
        image_path, label_path = self.pairs[index]
        return volume_tensors(read_volume(image_path), read_volume(label_path))


def pad_to(tensor, size):
    """Zero-pads the last three dimensions at their far end up to at least `size`."""
    pads = [max(s - t, 0) for t, s in zip(tensor.shape[-3:], size)]
    return F.pad(tensor, [x for p in reversed(pads) for x in (0, p)]) if any(pads) else tensor


class RandomPatches(Dataset):
    """Sample i is a random patch of volume i % len(volumes), flipped at random along each axis. The
    randomness comes from the torch generator, which SeededSamples seeds per sample."""

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


def note_small_volumes(volumes, patch, log):
    """Says how many volumes are smaller than a patch somewhere: padded, not refused, but worth knowing."""
    small = sum(any(s < p for s, p in zip(shape[-3:], patch)) for shape in volumes.shapes)
    if small:
        log(f"note: {small} training volume(s) are smaller than --patch-size {shape_text(patch)} along some axis; "
            f"their patches are zero-padded at the far end (label 0)")
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


def ddp_buffer_options(model):
    """DDP's options for a model with SyncBatchNorm, which keeps the statistics equal on every rank: no broadcast of
    them before each forward. torch 2.14 renamed the option (and warns about the old name); older releases know the
    old one only."""
    if not any(isinstance(m, torch.nn.SyncBatchNorm) for m in model.modules()):
        return {}
    renamed = "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
    return {"forward_sync_buffers" if renamed else "broadcast_buffers": False}
# endregion [sync-bn]
# region [preemption]: SIGTERM / SIGUSR1 / SIGHUP (a scheduler, a launcher or terminal gone): all stop at a step, save
PREEMPTED = 75  # the exit code of a run stopped early, its checkpoint saved: "resume me" (sysexits.h's EX_TEMPFAIL)


def sum_async(tensor, group):
    """Starts summing a CPU tensor in place over the processes of `group`; returns what waits for the sum. Part of
    the launcher interface (Horovod sums its own way), used by the preemption flag alone."""
    return dist.all_reduce(tensor, group=group, async_op=True).wait


class Preemption:
    """SIGTERM / SIGUSR1 / SIGHUP (a terminal hung up; torchrun passes it on, nohup or not) set a flag, from the start
    of main_worker (a request during start-up stops the run at its first steps). Ranks agree on it one step later
    through a non-blocking sum on the launcher's CPU group (`group`, set once it exists: sum_async), so checking it
    every step costs no barrier and no GPU sync."""

    signum = None  # the signal that stopped the run (the Slurm script requeues after SIGUSR1 only)

    def __init__(self):
        self.group, self.requested, self.wait = None, False, None
        self.flag = torch.zeros(1)
        self.signals = [sig for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP)  # nohup's SIGHUP stays ignored
                        if sig != signal.SIGHUP or signal.getsignal(sig) is not signal.SIG_IGN]
        self.catch(True)

    def catch(self, on):
        """Stop requests set the flag; not on: SIGTERM and SIGHUP end the process at once, while it waits for its peers
        to start the process group (no handler runs there, and a rank that failed first would leave it waiting)."""
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
        """Every rank saves where it stopped (unless it just did), then waits for all: a launcher stops the rest once
        one exits non-zero. Returns PREEMPTED."""
        if not saved:
            sync_buffers(run.model)  # rank 0's BatchNorm statistics, as an epoch's end saves (FSDP saves any rank's)
            run.save(args, rank, is_best=False)
        if self.group is not None:
            sum_async(self.flag, self.group)()
        log(f"preempted: saved {os.path.join(args.output_dir, CHECKPOINT)} {where}; continue with --resume auto "
            f"(exit code {PREEMPTED})")
        return PREEMPTED


def start_loader_worker(worker_id):
    """The loaders' worker_init_fn. Launchers signal a whole process group: workers ignore SIGTERM, SIGUSR1 and SIGHUP,
    which would take their training process down before its preemption checkpoint; they die with it, quietly."""
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    die_with_parent(signal.SIGKILL)
    report = sys.excepthook
    sys.excepthook = lambda kind, *rest: None if issubclass(kind, (ConnectionError, EOFError)) else report(kind, *rest)


def die_with_parent(signum):
    """Linux sends this process `signum` once its parent is gone (prctl PR_SET_PDEATHSIG): a launcher killed with -9
    leaves no process behind. A training process gets SIGTERM, and saves, once its process group is up; before, it
    gets SIGKILL: its rendezvous would wait --dist-timeout for the store that died with the launcher. A parent that
    multiprocessing started (spawn's, a loader's) and that is gone already sends nothing: the signal comes now."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signum))
        parent = multiprocessing.parent_process()
        if parent is not None and not parent.is_alive():
            os.kill(os.getpid(), signum)


def end_loader_workers():
    """Kills the loader workers as a training process ends (main's finally): they ignore SIGTERM, which
    multiprocessing's exit hook sends its daemonic children before it waits for them, forever."""
    workers = [child for child in multiprocessing.active_children() if child.daemon]  # spawn's are not daemonic
    if workers:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # DataLoader's handler would call their end a failure
    for worker in workers:
        worker.kill()


def print_or_drop(*values):
    """Rank 0's log: print, flushed. When the output cannot take it (whoever read it is gone, a launcher killed with
    -9; the log file's disk is full), the rest goes to /dev/null, instead of an error that would end the run before
    its next checkpoint (a disk full for that too says so, in one line, on stderr)."""
    try:
        print(*values, flush=True)
    except OSError:  # BrokenPipeError, or ENOSPC, EIO
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
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
    """Rank 0's TensorBoard writer (None elsewhere), closed at exit; it replaces older entries from `epoch` on. False
    where the tensorboard package, an optional one, does not load (missing, or made for another protobuf or numpy):
    metrics.jsonl alone."""
    if rank != 0:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except Exception as e:
        why = " ".join(str(e).split())[:200]  # on one line
        print(f"note: no TensorBoard logs (tensorboard did not load: {why}; pip install -U tensorboard); "
              f"metrics.jsonl has them")
        return False
    report = threading.excepthook  # its writer thread's error comes again as the next flush's (write_epoch's): once
    threading.excepthook = lambda fail: None if type(fail.thread).__module__.startswith("tensorboard") else report(fail)
    writer = SummaryWriter(os.path.join(args.output_dir, "tb"), purge_step=epoch)
    atexit.register(writer.close)
    return writer


def write_epoch(row, writer, output_dir):
    """One JSON line per epoch in metrics.jsonl (NaN, inf: null, as strict JSON has them), and the same scalars in
    TensorBoard."""
    with open(os.path.join(output_dir, "metrics.jsonl"), "a") as f:
        f.write(json.dumps({key: value if abs(value) < float("inf") else None for key, value in row.items()}) + "\n")
    if not writer:  # False: no tensorboard package
        return
    os.makedirs(writer.log_dir, exist_ok=True)  # a folder removed mid-run comes back, as save_checkpoint's does
    for key, value in row.items():
        if key != "epoch":
            writer.add_scalar(key, value, row["epoch"])
    writer.flush()
# endregion [logs]
# region [synthetic]: --synthetic, --synthetic-size, --synthetic-shape: learnable generated volumes, for demos and tests
class SyntheticVolumes(Dataset):
    """1 to 3 random ellipsoids of random brightness in noise, and their mask: learnable, and volume i
    is the same on every call, rank and run."""

    def __init__(self, size, shape, offset=0):
        self.size, self.offset, self.channels = size, offset, 1
        self.shapes = [tuple(shape)] * size

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        g = torch.Generator().manual_seed(self.offset + index)
        shape = self.shapes[0]
        grid = torch.stack(torch.meshgrid(*(torch.arange(s, dtype=torch.float32) for s in shape), indexing="ij"))
        size = torch.tensor(shape, dtype=torch.float32).view(3, 1, 1, 1)
        image, mask = torch.randn(shape, generator=g), torch.zeros(shape, dtype=torch.bool)
        for _ in range(int(torch.randint(1, 4, (), generator=g))):
            centre = (torch.rand(3, 1, 1, 1, generator=g) * 0.6 + 0.2) * size
            radius = (torch.rand(3, 1, 1, 1, generator=g) * 0.15 + 0.12) * size
            inside = (((grid - centre) / radius) ** 2).sum(0) <= 1
            image += inside * (1.0 + 0.5 * torch.rand((), generator=g))
            mask |= inside
        return volume_tensors(image.numpy(), mask.numpy())
# endregion [synthetic]
# =============================================================================================
# Part 3, the safety net: checks before training, failures made one line. Delete its region and lines tagged [safety].
# =============================================================================================
# region [safety]
def one_line(error):
    """UserError's text: on one line, whatever it quotes; raised in a loader worker, it ends the worker's traceback,
    after "UserError: " (RankError: ...)."""
    return " ".join(Exception.__str__(error).split()).split(f"{type(error).__name__}: ")[-1]


def argument_error(message):
    """argparse's error (it would print usage and exit on every rank): a UserError, one line from one rank."""
    raise UserError(f"{message} (see --help)")


def check_range(kind, at_least=None, above=None, below=None):
    """in_range, checked: a finite `kind` within the bounds given, else an error that names the range."""
    name = "an integer" if kind is int else "a number"
    limits = [f"{op} {bound}" for op, bound in ((">=", at_least), (">", above), ("<", below)) if bound is not None]
    wanted = f"{name} {' and '.join(limits)}".strip()

    def convert(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text} is not {name}: give {wanted}") from None
        if not (abs(value) < float("inf") and (at_least is None or value >= at_least)
                and (above is None or value > above) and (below is None or value < below)):
            raise argparse.ArgumentTypeError(f"{text} is out of range: give {wanted}")
        if kind is int and value >= 2**31:  # seeds, counts: larger ones overflow in torch, or never end
            raise argparse.ArgumentTypeError(f"{text} is too large: give {wanted}, below 2**31")
        return value

    convert.bounds = (kind, at_least, above, below)
    return convert


def exit_bad_input(error, reporter):
    """Exit code 2, with one `error:` line from the reporting rank (each rank, for a RankError). A silent rank waits up
    to 30 s to be stopped: a launcher that saw it exit would stop the reporting rank before it printed."""
    if reporter or isinstance(error, RankError):
        try:
            print(f"error: {error}\n", end="", file=sys.stderr, flush=True)  # one write: other ranks' cannot split it
        except OSError:  # stderr on a full disk, or gone: the exit code alone says it (and exit's flush cannot fail)
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stderr.fileno())
    else:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the launcher's stop ends the wait, preemption handler or not
        time.sleep(30)
    sys.unraisablehook = lambda failure_in_cleanup_after_the_line: None
    sys.exit(2)


def check_torchrun():
    """torchrun's variables set in part (by hand, or left from another job) or not numbers that fit together, and
    --max-restarts' shared store."""
    names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    present = [v for v in names if v in os.environ]
    if set(present) & {"RANK", "LOCAL_RANK", "WORLD_SIZE"} and len(present) < len(names):
        raise RankError(f"{', '.join(present)} set but not {', '.join(v for v in names if v not in present)}:"
                        f" start the script with torchrun, or unset them to run one process")
    given = {name: os.environ.get(name, default) for name, default in (("RANK", "0"), ("LOCAL_RANK", "0"),
             ("WORLD_SIZE", "1"), ("MASTER_PORT", "1"), ("TORCHELASTIC_MAX_RESTARTS", "0"))}
    if not (all(v.isdigit() for v in given.values()) and int(given["RANK"]) < int(given["WORLD_SIZE"])
            and 0 < int(given["MASTER_PORT"]) < 2**16):  # (port 0: each rank would listen on a port of its own)
        shown = ", ".join(f"{name}={value!r}" for name, value in given.items() if name in os.environ)
        raise RankError(f"torchrun's variables are not numbers that fit together ({shown}): start the script with "
                        f"torchrun, or unset them to run one process")
    address = os.environ.get("MASTER_ADDR") or "localhost"
    check_address(address, f"MASTER_ADDR={address}")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and int(given["TORCHELASTIC_MAX_RESTARTS"]):
        if given["RANK"] == "0":
            print("note: with --max-restarts, start torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1; with the "
                  "store shared, restarted workers can read their predecessors' addresses and fail "
                  "(pytorch/pytorch#135712)", flush=True)


def check_address(address, named):
    """A rendezvous host name that does not resolve, named as the user gave it: the rendezvous would wait for it
    until --dist-timeout (30 minutes by default)."""
    try:
        socket.getaddrinfo(address, None)
    except OSError as e:
        raise RankError(f"{named} does not resolve ({e.strerror}): give the address of the node of rank 0") from None


TORCH_MIN = (2, 9)  # the oldest torch the tests pass on (requirements.txt): see check_torch


def check_torch():
    """Refuses a torch older than TORCH_MIN: 2.4 lacks calls three scripts make (they failed mid-run), and up to 2.8
    FSDP2 over gloo ends with other weights than DDP (its tests). By the release number alone: NVIDIA's containers call
    theirs 2.9.0a0+..., a pre-release of 2.9 to pip."""
    have = tuple(int(part) for part in torch.__version__.split(".")[:2])
    if have < TORCH_MIN:
        need = ".".join(map(str, TORCH_MIN))
        raise UserError(f"torch {torch.__version__} is older than this script needs ({need}): install torch {need} "
                        f"or newer, the build for your CUDA driver (pip install -U torch torchvision)")


def check_args(args):
    """What no single flag's range says: the flags together. With the ranges in parse_args, every value is
    checked here, right after parsing, before any process waits for another."""
    check_torch()
    if args.epochs == 0 and not args.evaluate:
        raise UserError("--epochs 0 trains nothing: give at least 1, or -e to evaluate a checkpoint")
    if any(p % 2 ** (args.depth - 1) for p in args.patch_size):
        raise UserError(f"--patch-size {' '.join(map(str, args.patch_size))}: with --depth {args.depth} each side "
                        f"must be a positive multiple of {2 ** (args.depth - 1)} (2**(depth-1))")
    if args.synthetic and args.data:  # [synthetic]
        raise UserError(f"--synthetic makes its own volumes, and {args.data} names a folder: give one "  # [synthetic]
                        f"of them")  # [synthetic]


FOREIGN_FLAGS = {  # other scripts' flags that users bring along, and what this one does instead
    ("--local-rank", "--local_rank"): "torch.distributed.launch passes it to torchrun's scripts; see the docstring",
    ("--multiprocessing-distributed",): "every script here runs a process per GPU: see the docstring for how",
    ("--world-size", "--rank", "--dist-url"): "the launcher gives each process its rank and peers: see the docstring",
    ("--gpu",): "each visible GPU gets a process; for one GPU, start one process with CUDA_VISIBLE_DEVICES=N",
    ("--start-epoch",): "a run starts at its checkpoint's epoch: give --resume PATH, or --resume auto",
}


def add_foreign_flags(parser):
    """FOREIGN_FLAGS as hidden flags, each stopping with one line that names what to do here instead."""
    for flags, instead in FOREIGN_FLAGS.items():
        class Refuse(argparse.Action):
            def __call__(self, parser, namespace, values, option_string=None, instead=instead):
                raise UserError(f"{option_string} is not a flag of this script: {instead}")

        with contextlib.suppress(argparse.ArgumentError):  # a flag of its own
            parser.add_argument(*flags, nargs="?", action=Refuse, help=argparse.SUPPRESS)


def check_launch_args(args, world_size, device):
    """The flags this launcher reads its own way, checked before any process waits for another: none here. Part of
    the launcher interface (each sibling checks its own), called by check_run alone."""


MEMORY = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")  # this machine's, in bytes


def check_run(args, world_size, device, sets, rank):
    """The rest of bad input, before the loaders start: the batch, the launcher's flags, the data (each rank reads
    its own share of the label masks)."""
    if args.batch_size % world_size:
        raise UserError(f"--batch-size {args.batch_size} is the global batch and must divide by the world size "
                        f"{world_size}: use e.g. {max(args.batch_size // world_size, 1) * world_size}")
    patch = " ".join(map(str, args.patch_size))
    sizes = {f"--patch-size {patch} with -b {args.batch_size} and --base-channels {args.base_channels}": (
             args.patch_size, args.batch_size // world_size * args.base_channels, "the first level's features")}
    if args.synthetic:  # [synthetic]
        shape = " ".join(map(str, args.synthetic_shape))  # [synthetic]
        sizes[f"--synthetic-shape {shape}"] = (args.synthetic_shape, 1, "one volume")  # [synthetic]
    for given, (sides, count, what) in sizes.items():
        need = count * math.prod(sides) * 4  # as float32 (a model needs more)
        if need > MEMORY:
            raise UserError(f"{given}: {what}, {count} float volume(s) of that size per process, take "
                            f"{need / 2**30:.0f} GiB, more than this machine's {MEMORY / 2**30:.0f} GiB: give smaller "
                            f"sizes")
    check_launch_args(args, world_size, device)
    train_set, val_set = sets
    if len(train_set) * args.patches_per_volume < args.batch_size and not args.evaluate:
        raise UserError(f"{len(train_set)} training volumes x {args.patches_per_volume} patches are fewer than one "
                        f"global batch of {args.batch_size}: lower -b or raise --patches-per-volume")
    for dataset in sets:
        if isinstance(dataset, VolumeFolder):
            check_labels(dataset, rank, world_size)


def check_volume_folder(root):
    """VolumeFolder's files, before it pairs them: in images/ and labels/, volume files only, one per name, a label
    for every image and an image for every label, of D×H×W or C×D×H×W (a label: its image's D×H×W), and one number
    of channels."""
    files = {}
    for folder in (os.path.join(root, "images"), os.path.join(root, "labels")):
        names, found = sorted(f for f in os.listdir(folder) if not f.startswith(".")), {}
        if not names:
            raise UserError(f"{folder} is empty: put the volumes there ({', '.join(EXTENSIONS)}), "
                            f"labels under the same names")
        for name in names:
            stem, ext = split_name(name)
            if ext is None:
                raise UserError(f"{os.path.join(folder, name)}: unsupported file type; use {', '.join(EXTENSIONS)}")
            if stem in found:
                raise UserError(f"{folder} holds both {found[stem]} and {name}: keep one volume per name")
            found[stem] = name
        files[os.path.basename(folder)] = found
    pairs, shapes = [], []
    for stem in sorted(files["images"].keys() | files["labels"].keys()):
        image, label = (os.path.join(root, kind, files[kind].get(stem, stem)) for kind in ("images", "labels"))
        if stem not in files["labels"]:
            raise UserError(f"{image} has no label: add {label}.* (labels are paired by file name) "
                            f"or remove the image")
        if stem not in files["images"]:
            raise UserError(f"{label} has no image: add {image}.* (images are paired by file name) "
                            f"or remove the label")
        pairs.append((image, label))
    for image_path, label_path in pairs:
        image, label = read_volume(image_path, shape_only=True), read_volume(label_path, shape_only=True)
        if len(image) not in (3, 4) or 0 in image:
            raise UserError(f"{image_path} has shape {shape_text(image)}: volumes must be D×H×W or C×D×H×W, "
                            f"no side 0")
        if label != image[-3:] and label != (1, *image[-3:]):
            raise UserError(f"shape mismatch: {image_path} is {shape_text(image)}, {label_path} is "
                            f"{shape_text(label)}; a label must have its image's D×H×W")
        shapes.append(image)
    channels = {1 if len(s) == 3 else s[0] for s in shapes}
    if len(channels) > 1:
        raise UserError(f"{root}/images: volumes with {sorted(channels)} channels; all must have the same number")


def check_labels(volumes, rank, world_size):
    """Reads this rank's share of a VolumeFolder's masks (each is read by one rank only): 0 and 1 only."""
    for _, path in volumes.pairs[rank::world_size]:
        values = np.unique(read_volume(path))
        if not np.isin(values, (0, 1)).all():
            raise RankError(f"{path} is not a binary mask (values {', '.join(map(str, values[:6]))}"
                            f"{' ...' if len(values) > 6 else ''}): labels must hold only 0 and 1")


def explain_unreadable_volume(read_volume):
    """read_volume, with what it cannot read said in one line: a reader that is missing (tifffile, nibabel), a file
    it cannot read (said by the rank that reads it), values that are no intensities, NaN and inf, or values so large
    that standardizing them overflows."""
    @functools.wraps(read_volume)
    def checked(path, shape_only=False):
        ext = split_name(path)[1]
        if ext in (".tif", ".tiff") and tifffile is None:
            raise UserError(f"{path}: reading .tif/.tiff needs tifffile, which is missing or does not load here "
                            f"(pip install -U tifffile), or convert the volumes to .npy")
        if ext in (".nii", ".nii.gz") and nibabel is None:
            raise UserError(f"{path}: reading .nii/.nii.gz needs nibabel, which is missing or does not load here "
                            f"(pip install -U nibabel), or convert the volumes to .npy")
        try:
            array = read_volume(path, shape_only)
        except Exception as e:  # truncated, corrupt, not what its name says: all mean the same to the user
            reason = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
            raise RankError(f"cannot read volume {path} ({reason}): replace or remove the file") from None
        if shape_only:
            return array
        if array.dtype.kind not in "biuf":  # complex, text, dates: no intensities to learn from
            raise RankError(f"{path} holds {array.dtype} values: a volume holds integers, floats or booleans; "
                            f"convert it")
        if array.dtype.kind == "f" and not np.isfinite(array).all():
            raise RankError(f"{path} holds NaN or inf values: replace them (numpy.nan_to_num), or remove it")
        peak = max(abs(float(array.max())), abs(float(array.min()))) if array.size else 0.0
        if peak > min(1e19, 1e38 / max(array.size, 1)):  # its sum or its squares pass float32's 3.4e38: NaN, silently
            raise RankError(f"{path} holds values up to {peak:.3g}, too large to standardize in float32: rescale the "
                            f"volume")
        return array
    return checked


def check_evaluated(path, args):
    """-e where --output-dir holds no checkpoint for --resume auto, or with no --resume at all (nor --pretrained, nor
    a MODULE:FUNCTION model, which may load its own weights): it would evaluate the model's random initial weights."""
    if args.evaluate and args.resume == "auto" and not path:
        raise UserError(f"-e --resume auto: --output-dir {args.output_dir} holds no checkpoint to evaluate; give the "
                        f"--output-dir of the run, or --resume PATH")
    weighted = getattr(args, "pretrained", False) or ":" in getattr(args, "arch", "")  # (unet3d_apex.py: neither)
    if args.evaluate and not args.resume and not weighted:
        raise UserError("-e evaluates trained weights, and none are given: add --resume PATH (a checkpoint, or "
                        "weights saved with torch.save(model.state_dict(), PATH))"
                        + " or --pretrained" * hasattr(args, "pretrained"))


def check_kinds(path, ckpt, args):
    """A checkpoint's parts of types that no run saves (damaged, or made by hand), before anything reads them."""
    kinds = {"args": dict, "optimizer": (dict, type(None)), "scheduler": dict, "scaler": dict, "rng_states": list,
             "best_acc1": (int, float), "best_dice": (int, float), "train_sums": (torch.Tensor, type(None))}
    odd = next((key for key, kind in kinds.items() if key in ckpt and not isinstance(ckpt[key], kind)), None)
    if odd and not args.evaluate:
        raise UserError(f"{path}: its {odd} is a {type(ckpt[odd]).__name__}, which these scripts never save: the file "
                        f"is damaged or made elsewhere; resume from another checkpoint, or evaluate it with -e")


def check_train_samples(path, ckpt, train_set, args):
    """A checkpoint's counts that no run saves (damaged, or made by hand), and a resume on a training set of another
    size, which the step it resumes at, the order of a preempted epoch and the schedule cannot follow: they count the
    batches of the set it was trained on."""
    if not ckpt or args.evaluate:
        return
    bounds = {"epoch": (0, 2**31), "step": (0, len(train_set)), "world_size": (1, 2**31), "train_samples": (1, 2**31)}
    odd = next((key for key, (low, high) in bounds.items()
                if key in ckpt and not (type(ckpt[key]) is int and low <= ckpt[key] < high)), None)  # (not a bool)
    if odd:
        raise UserError(f"{path}: its {odd} is {ckpt[odd]!r}, which these scripts never save: the file is damaged or "
                        f"made elsewhere; resume from another checkpoint, or evaluate it with -e")
    trained = ckpt.get("train_samples")  # (none in older checkpoints)
    if trained not in (None, len(train_set)):
        raise UserError(f"{path} was trained on {trained} training samples, this run has {len(train_set)}: resume "
                        f"with the data it was trained on, or train without --resume")


def check_shared_gpus(store, world_size, device, backend):
    """Processes that share a GPU (one GPU for several Slurm tasks, two launchers on one machine), which NCCL answers
    with "Duplicate GPU detected" deep in a traceback: each counts itself in under its machine and GPU."""
    if "nccl" not in backend or device.type != "cuda":
        return
    gpu = torch.cuda.get_device_properties(device)
    key = f"gpu-check/{socket.gethostname()}/{getattr(gpu, 'uuid', device.index)}"
    store.add(key, 1)
    if store.add("gpu-check/arrived", 1) == world_size:
        store.set("gpu-check/done", "1")
    store.wait(["gpu-check/done"])
    if store.add(key, 0) > 1:
        raise RankError(f"{store.add(key, 0)} processes on {socket.gethostname()} use the same GPU ({gpu.name}, "
                        f"cuda:{device.index} here), which NCCL does not allow: start one process per GPU (Slurm: "
                        f"--gpus-per-task=1), or use --dist-backend gloo")


def explain_failed_save(save_checkpoint):
    """save_checkpoint; a failed write (disk full, folder gone) stops the run in one line: the room needed."""
    def save(state, is_best, output_dir):
        try:
            save_checkpoint(state, is_best, output_dir)
        except (OSError, RuntimeError) as e:  # torch.save reports a failed write as a RuntimeError
            need = tensor_bytes(state) / 2**20
            free = shutil.disk_usage(output_dir).free / 2**20 if os.path.isdir(output_dir) else 0.0  # or gone
            reason = ("no space left" if free < need else e.strerror if isinstance(e, OSError) and e.strerror
                      else str(e).strip().splitlines()[-1][:100])
            raise RankError(f"cannot write a checkpoint to {os.path.abspath(output_dir)} ({reason}): a checkpoint "
                            f"takes about {need:.0f} MiB (twice that while it replaces the last one), {free:.0f} MiB "
                            f"are free there; make room or give another --output-dir (the last checkpoint is kept)"
                            ) from None
    return save


def explain_unreadable(read_checkpoint):
    """read_checkpoint; a file it cannot read (truncated, corrupt, not a torch file) stops the run in one line."""
    def read(path):
        try:
            return read_checkpoint(path)
        except Exception as e:
            if isinstance(e, IsADirectoryError):  # a folder given for a file: nothing in it is damaged
                raise UserError(f"cannot load checkpoint {path}: it is a folder, not a checkpoint file (as "
                                f"fsdp_distributed.py saves: resume those with it); give a file that a run saved, or "
                                f"move the folder away to start fresh") from None
            text = str(e).split("WeightsUnpickler error:")[-1].strip()  # torch.load(weights_only=True): after it, why
            if text.startswith("Unsupported global: GLOBAL "):  # a pickled object: torch.save(model), say
                raise UserError(f"cannot load checkpoint {path}: it holds a pickled {text.split()[3]}, and checkpoints "
                                f"load as tensors only (weights_only, safe from code in the file); save its weights, "
                                f"torch.save(model.state_dict(), PATH), and evaluate those with -e") from None
            reason = text.splitlines()[0][:160] if text else type(e).__name__
            raise UserError(f"cannot load checkpoint {path} ({reason}): it is unreadable or truncated; resume from "
                            f"another file (e.g. model_best.pth.tar) or move it away to start fresh") from None
    return read


def explain_short_loader(prefetch):
    """Prefetcher.__iter__; a loader that ends before its length stops the run in one line. A dataset's __getitem__
    that raises StopIteration does that: a for loop takes it for the end, and this rank would wait for its peers."""
    def batches(self):
        count = 0
        for count, batch in enumerate(prefetch(self), 1):
            yield batch
        if count < len(self.loader):
            raise RankError(f"the data ended after {count} of {len(self.loader)} batches: a sample raised "
                            f"StopIteration, which ends a loop without an error; raise another one (IndexError)")
    return batches


def explain_damaged(load_state_dict):
    """RunState.load_state_dict; a checkpoint whose parts do not load, or load unlike this run's own (damaged, or
    made by hand or by another program), stops the run in one line: not at a later step, in a traceback or, for an
    optimizer state of another shape, in a fused step's segmentation fault."""
    def load(run, ckpt, args, *rest):
        def states():
            return {"optimizer": run.optimizer.state_dict(), "scheduler": run.scheduler.state_dict()}

        own = states()
        try:
            loaded = load_state_dict(run, ckpt, args, *rest)
            if args.evaluate:
                return loaded
            odd_shapes = (f"optimizer state {key}" for p, state in run.optimizer.state.items()
                          for key, v in state.items()
                          if not isinstance(v, torch.Tensor) or v.dim() and (v.shape, v.dtype) != (p.shape, p.dtype))
            odd = next(odd_shapes, None) or unlike(states(), own)
            if odd:
                raise ValueError(f"its {odd.lstrip('.')} is unlike this run's")
            return loaded
        except (UserError, torch.OutOfMemoryError, torch.distributed.DistError):
            raise
        except Exception as e:
            reason = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
            raise UserError(f"cannot resume from {resume_path(args)} ({reason}): the file is damaged or made "
                            f"elsewhere; resume from another checkpoint, or move it away to start fresh") from None
    return load


def unlike(saved, own, where=""):
    """Where a loaded state first differs in kind from this run's own (a key it lacks, a value of another type, a list
    of another length, a tensor of another shape), or "" where it does not; None on either side matches anything."""
    if saved is None or own is None:
        return ""
    if isinstance(own, dict):
        lacking = next((key for key in own if not isinstance(saved, dict) or key not in saved), None)
        if lacking is not None:
            return f"{where}.{lacking}"
        return next(filter(None, (unlike(saved[key], value, f"{where}.{key}") for key, value in own.items())), "")
    if isinstance(own, (list, tuple)):
        if not isinstance(saved, (list, tuple)) or len(saved) != len(own):
            return where
        return next(filter(None, (unlike(*pair, f"{where}.{i}") for i, pair in enumerate(zip(saved, own)))), "")
    if isinstance(own, torch.Tensor):
        return "" if isinstance(saved, torch.Tensor) and saved.shape == own.shape else where
    numbers = {type(saved), type(own)} <= {int, float}
    return "" if type(saved) is type(own) or numbers else where


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


def check_finite(summary, first_bad, epoch):
    """Stops every rank (they all see the same summary) when a loss was NaN/inf, naming the first such step. At the
    first step no update has happened yet: the learning rate is not the cause there."""
    if summary["nonfinite"]:
        step = min(s for s in gather_objects(int(first_bad)) if s >= 0)
        fix = ("it came before any update, from the model or the data: check them (on a GPU, --deterministic turns "
               "cuDNN's autotuner off)" if epoch == step == 0 else "lower --lr, or check the data")
        raise UserError(f"loss became NaN/inf at epoch {epoch} step {step}; stopped without saving it: {fix}")


# F.linear's, a convolution's, a norm's words for a model and inputs of other dtypes, or on other devices
MIXED_DTYPES = ("must have the same dtype", "should be the same", "expected scalar type", "to be on the same device")
PEER_GONE = ("closed by peer", "closed by remote peer", "reset by peer", "broken pipe", "socket closed", "got 0 bytes",
             "communicator was aborted", "remote process exited", "ncclremoteerror")  # words that say so: not a type


def explain_failure(error, args):
    """What to raise for an error that ends training on this rank: one line (RankError) on each rank that meets it,
    the cause where it happened and "a peer ended" elsewhere, for a collective that timed out or lost its peer, a
    DataLoader worker killed, NCCL failing here; any other error stays itself, traceback and all."""
    if isinstance(error, UserError):
        return error
    if isinstance(error, UnicodeEncodeError) and "surrogates not allowed" in str(error):  # bytes from argv, a path
        return UserError(f"a path holds bytes this locale cannot decode ({error}): set PYTHONUTF8=1 or a UTF-8 locale "
                         f"(LANG=C.UTF-8), or use ASCII paths")
    if "Too many open files" in str(error):  # an OSError's (EMFILE), or the DataLoader's on receiving a batch
        return RankError("this process has reached its limit of open files (ulimit -n): raise it where the job starts "
                         "(ulimit -n 65536), or use fewer -j/--workers")
    if "can't start new thread" in str(error) or isinstance(error, BlockingIOError):  # a thread's, or fork's EAGAIN
        return RankError("this process cannot start another process or thread (a limit on processes: ulimit -u, or "
                         "the pids limit of its container or job; or on memory, for a thread's stack): raise it where "
                         "the job starts, or use fewer -j/--workers")
    frames = traceback.extract_tb(error.__traceback__)
    from_folder = bool(frames) and frames[-1].filename.endswith(os.path.join("datasets", "folder.py"))  # ImageFolder
    written = getattr(error, "filename", None) or "/"  # a file of this run's output?
    if frames and frames[-1].name == "write_epoch":  # metrics.jsonl's write, which names no file (a disk full)
        written = os.path.join(args.output_dir, "metrics.jsonl")
    written = os.path.abspath(os.fsdecode(written))
    if isinstance(error, FileNotFoundError) and from_folder:
        return UserError(f"{getattr(args, 'data', None)}: {str(error).split('. ')[0]}; every class folder (of train/ "
                         f"and val/) needs an image it can read")  # ImageFolder's words, which name no split
    if isinstance(error, TypeError) and "keyword argument 'dropout'" in str(error):  # build_model's, with --dropout
        return UserError(f"--arch {getattr(args, 'arch', None)} does not take --dropout ({error}): drop it")
    if "Expected more than 1 value per channel when training" in str(error):  # BatchNorm's, on every rank alike
        got = str(error).split("got ")[-1]
        return UserError(f"a BatchNorm layer got one value per channel in a training step ({got}): give each "
                         f"process's (micro-)batch 2 or more samples (a larger -b/--batch-size), or larger inputs")
    if isinstance(error, OSError) and written.startswith(os.path.abspath(getattr(args, "output_dir", "/")) + os.sep):
        return RankError(f"cannot write {written} ({error.strerror}): give --output-dir a folder where this "
                         f"run's files (checkpoints, metrics.jsonl, tb/) can be written")
    if type(error).__name__ == "DistStoreError":  # a peer that never came to the rendezvous
        return UserError(f"not every rank joined the process group within --dist-timeout "
                         f"{getattr(args, 'dist_timeout', 0):g}s: a rank elsewhere may have stopped (see the output "
                         f"of every node), or was never started")
    # a loader worker killed is the cause, whichever error surfaced first (a batch cut short, a pipe or a socket
    # closed, a message garbled: one killed while it hands over a batch fails the read a moment before it can be
    # waited for): after an error of the transport's (OSError, EOFError, or one raised in multiprocessing's code)
    transport = isinstance(error, (OSError, EOFError)) or "multiprocessing" in (frames[-1].filename if frames else "")
    try:
        for pause in [0] + [0.05] * (20 if transport else 0):
            time.sleep(pause)
            torch.utils.data._utils.signal_handling._error_if_any_worker_fails()
    except RuntimeError as killed:
        error = killed
    cause = error
    for _ in range(8):  # a worker's death met while waiting for a batch: "exited unexpectedly", from the signal's
        if "killed by signal: " in str(cause):  # error (SIGCHLD's) when that came first; the signal says more
            error = cause
            break
        cause = cause.__cause__ or cause.__context__
        if cause is None:
            break
    if not isinstance(error, RuntimeError):
        return error
    text = str(error).strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()] or [type(error).__name__]
    if "DataLoader worker (pid" in text:  # torch/utils/data: "(pid 42) is killed by signal: Killed." and others
        pids = text.split("DataLoader worker (pid", 1)[1].removeprefix("(s)").split(")", 1)[0].strip()
        signal_name = text.split("killed by signal: ", 1)[1].split(".")[0] if "killed by signal: " in text else None
        what = f"a data loader worker (pid {pids})"
        if signal_name == "Killed":
            return RankError(f"{what} was killed (signal: Killed), most likely by the out-of-memory killer: use "
                             f"fewer -j/--workers, or give the job more memory")
        if signal_name == "Bus error":
            return RankError(f"{what} was killed (signal: Bus error), most likely out of shared memory: give the job "
                             f"more (/dev/shm; docker run --shm-size), or use fewer -j/--workers")
        ended = f"was killed (signal: {signal_name})" if signal_name else "exited unexpectedly"
        return RankError(f"{what} {ended}: if the out-of-memory killer ended it (dmesg says so), use fewer "
                         f"-j/--workers or give the job more memory; otherwise -j 0 shows the error in the training "
                         f"process")
    if isinstance(error, torch.OutOfMemoryError) or "can't allocate memory" in text:  # the GPU's, the CPU's
        sizes = [part.split(": ")[-1] for part in lines[-1].split(". ") if "to allocate" in part or " is free" in part]
        accumulate = " (--grad-accum-steps K: the same global batch in K passes)" * hasattr(args, "grad_accum_steps")
        return RankError(f"out of memory on this rank ({'; '.join(sizes)[:160]}): use a smaller -b/--batch-size"
                         + accumulate)
    if "Expected to have finished reduction in the prior iteration" in text:  # DDP's words
        return UserError("the model has parameters that get no gradient in a training step, and DDP waits for every "
                         "one: make the loss use them, drop them from the model, or freeze them (requires_grad=False)")
    if "DDP expects same model across all ranks" in text:  # DDP's words
        return UserError(f"the ranks built different models ({lines[-1][:120]}): build_model must build the same one "
                         f"on every rank")
    if any(words in text for words in MIXED_DTYPES):
        return UserError(f"the model and its inputs differ in dtype or device ({lines[-1][:120]}): give them one dtype "
                         f"(model.float() in build_model, or the data's tensors .float()), and keep the model's "
                         f"tensors in parameters or buffers, which move to the device with it")
    specific = [line for line in lines if not line.startswith(("nccl", "Last error"))] or lines  # not NCCL's glosses
    line = next((line for line in lines if any(words in line.lower() for words in PEER_GONE)), specific[-1])
    if line.startswith("NCCL error in:"):  # NCCL error in: FILE:LINE, what happened, NCCL version X
        line = line.split(", ", 1)[-1]
    detail = line.split("] ")[-1].split(". ")[0].rstrip(".")[:120]  # without gloo's source location
    lowered, timeout = text.lower(), f"--dist-timeout {getattr(args, 'dist_timeout', 1800):g}s"  # DataParallel: none
    if "trying to connect to" in lowered:  # the rendezvous store, never reached
        return RankError(f"cannot reach the rendezvous store within {timeout} ({detail}): start the node of rank 0 "
                         f"first, and check that its address and port can be reached from here")
    if any(words in lowered for words in ("timed out", "timeout", "timing out")):
        return RankError(f"a rank stopped answering: this one waited {timeout} for it "
                         f"({detail}); find the stuck process (py-spy dump --pid PID shows where it is), and lower "
                         f"--dist-timeout to notice sooner")
    if "horovod has been shut down" in lowered:  # its background loop stopped: a peer ended, or timed out
        return RankError(f"a peer ended or stopped answering within {timeout}, so this "
                         f"rank stops too ({detail}): Horovod's first error above says which; the error line of the "
                         f"rank that ended first says why")
    if any(words in lowered for words in PEER_GONE):
        return RankError(f"a peer ended, so this rank stops too ({detail}): the error line of the rank that ended "
                         f"first says why; with none, it was killed (the launcher names the signal; SIGKILL: often "
                         f"the out-of-memory killer)")
    if "nccl" in lowered:  # no peer lost: the cause is this rank's
        hints = {("out of memory", "calloc"): "the GPU is out of memory: use a smaller -b/--batch-size",
                 ("shared memory", "/dev/shm"): "too little shared memory (/dev/shm): give the job more (docker run "
                                                "--shm-size), or set NCCL_SHM_DISABLE=1",
                 ("invalid usage", "invalid argument"): "a bug, or ranks that disagree (two on a GPU, other calls)"}
        hint = next((hint for words, hint in hints.items() if any(w in lowered for w in words)),
                    "NCCL_DEBUG=INFO shows why")
        return RankError(f"NCCL failed on this rank ({detail}): {hint}")
    return error


def safety_net(main_worker):
    """main_worker, with Ctrl-C caught (catch_ctrl_c) and any failure on a rank made one line (explain_failure)."""
    def guarded(args, local_index=None):
        catch_ctrl_c()
        try:
            return main_worker(args, local_index)
        except Exception as e:
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # stopping: DataLoader's handler would raise a dead worker
            if catch_ctrl_c.pressed:  # a peer that the same Ctrl-C stopped first: no failure
                raise KeyboardInterrupt from None
            if type(e).__module__.startswith("horovod"):  # its thread logs why as it dies, in pieces: the error line
                sys.stderr.reconfigure(line_buffering=False, write_through=False)  # goes out in one write (print's
                sys.stderr.write("\n")  # flush), after a newline: a line of its own
            raise explain_failure(e, args) from None
        finally:
            with contextlib.suppress(AttributeError):  # the output folder's lock, if this rank took it: the run is over
                claim_output_dir.lock.close()
    return guarded


def catch_ctrl_c():
    """Ctrl-C reaches every process of a job at once: the first SIGINT stops this one where it is (main turns the
    KeyboardInterrupt into exit_ctrl_c), later ones cannot cut its cleanup short, and a peer that stopped first is
    no failure (catch_ctrl_c.pressed). Not where SIGINT was ignored at start (nohup, a background job)."""
    def pressed(signum, frame):
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        catch_ctrl_c.pressed = True
        raise KeyboardInterrupt

    catch_ctrl_c.pressed = False
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, pressed)


def exit_ctrl_c(reporter):
    """Exit code 130 (a shell's for Ctrl-C), one line from the reporting rank instead of every process's traceback."""
    if reporter:
        print("stopped by Ctrl-C, without saving: --resume auto continues from the last checkpoint (SIGTERM or "
              "SIGUSR1 stop a run after saving where it is)", file=sys.stderr, flush=True)
    sys.exit(130)


def claim_output_dir(args, rank, log):
    """Rank 0 of a training run locks --output-dir until it ends (lockf: a killed run holds it no more), so that a
    second run given it stops at once. The lock file stays open (locked) until exit closes it."""
    if rank != 0 or args.evaluate or getattr(args, "benchmark", 0):
        return
    path = os.path.join(args.output_dir, "run.lock")
    files = [os.path.join(args.output_dir, name + tmp) for name in (CHECKPOINT, "model_best.pth.tar", "metrics.jsonl",
                                                                    "run.lock") for tmp in ("", ".tmp")]
    odd = next((file for file in files if os.path.exists(file) and not os.path.isfile(file)
                and not (os.path.isdir(file) and os.path.islink(file))), None)  # (fsdp's checkpoint: a folder's link)
    if odd:
        what = "a folder" if os.path.isdir(odd) else "not a file (a pipe, a device)"
        raise UserError(f"{odd} is {what}, where this run writes a file: move it away, or give another --output-dir")
    try:
        os.makedirs(args.output_dir, exist_ok=True)
        lock = open(path, "a+")
    except OSError as e:
        what = "a file of that name is in the way" if isinstance(e, FileExistsError) else e.strerror
        raise UserError(f"--output-dir {args.output_dir} cannot be used ({what}): give a folder this user can "
                        f"write to") from None
    try:
        fcntl.lockf(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except (BlockingIOError, PermissionError):
        lock.seek(0)
        holder = lock.read().strip() or "a process on another node"
        lock.close()
        raise UserError(f"--output-dir {args.output_dir} is in use by another run ({holder}): give another "
                        f"--output-dir, or wait for that run to end") from None
    except OSError as e:  # a filesystem without locks
        log(f"note: cannot lock --output-dir {args.output_dir} ({e.strerror}); make sure no other run uses it")
    resumed = resume_path(args)
    for name in ("checkpoint.pth.tar", "checkpoint.dcp"):  # this script's, or a sibling's: they share model_best
        theirs = os.path.join(args.output_dir, name)
        if os.path.lexists(theirs) and not (resumed and os.path.realpath(resumed) == os.path.realpath(theirs)):
            raise UserError(f"--output-dir {args.output_dir} holds the checkpoint of an earlier run ({name}), which "
                            f"this one would overwrite: continue that run with --resume auto (by the script that "
                            f"saved it), or give another --output-dir")
    lock.truncate(0)
    lock.write(f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    lock.flush()
    claim_output_dir.lock = lock  # held until the run ends (safety_net closes it)


# the safety net wraps these: deleted with it, each is what part 1 says
UserError.__str__ = one_line
in_range = check_range  # noqa: F811 (parse_args calls the checked one)
main_worker = safety_net(main_worker)
save_checkpoint = explain_failed_save(save_checkpoint)
read_volume = explain_unreadable_volume(read_volume)
read_checkpoint = explain_unreadable(read_checkpoint)
RunState.load_state_dict = explain_damaged(RunState.load_state_dict)
DevicePrefetcher.__iter__ = explain_short_loader(DevicePrefetcher.__iter__)
# endregion [safety]


if __name__ == "__main__":
    main()
