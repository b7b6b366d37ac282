"""distributed.py launched by torchrun (and plain python) on CPU: learning, checkpoints, exact
evaluation, equivalence across process counts, resume, preemption and faults."""
import ast
import os
import re
import shutil
import signal
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
import torchvision

from conftest import (CHECKPOINT_KEYS, EPOCHS, FAST, LAUNCHER_FAILED, RESUME, ROOT, TIMED_OUT, Job, assert_learned,
                      assert_preempted, assert_same_run, assert_same_tensors, error_lines, free_port, freeze, load,
                      metrics, ok, own_rows, python, slow_start, spawn, started, threads_started, torchrun)
from test_bad_input import assert_one_clear_line

SCRIPT = "distributed.py"


@pytest.fixture(scope="module")
def trained(image_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("trained")
    job = ok(torchrun(SCRIPT, 2, image_data, *FAST, "--epochs", "4", "-p", "5", "--output-dir", out))
    return job, out


@pytest.mark.xdist_group("distributed_trained")
def test_two_processes_learn_and_write_outputs_from_rank_0_only(trained):
    job, out = trained
    assert "world size 2, device cpu, backend gloo, global batch 16 = 2 x 8" in job.output
    assert job.output.count("192 train / 101 val samples, JPEGs decoded by torchcodec\n") == 1  # rank 0's line
    assert re.search(r"^Epoch 0 \[ 5/12\] loss [\d.]+ acc1 [\d.]+ lr 0.005 \d+ img/s$", job.output, re.M), job.output
    assert_learned(out, epochs=4)  # one metrics line per epoch: rank 1 wrote nothing


@pytest.mark.xdist_group("distributed_trained")
def test_checkpoint_is_complete_and_loads_into_a_plain_model(trained):
    _, out = trained
    ckpt = load(out / "checkpoint.pth.tar")
    assert set(ckpt) == CHECKPOINT_KEYS
    assert (ckpt["epoch"], ckpt["step"], ckpt["arch"], ckpt["world_size"]) == (4, 0, "resnet18", 2)
    assert ckpt["args"]["batch_size"] == 16 and ckpt["args"]["epochs"] == 4
    assert len(ckpt["rng_states"]) == 2
    assert not torch.equal(ckpt["rng_states"][0]["torch"], ckpt["rng_states"][1]["torch"])
    assert ckpt["scheduler"]["last_epoch"] == 4 * 12
    model = torchvision.models.resnet18(num_classes=4)
    model.load_state_dict(ckpt["state_dict"])  # strict: no "module." prefix, nothing missing
    best = load(out / "model_best.pth.tar")
    assert best["best_acc1"] == max(r["val_acc1"] for r in metrics(out))
    assert best["epoch"] == 1 + max(metrics(out), key=lambda r: r["val_acc1"])["epoch"]


def val_line(job):
    m = re.search(r"val: loss ([\d.]+) acc1 ([\d.]+) acc5 ([\d.]+) \(correct1 (\d+), correct5 (\d+), images (\d+)\)",
                  job.output)
    assert m, job.output
    return float(m[1]), m.groups()[1:]


@pytest.mark.xdist_group("distributed_trained")
def test_evaluation_is_exact_for_any_number_of_processes(trained, image_data):
    """101 validation images: no rank pads or drops any, so 1, 2 and 3 processes agree exactly. The last with a batch
    larger than the train set (192): -e trains nothing, and has no optimizer step per epoch to divide by."""
    _, out = trained
    results = [val_line(ok(torchrun(SCRIPT, n, image_data, *FAST, "-b", str(batch), "-e",
                                    "--resume", out / "checkpoint.pth.tar")))
               for n, batch in ((1, 12), (2, 12), (3, 300))]
    losses, counts = zip(*results)
    assert counts[0][-1] == "101"
    assert counts[0] == counts[1] == counts[2]
    assert losses == pytest.approx([losses[0]] * 3, rel=1e-5)


def test_two_processes_give_the_weights_of_one(image_data, tmp_path):
    """No BatchNorm, no dropout: only the parallelism differs, and the global batch is the same. The
    random crops agree too, because each sample's augmentation is seeded by (seed, epoch, index)."""
    args = [image_data, *FAST, "-a", "squeezenet1_1", "--dropout", "0", "--epochs", "2"]
    ok(python(SCRIPT, *args, "--output-dir", tmp_path / "one"))
    ok(torchrun(SCRIPT, 2, *args, "--output-dir", tmp_path / "two"))
    one, two = (load(tmp_path / d / "checkpoint.pth.tar")["state_dict"] for d in ("one", "two"))
    assert_same_tensors(one, two, exact=False)
    torch.manual_seed(0)
    initial = torchvision.models.squeezenet1_1(num_classes=4, dropout=0.0).state_dict()
    assert not torch.allclose(initial["classifier.1.weight"], one["classifier.1.weight"])  # it did train


def test_pretrained_weights_come_through_the_torchvision_api(image_data, tmp_path):
    """Offline: the file lies where torchvision's cache keeps it. Every layer but the classifier (1000
    classes there, 4 here) starts from it."""
    cache = tmp_path / "torch" / "hub" / "checkpoints"
    cache.mkdir(parents=True)
    torch.manual_seed(1)
    weights = torchvision.models.resnet18().state_dict()
    torch.save(weights, cache / Path(torchvision.models.ResNet18_Weights.DEFAULT.url).name)
    ok(python(SCRIPT, image_data, *FAST, "--lr", "0", "--epochs", "1", "--pretrained", "--output-dir", tmp_path / "out",
              env={"TORCH_HOME": tmp_path / "torch"}))
    loaded = load(tmp_path / "out" / "checkpoint.pth.tar")["state_dict"]
    assert torch.equal(loaded["layer4.1.conv2.weight"], weights["layer4.1.conv2.weight"])
    assert loaded["fc.weight"].shape == (4, 512)


def test_resume_after_an_epoch_is_bitwise_identical(image_data, tmp_path, uninterrupted):
    ok(torchrun(SCRIPT, 2, image_data, *RESUME, "--epochs", "1", "--output-dir", tmp_path))
    job = ok(torchrun(SCRIPT, 2, image_data, *RESUME, "--epochs", EPOCHS, "--resume", "auto", "--output-dir", tmp_path))
    assert "resumed from" in job.output and "(epoch 1, step 0)" in job.output
    assert_same_run(tmp_path, uninterrupted)
    # the same command once more: the run is over (a requeued job that finished ends with 0) and its checkpoint stays;
    # with the largest --dist-timeout, which the rendezvous and the process group take (10**9 s: a C int overflowed)
    saved = (tmp_path / "checkpoint.pth.tar").read_bytes()
    ok(torchrun(SCRIPT, 2, image_data, *RESUME, "--epochs", EPOCHS, "--resume", "auto", "--output-dir", tmp_path,
                "--dist-timeout", "999999999.9"))
    assert (tmp_path / "checkpoint.pth.tar").read_bytes() == saved


def test_sigterm_mid_epoch_saves_the_position_and_resume_continues_from_it_on_the_same_data(image_data, tmp_path,
                                                                                            uninterrupted):
    job = torchrun(SCRIPT, 2, image_data, *RESUME, "--epochs", EPOCHS, "--output-dir", tmp_path)
    job.wait_for_line("Epoch 0 [ 1/12]")
    job.process_of_rank(1).send_signal(signal.SIGTERM)  # one rank only: the others must agree to stop with it
    step = assert_preempted(job, tmp_path, code=LAUNCHER_FAILED)
    assert "exitcode  : 75" in job.output  # torchrun's report: the code it would restart on (--max-restarts)
    assert load(tmp_path / "checkpoint.pth.tar")["train_samples"] == 192
    fewer = shutil.copytree(image_data, tmp_path.parent / "fewer")  # the step and the epoch's order would not fit
    for image in sorted((fewer / "train" / "class0").iterdir())[:16]:
        image.unlink()
    refused = torchrun(SCRIPT, 2, fewer, *RESUME, "--epochs", EPOCHS, "--resume", "auto", "--output-dir", tmp_path)
    assert_one_clear_line(refused.finish(), r"checkpoint.pth.tar was trained on 192 training samples, this run has "
                                            r"176: resume with the data it was trained on", launcher_reports=True)
    resumed = ok(torchrun(SCRIPT, 2, image_data, *RESUME, "--epochs", EPOCHS, "--resume", "auto",
                          "--output-dir", tmp_path))
    assert f"(epoch 0, step {step})" in resumed.output
    assert_same_run(tmp_path, uninterrupted)


def test_pythons_development_mode_finds_no_resource_left_open(image_data, tmp_path):
    """PYTHONDEVMODE=1 (python -X dev) prints every ResourceWarning: the run's lock file, left open for the
    garbage collector to close at exit, was one."""
    job = ok(torchrun(SCRIPT, 2, image_data, *FAST, "-j", "2", "--epochs", "1", "--output-dir", tmp_path,
                      env={"PYTHONDEVMODE": "1"}))
    assert "Warning" not in job.output, job.output


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP, signal.SIGKILL])
def test_a_signal_to_torchrun_ends_in_the_preemption_checkpoint_with_loader_workers(signum, image_data, tmp_path):
    """SIGTERM to torchrun (`kill`, `timeout`, Kubernetes), or SIGHUP (the terminal or SSH session hung up; torchrun
    takes it even under nohup): torchrun passes it to each worker's process group, loader workers included, which
    must not die of it. SIGKILL (kill -9, the OOM killer): the kernel tells the workers (PR_SET_PDEATHSIG). Either
    way every process saves the checkpoint and is gone (Job.finish checks)."""
    job = torchrun(SCRIPT, 2, image_data, *FAST, "-j", "2", "-p", "1", "--epochs", "3", "--output-dir", tmp_path)
    job.wait_for_line("Epoch 0 [ 1/12]")
    job.proc.send_signal(signum)
    assert_preempted(job, tmp_path, code=-signum if signum == signal.SIGKILL else LAUNCHER_FAILED)
    assert "DataLoader worker" not in job.output


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL])
def test_a_signal_during_start_up_stops_the_run_at_its_first_steps(signum, tmp_path):
    """SIGTERM to torchrun while the ranks still build their datasets (a scheduler's notice comes when it comes): the
    run stops as it does later, with a checkpoint and exit code 75 on every rank, not killed by the signal (which a
    wrapper that requeues on 75, or the Slurm script's requeue on SIGUSR1, would take for a failure). SIGKILL then:
    the ranks, with nothing trained to save, end at once, loader workers included; they used to wait --dist-timeout
    (30 minutes) in the rendezvous for torchrun's store, gone with it."""
    flags, env, wait_for_ranks = slow_start(tmp_path)
    job = torchrun(SCRIPT, 2, *flags, env=env)
    wait_for_ranks()
    job.proc.send_signal(signum)
    if signum == signal.SIGTERM:
        assert_preempted(job, tmp_path / "out", code=LAUNCHER_FAILED)
    else:
        job.finish(timeout=60)  # and nothing is left (Job.finish checks)
        assert job.returncode == -signum and not (tmp_path / "out" / "checkpoint.pth.tar").exists()


def test_ctrl_c_while_a_rank_waits_for_its_peers_ends_every_process_at_once(tmp_path):
    """Ctrl-C with rank 0 still building its datasets and rank 1 waiting for it in the rendezvous, where no handler
    of Python's runs: rank 1 used to wait on until torchrun killed it, 30 s later."""
    flags, env, wait_for_ranks = slow_start(tmp_path)
    job = torchrun(SCRIPT, 2, *flags, env={**env, "PAUSE_RANK0": "120"})
    wait_for_ranks()
    deadline = time.monotonic() + 120
    while not (tmp_path / "built").exists():
        assert time.monotonic() < deadline and job.proc.poll() is None, job.output
        time.sleep(0.1)
    time.sleep(1)  # rank 1: into the rendezvous
    os.killpg(job.proc.pid, signal.SIGINT)
    job.finish(timeout=20)  # torchrun's own wait for a rank that ignores its signal: 30 s
    assert "KeyboardInterrupt" not in job.output and not error_lines(job.output), job.output  # (torchrun's traceback)


def test_a_frozen_rank_ends_the_job_within_the_timeout(image_data, tmp_path):
    """A rank that stops answering but does not die (SIGSTOP: as if stuck in I/O or a driver call): the others
    give up after --dist-timeout, in gloo's words; torchrun kills the frozen one 30 s after asking it to stop."""
    job = torchrun(SCRIPT, 2, image_data, *FAST, "-p", "1", "--epochs", "3", "--dist-timeout", "10",
                   "--output-dir", tmp_path)
    job.wait_for_line("Epoch 0 [ 2/12]")
    freeze(job, job.process_of_rank(1), ends_within=10 + 30 + 15)
    assert re.search(TIMED_OUT, job.output), job.output


def test_a_killed_worker_is_restarted_and_repeats_at_most_one_epoch(image_data, tmp_path, uninterrupted):
    job = torchrun(SCRIPT, 2, image_data, *RESUME, "--epochs", EPOCHS, "--resume", "auto", "--output-dir", tmp_path,
                   launcher_args=["--max-restarts=1"], env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    job.wait_for_line("Epoch 1 [ 1/12]")
    job.process_of_rank(1).send_signal(signal.SIGKILL)
    ok(job)
    assert "pytorch#135712" not in job.output
    assert "(epoch 1, step 0)" in job.output  # restarted from the checkpoint of epoch 0
    assert [r["epoch"] for r in metrics(tmp_path)] == list(range(EPOCHS))
    assert_same_run(tmp_path, uninterrupted)


HELD = '''
import os
import time

import torch


class Held(torch.nn.Module):
    """A linear model with BALLAST numbers of state besides (a large model's weights, for memory's sake), whose
    training forward pass waits while it has run as many times as the file GATE says: the test looks at the run there,
    every loader worker alive (an epoch's end, or the run's, would end some)."""

    def __init__(self, num_classes):
        super().__init__()
        self.head = torch.nn.Linear(3, num_classes)
        self.register_buffer("ballast", torch.randn(int(os.environ["BALLAST"])))
        self.calls = 0

    def forward(self, x):
        self.calls += self.training
        while self.calls > int(open(os.environ["GATE"]).read()):
            time.sleep(0.05)
        return self.head(x.mean((2, 3)))
'''


def held(data, tmp_path, *args, ballast=1, output_dir="out", script=SCRIPT):
    """The script on `data` and the Held model, under its launcher with 2 processes and 2 loader workers each, its
    first training forward pass let through; (job, trainers, let): let(n) lets n passes through in all."""
    (tmp_path / "held.py").write_text(HELD)
    gate = tmp_path / "gate"

    def let(passes):  # in one rename: the model reads the file all the while, and must never find it half-written
        (tmp_path / "gate.new").write_text(str(passes))
        (tmp_path / "gate.new").replace(gate)
    let(1)
    job = (torchrun if script == SCRIPT else spawn)(script, 2, data, *FAST, "-j", "2", "-p", "1", "-a", "held:Held",
                                                    "--output-dir", tmp_path / output_dir, *args,
                                                    env={"PYTHONPATH": tmp_path, "BALLAST": ballast, "GATE": gate})

    def trainers():  # the training processes, in rank order
        return job.spawned() if script != SCRIPT else [job.process_of_rank(rank) for rank in (0, 1)]
    return job, trainers, let


@pytest.mark.parametrize("script", [SCRIPT, "multiprocessing_distributed.py"])
def test_every_loader_worker_is_forked_before_the_first_step_and_never_again(script, image_data, tmp_path):
    """A fork while other threads run can hang the child (pytorch#130610): both loaders' workers start before
    the process group's threads (gloo's: one hung a worker in os.fork in CI) and before training, and validation
    takes the same workers every epoch. Forked also in a process that spawn started, whose default start method is
    spawn: a spawned worker imports torch and the script anew (seconds, and some 400 MiB, each)."""
    job, trainers, let = held(image_data, tmp_path, "--epochs", "2", script=script)

    def workers():
        return {rank: {p.pid for p in trainer.children()} for rank, trainer in enumerate(trainers())}
    job.wait_for_line("Epoch 0 [ 1/12]")
    first = workers()
    assert [len(pids) for pids in first.values()] == [4, 4]  # 2 for training, 2 for validation
    for rank, pids in first.items():
        trainer = trainers()[rank]
        assert {tuple(psutil.Process(pid).cmdline()) for pid in pids} == {tuple(trainer.cmdline())}  # forked
        gloo = threads_started(trainer, "gloo")
        assert gloo and max(started(pid) for pid in pids) <= min(gloo), (rank, gloo)
    let(13)  # the rest of epoch 0, a validation, and epoch 1's first step
    job.wait_for_line("Epoch 1 [ 1/12]")
    assert workers() == first
    let(24)
    ok(job)


def test_loader_workers_keep_neither_the_model_nor_the_resumed_checkpoint(image_data, tmp_path):
    """The loader workers fork before the model is built and the checkpoint read: a fork after would keep their
    pages alive in every worker for the whole run, once the training process has dropped them (a 256 MiB model:
    about +512 MiB over 2 ranks' workers after --resume, and its share of the model on a fresh start). Measured
    against the same fresh run with a model of no size."""
    def workers_pss(epoch, *args, ballast=2**26):
        job, trainers, let = held(image_data, tmp_path, *args, ballast=ballast, output_dir=f"out{ballast}")
        job.wait_for_line(f"Epoch {epoch} [ 1/12]")
        pss = sum(w.memory_full_info().pss for trainer in trainers() for w in trainer.children())
        let(12)
        ok(job)
        return pss / 2**20

    none = workers_pss(0, "--epochs", "1", ballast=1)
    fresh = workers_pss(0, "--epochs", "1")
    resumed = workers_pss(1, "--epochs", "2", "--resume", "auto")
    assert fresh - none < 64 and resumed - none < 64, (none, fresh, resumed)


def test_a_rank_killed_while_it_saves_leaves_the_last_checkpoint_and_no_stray_file(image_data, tmp_path):
    """SIGKILL (the out-of-memory killer, a node's end) to rank 0 while it writes a 512 MiB checkpoint: the last
    checkpoint stays whole, and once a resumed run has saved, no temporary file is left, however many saves were
    killed (a file each would fill the disk)."""
    out = tmp_path / "out"
    job, _, let = held(image_data, tmp_path, "--epochs", "2", ballast=2**27)
    let(10**6)
    job.wait_for_line("Epoch 1 [ 1/12]")
    deadline = time.monotonic() + 120
    while not list(out.glob("checkpoint.pth.tar.tmp*")):
        assert time.monotonic() < deadline and job.proc.poll() is None, job.output
        time.sleep(0.01)
    writer = job.process_of_rank(0)
    writer.suspend()  # stopped mid-write: the kill below lands there, however slowly this test runs
    assert list(out.glob("checkpoint.pth.tar.tmp*")), "the write ended before the test could stop it"
    writer.kill()
    job.finish()
    assert job.returncode != 0 and load(out / "checkpoint.pth.tar")["epoch"] == 1
    job, _, let = held(image_data, tmp_path, "--epochs", "3", "--resume", "auto", ballast=2**27)
    let(10**6)
    ok(job)
    assert load(out / "checkpoint.pth.tar")["epoch"] == 3 and not list(out.glob("*.tmp*")), sorted(out.iterdir())


KILLED_BETWEEN_WRITES = """
def linear(num_classes):
    model = torch.nn.Linear(20, num_classes)
    def kill_at_second_write(module, prefix, keep_vars):  # as the checkpoint is saved
        if os.environ.get("KILL"):
            fsync, writes = os.fsync, []
            def fsync_or_die(fd):
                writes.append(fd)
                if len(writes) == 2:
                    os.kill(os.getpid(), signal.SIGKILL)
                fsync(fd)
            os.fsync = fsync_or_die
    model.register_state_dict_pre_hook(kill_at_second_write)
    return model
"""


def test_a_run_killed_between_the_best_and_the_checkpoint_loses_no_best_weights(tmp_path):
    """The first epoch's save writes two files, each whole or not at all; SIGKILL between them. model_best.pth.tar
    comes first: the checkpoint that commits an epoch comes last. The other way round, a resumed run went on from
    the committed epoch and never wrote its best weights."""
    flags, env = own_rows(tmp_path, KILLED_BETWEEN_WRITES)
    out = tmp_path / "out"
    flags += ["-j", "2", "--epochs", "2", "--output-dir", out]
    job = python(SCRIPT, *flags, env={**env, "KILL": "1"}).finish(120)
    assert job.returncode == -signal.SIGKILL and load(out / "model_best.pth.tar")["epoch"] == 1, job.output
    assert not (out / "checkpoint.pth.tar").exists()  # the epoch is not committed: it is trained again
    ok(python(SCRIPT, *flags, "--resume", "auto", env=env))
    best, last = load(out / "model_best.pth.tar"), load(out / "checkpoint.pth.tar")
    assert best["best_acc1"] == last["best_acc1"] > 0 and [row["epoch"] for row in metrics(out)] == [0, 1]


NAN_IN_EVAL = """
class Linear(torch.nn.Linear):
    def forward(self, x):  # finite in training, NaN in evaluation: an fp16 overflow in eval mode, say
        out = super().forward(x)
        return out if self.training else out * float("nan")
def linear(num_classes):
    return Linear(20, num_classes)
"""


def test_a_loss_that_is_nan_in_evaluation_is_null_in_metrics_jsonl(tmp_path):
    """NaN and inf are not JSON: a strict reader of metrics.jsonl (jq, a dashboard) refused the whole file."""
    flags, env = own_rows(tmp_path, NAN_IN_EVAL)
    job = ok(python(SCRIPT, *flags, "--epochs", "1", "--output-dir", tmp_path / "out", env=env))
    row = metrics(tmp_path / "out")[0]
    assert row["val_loss"] is None and row["train_loss"] > 0 and "val loss nan" in job.output, row


@pytest.mark.quick
@pytest.mark.parametrize("script", sorted(p.name for p in ROOT.glob("*.py")))
def test_every_script_forks_its_loader_workers_before_the_model_and_the_checkpoint(script):
    """The memory test above for every script, read from its source: nothing main_worker calls before build_loaders
    (nor what those functions of the script's own call) builds the model or reads a checkpoint."""
    tree = ast.parse((ROOT / script).read_text())
    functions = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}

    def calls(node):
        return {c.func.id for c in ast.walk(node) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)}

    body = functions["main_worker"].body
    first = next(i for i, statement in enumerate(body) if "build_loaders" in calls(statement))
    direct = set().union(*map(calls, body[:first]))
    called = direct.union(*(calls(functions[name]) for name in direct if name in functions))
    assert not called & {"build_model", "UNet3D", "load_checkpoint", "read_checkpoint"}, called


def test_benchmark_mode_trains_on_synthetic_device_batches_and_prints_img_per_s(image_data, tmp_path):
    """With DATA, its class count; the global batch may exceed its train set (192), which it never reads. Without
    DATA: tests/test_benchmarks.py (benchmarks/gpu_throughput.py)."""
    job = ok(torchrun(SCRIPT, 2, image_data, "--benchmark", "4", "--crop-size", "32", "-b", "200",
                      "--output-dir", tmp_path))
    assert "resnet18, 4 classes, 192 train" in job.output, job.output
    assert re.search(r"^benchmark: \d+ img/s over 4 steps, 2 processes, global batch 200, resnet18 at 32 px",
                     job.output, re.M)
    assert not tmp_path.exists() or not any(tmp_path.iterdir())  # nothing written


def test_the_deprecated_launcher_starts_it(image_data, tmp_path):
    """python -m torch.distributed.launch, which the repository this one follows tells its users to start (torch
    2.14 still ships it): it passes --local-rank=N, and sets LOCAL_RANK too."""
    launch = [sys.executable, "-m", "torch.distributed.launch", "--nproc_per_node=2", f"--master_port={free_port()}"]
    job = ok(Job([*launch, ROOT / SCRIPT, image_data, *FAST, "--epochs", "1", "--output-dir", tmp_path]))
    assert "world size 2" in job.output and "Epoch 0: train loss" in job.output, job.output
