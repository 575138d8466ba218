"""docs/ARCHITECTURE.md's module map against the package: every module named where it
is, and no module named that is not there (a new module left out of the map, or one
removed and still described, fails here)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "embedingest"


def map_by_folder(text: str) -> dict[str, set[str]]:
    """The ``*.py`` names of the map's code block under each folder ('' for the top)."""
    block = text.split("```\nembedingest/\n", 1)[1].split("```", 1)[0]
    named: dict[str, set[str]] = {"": set()}
    stack: list[str] = []
    folder = ""
    for line in block.splitlines():
        entry = re.match(r"^( {2}| {4}| {6})([\w.]+/?)(?:\s|$)", line)
        if entry and (entry.group(2).endswith("/") or entry.group(2).endswith(".py")):
            stack = stack[:len(entry.group(1)) // 2 - 1]
            if entry.group(2).endswith("/"):
                stack.append(entry.group(2)[:-1])
            folder = "/".join(stack)
        named.setdefault(folder, set()).update(re.findall(r"\b\w+\.py\b", line))
    return named


def package_by_folder() -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        folder = path.parent.relative_to(PACKAGE).as_posix()
        found.setdefault("" if folder == "." else folder, set()).add(path.name)
    return found


def test_the_module_map_names_every_module_of_the_package_and_no_other():
    named = map_by_folder((ROOT / "docs" / "ARCHITECTURE.md").read_text())
    found = package_by_folder()
    missing = {f: sorted(found[f] - named.get(f, set()) - {"__init__.py"}) for f in found}
    absent = {f: sorted(named[f] - found.get(f, set())) for f in named}
    assert not any(missing.values()), f"modules the map leaves out: {missing}"
    assert not any(absent.values()), f"modules the map names that do not exist: {absent}"


def test_every_module_path_the_architecture_names_exists():
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    paths = set(re.findall(r"`((?:\w+/)+\w+\.py)`", text))
    assert paths and not [p for p in sorted(paths) if not (PACKAGE / p).is_file()]


def test_the_map_reader_sees_a_module_left_out():
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    named = map_by_folder(text.replace("    worker_loader.py", "    other_name.py"))
    assert "worker_loader.py" not in named["engine"] and "other_name.py" in named["engine"]
