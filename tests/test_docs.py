"""The documentation's structure: a short README with the set-up commands CI runs, one guide per task in
the site's navigation, each opening with what the user wants to do, and API pages that follow `__all__`.
(The site itself is built by .ci/run, `mkdocs build --strict`; tests/test_docs_browser.py opens it.)"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
GUIDES = sorted((ROOT / "docs" / "guides").glob("*.md"))

MAIN_JOB = ("python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 && pip install -e . && "
            "ln-lightning fit --config configs/demo_migrate_prenorm.yaml")
TEST_SUITE = ('python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 && pip install -e ".[dev,hf,triton]" && '
              "python -m pytest -q -n 2 --maxschedchunk 1")


def test_api_pages_match_all(capsys):
    # In-process: the script reads the source with `ast` and imports nothing of the package.
    spec = importlib.util.spec_from_file_location("gen_api_pages", ROOT / "docs" / "gen_api_pages.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--check"]) == 0, capsys.readouterr().err


def test_readme_is_short():
    assert len(README.splitlines()) <= 150


def test_readme_starts_with_the_two_set_up_commands():
    lines = README.splitlines()
    assert MAIN_JOB in lines and TEST_SUITE in lines
    first_code = next(i for i, line in enumerate(lines) if line.startswith("```"))
    assert lines[first_code + 1] == MAIN_JOB, "the main job's command is the README's first code block"
    assert lines.index(MAIN_JOB) < lines.index(TEST_SUITE) < next(i for i, line in enumerate(lines) if line == "```python")


def test_ci_runs_the_readmes_test_command():
    """.ci/run runs the README's test command verbatim, in its own venv, with pip's -q."""
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    readme_install = TEST_SUITE.split(" && ", 2)[2]  # after creating and activating the venv
    assert readme_install.replace("pip install ", "pip install -q ") + " || exit $?" in ci.splitlines()


def _nav_pages() -> list[str]:
    config = yaml.load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"), Loader=yaml.BaseLoader)
    pages: list[str] = []

    def walk(items):
        for item in items:
            for value in (item.values() if isinstance(item, dict) else [item]):
                walk(value) if isinstance(value, list) else pages.append(value)

    walk(config["nav"])
    return pages


def test_every_guide_is_in_the_navigation_and_linked_from_the_readme():
    nav = _nav_pages()
    assert len(GUIDES) >= 8
    for guide in GUIDES:
        rel = guide.relative_to(ROOT / "docs").as_posix()
        assert rel in nav, f"{rel} is not in mkdocs.yml's nav"
        assert f"](docs/{rel})" in README, f"the README does not link {rel}"
    for page in nav:
        assert (ROOT / "docs" / page).is_file() or page in ("index.md", "changelog.md") or page.startswith("results/"), page


def test_every_guide_opens_with_what_the_user_wants_to_do():
    """The first paragraph after the title is addressed to the reader's goal: it starts with "You"."""
    for guide in GUIDES:
        text = guide.read_text(encoding="utf-8")
        title, _, rest = text.partition("\n")
        assert title.startswith("# "), f"{guide.name}: no title"
        first = rest.strip().split("\n\n")[0]
        assert first.startswith("You "), f"{guide.name} opens with {first[:80]!r}, not with the reader's goal"


def test_readme_and_guides_link_only_to_pages_that_exist():
    link = re.compile(r"\]\(([^)#\s]+\.md)(?:#[^)]*)?\)")
    for page in [ROOT / "README.md", *GUIDES]:
        for target in link.findall(page.read_text(encoding="utf-8")):
            if target.startswith("http"):
                continue
            assert (page.parent / target).resolve().is_file(), f"{page.name} links {target}, which does not exist"

