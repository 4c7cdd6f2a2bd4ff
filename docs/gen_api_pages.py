"""Write the API reference pages (docs/reference/) and their nav in mkdocs.yml from the packages' `__all__`.

    python docs/gen_api_pages.py          # (re)write the pages and the nav block
    python docs/gen_api_pages.py --check  # exit 1 and list what is out of date (tests/test_docs.py runs this)

One page per public object of `ln_lightning.__all__` and of the `__all__` of `ln_lightning.norm`,
`ln_lightning.callbacks` and `ln_lightning.placement`, plus one overview page per module. An object
exported both at the top level and by a subpackage gets one page, under the subpackage's name. The
names are read from the source with `ast` (nothing is imported, so no torch is needed). The pages hold
only a mkdocstrings directive: the text is the docstring, edited where the object is defined.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "docs" / "reference"
MKDOCS = ROOT / "mkdocs.yml"
TOP = "ln_lightning"
SUBPACKAGES = ("ln_lightning.placement", "ln_lightning.norm", "ln_lightning.callbacks")
NAV_BEGIN = "  # BEGIN API nav (docs/gen_api_pages.py writes this block)"
NAV_END = "  # END API nav"
HEADER = "<!-- Written by docs/gen_api_pages.py from the package's __all__: edit the docstring, not this file. -->\n"


def _module_tree(module: str) -> ast.Module:
    path = ROOT.joinpath(*module.split(".")) / "__init__.py"
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def _literal(tree: ast.Module, name: str):
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise LookupError(f"no literal {name} in the module")


def public_objects() -> dict[str, list[tuple[str, list[str]]]]:
    """{module: [(object name, [other public paths of the same object])]}, in `__all__` order."""
    exports = _literal(_module_tree(TOP), "_EXPORTS")
    top_all = [n for n in _literal(_module_tree(TOP), "__all__") if not n.startswith("__")]
    out: dict[str, list[tuple[str, list[str]]]] = {}
    for module in SUBPACKAGES:
        names = _literal(_module_tree(module), "__all__")
        out[module] = [(n, [f"{TOP}.{n}"] if exports.get(n) == module and n in top_all else []) for n in names]
    out[TOP] = [(n, []) for n in top_all if exports.get(n) not in SUBPACKAGES]
    return out


def _object_page(module: str, name: str, aliases: list[str]) -> str:
    also = "".join(f" or `from {a.rpartition('.')[0]} import {name}`" for a in aliases)
    return (
        f"{HEADER}\n"
        f"Import: `from {module} import {name}`{also}. Module overview: [`{module}`]({module}.md).\n\n"
        f"::: {module}.{name}\n"
    )


def _module_page(module: str, objects: list[tuple[str, list[str]]], everything: dict) -> str:
    lines = [HEADER, f"::: {module}", "    options:", "      members: false", ""]
    lines.append("## Public names\n")
    for name, _ in objects:
        lines.append(f"- [`{name}`]({module}.{name}.md)")
    if module == TOP:
        lines.append("")
        lines.append("Also exported here (documented with their subpackage):\n")
        for sub in SUBPACKAGES:
            for name, aliases in everything[sub]:
                if aliases:
                    lines.append(f"- [`{name}`]({sub}.{name}.md) (`{sub}`)")
        lines.append("- `__version__`: the package version, the one place it is written.")
    return "\n".join(lines) + "\n"


def expected_files() -> dict[Path, str]:
    objects = public_objects()
    files: dict[Path, str] = {}
    for module, items in objects.items():
        files[REFERENCE / f"{module}.md"] = _module_page(module, items, objects)
        for name, aliases in items:
            files[REFERENCE / f"{module}.{name}.md"] = _object_page(module, name, aliases)
    return files


def expected_nav() -> str:
    objects = public_objects()
    lines = [NAV_BEGIN, "  - API reference:"]
    for module in (TOP, *SUBPACKAGES):
        lines.append(f"      - {module}:")
        lines.append(f"          - Overview: reference/{module}.md")
        for name, _ in objects[module]:
            lines.append(f"          - {name}: reference/{module}.{name}.md")
    lines.append(NAV_END)
    return "\n".join(lines)


def _with_nav(text: str) -> str:
    begin, end = text.index(NAV_BEGIN), text.index(NAV_END) + len(NAV_END)
    return text[:begin] + expected_nav() + text[end:]


def main(argv: list[str]) -> int:
    check = "--check" in argv
    files = expected_files()
    stale = sorted(p for p in REFERENCE.glob("*.md") if p not in files)
    wrong = sorted(p for p, text in files.items() if not p.is_file() or p.read_text(encoding="utf-8") != text)
    mkdocs_text = MKDOCS.read_text(encoding="utf-8")
    nav_wrong = _with_nav(mkdocs_text) != mkdocs_text
    if check:
        problems = [f"stale: {p.relative_to(ROOT)}" for p in stale] + [f"out of date: {p.relative_to(ROOT)}" for p in wrong]
        if nav_wrong:
            problems.append("out of date: the API nav block in mkdocs.yml")
        if problems:
            print("\n".join(problems) + "\nrun: python docs/gen_api_pages.py", file=sys.stderr)
            return 1
        print(f"API reference up to date: {len(files)} pages")
        return 0
    REFERENCE.mkdir(parents=True, exist_ok=True)
    for p in stale:
        p.unlink()
    for p in wrong:
        p.write_text(files[p], encoding="utf-8")
    if nav_wrong:
        MKDOCS.write_text(_with_nav(mkdocs_text), encoding="utf-8")
    print(f"wrote {len(wrong)} pages, removed {len(stale)}, nav {'updated' if nav_wrong else 'unchanged'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
