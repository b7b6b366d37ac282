"""What the scripts share with distributed.py (the training flow, the appendix, the parts of the launcher
interface a sibling takes over) must stay byte-identical to it: a fix to one is a fix to all
(scripts/sync_helpers.py copies them). Each script stands alone, so the copies are on purpose; drift is
the bug. And every script reads in the same order, the lesson first."""
import ast
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
from sync_helpers import REFERENCE, SHARED, definitions, differences, layout, siblings  # noqa: E402

pytestmark = pytest.mark.quick


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


def test_what_siblings_share_and_the_reference_lacks_is_one_text_too():
    """select_gpus (spawn and DataParallel): no sync copies it, so this keeps it alike."""
    reference, texts = definitions((ROOT / REFERENCE).read_text()), {}
    for script in siblings():
        source = (ROOT / script).read_text()
        for name, (start, end) in definitions(source).items():
            if name not in reference:
                texts.setdefault(name, {})[script] = source[start:end]
    apart = {name: sorted(by) for name, by in texts.items() if len(set(by.values())) > 1}
    assert not apart, f"{apart}: give each name one text in every script that defines it"


@pytest.mark.parametrize("script", siblings())
def test_every_sibling_is_laid_out_as_the_reference(script):
    """The reference's order, banners and regions, the sibling's own definitions in the reference's places, so that
    `diff distributed.py <sibling>` shows the sibling's own code, not shared code moved about."""
    assert layout(script) == (ROOT / script).read_text(), f"run python scripts/sync_helpers.py to lay {script} out"


SCRIPTS = [REFERENCE, *siblings()]
# the banners of the three parts, and of part 1's launcher part (which main, and main_worker after it, follow)
FENCES = ("# Part 1, the lesson", "# The launcher part", "# Part 2, features", "# Part 3, the safety net")


def first_line(lines, prefix):
    return next((i for i, line in enumerate(lines, 1) if line.startswith(prefix)), None)


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_lesson_comes_first(script):
    """Part 1 (the command line, the two seams, the launcher part, the training flow with main_worker in it, what
    every run needs), then the features, then the safety net."""
    lines = (ROOT / script).read_text().splitlines()
    starts = [first_line(lines, fence) for fence in FENCES]
    assert None not in starts and starts == sorted(starts), dict(zip(FENCES, starts))
    main_worker = first_line(lines, "def main_worker(")
    assert starts[0] < first_line(lines, "def parse_args(") < starts[1] < main_worker < starts[2]
    if script == REFERENCE:  # a newcomer meets the two seams and the launcher part early, and the flow by line 400
        assert first_line(lines, "def build_model(") < 150 and starts[1] <= 220 and main_worker <= 400, starts


@pytest.mark.parametrize("script", SCRIPTS)
def test_no_function_takes_more_than_six_parameters(script):
    tree = ast.parse((ROOT / script).read_text())
    crowded = [f"{node.name} ({len(names)})" for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)
               for names in [[a.arg for a in node.args.posonlyargs + node.args.args + node.args.kwonlyargs
                              if a.arg != "self"]] if len(names) > 6]
    assert not crowded


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_top_level_name_is_used(script):
    """A unit the reference dropped stays behind in a sibling (the sync copies what both define): dead code there."""
    text = (ROOT / script).read_text()
    tree = ast.parse(text)
    used = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)}
    used |= {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    defined = [node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))]
    defined += [target.id for node in tree.body if isinstance(node, ast.Assign) for target in node.targets
                if isinstance(target, ast.Name)]
    assert not set(defined) - used - {"main"}, set(defined) - used
