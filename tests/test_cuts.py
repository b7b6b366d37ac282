"""The copier's cut (README: Copy only what you need): the README's own sed commands delete a block of part 2 or
3 with its region and its tagged lines, or every block at once (the core), and what is left runs. For
distributed.py and multiprocessing_distributed.py, each under its own launcher with 2 processes and loader
workers: every cut passes ruff (no undefined names) and trains; the core also evaluates exactly and resumes with
--resume auto to the weights of an uninterrupted run."""
import ast
import re
import shutil
import subprocess
import sys

import pytest

from conftest import FAST, ROOT, assert_same_tensors, load, ok, spawn, torchrun

LAUNCHERS = {"distributed.py": torchrun, "multiprocessing_distributed.py": spawn}
BLOCKS = ["benchmark", "clip-grad-norm", "compile", "deterministic", "ema", "fast-crop", "fast-decode",
          "foreign-weights", "logs", "lr-schedule", "no-wd", "preemption", "pretrained", "profile", "safety", "spec",
          "sync-bn", "tf32"]
# 2 processes, loader workers (on the CPU, reruns are bit-identical without --deterministic, a block of its own)
TRAIN = [*FAST, "-j", "2"]


def sed_lines():
    """The README's two commands: one block (X), every block."""
    lines = [line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith("sed -E -i ")]
    assert len(lines) == 2 and r"\[X\]" in lines[0] and "X" not in lines[1], lines
    return lines


def cut(script, folder, block=None):
    """A copy of `script` in `folder`, cut by the README's command: without `block`, or the core."""
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(ROOT / script, folder / script)
    one, every = sed_lines()
    command = (one.replace(r"\[X\]", rf"\[{block}\]") if block else every).replace("distributed.py", script)
    subprocess.run(["bash", "-c", command.removesuffix(script) + script], cwd=folder, check=True)
    return folder / script


def launch(script, path, *args):
    return LAUNCHERS[script](path, 2, *args)


@pytest.mark.quick
def test_every_block_is_fenced_and_every_tag_names_one():
    """A tag that names no block (a typo) would survive every cut; a region without its end would take the rest of
    the file with it."""
    for script in ["distributed.py", *(p.name for p in ROOT.glob("*.py") if p.name != "distributed.py")]:
        text = (ROOT / script).read_text()
        opened = re.findall(r"^ *# region \[([a-z0-9-]+)\]", text, re.M)
        closed = re.findall(r"^ *# endregion \[([a-z0-9-]+)\]", text, re.M)
        assert opened == closed and len(set(opened)) == len(opened), (script, opened, closed)
        tagged = re.findall(r"#((?: \[[a-z0-9-]+\])+)$", text, re.M)
        tags = {tag for line in tagged for tag in re.findall(r"\[(.*?)\]", line)}
        assert tags <= set(opened), (script, tags - set(opened))
        if script in LAUNCHERS:
            assert sorted(opened) == BLOCKS, opened
        # the markers' rule is written once, at the top: the docstring's example is the README's cut of a block it has
        example = re.search(r"^ +(sed -E -i .*) FILE$", ast.get_docstring(ast.parse(text)), re.M)
        block = example and re.search(r"region \\\[([a-z0-9-]+)\\\]", example[1])
        assert block and block[1] in opened, script
        assert example[1] == sed_lines()[0].replace(r"\[X\]", rf"\[{block[1]}\]").removesuffix(" distributed.py")


def unknown_flags(source):
    """args.NAME read where no flag and no assignment makes NAME: a flag of a block that was cut (ruff cannot see
    those); read flags of another block with getattr(args, NAME, default)."""
    made, read = set(), set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "add":
            names = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            dest = next((k.value.value for k in node.keywords if k.arg == "dest"), None)
            made.add(dest or next((n for n in names if n.startswith("--")), names[0]).lstrip("-").replace("-", "_"))
        elif isinstance(node, ast.Attribute) and getattr(node.value, "id", None) == "args":
            (made if isinstance(node.ctx, ast.Store) else read).add(node.attr)
    return sorted(read - made)


@pytest.mark.quick
@pytest.mark.parametrize("script", sorted(p.name for p in ROOT.glob("*.py")))
def test_every_cut_passes_ruff_and_reads_no_flag_it_cut(script, tmp_path):
    """Every script, each block alone and the core."""
    for block in [*re.findall(r"^ *# region \[([a-z0-9-]+)\]", (ROOT / script).read_text(), re.M), None]:
        path = cut(script, tmp_path / (block or "core"), block)
        assert not unknown_flags(path.read_text()), (block, unknown_flags(path.read_text()))
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--config", ROOT / "ruff.toml", "."],
                          cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.quick
def test_the_readme_counts_the_lines_of_every_script_and_its_core(tmp_path):
    table = dict(re.findall(r"^\| `(\w+\.py)` \| (\d+ \| \d+) \|", (ROOT / "README.md").read_text(), re.M))
    scripts = sorted(p.name for p in ROOT.glob("*.py"))
    counted = {s: f"{len((ROOT / s).read_text().splitlines())} | {len(cut(s, tmp_path).read_text().splitlines())}"
               for s in scripts}
    assert table == counted


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("script", LAUNCHERS)
def test_each_cut_trains(script, block, image_data, tmp_path):
    path = cut(script, tmp_path / "cut", block)
    ok(launch(script, path, image_data, *TRAIN, "-a", "squeezenet1_1", "--dropout", "0", "--epochs", "1",
              "--output-dir", tmp_path / "out"))
    ckpt = load(tmp_path / "out" / "checkpoint.pth.tar")
    assert (ckpt["epoch"], ckpt["step"], ckpt["world_size"]) == (1, 0, 2)


VAL = re.compile(r"^val: loss \S+ acc1 (\S+) acc5 \S+ \(correct1 \d+, correct5 \d+, images 101\)$", re.M)


@pytest.mark.parametrize("script", [pytest.param("distributed.py", marks=pytest.mark.quick),
                                    "multiprocessing_distributed.py"])
def test_the_core_trains_evaluates_exactly_and_resumes(script, image_data, tmp_path):
    """4 epochs at once, and 2 then 2 more after --resume auto: the same weights and optimizer state, bit for bit.
    The data is learnable: validation accuracy well above chance (4 classes: 25%). Evaluating the checkpoint on 1 or
    2 processes gives the same counts (each sample once, no padding), and the accuracy the last epoch logged."""
    core = cut(script, tmp_path / "core")
    assert not re.search(r"^ *# (end)?region \[", core.read_text(), re.M) and "--model-ema" not in core.read_text()
    whole = ok(launch(script, core, image_data, *TRAIN, "--epochs", "4", "--output-dir", tmp_path / "whole"))
    ok(launch(script, core, image_data, *TRAIN, "--epochs", "2", "--output-dir", tmp_path / "resumed"))
    ok(launch(script, core, image_data, *TRAIN, "--epochs", "4", "--resume", "auto", "--output-dir",
              tmp_path / "resumed"))
    a, b = (load(tmp_path / out / "checkpoint.pth.tar") for out in ("whole", "resumed"))
    assert a["epoch"] == b["epoch"] == 4
    assert_same_tensors(a["state_dict"], b["state_dict"])
    assert_same_tensors(a["optimizer"], b["optimizer"])
    logged = [float(acc) for acc in re.findall(r"^Epoch \d: .* \| val loss \S+ acc1 (\S+)", whole.output, re.M)]
    assert len(logged) == 4 and max(logged) >= 70, whole.output
    evaluated = [VAL.search(ok(LAUNCHERS[script](core, processes, image_data, *FAST, "-e", "--resume", "auto",
                                                 "--output-dir", tmp_path / "whole")).output) for processes in (1, 2)]
    assert None not in evaluated and evaluated[0][0] == evaluated[1][0], evaluated
    assert float(evaluated[1][1]) == pytest.approx(logged[-1], abs=0.005)
