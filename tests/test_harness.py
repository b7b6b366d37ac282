"""The harness's own promise: a process that outlives its job is found, even one that left the
job's session (as torchrun's workers do), so the no-leftover checks elsewhere can fail."""
import sys

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
