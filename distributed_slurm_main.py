r"""ImageNet training with DistributedDataParallel on a Slurm cluster, started by srun.

The Slurm sibling of distributed.py: the same program, with rank, world size and rendezvous taken
from Slurm, and a job that requeues itself when its time runs out. Two ways to start it:

    # 1. one task per GPU (the common way): srun starts every training process
    srun -N2 --ntasks-per-node=4 --gpus-per-task=1 --kill-on-bad-exit=1 python distributed_slurm_main.py /data/imagenet
    # 2. one task per node, which starts one process per GPU itself
    srun -N2 --ntasks-per-node=1 --gpus-per-node=4 --kill-on-bad-exit=1 \
        python distributed_slurm_main.py /data/imagenet --procs-per-node 4
    # batch jobs that requeue themselves before the time limit: slurm/*.sbatch
    # CPU demo, no dataset needed (gloo backend)
    srun -N1 -n2 python distributed_slurm_main.py --dummy --crop-size 64 -b 64 --epochs 3
    # outside Slurm: one process (or --procs-per-node N processes on this machine)
    python distributed_slurm_main.py --dummy

What differs from distributed.py: rank = SLURM_PROCID and world = SLURM_NTASKS (or, with
--procs-per-node N, rank = SLURM_NODEID * N + local index and world = SLURM_NTASKS * N); the
rendezvous is the first node of the job step (or --dist-file); after SIGUSR1 (sbatch
--signal=USR1@120) rank 0 requeues the job, and the restarted job resumes from the step it stopped at.

Three parts: the lesson every copier keeps (command line; build_model and build_datasets, the two functions to edit;
the launcher part; main -> main_worker -> train_one_epoch / evaluate; what every run needs), optional features, and
the safety net. A feature or the net lies between `# region [NAME]` and `# endregion [NAME]`, and each line elsewhere
that exists only for it ends with `# [NAME]`: delete those, and the rest runs (README: Copy only what you need):

    sed -E -i '/^ *# region \[ema\]/,/^ *# endregion \[ema\]/d; /#( \[[a-z0-9-]+\])* \[ema\]( \[[a-z0-9-]+\])*$/d' FILE
"""
import argparse
import contextlib
import ctypes  # [preemption]
import datetime
import fcntl  # [safety]
import functools
import gc
import hashlib  # [safety]
import importlib  # [spec]
import json  # [logs]
import math  # [lr-schedule]
import multiprocessing  # [preemption]
import os
import random
import re
import resource  # [benchmark]
import shutil
import signal
import socket  # [safety]
import subprocess
import sys
import time

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
# Part 1, the lesson every copier keeps: command line, the two seams, launcher part, training flow, what runs need.
# =============================================================================================
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    add = p.add_argument
    add("data", nargs="?", metavar="DIR", help="ImageFolder root with train/ and val/ (or --dummy, --dataset)")
    add("--dataset", metavar="MODULE:FUNCTION", help="your own data: FUNCTION(args) -> (train_set, val_set)")  # [spec]
    add("--dummy", action="store_true", help="train on a synthetic, learnable dataset instead of DIR")
    add("--dummy-size", type=number(int, 1), default=1280, metavar="N", help="--dummy's training images")
    add("-a", "--arch", default="resnet18", help="a torchvision classifier, or MODULE:FUNCTION(num_classes=N)")
    add("--pretrained", action="store_true", help="start from the model's default torchvision weights")  # [pretrained]
    add("--dropout", type=number(float, 0, 1), default=None, help="for models that take one (0: off)")
    add("--num-classes", type=number(int, 1), default=None, metavar="N", help="default: the train set's")
    add("-j", "--workers", type=number(int, 0), default=4, help="loader processes per training process")
    add("--epochs", type=number(int, 0), default=90)
    add("-b", "--batch-size", type=number(int, 1), default=256, help="global batch, divided over the processes")
    add("--opt", choices=("sgd", "adamw"), default="sgd", help="SGD with momentum, or AdamW")
    add("--lr", type=number(float, 0), default=None, help="for the global batch (default: SGD 0.1, AdamW 0.001)")
    add("--momentum", type=number(float, 0, 1), default=0.9, help="SGD's momentum")
    add("--wd", "--weight-decay", type=number(float, 0), default=1e-4, dest="weight_decay")
    add("--no-wd-norm-bias", action="store_true", help="no weight decay on normalization layers and biases")  # [no-wd]
    add("--lr-schedule", choices=("step", "cosine"), default="step", help="decay, per step")  # [lr-schedule]
    add("--lr-step", type=number(int, 1), default=30, help="epochs between step decays (/10)")
    add("--warmup-epochs", type=number(float, 0), default=0.0, help="linear, from 0 to --lr")  # [lr-schedule]
    add("--crop-size", type=number(int, 1), default=224, help="training crop (--dataset: at most its images' size)")
    add("--val-resize", type=number(int, 1), help="validation resize before the center crop (default: crop x 8/7)")
    add("--amp", choices=("none", "fp16", "bf16"), default="none", help="autocast dtype; fp16 scales the loss")
    add("--channels-last", action="store_true")
    add("--sync-bn", action="store_true", help="SyncBatchNorm across processes (CUDA only)")  # [sync-bn]
    add("--no-tf32", action="store_true", help="full fp32 matmuls and convolutions, not TF32")  # [tf32]
    add("--compile", action="store_true", help="torch.compile the model that trains (the wrapped one)")  # [compile]
    add("--grad-accum-steps", type=number(int, 1), default=1, metavar="K", help="K micro-batches per step")
    add("--label-smoothing", type=number(float, 0, 1), default=0.0, help="in the training loss only")
    add("--clip-grad-norm", type=number(float, 0), metavar="X", help="max gradient norm")  # [clip-grad-norm]
    add("--model-ema", action="store_true", help="an exponential moving average of the weights, evaluated too")  # [ema]
    add("--model-ema-decay", type=number(float, 0, 1), default=0.9998, metavar="D")  # [ema]
    add("--model-ema-steps", type=number(int, 1), default=1, metavar="N", help="steps between updates")  # [ema]
    add("--profile", type=number(int, 1), metavar="STEPS", help="torch.profiler's trace of STEPS steps")  # [profile]
    add("--resume", default="", metavar="PATH|auto", help="checkpoint to resume from; auto: the one in --output-dir")
    add("-e", "--evaluate", action="store_true", help="evaluate the model (e.g. with --resume) and exit")
    add("--output-dir", default="output", help="checkpoints, metrics.jsonl and tb/")
    add("--seed", type=number(int, 0), default=0, help="same seed, same data and world-size-independent results")
    add("--deterministic", action="store_true", help="use deterministic algorithms (slower)")  # [deterministic]
    add("-p", "--print-freq", type=number(int, 1), default=10, help="steps between progress lines")
    add("--benchmark", type=number(int, 0), default=0, metavar="N", help="N steps without data loading")  # [benchmark]
    add("--dist-backend", default=None, help="default: nccl with CUDA, else gloo")
    add("--dist-timeout", type=number(float, 1), default=1800, help="seconds a collective waits on a peer")
    add("--procs-per-node", type=number(int, 0), default=0, metavar="N",
        help="one Slurm task per node starts N processes, one per GPU (0: srun starts every process)")
    add("--dist-file", metavar="PATH", help="rendezvous through this file, on a filesystem every node shares")
    args = p.parse_args(argv)
    args.lr = {"sgd": 0.1, "adamw": 0.001}[args.opt] if args.lr is None else args.lr
    args.dummy = args.dummy or (args.benchmark > 0 and not (args.dataset or args.data))  # [benchmark] [spec]
    return args


def slurm_task():
    """(procid, ntasks, localid, nodeid) of this srun task; a job of one task when srun did not start it (no Slurm,
    or the batch script or salloc shell itself)."""
    if "SLURM_STEP_ID" not in os.environ:
        return 0, 1, 0, 0
    check_slurm_task()  # [safety]
    return tuple(int(os.environ[v]) for v in ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NODEID"))


def expand_hostlist(hostlist):
    """Slurm's compressed host list, e.g. node[01-03,07],gpu1 -> node01 node02 node03 node07 gpu1."""
    hosts = []
    for item in re.findall(r"(?:[^,\[]|\[[^\]]*\])+", hostlist):
        m = re.match(r"([^\[]*)\[([^\]]*)\](.*)", item)
        if not m:
            hosts.append(item)
            continue
        head, ranges, tail = m.groups()
        for lo, _, hi in (r.partition("-") for r in ranges.split(",")):
            hosts += [h for i in range(int(lo), int(hi or lo) + 1)
                      for h in expand_hostlist(f"{head}{i:0{len(lo)}d}{tail}")]
    return hosts


def number(kind, low, high=float("inf")):
    """An argparse type: a `kind` (int or float) in [low, high); argparse's error line names the flag."""
    def convert(text):
        if not low <= kind(text) < high:  # (NaN is not)
            raise argparse.ArgumentTypeError(f"{text} is out of range: give {kind.__name__} >= {low}, < {high}")
        return kind(text)
    convert.__name__ = kind.__name__  # argparse's "invalid int value: 'x'"
    return convert


def build_model(args, num_classes):
    """Your model (edit this, and build_datasets for your data): from a batch of inputs to num_classes logits."""
    options = {"num_classes": num_classes, **({} if args.dropout is None else {"dropout": args.dropout})}
    if ":" in args.arch:  # [spec]
        return call_spec(args.arch, **options)  # [spec]
    if args.arch in ("googlenet", "inception_v3"):
        # no auxiliary classifiers; inputs scaled as their weights expect, pretrained or not (a resume, -e)
        options.update(aux_logits=False, init_weights=True, transform_input=True)
    if args.pretrained and args.arch.startswith("vit_"):  # [pretrained]
        weights = torchvision.models.get_model_weights(args.arch).DEFAULT  # [pretrained]
        options["image_size"] = weights.meta["min_size"][0]  # [pretrained]
    model = torchvision.models.get_model(args.arch, **options)
    if args.pretrained:  # [pretrained]
        load_pretrained(model, args)  # [pretrained]
    return model


def build_datasets(args):
    """Your data (edit this, and build_model for your model): (train set, val set) of (input, label), labels 0 to N-1
    (N: --num-classes, or the set's num_classes or len(classes)), inputs uint8 CxHxW images or other tensors."""
    sets = call_spec(args.dataset, args) if args.dataset else None  # [spec]
    args.crop_size = min(args.crop_size, image_size(sets) or args.crop_size)  # [spec]
    val_resize = args.val_resize or round(args.crop_size * 8 / 7)
    train_tf = v2.Compose([v2.RandomResizedCrop(args.crop_size, antialias=True), v2.RandomHorizontalFlip()])
    train_tf = functools.partial(random_resized_crop_flip, size=args.crop_size)  # [fast-crop]
    val_tf = v2.Compose([v2.Resize(val_resize, antialias=True), v2.CenterCrop(args.crop_size)])
    if args.dataset:  # [spec]
        return [ImageCrops(data, tf) for data, tf in zip(sets, (train_tf, val_tf))]  # [spec]
    if args.dummy:
        return (SyntheticImages(args.dummy_size, 10, val_resize, train_tf),
                SyntheticImages(max(args.dummy_size // 4, 1), 10, val_resize, val_tf, offset=10**9))
    check_image_folder(args.data)  # [safety]
    return [torchvision.datasets.ImageFolder(os.path.join(args.data, split), tf, loader=load_image)
            for split, tf in (("train", train_tf), ("val", val_tf))]


# =============================================================================================
# The launcher part: Slurm, the process group, DDP. Every sibling has its own (README: How every script reads).
# =============================================================================================
def find_processes(args, local_index):
    """(rank, local_rank, world_size, device) of this process. One task per GPU: from srun's task variables. One
    task per node (--procs-per-node N): its N processes take the ranks SLURM_NODEID * N + local_index; the
    world is SLURM_NTASKS * N (not SLURM_NPROCS, which counts tasks: the job would wait forever)."""
    procid, ntasks, localid, nodeid = slurm_task()
    rank, local_rank, world_size = procid, localid, ntasks
    if args.procs_per_node:
        if ntasks != int(os.environ.get("SLURM_NNODES", ntasks)):  # [safety]
            raise UserError(f"--procs-per-node needs one task per node, not {ntasks} tasks on "  # [safety]
                            f"{os.environ['SLURM_NNODES']} nodes: srun --ntasks-per-node=1")  # [safety]
        rank, local_rank = nodeid * args.procs_per_node + local_index, local_index
        world_size = ntasks * args.procs_per_node
        die_with_parent(signal.SIGTERM)  # [preemption]
    if args.dist_file and not os.path.isdir(os.path.dirname(os.path.abspath(args.dist_file))):  # [safety]
        raise UserError(f"--dist-file {args.dist_file}: no such folder; give one that every node shares")  # [safety]
    if not torch.cuda.is_available():
        return rank, local_rank, world_size, torch.device("cpu")
    gpu = 0 if torch.cuda.device_count() == 1 else local_rank  # --gpus-per-task=1 shows each task only its own GPU
    torch.cuda.set_device(gpu)  # before anything touches CUDA, or every rank crowds GPU 0
    return rank, local_rank, world_size, torch.device("cuda", gpu)


def rendezvous(args):
    """A file on a shared filesystem (--dist-file), else TCP to the first node of the job step on a port
    derived from the job id, so that jobs sharing a node do not collide. MASTER_ADDR / MASTER_PORT override."""
    env = os.environ
    if args.dist_file:  # one file per job step and restart: a file left from an earlier run must not be reused
        return "file://" + os.path.abspath(f"{args.dist_file}.{env.get('SLURM_JOB_ID', 0)}."
                                           f"{env.get('SLURM_STEP_ID', 0)}.{env.get('SLURM_RESTART_COUNT', 0)}")
    nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
    host = env.get("MASTER_ADDR") or (expand_hostlist(nodes)[0] if nodes else "127.0.0.1")
    check_address(host, f"MASTER_ADDR={host}" if env.get("MASTER_ADDR") else f"the job's first node {host}")  # [safety]
    port = env.get("MASTER_PORT") or (20000 + int(env["SLURM_JOB_ID"]) % 40000 if "SLURM_JOB_ID" in env else 29500)
    return f"tcp://{host}:{port}"


def remove_rendezvous_file(args):
    """At a clean end, --dist-file's file goes: rank 0 deletes it between two barriers (no process touches it then;
    a peer killed meanwhile fails them, and the file stays). torch's store deletes it as the last process lets go,
    but two that let go at once can both miss being last."""
    if args.dist_file and dist.is_initialized():
        with contextlib.suppress(RuntimeError):
            dist.barrier()
            if dist.get_rank() == 0:
                os.remove(rendezvous(args).removeprefix("file://"))
            dist.barrier()


def start_process_group(args, rank, world_size, device, log):
    """Starts the process group (none for one process); returns its group, or None."""
    if world_size == 1:
        return None
    log(f"rendezvous: {rendezvous(args)}")
    timeout = datetime.timedelta(seconds=args.dist_timeout)
    store, rank, world_size = next(dist.rendezvous(rendezvous(args), rank, world_size, timeout=timeout))
    return join_process_group(args, store, rank, world_size, device)


def end_process_group():
    """Frees the process group while Python is whole (at shutdown, gloo's threads can abort it), FSDP's cycles gone."""
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP):  # [preemption]
        signal.signal(sig, signal.SIG_IGN)  # [preemption]
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
    """(the model that trains: DDP all-reduces its gradients in backward, the model that evaluates: no collective)."""
    if not dist.is_initialized():
        return model, model
    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None), model


def train_step(run, images, target, args):
    """One optimizer step on this process's batch, in --grad-accum-steps micro-batches (DDP all-reduces in the last
    one's backward only). Returns the loss summed over the batch, and the outputs."""
    no_sync = getattr(run.train_model, "no_sync", contextlib.nullcontext)  # one process: nothing to hold back
    chunks, loss_sum, outputs = args.grad_accum_steps, 0, []
    run.optimizer.zero_grad()  # frees the gradients (set_to_none, torch 2's default; Horovod's takes no arguments)
    for i, (images_part, target_part) in enumerate(zip(images.chunk(chunks), target.chunk(chunks))):
        with no_sync() if i < chunks - 1 else contextlib.nullcontext():
            with torch.autocast(images.device.type, dtype=run.amp_dtype, enabled=run.amp_dtype is not None):
                output = run.train_model(images_part)
                loss = F.cross_entropy(output, target_part, label_smoothing=args.label_smoothing)
            run.scaler.scale(loss / chunks).backward()  # fp16: the loss scaled up, so that no gradient underflows
        loss_sum = loss_sum + loss.detach().float() * target_part.numel()
        outputs.append(output.detach().float())
    # region [clip-grad-norm]: --clip-grad-norm caps the gradients' norm: the true one, unscaled (FSDP: of all shards)
    if args.clip_grad_norm:
        run.scaler.unscale_(run.optimizer)
        params = [p for group in run.optimizer.param_groups for p in group["params"]]  # (apex O2: the fp32 masters)
        torch.nn.utils.clip_grad_norm_(params, args.clip_grad_norm)
    # endregion [clip-grad-norm]
    run.scaler.step(run.optimizer)  # unscales the gradients, and skips the step if one is inf/NaN
    run.scaler.update()
    run.scheduler.step()
    if run.ema and run.scheduler.last_epoch % args.model_ema_steps == 0:  # [ema]
        run.ema.update_parameters(run.model)  # [ema]
    return loss_sum, torch.cat(outputs)


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
    args = parse_args()
    if not args.resume and os.environ.get("SLURM_RESTART_COUNT", "0") != "0":
        args.resume = "auto"  # a requeued job continues where it stopped
    if args.procs_per_node:
        start_node_processes(args)
    else:
        run(None, args)


def run(local_index, args):
    """One training process; a batch job is requeued after its preemption checkpoint."""
    first_on_node = not local_index and os.environ.get("SLURM_LOCALID", "0") == "0"  # [safety]
    try:
        code = main_worker(args, local_index)
        if code == PREEMPTED:  # [preemption]
            requeue(Preemption.signum)  # [preemption]
        remove_rendezvous_file(args)
        sys.exit(code)  # None (0): finished
    except UserError as e:  # [safety]
        exit_bad_input(e, reporter=first_on_node)  # [safety]
    except KeyboardInterrupt:  # [safety]
        exit_ctrl_c()  # [safety]
    finally:
        end_process_group()  # left to interpreter exit, a gloo thread can abort the process
        end_loader_workers()  # [preemption]


def requeue(signum):
    """Rank 0 puts a batch job back in the queue after the preemption checkpoint (the restart resumes from it)
    while the others wait: srun --kill-on-bad-exit would end it mid-call once they exit. After SIGUSR1 only (sbatch
    --signal's notice), not SIGTERM: that is scancel (a requeue would undo it), or a preemption after which Slurm
    requeues the job itself, or the time limit without --signal."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job or os.environ.get("ENVIRONMENT") != "BATCH":
        return
    if signum == signal.SIGUSR1 and (not dist.is_initialized() or dist.get_rank() == 0):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # scontrol inherits it: the requeue ends the step (SIGTERM)
        done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
        print(f"could not requeue job {job} ({done.stderr.strip()}): submit it again, it resumes from this checkpoint"
              if done.returncode else f"requeued job {job}; it will resume from this checkpoint", flush=True)
    if dist.is_initialized():
        dist.barrier()


def start_node_processes(args):
    """One task per node: start --procs-per-node processes and pass Slurm's signals on to them; if one
    fails, stop the others, and fail this task so that srun --kill-on-bad-exit ends the job."""
    forward = lambda signum, frame: [os.kill(p.pid, signum) for p in context.processes if p.is_alive()]  # noqa: E731
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # kept by multiprocessing's resource tracker, which Slurm signals too
    context = mp.start_processes(run, args=(args,), nprocs=args.procs_per_node, join=False, start_method="spawn")
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, signal.SIGHUP):  # SIGINT: srun passes on Ctrl-C
        signal.signal(sig, forward)
    try:
        while not context.join(grace_period=5):
            pass
    except mp.ProcessExitedException as e:  # each process says why it failed, but one that a signal killed
        if e.exit_code < 0 and e.signal_name not in ("SIGTERM", "SIGINT", "SIGHUP"):  # those: Slurm's, no cause
            sys.exit(f"error: {e}")  # (sys.exit prints a text, exit code 1)
        sys.exit(max(e.exit_code, 1))
    finally:  # the processes are done: a stop request now changes nothing, and at exit Python would restore the
        for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, signal.SIGHUP):  # default (srun --kill-on-bad-exit
            signal.signal(sig, signal.SIG_IGN)  # SIGTERM as soon as another task exits 75: this one exits 75 too)


def main_worker(args, local_index=None):
    """One training process, from finding its peers to its last checkpoint (None: finished)."""
    torch.backends.cudnn.benchmark = True  # cuDNN times its kernels for each new input shape, keeps the fastest
    set_deterministic(args)  # [deterministic]
    rank, local_rank, world_size, device = find_processes(args, local_index)
    log = functools.partial(print, flush=True) if rank == 0 else (lambda *_: None)
    log = print_or_drop if rank == 0 else log  # [safety]
    preemption = Preemption()  # [preemption]

    sets = build_datasets(args)
    train_set, val_set = sets
    args.num_classes = args.num_classes or class_count(train_set)
    check_run(args, world_size, device, sets)  # [safety]
    # the loader workers fork now: before the process group's threads, and the model, which each would keep a copy of
    train_sampler, train_batches, val_batches = build_loaders(args, sets, rank, world_size, device)
    ckpt_path = resume_path(args)
    ckpt = read_checkpoint(ckpt_path) if ckpt_path else None
    ckpt = ckpt and foreign_weights(ckpt)  # [foreign-weights]
    check_resume(ckpt_path, ckpt, train_set, args)  # [safety]
    claim_output_dir(args, rank)  # [safety]
    set_seed(args.seed)
    model = build_model(args, args.num_classes)  # the same initial weights on every rank
    set_seed(args.seed + rank)  # but each rank its own dropout draws
    preemption.catch(False)  # [preemption]
    ctrl_c = signal.getsignal(signal.SIGINT)  # Ctrl-C ends the rendezvous' wait at once: no Python handler runs there
    signal.signal(signal.SIGINT, signal.SIG_IGN if ctrl_c is signal.SIG_IGN else signal.SIG_DFL)
    group = start_process_group(args, rank, world_size, device, log)
    signal.signal(signal.SIGINT, ctrl_c)
    preemption.group = group  # [preemption]
    preemption.catch(True)  # [preemption]
    check_ranks_agree(args, sets, ckpt)  # [safety]
    data = f"{args.num_classes} classes, {len(train_set)} train / {len(val_set)} val samples"
    if getattr(train_set, "loader", None) is load_image:  # [fast-decode]
        data += f", JPEGs decoded by {JPEG_DECODER}"  # [fast-decode]
    log(f"{os.path.basename(__file__)}: {describe_processes(args, world_size, device, group)}, {args.arch}, {data}")
    set_tf32(args)  # [tf32]

    model = prepare_model(model, args, device, log)
    optimizer = build_optimizer(model, args, device, log)
    amp_dtype, scaler = setup_precision(model, optimizer, args, device, log)
    steps_per_epoch = max(len(train_batches), 1)  # -e with a train set smaller than -b: no batch, no step
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, steps_per_epoch, args))
    run = RunState(model, optimizer, scheduler, scaler, amp_dtype)
    run.ema = average_model(model, args) if args.model_ema else None  # [ema]
    run.train_samples = len(train_set)  # [safety]
    run.preemption = preemption  # [preemption]
    if ckpt:
        run.load_state_dict(ckpt, args, rank, world_size)
        log(f"resumed from {ckpt_path} (epoch {ckpt.get('epoch', 0)}, step {ckpt.get('step', 0)}), world size "
            f"{ckpt.get('world_size')} -> {world_size}")  # a job resized, a node lost: the same samples, new random
        ckpt = None  # all of it is in place now: keep no second copy of the weights
    run.train_model, run.eval_model = wrap_model(model, args, device, amp_dtype)
    if args.compile:  # [compile]
        run.train_model = compile_model(run.train_model)  # [compile]
    run.profiler = start_profiler(args, rank, device, log)  # [profile]
    if args.benchmark:  # [benchmark]
        return benchmark(run, args, world_size, log, val_set)  # [benchmark]
    if args.evaluate:
        val = evaluate(run.eval_model, val_batches, amp_dtype)
        log(f"val: loss {val['loss']:.6f} acc1 {val['acc1']:.3f} acc5 {val['acc5']:.3f} "
            f"(correct1 {val['correct1']}, correct5 {val['correct5']}, images {val['count']})")
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
        sync_buffers(model)
        val = evaluate(run.eval_model, val_batches, amp_dtype)
        if run.ema:  # [ema]
            sync_buffers(run.ema.module)  # [ema]
            val.update({f"{k}_ema": v for k, v in evaluate(run.ema.module, val_batches, amp_dtype).items()})  # [ema]
        is_best = val["acc1"] > run.best_acc1
        run.epoch, run.best_acc1 = epoch + 1, max(run.best_acc1, val["acc1"])
        run.save(args, rank, is_best)
        row = {"epoch": epoch, "train_loss": train["loss"], "train_acc1": train["acc1"],  # [logs]
               **{f"val_{key}": value for key, value in val.items() if key.startswith(("loss", "acc"))},  # [logs]
               "lr": optimizer.param_groups[0]["lr"], "img_per_s": train["count"] / train_seconds,  # [logs]
               "seconds": time.monotonic() - started}  # [logs]
        if writer:  # [logs]
            write_epoch(row, writer, args.output_dir)  # [logs]
        log(f"Epoch {epoch}: train loss {train['loss']:.4f} acc1 {train['acc1']:.2f} | val loss {val['loss']:.4f} "
            f"acc1 {val['acc1']:.2f} acc5 {val['acc5']:.2f}"
            + (f" | ema acc1 {val['acc1_ema']:.2f}" if "acc1_ema" in val else "")  # [ema]
            + f" | {train['count'] / train_seconds:.0f} img/s")
        if run.preemption.agreed(now=True) and run.epoch < args.epochs:  # [preemption]
            return run.preemption.stop(run, args, rank, log, f"after epoch {epoch}", saved=True)  # [preemption]
    return None


class RunState:
    """What a run carries from step to step and resumes; it alone writes and reads the checkpoint format."""

    def __init__(self, model, optimizer, scheduler, scaler, amp_dtype):
        self.model, self.optimizer, self.scheduler, self.scaler = model, optimizer, scheduler, scaler
        self.amp_dtype, self.train_model, self.eval_model = amp_dtype, model, model
        self.epoch, self.step, self.best_acc1 = 0, 0, 0.0
        self.train_sums = None  # [preemption]
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
                "world_size": len(rng_states), "rng_states": rng_states,
                "train_sums": self.train_sums,  # [preemption]
                "model_ema": self.ema and self.ema.state_dict(),  # [ema]
                "train_samples": self.train_samples,  # [safety]
            }, is_best, args.output_dir)

    def load_state_dict(self, ckpt, args, rank, world_size):
        """Everything back from a checkpoint; only the weights for --evaluate."""
        getattr(self.model, "_orig_mod", self.model).load_state_dict(ckpt["state_dict"])
        if self.ema and ckpt.get("model_ema"):  # [ema]
            self.ema.load_state_dict(ckpt["model_ema"])  # [ema]
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
    """One pass over this rank's share of the data, from step run.step on: the epoch's summary."""
    run.train_model.train()
    metrics = Metrics(next(run.model.parameters()).device)
    steps_per_epoch = run.step + len(batches)
    last_time, last_count = time.monotonic(), 0
    if run.train_sums is not None:  # [preemption]
        metrics.sums += run.train_sums.to(metrics.sums.device)  # [preemption]
        last_count = run.train_sums[3].item()  # [preemption]

    def report(step):
        nonlocal last_time, last_count
        s = metrics.summary()
        check_finite(s, run.epoch, step)  # [safety]
        now = time.monotonic()
        text = (f"loss {s['loss']:.4f} acc1 {s['acc1']:.2f} lr {run.optimizer.param_groups[0]['lr']:.4g} "
                f"{(s['count'] - last_count) / max(now - last_time, 1e-9):.0f} img/s")
        last_time, last_count = now, s["count"]
        log(f"Epoch {run.epoch} [{step:>{len(str(steps_per_epoch))}}/{steps_per_epoch}] {text}")
        return s

    for step, (images, target) in enumerate(batches, start=run.step):
        if run.preemption.agreed():  # [preemption]
            run.step, run.train_sums = step, reduce_tensor(metrics.sums).cpu()  # [preemption]
            return None  # [preemption]
        loss_sum, output = train_step(run, images, target, args)
        metrics.update(loss_sum, output, target)
        if run.profiler:  # [profile]
            run.profiler.step()  # [profile]
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


def join_process_group(args, store, rank, world_size, device):
    """The process group, on a rendezvous store; returns the CPU group the preemption flag is summed over."""
    backend = args.dist_backend or ("nccl" if device.type == "cuda" else "gloo")
    timeout = datetime.timedelta(seconds=args.dist_timeout)  # a new group would wait torch's default 30 minutes
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout,
                            device_id=device if device.type == "cuda" else None)
    if backend != "gloo":  # [preemption]
        return dist.new_group(backend="gloo", timeout=timeout)  # [preemption]
    return dist.group.WORLD


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


def collate(samples):
    """The loaders' collate_fn: uint8 images batched channels-last, as decode and crop leave them (4x cheaper)."""
    if getattr(samples[0][0], "dtype", None) != torch.uint8:
        return default_collate(samples)
    images, labels = default_collate([(image.permute(1, 2, 0), label) for image, label in samples])
    return images.permute(0, 3, 1, 2), labels


def build_loaders(args, sets, rank, world_size, device):
    """(train sampler, train batches, validation batches): each rank's share, on the device (DeviceBatches)."""
    train_set, val_set = sets
    loader_args = dict(batch_size=args.batch_size // world_size, num_workers=args.workers,
                       pin_memory=device.type == "cuda", persistent_workers=args.workers > 0, collate_fn=collate)
    loader_args.update(collate_fn=functools.partial(check_items, num_classes=args.num_classes))  # [safety]
    loader_args.update(worker_init_fn=start_loader_worker)  # [preemption]
    train_data = SeededSamples(train_set)
    train_sampler = TrainSampler(train_data, num_replicas=world_size, rank=rank, seed=args.seed)
    train_loader = DataLoader(train_data, sampler=train_sampler, drop_last=True, **loader_args)
    val_loader = DataLoader(val_set, sampler=range(rank, len(val_set), world_size),  # each sample once, unpadded
                            **{**loader_args, "pin_memory": False})  # fork_loader_workers says why
    fork_loader_workers(val_loader, train_loader)
    mean, std = getattr(train_set, "mean", None), getattr(train_set, "std", None)  # the data's own normalization
    normalize = NORMALIZE if mean is None else {len(mean): (mean, std)}
    return (train_sampler, DeviceBatches(train_loader, device, args.channels_last, normalize),
            DeviceBatches(val_loader, device, args.channels_last, normalize))


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


class SyntheticImages(Dataset):
    """--dummy: a learnable stand-in for ImageNet, colour and stripes by class, noise by image, alike on every call."""

    def __init__(self, size, num_classes, image_size, transform, offset=0):
        self.size, self.num_classes, self.image_size = size, num_classes, image_size
        self.transform, self.offset = transform, offset
        g = torch.Generator().manual_seed(12345)
        self.colours = torch.rand(num_classes, 3, 1, 1, generator=g) * 160 + 48

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        target = index % self.num_classes
        g = torch.Generator().manual_seed(self.offset + index)
        wave = torch.sin(torch.arange(self.image_size) * (target % 5 + 1) * torch.pi / 8) * 24
        stripes = wave[:, None] if target % 2 else wave[None, :]
        img = self.colours[target] + stripes + torch.randn(3, self.image_size, self.image_size, generator=g) * 24
        return self.transform(img.clamp(0, 255).to(torch.uint8)), target


class DeviceBatches:
    """A loader's batches on the device (no wait), uint8 images made floats there, normalized by `normalize`."""

    def __init__(self, loader, device, channels_last, normalize):
        self.loader, self.device = loader, device
        self.normalize = {channels: [torch.tensor(v, device=device).view(1, -1, 1, 1) * 255 for v in mean_std]
                          for channels, mean_std in normalize.items()}
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format

    def __len__(self):
        return len(self.loader)

    def __iter__(self):
        for images, target in self.loader:
            images = images.to(self.device, non_blocking=True)
            target = target.to(self.device, non_blocking=True).long()  # any integer labels: cross_entropy's int64
            images = images.contiguous(memory_format=self.memory_format) if images.dim() == 4 else images
            if images.dtype == torch.uint8:
                mean, std = self.normalize.get(images.shape[1], (0, 255))  # other channel counts: 0-1
                images = images.float().sub_(mean).div_(std)
            yield images, target


def accuracy(output, target, topk=(1, 5)):
    """How many samples have their target among the top-k outputs, for each k (a device tensor)."""
    maxk = min(max(topk), output.size(1))
    hits = output.topk(maxk, dim=1).indices.eq(target[:, None])
    return torch.stack([hits[:, :min(k, maxk)].any(dim=1).sum() for k in topk])


class Metrics:
    """Running sums (loss, top-1 and top-5 hits, samples) on the device: no wait for the GPU until `summary`."""

    def __init__(self, device):
        self.sums = torch.zeros(4, dtype=torch.float64, device=device)

    def update(self, loss_sum, output, target):
        count = torch.full((1,), target.numel(), dtype=torch.float64, device=target.device)
        hits = accuracy(output.detach(), target).double()
        self.sums += torch.cat([loss_sum.detach().double().reshape(1), hits, count])

    def summary(self):
        loss, c1, c5, n = reduce_tensor(self.sums).tolist()
        n_ = max(n, 1)
        return {"loss": loss / n_, "acc1": 100 * c1 / n_, "acc5": 100 * c5 / n_,
                "correct1": int(c1), "correct5": int(c5), "count": int(n)}


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


# =============================================================================================
# Part 2, features: a block each, for the flags its first line names. Keep what you use, delete the rest by markers.
# =============================================================================================
# region [ema]: --model-ema, --model-ema-decay, --model-ema-steps: an average of the weights, evaluated too
def average_model(model, args):
    """An exponential moving average of the weights and BatchNorm statistics (rank 0's: sync_buffers before use)."""
    decay = swa_utils.get_ema_multi_avg_fn(args.model_ema_decay)
    return swa_utils.AveragedModel(model, multi_avg_fn=decay, use_buffers=True)
# endregion [ema]
# region [pretrained]: --pretrained: start from torchvision's weights for --arch
def load_pretrained(model, args):
    """torchvision's weights for --arch into every layer whose shape fits: for fewer classes, all but the classifier."""
    weights = torchvision.models.get_model_weights(args.arch).DEFAULT
    pretrained, own = weights.get_state_dict(progress=False), model.state_dict()
    model.load_state_dict({k: v for k, v in pretrained.items() if k in own and own[k].shape == v.shape}, strict=False)
# endregion [pretrained]
# region [foreign-weights]: -e and --resume of weights other programs saved: a bare state dict, wrappers' prefixes
def foreign_weights(ckpt):
    """Weights alone (torch.save(model.state_dict())'s, which -e evaluates) as a checkpoint, and its keys without a
    DDP or DataParallel wrapper's prefix, torch.compile's (nanoGPT saves it), or both in either order."""
    if isinstance(ckpt, dict) and ckpt and all(isinstance(v, torch.Tensor) for v in ckpt.values()):
        ckpt = {"state_dict": ckpt}
    for prefix in ("module.", "_orig_mod.", "module."):
        consume_prefix_in_state_dict_if_present(ckpt.get("state_dict", {}), prefix)
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
# region [sync-bn]: --sync-bn: BatchNorm statistics over every process's batch (CUDA only)
def sync_batchnorm(model, args, device, log):
    """SyncBatchNorm in place of every BatchNorm, with --sync-bn on CUDA; on the CPU the statistics stay per process."""
    if args.sync_bn and device.type == "cuda":
        return torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    if args.sync_bn:
        log("--sync-bn: off on CPU (SyncBatchNorm needs CUDA); BatchNorm statistics stay per process")
    return model
# endregion [sync-bn]
# region [profile]: --profile: where the step time goes
def start_profiler(args, rank, device, log):
    """--profile STEPS: torch.profiler over training steps 3 to STEPS + 2 (no autotuning, warm), a trace per rank in
    <output-dir>/profile (Perfetto, TensorBoard; HolisticTraceAnalysis: how far communication overlaps computation),
    and the operators that took the most time in rank 0's log."""
    if not args.profile:
        return None
    cuda = device.type == "cuda"
    write_trace = torch.profiler.tensorboard_trace_handler(os.path.join(args.output_dir, "profile"), f"rank{rank}")

    def done(profiler):
        write_trace(profiler)
        table = profiler.key_averages().table(sort_by=f"self_{'device' if cuda else 'cpu'}_time_total", row_limit=12)
        log(f"profile: {args.profile} steps, the operators that took the most time:\n{table}")

    activities = [torch.profiler.ProfilerActivity.CPU] + [torch.profiler.ProfilerActivity.CUDA] * cuda
    schedule = torch.profiler.schedule(wait=1, warmup=1, active=args.profile, repeat=1)
    profiler = torch.profiler.profile(activities=activities, schedule=schedule, on_trace_ready=done)
    profiler.start()
    return profiler
# endregion [profile]
# region [benchmark]: --benchmark N: the training speed without the input pipeline
def benchmark(run, args, world_size, log, val_set):
    """Model, step and all-reduce on one batch on the device, the first validation input repeated."""
    device, local_batch = next(run.model.parameters()).device, args.batch_size // world_size
    example = val_set[0][0].to(device).float()
    images = example.expand(local_batch, *example.shape).contiguous()
    images = images.contiguous(memory_format=torch.channels_last) if args.channels_last else images
    batch = images, torch.zeros(local_batch, dtype=torch.int64, device=device)
    for steps in (max(args.benchmark // 10, 1), args.benchmark):  # a warm-up, then the timed run
        started = time.monotonic()
        train = train_one_epoch(run, [batch] * steps, args, log)
        if train is None:
            return None
    log(f"benchmark: {train['count'] / (time.monotonic() - started):.0f} img/s over {steps} steps, {world_size} "
        f"processes, global batch {args.batch_size}, {args.arch} at {args.crop_size} px, autocast {run.amp_dtype}; "
        f"{memory_use(run, device)}")


def memory_use(run, device):
    """This process's weights, gradients and optimizer state (a sharded model's shards), and its peak (CPU: the RSS)."""
    params = list(run.model.parameters())
    state = [value for per_param in run.optimizer.state.values() for value in per_param.values()]
    held = sum(getattr(t, "_local_tensor", t).nbytes for t in [*params, *(p.grad for p in params), *state]
               if isinstance(t, torch.Tensor))  # a DTensor's _local_tensor: this rank's shard
    peak = (torch.cuda.max_memory_allocated(device) if device.type == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)  # KiB on Linux
    return f"model state {held / 2**20:.0f} MiB, peak memory {peak / 2**20:.0f} MiB per process"
# endregion [benchmark]
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
# region [tf32]: --no-tf32: TF32 matmuls and convolutions on Ampere and newer GPUs
def set_tf32(args):
    """TF32 on Ampere and later: fp32 matmuls and convolutions with a 10-bit mantissa, several times faster; or not."""
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = not args.no_tf32
# endregion [tf32]
# region [compile]: --compile: the model that trains, compiled by torch.compile
def compile_model(model):
    """The wrapped model, compiled; inductor's relayout, which fails a convolution's backward under DDP, stays off."""
    torch._inductor.config.layout_optimization = False
    return torch.compile(model)
# endregion [compile]
# region [fast-decode]: JPEGs decoded by torchcodec (libjpeg-turbo, without PIL's overhead) where it loads
try:
    from torchcodec.decoders import decode_jpeg
    JPEG_DECODER = "torchcodec"
except Exception as e:  # not installed, or its libraries (FFmpeg's, torch's) do not fit
    decode_jpeg, JPEG_DECODER = None, f"PIL, slower: torchcodec did not load ({' '.join(str(e).split())[:300]})"


def decode_file(path):
    """The JPEG at `path` as an RGB uint8 CxHxW tensor, decoded by torchcodec; None for what it cannot take (a PNG
    named .JPEG, a file cut short) and where it does not load: PIL decodes those (load_image), to the same pixels."""
    if decode_jpeg is not None:
        with contextlib.suppress(RuntimeError):
            return decode_jpeg(path)
    return None
# endregion [fast-decode]
# region [fast-crop]: the training crop in one step, faster than torchvision's v2 transforms
def random_resized_crop_flip(image, size):
    """v2.RandomResizedCrop(size) and v2.RandomHorizontalFlip() on a uint8 CxHxW tensor, drawn by one call to torch's
    generator (v2's forty cost 5% of the input pipeline), cut channels-last and resized by v2's antialiased kernel."""
    height, width = image.shape[1:]
    u = torch.rand(23).tolist()
    for k in range(0, 20, 2):  # v2's ten tries: 8-100% of the area, aspect 3:4 to 4:3 (log-uniform)
        area, aspect = height * width * (0.08 + 0.92 * u[k]), 0.75 * (16 / 9) ** u[k + 1]
        h, w = round((area / aspect) ** 0.5), round((area * aspect) ** 0.5)
        if 0 < h <= height and 0 < w <= width:
            top, left = int(u[20] * (height - h + 1)), int(u[21] * (width - w + 1))
            break
    else:  # none fits (a long image): v2's fallback, the whole image cut to 4:3 at most, centred
        h, w = min(height, round(width * 4 / 3)), min(width, round(height * 4 / 3))
        top, left = (height - h) // 2, (width - w) // 2
    crop = image[None, :, top:top + h, left:left + w].contiguous(memory_format=torch.channels_last)
    crop = F.interpolate(crop, size=[size, size], mode="bilinear", antialias=True, align_corners=False)[0]
    return crop.flip(-1) if u[22] < 0.5 else crop
# endregion [fast-crop]
# region [spec]: --arch and --dataset MODULE:FUNCTION: your own model and data without editing this file
def call_spec(spec, *args, **kwargs):
    """What --arch's or --dataset's MODULE:FUNCTION returns, imported from the current directory or PYTHONPATH."""
    module, _, name = spec.partition(":")
    sys.path.append(os.getcwd())
    return getattr(importlib.import_module(module), name)(*args, **kwargs)


def image_size(sets):
    """The side of a --dataset's first training image (uint8 CxHxW), the largest --crop-size for it; else None."""
    image = sets[0][0][0] if sets else None
    fits = isinstance(image, torch.Tensor) and image.dtype == torch.uint8 and image.ndim == 3
    return image.shape[-1] if fits else None


class ImageCrops(Dataset):
    """A --dataset's set, its uint8 CxHxW images cropped by `transform`; its class count and (mean, std) its own."""

    def __init__(self, dataset, transform):
        self.dataset, self.transform, self.num_classes = dataset, transform, class_count(dataset)
        self.mean, self.std = getattr(dataset, "mean", None), getattr(dataset, "std", None)

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        inputs, label = self.dataset[index]
        fits = isinstance(inputs, torch.Tensor) and inputs.dtype == torch.uint8 and inputs.ndim == 3
        return (self.transform(inputs) if fits else inputs), label
# endregion [spec]
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


def explain_unreadable_image(load_image):
    """load_image; a file it cannot read (missing, cut short, not an image, too large for PIL: a decompression bomb)
    stops the rank whose loader met it, in one line that names the file."""
    @functools.wraps(load_image)  # (pickled by name, as a spawned loader worker takes it)
    def load(path):
        try:
            return load_image(path)
        except Exception as e:
            raise RankError(f"cannot read image {path} ({e}): replace or remove the file") from None
    return load


def check_address(address, named):
    """A rendezvous host name that does not resolve, named as the user gave it: every rank would wait for it until
    --dist-timeout (30 minutes by default)."""
    try:
        socket.getaddrinfo(address, None)
    except OSError as e:
        raise RankError(f"{named} does not resolve ({e.strerror}): give the address of the node of rank 0") from None


def check_slurm_task():
    """A task's Slurm variables in a process that no task of that job started (a shell that outlived its job, in
    tmux, or a copy exported by hand): its peers would never come, and it would wait for them until --dist-timeout."""
    task, pid = int(os.environ.get("SLURM_TASK_PID", 0)), os.getpid()
    while task and pid > 1 and pid != task:
        with open(f"/proc/{pid}/stat") as f:
            pid = int(f.read().rsplit(")", 1)[1].split()[1])  # the field after the state: the parent
    if task and pid != task:
        raise RankError(f"the SLURM_* variables are job {os.environ.get('SLURM_JOB_ID')}'s, whose task {task} is not "
                        f"this process or a parent of it: start the script with srun, or unset them to run one process")


def check_launch_args(args, world_size, device):
    """The flags this launcher reads its own way, checked before any process waits for another: none here. Part of
    the launcher interface (each sibling checks its own), called by check_run alone."""


def check_run(args, world_size, device, sets):
    """Bad input that would train on the wrong thing without a word, before the loaders start: flags that do not fit
    together or the world size, data whose classes, labels or normalization training would take wrongly."""
    if args.batch_size % world_size:
        raise UserError(f"--batch-size {args.batch_size} is the global batch and must divide by the world size "
                        f"{world_size}: use e.g. {max(args.batch_size // world_size, 1) * world_size}")
    if args.batch_size // world_size % args.grad_accum_steps:
        raise UserError(f"--grad-accum-steps {args.grad_accum_steps} must divide each process's batch "
                        f"{args.batch_size // world_size} (-b {args.batch_size} / {world_size} processes)")
    if args.val_resize and args.val_resize < args.crop_size:
        raise UserError(f"--val-resize {args.val_resize} is smaller than --crop-size {args.crop_size}: the center "
                        f"crop would be padded with black; give --val-resize {args.crop_size} or more")
    if args.dummy and args.data:
        raise UserError(f"--dummy makes its own data, and {args.data} names a folder: give one of them")
    if args.pretrained and ":" in args.arch:  # [pretrained]
        raise UserError(f"--pretrained loads torchvision's weights, and --arch {args.arch} is your own "  # [pretrained]
                        f"model: load its weights inside {args.arch.split(':')[-1]}, or drop it")  # [pretrained]
    check_launch_args(args, world_size, device)
    train_set, val_set = sets
    if len(train_set) < args.batch_size and not (args.evaluate or getattr(args, "benchmark", 0)):  # neither trains
        raise UserError(f"{len(train_set)} training samples are fewer than one global batch of {args.batch_size}: "
                        f"lower -b")
    classes = [getattr(data, "classes", None) for data in sets]  # an ImageFolder's: its class folders, sorted
    if all(isinstance(names, list) for names in classes) and classes[0] != classes[1]:
        odd = ", ".join(sorted(set(classes[0]) ^ set(classes[1]))[:3]) or "the same names in another order"
        raise UserError(f"the train and val sets have different classes ({odd}): give both the same (an image "
                        f"folder: the same class folders), or the labels of one would not be the other's")
    if not isinstance(args.num_classes, int):
        raise UserError(f"the train set has no number of classes ({args.num_classes!r}): give --num-classes N, or "
                        f"the set an attribute num_classes = N (a Python int) or classes, a list of N names")
    mean, std = getattr(train_set, "mean", None), getattr(train_set, "std", None)
    if mean is not None and not (all(0 <= m <= 1 for m in mean) and all(0 < s <= 1 for s in std)):
        raise UserError(f"the train set's mean {mean!r} and std {std!r} must be in 0-1 units (0-255 ones divided "
                        f"by 255), every std above 0")


def check_image_folder(data):
    """build_datasets' folder: DIR, and train/ and val/ in it (ImageFolder's own error would name one path only)."""
    if not (data and os.path.isdir(data)):
        raise UserError(f"data folder {data!r} not found: give a folder with train/ and val/ inside, or --dummy")
    for root in (os.path.join(data, "train"), os.path.join(data, "val")):
        if not os.path.isdir(root):
            raise UserError(f"{root} not found: DIR must hold train/ and val/, one folder per class")


def check_resume(path, ckpt, train_set, args):
    """-e with no trained weights to evaluate, and a checkpoint the command line does not fit: another model, flags
    whose values its state holds (given anew, they would be ignored; --seed drew the order of an epoch it goes on
    with), or a training set of another size (its step and schedule count that set's batches)."""
    own_weights = getattr(args, "pretrained", False) or ":" in getattr(args, "arch", "")  # they may load their own
    if args.evaluate and not ckpt and (args.resume or not own_weights):
        where = f"--output-dir {args.output_dir} holds no checkpoint" if args.resume else "no --resume PATH is given"
        raise UserError(f"-e evaluates trained weights, and {where}: give --resume PATH (a checkpoint, or weights "
                        f"saved with torch.save(model.state_dict(), PATH)), or the --output-dir of the run")
    if not ckpt:
        return
    if ckpt.get("arch", args.arch) != args.arch:
        raise UserError(f"{path} holds a {ckpt['arch']} model, not {args.arch}: pass -a {ckpt['arch']} or another "
                        f"checkpoint")
    trained = ckpt.get("args", {}) if not args.evaluate else {}
    for flag in ("dropout", "opt", "batch_size", "no_wd_norm_bias", "lr", "momentum", "weight_decay", "seed"):
        if flag in trained and trained[flag] != getattr(args, flag, trained[flag]):
            name = "--" + flag.replace("_", "-")
            raise UserError(f"{path} was trained with {name} {trained[flag]}, this run has {name} "
                            f"{getattr(args, flag)}: continue it with {name} {trained[flag]}, or train without "
                            f"--resume")
    if ckpt.get("train_samples", len(train_set)) != len(train_set) and not args.evaluate:
        raise UserError(f"{path} was trained on {ckpt['train_samples']} training samples, this run has "
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


def check_items(samples, num_classes):
    """collate, in the loader workers, after one line from the rank whose loader met them for items that cannot make
    a batch (not (input, label) pairs, inputs of other shapes or dtypes) and for labels that are not integers from 0
    to num_classes - 1 (a float label cut to an integer; one past the class count: a GPU's device-side assert)."""
    kinds = sorted({f"{'x'.join(map(str, x.shape))} {str(x.dtype).replace('torch.', '')}"
                    if isinstance(x, torch.Tensor) else type(x).__name__
                    for x, *_ in (s if isinstance(s, (tuple, list)) else (s,) for s in samples)})
    if len(kinds) > 1 or not all(isinstance(s, (tuple, list)) and len(s) == 2 for s in samples):
        raise RankError(f"the data's items differ within a batch (inputs {', '.join(kinds[:3])}), or are not "
                        f"(input, label) pairs: every item's input must have one shape and dtype; crop or pad it in "
                        f"the dataset")
    bad = [label for _, label in samples if not label_fits(label, num_classes)]
    if bad:
        raise RankError(f"a label is {bad[0]!r}; with {num_classes} classes (--num-classes, or the data's count) "
                        f"labels are integers from 0 to {num_classes - 1}: fix the data, or give --num-classes")
    return collate(samples)


def label_fits(label, num_classes):
    """A label as training takes it, collated into a batch: one integer (Python's, numpy's, a tensor of shape ())
    from 0 to num_classes - 1."""
    try:
        target = default_collate([label])
        torch.iinfo(target.dtype)  # an integer dtype: not bool
    except Exception:  # None, a float, a bool, a string, an int beyond int64
        return False
    return target.shape == (1,) and 0 <= int(target) < num_classes


def check_finite(summary, epoch, step):
    """Stops every rank (they all see the same sums) when a loss was NaN or inf, before a checkpoint would keep it."""
    if not abs(summary["loss"]) < float("inf"):
        raise UserError(f"loss became NaN/inf at epoch {epoch} step {step}; stopped without saving it: lower --lr, "
                        f"add --warmup-epochs, or check the model and the data")


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
load_image = explain_unreadable_image(load_image)
save_checkpoint = explain_failed_save(save_checkpoint)
DeviceBatches.__iter__ = explain_short_loader(DeviceBatches.__iter__)
# endregion [safety]


if __name__ == "__main__":
    main()
