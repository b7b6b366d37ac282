"""The style CI enforces: ruff (pyflakes' and pycodestyle's errors, ruff.toml), and no line of any Python
file over 120 characters, not even one that ruff lets pass for its `# noqa` or its URL."""
import subprocess
import sys

import pytest

from conftest import ROOT

pytestmark = pytest.mark.quick
LIMIT = 120


def python_files():
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.split()
    return [ROOT / name for name in listed if (ROOT / name).exists()]


def test_ruff_finds_nothing():
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=ROOT, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_no_line_is_longer_than_the_limit():
    files = python_files()
    assert len(files) > 20, files
    long = [f"{path.relative_to(ROOT)}:{number}: {len(line)} characters"
            for path in files for number, line in enumerate(path.read_text().splitlines(), 1) if len(line) > LIMIT]
    assert not long, "\n".join(long)
