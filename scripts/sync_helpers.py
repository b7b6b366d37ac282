"""Copies the shared helpers from distributed.py into every sibling ImageNet script.

The scripts stand alone, so each carries its own copy of the helpers; this keeps the copies
byte-identical after a fix (tests/test_helpers_identical.py fails until it is run).

    python scripts/sync_helpers.py          # rewrite the siblings in place
    python scripts/sync_helpers.py --check  # only list what differs (exit 1 if anything does)
"""
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = "distributed.py"
SHARED = ["IMAGENET_MEAN", "IMAGENET_STD", "UserError", "RankError", "exit_bad_input", "set_seed", "rng_state", "set_rng_state",
          "reduce_tensor", "accuracy", "Metrics", "SyntheticImages", "load_image", "RandomResizedCropFlip", "collate", "build_datasets", "TrainSampler",
          "SeededSamples", "ShardSampler", "Prefetcher", "check_model", "build_model", "param_groups", "lr_factor", "atomic_write",
          "save_checkpoint", "resume_path", "load_checkpoint", "check_same_checkpoint", "check_and_load", "write_epoch"]
# helpers every script that starts a torch.distributed process group carries as well
PROCESS_GROUP = ["join_process_group", "end_process_group"]
# helpers a launcher has to do its own way: Horovod sums with hvd.allreduce, not torch.distributed
OWN_WAY = {"horovod_distributed.py": {"reduce_tensor"}, "apex_distributed.py": {"collate"}}
# a script for another task than ImageNet carries the task-independent helpers, and the launcher part of
# the launcher it shares with the reference
OTHER_TASKS = {"unet3d_apex.py": ["UserError", "RankError", "exit_bad_input", "set_seed", "rng_state", "set_rng_state", "reduce_tensor",
                                  "TrainSampler", "SeededSamples", "ShardSampler", "atomic_write", "save_checkpoint",
                                  "resume_path", "check_same_checkpoint", "write_epoch", "find_processes",
                                  "start_process_group", "join_process_group", "wrap_model", "sync_buffers",
                                  "gather_objects", "Preemption", "end_process_group", "main"]}


def definitions(source):
    """name -> (start offset, end offset) of each top-level function, class and assignment."""
    lines = source.splitlines(keepends=True)
    offset = [0]
    for line in lines:
        offset.append(offset[-1] + len(line))
    found = {}
    for node in ast.parse(source).body:
        names = [t.id for t in getattr(node, "targets", []) if isinstance(t, ast.Name)] + [getattr(node, "name", None)]
        for name in filter(None, names):
            start = offset[node.lineno - 1] + node.col_offset
            found[name] = (start, offset[node.end_lineno - 1] + node.end_col_offset)
    return found


def siblings():
    """Every top-level script that follows the reference's main -> main_worker shape."""
    return sorted(p.name for p in ROOT.glob("*.py") if p.name != REFERENCE and "def main_worker(" in p.read_text())


def differences(script):
    """(helper, reference text, script text or None) for every shared helper that differs."""
    ref_source, source = (ROOT / REFERENCE).read_text(), (ROOT / script).read_text()
    ref, own = definitions(ref_source), definitions(source)
    out = []
    shared = SHARED + (PROCESS_GROUP if "process_group(" in source else [])
    for name in OTHER_TASKS.get(script, shared):
        if name in OWN_WAY.get(script, ()):
            continue
        text = ref_source[slice(*ref[name])]
        mine = source[slice(*own[name])] if name in own else None
        if mine != text:
            out.append((name, text, mine))
    return out


def sync(script):
    source = (ROOT / script).read_text()
    for name, text, mine in differences(script):
        if mine is None:
            raise SystemExit(f"{script} lacks the shared helper {name}: add it by hand where it belongs")
        start, end = definitions(source)[name]
        source = source[:start] + text + source[end:]
    (ROOT / script).write_text(source)


if __name__ == "__main__":
    drift = {s: [d[0] for d in differences(s)] for s in siblings()}
    for script, names in drift.items():
        if names:
            print(f"{script}: {', '.join(names)}")
            if "--check" not in sys.argv:
                sync(script)
    sys.exit(1 if "--check" in sys.argv and any(drift.values()) else 0)
