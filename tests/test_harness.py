"""The harness's own promises: a process that outlives its job is found, even one that left the
job's session (as torchrun's workers do), so the no-leftover checks elsewhere can fail; and a job gets
SIGINT as a terminal leaves it, however the suite was started."""
import signal
import sys
import time

import pytest

from conftest import Job

ESCAPE = "import subprocess; subprocess.Popen(['sleep', '60'], start_new_session=True)"


def test_an_orphan_in_its_own_session_is_reported_and_killed():
    job = Job([sys.executable, "-c", ESCAPE])
    job.proc.wait(timeout=30)
    assert [p.name() for p in job.processes()] == ["sleep"]
    with pytest.raises(AssertionError, match="processes left behind"):
        job.assert_no_leftovers(grace=1)
    assert not job.processes()


def test_a_job_takes_sigint_as_a_terminal_leaves_it_even_when_the_suite_ignores_it():
    """`bash -c 'bash scripts/test.sh &'` starts pytest with SIGINT ignored, which children inherit: a test of
    Ctrl-C then watched the job train on. Python installs its KeyboardInterrupt handler only where SIGINT is not
    ignored at start-up."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        job = Job([sys.executable, "-c", "import signal; print(signal.getsignal(signal.SIGINT).__name__)"])
    finally:
        signal.signal(signal.SIGINT, previous)
    assert job.finish(30).output.strip() == "default_int_handler"


def test_a_job_that_times_out_fails_with_where_each_of_its_processes_is():
    """CI's log is all there is of a hung job: its output, and each Python process's stack (py-spy)."""
    job = Job([sys.executable, "-c", "import time\ndef waiting_here():\n    time.sleep(60)\nprint('up', flush=True)\n"
               "waiting_here()"])
    with pytest.raises(pytest.fail.Exception, match=r"(?s)timed out after 3s.*up.*waiting_here") as failure:
        job.finish(timeout=3)
    assert "py-spy on" not in str(failure.value)
    assert not job.processes()


def test_waiting_for_a_line_from_a_job_that_prints_nothing_times_out_with_its_stacks():
    """A job hung before its first line (a rank stuck at start-up) used to block the test on its silent output
    for good: pytest's own backstop then ended the whole suite's run of that test, without the stacks."""
    job = Job([sys.executable, "-c", "import time\ndef silent_here():\n    time.sleep(60)\nsilent_here()"])
    started = time.monotonic()
    with pytest.raises(pytest.fail.Exception, match=r"(?s)never saw 'Epoch' .*within 3s.*silent_here"):
        job.wait_for_line("Epoch", timeout=3)
    assert time.monotonic() - started < 40 and not job.processes()
