"""The README cannot rot: its CPU demo commands run, its links name what exists (a function in a script, never a
line number; a file; a heading), and its pictures are what docs/make_figures.py draws.

Which commands run (the rule is also in CONTRIBUTING.md): a command in a ```bash block, with its continuation lines
joined, that trains without a dataset (--dummy or --synthetic) and starts with torchrun, python or horovodrun,
optionally after VAR=value settings. It runs as written, with tiny settings appended (later flags win in argparse).
srun/sbatch commands are exercised by tests/test_distributed_slurm_main.py on a real Slurm; commands that need a
dataset or GPUs cannot run here; scripts/*.sh install packages (CI runs scripts/test.sh itself)."""
import re
import shlex
import subprocess
import sys

import pytest

from conftest import BIN, ROOT, Job, ok

sys.path.insert(0, str(ROOT / "scripts"))
import readme_links  # noqa: E402

LAUNCHERS = {"torchrun": str(BIN / "torchrun"), "python": sys.executable, "horovodrun": str(BIN / "horovodrun")}


def readme_commands():
    """Every shell command of the README's ```bash blocks, continuation lines joined, comments dropped."""
    commands = []
    for block in re.findall(r"^```bash\n(.*?)^```", (ROOT / "README.md").read_text(), re.S | re.M):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0].strip()
            if line and not line.startswith("#"):
                commands.append(line)
    return commands


def split_env(words):
    env = {}
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    return env, words


def is_cpu_demo(command):
    words = shlex.split(command)
    _, words = split_env(words)
    return bool(words) and words[0] in LAUNCHERS and ("--dummy" in words or "--synthetic" in words)


DEMOS = [c for c in readme_commands() if is_cpu_demo(c)]


def tiny(words, out):
    """What the rule appends: one epoch on a tiny dataset, no loader processes, a temporary output."""
    extra = ["--epochs", "1", "-j", "0", "--output-dir", str(out)]
    if "--synthetic" in words:
        return [*extra, "--synthetic-size", "8"]
    extra += ["--dummy-size", "64"]
    if "--crop-size" not in words:
        extra += ["--crop-size", "32", "--val-resize", "36"]
    if "-b" not in words and "--batch-size" not in words:
        extra += ["-b", "16"]
    return extra


@pytest.mark.quick
def test_the_readme_has_cpu_demos_for_every_launcher():
    """The selection rule must keep finding the demos, or the test below would silently test nothing."""
    scripts = {next(w for w in shlex.split(c) if w.endswith(".py")) for c in DEMOS}
    assert scripts == {"distributed.py", "multiprocessing_distributed.py", "dataparallel.py", "apex_distributed.py",
                       "horovod_distributed.py", "distributed_slurm_main.py", "unet3d_apex.py",
                       "fsdp_distributed.py"}, DEMOS
    assert {split_env(shlex.split(c))[1][0] for c in DEMOS} == set(LAUNCHERS)


@pytest.mark.parametrize("command", DEMOS)
def test_readme_cpu_demo_runs(command, tmp_path):
    env, words = split_env(shlex.split(command))
    words = [LAUNCHERS[words[0]], *words[1:]]
    if "horovodrun" in words[0]:  # horovodrun ... python SCRIPT: the same interpreter as the tests
        words = [sys.executable if w == "python" else w for w in words]
    job = ok(Job([*words, *tiny(words, tmp_path)], env=env), timeout=240)
    sharded = any(w.endswith("fsdp_distributed.py") for w in words)  # its checkpoint: a folder of shards
    assert (tmp_path / ("checkpoint.dcp" if sharded else "checkpoint.pth.tar")).exists(), job.output


@pytest.mark.quick
def test_readme_links_name_what_exists():
    """README.md, CONTRIBUTING.md and docs/results/*.md: no link into a script by line number (an edit moves it); a
    function a link or a sentence names in a script (`save_checkpoint` in distributed.py) is defined there; every
    linked file and heading exists."""
    bad = readme_links.bad_links()
    assert not bad, "\n".join(bad)


@pytest.mark.quick
def test_the_readme_stays_a_guide():
    """At most 900 lines for the people who copy a script: run records go to docs/results/, contributors' notes to
    CONTRIBUTING.md."""
    assert len((ROOT / "README.md").read_text().splitlines()) <= 900


@pytest.mark.quick
def test_readme_pictures_are_up_to_date():
    result = subprocess.run([sys.executable, ROOT / "docs" / "make_figures.py", "--check"], capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stderr
    for name in re.findall(r"\]\((docs/[\w.]+\.svg)\)", (ROOT / "README.md").read_text()):
        assert (ROOT / name).exists(), name
