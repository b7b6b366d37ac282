"""Two nodes under torchrun, emulated on one machine: two agents (--nnodes=2, --node-rank 0 and 1) that
meet at one --rdzv-endpoint. Each node is given its own folders where a test needs it, as two hosts may
see different files: a problem only one node has is reported by that node, ranks that find different
checkpoints stop with one line on each node, and two nodes train exactly as two processes on one."""
import re
import shutil

import pytest

from conftest import EPOCHS, FAST, RESUME, ROOT, assert_same_run, error_lines, ok, two_nodes


def test_two_nodes_train_exactly_as_two_processes_on_one(image_data, tmp_path, uninterrupted):
    jobs = two_nodes("distributed.py", image_data, *RESUME, "--epochs", EPOCHS, "--output-dir", tmp_path)
    for job in jobs:
        ok(job, timeout=400)
    assert "world size 2" in jobs[0].output
    assert_same_run(tmp_path, uninterrupted)


@pytest.mark.parametrize("script", ["distributed.py", "apex_distributed.py"])
def test_a_problem_only_one_node_has_is_reported_by_that_node(script, image_data, tmp_path):
    """Node 1 lacks the data folder node 0 has (a mount missing on one host). apex_distributed.py used to
    report bad input from global rank 0 only: the job failed without a word about why. Node 0 waits for
    the missing rank until --dist-timeout, then says so in a line of its own."""
    (tmp_path / "data0").symlink_to(image_data)
    jobs = two_nodes(script, *FAST, "--epochs", "1", "--dist-timeout", "15", "--output-dir", tmp_path / "out",
                     node_args=lambda node: [tmp_path / f"data{node}"])
    for job in jobs:
        job.finish(120)
        assert job.returncode != 0, job.output
    assert [re.search(r"data folder '.*data1' not found: give a folder with train/ and val/", line) is not None
            for line in error_lines(jobs[1].output)] == [True], jobs[1].output
    assert [re.search(r"not every rank joined the process group within --dist-timeout 15s: a rank elsewhere may have "
                      r"stopped \(see the output of every node\)", line) is not None
            for line in error_lines(jobs[0].output)] == [True], jobs[0].output
    assert f'File "{ROOT / script}"' not in jobs[0].output + jobs[1].output  # torchrun's own report is fine


def test_ranks_that_find_different_checkpoints_stop_with_one_line_per_node(image_data, tmp_path, uninterrupted):
    """--resume auto with an output folder that is not shared: node 0 finds a checkpoint, node 1 none. Each
    would train from its own step, and the job would hang at the first all-reduce that one rank skips."""
    (tmp_path / "out0").mkdir()
    shutil.copy(uninterrupted / "checkpoint.pth.tar", tmp_path / "out0")
    jobs = two_nodes("distributed.py", image_data, *FAST, "--epochs", EPOCHS + 1, "--resume", "auto",
                     node_args=lambda node: ["--output-dir", tmp_path / f"out{node}"])
    for job in jobs:
        job.finish(120)
        assert job.returncode != 0, job.output
        assert error_lines(job.output) == [
            f"error: the ranks found different checkpoints to resume from (rank 0: epoch {EPOCHS} step 0; rank 1: "
            f"none): --output-dir and --resume must be on a filesystem that every node shares and sees up to date"
        ], job.output
    assert not (tmp_path / "out1" / "checkpoint.pth.tar").exists()
