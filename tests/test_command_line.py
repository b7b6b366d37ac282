"""Every value of every flag of every script is checked by argparse as it parses: each option that takes a number has
a range (the scripts' `number` type), and a value outside it, or no number of its kind, is argparse's `error:` line
naming the flag, exit code 2. A new numeric flag without a range fails here."""
import argparse
import inspect
import math
import subprocess
import sys
from unittest import mock

import pytest

from conftest import ROOT, import_script

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
    return values + ([] if high in (None, math.inf) else [str(high)])


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
    assert done.stderr.splitlines()[-1].startswith("distributed.py: error: argument --lr: -1 is out of range: give "
                                                   "float >= 0"), done


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
