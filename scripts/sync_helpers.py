"""Keeps what the scripts share byte-identical with distributed.py, the reference.

The scripts stand alone, so each carries its own copy of the shared code; this copies the reference's
text into every sibling after a fix (tests/test_helpers_identical.py fails until it is run). Shared is
every top-level function, class and constant a sibling defines under a name the reference also uses,
except the names the sibling does its own way (OWN below): so the training flow (main_worker, RunState,
train_one_epoch, evaluate) and the appendix are compared, and so is every part of the launcher
interface that a sibling takes over unchanged.

    python scripts/sync_helpers.py          # rewrite the siblings in place
    python scripts/sync_helpers.py --check  # only list what differs (exit 1 if anything does)
"""
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = "distributed.py"
# the launcher interface: every ImageNet sibling defines these, its own way or with the reference's text
INTERFACE = ["parse_args", "find_processes", "check_launch_args", "start_process_group",
             "end_process_group", "describe_processes", "prepare_model", "build_optimizer", "setup_precision",
             "wrap_model", "train_step", "reduce_tensor", "gather_objects", "gather_rng_states", "sync_buffers",
             "sum_async", "main"]
# the training flow, the same text in every ImageNet sibling
FLOW = ["main_worker", "RunState", "train_one_epoch", "check_finite", "evaluate"]
# the appendix
APPENDIX = ["UserError", "RankError", "Parser", "number", "PEER_GONE", "PEER_GONE_TYPES", "explain_failure",
            "exit_bad_input", "catch_ctrl_c", "exit_ctrl_c", "join_process_group", "die_with_parent", "Preemption",
            "check_args", "check_and_load",
            "load_spec", "call_spec", "class_count", "check_datasets", "check_model",
            "build_model", "param_groups", "new_optimizer", "lr_factor", "forward_backward", "optimizer_step",
            "ModelEMA", "set_tf32", "span_union", "span_common", "StepProfiler", "IMAGENET_MEAN", "IMAGENET_STD",
            "SyntheticImages",
            "load_image", "RandomResizedCropFlip", "collate", "check_items", "build_datasets", "ImageCrops",
            "build_loaders", "fork_loader_workers",
            "start_loader_worker", "end_loader_workers", "TrainSampler", "SeededSamples", "ShardSampler",
            "Prefetcher", "accuracy", "Metrics", "print_or_drop", "write_epoch", "benchmark", "memory_use",
            "CHECKPOINT", "set_seed",
            "rng_state", "set_rng_state", "atomic_write", "claim_output_dir", "tensor_bytes", "save_checkpoint",
            "resume_path", "read_checkpoint", "load_checkpoint", "check_fit", "check_same_checkpoint"]
SHARED = INTERFACE + FLOW + APPENDIX
# what each sibling does its own way (its launcher part); every other name it shares with the reference is
# the reference's text
OWN = {
    "multiprocessing_distributed.py": {"parse_args", "find_processes", "start_process_group", "main"},
    "distributed_slurm_main.py": {"parse_args", "find_processes", "start_process_group", "main"},
    "dataparallel.py": {"parse_args", "find_processes", "start_process_group", "describe_processes", "prepare_model",
                        "wrap_model", "gather_rng_states", "main"},
    "horovod_distributed.py": {"parse_args", "find_processes", "start_process_group",
                               "end_process_group", "describe_processes", "prepare_model", "build_optimizer",
                               "wrap_model", "train_step", "reduce_tensor", "gather_objects", "sync_buffers",
                               "sum_async", "main"},
    "fsdp_distributed.py": {"parse_args", "check_launch_args", "start_process_group", "prepare_model",
                            "setup_precision", "wrap_model", "train_step", "RunState", "evaluate", "CHECKPOINT",
                            "read_checkpoint"},
    "apex_distributed.py": {"parse_args", "build_optimizer", "setup_precision", "collate"},
    # another task than ImageNet: it shares the launcher part and the task-independent appendix helpers
    "unet3d_apex.py": {"parse_args", "check_args", "describe_processes", "prepare_model",
                       "build_optimizer", "setup_precision", "train_step", "main_worker", "RunState", "train_one_epoch",
                       "check_finite", "evaluate", "check_and_load", "build_datasets", "build_loaders",
                       "load_checkpoint"},
}
# shared names a sibling has no use for: no process group of torch.distributed's
NOT_CARRIED = {"dataparallel.py": {"join_process_group"}, "horovod_distributed.py": {"join_process_group"},
               "unet3d_apex.py": {"check_fit", "load_spec", "call_spec", "class_count", "check_datasets", "ImageCrops",
                                  "check_model", "build_model", "param_groups", "new_optimizer",
                                  "lr_factor", "forward_backward", "optimizer_step", "ModelEMA", "set_tf32",
                                  "span_union", "span_common", "StepProfiler",
                                  "IMAGENET_MEAN", "IMAGENET_STD", "SyntheticImages", "load_image",
                                  "RandomResizedCropFlip", "collate", "check_items", "Prefetcher", "accuracy",
                                  "Metrics", "benchmark",
                                  "memory_use",
                                  "MODEL_NAMES"}}


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
    """(name, reference text, script text or None) for every shared name the script lacks or has another text
    for; and (name, None, script text) for a name declared its own that is the reference's text after all."""
    ref_source, source = (ROOT / REFERENCE).read_text(), (ROOT / script).read_text()
    ref, own = definitions(ref_source), definitions(source)
    mine = OWN.get(script, set())
    required = set(SHARED) - NOT_CARRIED.get(script, set())
    out = []
    for name in sorted(set(ref) & (set(own) | required)):
        text = ref_source[slice(*ref[name])]
        theirs = source[slice(*own[name])] if name in own else None
        if name in mine and theirs == text:
            out.append((name, None, theirs))
        elif name not in mine and theirs != text and (theirs is not None or name in required):
            out.append((name, text, theirs))
    return out


def sync(script):
    source = (ROOT / script).read_text()
    for name, text, mine in differences(script):
        if mine is None:
            raise SystemExit(f"{script} lacks {name}: add it by hand where it belongs")
        if text is None:
            raise SystemExit(f"{script}: {name} is the reference's text: take it out of OWN in {__file__}")
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
