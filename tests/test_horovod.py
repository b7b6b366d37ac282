"""horovod_distributed.py under the real `horovodrun --gloo` on CPU."""
import re
import signal
import sys

import pytest

from conftest import (BIN, CHECKPOINT_KEYS, FAST, LAUNCHER_FAILED, LOOP, ROOT, Job, assert_same_tensors, freeze, load,
                      metrics, ok, python, torchrun)
from test_distributed import val_line

SCRIPT = "horovod_distributed.py"
EQUIVALENCE = [*FAST, "-a", "squeezenet1_1", "--dropout", "0", "--epochs", "2"]
# gradients are averaged by Horovod instead of DDP: the same sums in another order
TOLERANCE = dict(rtol=1e-4, atol=1e-6)


@pytest.fixture(scope="module", autouse=True)
def horovod():
    """Installed by scripts/setup.sh --test (scripts/install_horovod.sh); a skip is a failure in CI."""
    pytest.importorskip("horovod.torch")


def horovodrun(np, *args, **kwargs):
    return Job([BIN / "horovodrun", "--gloo", "-np", np, "-H", f"localhost:{np}", sys.executable, ROOT / SCRIPT, *args],
               **kwargs)


@pytest.fixture(scope="module")
def trained(image_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("horovod")
    job = ok(horovodrun(2, image_data, *FAST, "--epochs", "4", "--output-dir", out))
    return job, out


@pytest.mark.xdist_group("horovod_trained")
def test_two_processes_learn_checkpoint_and_resume(trained, image_data):
    job, out = trained
    assert "world size 2, device cpu, backend horovod/gloo, global batch 16 = 2 x 8" in job.output
    rows = metrics(out)
    assert [r["epoch"] for r in rows] == [0, 1, 2, 3]
    assert max(r["val_acc1"] for r in rows) >= 70, rows
    ckpt = load(out / "checkpoint.pth.tar")
    assert set(ckpt) == CHECKPOINT_KEYS and (ckpt["epoch"], ckpt["world_size"], len(ckpt["rng_states"])) == (4, 2, 2)
    resumed = ok(horovodrun(2, image_data, *FAST, "--epochs", "5", "--resume", "auto", "--output-dir", out))
    assert "(epoch 4, step 0)" in resumed.output
    assert [r["epoch"] for r in metrics(out)] == [0, 1, 2, 3, 4]


@pytest.mark.xdist_group("horovod_trained")
def test_evaluation_is_exact(trained, image_data):
    """Two Horovod processes count exactly what one distributed.py process counts on 101 images."""
    _, out = trained
    ckpt = out / "model_best.pth.tar"
    two = val_line(ok(horovodrun(2, image_data, *FAST, "-e", "--resume", ckpt)))
    one = val_line(ok(python("distributed.py", image_data, *FAST, "-e", "--resume", ckpt)))
    assert two[1] == one[1] and two[1][-1] == "101"
    assert two[0] == pytest.approx(one[0], rel=1e-5)


@pytest.fixture(scope="module")
def ddp_weights(image_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    ok(torchrun("distributed.py", 2, image_data, *EQUIVALENCE, "--output-dir", out))
    return load(out / "checkpoint.pth.tar")["state_dict"]


@pytest.mark.parametrize("extra", [[], ["--grad-accum-steps", "2"]], ids=["one-pass", "two-micro-batches"])
@pytest.mark.xdist_group("horovod_ddp_weights")
def test_horovod_gives_the_weights_of_ddp(extra, image_data, tmp_path, ddp_weights):
    """Same seed, data and global batch: Horovod ends where DDP ends, also when each process's batch
    is split into two backward passes per all-reduce (backward_passes_per_step)."""
    ok(horovodrun(2, image_data, *EQUIVALENCE, *extra, "--output-dir", tmp_path))
    assert_same_tensors(load(tmp_path / "checkpoint.pth.tar")["state_dict"], ddp_weights, exact=False, **TOLERANCE)


def test_horovod_clips_averaged_gradients_and_keeps_the_average_of_ddp(image_data, tmp_path, loop_reference):
    """--clip-grad-norm after synchronize(): on the averaged gradients, as DDP clips them; --grad-accum-steps,
    --model-ema and --label-smoothing alike; --profile under Horovod, rank 0's table."""
    job = ok(horovodrun(2, image_data, *LOOP, "--profile", "2", "--output-dir", tmp_path))
    ours, ddp = load(tmp_path / "checkpoint.pth.tar"), load(loop_reference / "checkpoint.pth.tar")
    for key in ("state_dict", "model_ema"):
        assert_same_tensors(ours[key], ddp[key], exact=False, **TOLERANCE)
    assert re.search(r"^\[0\]<stdout>:profile: 2 steps", job.output, re.M), job.output


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL])
@pytest.mark.alone  # horovodrun kills the ranks 5 s after SIGTERM: the checkpoint must be saved by then
def test_a_signal_to_horovodrun_ends_in_the_preemption_checkpoint_with_loader_workers(signum, image_data, tmp_path):
    """SIGTERM to horovodrun: it passes SIGTERM to each training process and kills what is left 5 s later.
    SIGKILL: its per-rank middlemen notice and do the same. Loader workers must not bring their rank down first;
    nothing may be left (Job.finish checks). After SIGKILL, horovodrun's output is gone with it."""
    job = horovodrun(2, image_data, *FAST, "-j", "2", "-p", "1", "--epochs", "3", "--output-dir", tmp_path)
    job.wait_for_line("Epoch 0 [ 1/12]")
    job.proc.send_signal(signum)
    job.finish(timeout=120)
    # horovodrun: 1, or 0 when its own shutdown races (the thread that stops a rank reaps the rank's shell before the
    # middleman's Popen.wait does, which then reads 0: seen once in CI); the checkpoint below is what counts
    assert job.returncode in ((LAUNCHER_FAILED, 0) if signum == signal.SIGTERM else (-signum,)), job.output
    ckpt = load(tmp_path / "checkpoint.pth.tar")
    assert (ckpt["epoch"], ckpt["world_size"]) == (0, 2) and 0 < ckpt["step"] < 12, job.output
    if signum == signal.SIGTERM:
        assert re.search(rf"preempted: saved .* at epoch 0 step {ckpt['step']};", job.output), job.output


def test_a_frozen_rank_ends_the_job_within_the_timeout(image_data, tmp_path):
    """--dist-timeout is Horovod's gloo timeout (its own default, 30 s, is shorter than writing a big checkpoint):
    the waiting rank gives up in gloo's own words, horovodrun ends the rest."""
    job = horovodrun(2, image_data, *FAST, "-p", "1", "--epochs", "3", "--dist-timeout", "10", "--output-dir", tmp_path)
    job.wait_for_line("Epoch 0 [ 2/12]")
    freeze(job, job.process_of_rank(1, "HOROVOD_RANK"), ends_within=10 + 30)
    # gloo's own words: the collective that timed out, or (seen under load) another one on the pair it closed then
    assert re.search(r"Timed out waiting 10000ms|Application timeout caused pair closure", job.output), job.output
