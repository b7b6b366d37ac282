"""The helpers every ImageNet script carries must stay byte-identical to distributed.py's: a fix to
one is a fix to all. Each script stands alone, so the copies are on purpose; drift is the bug."""
import ast

import pytest

from conftest import ROOT

REFERENCE = "distributed.py"
SHARED = ["IMAGENET_MEAN", "IMAGENET_STD", "UserError", "DataError", "set_seed", "rng_state", "set_rng_state",
          "reduce_tensor", "accuracy", "Metrics", "SyntheticImages", "load_image", "build_datasets", "TrainSampler",
          "SeededSamples", "ShardSampler", "Prefetcher", "build_model", "param_groups", "lr_factor", "atomic_write",
          "save_checkpoint", "resume_path", "load_checkpoint", "check_and_load", "write_epoch"]
# helpers a launcher has to do its own way (e.g. Horovod reduces with hvd.allreduce, not torch.distributed)
OWN_WAY = {}
# scripts for another task than ImageNet carry only the task-independent helpers, and the launcher part
# of the launcher they share with the reference
OTHER_TASKS = {"unet3d_apex.py": ["UserError", "DataError", "set_seed", "rng_state", "set_rng_state", "reduce_tensor",
                                  "TrainSampler", "SeededSamples", "ShardSampler", "atomic_write", "save_checkpoint",
                                  "resume_path", "write_epoch", "find_processes", "start_process_group", "wrap_model",
                                  "sync_buffers", "gather_rng_states", "Preemption", "main"]}


def definitions(path):
    """name -> source text of each top-level function, class and assignment."""
    source = path.read_text()
    found = {}
    for node in ast.parse(source).body:
        names = [t.id for t in getattr(node, "targets", []) if isinstance(t, ast.Name)] + [getattr(node, "name", None)]
        for name in filter(None, names):
            found[name] = ast.get_source_segment(source, node)
    return found


def imagenet_scripts():
    """Every top-level script that follows the reference's main -> main_worker shape."""
    return sorted(p.name for p in ROOT.glob("*.py") if "def main_worker(" in p.read_text())


def test_the_reference_defines_every_shared_helper():
    missing = set(SHARED) - set(definitions(ROOT / REFERENCE))
    assert not missing, f"{REFERENCE} lacks {missing}: update SHARED in this test if a helper was renamed"


@pytest.mark.parametrize("script", imagenet_scripts())
def test_shared_helpers_are_identical_to_the_reference(script):
    reference, other = definitions(ROOT / REFERENCE), definitions(ROOT / script)
    for name in OTHER_TASKS.get(script, SHARED):
        if name in OWN_WAY.get(script, ()):
            continue
        assert name in other, f"{script} lacks the shared helper {name}"
        assert other[name] == reference[name], f"{script}: {name} differs from {REFERENCE}'s; copy the fix across"
