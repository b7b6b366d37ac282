"""Every value of every flag of every script is checked by argparse as it parses: each option that takes a number has
a range (the scripts' `number` type), and a value outside it, or no number of its kind, is argparse's `error:` line
naming the flag, exit code 2. A new numeric flag without a range fails here."""
import argparse
import inspect
import subprocess
import sys
from unittest import mock

import pytest

from conftest import FAST, OUTPUT_FILES, ROOT, import_script, metrics

pytestmark = pytest.mark.quick
SCRIPTS = ["distributed.py", "multiprocessing_distributed.py", "dataparallel.py", "apex_distributed.py",
           "horovod_distributed.py", "distributed_slurm_main.py", "fsdp_distributed.py", "unet3d_apex.py"]
# values checked where they are used, against what they name: a folder, a file, a model, a backend, GPUs, a URL
FREE_TEXT = {"data", "arch", "dataset", "resume", "output_dir", "dist_backend", "dist_url", "gpus", "dist_file",
             "export"}


@pytest.fixture(scope="module", params=SCRIPTS)
def script(request):
    return import_script(request.param)


def base_args(module):
    """A command line that trains without a dataset."""
    return ["--synthetic"] if hasattr(module, "UNet3D") else ["--dummy"]


def value_options(module):
    """The options of the script's parser that take a value (but the hidden ones, other launchers' flags it takes),
    caught as parse_args hands them to argparse."""
    found, real = [], argparse.ArgumentParser.parse_args

    def capture(parser, *args, **kwargs):
        found.extend(a for a in parser._actions if a.option_strings and a.nargs != 0 and a.help != argparse.SUPPRESS)
        return real(parser, *args, **kwargs)

    with mock.patch.object(argparse.ArgumentParser, "parse_args", capture):
        module.parse_args(base_args(module))
    return found


def bounds(option):
    """(kind, low, high) of an option whose type is the scripts' number(kind, low, high); None for another type."""
    if "number.<locals>" not in getattr(option.type, "__qualname__", ""):
        return None
    given = inspect.getclosurevars(option.type).nonlocals
    return given["kind"], given["low"], given["high"]


def outside(kind, low, high):
    """Values just outside a number's range, and values that are no number of its kind."""
    values = ["x", "1.5"] if kind is int else ["x", "nan"]
    values += [str(low - (1 if kind is int else 1e-3))]
    return values + ([] if high is None else [str(high)])


def test_every_option_that_takes_a_value_has_a_range_or_choices(script):
    options = value_options(script)
    assert len(options) > 15
    unchecked = [o.option_strings[-1] for o in options if not (o.choices or bounds(o) or o.dest in FREE_TEXT)]
    assert not unchecked, f"give these a range (type=number(...)) or choices: {unchecked}"


def test_every_value_outside_its_range_is_argparses_error(script, capsys):
    numeric = [o for o in value_options(script) if bounds(o)]
    assert len(numeric) > 10
    for option in numeric:
        for bad in outside(*bounds(option)):
            count = option.nargs if isinstance(option.nargs, int) else 1
            with pytest.raises(SystemExit) as exited:
                script.parse_args([*base_args(script), option.option_strings[-1], *[bad] * count])
            said = capsys.readouterr().err.splitlines()[-1]
            assert exited.value.code == 2 and f"error: argument {'/'.join(option.option_strings)}: " in said, said
            assert bad in said, said
        defaults = option.default if isinstance(option.default, (list, tuple)) else [option.default]
        assert all(option.type(str(v)) == v for v in defaults if v is not None)  # the defaults are in range


def test_a_value_out_of_range_from_the_command_line(tmp_path):
    """The whole way, as a user meets it: the script run, not only parse_args: argparse's usage and its line."""
    done = subprocess.run([sys.executable, ROOT / "distributed.py", "--dummy", "--lr", "-1"], capture_output=True,
                          text=True, cwd=tmp_path)
    assert done.returncode == 2 and done.stdout == "", done
    assert done.stderr.endswith("distributed.py: error: argument --lr: -1 is out of range: give float >= 0\n"), done


# script, its flags, its whole stderr: the flags that a launcher checks its own way
REFUSED = [
    ("multiprocessing_distributed.py", ["--node-rank", "2", "--world-size", "2"],
     "--node-rank 2 with --world-size 2: node ranks go from 0 to 1"),
    ("multiprocessing_distributed.py", ["--gpus", "0,x"], "--gpus 0,x: give comma-separated GPU ids, e.g. 0,2,5"),
    ("dataparallel.py", ["--gpus", "1,1"], "--gpus 1,1 names GPU 1 more than once: list each GPU once"),
    ("fsdp_distributed.py", ["--compile"], "--compile: fsdp_distributed.py does not compile the sharded model "
     "(torch 2.14's inductor fails on FSDP2's hooks across the whole model); drop it, or train with distributed.py"),
    ("fsdp_distributed.py", ["--model-ema"], "--model-ema: fsdp_distributed.py keeps no average of the weights (a "
     "whole copy on every rank is what sharding saves); drop it, or train with distributed.py"),
]


@pytest.mark.parametrize("script_name,flags,said", REFUSED)
def test_one_line_and_exit_code_2_from_the_command_line(script_name, flags, said, tmp_path):
    """The whole way, as a user meets it: the script run, not only parse_args."""
    done = subprocess.run([sys.executable, ROOT / script_name, "--dummy", *flags], capture_output=True, text=True,
                          cwd=tmp_path)
    assert done.returncode == 2 and done.stdout == "", done
    assert done.stderr == f"error: {said}\n"


def run_after(setup, script_name, *args, cwd):
    """`python SCRIPT ARGS`, with the Python `setup` run first in the same process (to take a package away)."""
    run = (f"import runpy, sys, torch; {setup}; sys.argv[:] = sys.argv[1:]; "
           f"runpy.run_path(sys.argv[0], run_name='__main__')")
    return subprocess.run([sys.executable, "-c", run, ROOT / script_name, *args], capture_output=True, text=True,
                          cwd=cwd)


# a tensorboard made for another protobuf fails as it imports, as this does
BROKEN_TENSORBOARD = ("sys.meta_path.insert(0, type('Broken', (), {'find_spec': staticmethod(lambda name, *rest: "
                      "exec('raise TypeError(\"Descriptors cannot be created directly\")') if name == 'tensorboard' "
                      "else None)}))")


@pytest.mark.parametrize("setup,why", [("sys.modules['tensorboard'] = None", "import of tensorboard halted"),
                                       (BROKEN_TENSORBOARD, "Descriptors cannot be created directly")],
                         ids=["missing", "broken"])
def test_without_tensorboard_a_run_writes_metrics_jsonl_alone(setup, why, tmp_path):
    """TensorBoard is optional, as torchcodec is: where its package is missing or does not load, a run says so once
    and logs metrics.jsonl (it stopped at the import, in a traceback)."""
    done = run_after(setup, "distributed.py", "--dummy", "--dummy-size", "64", *FAST, "-j", "1", "--epochs", "1",
                     cwd=tmp_path)
    assert done.returncode == 0, done
    assert f"note: no TensorBoard logs (tensorboard did not load: {why}" in done.stdout, done
    assert sorted(p.name for p in (tmp_path / "output").iterdir()) == [f for f in OUTPUT_FILES if f != "tb"]
    assert [row["epoch"] for row in metrics(tmp_path / "output")] == [0]


# the flags of pytorch/examples' imagenet and torch.distributed.launch that a script takes as its own
TAKEN = {"distributed.py": {"--local-rank", "--local_rank"}, "apex_distributed.py": {"--local-rank", "--local_rank"},
         "unet3d_apex.py": {"--local-rank", "--local_rank"}, "fsdp_distributed.py": {"--local-rank", "--local_rank"},
         "multiprocessing_distributed.py": {"--world-size", "--rank", "--dist-url", "--gpu",
                                            "--multiprocessing-distributed"}}
OTHER_SCRIPTS_FLAGS = ["--local-rank", "--local_rank", "--multiprocessing-distributed", "--world-size", "--rank",
                       "--dist-url", "--gpu", "--start-epoch"]


def test_flags_of_other_scripts_are_taken_or_refused_by_argparse(script, capsys):
    """Commands users already know: torch.distributed.launch passes --local-rank=N (LOCAL_RANK says the same);
    pytorch/examples' users type --multiprocessing-distributed --world-size 1 --rank 0, --gpu 0, --start-epoch N.
    A script takes those that map onto its own flags; argparse refuses any other, never reading it as a flag of the
    script's own that it abbreviates (--gpu as --gpus: allow_abbrev=False)."""
    taken = TAKEN.get(script.__file__.rsplit("/", 1)[-1], set())
    for flag in OTHER_SCRIPTS_FLAGS:
        given = flag if flag == "--multiprocessing-distributed" else f"{flag}=1"
        if flag in taken:
            script.parse_args([*base_args(script), given])
            continue
        with pytest.raises(SystemExit) as exited:
            script.parse_args([*base_args(script), given])
        assert exited.value.code == 2 and f"error: unrecognized arguments: {given}" in capsys.readouterr().err
