"""No measured figure in the docs is typed by hand (the rule: docs/docgen/figures.py).

The README and the guides hold no bare measured number; every placeholder resolves from a results file;
every results file is used; the results pages are what their example renders from results.json; every
picture comes from a script that wrote it. The rule itself is tested on figures it must catch and on
numbers it must let pass.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from _helpers_docs import docgen, docgen_script

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
figures = docgen("figures")
tables = docgen("tables")
results_pages = docgen("results_pages")
# What people write: the README and the guides' templates (docs/render_guides.py fills their figures in).
HAND_WRITTEN = [ROOT / "README.md", *sorted((DOCS / "guides_src").glob("*.md"))]


def _rel(p: Path) -> str:
    return p.relative_to(ROOT).as_posix()


@pytest.mark.parametrize("page", HAND_WRITTEN, ids=_rel)
def test_no_measured_figure_typed_by_hand(page):
    hits = figures.bare_figures(page.read_text(encoding="utf-8"))
    assert not hits, f"{_rel(page)}: measured figures typed by hand (use a {{{{ results... }}}} placeholder, or remove them):\n" + "\n".join(
        f"  line {n}: {fig!r} in: {line[:160]}" for n, fig, line in hits)


@pytest.mark.parametrize("text", [
    "the ratio is 0.986 in two runs", "it changed the output by 27%", "a step costs 1.08x a plain one",
    "600 steps in 28 s", "the suite took 12.6 min", "error 4.6e-2 against float64", "worst excess +0.26",
    "537 MB moved", "H200 at 4.3 TB/s", "a factor of 2×",
])
def test_the_rule_catches_typed_figures(text):
    assert figures.bare_figures(text), f"not caught: {text!r}"


@pytest.mark.parametrize("text", [
    "12 layers, 600 steps, 2 seeds, width 4096 x 768", "tested on Lightning 2.5 and 2.6, torch 2.13",
    "a literal in code: `eps=1e-5` or `1.15x`", "{{ results.bench_monitors.wall.ratio_median_paired | .3f }}",
    "<!-- 0.986 in a comment -->", "[a link](results/warmup_study_lr1e-2/results.md)", "sm_80, H200, Gemma 2",
    "versions 2.5.6 and 2.6.6", "`L = 1..128`, depths 1 to 128",
])
def test_the_rule_lets_configuration_and_code_pass(text):
    assert not figures.bare_figures(text), figures.bare_figures(text)


def test_the_rule_ignores_fenced_code():
    assert not figures.bare_figures("```python\nx = 0.986  # 27%\n```\n")
    assert figures.bare_figures("```python\nx = 1\n```\nthen 0.986\n")[0][0] == 4  # the line number in the page


def _inline_code(prose: str) -> list[str]:
    return [span for line in prose.splitlines() for span in line.split("`")[1::2]]


@pytest.mark.parametrize("page", [p for p in HAND_WRITTEN if p.name != "development.md"], ids=_rel)
def test_no_placeholder_inside_inline_code(page):
    """A placeholder in inline code is shown as it is (that is how the development guide shows the syntax):
    anywhere else it is a figure that would not be filled in."""
    prose = "".join(text for is_code, text in figures.split_fenced(page.read_text(encoding="utf-8")) if not is_code)
    spans = [span for span in _inline_code(prose) if "{{" in span]
    assert not spans, f"{_rel(page)}: placeholders in inline code: {spans}"


def test_rendered_guides_are_current(capsys):
    """docs/guides/ (what the README links to, and GitHub shows as it is) is the templates with every figure filled
    in: no placeholder left outside code, and the text of today's results files."""
    render_guides = docgen_script("render_guides")
    assert render_guides.main(["--check"]) == 0, capsys.readouterr().err
    for page in sorted((DOCS / "guides").glob("*.md")):
        assert not figures.placeholders(page.read_text(encoding="utf-8")), page


def test_readme_has_no_placeholders():
    """GitHub shows the README as it is: it links to the pages with the figures instead."""
    assert not figures.placeholders((ROOT / "README.md").read_text(encoding="utf-8"))


def test_every_placeholder_resolves_and_every_source_is_used(capsys):
    evaluator = figures.Evaluator(tables.Tables())
    for page in HAND_WRITTEN:
        for expr in figures.placeholders(page.read_text(encoding="utf-8")):
            evaluator.evaluate(expr)  # raises FigureError naming the placeholder
    with capsys.disabled():
        print(f"\ndocs figures: {evaluator.figures} from results files ({', '.join(f'{k} {v}' for k, v in sorted(evaluator.used.items()))}); "
              f"{evaluator.tables_rendered} generated tables")
    assert evaluator.figures >= 40 and evaluator.tables_rendered >= 8
    unused = set(figures.SOURCES) - figures.LOADED
    assert not unused, f"results files no page uses (remove them from SOURCES or show them): {sorted(unused)}"


def test_a_placeholder_that_does_not_resolve_fails():
    ev = figures.Evaluator()
    for bad in ["results.nope.x", "results.depth_scaling.analysis.no_such_key | .3f", "results.depth_scaling.analysis | .3f",
                "__import__('os').system('true')", "results.depth_scaling.analysis.v0 | .3q"]:
        with pytest.raises(figures.FigureError):
            ev.evaluate(bad)


def test_every_results_file_is_a_source():
    files = {p.relative_to(DOCS).as_posix() for p in (DOCS / "results").rglob("*.json")}
    assert files <= set(figures.SOURCES.values()), f"results files not in SOURCES: {sorted(files - set(figures.SOURCES.values()))}"


@pytest.mark.parametrize("page", sorted(results_pages.PAGES))
def test_results_page_is_its_example_rendering_of_results_json(page):
    rendered = results_pages.render(page)
    committed = results_pages.committed(page).read_text(encoding="utf-8")
    assert rendered == committed, (f"docs/{page} differs from the example's render_markdown(results.json): regenerate it "
                                   "(run the example, or its render_markdown on the committed results.json)")


def test_every_results_page_is_rendered_or_says_why_not():
    pages = {p.relative_to(DOCS).as_posix() for p in (DOCS / "results").glob("*/results.md")}
    assert pages == set(results_pages.PAGES) | set(results_pages.NOT_RENDERED)
    assert not set(results_pages.PAGES) & set(results_pages.NOT_RENDERED)


IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")
# Where the pictures come from: the examples write docs/results/*; depth profiles are exported from a run
# (docs/docgen/depth_images.py, with provenance.json); the two screenshots are taken by scripts.
GENERATED_IMAGES = {
    "results/": "the examples (docs/results/NAME, next to their results.json)",
    "img/depth/": "docs/docgen/depth_images.py",
    "img/dashboard.png": "tests/test_dashboard_browser.py",
    "img/site_navigation.png": "tests/test_docs_browser.py",
}


def test_every_picture_comes_from_a_script():
    for page in HAND_WRITTEN:
        for target in IMAGE.findall(page.read_text(encoding="utf-8")):
            path = (page.parent / target).resolve()  # the README's links point into docs/, the guides' are relative
            assert path.is_file(), f"{_rel(page)}: {target} does not exist"
            rel = path.relative_to(DOCS).as_posix()
            assert any(rel.startswith(prefix) for prefix in GENERATED_IMAGES), f"{_rel(page)}: {target} is not written by a script"
            if rel.startswith("results/"):
                assert list(path.parent.glob("*.json")) or list(path.parent.parent.glob("*.json")), f"{target}: no results file beside it"
