"""The API reference's pages follow the packages' `__all__` (the site itself is built by .ci/run:
`mkdocs build --strict`, and the docstring examples run there as doctests)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_api_pages_match_all(capsys):
    # In-process: the script reads the source with `ast` and imports nothing of the package.
    spec = importlib.util.spec_from_file_location("gen_api_pages", ROOT / "docs" / "gen_api_pages.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--check"]) == 0, capsys.readouterr().err


def test_index_links_every_readme_guide():
    """docs/index.md links each README guide through the rendered guide page: the `##` sections (but
    Usage, whose `###` subsections are linked one by one, and Layout) and the `###` sections of Usage."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    index = (ROOT / "docs" / "index.md").read_text(encoding="utf-8")
    in_code, section, guides = False, None, []
    for line in readme.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and line.startswith("## "):
            section = line[3:].strip()
            if section not in ("Usage", "Layout"):
                guides.append(section)
        elif not in_code and line.startswith("### ") and section == "Usage":
            guides.append(line[4:].strip())
    assert len(guides) >= 8
    for title in guides:
        assert f"guide.md#{_slug(title)})" in index, f"docs/index.md does not link the README guide {title!r}"


def _slug(title: str) -> str:
    """Python-Markdown's toc slug (what mkdocs uses for anchors)."""
    import re
    import unicodedata

    value = unicodedata.normalize("NFKD", title).encode("ascii", "ignore").decode()
    value = re.sub(r"[^\w\s-]", "", value).strip().lower()
    return re.sub(r"[-\s]+", "-", value)
