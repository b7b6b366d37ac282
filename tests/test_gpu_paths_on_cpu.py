"""Defects that only CUDA runs show, caught here where a CPU can stand in (tests/gpu/ runs them on a GPU)."""
import types

import pytest
import torch
import torchvision

from conftest import import_script

IMAGENET_SCRIPTS = ["distributed.py", "multiprocessing_distributed.py", "dataparallel.py", "apex_distributed.py",
                    "horovod_distributed.py", "distributed_slurm_main.py"]
DDP_SCRIPTS = ["distributed.py", "multiprocessing_distributed.py", "apex_distributed.py", "distributed_slurm_main.py",
               "unet3d_apex.py"]


def tensors(tree):
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for value in tree.values():
            yield from tensors(value)
    elif isinstance(tree, (list, tuple)):
        for value in tree:
            yield from tensors(value)


def assert_resumes_with_cpu_states(module, ckpt):
    """What a resume hands to torch: CPU tensors only, and random states set_rng_state takes."""
    devices = {t.device.type for t in tensors(ckpt)}
    assert devices == {"cpu"}, devices
    for state in ckpt["rng_states"]:
        module.set_rng_state(state)


@pytest.mark.parametrize("script", IMAGENET_SCRIPTS)
def test_a_checkpoint_loaded_for_a_gpu_is_on_the_cpu(script, image_data, uninterrupted):
    """Loaded with map_location=device, every resume on a GPU crashed: the random states landed on the
    GPU and torch.set_rng_state refused them. The meta device stands in for the GPU here: it fails the
    same way ("RNG state must be a torch.ByteTensor") when anything is mapped to the device."""
    module = import_script(script)
    args = module.parse_args([str(image_data), "--resume", str(uninterrupted / "checkpoint.pth.tar"), "-b", "16"])
    ckpt = module.read_checkpoint(module.resume_path(args))
    assert ckpt["epoch"] > 0
    assert_resumes_with_cpu_states(module, ckpt)
    with pytest.raises(TypeError, match="RNG state must be a torch.ByteTensor"):  # what mapping to the device did
        module.set_rng_state({**ckpt["rng_states"][0], "torch": ckpt["rng_states"][0]["torch"].to("meta")})


def test_a_unet_checkpoint_loaded_for_a_gpu_is_on_the_cpu(tmp_path):
    module = import_script("unet3d_apex.py")
    args = module.parse_args(["--synthetic", "--resume", str(tmp_path / "ckpt.pth.tar")])
    config = module.model_config(args, 1)
    torch.save({"arch": "unet3d", "model": config, "state_dict": module.UNet3D(**config).state_dict(), "epoch": 1,
                "rng_states": [module.rng_state()]}, tmp_path / "ckpt.pth.tar")
    assert_resumes_with_cpu_states(module, module.read_checkpoint(module.resume_path(args)))


@pytest.mark.parametrize("script", [*IMAGENET_SCRIPTS, "fsdp_distributed.py", "unet3d_apex.py"])
def test_sync_bn_converts_every_batchnorm_for_cuda_and_says_it_is_off_on_cpu(script):
    """--sync-bn on a GPU: a SyncBatchNorm (Horovod's own, for horovod_distributed.py) in place of every BatchNorm,
    their statistics kept; on the CPU, and under DataParallel anywhere, the model as it was and a notice."""
    module = import_script(script)
    args, said = types.SimpleNamespace(sync_bn=True), []
    model = torchvision.models.resnet18()
    model.bn1.running_mean.fill_(0.5)
    assert module.sync_batchnorm(model, args, torch.device("cpu"), said.append) is model and len(said) == 1
    assert said[0].startswith("--sync-bn: off")
    synced = module.sync_batchnorm(model, args, torch.device("cuda", 0), said.append)
    norms = [m for m in synced.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    if script == "dataparallel.py":
        assert synced is model and len(said) == 2
    else:
        assert len(norms) == 20 and all("SyncBatchNorm" in type(m).__name__ for m in norms) and len(said) == 1
        assert torch.equal(synced.bn1.running_mean, torch.full((64,), 0.5))
