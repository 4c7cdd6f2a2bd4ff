"""MkDocs hooks (mkdocs.yml `hooks:`): the README and the CHANGELOG become site pages.

The README is the one source of the guides: it is rendered as `guide.md` with its `docs/...` links made
relative to the site (`docs/img/x.png` -> `img/x.png`), and the CHANGELOG as `changelog.md`.
"""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[1]
GENERATED = {"guide.md": "README.md", "changelog.md": "CHANGELOG.md"}


def on_files(files, config):
    for uri, source in GENERATED.items():
        text = (ROOT / source).read_text(encoding="utf-8").replace("](docs/", "](")
        files.append(File.generated(config, uri, content=text))
    return files
