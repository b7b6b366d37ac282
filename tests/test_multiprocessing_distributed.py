"""multiprocessing_distributed.py started with plain python on CPU: it spawns its own workers, equals
torchrun, resumes after a forwarded SIGTERM, shares a machine with other jobs and nodes, and stops
every process when a worker dies (Ctrl-C: test_peer_failure.py, with the other launchers)."""
import os
import signal
import time

import pytest

from conftest import (EPOCHS, FAST, RESUME, assert_learned, assert_preempted, assert_same_run, error_lines, free_port,
                      load, metrics, ok, python, slow_start, spawn)

SCRIPT = "multiprocessing_distributed.py"
SHORT = [*RESUME, "-p", "1000", "--epochs", "1"]


def test_spawned_processes_learn_and_equal_torchrun(image_data, tmp_path, uninterrupted):
    """Same seed, data and global batch: bit-identical weights and the same metrics.jsonl as
    `torchrun --nproc_per_node=2 distributed.py`."""
    job = ok(spawn(SCRIPT, 2, image_data, *RESUME, "--epochs", EPOCHS, "--output-dir", tmp_path))
    assert "world size 2, device cpu, backend gloo, global batch 16 = 2 x 8" in job.output
    ckpt = assert_learned(tmp_path, epochs=EPOCHS)
    assert ckpt["world_size"] == 2 and len(ckpt["rng_states"]) == 2
    assert ckpt["args"]["dist_url"].startswith("tcp://127.0.0.1:") and ckpt["args"]["nprocs"] == 2
    assert_same_run(tmp_path, uninterrupted)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_stop_to_the_job_with_loader_workers_saves_and_resume_auto_continues(signum, image_data, tmp_path,
                                                                                uninterrupted):
    """To the parent, its workers and their loader workers: a scheduler's stop (SIGTERM), or the terminal's hangup
    (SIGHUP, which the kernel sends to the whole foreground process group)."""
    job = spawn(SCRIPT, 2, image_data, *RESUME, "-j", "2", "--epochs", EPOCHS, "--output-dir", tmp_path)
    job.wait_for_line("Epoch 0 [ 1/12]")
    os.killpg(job.proc.pid, signum)
    step = assert_preempted(job, tmp_path)
    resumed = ok(spawn(SCRIPT, 2, image_data, *RESUME, "--epochs", EPOCHS, "--resume", "auto",
                       "--output-dir", tmp_path))
    assert f"(epoch 0, step {step})" in resumed.output
    assert_same_run(tmp_path, uninterrupted)


def test_two_jobs_on_one_machine_pick_different_ports(image_data, tmp_path):
    """Port 0, a free one: the default's, and one given with a host (an IPv6 address, which keeps its brackets)."""
    urls = [[], ["--dist-url", "tcp://[::1]:0"]]
    jobs = [spawn(SCRIPT, 2, image_data, *SHORT, *url, "--output-dir", tmp_path / str(i)) for i, url in enumerate(urls)]
    for i, job in enumerate(jobs):
        ok(job)
        assert [r["epoch"] for r in metrics(tmp_path / str(i))] == [0]
    assert load(tmp_path / "1" / "checkpoint.pth.tar")["args"]["dist_url"].startswith("tcp://[::1]:")


def test_two_nodes_on_one_machine_train_together(image_data, tmp_path):
    """Two invocations, as on two nodes: one --dist-url, --node-rank 0 and 1, global ranks 0 and 1."""
    url = f"tcp://127.0.0.1:{free_port()}"
    nodes = [spawn(SCRIPT, 1, image_data, *SHORT, "--world-size", "2", "--node-rank", r, "--dist-url", url,
                   "--dist-timeout", "120", "--output-dir", tmp_path) for r in (0, 1)]
    first, second = (ok(node) for node in nodes)
    assert "world size 2, device cpu, backend gloo, global batch 16 = 2 x 8" in first.output
    assert "Epoch 0:" not in second.output  # only global rank 0 prints and writes
    assert [r["epoch"] for r in metrics(tmp_path)] == [0]
    assert load(tmp_path / "checkpoint.pth.tar")["world_size"] == 2


def test_a_killed_worker_ends_the_job_with_its_error(image_data, tmp_path):
    job = spawn(SCRIPT, 2, image_data, *RESUME, "-j", "1", "--epochs", "50", "--output-dir", tmp_path)
    job.wait_for_line("Epoch 0 [ 1/12]")
    job.spawned()[1].kill()
    job.finish(timeout=90)  # fails if any process (worker, DataLoader worker) is left behind
    assert job.returncode == 1 and "Traceback" not in job.output, job.output
    # the parent says what the killed worker cannot, the other worker that its peer ended
    assert "error: process 1 terminated with signal SIGKILL" in job.output
    assert len(error_lines(job.output)) == 2 and "error: a peer ended, so this rank stops too" in job.output


def test_a_killed_parent_leaves_no_process_behind_and_a_checkpoint(image_data, tmp_path):
    """kill -9 or the OOM killer on the parent: the kernel sends the workers SIGTERM (PR_SET_PDEATHSIG)."""
    job = spawn(SCRIPT, 2, image_data, *FAST, "-j", "1", "-p", "1", "--epochs", "3", "--output-dir", tmp_path)
    job.wait_for_line("Epoch 0 [ 1/12]")
    job.proc.kill()
    assert_preempted(job, tmp_path, code=-signal.SIGKILL)


@pytest.mark.parametrize("moment", ["importing", "building datasets"])
def test_a_parent_killed_during_start_up_leaves_no_process_behind(moment, tmp_path):
    """kill -9 on the parent before the process group is up: the workers, with nothing trained to save, end at once,
    loader workers included. They used to wait --dist-timeout (30 minutes) for the store that died with the parent:
    killed while they import the script, before they ask to die with it, or while they build their datasets."""
    flags, env, wait_for_ranks = slow_start(tmp_path)
    job = spawn(SCRIPT, 2, *flags, env=env)
    if moment == "importing":
        deadline = time.monotonic() + 60
        while len(job.spawned()) < 2:
            assert time.monotonic() < deadline, job.output
            time.sleep(0.05)
    else:
        wait_for_ranks()
    job.proc.kill()
    job.finish(timeout=60)  # fails if any process is left behind
    assert job.returncode == -signal.SIGKILL and not (tmp_path / "out" / "checkpoint.pth.tar").exists()


def test_python_without_nprocs_runs_one_process_on_cpu(image_data, tmp_path):
    job = ok(python(SCRIPT, image_data, *SHORT, "--output-dir", tmp_path))
    assert "world size 1, device cpu, backend gloo, global batch 16 = 1 x 16" in job.output
