"""Test harness: launches the scripts the way users do (torchrun, python) on CPU with gloo, on tiny
generated data, and checks that no process outlives its job."""
import contextlib
import fcntl
import importlib.metadata
import importlib.util
import itertools
import json
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist
import torchvision
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
TORCHRUN = str(BIN / "torchrun")
# torchrun of this Python: its script, or (a system or --user install puts the script elsewhere) its module
TORCHRUN_CMD = [TORCHRUN] if os.path.exists(TORCHRUN) else [sys.executable, "-m", "torch.distributed.run"]
# tests/gpu is the GPU acceptance suite: scripts/test_gpu.sh runs it (GPU_SUITE=1); GPU_SUITE_ON_CPU=1 tries its
# code on the CPU. The CPU suite (`pytest tests`) leaves it out.
collect_ignore = [] if os.environ.get("GPU_SUITE") == "1" or os.environ.get("GPU_SUITE_ON_CPU") == "1" else ["gpu"]
# small images, no loader workers unless a test asks, no progress lines unless a test asks
FAST = ["--crop-size", "32", "--val-resize", "36", "-j", "0", "-p", "1000", "-b", "16", "--lr", "0.005"]
# bit-identical reruns, and a progress line every step to wait for
RESUME = [*FAST, "--deterministic", "-p", "1"]
# epochs of the reference run that resumed runs and other launchers must equal. Its validation accuracy
# swings from epoch to epoch (BatchNorm's running statistics lag behind 12 fast steps an epoch): three
# epochs reached 70% on one CPU and only 50% on another; four reached it on both, and for 8 of 8 data seeds
EPOCHS = 4
CHECKPOINT_KEYS = {"epoch", "step", "arch", "state_dict", "optimizer", "scheduler", "scaler", "best_acc1", "args",
                   "world_size", "rng_states", "train_sums", "model_ema", "train_samples"}
# the scripts' exit code for a run stopped before its last epoch, its checkpoint saved ("resume me")
PREEMPTED = 75
# torchrun's and horovodrun's exit code for a job one of whose processes exited non-zero (75 included)
LAUNCHER_FAILED = 1
# torchrun itself, signalled, once aborted as its interpreter exited, its workers done (seen once in CI, under
# load): a C++ thread of torch's, not the script's; assert_preempted takes that exit too, and checks the rest
TORCHRUN_ABORT = "terminate called without an active exception"
# what a training run leaves in --output-dir (run.lock: the lock a second run given the folder stops at)
OUTPUT_FILES = ["checkpoint.pth.tar", "metrics.jsonl", "model_best.pth.tar", "run.lock", "tb"]
COLOURS = [(220, 40, 40), (40, 200, 60), (50, 70, 230), (230, 210, 40)]


class Job:
    """A launched command. Every process it starts, however far down and even in a session of its own
    (torchrun starts workers that way), inherits a marker in its environment, so none can escape."""

    started = []
    count = itertools.count()

    def __init__(self, cmd, env=None, cwd=None):
        self.cmd = [str(c) for c in cmd]
        self.marker = f"{os.getpid()}.{next(Job.count)}"
        full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TEST_JOB": self.marker,
                    **{k: str(v) for k, v in (env or {}).items()}}
        # SIGINT as a terminal leaves it: pytest started as a background job (`bash -c 'pytest &'`) ignores it,
        # and its children would inherit that, so a test of Ctrl-C would measure how the suite was started
        self.proc = subprocess.Popen(self.cmd, cwd=cwd or ROOT, env=full_env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True,
                                     preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        self.lines = []
        # read by a thread of its own, so that waiting for a line times out also when the job prints nothing
        self.unread = queue.Queue()
        threading.Thread(target=lambda: [*map(self.unread.put, self.proc.stdout), self.unread.put(None)],
                         daemon=True).start()
        Job.started.append(self)

    def read(self, deadline, until=lambda line: False):
        """Takes the job's output into self.lines until a line satisfies `until` (returns it), or its end
        (returns None); False at the deadline."""
        while True:
            try:
                line = self.unread.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return False
            if line is None:
                self.unread.put(None)  # the end stays the end for the next read
                return None
            self.lines.append(line)
            if until(line):
                return line

    def wait_for_line(self, text, timeout=120):
        """Read output until a line contains `text`; returns that line."""
        line = self.read(time.monotonic() + timeout, until=lambda line: text in line)
        if not line:
            self.give_up(f"never saw {text!r} in the output of {' '.join(self.cmd)} "
                         f"({'it ended' if line is None else f'within {timeout}s'}):")
        return line

    def give_up(self, why):
        """Fails the test with why, the job's output and its stacks (taken before the job is killed)."""
        stacks = self.stacks()
        self.kill()
        pytest.fail(f"{why}\n{self.output}\n{stacks}")

    def stacks(self):
        """Where each Python process of the job is now, every thread (py-spy dump): what a job that timed out was
        waiting for, in CI's log, where nobody can attach a debugger. Processes that are not Python are left out."""
        dumps = []
        for p in self.processes():
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                dump = subprocess.run([BIN / "py-spy", "dump", "--pid", str(p.pid)], capture_output=True, text=True,
                                      timeout=30)
                dumps.append(dump.stdout if dump.returncode == 0 else f"py-spy on {p.pid}: {dump.stderr.strip()}")
        return "\n".join(dumps)

    def processes(self):
        found = []
        for p in psutil.process_iter():
            try:
                if p.environ().get("TEST_JOB") == self.marker:
                    found.append(p)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                pass
        return found

    def process_of_rank(self, rank, variable="RANK"):
        """The training process that its launcher gave `variable`=rank (not its loader workers)."""
        def is_rank(p):
            return "python" in p.name() and p.environ().get(variable) == str(rank)
        matches = [p for p in self.processes() if is_rank(p)]
        return next(p for p in matches if not is_rank(p.parent()))

    def spawned(self):
        """The worker processes torch.multiprocessing.spawn started, in local rank order."""
        children = psutil.Process(self.proc.pid).children()
        return sorted((p for p in children if "spawn_main" in " ".join(p.cmdline())), key=lambda p: p.pid)

    def finish(self, timeout=300):
        deadline = time.monotonic() + timeout
        try:
            if self.read(deadline) is False:
                raise subprocess.TimeoutExpired(self.cmd, timeout)
            self.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.give_up(f"timed out after {timeout}s: {' '.join(self.cmd)}")
        self.assert_no_leftovers()
        return self

    def assert_no_leftovers(self, grace=15):
        """DataLoader workers notice a dead parent within seconds; anything alive after `grace` is an orphan."""
        deadline = time.monotonic() + grace
        while self.processes() and time.monotonic() < deadline:
            time.sleep(0.2)
        orphans = self.kill_all()
        assert not orphans, f"processes left behind by {' '.join(self.cmd)}: {orphans}"

    def kill_all(self):
        """Kills what is left and waits until it is gone; returns (pid, command line) of each."""
        killed = []
        for p in self.processes():
            with contextlib.suppress(psutil.Error):
                killed.append((p.pid, " ".join(p.cmdline())[:150]))
                p.kill()
        deadline = time.monotonic() + 10
        while killed and self.processes() and time.monotonic() < deadline:
            time.sleep(0.1)
        return killed

    def kill(self):
        self.kill_all()
        self.proc.wait()
        self.read(time.monotonic() + 10)

    @property
    def output(self):
        return "".join(self.lines)

    @property
    def returncode(self):
        return self.proc.returncode


def run(cmd, timeout=300, **kwargs):
    return Job(cmd, **kwargs).finish(timeout)


def torchrun(script, nproc, *args, launcher_args=(), **kwargs):
    return Job([*TORCHRUN_CMD, "--standalone", f"--nproc_per_node={nproc}", *launcher_args, ROOT / script, *args],
               **kwargs)


def two_nodes(script, *args, node_args=lambda node: [], nproc=1, **kwargs):
    """Two nodes emulated on this machine, as on two hosts: two torchrun agents (--nnodes=2, --node-rank 0
    and 1) that meet at one --rdzv-endpoint. node_args(node) adds what differs per node (its own folders)."""
    endpoint = f"127.0.0.1:{free_port()}"
    return [Job([*TORCHRUN_CMD, "--nnodes=2", f"--node-rank={node}", f"--nproc_per_node={nproc}",
                 f"--rdzv-endpoint={endpoint}", ROOT / script, *args, *node_args(node)], **kwargs) for node in (0, 1)]


def python(script, *args, **kwargs):
    return Job([sys.executable, ROOT / script, *args], **kwargs)


def spawn(script, nprocs, *args, **kwargs):
    """`python script --nprocs N`: the script starts its own processes (torch.multiprocessing.spawn)."""
    return python(script, "--nprocs", nprocs, *args, **kwargs)


# a dataset slow to build: each rank marks when it is building it, for a test to signal the job then
SLOW_START = '''
import os
import time

import torch


def rows(args):
    open(os.path.join(os.environ["STARTED"], str(os.getpid())), "w").close()
    time.sleep(float(os.environ.get("PAUSE_RANK" + os.environ.get("RANK", "0"), 3)))
    data = torch.utils.data.TensorDataset(torch.randn(64, 20), torch.arange(64) % 2)
    return data, data


def linear(num_classes):
    open(os.path.join(os.environ["STARTED"], os.pardir, "built"), "w").close()  # its rank starts the process group next
    return torch.nn.Linear(20, num_classes)
'''


OWN_ROWS = '''
import os, signal, torch
def rows(args):  # learnable: the label is the sign of the first feature
    inputs = torch.randn(64, 20, generator=torch.Generator().manual_seed(0))
    data = torch.utils.data.TensorDataset(inputs, (inputs[:, 0] > 0).long())
    return data, data
'''


def own_rows(tmp_path, model):
    """A tiny run on 64 rows of 20 features in 2 classes, its model `linear(num_classes)` defined in `model` (which
    may hook what a test needs into it): (its flags, its environment)."""
    (tmp_path / "own.py").write_text(OWN_ROWS + model)
    return ["--dataset", "own:rows", "-a", "own:linear", "--num-classes", "2", "-b", "8"], {"PYTHONPATH": tmp_path}


def slow_start(tmp_path, ranks=2):
    """A tiny run whose ranks each pause 3 s while they build their datasets (PAUSE_RANKn in the environment: rank n
    another time), and that makes tmp_path/built as a rank starts its process group: (its flags, its environment, a
    function that waits until all `ranks` are in that pause)."""
    (tmp_path / "slow.py").write_text(SLOW_START)
    started = tmp_path / "started"
    started.mkdir()

    def wait_for_ranks(timeout=120):
        deadline = time.monotonic() + timeout
        while len(list(started.iterdir())) < ranks:
            assert time.monotonic() < deadline, f"fewer than {ranks} ranks built their datasets within {timeout}s"
            time.sleep(0.1)

    flags = ["--dataset", "slow:rows", "-a", "slow:linear", "--num-classes", "2", "-b", "8", "-j", "2", "-p", "1",
             "--epochs", "1", "--output-dir", tmp_path / "out"]
    return flags, {"PYTHONPATH": tmp_path, "STARTED": started}, wait_for_ranks


# Ports the kernel picks (bind to port 0; the local end of every outgoing connection) come from its ephemeral range
# (32768-60999 on Linux), where another connection may take a port between free_port() and the job's bind. The
# concurrent pytest processes of scripts/gpu_suite.py (TEST_PORT_BLOCK=0, 1, ...: from port 20000) and pytest-xdist's
# workers (gw0, gw1, ...: from port 10000, below distributed_slurm_main.py's 20000 + job id) each take ports in turn
# from a block of their own below it.
PORT_BLOCK_SIZE = 200
XDIST_WORKER = None  # this pytest-xdist worker's id (gw0, gw1, ...): set by pytest_configure
_next_port = itertools.count()


def first_port():
    """The first port of this process's block; None: the kernel picks."""
    if os.environ.get("TEST_PORT_BLOCK") is not None:
        return 20000 + int(os.environ["TEST_PORT_BLOCK"]) * PORT_BLOCK_SIZE
    if XDIST_WORKER is not None:
        return 10000 + int(XDIST_WORKER.removeprefix("gw")) * PORT_BLOCK_SIZE
    return None


def free_port():
    first = first_port()
    if first is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    for _ in range(PORT_BLOCK_SIZE):
        port = first + next(_next_port) % PORT_BLOCK_SIZE
        with socket.socket() as s, contextlib.suppress(OSError):
            s.bind(("127.0.0.1", port))
            return port
    raise RuntimeError(f"no free port in {first}-{first + PORT_BLOCK_SIZE - 1} (TEST_PORT_BLOCK="
                       f"{os.environ.get('TEST_PORT_BLOCK')}, pytest-xdist worker {XDIST_WORKER})")


def error_lines(text):
    """The `error: ...` lines of a job's output: what the scripts print on bad input."""
    return [line for line in text.splitlines() if line.startswith("error: ")]


def ok(job, timeout=300):
    job.finish(timeout)
    assert job.returncode == 0, job.output
    return job


def started(pid, tid=None):
    """When a process (or one of its threads) started: clock ticks since boot, /proc's starttime."""
    stat = Path(f"/proc/{pid}" + (f"/task/{tid}" if tid else "") + "/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[19])


def threads_started(process, name):
    """When each of the process's threads whose name holds `name` started (started's clock)."""
    return [started(process.pid, t.id) for t in process.threads()
            if name in Path(f"/proc/{process.pid}/task/{t.id}/comm").read_text()]


def import_script(script):
    """A top-level script as a module (its main() does not run), to test its parts directly."""
    spec = importlib.util.spec_from_file_location(Path(script).stem, ROOT / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load(path):
    return torch.load(path, map_location="cpu", weights_only=True)


def strict_json(constant):
    raise AssertionError(f"{constant} in metrics.jsonl: not JSON, which has null for it")


def metrics(out):
    """metrics.jsonl's rows, as a strict JSON reader takes them (jq, JavaScript: no NaN, no Infinity)."""
    return [json.loads(line, parse_constant=strict_json) for line in (out / "metrics.jsonl").read_text().splitlines()]


def assert_same_tensors(a, b, exact=True, rtol=1e-4, atol=1e-6):
    """Every tensor in two nested state dicts is equal (bit for bit, or allclose)."""
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b) if exact else torch.allclose(a, b, rtol=rtol, atol=atol)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            assert_same_tensors(a[key], b[key], exact, rtol, atol)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same_tensors(x, y, exact, rtol, atol)


def ema_weights(ckpt):
    """The --model-ema average of a checkpoint as the model's own state dict (the checkpoint holds swa_utils'
    AveragedModel's: the model's under "module.", and the count of its updates)."""
    return {k.removeprefix("module."): v for k, v in ckpt["model_ema"].items() if k != "n_averaged"}


def profile_traces(out):
    """The --profile traces in `out`, by rank: the events of each (Perfetto's format, which TensorBoard reads too)."""
    found = {int(path.name.split(".")[0].removeprefix("rank")): path for path in (out / "profile").iterdir()}
    return {rank: json.loads(found[rank].read_text())["traceEvents"] for rank in sorted(found)}


def assert_same_run(out, reference, epochs=EPOCHS):
    """Same weights and optimizer state bit for bit, same metrics.jsonl but for the timings."""
    a, b = load(out / "checkpoint.pth.tar"), load(reference / "checkpoint.pth.tar")
    assert a["epoch"] == b["epoch"] == epochs
    assert_same_tensors(a["state_dict"], b["state_dict"])
    assert_same_tensors(a["optimizer"], b["optimizer"])
    assert len(metrics(out)) == len(metrics(reference))
    for x, y in zip(metrics(out), metrics(reference)):
        assert {k: v for k, v in x.items() if k not in ("img_per_s", "seconds")} == pytest.approx(
            {k: v for k, v in y.items() if k not in ("img_per_s", "seconds")}, rel=1e-9)


def assert_learned(out, epochs):
    """One metrics line per epoch (only rank 0 wrote), accuracy well above chance (4 classes: 25%),
    the same scalars in TensorBoard, a complete checkpoint that loads into a plain model."""
    rows = metrics(out)
    assert [r["epoch"] for r in rows] == list(range(epochs))
    assert set(rows[0]) == {"epoch", "train_loss", "train_acc1", "val_loss", "val_acc1", "val_acc5", "lr",
                            "img_per_s", "seconds"}
    assert max(r["val_acc1"] for r in rows) >= 70, rows
    assert rows[-1]["train_acc1"] >= 60 and rows[-1]["train_loss"] < rows[0]["train_loss"], rows
    events = list((out / "tb").iterdir())
    assert len(events) == 1, events
    tb = EventAccumulator(str(events[0])).Reload()
    assert [e.value for e in tb.Scalars("val_acc1")] == pytest.approx([r["val_acc1"] for r in rows])
    assert sorted(os.listdir(out)) == OUTPUT_FILES
    ckpt = load(out / "checkpoint.pth.tar")
    assert set(ckpt) == CHECKPOINT_KEYS
    assert (ckpt["epoch"], ckpt["step"], ckpt["arch"]) == (epochs, 0, "resnet18")
    torchvision.models.resnet18(num_classes=4).load_state_dict(ckpt["state_dict"])  # strict: no "module." prefix
    return ckpt


def assert_preempted(job, out, code=PREEMPTED):
    """A job signalled during epoch 0 exits `code`, with a checkpoint at the step where every rank stopped.
    Returns that step."""
    job.finish()
    aborted = code == LAUNCHER_FAILED and job.returncode == -signal.SIGABRT and TORCHRUN_ABORT in job.output
    assert job.returncode == code or aborted, job.output
    stop = re.search(r"preempted: saved .* at epoch 0 step (\d+);", job.output)
    assert stop, job.output
    ckpt = load(out / "checkpoint.pth.tar")
    assert (ckpt["epoch"], ckpt["step"]) == (0, int(stop[1])) and 0 < ckpt["step"] < 12
    assert not (out / "metrics.jsonl").exists()
    return ckpt["step"]


# how the backends say that a peer stopped answering for --dist-timeout: gloo, at a receive or a connection; NCCL
TIMED_OUT = (r"Timed out waiting \d+ms|Application timeout caused pair closure|"
             r"Watchdog caught collective operation timeout")


def freeze(job, process, ends_within):
    """Stops `process` without killing it (SIGSTOP: as if stuck in I/O or a driver call); the job must then end,
    failing, within `ends_within` seconds."""
    process.send_signal(signal.SIGSTOP)
    started = time.monotonic()
    job.finish(timeout=120)
    assert job.returncode != 0 and time.monotonic() - started < ends_within, job.output


def make_image_folder(root, train_per_class=48, val_total=101, size=40, seed=0):
    """One class per colour, noisy: learnable in a few epochs. val_total is odd on purpose."""
    gen = torch.Generator().manual_seed(seed)
    root = Path(root)
    for split, count in (("train", train_per_class * len(COLOURS)), ("val", val_total)):
        for i in range(count):
            k = i % len(COLOURS)
            noise = torch.randn(size, size, 3, generator=gen) * 30
            pixels = (torch.tensor(COLOURS[k]) + noise).clamp(0, 255).to(torch.uint8).numpy()
            folder = root / split / f"class{k}"
            folder.mkdir(parents=True, exist_ok=True)
            Image.fromarray(pixels).save(folder / f"{i:04d}.JPEG", quality=90)
    return root


@pytest.fixture(scope="session")
def image_data(tmp_path_factory):
    """Each pytest-xdist worker makes its own, the same bytes (seeded): a run made once for all of them (made_once)
    read the maker's copy, and equals a run on any other."""
    return make_image_folder(tmp_path_factory.mktemp("imagefolder"))


def made_once(name, tmp_path_factory, make):
    """make(folder): a reference run that tests in several modules compare with, made in a folder of this session.
    Under pytest-xdist every worker is a session of its own: there the folder is one that the workers share (in the
    run's temporary folder), made by the first worker that asks while the others wait on its lock, then only read.
    A run that failed fails the others' tests at once; one that was interrupted is made by the next that asks."""
    if not XDIST_WORKER:
        folder = tmp_path_factory.mktemp(name)
        make(folder)
        return folder
    shared = tmp_path_factory.getbasetemp().parent  # the workers' --basetemp folders lie in the run's own folder
    folder, done, failed = shared / name, shared / f"{name}.done", shared / f"{name}.failed"
    with open(shared / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # let go when the file closes, or this process dies
        if failed.exists():
            pytest.fail(f"the run {name}, made by another pytest-xdist worker, failed there: {failed.read_text()}")
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            try:
                make(folder)
            except (Exception, pytest.fail.Exception) as e:
                failed.write_text(f"{type(e).__name__}: {str(e)[-2000:]}")
                raise
            done.touch()
    return folder


@pytest.fixture(scope="session")
def uninterrupted(image_data, tmp_path_factory):
    """torchrun, 2 processes, EPOCHS epochs, deterministic: what resumed runs and other launchers must equal."""
    return made_once("uninterrupted", tmp_path_factory, lambda out: ok(torchrun(
        "distributed.py", 2, image_data, *RESUME, "--epochs", EPOCHS, "--output-dir", out)))


@pytest.fixture
def process_group():
    """A one-process gloo group in the test's own process, for a script's parts that need one."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="session")
def small_disk(tmp_path_factory):
    """mount(size): a folder on a tmpfs of its own (the tests run as root, as in CI)."""
    mounted = []

    def mount(size):
        folder = tmp_path_factory.mktemp("disk")
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", folder], capture_output=True,
                              text=True)
        if done.returncode:
            pytest.skip(f"cannot mount a tmpfs here (root needed): {done.stderr.strip()}")
        mounted.append(folder)
        return folder

    yield mount
    for folder in mounted:
        subprocess.run(["umount", "-l", folder], check=True)


# no BatchNorm and no dropout: the weights do not depend on how a batch is split
NO_BN = [*FAST, "-a", "squeezenet1_1", "--dropout", "0", "--epochs", "1"]
# every flag of the loop at once, with loader workers
LOOP = [*NO_BN, "-j", "2", "--grad-accum-steps", "2", "--clip-grad-norm", "0.05", "--label-smoothing", "0.1",
        "--model-ema", "--model-ema-decay", "0.9"]


@pytest.fixture(scope="session")
def loop_reference(image_data, tmp_path_factory):
    return made_once("loop_reference", tmp_path_factory, lambda out: ok(torchrun(
        "distributed.py", 2, image_data, *LOOP, "--output-dir", out)))


def assert_same_loop(out, reference, exact):
    """The weights and their average of a run with LOOP's flags equal the reference's."""
    a, b = load(out / "checkpoint.pth.tar"), load(reference / "checkpoint.pth.tar")
    for key in ("state_dict", "model_ema"):
        assert_same_tensors(a[key], b[key], exact=exact)


def pytest_configure(config):
    """Under pytest-xdist (`pytest -n N`, scripts/test.sh), each xdist_group must stay on one worker: the Slurm tests
    share one cluster, and the users of a module-scoped reference run (a fixture that trains) share that run, made
    once per worker. `-n N` alone would hand out test by test (--dist load)."""
    global XDIST_WORKER
    XDIST_WORKER = getattr(config, "workerinput", {}).get("workerid")  # not an inherited PYTEST_XDIST_WORKER
    dist = getattr(config.option, "dist", "no")
    if dist not in ("no", "loadgroup"):
        raise pytest.UsageError(f"--dist {dist}: the suite's xdist_group marks need --dist loadgroup "
                                "(bash scripts/test.sh passes -n 2 --dist loadgroup)")
    # loadgroup tells the groups by a suffix that pytest-xdist (up to 3.8.0 at least) appends to each node id,
    # `test@group`, and pytest 9.2 ignores (pytest-dev/pytest-xdist#1386): every test would go to any worker
    if dist == "loadgroup" and version("pytest") >= (9, 2) and version("pytest-xdist") <= (3, 8, 0):
        xdist = importlib.metadata.version("pytest-xdist")
        raise pytest.UsageError(f"pytest {pytest.__version__} with pytest-xdist {xdist} runs the tests of an "
                                "xdist_group on any worker (pytest-dev/pytest-xdist#1386): pip install -r "
                                "requirements-test.txt (pytest<9.2)")


def version(package):
    """An installed package's version as numbers: (9, 2, 0)."""
    return tuple(int(part) for part in re.findall(r"\d+", importlib.metadata.version(package))[:3])


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Tests that need a tool (Horovod, Slurm) may skip on a laptop, never in CI."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and os.environ.get("CI") == "true":
        report.outcome = "failed"
        report.longrepr = f"skipped under CI=true, where every test must run: {report.longrepr}"


@pytest.fixture(autouse=True)
def _alone(request, tmp_path_factory):
    """Under pytest-xdist, a test marked `alone` runs while no other worker runs one: its timing is a launcher's, not
    its own (horovodrun kills a rank 5 s after passing it SIGTERM, saving or not). The others share a lock that it
    takes whole; while it waits for that, it holds a turnstile, so that no other test starts before it."""
    if XDIST_WORKER is None:
        yield
        return
    shared = tmp_path_factory.getbasetemp().parent
    with open(shared / "alone.turnstile", "a") as turnstile, open(shared / "alone.lock", "a") as lock:
        alone = request.node.get_closest_marker("alone") is not None
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        fcntl.flock(lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        if not alone:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        yield  # the locks go with the files


@pytest.fixture(autouse=True)
def _end_jobs():
    """A test that failed or timed out midway must not leave its job running."""
    yield
    while Job.started:
        job = Job.started.pop()
        if job.proc.poll() is None or job.processes():
            job.kill()
