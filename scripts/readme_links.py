"""Keeps the README's links true, and its table of line counts.

Links into a script name a function, never a line number, so that an edit cannot move them:
[`save_checkpoint`](distributed.py), or [`wrap_model` in dataparallel.py](dataparallel.py). The name in backticks
must be defined in the linked script: a top-level function, class or constant, or a method (`RunState.save`, or
`save` alone). A sentence that names a function in a script, "`wrap_model` in dataparallel.py", is held to the
same rule. Every relative link must lead to a file or folder that exists, and a link to a heading of the same page
(#the-heading) to a heading that exists. Checked in README.md, CONTRIBUTING.md and docs/results/*.md.

    python scripts/readme_links.py          # rewrites the README's table of line counts, then lists bad links
    python scripts/readme_links.py --check  # only lists bad links and a stale table; exit 1 if there is any

The table "| `script.py` | lines | the core |" gets each script's line count, whole and cut to its core (every block
deleted by its markers, README: Copy only what you need).
"""
import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = ["README.md", "CONTRIBUTING.md", "docs/results/*.md"]
LINK = re.compile(r"\[((?:[^\[\]]|\[[^\]]*\])*)\]\(([^)\s]+)\)")  # [text](target)
NAMED = re.compile(r"^`([A-Za-z_][\w.]*)(?:\(\))?`")  # a link text that starts with a name in backticks
IN_SCRIPT = re.compile(r"`([A-Za-z_][\w.]*)(?:\(\))?`(?:\]\([^)]*\))? in `?(\w+\.py)\b")  # "`name` in script.py"
LINE_LINK = re.compile(r"\.py#L\d+")
COUNTS = re.compile(r"^\| `(\w+\.py)` \| \d+ \| \d+ \|$", re.M)
BLOCK = re.compile(r"^ *# region \[.*?^ *# endregion \[[^\n]*\n", re.M | re.S)


def line_counts(script):
    """The script's lines, whole and as the core: its blocks' regions and tagged lines deleted."""
    text = (ROOT / script).read_text()
    core = [line for line in BLOCK.sub("", text).splitlines() if not re.search(r"#( \[[a-z0-9-]+\])+$", line)]
    return f"| `{script}` | {len(text.splitlines())} | {len(core)} |"


def definitions(script):
    """What a script defines: its top-level functions, classes and constants, and its classes' methods, both as
    `Class.method` and as `method`."""
    names = set()
    for node in ast.parse(script.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.update({item.name, f"{node.name}.{item.name}"})
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names


def slug(heading):
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(text):
    found = set()
    for heading in re.findall(r"^#+ (.*)$", re.sub(r"^```.*?^```", "", text, flags=re.M | re.S), re.M):
        name, n = slug(heading), 1
        while name in found:  # GitHub numbers repeated headings
            name, n = f"{slug(heading)}-{n}", n + 1
        found.add(name)
    return found


def problems(page):
    """What is wrong with the links of one page: line-number links, names a script does not define, paths that do
    not exist, anchors without their heading."""
    text, found, cache = page.read_text(), [], {}

    def defined(name, path):
        path = path.resolve()
        if path not in cache:
            cache[path] = definitions(path) if path.is_file() else None
        return cache[path] is None or name in cache[path]

    where = page.relative_to(ROOT)
    found += [f"{where}: a line-number link {m[0]!r}: name a function instead" for m in LINE_LINK.finditer(text)]
    for m in LINK.finditer(text):
        label, target = m[1], m[2]
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        if not path:
            if anchor not in anchors(text):
                found.append(f"{where}: no heading for #{anchor}")
            continue
        if not (page.parent / path).exists():
            found.append(f"{where}: {path} does not exist")
            continue
        named, script = NAMED.match(label), page.parent / path
        if path.endswith(".py") and named and not named[1].endswith(".py") and not defined(named[1], script):
            found.append(f"{where}: [{label}]({target}): {path} defines no {named[1]}")
    for name, script in IN_SCRIPT.findall(text):
        if (ROOT / script).is_file() and not defined(name, ROOT / script):
            found.append(f"{where}: `{name}` in {script}: {script} defines no {name}")
    return found


def bad_links():
    return [problem for pattern in PAGES for page in sorted(ROOT.glob(pattern)) for problem in problems(page)]


def main(argv):
    readme = ROOT / "README.md"
    text = readme.read_text()
    counted = COUNTS.sub(lambda m: line_counts(m[1]), text)
    bad = bad_links()
    if "--check" in argv:
        if counted != text:
            bad.append("README.md: the table of line counts is stale (python scripts/readme_links.py)")
    elif counted != text:
        readme.write_text(counted)
        print("README.md: the table of line counts updated")
    print("\n".join(bad) or "every link names what exists")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
