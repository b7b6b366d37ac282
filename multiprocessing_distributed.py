r"""ImageNet training with DistributedDataParallel, one process per GPU, started by torch.multiprocessing.spawn.

No launcher: `python` starts one process, which checks the command line, picks a rendezvous port and
spawns one worker per GPU (or --nprocs on CPU), each running main_worker(args, local_index).

    # one node, all visible GPUs (or e.g. --gpus 0,2,5)
    python multiprocessing_distributed.py /data/imagenet
    # two nodes (run on each, R = 0 or 1; HOST:PORT = a free port on node 0)
    python multiprocessing_distributed.py --dist-url tcp://HOST:PORT --world-size 2 --node-rank R /data/imagenet
    # CPU demo, 2 processes, no dataset needed (gloo backend)
    python multiprocessing_distributed.py --nprocs 2 --dummy --crop-size 64 -b 64 --epochs 3

What differs from distributed.py: rank = node_rank x procs_per_node + local_rank comes from the command
line, not torchrun's environment; the process group always starts, at a TCP store that node 0's parent
serves on --dist-url (it counts arriving ranks); and the parent, not torchrun, stops every worker when
one fails or on Ctrl-C, and forwards SIGTERM / SIGUSR1 to them. -b is the global batch: each of W
processes gets b = B / W.

Read it top to bottom, in three parts: the lesson, which every copier keeps (the command line, build_model and
build_datasets, the two functions to edit, the launcher part, the training flow main -> main_worker -> train_one_epoch /
evaluate, what every run needs); optional features, a block each; the safety net. Every block lies between a line
`# region [NAME]` and a line `# endregion [NAME]`, and every line elsewhere that exists only for it ends with the
comment `# [NAME]` (`# [a] [b]`: for a and for b). Delete a block and its tagged lines, nothing else, and the rest runs;
delete every block for the core. For the block ema (README: Copy only what you need):

    sed -E -i '/^ *# region \[ema\]/,/^ *# endregion \[ema\]/d; /#( \[[a-z0-9-]+\])* \[ema\]( \[[a-z0-9-]+\])*$/d' FILE
"""
import argparse
import atexit  # [logs]
import contextlib
import copy  # [ema]
import ctypes  # [preemption]
import datetime
import functools
import gc
import fcntl  # [safety]
import hashlib  # [safety]
import importlib  # [spec]
import inspect  # [sync-bn]
import json  # [logs]
import math  # [lr-schedule]
import multiprocessing  # [preemption]
import os
import random
import resource  # [benchmark]
import shutil
import signal
import socket  # [safety]
import sys
import threading  # [logs]
import time
import traceback
import urllib.parse

# torch missing, a torchvision for another torch (no torchvision::nms), TORCH_LOGS=bogus, a cache folder  # [safety]
try:  # [safety]
    import torchvision  # [safety]
except Exception as e:  # [safety]
    fix = "install torch and the torchvision made for it (pip install -U torch torchvision)"  # [safety]
    if isinstance(e, ValueError) or getattr(e, "filename", None):  # [safety]
        fix = "fix what it names: a TORCH variable (env | grep TORCH), or TORCHINDUCTOR_CACHE_DIR"  # [safety]
    print(f"error: cannot import torchvision ({' '.join(str(e).split())[:200]}): {fix}", file=sys.stderr)  # [safety]
    sys.exit(2)  # [safety]
except KeyboardInterrupt:  # [safety]
    sys.exit(130)  # [safety]
import torch
import torch.distributed as dist
import torch._dynamo  # noqa: F401 (import before any process group, or it keeps the group alive and exit aborts)
import torch.multiprocessing as mp
import torch.nn.functional as F
import torchvision
from PIL import Image, ImageOps
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present  # [foreign-weights]
from torch.nn.parallel import DistributedDataParallel
from torch.optim import swa_utils  # [ema]
from torch.utils.data import DataLoader, Dataset, DistributedSampler, default_collate
from torchvision.transforms import v2


# =============================================================================================
# Part 1, the lesson, what every copier keeps: command line, the two seams, launcher part, training flow, needs.
# =============================================================================================
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.error = argument_error  # [safety]
    add = p.add_argument
    add("data", nargs="?", metavar="DIR",
        help="ImageFolder root with train/ and val/ (not needed with --dummy; with --dataset, its function's)")
    add("--dataset", default=None, metavar="MODULE:FUNCTION",  # [spec]
        help="your own data: FUNCTION(args) returns (train_set, val_set) (README: Your own data and model)")  # [spec]
    add("--dummy", action="store_true", help="train on a synthetic, learnable dataset instead of DIR")  # [dummy]
    add("--dummy-size", type=in_range(int, 1, below=10**7), default=1280, metavar="N",  # [dummy]
        help="--dummy's training images (an epoch's order is a list in memory: fewer than 10**7)")  # [dummy]
    add("-a", "--arch", default="resnet18", metavar="ARCH",
        help="any torchvision classification model, or your own: MODULE:FUNCTION, called FUNCTION(num_classes=N)")
    add("--pretrained", action="store_true", help="start from the model's default torchvision weights")  # [pretrained]
    add("--dropout", type=in_range(float, 0, below=1), default=None, help="for models that take one (0: off)")
    add("--num-classes", type=in_range(int, 2), default=None, metavar="N", help="default: the train set's")
    add("-j", "--workers", type=in_range(int, 0, below=256), default=4, help="loader processes per training process")
    add("--epochs", type=in_range(int, 0), default=90)
    add("-b", "--batch-size", type=in_range(int, 1), default=256, help="global batch, divided over the processes")
    add("--opt", choices=("sgd", "adamw"), default="sgd", help="SGD with momentum, or AdamW")
    add("--lr", type=in_range(float, 0), default=None, help="for the global batch (default: SGD 0.1, AdamW 0.001)")
    add("--momentum", type=in_range(float, 0, below=1), default=0.9, help="SGD's momentum")
    add("--wd", "--weight-decay", type=in_range(float, 0), default=1e-4, dest="weight_decay")
    add("--no-wd-norm-bias", action="store_true", help="no weight decay on normalization layers and biases")  # [no-wd]
    add("--lr-schedule", choices=("step", "cosine"), default="step", help="decay, per step")  # [lr-schedule]
    add("--lr-step", type=in_range(int, 1), default=30, help="epochs between step decays (/10)")
    add("--warmup-epochs", type=in_range(float, 0), default=0.0, help="linear, from 0 to --lr")  # [lr-schedule]
    add("--crop-size", type=in_range(int, 1), default=224)
    add("--val-resize", type=in_range(int, 1), default=None,
        help="validation images are resized to this, then center-cropped (default: --crop-size x 8/7, 256 for 224)")
    add("--amp", choices=("none", "fp16", "bf16"), default="none", help="autocast dtype; fp16 scales the loss")
    add("--channels-last", action="store_true")
    add("--gpu-decode", action="store_true", help="decode (nvJPEG) and crop JPEGs on the GPU")  # [gpu-decode]
    add("--sync-bn", action="store_true", help="SyncBatchNorm across processes (CUDA only)")  # [sync-bn]
    add("--no-tf32", action="store_true", help="full fp32 matmuls and convolutions, not TF32")  # [tf32]
    add("--compile", action="store_true", help="torch.compile the model that trains (the wrapped one)")  # [compile]
    add("--grad-accum-steps", type=in_range(int, 1), default=1, metavar="K",
        help="split each process's batch into K micro-batches, all-reduced once per optimizer step (less memory)")
    add("--label-smoothing", type=in_range(float, 0, below=1), default=0.0, help="in the training loss only")
    add("--clip-grad-norm", type=in_range(float, above=0), metavar="X", help="max gradient norm")  # [clip-grad-norm]
    add("--model-ema", action="store_true", help="an exponential moving average of the weights, evaluated too")  # [ema]
    add("--model-ema-decay", type=in_range(float, 0, below=1), metavar="D", help="default 0.9998")  # [ema]
    add("--model-ema-steps", type=in_range(int, 1), metavar="N", help="optimizer steps between updates (1)")  # [ema]
    add("--profile", type=in_range(int, 1), metavar="STEPS",  # [profile]
        help="torch.profiler over STEPS training steps after warm-up: a trace, where the step time went")  # [profile]
    add("--profile-all-ranks", action="store_true", help="with --profile: all ranks trace")  # [profile]
    add("--resume", default="", metavar="PATH|auto", help="checkpoint to resume from; auto: the one in --output-dir")
    add("-e", "--evaluate", action="store_true", help="evaluate the model (e.g. with --resume) and exit")
    add("--output-dir", default="output", help="checkpoints, metrics.jsonl and tb/")
    add("--seed", type=in_range(int, 0), default=0, help="same seed, same data and world-size-independent results")
    add("--deterministic", action="store_true", help="use deterministic algorithms (slower)")  # [deterministic]
    add("-p", "--print-freq", type=in_range(int, 1), default=10, help="steps between progress lines")
    add("--benchmark", type=in_range(int, 0), default=0, metavar="N",  # [benchmark]
        help="train N steps on synthetic batches on the device (no data loading), print img/s, exit")  # [benchmark]
    add("--dist-backend", default=None, help="default: nccl with CUDA, else gloo")
    add("--dist-timeout", type=in_range(float, 1, below=1e9), default=1800, help="seconds a collective waits on a peer")
    add("--dist-url", default=None, metavar="tcp://HOST:PORT",
        help="rendezvous on node 0 (default: a free local port; needed with --world-size > 1)")
    add("--world-size", type=in_range(int, 1), default=1, help="number of nodes")
    add("--node-rank", "--rank", type=in_range(int, 0), default=0, help="this node's index, 0 to --world-size - 1")
    add("--nprocs", type=in_range(int, 1), default=None, help="processes on this node (default: one per GPU, 1 on CPU)")
    add("--gpus", "--gpu", default=None, metavar="IDS", help="comma-separated GPU ids, e.g. 0,2,5 (default: all)")
    add("--multiprocessing-distributed", action="store_true", help=argparse.SUPPRESS)  # pytorch/examples': always
    add_foreign_flags(p)  # [safety]
    args = p.parse_args(argv)
    args.val_resize = args.val_resize or round(args.crop_size * 8 / 7)
    args.lr = {"sgd": 0.1, "adamw": 0.001}[args.opt] if args.lr is None else args.lr
    args.dummy = args.dummy or (args.benchmark > 0 and not (args.dataset or args.data))  # [dummy] [benchmark] [spec]
    check_args(args)  # [safety]
    args.model_ema_decay = 0.9998 if args.model_ema_decay is None else args.model_ema_decay  # [ema]
    args.model_ema_steps = args.model_ema_steps or 1  # [ema]
    return args


def check_launch(args):
    """In the parent, before any worker starts: which GPUs, how many processes, where to meet. On node
    0 it returns the store the workers meet at, which must live as long as they do."""
    check_spawn_args(args)  # [safety]
    args.gpus = select_gpus(args)
    if args.gpus:
        args.nprocs = args.nprocs or len(args.gpus)
        if args.nprocs > len(args.gpus):  # [safety]
            raise UserError(f"--nprocs {args.nprocs} but {len(args.gpus)} GPUs: one process per GPU, "  # [safety]
                            f"use --nprocs {len(args.gpus)}")  # [safety]
    args.nprocs = args.nprocs or 1
    check_batch(args, args.nprocs * args.world_size)  # [safety]
    url = urllib.parse.urlparse(args.dist_url or "tcp://127.0.0.1:0")
    if args.node_rank != 0:
        return None
    # node 0's parent serves the store the workers meet at; port 0: a free one, so two jobs never collide
    try:
        store = dist.TCPStore(url.hostname, url.port, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=args.dist_timeout))
    except dist.DistError as e:
        raise UserError(f"--dist-url {args.dist_url}: cannot listen on port {url.port} "
                        f"({str(e).splitlines()[0].split('message: ')[-1]}); another job may use it: choose a "
                        f"free port, or leave --dist-url out on a single node") from None
    args.dist_url = f"tcp://{url.netloc.rpartition(':')[0]}:{store.port}"  # the host as given: [::1] keeps its brackets
    return store


def select_gpus(args):
    """The GPU ids to use: --gpus, else all visible ones; None on CPU."""
    check_gpus(args)  # [safety]
    if not torch.cuda.is_available():
        return None
    return [int(i) for i in args.gpus.split(",")] if args.gpus is not None else list(range(torch.cuda.device_count()))


def build_model(args, num_classes, load_weights=True):
    """Your model (edit this, and build_datasets for your data): an nn.Module from a batch of inputs on the device
    (images as normalized floats) to num_classes logits. load_weights=False: no --pretrained weights (check_model)."""
    options = {"num_classes": num_classes, **({} if args.dropout is None else {"dropout": args.dropout})}
    if ":" in args.arch:  # [spec]
        model = call_spec(args.arch, "--arch", **options)  # [spec]
        if not isinstance(model, torch.nn.Module):  # [spec]
            raise UserError(f"--arch {args.arch} returned a {type(model).__name__}, not a torch.nn.Module")  # [spec]
        return model  # [spec]
    if args.arch in ("googlenet", "inception_v3"):
        # without their auxiliary classifiers, which training returns too. Their weights expect inputs scaled to
        # [-1, 1]: always so, that a run resumed or evaluated without --pretrained scales its input alike
        options.update(aux_logits=False, init_weights=True, transform_input=True)
    if args.pretrained and args.arch.startswith("vit_"):  # [pretrained]
        weights = torchvision.models.get_model_weights(args.arch).DEFAULT  # [pretrained]
        options["image_size"] = weights.meta["min_size"][0]  # [pretrained]
    model = torchvision.models.get_model(args.arch, **options)
    if args.pretrained and load_weights:  # [pretrained]
        load_pretrained(model, args)  # [pretrained]
    return model


def build_datasets(args):
    """Your data (edit this, and build_model for your model): (train set, validation set) of (input, label) items. A
    label is an integer from 0 to N-1 (N: --num-classes, else the train set's num_classes or len(classes)); an input a
    uint8 CxHxW image (RGB, gray, or the channels of the set's mean and std), or any other tensor, moved as it is."""
    train_tf = v2.Compose([v2.RandomResizedCrop(args.crop_size, antialias=True), v2.RandomHorizontalFlip()])
    train_tf = RandomResizedCropFlip(args.crop_size)  # [fast-crop]
    val_tf = v2.Compose([v2.Resize(args.val_resize, antialias=True), v2.CenterCrop(args.crop_size)])
    if args.dataset:  # [spec]
        sets = call_spec(args.dataset, "--dataset", args)  # [spec]
        if isinstance(sets, (tuple, list)) and len(sets) == 2:  # [spec]
            mapped = [hasattr(data, "__len__") and hasattr(data, "__getitem__") for data in sets]  # [spec]
            sets = [ImageCrops(data, tf) if wrap else data  # [spec]
                    for data, tf, wrap in zip(sets, (train_tf, val_tf), mapped)]  # [spec]
        return sets  # [spec]
    if args.dummy:  # [dummy]
        return (SyntheticImages(args.dummy_size, 10, args.val_resize, train_tf),  # [dummy]
                SyntheticImages(max(args.dummy_size // 4, 1), 10, args.val_resize, val_tf, offset=10**9))  # [dummy]
    check_image_folder(args.data)  # [safety]
    return [torchvision.datasets.ImageFolder(os.path.join(args.data, split), tf, loader=load_image)
            for split, tf in (("train", train_tf), ("val", val_tf))]


# =============================================================================================
# The launcher part: spawn, the process group, DDP. Every sibling has its own (README: How every script reads).
# =============================================================================================
def find_processes(args, local_index):
    """(rank, local_rank, world_size, device) of this process: from the command line, nodes x processes per
    node. local_index: the process's index on its node, where the script starts the processes itself."""
    rank, world_size = args.node_rank * args.nprocs + local_index, args.world_size * args.nprocs
    die_with_parent(signal.SIGKILL)  # [preemption]
    if not torch.cuda.is_available():
        return rank, local_index, world_size, torch.device("cpu")
    torch.cuda.set_device(args.gpus[local_index])  # before anything touches CUDA, or every rank crowds GPU 0
    return rank, local_index, world_size, torch.device("cuda", args.gpus[local_index])


def start_process_group(args, rank, world_size, device, log):
    """Starts the process group at the store of node 0's parent, once every rank has counted itself in (or fails
    after --dist-timeout saying how many did); returns the CPU group for preemption."""
    url = urllib.parse.urlparse(args.dist_url)
    timeout = datetime.timedelta(seconds=args.dist_timeout)
    try:
        store = dist.TCPStore(url.hostname, url.port, world_size, is_master=False, timeout=timeout)
    except dist.DistError as e:
        raise UserError(f"--dist-url {args.dist_url}: cannot reach node 0 within --dist-timeout "
                        f"{args.dist_timeout:g}s ({str(e).splitlines()[0]}); start node 0 first, and check the "
                        f"address and port") from None
    arrived, deadline = store.add("arrived", 1), time.monotonic() + args.dist_timeout
    while arrived < world_size:
        if time.monotonic() > deadline:
            raise UserError(f"only {arrived} of {world_size} ranks arrived at {args.dist_url} within --dist-timeout "
                            f"{args.dist_timeout:g}s: start every node (--node-rank 0 to {args.world_size - 1}) "
                            f"with the same --dist-url and --world-size {args.world_size}")
        time.sleep(0.1)
        arrived = store.add("arrived", 0)
    group = join_process_group(args, store, rank, world_size, device)
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
    """How this run is spread, for the first line of the log."""
    return (f"world size {world_size}, device {device.type}, backend {dist.get_backend() if group else 'none'}, "
            f"global batch {args.batch_size} = {world_size} x {args.batch_size // world_size}")


def prepare_model(model, args, device, log):
    """The model on this process's device, its 4-D weights channels-last with --channels-last."""
    model = sync_batchnorm(model, args, device, log)  # [sync-bn]
    for p in model.parameters() if args.channels_last else ():  # (module.to would refuse a Conv3d's 5-D weights)
        p.data = p.data.contiguous(memory_format=torch.channels_last) if p.dim() == 4 else p.data
    return model.to(device)


def build_optimizer(model, args, device, log):
    """--opt: SGD with momentum, or AdamW, fused on every device (GradScaler's inf check stays there); foreach SGD for
    FSDP's DTensors. Momentum starts as zeros: fused SGD's own, made at a first step GradScaler skips, is unfilled."""
    groups = [{"params": list(model.parameters()), "weight_decay": args.weight_decay}]
    groups = param_groups(model, args) if args.no_wd_norm_bias else groups  # [no-wd]
    if args.opt == "adamw":
        return torch.optim.AdamW(groups, lr=args.lr, fused=True)
    params = [p for group in groups for p in group["params"]]
    foreach = any(hasattr(p, "full_tensor") for p in params)
    optimizer = torch.optim.SGD(groups, lr=args.lr, momentum=args.momentum, fused=not foreach, foreach=foreach or None)
    for p in params if args.momentum else ():
        optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p)
    return optimizer


def setup_precision(model, optimizer, args, device, log):
    """(autocast dtype or None, GradScaler) for --amp; the scaler scales the loss for fp16 only."""
    amp_dtype = {"none": None, "fp16": torch.float16, "bf16": torch.bfloat16}[args.amp]
    return amp_dtype, torch.amp.GradScaler(device.type, enabled=args.amp == "fp16")


def wrap_model(model, args, device, amp_dtype):
    """(the model that trains, the model that evaluates). DDP all-reduces the gradients in backward(); evaluation,
    where ranks may have one batch more or less, must call no collective: it evaluates the plain model."""
    if not dist.is_initialized():
        return model, model
    options = {"device_ids": [device.index] if device.type == "cuda" else None}
    options.update(ddp_buffer_options(model))  # [sync-bn]
    return DistributedDataParallel(model, **options), model


def train_step(run, images, target, args):
    """One optimizer step on this process's batch, in --grad-accum-steps micro-batches (DDP all-reduces in the last
    one's backward only). Returns the loss summed over the batch, the outputs, and 1 if --clip-grad-norm clipped."""
    no_sync = getattr(run.train_model, "no_sync", contextlib.nullcontext)  # one process: nothing to hold back
    chunks, loss_sum, outputs, clipped = args.grad_accum_steps, 0, [], 0
    run.optimizer.zero_grad()  # frees the gradients (set_to_none, torch 2's default; Horovod's takes no arguments)
    for i, (images_part, target_part) in enumerate(zip(images.chunk(chunks), target.chunk(chunks))):
        with no_sync() if i < chunks - 1 else contextlib.nullcontext():
            with torch.autocast(images.device.type, dtype=run.amp_dtype, enabled=run.amp_dtype is not None):
                output = run.train_model(images_part)
                loss = F.cross_entropy(output, target_part, label_smoothing=args.label_smoothing)
            run.scaler.scale(loss / chunks).backward()  # fp16: the loss scaled up, so that no gradient underflows
        loss_sum = loss_sum + loss.detach().float() * target_part.numel()
        outputs.append(output.detach().float())
    if args.clip_grad_norm:  # [clip-grad-norm]
        clipped = clip_gradients(run, args)  # [clip-grad-norm]
    run.scaler.step(run.optimizer)  # unscales (unless clipping did), and skips the step if a gradient is inf/NaN
    run.scaler.update()
    run.scheduler.step()
    if run.ema:  # [ema]
        run.ema.update(run.model, run.scheduler.last_epoch)  # [ema]
    return loss_sum, torch.cat(outputs), clipped


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
    try:
        args = parse_args()
        store = check_launch(args)  # noqa: F841 (node 0 serves the rendezvous while the workers run)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    workers = mp.spawn(worker, args=(args,), nprocs=args.nprocs, join=False)
    sys.exit(supervise(workers))


def supervise(workers):
    """Waits for the workers. SIGTERM / SIGUSR1 / SIGHUP are passed on to them (preemption); when one fails the
    others get a grace period, then are terminated; Ctrl-C stops them all. Returns the exit code."""
    def forward(signum, frame):
        for p in workers.processes:
            if p.is_alive():
                os.kill(p.pid, signum)

    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP):
        if sig != signal.SIGHUP or signal.getsignal(sig) is not signal.SIG_IGN:  # nohup's SIGHUP stays ignored
            signal.signal(sig, forward)
    try:
        while not workers.join(grace_period=10):
            pass
        return 0
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C pressed again cannot cut the wait for the workers short
        forward(signal.SIGINT, None)
        for p in workers.processes:
            p.join(10)
            if p.is_alive():
                p.kill()
        return 130
    except (mp.ProcessExitedException, mp.ProcessRaisedException) as e:
        # every worker reports its own failure (worker()): one line (exit code 2), or a bug's traceback (1); the
        # first to fail is the cause, and its code the job's. Only one killed by a signal cannot say it
        if isinstance(e, mp.ProcessExitedException) and e.exit_code > 0:
            return e.exit_code
        if getattr(e, "signal_name", None) in ("SIGTERM", "SIGINT", "SIGHUP"):  # stopped from outside: not the cause
            return 1
        what = (f"failed: {e.msg.strip().splitlines()[-1]}" if isinstance(e, mp.ProcessRaisedException)
                else f"terminated with signal {e.signal_name}")
        if getattr(e, "signal_name", None) == "SIGKILL":
            what += " (often the out-of-memory killer: give the job more memory, or lower -b or -j/--workers)"
        print(f"error: worker {e.error_index} on this node {what}", file=sys.stderr, flush=True)
        return 1


def worker(local_index, args):
    """What each spawned process runs (a top-level function, so that spawn can import it)."""
    try:
        sys.exit(main_worker(args, local_index))  # None (0): finished
    except UserError as e:  # [safety]
        exit_bad_input(e, reporter=local_index == 0)  # [safety]
    except KeyboardInterrupt:  # [safety]
        exit_ctrl_c(reporter=local_index == 0)  # [safety]
    except Exception:  # a bug: its traceback, here (spawn would hand it to the parent, which sees one failure only)
        traceback.print_exc()
        sys.exit(1)
    finally:
        end_process_group()  # left to interpreter exit, a gloo thread can abort the process
        end_loader_workers()  # [preemption]


def main_worker(args, local_index=None):
    """One training process, from finding its peers to its last checkpoint; returns None, or PREEMPTED if stopped."""
    torch.backends.cudnn.benchmark = True  # cuDNN times its kernels for each new input shape, keeps the fastest
    set_deterministic(args)  # [deterministic]
    rank, local_rank, world_size, device = find_processes(args, local_index)
    log = (lambda *text: print(*text, flush=True)) if rank == 0 else (lambda *text: None)
    log = print_or_drop if rank == 0 else log  # [preemption]
    preemption = Preemption()  # [preemption]

    sets = build_datasets(args)
    check_run(args, world_size, device, sets)  # [safety]
    train_set, val_set = sets
    num_classes = args.num_classes or class_count(train_set)
    # the loaders fork their workers now: before the process group's threads start (fork_loader_workers says why),
    # and before the model and the checkpoint are read, whose memory every worker would keep for the whole run
    train_sampler, train_batches, val_batches = build_loaders(args, sets, num_classes, rank, world_size, device)
    ckpt_path = resume_path(args)
    ckpt = load_checkpoint(ckpt_path) if ckpt_path else None
    check_fit(ckpt_path, ckpt, sets, args)  # [safety]
    claim_output_dir(args, rank, log)  # [safety]
    set_seed(args.seed)
    model = build_model(args, num_classes)  # the same initial weights on every rank
    set_seed(args.seed + rank)  # but each rank its own dropout draws
    preemption.catch(False)  # [preemption]
    ctrl_c = signal.getsignal(signal.SIGINT)  # no handler runs while it waits for its peers: Ctrl-C ends the wait
    signal.signal(signal.SIGINT, signal.SIG_IGN if ctrl_c is signal.SIG_IGN else signal.SIG_DFL)
    group = start_process_group(args, rank, world_size, device, log)
    signal.signal(signal.SIGINT, ctrl_c)
    preemption.group = group  # [preemption]
    preemption.catch(True)  # [preemption]
    check_ranks_agree(args, sets, ckpt)  # [safety]
    data = f"{num_classes} classes, {len(train_set)} train / {len(val_set)} val samples"
    if getattr(train_set, "loader", None) is load_image:  # [fast-decode]
        data += f", JPEGs decoded by {JPEG_DECODER}"  # [fast-decode]
    log(f"{os.path.basename(__file__)}: {describe_processes(args, world_size, device, group)}, {args.arch}, {data}")
    set_tf32(args, device, log)  # [tf32]

    model = prepare_model(model, args, device, log)
    ema = ModelEMA(model, args) if args.model_ema else None  # [ema]
    optimizer = build_optimizer(model, args, device, log)
    amp_dtype, scaler = setup_precision(model, optimizer, args, device, log)
    steps_per_epoch = max(len(train_batches), 1)  # -e with a train set smaller than -b: no batch, no step
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, steps_per_epoch, args))
    run = RunState(model, optimizer, scheduler, scaler, amp_dtype)
    run.ema = ema  # [ema]
    run.train_samples = len(train_set)  # [safety]
    run.preemption = preemption  # [preemption]
    if ckpt:
        run.load_state_dict(ckpt, args, rank, world_size, log)
        moved = "" if args.evaluate or ckpt.get("world_size") == world_size else (  # a job resized, a node lost
            f", world size {ckpt.get('world_size')} -> {world_size}: the same samples, fresh random states")
        log(f"resumed from {ckpt_path} (epoch {ckpt.get('epoch', 0)}, step {ckpt.get('step', 0)}){moved}")
        if ckpt.get("model_ema") and not (ema or args.evaluate):  # [ema]
            log("note: the checkpoint's --model-ema average is dropped: add --model-ema to keep it")  # [ema]
        ckpt = None  # all of it is in place now: keep no second copy of the weights
    run.train_model, run.eval_model = wrap_model(model, args, device, amp_dtype)
    if args.compile:  # [compile]
        run.train_model = compile_model(run.train_model)  # [compile]
    run.profiler = StepProfiler(run, args, rank, log, steps_per_epoch)  # [profile]
    if args.benchmark:  # [benchmark]
        return benchmark(run, args, world_size, log, val_set)  # [benchmark]
    if args.evaluate:
        evaluated = {"val": run.eval_model}
        if ema:  # [ema]
            evaluated["val ema"] = ema.module  # [ema]
        for name, net in evaluated.items():
            val = evaluate(net, val_batches, amp_dtype)
            log(f"{name}: loss {val['loss']:.6f} acc1 {val['acc1']:.3f} acc5 {val['acc5']:.3f} "
                f"(correct1 {val['correct1']}, correct5 {val['correct5']}, images {val['count']})")
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
        train_seconds = time.monotonic() - started
        sync_buffers(model)
        val = evaluate(run.eval_model, val_batches, amp_dtype)
        if ema:  # [ema]
            sync_buffers(ema.module)  # [ema]
            val_ema = evaluate(ema.module, val_batches, amp_dtype)  # [ema]
            val.update({f"{key}_ema": value for key, value in val_ema.items()})  # [ema]
        is_best = val["acc1"] > run.best_acc1
        run.epoch, run.best_acc1 = epoch + 1, max(run.best_acc1, val["acc1"])
        run.save(args, rank, is_best)
        row = {"epoch": epoch, "train_loss": train["loss"], "train_acc1": train["acc1"],  # [logs]
               **{f"val_{key}": value for key, value in val.items() if key.startswith(("loss", "acc"))},  # [logs]
               "lr": optimizer.param_groups[0]["lr"], "img_per_s": train["count"] / train_seconds,  # [logs]
               **({"clipped_percent": train["clipped"]} if args.clip_grad_norm else {}),  # [logs] [clip-grad-norm]
               "seconds": time.monotonic() - started}  # [logs]
        if writer is not None:  # [logs]
            write_epoch(row, writer, args.output_dir)  # [logs]
        log(f"Epoch {epoch}: train loss {train['loss']:.4f} acc1 {train['acc1']:.2f} | val loss {val['loss']:.4f} "
            f"acc1 {val['acc1']:.2f} acc5 {val['acc5']:.2f}"
            + (f" | ema acc1 {val['acc1_ema']:.2f}" if "acc1_ema" in val else "")  # [ema]
            + (f" | clipped {train['clipped']:.0f}% of steps" if args.clip_grad_norm else "")  # [clip-grad-norm]
            + f" | {train['count'] / train_seconds:.0f} img/s")
        if run.preemption.agreed(now=True) and run.epoch < args.epochs:  # [preemption]
            return run.preemption.stop(run, args, rank, log, f"after epoch {epoch}", saved=True)  # [preemption]
    return None


class RunState:
    """What a run carries from step to step and resumes: model, optimizer, scheduler, loss scaler, epoch and step,
    best accuracy, a preempted epoch's running sums, random states. It alone writes and reads the checkpoint format."""

    def __init__(self, model, optimizer, scheduler, scaler, amp_dtype):
        self.model, self.optimizer, self.scheduler, self.scaler = model, optimizer, scheduler, scaler
        self.amp_dtype, self.train_model, self.eval_model = amp_dtype, model, model
        self.epoch, self.step, self.best_acc1, self.train_sums = 0, 0, 0.0, None
        self.ema = None  # [ema]

    def save(self, args, rank, is_best):
        """Every rank takes part (their random states are gathered); rank 0 writes."""
        rng_states = gather_rng_states()
        if rank == 0:
            save_checkpoint({
                "epoch": self.epoch, "step": self.step, "arch": args.arch,
                "state_dict": getattr(self.model, "_orig_mod", self.model).state_dict(),  # torch.compile'd: its own
                "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                "scaler": self.scaler.state_dict(), "best_acc1": self.best_acc1, "args": vars(args),
                "world_size": len(rng_states), "rng_states": rng_states, "train_sums": self.train_sums,
                "model_ema": self.ema and self.ema.module.state_dict(),  # [ema]
                "train_samples": self.train_samples,  # [safety]
            }, is_best, args.output_dir)

    def load_state_dict(self, ckpt, args, rank, world_size, log):
        """Everything back from a checkpoint (load_checkpoint's); only the weights for --evaluate."""
        getattr(self.model, "_orig_mod", self.model).load_state_dict(ckpt["state_dict"])
        if self.ema:  # [ema]
            self.ema.load(ckpt.get("model_ema"), self.model, log)  # [ema]
        if args.evaluate:
            return
        self.optimizer.load_state_dict(ckpt["optimizer"])
        self.scheduler.load_state_dict(ckpt["scheduler"])
        if ckpt["scaler"]:  # empty when saved without loss scaling: the scaler starts afresh
            self.scaler.load_state_dict(ckpt["scaler"])
        self.epoch, self.step, self.best_acc1 = ckpt["epoch"], ckpt.get("step", 0), ckpt["best_acc1"]
        self.train_sums = ckpt.get("train_sums") if rank == 0 else None  # [preemption]
        if ckpt.get("world_size") == world_size:
            set_rng_state(ckpt["rng_states"][rank])


def train_one_epoch(run, batches, args, log):
    """One pass over this rank's share of the data, from step run.step on. Returns the epoch's summary (loss,
    acc1, count), or None when every rank agreed to stop: run.step and run.train_sums then say where."""
    run.train_model.train()
    device = next(run.model.parameters()).device
    metrics = Metrics(device)
    steps_per_epoch = run.step + len(batches)
    first_bad = torch.full((), -1, device=device)  # [safety]
    last_time, last_count = time.monotonic(), 0
    if run.train_sums is not None:  # [preemption]
        metrics.sums[:len(run.train_sums)] += run.train_sums.to(device)  # [preemption]
        last_count = run.train_sums[3].item()  # [preemption]

    def report(step):
        nonlocal last_time, last_count
        s = metrics.summary()
        check_finite(s, first_bad, run.epoch)  # [safety]
        now = time.monotonic()
        text = (f"loss {s['loss']:.4f} acc1 {s['acc1']:.2f} lr {run.optimizer.param_groups[0]['lr']:.4g} "
                f"{(s['count'] - last_count) / max(now - last_time, 1e-9):.0f} img/s")
        last_time, last_count = now, s["count"]
        log(f"Epoch {run.epoch} [{step:>{len(str(steps_per_epoch))}}/{steps_per_epoch}] {text}")
        return s

    batches = run.profiler.timed(batches)  # [profile]
    for step, (images, target) in enumerate(batches, start=run.step):
        if run.preemption.agreed():  # [preemption]
            run.step, run.train_sums = step, reduce_tensor(metrics.sums).cpu()  # [preemption]
            return None  # [preemption]
        loss_sum, output, clipped = train_step(run, images, target, args)
        metrics.update(loss_sum, output, target, clipped)
        first_bad = torch.where((first_bad < 0) & ~torch.isfinite(loss_sum), step, first_bad)  # [safety]
        if (step + 1) % args.print_freq == 0 and step + 1 < steps_per_epoch:
            report(step + 1)
    summary = report(steps_per_epoch)
    run.step = 0
    run.train_sums = None  # [preemption]
    return summary


def evaluate(model, batches, amp_dtype):
    model.eval()
    device = next(model.parameters()).device
    metrics = Metrics(device)
    with torch.inference_mode(), torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
        for images, target in batches:
            output = model(images).float()
            metrics.update(F.cross_entropy(output, target, reduction="sum"), output, target)
    return metrics.summary()


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


def lr_factor(step, steps_per_epoch, args):
    """Multiplier of --lr after `step` optimizer steps: step decay, /10 every --lr-step epochs."""
    if args.lr_schedule == "cosine" or step / steps_per_epoch < args.warmup_epochs:  # [lr-schedule]
        return warmup_or_cosine(step, steps_per_epoch, args)  # [lr-schedule]
    return 0.1 ** (step // steps_per_epoch // args.lr_step)


def class_count(dataset):
    """The number of classes of a dataset: its num_classes, else the length of its classes (ImageFolder's)."""
    count = getattr(dataset, "num_classes", None)
    return len(dataset.classes) if count is None and getattr(dataset, "classes", None) is not None else count


NORMALIZE = {3: ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)), 1: ((0.449,), (0.226,))}  # ImageNet's; gray: their mean


def load_image(path):
    """The image as an RGB uint8 CxHxW tensor, decoded by PIL (JPEGs by torchcodec: decode_file)."""
    image = decode_file(path)  # [fast-decode]
    if image is not None:  # [fast-decode]
        return image  # [fast-decode]
    with Image.open(path) as img:
        ImageOps.exif_transpose(img, in_place=True)  # turned upright as its EXIF orientation says, as torchcodec does
        if img.mode.startswith("I;16"):  # 16-bit gray (convert("RGB") would clip at 255): its top 8 bits
            return (v2.functional.pil_to_tensor(img.convert("I")) >> 8).to(torch.uint8).repeat(3, 1, 1)
        if img.mode in ("I", "F"):  # [safety]
            raise ValueError(f"its 32-bit pixels (PIL mode {img.mode}) have no range to map to 8 bits")  # [safety]
        return v2.functional.pil_to_tensor(img.convert("RGB"))


def collate(samples, num_classes):
    """The loaders' collate_fn: uint8 images copied into the batch in their memory order (channels last, as decode
    and crop leave them), about 4x cheaper than transposed; the Prefetcher sets the model's format on the device."""
    check_items(samples, num_classes)  # [safety]
    if samples[0][0].dtype != torch.uint8:
        return default_collate(samples)
    images, labels = default_collate([(image.permute(1, 2, 0), label) for image, label in samples])
    return images.permute(0, 3, 1, 2), labels


def build_loaders(args, sets, num_classes, rank, world_size, device):
    """(train sampler, train batches, validation batches): each rank's share, on the device (Prefetcher)."""
    train_set, val_set = sets
    loader_args = dict(batch_size=args.batch_size // world_size, num_workers=args.workers,
                       pin_memory=device.type == "cuda", persistent_workers=args.workers > 0,
                       collate_fn=functools.partial(collate, num_classes=num_classes))
    loader_args.update(worker_init_fn=start_loader_worker)  # [preemption]
    train_data = SeededSamples(train_set)
    if args.gpu_decode:  # [gpu-decode]
        train_data, val_set = DeviceDecoded(train_set), DeviceDecoded(val_set)  # [gpu-decode]
        loader_args.update(collate_fn=DeviceDecoded.collate)  # [gpu-decode]
    train_sampler = TrainSampler(train_data, num_replicas=world_size, rank=rank, seed=args.seed)
    train_loader = DataLoader(train_data, sampler=train_sampler, drop_last=True, **loader_args)
    val_loader = DataLoader(val_set, sampler=range(rank, len(val_set), world_size),  # each sample once, unpadded
                            **{**loader_args, "pin_memory": False})  # fork_loader_workers says why
    fork_loader_workers(val_loader, train_loader)
    mean, std = getattr(train_set, "mean", None), getattr(train_set, "std", None)  # the data's own normalization
    normalize = NORMALIZE if mean is None else {len(mean): (mean, std)}
    return (train_sampler, Prefetcher(train_loader, device, args.channels_last, normalize),
            Prefetcher(val_loader, device, args.channels_last, normalize))


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


class Prefetcher:
    """Yields a loader's batches on the device, 4-D inputs in the model's memory format; the copy from pinned memory is
    queued without waiting, while the GPU still runs the last step. uint8 images become floats there, normalized by
    `normalize`'s (mean, std) for their number of channels (0-1 units, as NORMALIZE); other inputs are only moved."""

    def __init__(self, loader, device, channels_last, normalize):
        self.loader, self.device = loader, device
        self.normalize = {channels: [torch.tensor(v, device=device).view(1, -1, 1, 1) * 255 for v in mean_std]
                          for channels, mean_std in normalize.items()}
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format

    def __len__(self):
        return len(self.loader)

    def __iter__(self):
        for images, target in self.loader:
            if isinstance(getattr(self.loader, "dataset", None), DeviceDecoded):  # [gpu-decode]
                images = self.loader.dataset.decode(images, self.device)  # [gpu-decode]
            image = images.dtype == torch.uint8
            images = images.to(self.device, non_blocking=True)
            target = target.to(self.device, non_blocking=True).long()  # any integer labels: cross_entropy's int64
            images = images.contiguous(memory_format=self.memory_format) if images.dim() == 4 else images
            if image:
                mean, std = self.normalize[images.shape[1]]
                images = images.float().sub_(mean).div_(std)
            yield images, target


def accuracy(output, target, topk=(1, 5)):
    """How many samples have their target among the top-k outputs, for each k (a device tensor)."""
    maxk = min(max(topk), output.size(1))
    hits = output.topk(maxk, dim=1).indices.eq(target[:, None])
    return torch.stack([hits[:, :min(k, maxk)].any(dim=1).sum() for k in topk])


class Metrics:
    """Running sums on the device, which never wait for the GPU; `summary` reduces them over all ranks."""

    def __init__(self, device):
        self.sums = torch.zeros(6, dtype=torch.float64, device=device)

    def update(self, loss_sum, output, target, clipped=0):
        loss_sum = loss_sum.detach().double().reshape(1)
        count = torch.full((1,), target.numel(), dtype=torch.float64, device=target.device)
        self.sums += torch.cat([loss_sum, accuracy(output.detach(), target).double(), count,
                                (~torch.isfinite(loss_sum)).double(), count * clipped])

    def summary(self):
        loss, c1, c5, n, bad, clipped = reduce_tensor(self.sums).tolist()
        n_ = max(n, 1)
        return {"loss": loss / n_, "acc1": 100 * c1 / n_, "acc5": 100 * c5 / n_, "clipped": 100 * clipped / n_,
                "correct1": int(c1), "correct5": int(c5), "count": int(n), "nonfinite": int(bad)}


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


def load_checkpoint(path):
    """The checkpoint, checked to be a training checkpoint."""
    ckpt = read_checkpoint(path)
    ckpt = foreign_weights(ckpt)  # [foreign-weights]
    weights = ckpt.get("state_dict") if isinstance(ckpt, dict) else None  # [safety]
    named = isinstance(weights, dict) and all(isinstance(key, str) for key in weights)  # [safety]
    if not (named and all(isinstance(v, torch.Tensor) for v in weights.values())):  # [safety]
        raise UserError(f"{path} is not a checkpoint of these scripts (no state_dict of named tensors): "  # [safety]
                        f"resume from one, or save a model's weights alone, torch.save(model.state_dict(), "  # [safety]
                        f"PATH), for -e")  # [safety]
    return ckpt


# =============================================================================================
# Part 2, features: a block each, for the flags its first line names. Keep what you use, delete the rest by markers.
# =============================================================================================


# region [ema]: --model-ema, --model-ema-decay, --model-ema-steps: an average of the weights, evaluated too
class ModelEMA:
    """--model-ema: an fp32 exponential moving average of the weights and BatchNorm statistics, updated every
    --model-ema-steps steps as ema = decay * ema + (1 - decay) * weights. Every rank updates its own from the same
    all-reduced weights; its statistics become rank 0's (sync_buffers) before it is evaluated and saved."""

    def __init__(self, model, args):
        self.module = copy.deepcopy(model).float().eval().requires_grad_(False)
        self.every, self.average = args.model_ema_steps, swa_utils.get_ema_multi_avg_fn(args.model_ema_decay)

    @torch.no_grad()
    def update(self, model, step):
        if step % self.every == 0:
            mine, theirs = self.module.state_dict(), model.state_dict()
            floats = [key for key, value in mine.items() if value.is_floating_point()]
            self.average([mine[key] for key in floats], [theirs[key].float() for key in floats], None)
            for key in mine.keys() - set(floats):  # BatchNorm's batch counts
                mine[key].copy_(theirs[key])

    def load(self, state, model, log):
        """The checkpoint's average; a checkpoint without one starts it from the model's resumed weights."""
        if state is None:
            log("note: the checkpoint has no --model-ema average: it starts from the resumed weights")
        self.module.load_state_dict(model.state_dict() if state is None else state)
# endregion [ema]
# region [pretrained]: --pretrained: start from torchvision's weights for --arch
def load_pretrained(model, args):
    """torchvision's weights for --arch into every layer whose shape fits: for fewer classes, all but the classifier."""
    weights = torchvision.models.get_model_weights(args.arch).DEFAULT
    try:
        pretrained = weights.get_state_dict(progress=False)
    except Exception as e:  # offline, a proxy, a broken download or copy
        path = os.path.join(torch.hub.get_dir(), "checkpoints", os.path.basename(weights.url))
        fix = (f"delete {path}, and the next run downloads it again" if os.path.isfile(path) else
               f"check network access, or put the file into {os.path.dirname(path)}/")
        raise UserError(f"cannot load pretrained weights {weights.url} ({str(e)[:200]}): {fix}") from None
    own = model.state_dict()
    model.load_state_dict({k: v for k, v in pretrained.items() if k in own and own[k].shape == v.shape}, strict=False)
# endregion [pretrained]
# region [foreign-weights]: -e and --resume of weights other programs saved: a bare state dict, wrappers' prefixes
def foreign_weights(ckpt):
    """Weights alone (torch.save(model.state_dict())'s, which -e evaluates) as a checkpoint, and its keys without a
    DDP or DataParallel wrapper's prefix, torch.compile's (nanoGPT saves it), or both in either order."""
    if isinstance(ckpt, dict) and ckpt and all(isinstance(v, torch.Tensor) for v in ckpt.values()):
        ckpt = {"state_dict": ckpt}
    weights = ckpt.get("state_dict") if isinstance(ckpt, dict) else None
    named = isinstance(weights, dict) and all(isinstance(key, str) for key in weights)  # (others: not weights)
    for prefix in ("module.", "_orig_mod.", "module.") if named else ():
        consume_prefix_in_state_dict_if_present(weights, prefix)
    return ckpt
# endregion [foreign-weights]
# region [no-wd]: --no-wd-norm-bias: no weight decay on normalization layers and biases
def param_groups(model, args):
    """The optimizer's parameter groups: --wd for weights, none for normalization layers and biases."""
    norm_types = (torch.nn.modules.batchnorm._NormBase, torch.nn.LayerNorm, torch.nn.GroupNorm)
    decay, no_decay = [], []
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            (no_decay if isinstance(module, norm_types) or name == "bias" else decay).append(param)
    return [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
# endregion [no-wd]
# region [lr-schedule]: --lr-schedule cosine, --warmup-epochs: cosine decay, linear warmup
def warmup_or_cosine(step, steps_per_epoch, args):
    """lr_factor during --warmup-epochs (linear, from 0), and after them for --lr-schedule cosine."""
    epoch = step / steps_per_epoch
    if epoch < args.warmup_epochs:
        return min((step + 1) / (args.warmup_epochs * steps_per_epoch), 1.0)  # (a warmup shorter than a step)
    progress = (epoch - args.warmup_epochs) / max(args.epochs - args.warmup_epochs, 1e-8)
    return 0.5 * (1 + math.cos(math.pi * progress))
# endregion [lr-schedule]
# region [clip-grad-norm]: --clip-grad-norm: the gradients' norm capped, on the true (unscaled) gradients
def clip_gradients(run, args):
    """Unscales the gradients (GradScaler's step then does not again) and caps their norm at --clip-grad-norm: with
    FSDP, the norm over all ranks' shards. Returns 1.0 if it was over (a device tensor: no wait for the GPU)."""
    run.scaler.unscale_(run.optimizer)
    params = [p for group in run.optimizer.param_groups for p in group["params"]]
    norm = torch.nn.utils.clip_grad_norm_(params, args.clip_grad_norm)
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # FSDP's DTensor: the norm of every shard
    return (norm > args.clip_grad_norm).double()
# endregion [clip-grad-norm]
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
# region [profile]: --profile, --profile-all-ranks: where the step time goes
def span_union(spans):
    """Sorted, non-overlapping (start, end) pairs that cover the time `spans` cover."""
    merged = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def span_common(spans, others):
    """The pieces of time that `spans` and `others` share (one pass over both, sorted)."""
    mine, theirs, common, i, j = span_union(spans), span_union(others), [], 0, 0
    while i < len(mine) and j < len(theirs):
        start, end = max(mine[i][0], theirs[j][0]), min(mine[i][1], theirs[j][1])
        if end > start:
            common.append((start, end))
        i, j = (i + 1, j) if mine[i][1] < theirs[j][1] else (i, j + 1)
    return common


class StepProfiler:
    """--profile STEPS: torch.profiler over STEPS steps after WARMUP ones, on rank 0 (all: --profile-all-ranks).
    Writes <output-dir>/profile/rank<R>.pt.trace.json (Perfetto opens it) and logs where the step time went."""
    WARMUP = 5

    def __init__(self, run, args, rank, log, steps_per_epoch):
        benchmark = getattr(args, "benchmark", 0)
        total = benchmark + max(benchmark // 10, 1) if benchmark else steps_per_epoch * args.epochs
        self.steps = min(args.profile or 0, total)
        self.device, self.log, self.profiler, self.done = next(run.model.parameters()).device, log, None, 0
        self.path = os.path.join(args.output_dir, "profile", f"rank{rank}.pt.trace.json")
        self.part_recorded = None  # the part of the step being recorded now
        wanted = self.steps and (rank == 0 or args.profile_all_ranks)
        self.skip = min(self.WARMUP, total - self.steps) if wanted else float("inf")
        if wanted:  # the parts of a step begin at the first forward and at the optimizer's step, seen by hooks
            run.train_model.register_forward_pre_hook(lambda *_: self.part("forward/backward", first=True))
            run.optimizer.register_step_pre_hook(lambda *_: self.part("optimizer"))
            run.optimizer.register_step_post_hook(lambda *_: self.part(None))

    def part(self, name, first=False):
        """While the profiler records: ends the part of the step being recorded (the GPU done with it), and begins the
        part `name` (None: none). first: only if none is being recorded (a later micro-batch's forward)."""
        if self.profiler is None or (first and self.part_recorded):
            return
        if self.part_recorded:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.part_recorded.__exit__(None, None, None)
        self.part_recorded = name and torch.profiler.record_function(name).__enter__()

    @contextlib.contextmanager
    def region(self, name):
        """A named stretch around parts of a step, recorded (the GPU done with it) while the profiler records."""
        with contextlib.nullcontext() if self.profiler is None else torch.profiler.record_function(name):
            yield
            if self.profiler is not None and self.device.type == "cuda":
                torch.cuda.synchronize(self.device)

    def timed(self, batches):
        """The batches; a recorded step lasts from the wait for its batch to the request for the next."""
        batches = iter(batches)
        while True:
            if self.skip == 0:
                cuda = [torch.profiler.ProfilerActivity.CUDA] if self.device.type == "cuda" else []
                self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, *cuda])
                self.profiler.start()
            self.skip -= 1
            with self.region("train step"):
                with self.region("data wait"):
                    batch = next(batches, None)
                if batch is None:
                    return
                yield batch
                self.part(None)
            self.done += self.profiler is not None
            if self.profiler and self.done == self.steps:
                self._finish()

    def _finish(self):
        profiler, self.profiler, self.skip = self.profiler, None, float("inf")
        profiler.stop()
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        profiler.export_chrome_trace(self.path)
        self.log(f"profile: {self.summary(profiler.events())}; trace in {self.path}")

    def summary(self, events):
        """Where the step time went, in ms per step: waiting for the batch, forward/backward, the all-reduce time that
        computation did not hide, the optimizer step, and the rest."""
        spans, trainer, on_gpu = {}, {e.thread for e in events if e.name == "train step"}, self.device.type == "cuda"
        for e in events:
            spans.setdefault(e.name, []).append((e.time_range.start, e.time_range.end))
        steps = [s for s in spans.get("train step", []) if span_common([s], spans.get("forward/backward", []))]

        def place(e):  # the GPU, the training thread, or another thread (gloo's)
            on_cuda = e.device_type == torch.autograd.DeviceType.CUDA
            return "gpu" if on_cuda else "main" if e.thread in trainer else "other"

        def length(pieces):
            return sum(end - start for start, end in pieces)

        # communication: NCCL's kernels on the GPU, gloo's work on its threads; computation: the other kernels on
        # the GPU, the operators of the training thread on the CPU
        comm = [(e.time_range.start, e.time_range.end) for e in events
                if e.name.startswith(("gloo:", "nccl")) and place(e) == ("gpu" if on_gpu else "other")]
        compute = [(e.time_range.start, e.time_range.end) for e in events if not e.name.startswith(("gloo:", "nccl"))
                   and (place(e) == "gpu" if on_gpu else place(e) == "main" and e.name.startswith("aten::"))]
        comm_in_backward = span_common(comm, spans.get("forward/backward", []))
        exposed = length(comm_in_backward) - length(span_common(comm_in_backward, compute))
        n = max(len(steps), 1)
        parts = {name: length(span_common(spans.get(name, []), steps)) / n
                 for name in ("data wait", "forward/backward", "all-reduce", "optimizer")}  # "all-reduce": Horovod's
        parts["forward/backward"] -= exposed / n
        parts["all-reduce"] += exposed / n
        parts["other"] = length(span_union(steps)) / n - sum(parts.values())
        count = sum(1 for e in events if e.name == "c10d::allreduce_" and e.thread in trainer
                    and span_common([(e.time_range.start, e.time_range.start + 1e-3)], steps))
        return (f"{len(steps)} steps, {length(span_union(steps)) / n / 1e3:.1f} ms each = "
                + " + ".join(f"{name} {ms / 1e3:.1f}" for name, ms in parts.items())
                + f" ms; {count / n:g} all-reduces per step")
# endregion [profile]
# region [benchmark]: --benchmark N: the training speed without the input pipeline
def benchmark(run, args, world_size, log, val_set):
    """Model, step and all-reduce on batches made on the device: random images, or the first validation input."""
    device, local_batch = next(run.model.parameters()).device, args.batch_size // world_size
    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format
    example = val_set[0][0]
    if example.dtype == torch.uint8:
        images = torch.randn(local_batch, example.shape[0], args.crop_size, args.crop_size, device=device)
    else:
        images = example.to(device).expand(local_batch, *example.shape).clone()
    batch = images.contiguous(memory_format=memory_format), torch.zeros(local_batch, dtype=torch.int64, device=device)
    autocast = str(run.amp_dtype).replace("torch.", "") if run.amp_dtype else "off"
    for steps in (max(args.benchmark // 10, 1), args.benchmark):  # a warm-up, then the timed run
        started = time.monotonic()
        train = train_one_epoch(run, [batch] * steps, args, log)
        if train is None:
            return
    log(f"benchmark: {train['count'] / (time.monotonic() - started):.0f} img/s over {steps} steps, {world_size} "
        f"processes, global batch {args.batch_size}, {args.arch} at {args.crop_size} px, autocast {autocast}; "
        f"{memory_use(run, device)}")


def memory_use(run, device):
    """This process's weights, gradients and optimizer state (a sharded model's shards), and its peak (CPU: the RSS)."""
    params = list(run.model.parameters())
    state = [value for per_param in run.optimizer.state.values() for value in per_param.values()
             if isinstance(value, torch.Tensor)]
    held = sum(getattr(t, "_local_tensor", t).nbytes for t in [*params, *(p.grad for p in params), *state]
               if t is not None)  # a DTensor's _local_tensor: this rank's shard
    peak = (torch.cuda.max_memory_allocated(device) if device.type == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)  # KiB on Linux
    return f"model state {held / 2**20:.0f} MiB, peak memory {peak / 2**20:.0f} MiB per process"
# endregion [benchmark]
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
# region [tf32]: --no-tf32: TF32 matmuls and convolutions on Ampere and newer GPUs
def set_tf32(args, device, log):
    """TF32 on Ampere and later: fp32 matmuls and convolutions with a 10-bit mantissa, several times faster; or not."""
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = not args.no_tf32
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 0):
        log(f"TF32: not on {'this GPU (before Ampere)' if device.type == 'cuda' else 'the CPU'}: full fp32")
    else:
        log("TF32: off (--no-tf32): full fp32" if args.no_tf32 else
            "TF32: on for fp32 matmuls and convolutions (--no-tf32 turns it off)")
# endregion [tf32]
# region [compile]: --compile: the model that trains, compiled by torch.compile
def compile_model(model):
    """The wrapped model, compiled: DDP's buckets split the graph, so that each all-reduce still overlaps backward.
    Inductor's own relayout of the graphs DDP splits fails the stride check of a convolution's backward on CUDA
    (torch 2.11): it stays off."""
    torch._inductor.config.layout_optimization = False
    return torch.compile(model)
# endregion [compile]
# region [dummy]: --dummy, --dummy-size: a learnable synthetic dataset, for demos and tests
class SyntheticImages(Dataset):
    """A learnable stand-in for ImageNet: colour and stripes by class, noise by image, the same on every call."""

    def __init__(self, size, num_classes, image_size, transform, offset=0):
        self.size, self.num_classes, self.image_size = size, num_classes, image_size
        self.transform, self.offset = transform, offset
        g = torch.Generator().manual_seed(12345)
        self.colours = torch.rand(num_classes, 3, 1, 1, generator=g) * 160 + 48
        self.classes = [f"class{k}" for k in range(num_classes)]

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        target = index % self.num_classes
        g = torch.Generator().manual_seed(self.offset + index)
        wave = torch.sin(torch.arange(self.image_size) * (target % 5 + 1) * torch.pi / 8) * 24
        stripes = wave[:, None] if target % 2 else wave[None, :]
        img = self.colours[target] + stripes + torch.randn(3, self.image_size, self.image_size, generator=g) * 24
        return self.transform(img.clamp(0, 255).to(torch.uint8)), target
# endregion [dummy]
# region [fast-decode]: JPEGs decoded by torchcodec (libjpeg-turbo, without PIL's overhead) where it loads
try:
    from torchcodec.decoders import decode_jpeg
    JPEG_DECODER = "torchcodec"
except Exception as e:  # not installed, or its libraries (FFmpeg's, torch's) do not fit
    why = " ".join(str(e).split())[:300]  # on one line: torchcodec's own runs over many
    decode_jpeg, JPEG_DECODER = None, f"PIL, slower: torchcodec did not load ({why}); pip install torchcodec"


def decode_file(path):
    """The JPEG at `path` as an RGB uint8 CxHxW tensor, decoded by torchcodec; None for what it cannot take (a PNG
    named .JPEG, a file cut short) and where it does not load: PIL decodes those (load_image), to the same pixels."""
    if decode_jpeg is None:
        return None
    with open(path, "rb") as f:
        data = f.read()
    if data[:2] != b"\xff\xd8":
        return None
    with contextlib.suppress(RuntimeError):
        return decode_jpeg(data)
    return None
# endregion [fast-decode]
# region [fast-crop]: the training crop in one step, faster than torchvision's v2 transforms
class RandomResizedCropFlip:
    """v2.RandomResizedCrop(size) and v2.RandomHorizontalFlip() in one step, drawn alike from torch's RNG in one call.
    A uint8 tensor is cut channels-last (decode_jpeg's order) and resized by v2's kernel; a PIL image goes through
    v2.functional. After a decode, v2's machinery costs about as much as the resize (benchmarks/input_pipeline.py)."""

    def __init__(self, size, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)):
        self.size, self.scale, self.ratio = [size, size], scale, ratio

    def params(self, height, width):
        """(top, left, crop height, crop width, flip) for an image of this size."""
        u = torch.rand(23).tolist()
        (smin, smax), (rmin, rmax) = self.scale, self.ratio
        for k in range(0, 20, 2):
            area = height * width * (smin + (smax - smin) * u[k])
            aspect = rmin * (rmax / rmin) ** u[k + 1]
            w, h = round((area * aspect) ** 0.5), round((area / aspect) ** 0.5)
            if 0 < w <= width and 0 < h <= height:
                return int(u[20] * (height - h + 1)), int(u[21] * (width - w + 1)), h, w, u[22] < 0.5
        w, h = width, height  # v2's fallback: the whole image, trimmed to the nearest allowed aspect ratio
        if width / height < rmin:
            h = round(width / rmin)
        elif width / height > rmax:
            w = round(height * rmax)
        return (height - h) // 2, (width - w) // 2, h, w, u[22] < 0.5

    def __call__(self, image):
        fast = isinstance(image, torch.Tensor) and image.dtype == torch.uint8 and image.ndim == 3 and not image.is_cuda
        top, left, height, width, flip = self.params(*(image.shape[1:] if fast else v2.functional.get_size(image)))
        if fast:
            crop = image[:, top:top + height, left:left + width].unsqueeze(0)
            crop = crop.contiguous(memory_format=torch.channels_last)
            image = F.interpolate(crop, size=self.size, mode="bilinear", antialias=True, align_corners=False)[0]
        else:
            image = v2.functional.resized_crop(image, top, left, height, width, self.size, antialias=True)
        return v2.functional.horizontal_flip(image) if flip else image
# endregion [fast-crop]
# region [gpu-decode]: --gpu-decode: loader workers only read JPEG files; the training process decodes and crops them
class DeviceDecoded(Dataset):
    """An image folder's samples as their files' bytes: decode() turns a batch of them into the images the folder's
    transform makes, decoded (torchcodec: nvJPEG on a GPU, a batch per call) and cut on the device. The keys are
    the samplers': TrainSampler's (index, seed) pairs, whose seed draws the crop as SeededSamples does, or indices."""

    def __init__(self, dataset):
        try:
            from torchcodec.decoders import decode_jpeg
        except Exception as e:  # not installed, or its libraries (FFmpeg's, torch's) do not fit
            raise UserError(f"--gpu-decode needs torchcodec, which did not load ({str(e)[:300]}): "
                            f"pip install torchcodec") from None
        if getattr(dataset, "loader", None) is not load_image:
            raise UserError("--gpu-decode decodes image folders (DATA/train, DATA/val); this data is not one: leave "
                            "--gpu-decode out")
        self.dataset, self.decode_jpeg = dataset, decode_jpeg

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, key):
        index, seed = key if isinstance(key, tuple) else (key, 0)
        path, label = self.dataset.samples[index]
        with open(path, "rb") as f:
            return (torch.frombuffer(bytearray(f.read()), dtype=torch.uint8), seed, path), label

    @staticmethod
    def collate(samples):
        files, labels = zip(*samples)
        return tuple(map(list, zip(*files))), torch.tensor(labels)

    def decode(self, batch, device):
        data, seeds, paths = batch
        try:
            images = self.decode_jpeg(data, device=device)
        except RuntimeError:  # a file it cannot take (a PNG named .JPEG, say) in the batch: load_image decodes it
            images = [load_image(path).to(device) for path in paths]
        crops = []
        for image, seed in zip(images, seeds):
            with torch.random.fork_rng(devices=[]):  # the CPU's generator draws crops, the GPU's (dropout) goes on
                torch.default_generator.manual_seed(seed)
                crops.append(self.dataset.transform(image))
        return torch.stack(crops)
# endregion [gpu-decode]
# region [spec]: --arch and --dataset MODULE:FUNCTION: your own model and data without editing this file
def load_spec(spec, flag):
    """--arch or --dataset MODULE:FUNCTION: the function, imported from the current directory or PYTHONPATH."""
    module_name, _, name = spec.partition(":")
    if not all(part.isidentifier() for part in module_name.split(".")) or not name.isidentifier():  # not a path
        raise UserError(f"{flag} {spec!r}: give MODULE:FUNCTION, a module's name as import takes it, e.g. "
                        f"mymodels:tiny_cnn for tiny_cnn in ./mymodels.py")
    if os.getcwd() not in sys.path:  # `python script.py` puts the script's folder on the path, not the current one
        sys.path.append(os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # not found, or its own code failing on import: the user's to fix either way
        raise UserError(f"{flag} {spec}: cannot import {module_name} ({type(e).__name__}: {e}); put "
                        f"{module_name.replace('.', '/')}.py in the current directory or on PYTHONPATH") from None
    function = getattr(module, name, None)
    if not callable(function):
        there = f" ({name} there is a {type(function).__name__})" if hasattr(module, name) else ""
        raise UserError(f"{flag} {spec}: {module_name} ({module.__file__}) has no function {name}{there}")
    return function


def call_spec(spec, flag, *args, **kwargs):
    """What the MODULE:FUNCTION of --arch or --dataset returns; its failure is one line that names it."""
    function = load_spec(spec, flag)
    try:
        return function(*args, **kwargs)
    except UserError:
        raise
    except Exception as e:
        called = ", ".join([*("args" for _ in args), *(f"{k}={v}" for k, v in kwargs.items())])
        raise UserError(f"{flag} {spec}: {spec.split(':')[1]}({called}) failed ({type(e).__name__}: "
                        f"{str(e)[:200]})") from None


class ImageCrops(Dataset):
    """A --dataset's set, its uint8 CxHxW images cropped by `transform`; its class count and (mean, std) its own."""

    def __init__(self, dataset, transform):
        self.dataset, self.transform, self.num_classes = dataset, transform, class_count(dataset)
        self.mean, self.std = getattr(dataset, "mean", None), getattr(dataset, "std", None)

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        item = self.dataset[index]
        if not (isinstance(item, (tuple, list)) and len(item) == 2):
            return item  # no (input, label) pair: check_items says so
        inputs, label = item
        fits = isinstance(inputs, torch.Tensor) and inputs.dtype == torch.uint8 and inputs.ndim == 3
        return (self.transform(inputs) if fits else inputs), label
# endregion [spec]
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


# =============================================================================================
# Part 3, the safety net: checks before training, failures made one line. Delete its region and lines tagged [safety].
# =============================================================================================


# region [safety]
MODEL_NAMES = sorted(torchvision.models.list_models(module=torchvision.models))


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


def explain_unreadable_image(load_image):
    """load_image; a file it cannot read (missing, cut short, not an image, too large for PIL: a decompression bomb)
    stops the rank whose loader met it, in one line that names the file."""
    @functools.wraps(load_image)  # (pickled by name, as a spawned loader worker takes it)
    def load(path):
        try:
            if not os.path.isfile(path):  # a named pipe would be read for ever
                raise OSError("not a file: a pipe, a device")
            return load_image(path)
        except Exception as e:
            raise RankError(f"cannot read image {path} ({e}): replace or remove the file") from None
    return load


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
    """The flags together and the model's name, right after parsing (each flag's range: parse_args)."""
    check_torch()
    if ":" not in args.arch and args.arch not in MODEL_NAMES:
        raise UserError(f"unknown --arch {args.arch!r}: use a torchvision classification model, e.g. resnet50 "
                        f"(torchvision.models.list_models() has {len(MODEL_NAMES)}), or your own as MODULE:FUNCTION")
    if ":" in args.arch:  # [spec]
        load_spec(args.arch, "--arch")  # [spec]
    if args.dummy and args.dataset:  # [dummy] [spec]
        raise UserError("--dummy and --dataset both name the data: give one of them")  # [dummy] [spec]
    if args.dummy and args.data:  # [dummy]
        raise UserError(f"--dummy makes its own data, and {args.data} names a folder: give one of them")  # [dummy]
    if args.pretrained and ":" in args.arch:  # [pretrained]
        raise UserError(f"--pretrained loads torchvision's weights, and --arch {args.arch} is your own "  # [pretrained]
                        f"model: load its weights inside {args.arch.split(':')[-1]}, or drop it")  # [pretrained]
    if args.epochs == 0 and not (args.evaluate or getattr(args, "benchmark", 0)):
        raise UserError("--epochs 0 trains nothing: give at least 1, or -e to evaluate a checkpoint")
    if args.val_resize < args.crop_size:
        raise UserError(f"--val-resize {args.val_resize} is smaller than --crop-size {args.crop_size}: the center "
                        f"crop would be padded with black; give --val-resize {args.crop_size} or more")
    for flag in ("model_ema_decay", "model_ema_steps"):  # [ema]
        if getattr(args, flag) is not None and not args.model_ema:  # [ema]
            raise UserError(f"--{flag.replace('_', '-')} goes with --model-ema: add it, or drop the other")  # [ema]
    if args.profile_all_ranks and not args.profile:  # [profile]
        raise UserError("--profile-all-ranks goes with --profile: add it, or drop --profile-all-ranks")  # [profile]
    if args.profile and args.evaluate:  # [profile]
        raise UserError("--profile records training steps, and -e trains none: drop one of them")  # [profile]


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


def check_spawn_args(args):
    """The nodes' flags, in the parent before any worker starts: --node-rank within --world-size, and the
    --dist-url that several nodes need, a tcp:// address that resolves."""
    if not 1 <= args.world_size or not 0 <= args.node_rank < args.world_size:
        raise UserError(f"--node-rank {args.node_rank} with --world-size {args.world_size}: node ranks go from 0 "
                        f"to {max(args.world_size, 1) - 1}")
    if args.dist_url is None and args.world_size > 1:
        raise UserError(f"--world-size {args.world_size} needs --dist-url tcp://HOST:PORT, HOST being node 0, "
                        f"the same on every node")
    url = urllib.parse.urlparse(args.dist_url or "tcp://127.0.0.1:0")
    port = url.netloc.rpartition(":")[2]  # (url.port raises past 65535)
    if url.scheme != "tcp" or not url.hostname or not port.isdigit() or int(port) >= 2**16:
        raise UserError(f"--dist-url {args.dist_url}: give tcp://HOST:PORT, HOST being node 0's address, PORT a "
                        f"number below 65536")
    if int(port) == 0 and args.world_size > 1:  # each node would listen on a port of its own, and wait for the others
        raise UserError(f"--dist-url {args.dist_url}: port 0 is a free port of this node's, and the {args.world_size} "
                        f"nodes meet at one port: give PORT from 1 to 65535")
    check_address(url.hostname, f"--dist-url {args.dist_url}: {url.hostname}")


def check_gpus(args):
    """--gpus: ids of GPUs that are visible, comma-separated, each once."""
    if args.gpus is None:
        return
    try:
        gpus = [int(i) for i in args.gpus.split(",")]
    except ValueError:
        raise UserError(f"--gpus {args.gpus}: give comma-separated GPU ids, e.g. 0,2,5") from None
    twice = sorted({i for i in gpus if gpus.count(i) > 1})
    if twice:
        raise UserError(f"--gpus {args.gpus} names GPU {twice[0]} more than once: list each GPU once")
    if not torch.cuda.is_available():
        raise UserError(f"--gpus {args.gpus}: CUDA is not available on this machine; drop --gpus to train on the CPU")
    missing = sorted(set(gpus) - set(range(torch.cuda.device_count())))
    if missing:
        raise UserError(f"--gpus {args.gpus}: there is no GPU {missing[0]}, {torch.cuda.device_count()} are "
                        f"visible (0 to {torch.cuda.device_count() - 1}); check CUDA_VISIBLE_DEVICES")


def check_launch_args(args, world_size, device):
    """The flags this launcher reads its own way, checked before any process waits for another: none here. Part of
    the launcher interface (each sibling checks its own), called by check_run alone."""


MEMORY = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")  # this machine's, in bytes


def check_batch(args, world_size):
    """The global batch over `world_size` processes, each process's over --grad-accum-steps, and the size of its
    images against the machine's memory (a size mistyped would end in the out-of-memory killer's SIGKILL)."""
    if args.batch_size % world_size:
        raise UserError(f"--batch-size {args.batch_size} is the global batch and must divide by the world size "
                        f"{world_size}: use e.g. {max(args.batch_size // world_size, 1) * world_size}")
    if args.batch_size // world_size % args.grad_accum_steps:
        raise UserError(f"--grad-accum-steps {args.grad_accum_steps} must divide each process's batch "
                        f"{args.batch_size // world_size} (-b {args.batch_size} / {world_size} processes)")
    local_batch = args.batch_size // world_size
    sizes = {f"-b {args.batch_size} at --crop-size {args.crop_size}": (args.crop_size, local_batch, "-b, --crop-size"),
             f"--val-resize {args.val_resize}": (args.val_resize, 1, "--val-resize")}  # one image, before its crop
    for given, (side, images, smaller) in sizes.items():
        need = images * 3 * side**2 * 4  # as float RGB, as the device gets them (a model needs more)
        if need > MEMORY:
            raise UserError(f"{given}: {images} image(s) of {side}x{side} per process take {need / 2**30:.0f} GiB as "
                            f"floats, more than this machine's {MEMORY / 2**30:.0f} GiB: give smaller {smaller}")


def check_run(args, world_size, device, sets):
    """The rest of bad input, before the loaders start: the batch, the launcher's flags, the data."""
    check_batch(args, world_size)
    check_launch_args(args, world_size, device)
    backend = getattr(args, "dist_backend", None) or ""  # (Horovod and DataParallel have no such flag)
    for name in [part.split(":")[-1] for part in backend.split(",") if part]:
        known = torch.distributed.is_backend_available(name)  # (torch.distributed: Horovod's imports no dist)
        if not known or (name == "nccl" and device.type != "cuda"):
            what = "needs GPUs" if known else "is not a backend of this torch"
            raise UserError(f"--dist-backend {backend}: {name} {what}; leave the flag out (nccl with GPUs, "
                            f"gloo without), or give gloo")
    train_set = check_datasets(sets, args)[0]
    if len(train_set) < args.batch_size and not (args.evaluate or getattr(args, "benchmark", 0)):  # neither trains
        raise UserError(f"{len(train_set)} training samples are fewer than one global batch of {args.batch_size}: "
                        f"lower -b")
    order = len(train_set) * 145  # an epoch's order at its peak, measured: randperm, a list of ints, of pairs
    if order > MEMORY:
        raise UserError(f"{len(train_set)} training samples: an epoch's order of them, a list in memory, takes "
                        f"{order / 2**30:.0f} GiB, more than this machine's {MEMORY / 2**30:.0f} GiB: give a smaller "
                        f"train set")


def check_image_folder(data):
    """build_datasets' folder: DIR, and train/ and val/ in it (ImageFolder's own error would name one path only)."""
    if not (data and os.path.isdir(data)):
        raise UserError(f"data folder {data!r} not found: give a folder with train/ and val/ inside, or --dummy")
    for root in (os.path.join(data, "train"), os.path.join(data, "val")):
        if not os.path.isdir(root):
            raise UserError(f"{root} not found: DIR must hold train/ and val/, one folder per class")


def check_datasets(sets, args):
    """Refuses in one line what build_datasets returned if training cannot take it: two map-style, non-empty datasets
    of (input tensor, integer label), a number of classes, uint8 inputs that are CxHxW images (C: 3, 1, or as many as
    its mean's). Reads the first validation item only: returns the datasets, the number of classes and its input."""
    spec = getattr(args, "dataset", None)  # None too where the block spec is cut
    source = f"--dataset {spec}" if spec else "build_datasets"
    if not (isinstance(sets, (tuple, list)) and len(sets) == 2):
        raise UserError(f"{source} returned a {type(sets).__name__}, not a pair (train_set, val_set): return both")
    for split, data in zip(("train", "val"), sets):
        mapped = hasattr(data, "__len__") and hasattr(data, "__getitem__")
        if not mapped or isinstance(data, torch.utils.data.IterableDataset):
            raise UserError(f"{source}: its {split} set, a {type(data).__name__}, is not a map-style dataset "
                            f"(__len__ and __getitem__, which the samplers shard by): give it both")
        try:
            size = len(data)
        except (TypeError, ValueError) as e:  # a __len__ that returns a float, or a negative number
            raise UserError(f"{source}: its {split} set's len() fails ({e}): return the number of items") from None
        if size == 0:
            raise UserError(f"{source}: its {split} set is empty: give it samples")
        if isinstance(data, torchvision.datasets.DatasetFolder):  # ImageFolder follows links: one looping back
            folders = {}
            for folder in sorted({os.path.dirname(path) for path, _ in data.samples}):
                first = folders.setdefault(os.path.realpath(folder), folder)
                if first != folder:
                    raise UserError(f"{folder} is {first} again, through a symbolic link: the {split} set would hold "
                                    f"its images twice; remove the link")
    classes = [getattr(data, "classes", None) for data in sets]  # an ImageFolder's: its class folders, sorted
    if all(isinstance(names, list) for names in classes) and classes[0] != classes[1]:
        odd = ", ".join(sorted(set(classes[0]) ^ set(classes[1]))[:3]) or "the same names in another order"
        raise UserError(f"{source}: its train and val sets have different classes ({odd}): give both the same (an "
                        f"image folder: the same class folders), or the labels of one would not be the other's")
    try:
        own = class_count(sets[0])
    except TypeError:  # classes that have no len(): an iterator
        own = None
    num_classes = args.num_classes or own
    if not isinstance(num_classes, int) or num_classes < 1:
        said = "" if own is None or isinstance(own, int) else f" ({own!r} is no Python int)"  # numpy's: int() it
        raise UserError(f"{source}: its train set has no number of classes{said}: give --num-classes N, or the set an "
                        f"attribute num_classes = N (or classes, a list of N names), labels being 0 to N-1")
    if num_classes == 1:  # the loss is 0 from the first step: nothing to learn
        raise UserError(f"{source}: its train set has 1 class, and a classifier needs 2 or more: give it the other "
                        f"classes (ImageFolder: a folder each), or --num-classes N")
    if isinstance(own, int) and num_classes < own:
        raise UserError(f"--num-classes {num_classes}, but {source}'s train set has {own} classes: drop the flag")
    mean, std = getattr(sets[0], "mean", None), getattr(sets[0], "std", None)
    try:  # as the Prefetcher takes them
        mean_std = None if mean is None else [torch.as_tensor(v, dtype=torch.float64) for v in (mean, std)]
    except (TypeError, ValueError, RuntimeError):  # None, strings
        mean_std = []
    if mean_std is not None and not (mean_std and mean_std[0].ndim == 1 and mean_std[0].shape == mean_std[1].shape
                                     and (0 <= mean_std[0]).all() and (mean_std[0] <= 1).all()
                                     and (0 < mean_std[1]).all() and (mean_std[1] <= 1).all()):
        raise UserError(f"{source}: its train set's mean {mean!r} and std {std!r} need one number per channel each, "
                        f"in 0-1 units (0-255 ones divided by 255), every std above 0")
    channels = tuple(NORMALIZE) if mean is None else (len(mean_std[0]),)
    inputs = {}
    for split, data in zip(("train", "val"), sets):
        try:
            item = data[0]
        except RankError:  # an unreadable image: the rank that reads it in training or evaluation says so
            continue
        except UserError:
            raise
        except Exception as e:
            raise UserError(f"{source}: its {split} set's item 0 failed ({type(e).__name__}: {str(e)[:200]})") from None
        if not (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], torch.Tensor)):
            pair = isinstance(item, (tuple, list)) and len(item) == 2  # an input of another type: a PIL image, numpy
            parts = f" {tuple(type(x).__name__ for x in item)}" if isinstance(item, (tuple, list)) else ""
            fix = ("return the input as a tensor (torch.from_numpy(array), v2.functional.pil_to_tensor(image))"
                   if pair else "return (input, label) pairs")
            raise UserError(f"{source}: an item of its {split} set is {type(item).__name__}{parts}, "
                            f"not (input tensor, label): {fix}")
        inputs[split], label = item
        shape = "x".join(map(str, inputs[split].shape))
        if inputs[split].dtype == torch.uint8 and (inputs[split].ndim != 3 or inputs[split].shape[0] not in channels):
            raise UserError(f"{source}: an input is a uint8 tensor of shape {shape}; uint8 inputs are images, CxHxW "
                            f"with C {' or '.join(map(str, channels))} (as its mean and std): give other data as float "
                            f"tensors")
        if not label_fits(label, num_classes):
            raise UserError(f"{source}: a label is {label!r}; labels are integers from 0 to num_classes - 1 "
                            f"({num_classes - 1}): Python or numpy integers, or integer tensors of shape ()")
    kinds = {split: (x.dtype, x.ndim, x.shape[:1] if x.ndim >= 2 else x.shape) for split, x in inputs.items()}  # C
    if len(set(kinds.values())) > 1:
        said = {split: f"{str(kind[0]).replace('torch.', '')} {'x'.join(map(str, inputs[split].shape))}"
                for split, kind in kinds.items()}
        raise UserError(f"{source}: its train inputs are {said['train']}, its val inputs {said['val']}: give both "
                        f"one dtype and one number of channels (or features)")
    return (*sets, num_classes, inputs.get("val", inputs.get("train")))


def check_model(args, num_classes=1000, example=None):
    """Refuses, in one line, options the model does not take and inputs it cannot train on (`example`, one input of
    the data; None: an image of --crop-size), by a training forward pass on the meta device (shapes only: 0.01-0.8 s);
    for a torchvision model, more passes find the --crop-size to name. Your own model gets a verdict only from a
    torch function that fails on its inputs' shapes and dtypes. Returns the model built there, or None."""
    image = example is None or example.dtype == torch.uint8  # the Prefetcher makes uint8 images float
    shape = (3, args.crop_size, args.crop_size) if example is None else tuple(example.shape)
    dtype = torch.float32 if image else example.dtype
    try:
        with torch.device("meta"):
            model = build_model(args, num_classes, load_weights=False).train()
    except Exception:  # no verdict: regnet_* compute their layout with tensors, which hold no values there; your
        return None  # model may need a real device to build (build_model, run on it later, says what fails)
    model = getattr(model, "_orig_mod", model)  # torch.compile'd: the same shapes, with nothing to compile
    known = args.arch in MODEL_NAMES and type(model).__module__.startswith("torchvision.")

    class Calls(torch.overrides.TorchFunctionMode):  # the last torch function's error, unless it names the meta device
        def __torch_function__(self, func, types, args=(), kwargs=None):
            try:
                return func(*args, **(kwargs or {}))
            except Exception as e:
                self.refused = None if "meta" in str(e).lower() else e
                raise

    def failure(size=None, train=True):
        """Why a training forward pass of 2 inputs (images of size x size), or an evaluation one of 1 (evaluation's
        last batch may hold one), fails; None if it works, or may work."""
        model.train(train)
        batch = 2 if train else 1
        try:
            with Calls() as calls, torch.device("meta"):
                output = model(torch.empty(batch, *(shape if size is None else (3, size, size)), dtype=dtype))
        except NotImplementedError:  # an operation the meta device lacks: no verdict
            return None
        except Exception as e:
            return str(e).strip().splitlines()[-1][:200] if known or e is getattr(calls, "refused", None) else None
        if not isinstance(output, torch.Tensor):
            return f"it returns {type(output).__name__}, not logits"
        if not output.is_floating_point():  # cross-entropy and backward need floats
            return f"its logits are {str(output.dtype).replace('torch.', '')}, not floating point"
        if train and not output.requires_grad:  # backward() would find no graph
            return "its logits have no gradient (a forward under torch.no_grad(), or .detach()): return them with it"
        wide = "x".join(map(str, output.shape)) or "a scalar"
        expected = f"{batch}x{num_classes}"
        return None if wide == expected else f"its logits are {wide}, not {expected}"

    if not any(p.requires_grad for p in model.parameters()):  # DDP and backward() would fail at the first step
        raise UserError(f"--arch {args.arch} has no parameters to train (none, or all with requires_grad=False): "
                        f"give it some that require gradients")
    if any(isinstance(p, torch.nn.parameter.UninitializedParameter) for p in model.parameters()):
        raise UserError(f"--arch {args.arch} has lazy parameters (nn.LazyLinear, nn.LazyConv2d...), whose sizes only a "
                        f"forward pass sets, after DDP and the optimizer took them: give their input sizes")
    if any(isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse for m in model.modules()):
        raise UserError(f"--arch {args.arch} makes sparse gradients (an embedding with sparse=True), which neither the "
                        f"fused optimizers nor FSDP take: make them dense (sparse=False)")
    reason = failure()
    if reason is None:  # and the evaluation that ends the first epoch, in eval mode
        evaluated = failure(train=False)
        if evaluated:
            raise UserError(f"--arch {args.arch} in eval mode (model.eval(), as evaluation runs it, on batches down to "
                            f"1 sample): {evaluated}; return the logits it returns in training, batch x classes")
        return model
    if not (image and known):
        hint = (f"; images reach it at --crop-size {args.crop_size}: give the size it takes" if image else "")
        if any(words in reason for words in MIXED_DTYPES):
            hint = "; give them one dtype (model.float() in build_model, or the data's tensors .float())"
        raise UserError(f"--arch {args.arch} does not take the data's inputs ({'x'.join(map(str, shape))} "
                        f"{str(dtype).replace('torch.', '')}): {reason}{hint}")
    weights = torchvision.models.get_model_weights(args.arch).DEFAULT
    hints = [getattr(model, "image_size", 0), weights.meta["min_size"][0]]  # a ViT's size, torchvision's minimum
    fits = next((size for size in hints if size and failure(size) is None), None)
    if fits is None:
        raise UserError(f"--arch {args.arch} does not train at --crop-size {args.crop_size} ({reason})")
    if failure(fits + 1) is not None:
        weighted = " --pretrained" if getattr(args, "pretrained", False) else ""  # the flag's block may be cut
        raise UserError(f"--arch {args.arch}{weighted} takes {fits}x{fits} images only: use --crop-size {fits}")
    low = fits - 1 if failure(fits - 1) else 0  # the smallest size that fits lies in (low, fits]; often it is the hint
    while fits - low > 1:
        middle = (low + fits) // 2
        low, fits = (low, middle) if failure(middle) is None else (middle, fits)
    if args.crop_size < fits:
        raise UserError(f"--crop-size {args.crop_size} is too small for --arch {args.arch}: use at least {fits}")
    raise UserError(f"--arch {args.arch} does not train at --crop-size {args.crop_size} ({reason}); {fits} works")


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


def check_fit(path, ckpt, sets, args):
    """Refuses, in one line that names both sides, a model that does not fit the data (check_model) and a checkpoint
    that does not fit the command line: its model first (it says which -a to give), dropout, weights, classes."""
    check_evaluated(path, args)
    arch = ckpt and ckpt.get("arch", args.arch)
    if ckpt and arch not in MODEL_NAMES and ":" not in str(arch):
        raise UserError(f"{path} holds a {arch} model, not a torchvision classification model: it is another "
                        f"script's checkpoint; resume it with that script")
    if ckpt and arch != args.arch:
        raise UserError(f"{path} holds a {arch} model, not {args.arch}: pass -a {arch} or another checkpoint")
    model = check_model(args, *check_datasets(sets, args)[2:])
    if not ckpt or model is None:  # a model the meta device cannot build: load_state_dict says what does not fit
        return
    check_kinds(path, ckpt, args)
    # the step and the schedule count batches of --batch-size, the optimizer's groups follow --no-wd-norm-bias, and
    # its state holds --lr, --momentum and --wd (given anew, they would be ignored); --seed drew the order of the
    # epoch a preempted run goes on with; checkpoints before --opt: SGD's
    for flag, default in (("dropout", args.dropout), ("opt", "sgd"), ("batch_size", args.batch_size),
                          ("no_wd_norm_bias", False), ("lr", args.lr), ("momentum", args.momentum),
                          ("weight_decay", args.weight_decay), ("seed", args.seed)) if not args.evaluate else ():
        trained, given = ckpt.get("args", {}).get(flag, default), getattr(args, flag, default)
        name = "--" + flag.replace("_", "-")
        said = {v: "the model's own dropout" if v is None else name if v is True else f"no {name}" if v is False
                else f"{name} {v}" for v in (trained, given)}
        if trained != given:
            raise UserError(f"{path} was trained with {said[trained]}, this run has {said[given]}: continue it with "
                            f"{said[trained]}, or train without --resume")
    check_train_samples(path, ckpt, sets[0], args)
    own, saved = getattr(model, "_orig_mod", model).state_dict(), ckpt["state_dict"]  # as RunState saves them
    missing, unknown = sorted(set(own) - set(saved)), sorted(set(saved) - set(own))
    if missing or unknown:
        parts = [f"{len(missing)} weights missing (e.g. {missing[0]})" if missing else "",
                 f"{len(unknown)} the model lacks (e.g. {unknown[0]})" if unknown else ""]
        raise UserError(f"{path} does not fit --arch {args.arch}: {', '.join(p for p in parts if p)}; resume from "
                        f"a checkpoint of this model")
    wrong = [(key, tuple(saved[key].shape), tuple(own[key].shape)) for key in own
             if saved[key].shape != own[key].shape]
    if wrong and all(there[1:] == here[1:] and there[0] != here[0] for _, there, here in wrong):
        data = getattr(args, "dataset", None) or args.data or "--dummy"
        raise UserError(f"{path} has {wrong[0][1][0]} classes, {data} has {wrong[0][2][0]}: "
                        f"resume with the data it was trained on, or train without --resume")
    if wrong:
        key, there, here = wrong[0]
        raise UserError(f"{path} does not fit --arch {args.arch}: {key} is {'x'.join(map(str, there))} there, "
                        f"{'x'.join(map(str, here))} here; resume from a checkpoint of this model")
    lacking = [key for key in ("epoch", "optimizer", "scheduler", "scaler", "best_acc1") if key not in ckpt]
    if lacking and not args.evaluate:  # weights alone: another tool's, or a compiled model's state_dict saved by hand
        raise UserError(f"{path} holds weights but no training state ({', '.join(lacking)}): evaluate it with -e; "
                        f"training resumes from this repository's checkpoints only")
    diverged = next((key for key, value in saved.items() if value.is_floating_point() and value.device.type != "meta"
                     and value.isnan().any()), None)  # (not inf: a mask buffer may hold it; FSDP's: in the shards)
    if diverged:
        raise UserError(f"{path} holds NaN weights ({diverged}): the run had diverged; use a checkpoint saved before "
                        f"(model_best.pth.tar, or another copy)")


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


def check_items(samples, num_classes):
    """One line, from the rank whose loader met them, for items unlike check_datasets' one that cannot make a batch:
    a row cut short, an image of another size, a label past the class count (a GPU's device-side assert)."""
    kinds = sorted({f"{'x'.join(map(str, x.shape))} {str(x.dtype).replace('torch.', '')}"
                    if isinstance(x, torch.Tensor) else type(x).__name__
                    for x, *_ in (s if isinstance(s, (tuple, list)) else (s,) for s in samples)})
    if len(kinds) > 1 or not all(isinstance(s, (tuple, list)) and len(s) == 2 for s in samples):
        raise RankError(f"the data's items differ within a batch (inputs {', '.join(kinds[:3])}), or are not "
                        f"(input, label) pairs: every item's input must have one shape and dtype; crop or pad it in "
                        f"the dataset")
    if any(isinstance(x, torch.Tensor) and x.requires_grad for x, _ in samples):  # (a batch cannot be made of them)
        raise RankError("the data's inputs require grad (made by a module, or requires_grad=True): make them under "
                        "torch.no_grad(), or .detach() them")
    bad = [label for _, label in samples if not label_fits(label, num_classes)]
    if bad:
        raise RankError(f"a label is {bad[0]!r}; with {num_classes} classes (--num-classes, or the data's count) "
                        f"labels are integers from 0 to {num_classes - 1}: fix the data, or give --num-classes")
    try:
        default_collate([label for _, label in samples])
    except Exception as e:  # each label fits alone, and not together: a tensor, then Python ints
        raise RankError(f"the data's labels cannot make one batch ({e}): give every label one type, Python ints or "
                        f"integer tensors of shape ()") from None


def label_fits(label, num_classes):
    """A label as training takes it, collated into a batch (the Prefetcher makes it int64): one integer (Python's,
    numpy's, a tensor of shape ()) from 0 to num_classes - 1."""
    try:
        target = default_collate([label])
        torch.iinfo(target.dtype)  # an integer dtype: not bool
    except Exception:  # None, a float, a bool, a string (a list of it then), an int beyond int64
        return False
    return target.shape == (1,) and 0 <= int(target) < num_classes


def check_finite(summary, first_bad, epoch):
    """Stops every rank (they all see the same summary) when a loss was NaN/inf, naming the first such step. At the
    first step no update has happened yet: the learning rate is not the cause there."""
    if summary["nonfinite"]:
        step = min(s for s in gather_objects(int(first_bad)) if s >= 0)
        fix = ("it came before any update, from the model or the data: check them (on a GPU, --deterministic turns "
               "cuDNN's autotuner off)" if epoch == step == 0 else "lower --lr, add --warmup-epochs, or check the data")
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
load_image = explain_unreadable_image(load_image)
save_checkpoint = explain_failed_save(save_checkpoint)
read_checkpoint = explain_unreadable(read_checkpoint)
RunState.load_state_dict = explain_damaged(RunState.load_state_dict)
Prefetcher.__iter__ = explain_short_loader(Prefetcher.__iter__)
# endregion [safety]


if __name__ == "__main__":
    main()
