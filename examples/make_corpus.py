"""Write a corpus of real English paragraphs taken from the Python standard library.

Docstrings of every module, class and function of the running Python's stdlib are read
with ``ast`` (nothing is imported or executed), split into paragraphs, de-duplicated and
written as one JSON-lines file per package plus a few Markdown files, so a new user can
try ``embedingest build-index`` on a few thousand paragraphs without a download.

    python examples/make_corpus.py corpus/ [--max-paragraphs 5000]
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sysconfig
from pathlib import Path


def paragraphs_of(path: Path):
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if not doc:
                continue
            for para in re.split(r"\n\s*\n", doc):
                text = " ".join(para.split())
                if len(text) >= 60 and not text.startswith((">>>", "..")):
                    yield getattr(node, "name", path.stem), text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--max-paragraphs", type=int, default=5000)
    args = ap.parse_args()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    seen: set[str] = set()
    per_package: dict[str, list[dict]] = {}
    for path in sorted(stdlib.glob("*.py")) + sorted(stdlib.glob("*/*.py")):
        if any(part.startswith(("test", "idlelib")) for part in path.relative_to(stdlib).parts):
            continue
        package = path.parent.name if path.parent != stdlib else path.stem
        for name, text in paragraphs_of(path):
            if text in seen:
                continue
            seen.add(text)
            rows = per_package.setdefault(package, [])
            rows.append({"id": f"{path.relative_to(stdlib)}:{name}:{len(rows)}", "text": text})
            if len(seen) >= args.max_paragraphs:
                break
        if len(seen) >= args.max_paragraphs:
            break
    args.out.mkdir(parents=True, exist_ok=True)
    for package, rows in per_package.items():
        if len(rows) >= 40:
            with open(args.out / f"{package}.jsonl", "w", encoding="utf-8") as fh:
                fh.writelines(json.dumps(r) + "\n" for r in rows)
        else:
            body = "\n\n".join(r["text"] for r in rows)
            (args.out / f"{package}.md").write_text(f"# {package}\n\n{body}\n", encoding="utf-8")
    print(f"wrote {len(seen)} paragraphs from {len(per_package)} modules into {args.out}")


if __name__ == "__main__":
    main()
