"""The training loop's flags where their CUDA paths run: --compile (inductor's GPU kernels),
--clip-grad-norm under fp16 loss scaling (and on apex O2's fp32 masters), --grad-accum-steps, --model-ema, and
--profile with the GPU's kernels in the trace, under every launcher."""
import pytest
import torchvision

from conftest import EPOCHS, FAST, ema_weights, ok, profile_traces

from .harness import (APEX, DATAPARALLEL, DEVICE, DISTRIBUTED, FP16, HALF, HOROVOD, ON_CPU, SLURM,
                      SPAWN, assert_trains, checkpoint_of, horovod_missing, launch)

LOOP = ["--grad-accum-steps", "2", "--clip-grad-norm", "1", "--label-smoothing", "0.1", "--model-ema",
        "--model-ema-decay", "0.9"]
PRECISION = {APEX: ["--opt-level", "O2", "--half-dtype", HALF]}  # O2: clipping the fp32 masters' gradients


@pytest.mark.parametrize("script", [DISTRIBUTED, SPAWN, DATAPARALLEL, APEX, HOROVOD, SLURM])
def test_the_loop_under_fp16_learns_clips_and_averages(script, image_data, tmp_path):
    """Every flag of the loop at once, in fp16 with loss scaling (apex: O2): clipping sees unscaled gradients
    (clipping scaled ones at 1 would clip every step to nothing, and it would not learn)."""
    if script == HOROVOD and (why := horovod_missing()):
        pytest.skip(why)
    ok(launch(script, image_data, *FAST, "--lr", "0.05", *PRECISION.get(script, ["--amp", FP16]), *LOOP,
              "--epochs", EPOCHS, "--output-dir", tmp_path))
    rows = assert_trains(tmp_path, EPOCHS, min_acc1=50)
    assert "val_acc1_ema" in rows[-1], rows
    torchvision.models.resnet18(num_classes=4).load_state_dict(ema_weights(checkpoint_of(tmp_path)))


def test_compile_on_the_gpu_trains_and_saves_a_plain_model(image_data, tmp_path):
    ok(launch(DISTRIBUTED, image_data, *FAST, "--compile", "--amp", "bf16", "--no-tf32", "--epochs", 2,
              "--output-dir", tmp_path), timeout=900)
    assert_trains(tmp_path, 2)
    torchvision.models.resnet18(num_classes=4).load_state_dict(checkpoint_of(tmp_path)["state_dict"])


def test_profile_on_the_gpu_traces_its_kernels(image_data, tmp_path):
    job = ok(launch(DISTRIBUTED, image_data, *FAST, "--epochs", 1, "--profile", 3, "--output-dir", tmp_path))
    assert "profile: 3 steps, the operators that took the most time:" in job.output, job.output
    events = profile_traces(tmp_path)[0]
    assert ON_CPU or any(e.get("cat") == "kernel" for e in events)  # the GPU's own timeline
    assert f"device {DEVICE}" in job.output


