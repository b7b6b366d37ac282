"""Two nodes under torchrun, emulated on one machine: two agents (--nnodes=2, --node-rank 0 and 1) that
meet at one --rdzv-endpoint. Each node is given its own folders where a test needs it, as two hosts may
see different files: a problem only one node has is reported by that node, ranks that find different
checkpoints stop with one line on each node, and two nodes train exactly as two processes on one. Elastic
jobs (--nnodes=1:2 --max-restarts=3, as the README's "Nodes come and go" starts them): a node lost mid-epoch
leaves the other to finish alone, a node added mid-epoch makes both go on together, from the same step."""
import contextlib
import hashlib
import re
import shutil
import signal
import time
from pathlib import Path

import psutil
import pytest
from torchvision.datasets import ImageFolder

from conftest import (EPOCHS, FAST, LOOP, RESUME, ROOT, TORCHRUN_CMD, Job, assert_same_loop, assert_same_run,
                      error_lines, free_port, metrics, ok, two_nodes)


def test_two_nodes_train_exactly_as_two_processes_on_one(image_data, tmp_path, uninterrupted):
    jobs = two_nodes("distributed.py", image_data, *RESUME, "--epochs", EPOCHS, "--output-dir", tmp_path)
    for job in jobs:
        ok(job, timeout=400)
    assert "world size 2" in jobs[0].output
    assert_same_run(tmp_path, uninterrupted)


@pytest.mark.parametrize("script", ["distributed.py", "apex_distributed.py"])
def test_a_problem_only_one_node_has_is_reported_by_that_node(script, image_data, tmp_path):
    """Node 1 lacks the data folder node 0 has (a mount missing on one host). apex_distributed.py used to
    report bad input from global rank 0 only: the job failed without a word about why. Node 0 waits for
    the missing rank until --dist-timeout, then stops with the rendezvous store's own timeout."""
    (tmp_path / "data0").symlink_to(image_data)
    jobs = two_nodes(script, *FAST, "--epochs", "1", "--dist-timeout", "15", "--output-dir", tmp_path / "out",
                     node_args=lambda node: [tmp_path / f"data{node}"])
    for job in jobs:
        job.finish(120)
        assert job.returncode != 0, job.output
    assert [re.search(r"data folder '.*data1' not found: give a folder with train/ and val/", line) is not None
            for line in error_lines(jobs[1].output)] == [True], jobs[1].output
    assert "wait timeout after 15000ms" in jobs[0].output and not error_lines(jobs[0].output), jobs[0].output
    assert f'File "{ROOT / script}"' not in jobs[1].output  # torchrun's own report is fine


def test_ranks_that_find_different_checkpoints_stop_with_one_line_per_node(image_data, tmp_path, uninterrupted):
    """--resume auto with an output folder that is not shared: node 0 finds a checkpoint, node 1 none. Each
    would train from its own step, and the job would hang at the first all-reduce that one rank skips."""
    (tmp_path / "out0").mkdir()
    shutil.copy(uninterrupted / "checkpoint.pth.tar", tmp_path / "out0")
    jobs = two_nodes("distributed.py", image_data, *FAST, "--epochs", EPOCHS + 1, "--resume", "auto",
                     node_args=lambda node: ["--output-dir", tmp_path / f"out{node}"])
    for job in jobs:
        job.finish(120)
        assert job.returncode != 0, job.output
        assert error_lines(job.output) == [
            f"error: the ranks differ (rank 0: checkpoint epoch {EPOCHS} step 0; rank 1: checkpoint none): "
            f"--output-dir and --resume must be on a filesystem that every node shares and sees up to date"
        ], job.output
    assert not (tmp_path / "out1" / "checkpoint.pth.tar").exists()


def test_nodes_given_other_flags_or_data_stop_with_one_line_per_node(image_data, tmp_path):
    """Node 1 has a copy of the data that lacks 4 training images and names a class otherwise, and another --lr: the
    epochs would have other lengths, and the job hang at an all-reduce one rank skips (here gloo aborted on a
    collective mismatch); another --lr, or other labels, alone train each rank apart without a word. Flags that may
    differ per node (-j, the data's path) are not compared."""
    shutil.copytree(image_data, tmp_path / "data1")
    for image in sorted((tmp_path / "data1" / "train").rglob("*.JPEG"))[:4]:
        image.unlink()
    for split in ("train", "val"):
        (tmp_path / "data1" / split / "class3").rename(tmp_path / "data1" / split / "class9")
    labels = [hashlib.sha256(repr([[folder.classes, folder.targets] for folder in (
        ImageFolder(Path(data) / "train"), ImageFolder(Path(data) / "val"))]).encode()).hexdigest()[:12]
        for data in (image_data, tmp_path / "data1")]
    jobs = two_nodes("distributed.py", *FAST, "--epochs", "1", "--output-dir", tmp_path / "out",
                     node_args=lambda node: [image_data, "-j", "0"] if node == 0 else [
                         tmp_path / "data1", "-j", "1", "--lr", "0.01"])
    train = len(list((Path(image_data) / "train").rglob("*.JPEG")))
    for job in jobs:
        job.finish(120)
        assert job.returncode != 0, job.output
        assert error_lines(job.output) == [
            f"error: the ranks differ (rank 0: --lr 0.005, {train} training samples, labels sha256 {labels[0]}; rank "
            f"1: --lr 0.01, {train - 4} training samples, labels sha256 {labels[1]}): start every node with the same "
            f"script, torch, flags and data"], job.output
    assert not (tmp_path / "out" / "checkpoint.pth.tar").exists()


def elastic_node(endpoint, data, out, host=False):
    """One node of an elastic job as the README starts it (1 to 2 nodes, up to 3 restarts), training with LOOP's
    flags into the shared `out`. host: this node serves the rendezvous (on real hosts, the one the endpoint names).
    last_call_timeout: how long a rendezvous waits for more nodes once it has enough (torchrun's default: 30 s)."""
    return Job([*TORCHRUN_CMD, "--nnodes=1:2", "--nproc_per_node=1", "--max-restarts=3", "--rdzv-backend=c10d",
                f"--rdzv-endpoint={endpoint}", "--rdzv-id=elastic", f"--rdzv-conf=is_host={host:d},last_call_timeout=3",
                ROOT / "distributed.py", data, *LOOP, "-p", "1", "--resume", "auto", "--output-dir", out],
               env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})


def hold_at_the_second_step(job):
    """Freezes (SIGSTOP) the second training-loader worker of `job`'s training process as soon as it is forked, idle,
    at start-up (the training loader's two workers come first): the process then waits for that worker's batch, the
    second, after its first step, and the job stands still in epoch 0 however long the test takes to act (an epoch
    of these runs lasts about half a second, too short to hit from the test's side). Returns the worker, for the
    test to resume."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        with contextlib.suppress(psutil.Error):
            trainers = [p for p in job.processes() if "RANK" in p.environ() and "RANK" not in p.parent().environ()]
            workers = sorted(trainers[0].children(), key=lambda p: (p.create_time(), p.pid)) if trainers else []
            if len(workers) >= 2:
                workers[1].suspend()
                return workers[1]
        time.sleep(0.02)
    job.give_up("its training process forked no loader workers within 120 s")


def pending_signals(process):
    """The signals sent to `process` and not yet handled (it is stopped, say), as a bit mask: 1 << (signum - 1)."""
    status = Path(f"/proc/{process.pid}/status").read_text()
    return int(re.search(r"^ShdPnd:\s*([0-9a-f]+)$", status, re.M)[1], 16)


def wait_for_line_in_either(jobs, text, timeout=180):
    """The job (of several) whose output shows `text` first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for job in jobs:
            if job.read(time.monotonic() + 0.1, until=lambda line: text in line):
                return job
    jobs[0].give_up(f"never saw {text!r} within {timeout}s:\n{''.join(jobs[1].lines)}")


def assert_finished_as_the_reference(survivor, out, reference, resized):
    """The job ends once, exit 0, with no wait at an exit barrier; the run has every epoch and the weights of a run at
    the reference's world size to float tolerance (another world size sums the gradients in another order).
    resized: what the resumed run's line says ("2 -> 1"), None when nothing could be saved to resume from."""
    ok(survivor, timeout=240)
    resumed = re.search(r"^resumed from .*\(epoch 0, step \d+\), world size (\d -> \d)$", survivor.output, re.M)
    assert (resumed and resumed[1]) == resized, survivor.output
    assert [row["epoch"] for row in metrics(out)] == [0]
    assert_same_loop(out, reference, exact=False)


@pytest.mark.parametrize("lost", ["agent", "node"])
def test_a_node_lost_mid_epoch_leaves_the_other_to_finish_at_world_size_1(lost, image_data, tmp_path, loop_reference):
    """agent: node 1's torchrun killed with -9 (the scheduler taking the node back): its training process saves with
    the other at one step (PR_SET_PDEATHSIG: SIGTERM) and both exit 75; node 0's agent restarts its process, alone
    now, from that step. node: node 1 gone with every process (power lost): node 0's process exits 2 (a peer
    ended) and is restarted alone, from the last checkpoint (none in this one-epoch run: from the start)."""
    endpoint = f"127.0.0.1:{free_port()}"
    node0, node1 = (elastic_node(endpoint, image_data, tmp_path, host=node == 0) for node in (0, 1))
    held = hold_at_the_second_step(node1)
    rank0 = wait_for_line_in_either([node0, node1], "world size 2,")  # both ranks past start-up, held at step 1
    if lost == "agent":
        node1.proc.kill()
        held.resume()  # node 1's training process, signalled by the kernel, goes on to stop with node 0's
        node1.finish(timeout=60)  # its training process is gone too (Job.finish checks)
    else:
        node1.kill()
    assert_finished_as_the_reference(node0, tmp_path, loop_reference, "2 -> 1" if lost == "agent" else None)
    assert ("preempted: saved" in rank0.output) == (lost == "agent"), rank0.output
    assert f"failed (exitcode: {75 if lost == 'agent' else 2})" in node0.output  # torchrun's line: then it restarts


def test_a_node_joining_mid_epoch_makes_both_go_on_at_world_size_2(image_data, tmp_path, loop_reference):
    """Node 1 starts while node 0 trains alone: node 0's agent stops its process (SIGTERM), which saves, and both
    nodes' agents start theirs at world size 2, which resume from there. Node 0's process is held (SIGSTOP) until
    its agent has asked it to stop, as if its steps took as long as real ones: the join lands mid-epoch."""
    endpoint = f"127.0.0.1:{free_port()}"
    node0 = elastic_node(endpoint, image_data, tmp_path, host=True)
    node0.wait_for_line("Epoch 0 [ 3/12]")
    trainer = node0.process_of_rank(0)
    trainer.suspend()
    node1 = elastic_node(endpoint, image_data, tmp_path)
    deadline = time.monotonic() + 120
    while not pending_signals(trainer) & 1 << signal.SIGTERM - 1:
        assert time.monotonic() < deadline, node0.output + "".join(node1.lines)
        time.sleep(0.2)
    trainer.resume()
    assert_finished_as_the_reference(node0, tmp_path, loop_reference, "1 -> 2")
    ok(node1)
