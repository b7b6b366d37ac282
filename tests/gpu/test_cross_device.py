"""Checkpoints move between devices: a run checkpointed on the GPU continues on the CPU (CUDA_VISIBLE_DEVICES=""),
and one checkpointed on the CPU continues on the GPU, with the same command line. A checkpoint from a GPU holds
CUDA tensors and the GPU's random state; the scripts must load it to the CPU first (random states must reach
torch.set_rng_state as CPU tensors) and leave out the GPU's state where there is no GPU."""
import pytest

from conftest import FAST, metrics, ok, python, torchrun

from .harness import APEX, DATAPARALLEL, DEVICE, DISTRIBUTED, UNET, UNET_ARGS, checkpoint_of, launch

NO_GPU = {"CUDA_VISIBLE_DEVICES": ""}
SCRIPTS = [DISTRIBUTED, DATAPARALLEL, APEX, UNET]
# apex: the same command on both devices; float16 on the GPU, bfloat16 standing in on the CPU
ARGS = {APEX: [*FAST, "--opt-level", "O2"], UNET: UNET_ARGS}


def on_cpu(script, *args):
    """The script's plain single-process run, on the CPU (it sees no GPU)."""
    if script in (DISTRIBUTED, APEX, UNET):
        return torchrun(script, 1, *args, env=NO_GPU)
    return python(script, *args, env=NO_GPU)


def run(script, device, data, out, epochs, *extra):
    args = [*([] if script == UNET else [data]), *ARGS.get(script, FAST), "--epochs", epochs, "--output-dir", out,
            *extra]
    return ok(on_cpu(script, *args) if device == "cpu" else launch(script, *args))


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("first, then", [(DEVICE, "cpu"), ("cpu", DEVICE)], ids=["gpu-to-cpu", "cpu-to-gpu"])
def test_a_checkpoint_continues_on_the_other_device(first, then, script, image_data, tmp_path):
    written = run(script, first, image_data, tmp_path, 1)
    assert f"device {first}" in written.output, written.output
    resumed = run(script, then, image_data, tmp_path, 2, "--resume", "auto")
    assert f"device {then}" in resumed.output and "(epoch 1, step 0)" in resumed.output, resumed.output
    assert [r["epoch"] for r in metrics(tmp_path)] == [0, 1]
    assert checkpoint_of(tmp_path)["epoch"] == 2
