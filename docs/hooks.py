"""MkDocs hooks (mkdocs.yml `hooks:`): the pages the build generates, and the figures in every page.

- The README is the site's home page (`index.md`), its `docs/...` links made relative to the site
  (`docs/guides/x.md` -> `guides/x.md`); the CHANGELOG is `changelog.md`.
- The examples' results pages (`results/NAME/results.md`) are rendered from their `results.json`
  by the example's own `render_markdown` (docs/docgen/results_pages.py).
- In every page, `{{ ... }}` placeholders become the figures and tables they name, read from the
  results files (docs/docgen/figures.py, tables.py). A placeholder that does not resolve stops the
  build. The build's log says how many figures and tables came from which files.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from mkdocs.structure.files import File

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(DOCS))  # docs/docgen, importable from the hook and from the tests

from docgen import figures, results_pages, tables  # noqa: E402

log = logging.getLogger("mkdocs.hooks.ln_lightning")
GENERATED = {"index.md": "README.md", "changelog.md": "CHANGELOG.md"}
_evaluator: figures.Evaluator | None = None


def readme_as_page(text: str) -> str:
    """The README's links point into docs/ (for GitHub); on the site they are relative to docs/."""
    return text.replace("](docs/", "](")


def on_files(files, config):
    for uri, source in GENERATED.items():
        text = (ROOT / source).read_text(encoding="utf-8")
        files.append(File.generated(config, uri, content=readme_as_page(text)))
    for page in results_pages.PAGES:
        committed = files.get_file_from_path(page)
        if committed is not None:
            files.remove(committed)  # the committed copy is what GitHub shows; the site renders the JSON
        files.append(File.generated(config, page, content=results_pages.render(page)))
    return files


def on_pre_build(config):
    global _evaluator
    figures.load.cache_clear()  # mkdocs serve: read the results files afresh on every build
    _evaluator = figures.Evaluator(tables.Tables())


def on_page_markdown(markdown, page, config, files):
    try:
        return figures.resolve(markdown, _evaluator)
    except figures.FigureError as err:
        raise figures.FigureError(f"{page.file.src_uri}: {err}") from None


def on_post_build(config):
    used = ", ".join(f"{k} {v}" for k, v in sorted(_evaluator.used.items()))
    log.info(f"figures: {_evaluator.figures} from results files ({used}); tables rendered: {_evaluator.tables_rendered}")
