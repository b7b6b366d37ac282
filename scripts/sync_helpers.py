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
import re
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
FLOW = ["main_worker", "RunState", "train_one_epoch", "evaluate"]
# the two seams, and what every run needs (part 1); the features (part 2); the safety net (part 3)
SEAMS = ["build_model", "build_datasets"]
NEEDS = ["number", "join_process_group", "lr_factor", "class_count", "NORMALIZE", "load_image", "collate",
         "build_loaders", "fork_loader_workers", "TrainSampler", "SeededSamples", "SyntheticImages", "DeviceBatches",
         "accuracy", "Metrics", "CHECKPOINT", "set_seed", "rng_state", "set_rng_state", "atomic_write",
         "save_checkpoint", "resume_path", "read_checkpoint"]
FEATURES = ["average_model", "load_pretrained", "foreign_weights", "param_groups", "warmup_or_cosine",
            "sync_batchnorm", "start_profiler", "benchmark", "memory_use", "PREEMPTED", "Preemption",
            "start_loader_worker", "die_with_parent", "end_loader_workers", "set_deterministic", "set_tf32",
            "compile_model", "JPEG_DECODER", "decode_file", "random_resized_crop_flip", "call_spec", "image_size",
            "ImageCrops", "open_writer", "write_epoch"]
SAFETY = ["UserError", "RankError", "one_line", "exit_bad_input", "exit_ctrl_c", "print_or_drop",
          "explain_unreadable_image", "check_launch_args", "check_run", "check_image_folder", "check_resume",
          "explain_failed_save", "explain_short_loader", "PER_NODE", "check_ranks_agree", "check_items", "label_fits",
          "check_finite", "PEER_GONE", "explain_failure", "safety_net", "claim_output_dir"]
APPENDIX = SEAMS + NEEDS + FEATURES + SAFETY
SHARED = INTERFACE + FLOW + APPENDIX
# what each sibling does its own way (its launcher part); every other name it shares with the reference is
# the reference's text
OWN = {
    "multiprocessing_distributed.py": {"parse_args", "find_processes", "start_process_group", "main"},
    "distributed_slurm_main.py": {"parse_args", "find_processes", "start_process_group", "main"},
    "dataparallel.py": {"parse_args", "find_processes", "start_process_group", "describe_processes", "prepare_model",
                        "wrap_model", "gather_rng_states", "set_rng_state", "sync_batchnorm", "main"},
    "horovod_distributed.py": {"parse_args", "find_processes", "start_process_group",
                               "end_process_group", "describe_processes", "prepare_model", "build_optimizer",
                               "wrap_model", "train_step", "reduce_tensor", "gather_objects", "sync_buffers",
                               "sum_async", "sync_batchnorm", "main"},
    "fsdp_distributed.py": {"parse_args", "check_launch_args", "start_process_group", "prepare_model",
                            "setup_precision", "wrap_model", "train_step", "RunState", "evaluate", "CHECKPOINT",
                            "read_checkpoint"},
    "apex_distributed.py": {"parse_args", "setup_precision"},
    # another task than ImageNet: it shares the launcher part and the task-independent appendix helpers
    "unet3d_apex.py": {"parse_args", "describe_processes", "prepare_model",
                       "build_optimizer", "setup_precision", "train_step", "main_worker", "RunState", "train_one_epoch",
                       "check_finite", "evaluate", "build_datasets", "build_loaders", "check_run"},
}
# shared names a sibling has no use for: no process group of torch.distributed's; unet3d_apex.py: not ImageNet
NOT_CARRIED = {"dataparallel.py": {"join_process_group"},
               "horovod_distributed.py": {"join_process_group"},
               "unet3d_apex.py": {"build_model", "class_count", "NORMALIZE", "load_image", "collate",
                                  "SyntheticImages", "DeviceBatches", "accuracy", "Metrics", "lr_factor",
                                  "average_model", "load_pretrained", "foreign_weights", "param_groups",
                                  "warmup_or_cosine", "set_tf32", "compile_model", "start_profiler", "benchmark",
                                  "memory_use", "JPEG_DECODER", "decode_file", "random_resized_crop_flip", "call_spec",
                                  "image_size", "ImageCrops", "explain_unreadable_image", "check_image_folder",
                                  "check_resume", "check_items", "label_fits"}}


def units(source):
    """The file in pieces: (header, [(key, leading, text)], tail). header: the docstring and imports; each unit a
    top-level function, class, assignment or try block (key: its name, or the first a try assigns; ("=", name) for a
    name assigned again, such as main_worker wrapped by the safety net), its text from its first decorator on, and
    `leading` the comments and blank lines before it; tail: the `if __name__` block."""
    lines = source.splitlines(keepends=True)
    offset = [0]
    for line in lines:
        offset.append(offset[-1] + len(line))
    body = ast.parse(source).body
    first = next(i for i, node in enumerate(body) if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.Assign)))
    last = len(body) - 1  # if __name__ == "__main__":
    header_end = offset[body[first - 1].end_lineno]
    found, seen, position = [], set(), header_end
    for node in body[first:last]:
        start = offset[min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])]) - 1]
        end = offset[node.end_lineno]
        # a name, or the class whose attribute is set again (RunState.load_state_dict wrapped by the safety net)
        names = [ast.unparse(t).split(".")[0] for t in getattr(node, "targets", [])] + [getattr(node, "name", None)]
        names += [n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)]  # a try
        name = next(filter(None, names))
        key = ("=", name) if name in seen else name
        seen.add(name)
        found.append((key, source[position:start], source[start:end]))
        position = end
    return source[:header_end], found, source[position:]


def definitions(source):
    """name -> (start offset, end offset) of each top-level function (from its first decorator), class and
    assignment; a name assigned again keeps its first definition."""
    header, found, _ = units(source)
    spans, position = {}, len(header)
    for key, leading, text in found:
        start = position + len(leading)
        position = start + len(text)
        if isinstance(key, str):
            spans[key] = (start, position - 1)  # without the last line's newline
    return spans


def banners(text):
    """The banners in a stretch of comments: a title (up to its first colon or full stop) -> the banner's lines."""
    found, lines = {}, text.splitlines(keepends=True)
    for i, line in enumerate(lines):
        if line.startswith("# ===") and i + 1 < len(lines) and not lines[i + 1].startswith("# ==="):
            end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("# ===")), None)
            if end is not None and (i == 0 or not lines[i - 1].startswith("# ")):
                title = lines[i + 1][2:].replace(".", ":").split(":")[0]
                found[title] = "".join(lines[i:end + 1])
    return found


def layout(script):
    """The sibling rebuilt in the reference's layout: the reference's text, banners and regions, with the sibling's
    docstring, imports and own definitions (OWN) in place of the reference's, the shared names it does not carry
    left out, and the definitions only it has after the one they follow in it now."""
    _, ref_units, tail = units((ROOT / REFERENCE).read_text())
    header, mine, _ = units((ROOT / script).read_text())
    own, skip = OWN.get(script, set()), NOT_CARRIED.get(script, set())
    theirs = {key: text for key, _, text in mine}
    ref_keys = {key for key, _, _ in ref_units}
    their_banners = {}
    for _, leading, _ in mine:
        their_banners.update(banners(leading))
    # a block only the sibling has: its region's lines go with its definitions, after the reference's block they follow
    ref_regions = set(re.findall(r"^# region \[([a-z0-9-]+)\]", "".join(u[1] for u in ref_units), re.M))
    markers = re.compile(r"^# (end)?region \[([a-z0-9-]+)\]")
    after, anchor, last = {}, None, None
    for key, leading, text in mine:
        closing = [line for line in leading.splitlines(keepends=True)
                   if (m := markers.match(line)) and m[1] and m[2] not in ref_regions]
        if closing and last:
            last[-1] += "".join(closing)
        if key in ref_keys:
            anchor, last = key, None
        else:  # only the sibling has it: its comments, without banners, the old layout's section lines, and the
            for banner in banners(leading).values():  # reference's region lines (the reference's leading has them)
                leading = leading.replace(banner, "")
            kept = "".join(line for line in leading.splitlines(keepends=True)
                           if not line.startswith(("# ===", "# --- ")) and line not in closing
                           and not ((m := markers.match(line)) and m[2] in ref_regions))
            last = after.setdefault(anchor, [])
            last.append(kept + text)
    out, deferred = [header], []
    out += after.get(None, [])
    for key, leading, text in ref_units:
        name = key if isinstance(key, str) else key[1]
        for title, banner in banners(leading).items():
            leading = leading.replace(banner, their_banners.get(title, banner))
        carried = name not in skip and (key in theirs or name in SHARED)
        comments = "".join(line for line in leading.splitlines(keepends=True) if line.startswith("#"))
        piece = leading if carried else comments
        if deferred:  # after the regions that close here
            ends = re.match(r"(\n|# endregion \[[^\n]*\n)*", piece)[0]
            piece = ends + "".join(deferred) + piece[len(ends):]
            deferred = []
        out.append(piece)
        if carried:
            out.append(theirs[key] if name in own and key in theirs else text)
        for extra in after.get(key, []):
            opened = markers.match(extra.lstrip("\n"))
            if opened and opened[2] not in ref_regions:
                deferred.append(extra.lstrip("\n"))
            else:  # an assignment right after the one it follows (a wrapper of the safety net's) stays there
                out.append(extra if re.match(r"[A-Za-z_][\w.]* = ", extra) else "\n\n" + extra)
    text = "".join(out) + tail
    while True:  # regions left empty: the sibling carries none of their definitions
        emptied = re.sub(r"^# region \[([a-z0-9-]+)\][^\n]*\n(#[^\n]*\n)*# endregion \[\1\]\n", "", text, flags=re.M)
        if emptied == text:
            break
        text = emptied
    text = re.sub(r"\n{4,}", "\n\n\n", text)
    text = re.sub(r"(^#[^\n]*\n)\n+(?=(def |class |@|[A-Za-z_]+ = ))", r"\1", text, flags=re.M)
    while True:  # drop what only the sibling has and nothing calls: a unit the reference dropped
        dead = next((leading + unit for key, leading, unit in units(text)[1] if isinstance(key, str)
                     and key not in ref_keys and len(re.findall(rf"\b{key}\b", text)) == 1), None)
        if dead is None:
            return text
        text = re.sub(r"\n{4,}", "\n\n\n", text.replace(dead, "\n", 1))


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
    for name, text, mine in differences(script):
        if mine is None and name not in OWN.get(script, set()):
            continue  # the layout adds it
        if text is None:
            raise SystemExit(f"{script}: {name} is the reference's text: take it out of OWN in {__file__}")
    (ROOT / script).write_text(layout(script))


if __name__ == "__main__":
    drift = {s: [d[0] for d in differences(s)] + ["layout"] * (layout(s) != (ROOT / s).read_text()) for s in siblings()}
    for script, names in drift.items():
        if names:
            print(f"{script}: {', '.join(names)}")
            if "--check" not in sys.argv:
                sync(script)
    sys.exit(1 if "--check" in sys.argv and any(drift.values()) else 0)
