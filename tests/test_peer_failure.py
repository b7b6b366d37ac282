"""A failure on one rank mid-training (a file that is not an image, a loader worker killed by the out-of-memory
killer): the rank that met it says why in one line, every other rank says in one line that a peer ended, no rank
prints a traceback, and none is left behind. Each launcher reports its processes its own way: one case per way."""
import contextlib
import os
import re
import signal
import time

import pytest
import torch

from conftest import FAST, LAUNCHER_FAILED, error_lines, import_script, python, spawn, torchrun
from test_bad_input import broken_copy, first_train_image
from test_horovod import horovodrun

# how each launcher starts two processes, and finds the training process of a rank (not its loader workers)
LAUNCHERS = {
    "torchrun": (lambda *args: torchrun("distributed.py", 2, *args), lambda job, rank: job.process_of_rank(rank)),
    "spawn": (lambda *args: spawn("multiprocessing_distributed.py", 2, *args), lambda job, rank: job.spawned()[rank]),
    "horovodrun": (lambda *args: horovodrun(2, *args), lambda job, rank: job.process_of_rank(rank, "HOROVOD_RANK")),
}
# a launcher's own report of a failed worker: a traceback of its own, and exit code 1
LAUNCHER_REPORTS = {"torchrun": "errors.ChildFailedError:", "horovodrun": "RuntimeError: Horovod detected that one"}
PEER_ENDED = r"a peer ended, so this rank stops too \(.+\): the error line of the rank that ended first says why"
KILLED_WORKER = (r"a data loader worker was killed \(signal: Killed\), most likely by the out-of-memory killer: use "
                 r"fewer -j/--workers, or give the job more memory")


def output_of(job):
    """What the job printed, without horovodrun's prefix ("[1]<stderr>:") on its processes' lines."""
    return re.sub(r"^\[\d+\]<std\w+>:", "", job.output, flags=re.M)


def assert_cause_and_peer(job, launcher, cause):
    """The cause once and "a peer ended" once, nothing else: no traceback, exit code 2. torchrun and horovodrun add
    their own report of a failed worker (a traceback of the launcher's, exit code 1), torchrun's with its code."""
    job.finish(timeout=120)
    errors = error_lines(output_of(job))
    assert len(errors) == 2, job.output
    assert sum(bool(re.search(cause, line)) for line in errors) == 1, job.output
    assert sum(bool(re.search(PEER_ENDED, line)) for line in errors) == 1, job.output
    tracebacks = job.output.count("Traceback (most recent call last)")
    if launcher in LAUNCHER_REPORTS:
        assert job.returncode == 1 and tracebacks == job.output.count(LAUNCHER_REPORTS[launcher]) == 1, job.output
        assert re.search(r"exitcode\s*: 2 |Exit code: 2\n", job.output), job.output  # the cause's code
    else:
        assert job.returncode == 2 and tracebacks == 0, job.output


def needs(launcher):
    if launcher == "horovodrun":
        pytest.importorskip("horovod.torch")


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_a_file_that_is_not_an_image_read_by_a_loader_worker(launcher, image_data, tmp_path):
    needs(launcher)
    data = broken_copy(image_data, tmp_path, lambda x: first_train_image(x).write_bytes(b"not an image"))
    job = LAUNCHERS[launcher][0](data, *FAST, "-j", "2", "--epochs", "1", "--output-dir", tmp_path / "out")
    assert_cause_and_peer(job, launcher, r"cannot read image .*class0/0000.JPEG .*replace or remove the file")
    assert not (tmp_path / "out" / "checkpoint.pth.tar").exists()


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_a_loader_worker_killed_by_the_out_of_memory_killer(launcher, image_data, tmp_path):
    """SIGKILL, as the kernel's out-of-memory killer sends it, to a loader worker of rank 1 mid-epoch."""
    needs(launcher)
    start, rank_process = LAUNCHERS[launcher]
    job = start(image_data, *FAST, "-j", "2", "-p", "1", "--epochs", "50", "--output-dir", tmp_path)
    job.wait_for_line("Epoch 0 [ 1/12]")
    worker = rank_process(job, 1).children()[0]
    worker.kill()
    assert_cause_and_peer(job, launcher, KILLED_WORKER)
    assert not (tmp_path / "checkpoint.pth.tar").exists()  # no checkpoint from a step that never finished


# a dataset whose loader worker dies as it hands over its first batch, slowly enough to be seen doing it
DYING_WORKER = '''
import multiprocessing.reduction
import os
import signal
import socket
import time

import torch


class Rows(torch.utils.data.Dataset):
    num_classes = 2

    def __len__(self):
        return 64

    def __getitem__(self, index):
        if torch.utils.data.get_worker_info():  # in a loader worker: the first batch it hands over is its last
            multiprocessing.reduction.send_handle = die_handing_over
        return torch.full((20,), float(index % 2)), index % 2


def die_handing_over(conn, fd, pid):
    """The worker's end of the socket that passes a batch's memory closes, or sends a byte without the descriptor
    (a message cut short), and the kernel lets the worker be waited for a moment later: as when the out-of-memory
    killer ends it there, with that moment made long."""
    if os.environ["HANDOVER"] == "garbled":
        socket.socket(fileno=os.dup(conn.fileno())).send(b"A")
    conn.close()
    time.sleep(0.3)
    os.kill(os.getpid(), signal.SIGKILL)


def rows(args):
    return Rows(), Rows()


def linear(num_classes):
    return torch.nn.Linear(20, num_classes)
'''


@pytest.mark.parametrize("handover", ["closed", "garbled"])
def test_a_loader_worker_killed_as_it_hands_over_a_batch(handover, tmp_path):
    """A batch passed by file descriptor (torch's default on Linux) is taken from the worker through a socket: a worker
    killed then fails the training process's read (closed: EOFError; garbled: multiprocessing's RuntimeError
    "received 0 items of ancdata"; ConnectionResetError, FileNotFoundError and the like at other moments) before it
    can be waited for. The rank still names it."""
    (tmp_path / "dying.py").write_text(DYING_WORKER)
    job = spawn("multiprocessing_distributed.py", 1, "--dataset", "dying:rows", "-a", "dying:linear", "-b", "8", "-j",
                "1", "--epochs", "1", "--output-dir", tmp_path / "out", cwd=tmp_path,
                env={"HANDOVER": handover}).finish(120)
    errors = error_lines(job.output)
    assert job.returncode == 2 and "Traceback" not in job.output, job.output
    assert len(errors) == 1 and re.fullmatch("error: " + KILLED_WORKER, errors[0]), job.output


# Ctrl-C: the launchers above, and one process without one
CTRL_C = {**{name: start for name, (start, _) in LAUNCHERS.items()},
          "python": lambda *args: python("dataparallel.py", *args)}


@pytest.mark.parametrize("launcher", [pytest.param(name, marks=[pytest.mark.alone] if name == "horovodrun" else [])
                                      for name in CTRL_C])
def test_ctrl_c_stops_every_process_without_a_traceback(launcher, image_data, tmp_path):
    """SIGINT to the whole foreground group, as a terminal sends it, with loader workers: every process ends (the
    harness checks that none is left) without a traceback of the script's or "a peer ended" from the ranks that
    lost one. horovodrun ends its processes itself, with SIGTERM: they save a preemption checkpoint; elsewhere no
    checkpoint, and exit code 130 where the script decides it (not torchrun's own report), Ctrl-C pressed twice too
    (the second cut the spawn parent's wait for its workers short, in two tracebacks)."""
    needs(launcher)
    job = CTRL_C[launcher](image_data, *FAST, "-j", "2", "-p", "1", "--epochs", "50", "--output-dir", tmp_path)
    job.wait_for_line("Epoch 0 [ 1/12]")
    os.killpg(job.proc.pid, signal.SIGINT)
    if launcher in ("spawn", "python"):
        time.sleep(0.3)
        with contextlib.suppress(ProcessLookupError):  # (ended already)
            os.killpg(job.proc.pid, signal.SIGINT)
    job.finish(timeout=60)
    output, saved = output_of(job), (tmp_path / "checkpoint.pth.tar").exists()
    assert not error_lines(output) and "KeyboardInterrupt" not in output, output
    if launcher == "horovodrun":
        assert job.returncode == LAUNCHER_FAILED and "preempted: saved" in output and saved, output
    else:
        assert not saved
        assert job.returncode != 0 if launcher == "torchrun" else job.returncode == 130 and "Traceback" not in output


GLOO_CLOSED = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:561] Connection closed by peer "
               "[127.0.0.1]:39860. This is typically caused by a remote worker crashing. Check the logs of the remote "
               "worker before reporting an error. GLHF!")
NCCL_REMOTE = ("NCCL error in: /pytorch/torch/csrc/distributed/c10d/NCCLUtils.hpp:268, remote process exited or there "
               "was a network error, NCCL version 2.21.5\nncclRemoteError: A call failed possibly due to a network "
               "error or a remote process exiting prematurely.\nLast error:\nsocketProgressOpt: Call to recv from "
               "10.0.0.7<33759> failed : Connection reset by peer")
# NCCL's codes: what torch says of each
NCCL_CUDA = ("unhandled cuda error (run with NCCL_DEBUG=INFO for details)\nncclUnhandledCudaError: Call to CUDA "
             "function failed.")
NCCL_SYSTEM = ("unhandled system error (run with NCCL_DEBUG=INFO for details)\nncclSystemError: System call (e.g. "
               "socket, malloc) or external library call failed or device error. ")


def nccl_error(code, last):
    """torch's DistBackendError for an NCCL error: the code, what it means, and NCCL's last warning (the cause)."""
    where, meaning = code.split("\n")
    return torch.distributed.DistBackendError(f"NCCL error in: /pytorch/torch/csrc/distributed/c10d/NCCLUtils.hpp:268, "
                                              f"{where}, NCCL version 2.21.5\n{meaning}\nLast error:\n{last}")


def raised_from(error, cause):
    """`error`, as `raise error from cause` leaves it."""
    error.__cause__ = cause
    return error


class HorovodInternalError(RuntimeError):
    """Horovod's: the scripts read its words, as every other error's, without importing Horovod."""


# what torch, its backends and Horovod raise -> what the line must say (None: the error stays itself)
MESSAGES = [
    (RuntimeError(GLOO_CLOSED),
     PEER_ENDED.replace(r"\(.+\)", r"\(Connection closed by peer \[127.0.0.1\]:39860\. This is typically .+\)")),
    (RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error [10.0.0.7]:43270: Connection "
                  "reset by peer"), PEER_ENDED),
    (RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:598] Write error [10.0.0.7]:43270: Broken pipe"),
     PEER_ENDED),
    (RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Socket closed [10.0.0.7]:43270"),
     PEER_ENDED),
    (torch.distributed.DistBackendError(NCCL_REMOTE),
     PEER_ENDED.replace(r"\(.+\)", r"\(NCCL error in: .*, remote process exited or there was a network .+\)")),
    (torch.distributed.DistBackendError("NCCL communicator was aborted on rank 1."), PEER_ENDED),
    (nccl_error(NCCL_SYSTEM, "socketProgress: Connection closed by remote peer node7-ib<51159>"),
     PEER_ENDED.replace(r"\(.+\)", r"\(socketProgress: Connection closed by remote peer node7-ib<51159>\)")),
    # an NCCL error of this rank's own stays itself: torch's error names its cause
    (nccl_error(NCCL_CUDA, "Cuda failure 2 'out of memory'"), None),
    (torch.distributed.DistNetworkError("failed to recv, got 0 bytes"), PEER_ENDED),
    (HorovodInternalError("Horovod has been shut down. This was caused by an exception on one of the ranks or an "
                          "attempt to allreduce, allgather or broadcast a tensor after one of the ranks finished "
                          "execution."),
     PEER_ENDED.replace(r"\(.+\)", r"\(Horovod has been shut down\. This was caused by .*\)")),
    # a rank that stops answering: the backend's timeout, which says so, stays itself
    (RuntimeError("[../gloo/transport/tcp/pair.cc:446] Timed out waiting 10000ms for recv operation to complete"),
     None),
    (torch.distributed.DistBackendError("[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9, "
                                        "OpType=ALLREDUCE) ran for 10008 milliseconds before timing out."), None),
    (RuntimeError("DataLoader worker (pid 4242) is killed by signal: Killed. "), KILLED_WORKER),
    (RuntimeError("DataLoader worker (pid 4242) is killed by signal: Bus error. It is possible that dataloader's "
                  "workers are out of shared memory. Please try to raise your shared memory limit."),
     r"a data loader worker was killed \(signal: Bus error\), most likely out of shared memory: give the job more "
     r"\(/dev/shm; docker run --shm-size\), or use fewer -j/--workers"),
    # SIGCHLD's error met while waiting for a batch: torch raises "exited unexpectedly" from it
    (raised_from(RuntimeError("DataLoader worker (pid(s) 4242) exited unexpectedly"),
                 RuntimeError("DataLoader worker (pid 4242) is killed by signal: Killed. ")), KILLED_WORKER),
    (RuntimeError("DataLoader worker (pid(s) 4242, 4243) exited unexpectedly"),
     r"a data loader worker was killed \(signal: None\), or exited: -j 0 shows its error in the training process"),
    (RuntimeError("CUDA error: an illegal memory access was encountered"), None),  # no memory to free: a bug
    (HorovodInternalError("Mismatched allreduce tensor shapes: One rank sent a tensor of rank 2, but another rank "
                          "sent a tensor of rank 1."), None),
]


@pytest.fixture(scope="module")
def script():
    return import_script("distributed.py")


@pytest.mark.parametrize("error, expected", MESSAGES,
                         ids=lambda x: str(x).strip().splitlines()[-1][:40] if isinstance(x, Exception) else "")
def test_each_kind_of_failure_becomes_one_line(error, expected, script):
    """By what gloo, NCCL, Horovod and the DataLoader say, not by the error's class (DistBackendError is every NCCL
    error's, a peer's end or this rank's own): the NCCL cases cannot be launched on a machine without two GPUs."""
    line = script.explain_failure(error)
    if expected is None:
        assert line is error
    else:
        assert isinstance(line, script.RankError) and "\n" not in str(line) and re.fullmatch(expected + ".*", str(line))
