"""A finished run must end its process group itself. gloo's worker threads are joined only when the
group is freed; left to interpreter shutdown, a worker still releasing a finished collective's tensors
needs the GIL there and aborts the process ("terminate called without an active exception", exit -6):
a flaky failure after an otherwise good run. So every torchrun script is run under a wrapper that,
once the script's main() is over, fails if any gloo thread is still alive. And a process that an unexpected
error ends must end, loader workers or not."""
import pytest

from conftest import FAST, ok, python, torchrun

WRAPPER = '''
import os, runpy, sys
script = sys.argv.pop(1)
try:
    runpy.run_path(script, run_name="__main__")
finally:
    names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
    gloo = [n for n in names if "gloo" in n]
    if gloo:
        print(f"rank {os.environ['RANK']}: gloo threads outlive main(): {gloo}", flush=True)
        os._exit(3)
'''
IMAGENET = [*FAST, "--dummy", "--dummy-size", "32", "--epochs", "1"]
UNET = ["--synthetic", "--synthetic-size", "4", "--synthetic-shape", "16", "16", "16", "--patch-size", "16", "16", "16",
        "--base-channels", "4", "--depth", "2", "-b", "2", "-j", "0", "--epochs", "1"]


@pytest.mark.parametrize("script, args", [("distributed.py", IMAGENET), ("apex_distributed.py", IMAGENET),
                                          pytest.param("unet3d_apex.py", UNET, marks=pytest.mark.quick)])
def test_no_gloo_thread_outlives_main(script, args, tmp_path):
    wrapper = tmp_path / "wrapper.py"
    wrapper.write_text(WRAPPER)
    ok(torchrun(wrapper, 2, script, *args, "--output-dir", tmp_path / "out"), timeout=180)


BUG_AT_STEP_3 = """
import runpy, sys
module = runpy.run_path(sys.argv.pop(1), run_name="with_a_bug")  # defines the functions, runs nothing
train_step, steps = module["train_step"], []
def failing_step(*args):
    steps.append(1)
    if len(steps) == 3:
        raise ValueError("a bug in the training step")
    return train_step(*args)
module["main_worker"].__globals__["train_step"] = failing_step
module["main"]()
"""


def test_an_uncaught_error_with_loader_workers_ends_the_process(tmp_path):
    """The traceback keeps the loader alive until exit, where multiprocessing stops its workers with SIGTERM and
    waits for them; they ignore SIGTERM (preemption is the training process's business). It hung for good."""
    wrapper = tmp_path / "with_a_bug.py"
    wrapper.write_text(BUG_AT_STEP_3)
    job = python(wrapper, "distributed.py", *IMAGENET, "--epochs", "3", "-j", "2", "--output-dir", tmp_path).finish(60)
    assert job.returncode == 1 and job.output.count("Traceback") == 1, job.output
    assert "ValueError: a bug in the training step" in job.output, job.output
