"""The helpers every ImageNet script carries must stay byte-identical to distributed.py's: a fix to
one is a fix to all (scripts/sync_helpers.py copies them). Each script stands alone, so the copies
are on purpose; drift is the bug."""
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
from sync_helpers import REFERENCE, SHARED, definitions, differences, siblings  # noqa: E402


def test_the_reference_defines_every_shared_helper():
    missing = set(SHARED) - set(definitions((ROOT / REFERENCE).read_text()))
    assert not missing, f"{REFERENCE} lacks {missing}: update SHARED in scripts/sync_helpers.py if a helper was renamed"


def test_every_sibling_is_compared():
    assert set(siblings()) >= {"multiprocessing_distributed.py", "dataparallel.py", "horovod_distributed.py",
                               "apex_distributed.py", "unet3d_apex.py"}


@pytest.mark.parametrize("script", siblings())
def test_shared_helpers_are_identical_to_the_reference(script):
    drift = [(name, "missing" if mine is None else "differs") for name, _, mine in differences(script)]
    assert not drift, f"{script}: {drift}; run python scripts/sync_helpers.py to copy {REFERENCE}'s across"
