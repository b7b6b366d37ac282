"""fsdp_distributed.py on the GPU: NCCL, the bf16 and fp16 precision policies (BatchNorm kept in fp32 groups,
GradScaler on the sharded gradients for fp16), fused AdamW and foreach SGD on sharded parameters, a ViT's flash
attention on ranks of uneven validation batches, SyncBatchNorm, a sharded checkpoint written from the
GPU that resumes bit for bit after SIGTERM, full weights that distributed.py evaluates alike; on two GPUs, the
weights of distributed.py. On the CPU (GPU_SUITE_ON_CPU=1): gloo, bf16 for fp16."""
import re

import pytest

from conftest import EPOCHS, FAST, LAUNCHER_FAILED, NO_BN, RESUME, assert_same_tensors, load, metrics, ok, torchrun

from .harness import DEVICE, FP16, NCCL, ON_CPU, assert_trains, cuda_only, made_once, preempt, two_gpus, worker

FSDP = "fsdp_distributed.py"


def export(out):
    return out / "full.pth.tar"


def fsdp(nproc, out, *args):
    return torchrun(FSDP, nproc, *args, "--output-dir", out, "--export", export(out))


@pytest.fixture(scope="module")
def fsdp_reference(image_data, tmp_path_factory):
    """One process on the first GPU, resnet18 (BatchNorm), AdamW, deterministic: (job, output folder)."""
    return made_once("fsdp_gpu", tmp_path_factory,
                     lambda out: ok(fsdp(1, out, image_data, *RESUME, "--opt", "adamw", "--epochs", EPOCHS)))


@pytest.mark.parametrize("amp", ["none", "bf16", FP16])
def test_each_precision_policy_trains_resnet18_with_adamw(amp, image_data, tmp_path):
    """--amp: the weights gathered and computed in the half dtype, BatchNorm in fp32 groups of their own (its
    statistics would drift in a half dtype, and mixed dtypes fail), gradients reduced in fp32; fp16 through
    GradScaler, whose scale the checkpoint keeps."""
    job = ok(fsdp(1, tmp_path, image_data, *FAST, "--opt", "adamw", "--lr", "0.002", "--amp", amp, "--epochs", "3"))
    assert f"device {DEVICE}, backend {NCCL}" in job.output
    assert_trains(tmp_path, 3, min_acc1=50)
    scaler = load(tmp_path / "checkpoint.dcp" / "train_state.pt")["scaler"]
    assert (scaler.get("scale", 0) > 0) == (amp == "fp16" and not ON_CPU), scaler


@cuda_only
def test_sync_bn_trains_sharded(image_data, tmp_path):
    job = ok(fsdp(1, tmp_path, image_data, *FAST, "--sync-bn", "--amp", "bf16", "--epochs", "2"))
    assert "--sync-bn: off" not in job.output
    assert_trains(tmp_path, 2)


def test_sigterm_then_resume_auto_equals_the_uninterrupted_run(fsdp_reference, image_data, tmp_path):
    job = fsdp(1, tmp_path, image_data, *RESUME, "--opt", "adamw", "--epochs", EPOCHS)
    preempt(job, worker(job), f"{FSDP}: world size")
    job.finish()
    assert job.returncode == LAUNCHER_FAILED, job.output
    assert re.search(r"preempted: saved .*checkpoint.dcp at epoch 0 step \d+;", job.output), job.output
    ok(fsdp(1, tmp_path, image_data, *RESUME, "--opt", "adamw", "--epochs", EPOCHS, "--resume", "auto"))
    assert_same_tensors(load(export(tmp_path))["state_dict"], load(export(fsdp_reference[1]))["state_dict"])
    assert len(metrics(tmp_path)) == EPOCHS


def test_distributed_evaluates_the_exported_weights_alike(fsdp_reference, image_data):
    _, out = fsdp_reference
    job = ok(torchrun("distributed.py", 1, image_data, *RESUME, "-e", "--resume", export(out)))
    correct1, count = map(int, re.search(r"correct1 (\d+), correct5 \d+, images (\d+)", job.output).groups())
    assert 100 * correct1 / count == metrics(out)[-1]["val_acc1"]


@two_gpus
@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_two_gpus_end_with_the_weights_of_distributed(opt, image_data, tmp_path):
    args = [image_data, *NO_BN, "--opt", opt, "--lr", "0.002"]
    ok(torchrun("distributed.py", 2, *args, "--output-dir", tmp_path / "ddp"))
    ok(fsdp(2, tmp_path / "fsdp", *args))
    assert_same_tensors(load(export(tmp_path / "fsdp"))["state_dict"],
                        load(tmp_path / "ddp" / "checkpoint.pth.tar")["state_dict"], exact=False, rtol=1e-3, atol=1e-5)


@cuda_only
@two_gpus
def test_a_vit_under_bf16_evaluates_ranks_of_uneven_batches(image_data, tmp_path):
    """-b 4: rank 0 has 26 validation batches, rank 1 25 and one forward (a collective) more, on one input: CUDA's
    flash attention, which a ViT under --amp runs, rejects a batch of 0 rows (pytorch/pytorch#133780)."""
    ok(fsdp(2, tmp_path, image_data, *FAST, "-a", "vit_b_16", "--crop-size", "224", "--val-resize", "224", "-b", "4",
            "--amp", "bf16", "--epochs", "1"))
    assert metrics(tmp_path)[0]["val_acc1"] > 0


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_the_default_sgd_and_adamw_train_with_fp16_clipping_and_channels_last(opt, image_data, tmp_path):
    """Each crashed at its first step on a GPU: fused SGD over DTensors (no sharding rule), ShardedGradScaler's inf
    check with fused AdamW once clipping unscaled, channels-last weights that fully_shard refused."""
    ok(fsdp(1, tmp_path, image_data, *FAST, "--opt", opt, "--lr", "0.005" if opt == "sgd" else "0.002", "--amp", FP16,
            "--clip-grad-norm", "1", "--channels-last", "--epochs", "2"))
    assert_trains(tmp_path, 2)
