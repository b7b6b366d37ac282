"""distributed_slurm_main.py on a real Slurm 22.05 cluster that the tests start on this machine (two
nodes emulated by two slurmd): srun in both ways, equality with torchrun + distributed.py, sbatch with
a requeue after SIGUSR1, failures, and the script outside Slurm."""
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import psutil
import pytest

from conftest import (BIN, EPOCHS, LOOP, OUTPUT_FILES, RESUME, ROOT, Job, assert_preempted, assert_same_loop,
                      assert_same_run, error_lines, import_script, load, metrics, ok, python)

# one cluster for the whole module, and its tasks are found by that cluster's config: under pytest-xdist these tests
# run on one worker, one after another (a test waits for its job's tasks to end, and may kill any left behind)
pytestmark = pytest.mark.xdist_group("slurm")
SCRIPT = "distributed_slurm_main.py"
BASE = os.environ.get("LOCAL_SLURM_BASE", "/tmp/pytorch-multigpu-slurm")
PORT = os.environ.get("LOCAL_SLURM_PORT", "17817")


@pytest.fixture(scope="session")
def slurm():
    """A private two-node cluster from scripts/start_slurm.sh (which installs the Debian packages if they
    are missing); stopped afterwards by scripts/stop_slurm.sh if this session started it."""
    env = {**os.environ, "LOCAL_SLURM_BASE": BASE, "LOCAL_SLURM_PORT": PORT, "LOCAL_SLURM_NODES": "2",
           "LOCAL_SLURM_REQUEUE_DELAY": "5"}
    started = time.monotonic()
    stop = ["bash", ROOT / "scripts" / "stop_slurm.sh"]
    try:
        done = subprocess.run(["bash", ROOT / "scripts" / "start_slurm.sh"], env=env, capture_output=True, text=True,
                              timeout=900)
    except subprocess.TimeoutExpired as e:
        subprocess.run(stop, env=env, timeout=120)
        pytest.skip(f"scripts/start_slurm.sh timed out: {e.stderr}")
    ours = re.search(r"(munged|slurmctld|slurmd \S+) started", done.stderr)  # leave a cluster we found running alone
    if done.returncode:
        if ours:
            subprocess.run(stop, env=env, timeout=120)
        pytest.skip(f"no Slurm cluster (scripts/start_slurm.sh needs root and apt-get):\n{done.stderr[-3000:]}")
    print(f"\nSlurm cluster ready in {time.monotonic() - started:.1f} s", file=sys.stderr)
    yield {"SLURM_CONF": f"{BASE}/etc/slurm.conf", "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    if ours:
        subprocess.run(stop, env=env, timeout=120, check=True)


def slurm_tasks():
    """Training processes that Slurm started (srun tasks and what they spawned) and that are still alive."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if "python" in " ".join(p.info["cmdline"] or []) and p.environ().get("SLURM_CONF", "").startswith(BASE):
                if "SLURM_JOB_ID" in p.environ():
                    found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return found


@pytest.fixture(autouse=True)
def _no_task_outlives_its_job():
    yield
    deadline = time.monotonic() + 20
    while slurm_tasks() and time.monotonic() < deadline:
        time.sleep(0.5)
    left = slurm_tasks()
    for p in left:
        p.kill()
    assert not left, f"Slurm tasks left behind: {[(p.pid, p.info['cmdline']) for p in left]}"  # read before kill


def srun(env, srun_args, *args):
    return Job(["srun", "--kill-on-bad-exit=1", *srun_args, sys.executable, ROOT / SCRIPT, *args], env=env)


def slurm_command(slurm, *cmd, check=False, **kwargs):
    done = subprocess.run([str(c) for c in cmd], env={**os.environ, **slurm}, capture_output=True, text=True, **kwargs)
    assert not check or done.returncode == 0, f"{' '.join(map(str, cmd))}: {done.stderr}"  # with Slurm's reason
    return done


def wait_for_job(slurm, job_id, log, timeout):
    """Polls `scontrol show job` until the job has ended; returns its fields (JobState, Restarts, ...)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = slurm_command(slurm, "scontrol", "-o", "show", "job", job_id, check=True).stdout
        fields = dict(f.split("=", 1) for f in text.split() if "=" in f)
        if fields["JobState"] in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
            return fields
        time.sleep(0.5)
    slurm_command(slurm, "scancel", job_id)
    pytest.fail(f"job {job_id} did not end in {timeout}s: {text}\n{log.read_text() if log.exists() else ''}")


def test_hostlist_expansion_matches_scontrol(slurm):
    module = import_script(SCRIPT)
    for hostlist in ("127.0.0.[2-3]", "node[01-04,07]", "node[01-03,07],gpu1,login", "a[1-2]-ib[3-4]", "n[8-11]", "x"):
        expected = slurm_command(slurm, "scontrol", "show", "hostnames", hostlist, check=True).stdout.split()
        assert module.expand_hostlist(hostlist) == expected


def test_one_task_per_process_on_two_nodes_equals_torchrun(slurm, image_data, tmp_path, uninterrupted):
    """srun -N2 -n2: rank SLURM_PROCID on two nodes, rendezvous on the first; the same weights, bit for
    bit, as distributed.py under torchrun with 2 processes."""
    job = ok(srun(slurm, ["-N2", "-n2"], image_data, *RESUME, "--epochs", EPOCHS, "--output-dir", tmp_path),
             timeout=400)
    assert "distributed_slurm_main.py: world size 2, device cpu, backend gloo, global batch 16 = 2 x 8" in job.output
    assert job.output.count(f"Epoch {EPOCHS - 1}: train loss") == 1  # only rank 0 prints
    assert_same_run(tmp_path, uninterrupted)
    rows = metrics(tmp_path)
    assert rows[-1]["train_loss"] < rows[0]["train_loss"] and max(r["val_acc1"] for r in rows) > 40, rows  # chance: 25
    assert sorted(os.listdir(tmp_path)) == OUTPUT_FILES


def test_one_task_per_node_spawning_two_processes_equals_torchrun(slurm, image_data, tmp_path, uninterrupted):
    """srun -N1 -n1 --procs-per-node 2: the task starts ranks 0 and 1 itself."""
    job = ok(srun(slurm, ["-N1", "-n1"], image_data, *RESUME, "--epochs", EPOCHS, "--procs-per-node", "2",
                  "--output-dir", tmp_path), timeout=400)
    assert "world size 2, device cpu, backend gloo, global batch 16 = 2 x 8" in job.output
    assert_same_run(tmp_path, uninterrupted)


def test_the_training_loop_flags_under_srun_equal_torchrun(slurm, image_data, tmp_path, loop_reference):
    """--grad-accum-steps, --clip-grad-norm, --label-smoothing and --model-ema, with loader workers, across two
    nodes: the weights and their average of distributed.py under torchrun, bit for bit."""
    ok(srun(slurm, ["-N2", "-n2"], image_data, *LOOP, "--output-dir", tmp_path), timeout=400)
    assert_same_loop(tmp_path, loop_reference, exact=True)


@pytest.mark.quick  # the quick tier's srun launch: the cheapest that trains
def test_one_task_per_node_on_two_nodes_with_a_rendezvous_file(slurm, image_data, tmp_path):
    """srun -N2 -n2 --procs-per-node 2: world = SLURM_NTASKS x 2 = 4 (not SLURM_NPROCS = 2, which hung)."""
    out = tmp_path / "out"
    job = ok(srun(slurm, ["-N2", "-n2"], image_data, "--crop-size", "32", "--val-resize", "36", "-j", "0", "-p", "1000",
                  "-b", "16", "--lr", "0.01", "--epochs", "2", "--procs-per-node", "2",
                  "--dist-file", tmp_path / "rendezvous", "--output-dir", out), timeout=400)
    assert "world size 4, device cpu, backend gloo, global batch 16 = 4 x 4" in job.output
    ckpt = load(out / "checkpoint.pth.tar")
    assert (ckpt["epoch"], ckpt["world_size"], len(ckpt["rng_states"])) == (2, 4, 4)
    # 4 images per rank make BatchNorm's running statistics (rank 0's) poor for validation; training learns
    assert [r["epoch"] for r in metrics(out)] == [0, 1] and metrics(out)[-1]["train_acc1"] > 50, metrics(out)
    # the file of this job step, which the store deletes once every process has let go of the group
    assert f"rendezvous: file://{tmp_path}/rendezvous." in job.output
    assert not any(p.name.startswith("rendezvous.") for p in tmp_path.iterdir())


def sbatch_example(name, tmp_path):
    """The example from slurm/, without its GPU request (this cluster has none)."""
    text = (ROOT / "slurm" / name).read_text()
    assert "--signal=USR1@120" in text and "--requeue" in text and "--kill-on-bad-exit=1" in text
    script = tmp_path / name
    script.write_text("\n".join(line for line in text.splitlines() if not line.startswith("#SBATCH --gpus")) + "\n")
    return script


def lingering_scontrol(slurm, tmp_path):
    """A PATH whose scontrol lingers 2 s after its work, as one may on a loaded machine: the requeue ends the job's
    step, with SIGTERM to each of its processes, while the scontrol that asked for it still runs."""
    script = tmp_path / "bin" / "scontrol"
    script.parent.mkdir()
    script.write_text(f'#!/bin/sh\n{shutil.which("scontrol", path=slurm["PATH"])} "$@"; code=$?; sleep 2; exit $code\n')
    script.chmod(0o755)
    return f"{script.parent}{os.pathsep}{slurm['PATH']}"


@pytest.mark.parametrize("example, resources, args", [
    ("one_task_per_gpu.sbatch", ["-N1", "--ntasks-per-node=2"], []),
    ("one_task_per_node.sbatch", ["-N2", "--ntasks-per-node=1"], ["--procs-per-node", "1"]),
])
def test_sbatch_usr1_checkpoints_requeues_and_resumes_to_the_same_weights(
        example, resources, args, slurm, image_data, tmp_path, uninterrupted):
    out, log = tmp_path / "out", tmp_path / "job.log"
    env = {**slurm, "OMP_NUM_THREADS": "1", "PATH": lingering_scontrol(slurm, tmp_path)}
    submitted = slurm_command(env, "sbatch", "--parsable", *resources,
                              "--cpus-per-task=1", f"--chdir={ROOT}", f"--output={log}",
                              sbatch_example(example, tmp_path), image_data,
                              *RESUME, "-j", "2", "--epochs", EPOCHS, *args, "--output-dir", out, check=True)
    job_id = submitted.stdout.strip().split(";")[0]
    deadline = time.monotonic() + 300
    while "Epoch 0 [ 3/12]" not in (log.read_text() if log.exists() else ""):
        assert time.monotonic() < deadline, log.read_text() if log.exists() else "no log"
        time.sleep(0.2)
    slurm_command(slurm, "scancel", "--signal=USR1", job_id, check=True)  # what --signal=USR1@120 sends
    done = wait_for_job(slurm, job_id, log, 300)
    text = log.read_text()
    assert done["JobState"] == "COMPLETED" and done["Restarts"] == "1", text
    stop = re.search(r"preempted: saved .* at epoch 0 step (\d+);", text)
    assert stop and 3 <= int(stop[1]) < 12, text
    assert f"requeued job {job_id}" in text and "(restart 1)" in text, text
    assert f"(epoch 0, step {stop[1]})" in text, text  # the restart resumed from that step, without --resume
    assert_same_run(out, uninterrupted)


def test_scancel_checkpoints_but_does_not_requeue(slurm, image_data, tmp_path):
    """scancel sends SIGTERM to every process of the step, loader workers included: the job saves its position
    and stays cancelled (a requeue would undo scancel)."""
    log = tmp_path / "job.log"
    job_id = slurm_command({**slurm, "OMP_NUM_THREADS": "1"}, "sbatch", "--parsable", "--requeue", "-N1", "-n2",
                           f"--chdir={ROOT}", f"--output={log}", "--wrap",
                           f"srun --kill-on-bad-exit=1 {sys.executable} {SCRIPT} {image_data} {' '.join(RESUME)} "
                           f"-j 2 --epochs 3 --output-dir {tmp_path}", check=True).stdout.strip().split(";")[0]
    deadline = time.monotonic() + 300
    while "Epoch 0 [ 2/12]" not in (log.read_text() if log.exists() else ""):
        assert time.monotonic() < deadline, log.read_text() if log.exists() else "no log"
        time.sleep(0.2)
    slurm_command(slurm, "scancel", job_id, check=True)
    done = wait_for_job(slurm, job_id, log, 120)
    time.sleep(8)  # longer than the requeue delay: a requeued job would be back by now
    done = wait_for_job(slurm, job_id, log, 10)
    assert (done["JobState"], done["Restarts"]) == ("CANCELLED", "0"), log.read_text()
    ckpt = load(tmp_path / "checkpoint.pth.tar")
    assert (ckpt["epoch"], ckpt["world_size"]) == (0, 2) and 2 <= ckpt["step"] < 12, log.read_text()


@pytest.mark.parametrize("way", ["one task per process", "one task per node"])
def test_a_failing_task_ends_the_whole_job(way, slurm, image_data, tmp_path):
    extra = ["--procs-per-node", "1"] if way == "one task per node" else []
    job = srun(slurm, ["-N2", "-n2"], image_data, *RESUME, "--epochs", "50", *extra, "--output-dir", tmp_path)
    job.wait_for_line("Epoch 0 [ 1/12]")
    task = next(p for p in slurm_tasks() if p.environ().get("SLURM_PROCID") == "1" and SCRIPT in " ".join(p.cmdline()))
    # the training process: the task itself, or with --procs-per-node the process the task spawned
    victim = next(c for c in task.children() if "spawn_main" in " ".join(c.cmdline())) if extra else task
    victim.send_signal(signal.SIGKILL)
    started = time.monotonic()
    job.finish(timeout=90)
    assert job.returncode != 0 and time.monotonic() - started < 60, job.output


@pytest.mark.parametrize("way", ["one task per process", "one task per node"])
def test_usr1_to_the_step_saves_and_srun_exits_75(way, slurm, image_data, tmp_path):
    """What --signal=USR1@120 sends, to an srun outside a batch job (nothing to requeue): srun's exit code says
    "preempted, resume me" (75), the code of every task."""
    extra = ["--procs-per-node", "1"] if way == "one task per node" else []
    job = srun(slurm, ["-N2", "-n2", "-J", "usr1"], image_data, *RESUME, "-j", "2", "--epochs", "3", *extra,
               "--output-dir", tmp_path)
    job.wait_for_line("Epoch 0 [ 1/12]")
    slurm_command(slurm, "scancel", "--signal=USR1", "--name=usr1", check=True)
    assert_preempted(job, tmp_path)
    assert "Traceback" not in job.output and "resource_tracker" not in job.output, job.output  # spawn's helper too


@pytest.mark.parametrize("way", ["one task per process", "one task per node"])
def test_sigint_to_the_step_stops_every_process_with_exit_code_130(way, slurm, image_data, tmp_path):
    """SIGINT to every task of the step, as Slurm delivers it (scancel --signal=INT; srun passes on a second Ctrl-C
    within a second the same way, then aborts the step itself). With --procs-per-node the task passes it on."""
    extra = ["--procs-per-node", "1"] if way == "one task per node" else []
    job = srun(slurm, ["-N2", "-n2", "-J", "ctrl-c"], image_data, *RESUME, "-j", "2", "--epochs", "50", *extra,
               "--output-dir", tmp_path)
    job.wait_for_line("Epoch 0 [ 1/12]")
    slurm_command(slurm, "scancel", "--signal=INT", "--name=ctrl-c", check=True)
    job.finish(timeout=90)
    assert not error_lines(job.output) and "Traceback" not in job.output, job.output
    assert "Exited with exit code 130" in job.output and not (tmp_path / "checkpoint.pth.tar").exists()


def test_a_killed_srun_leaves_no_process_behind(slurm, image_data, tmp_path):
    """srun killed with -9 (the OOM killer on the login node): Slurm cancels the step and kills its processes at
    once (SIGKILL: nothing can be saved), loader workers included."""
    job = srun(slurm, ["-N2", "-n2"], image_data, *RESUME, "-j", "2", "--epochs", "50", "--output-dir", tmp_path)
    job.wait_for_line("Epoch 0 [ 1/12]")
    job.proc.kill()
    deadline = time.monotonic() + 30
    while slurm_tasks() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not slurm_tasks(), [p.cmdline() for p in slurm_tasks()]
    job.finish(timeout=30)


@pytest.mark.parametrize("way", ["one task per process", "one task per node"])
def test_a_problem_only_one_node_has_is_reported_by_that_node(way, slurm, image_data, tmp_path):
    """The second node lacks the data folder the first has (a mount missing on one host). Errors used to
    come from global rank 0 only: the job failed without a word about why. Each node's first process reports."""
    (tmp_path / "data0").symlink_to(image_data)
    extra = "--procs-per-node 1" if way == "one task per node" else ""
    command = (f"exec {sys.executable} {ROOT / SCRIPT} {tmp_path}/data$SLURM_NODEID {' '.join(RESUME)} {extra} "
               f"--output-dir {tmp_path}/out")  # each task's own data folder: data0 or data1
    job = Job(["srun", "--kill-on-bad-exit=1", "-N2", "-n2", "bash", "-c", command], env=slurm).finish(120)
    errors = [line for line in job.output.splitlines() if line.startswith("error: ")]
    assert job.returncode != 0 and len(errors) == 1, job.output
    assert re.search(r"data folder '.*data1' not found: give a folder with train/ and val/", errors[0]), job.output


@pytest.mark.parametrize("flags,said", [
    (lambda t: ["--dist-file", t / "nowhere" / "rdzv"],
     r"--dist-file .*nowhere/rdzv: no such folder; give one that every node shares"),
    (lambda t: ["--procs-per-node", "2"],
     r"--procs-per-node needs one task per node, not 2 tasks on 1 nodes: srun --ntasks-per-node=1$"),
], ids=["a rendezvous file in no folder", "processes per node with two tasks on the node"])
def test_flags_that_do_not_fit_the_step_are_one_clear_error(flags, said, slurm, image_data, tmp_path):
    job = srun(slurm, ["-N1", "-n2"], image_data, *RESUME, *flags(tmp_path)).finish(120)
    errors = [line for line in job.output.splitlines() if line.startswith("error: ")]
    assert job.returncode != 0 and len(errors) == 1, job.output
    assert re.search(said, errors[0]), job.output


def test_outside_slurm_one_process_runs(image_data, tmp_path):
    job = ok(python(SCRIPT, image_data, *RESUME, "--epochs", "1", "--output-dir", tmp_path))
    assert "world size 1, device cpu, backend none, global batch 16 = 1 x 16" in job.output
    assert load(tmp_path / "checkpoint.pth.tar")["epoch"] == 1


# the variables srun gives the first of a job's two tasks
A_TASK = {"SLURM_STEP_ID": "0", "SLURM_JOB_ID": "41", "SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0",
          "SLURM_NODEID": "0"}


def test_slurm_variables_left_from_another_job_are_one_clear_line(image_data, tmp_path):
    """A whole task's variables, in a shell that outlived its job (a tmux started inside it, an exported copy)."""
    left = {**A_TASK, "SLURM_TASK_PID": "999999999"}
    job = python(SCRIPT, image_data, "--epochs", "1", "--output-dir", tmp_path, env=left).finish(60)
    assert job.returncode == 2 and job.output.startswith(
        "error: the SLURM_* variables are job 41's, whose task 999999999 is not this process or a parent of it: start "
        "the script with srun"), job.output


def test_a_master_addr_that_does_not_resolve_is_one_clear_line_at_once(image_data, tmp_path):
    """Not a wait for the peers until --dist-timeout (30 minutes by default)."""
    env = {**A_TASK, "MASTER_ADDR": "no.such.host.invalid"}
    job = python(SCRIPT, image_data, *RESUME, "--epochs", "1", "--output-dir", tmp_path, env=env).finish(60)
    assert job.returncode == 2 and re.search(r"^error: MASTER_ADDR=no.such.host.invalid does not resolve \(.*\): "
                                             r"give the address of the node of rank 0$", job.output, re.M), job.output
