"""Keeps the README's links into the scripts pointing at the right lines, and its table of line counts true.

A link [`name`](script.py#L123) or [`name` in script.py](script.py#L123) promises that line 123 of
script.py holds `name` (quoted parts such as "state_dict" may appear as 'state_dict'). After a script
changes, run

    python scripts/readme_links.py          # rewrites the line numbers in README.md
    python scripts/readme_links.py --check  # lists links whose line no longer holds the name; exit 1

A name is looked up as `def name` / `class name` first, then as the first line that contains it. The table
"| `script.py` | lines | the core |" gets each script's line count, whole and cut to its core (every block
deleted by its markers, README: Copy only what you need).
"""
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\[`([^`]+)`[^\]]*\]\(([\w./-]+\.py)#L(\d+)\)")
COUNTS = re.compile(r"^\| `(\w+\.py)` \| \d+ \| \d+ \|$", re.M)
BLOCK = re.compile(r"^ *# region \[.*?^ *# endregion \[[^\n]*\n", re.M | re.S)


def line_counts(script):
    """The script's lines, whole and as the core: its blocks' regions and tagged lines deleted."""
    text = (ROOT / script).read_text()
    core = [line for line in BLOCK.sub("", text).splitlines() if not re.search(r"#( \[[a-z0-9-]+\])+$", line)]
    return f"| `{script}` | {len(text.splitlines())} | {len(core)} |"


def matches(line, name):
    return name in line or name.replace('"', "'") in line


def find_line(lines, name):
    bare = name.split("(")[0].split(".")[-1]
    for pattern in (rf"^\s*(def|class) {re.escape(bare)}\b",):
        for i, line in enumerate(lines, 1):
            if re.search(pattern, line) and matches(line, name):
                return i
    return next((i for i, line in enumerate(lines, 1) if matches(line, name)), None)


def links(text):
    """(match, name, file, line) for every line-anchored link."""
    return [(m, m[1], m[2], int(m[3])) for m in LINK.finditer(text)]


def stale_links(readme=ROOT / "README.md"):
    found = []
    for _, name, file, n in links(readme.read_text()):
        lines = (ROOT / file).read_text().splitlines()
        if not (1 <= n <= len(lines) and matches(lines[n - 1], name)):
            found.append(f"{file}#L{n}: `{name}`")
    return found


def main(argv):
    readme = ROOT / "README.md"
    if "--check" in argv:
        stale = stale_links(readme)
        print("\n".join(stale) or "all links point at their names")
        return 1 if stale else 0
    text, missing = readme.read_text(), []

    def fix(m):
        lines = (ROOT / m[2]).read_text().splitlines()
        n = int(m[3])
        if 1 <= n <= len(lines) and matches(lines[n - 1], m[1]):
            return m[0]
        found = find_line(lines, m[1])
        if found is None:
            missing.append(f"{m[2]}: `{m[1]}` not found")
            return m[0]
        return m[0][: m[0].rindex("#L")] + f"#L{found})"

    readme.write_text(COUNTS.sub(lambda m: line_counts(m[1]), LINK.sub(fix, text)))
    print("\n".join(missing) or "README.md: links updated")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
