"""The Python code blocks of the README and the guides, extracted and run (tests/test_docs_code.py).

A page's ```` ```python ```` blocks run in order in one namespace, like a notebook: a later block may
use what an earlier one defined, so each page reads top to bottom as one session. A block that is
not meant to run (it needs GPUs, a cluster, or a file of yours) has an HTML comment on the line
before it, which the site does not show:

    <!-- no-run: needs 8 GPUs on each of 2 nodes -->
    ```python
    ...

The reason is required. Blocks in other languages (`bash`, `yaml`, text) are not run.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from .figures import DOCS

ROOT = DOCS.parent
NO_RUN = re.compile(r"^\s*<!--\s*no-run:\s*(?P<reason>\S.*?)\s*-->\s*$")
OPEN = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`\s]*)(?P<rest>.*)$")


@dataclass
class Block:
    page: str  # path relative to the repository root
    line: int  # line of the opening fence (1-based)
    language: str
    code: str
    no_run: str | None  # the reason, for a block marked not runnable

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def pages() -> list[Path]:
    """The pages whose blocks are run: the README and every guide."""
    return [ROOT / "README.md", *sorted((DOCS / "guides").glob("*.md"))]


def blocks(text: str, page: str) -> list[Block]:
    out: list[Block] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = OPEN.match(lines[i])
        if not m:
            i += 1
            continue
        fence, indent = m.group("fence"), len(m.group("indent"))
        start, body = i, []
        i += 1
        while i < len(lines) and not (lines[i].strip().startswith(fence) and lines[i].strip().strip(fence[0]) == ""):
            body.append(lines[i][indent:] if lines[i][:indent].strip() == "" else lines[i])
            i += 1
        i += 1
        prev = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        marked = NO_RUN.match(prev)
        out.append(Block(page, start + 1, m.group("info").lower(), "\n".join(body) + "\n",
                         marked.group("reason") if marked else None))
    return out


def python_blocks(path: Path) -> list[Block]:
    rel = path.relative_to(ROOT).as_posix()
    return [b for b in blocks(path.read_text(encoding="utf-8"), rel) if b.language in ("python", "py", "python3")]


class BlockFailed(AssertionError):
    pass


def run_page(page_blocks: list[Block], namespace: dict | None = None) -> dict:
    """Run the runnable blocks in order in one namespace; a failure names the block and its line."""
    namespace = {"__name__": "__docs__"} if namespace is None else namespace
    for b in page_blocks:
        if b.no_run is not None:
            continue
        try:
            # padded so that a traceback's line numbers are the page's
            exec(compile("\n" * b.line + b.code, b.page, "exec"), namespace)  # noqa: S102 - the docs' own code
        except Exception as err:  # noqa: BLE001 - any failure of a block is the test's failure
            raise BlockFailed(f"the code block at {b.where} failed: {type(err).__name__}: {err}\n--- block ---\n{b.code}") from err
    return namespace
