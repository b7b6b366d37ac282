"""A finished run must end its process group itself. gloo's worker threads are joined only when the
group is freed; left to interpreter shutdown, a worker still releasing a finished collective's tensors
needs the GIL there and aborts the process ("terminate called without an active exception", exit -6):
a flaky failure after an otherwise good run. So every torchrun script is run under a wrapper that,
once the script's main() is over, fails if any gloo thread is still alive."""
import pytest

from conftest import FAST, ok, torchrun

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
                                          ("unet3d_apex.py", UNET)])
def test_no_gloo_thread_outlives_main(script, args, tmp_path):
    wrapper = tmp_path / "wrapper.py"
    wrapper.write_text(WRAPPER)
    ok(torchrun(wrapper, 2, script, *args, "--output-dir", tmp_path / "out"), timeout=180)
