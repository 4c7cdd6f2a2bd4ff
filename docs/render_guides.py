"""Write the guides (docs/guides/) from their templates (docs/guides_src/), with every figure filled in.

    python docs/render_guides.py          # (re)write docs/guides/*.md
    python docs/render_guides.py --check  # exit 1 and list what is out of date (tests/test_docs_figures.py runs this)

The templates hold `{{ results... }}` / `{{ tables... }}` placeholders (docs/docgen/figures.py); a repository page
shows markdown as it is, so the README links to the rendered guides, which are committed. Edit the template, then
run this. The site builds from the rendered guides too (the templates are excluded in mkdocs.yml), so what GitHub
shows and what the site shows are one text.
"""

from __future__ import annotations

import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
TEMPLATES = DOCS / "guides_src"
GUIDES = DOCS / "guides"

# Run as a script, docs/ is the first entry of sys.path (the script's folder); the tests load docgen first.
from docgen import figures, tables  # noqa: E402


def header(name: str) -> str:
    return (f"<!-- Written by docs/render_guides.py from docs/guides_src/{name}, with the figures read from the results "
            "files: edit the template, then run python docs/render_guides.py. -->\n")


def expected_files() -> dict[Path, str]:
    evaluator = figures.Evaluator(tables.Tables())
    out = {}
    for template in sorted(TEMPLATES.glob("*.md")):
        try:
            body = figures.resolve(template.read_text(encoding="utf-8"), evaluator)
        except figures.FigureError as err:
            raise figures.FigureError(f"docs/guides_src/{template.name}: {err}") from None
        # (at the end: a guide opens with its title and the reader's goal, tests/test_docs.py)
        out[GUIDES / template.name] = body.rstrip("\n") + "\n\n" + header(template.name)
    return out


def main(argv: list[str]) -> int:
    check = "--check" in argv
    files = expected_files()
    stale = sorted(p for p in GUIDES.glob("*.md") if p not in files)
    wrong = sorted(p for p, text in files.items() if not p.is_file() or p.read_text(encoding="utf-8") != text)
    if check:
        problems = [f"no template: {p.relative_to(ROOT)}" for p in stale] + [f"out of date: {p.relative_to(ROOT)}" for p in wrong]
        if problems:
            print("\n".join(problems) + "\nrun: python docs/render_guides.py (edit docs/guides_src/, not docs/guides/)",
                  file=sys.stderr)
            return 1
        print(f"rendered guides up to date: {len(files)} pages")
        return 0
    GUIDES.mkdir(parents=True, exist_ok=True)
    for p in stale:
        p.unlink()
    for p in wrong:
        p.write_text(files[p], encoding="utf-8")
    print(f"wrote {len(wrong)} guides, removed {len(stale)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
