"""Every value of every flag of every script is checked against its range in one place, right after parsing:
a value out of range is one `error:` line naming the flag, the value and the range, exit code 2 (the launch
itself is tested in test_bad_input.py). A new numeric flag without a range fails here."""
import argparse
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
    """The options of the script's parser that take a value, caught as parse_args hands them to argparse."""
    found, real = [], argparse.ArgumentParser.parse_args

    def capture(parser, *args, **kwargs):
        found.extend(a for a in parser._actions if a.option_strings and a.nargs != 0)
        return real(parser, *args, **kwargs)

    with mock.patch.object(argparse.ArgumentParser, "parse_args", capture):
        module.parse_args(base_args(module))
    return found


def outside(bounds):
    """Values just outside a number's range, and values that are no number of its kind."""
    kind, at_least, above, below = bounds
    values = ["x", "1.5"] if kind is int else ["x", "nan", "inf"]
    step = 1 if kind is int else 1e-3
    values += [str(at_least - step)] if at_least is not None else []
    values += [str(above)] if above is not None else []
    values += [str(below)] if below is not None else []
    return values


def test_every_option_that_takes_a_value_has_a_range_or_choices(script):
    options = value_options(script)
    assert len(options) > 15
    unchecked = [o.option_strings[-1] for o in options
                 if not (o.choices or hasattr(o.type, "bounds") or o.dest in FREE_TEXT or type(o).__name__ == "Refuse")]
    assert not unchecked, f"give these a range (in_range(...)) or choices: {unchecked}"


def test_every_value_outside_its_range_is_one_clear_error(script):
    numeric = [o for o in value_options(script) if hasattr(o.type, "bounds")]
    assert len(numeric) > 10
    for option in numeric:
        for bad in outside(option.type.bounds):
            count = option.nargs if isinstance(option.nargs, int) else 1
            with pytest.raises(script.UserError) as error:
                script.parse_args([*base_args(script), option.option_strings[-1], *[bad] * count])
            message = str(error.value)
            assert message.startswith(f"argument {'/'.join(option.option_strings)}: {bad}"), message
            assert message.endswith("(see --help)") and "give " in message, message
        defaults = option.default if isinstance(option.default, (list, tuple)) else [option.default]
        assert all(option.type(str(v)) == v for v in defaults if v is not None)  # the defaults are in range


def test_flags_that_contradict_each_other(script):
    with pytest.raises(script.UserError, match=r"--epochs 0 trains nothing: give at least 1, or -e"):
        script.parse_args([*base_args(script), "--epochs", "0"])
    assert script.parse_args([*base_args(script), "--epochs", "0", "-e"]).epochs == 0
    if "val_resize" in vars(script.parse_args(base_args(script))):
        with pytest.raises(script.UserError, match=r"--val-resize 30 is smaller than --crop-size 32"):
            script.parse_args([*base_args(script), "--crop-size", "32", "--val-resize", "30"])
        assert script.parse_args([*base_args(script), "--crop-size", "518"]).val_resize == 592  # 8/7 of it


def test_argparse_errors_are_user_errors(script):
    """argparse's own errors (an unknown flag, a missing value) would print its usage from every rank."""
    with pytest.raises(script.UserError, match=r"unrecognized arguments: --no-such-flag \(see --help\)"):
        script.parse_args([*base_args(script), "--no-such-flag"])


# script, its flags, its whole stderr: a number out of range, and the flags that a launcher checks its own way
REFUSED = [
    ("distributed.py", ["--lr", "-1"], "argument --lr: -1 is out of range: give a number >= 0 (see --help)"),
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


def test_a_torch_older_than_the_tests_pass_on_is_one_line(script, monkeypatch):
    """requirements.txt's lower bound, checked first. On torch 2.4.1 three scripts failed mid-run (apex's O2, the
    end of the spawn script, FSDP2's imports); on 2.7.1 and 2.8.0 FSDP2 over gloo ended with other weights than
    DDP's. NVIDIA's containers number their torch 2.9.0a0+...: a 2.9 all the same."""
    monkeypatch.setattr(script.torch, "__version__", "2.8.0+cu128")
    with pytest.raises(script.UserError, match=r"^torch 2\.8\.0\+cu128 is older than this script needs \(2\.9\): "
                                               r"install torch 2\.9 or newer"):
        script.parse_args(base_args(script))
    monkeypatch.setattr(script.torch, "__version__", "2.9.0a0+50eac811a6.nv25.09")
    assert script.parse_args(base_args(script))


def run_after(setup, script_name, *args, cwd):
    """`python SCRIPT ARGS`, with the Python `setup` run first in the same process (to take a package away)."""
    run = (f"import runpy, sys, torch; {setup}; sys.argv[:] = sys.argv[1:]; "
           f"runpy.run_path(sys.argv[0], run_name='__main__')")
    return subprocess.run([sys.executable, "-c", run, ROOT / script_name, *args], capture_output=True, text=True,
                          cwd=cwd)


# torchvision made for another torch fails as it registers its operators' fake kernels: here its import does that
MISMATCHED_TORCHVISION = ("sys.meta_path.insert(0, type('Mismatch', (), {'find_spec': staticmethod(lambda name, *rest: "
                          "torch.library.register_fake('torchvision::nms')(len) if name == 'torchvision' else None)}))")


@pytest.mark.parametrize("script_name, setup, said", [
    ("distributed.py", "torch.__version__ = '2.4.1+cu121'", "torch 2.4.1+cu121 is older than this script needs (2.9)"),
    ("horovod_distributed.py", "sys.modules['horovod'] = None", "cannot import horovod.torch (No module named "),
    ("fsdp_distributed.py", "sys.modules['torchvision'] = None", "cannot import torchvision (import of torchvision "
     "halted; None in sys.modules): install torch and the torchvision made for it (pip install -U torch torchvision)"),
    ("distributed.py", MISMATCHED_TORCHVISION, "cannot import torchvision (operator torchvision::nms does not exist): "
     "install torch and the torchvision made for it"),
])
def test_an_old_torch_or_no_horovod_from_the_command_line(script_name, setup, said, tmp_path):
    """The whole way, for what the environment lacks: a torch too old, Horovod or torchvision not installed (None in
    sys.modules: its import fails as if it were missing), a torchvision made for another torch. One line, exit code
    2, before any work."""
    done = run_after(setup, script_name, "--dummy", cwd=tmp_path)
    assert done.returncode == 2 and done.stdout == "", done
    assert done.stderr.startswith(f"error: {said}") and done.stderr.count("\n") == 1, done


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


def test_flags_of_other_scripts_are_taken_or_name_what_to_do_here(script):
    """Commands users already know: torch.distributed.launch passes --local-rank=N (LOCAL_RANK says the same);
    pytorch/examples' users type --multiprocessing-distributed --world-size 1 --rank 0, --gpu 0, --start-epoch N.
    A script takes those that map onto its own flags; any other is one line saying what to do instead."""
    taken = TAKEN.get(script.__file__.rsplit("/", 1)[-1], set())
    flags = [flag for names in script.FOREIGN_FLAGS for flag in names]
    assert {"--local-rank", "--start-epoch", "--multiprocessing-distributed", "--gpu"} <= set(flags)
    for flag in flags:
        given = [flag] if flag == "--multiprocessing-distributed" else [f"{flag}=1"]
        if flag in taken:
            script.parse_args([*base_args(script), *given])
        else:
            with pytest.raises(script.UserError, match=rf"^{flag} is not a flag of this script: \S"):
                script.parse_args([*base_args(script), *given])
    assert script.parse_args(base_args(script))  # the hidden flags change nothing else

