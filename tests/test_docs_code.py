"""Every Python code block of the README and the guides runs (docs/docgen/codeblocks.py says how).

One test per page: its blocks run in order in one namespace, in an empty working directory, on CPU
with this suite's single thread. A block marked `<!-- no-run: reason -->` is not run; the count test
prints how many blocks run and how many are marked, and the last two tests show that a broken block
fails the run and that a marked block is not run.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _helpers_docs import docgen

ROOT = Path(__file__).resolve().parents[1]
codeblocks = docgen("codeblocks")

PAGES = codeblocks.pages()


@pytest.fixture
def in_empty_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # checkpoints and lightning_logs the blocks write land here
    monkeypatch.setenv("PYTHONWARNINGS", "ignore")
    return tmp_path


# Pages whose blocks fit models for several seconds run in the full suite (CI), not in the quick run (conftest's rule).
_FITTING = {"README.md", "docs/guides/migrate.md"}
_PARAMS = [pytest.param(p, marks=[pytest.mark.slow] if p.relative_to(ROOT).as_posix() in _FITTING else [],
                        id=p.relative_to(ROOT).as_posix()) for p in PAGES]


@pytest.mark.parametrize("page", _PARAMS)
def test_code_blocks_run(page, in_empty_dir):
    import lightning  # noqa: F401 - imported before the blocks, so their time is the blocks' own

    blocks = codeblocks.python_blocks(page)
    if not any(b.no_run is None for b in blocks):
        pytest.skip(f"{page.name} has no runnable Python block")
    codeblocks.run_page(blocks)


def test_count_of_blocks_run_and_marked(capsys):
    run, marked = [], []
    for page in PAGES:
        for b in codeblocks.python_blocks(page):
            (marked if b.no_run is not None else run).append(b)
    with capsys.disabled():
        print(f"\ndocs code blocks: {len(run)} run, {len(marked)} marked not runnable: "
              + "; ".join(f"{b.where} ({b.no_run})" for b in marked))
    assert len(run) >= 10, "the README and the guides should show runnable code"
    # The README's examples all run: a user copies them first.
    assert not [b for b in marked if b.page == "README.md"], "a README block is marked not runnable"


def test_every_python_block_is_tagged_python():
    """A block of Python written under another info string (or none) would escape the run."""
    suspects = []
    for page in PAGES:
        rel = page.relative_to(ROOT).as_posix()
        for b in codeblocks.blocks(page.read_text(encoding="utf-8"), rel):
            if b.language in ("", "text", "console") and ("import " in b.code or "def " in b.code):
                suspects.append(b.where)
    assert not suspects, f"Python code in blocks not tagged python: {suspects}"


BROKEN_PAGE = """# A page

```python
x = 1
```

<!-- no-run: needs a cluster -->
```python
raise SystemExit("a marked block must not run")
```

```python
y = x + undefined_name
```
"""


def test_a_broken_block_fails_the_run(in_empty_dir):
    blocks = codeblocks.blocks(BROKEN_PAGE, "docs/guides/broken.md")
    assert [b.no_run for b in blocks] == [None, "needs a cluster", None]
    with pytest.raises(codeblocks.BlockFailed, match=r"docs/guides/broken.md:12 failed: NameError"):
        codeblocks.run_page(blocks)


def test_the_first_blocks_share_a_namespace_and_a_marked_block_is_skipped(in_empty_dir):
    blocks = codeblocks.blocks(BROKEN_PAGE, "docs/guides/broken.md")[:2]
    namespace = codeblocks.run_page(blocks)
    assert namespace["x"] == 1
