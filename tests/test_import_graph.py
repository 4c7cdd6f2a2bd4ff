"""The package's layers point one way: no import cycles, and `ln_lightning.norm` is a leaf."""

from __future__ import annotations

import ast
import functools
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent / "ln_lightning"


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for p in ROOT.rglob("*.py"):
        name = ".".join(p.relative_to(ROOT.parent).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = p
    return out


@functools.lru_cache(maxsize=None)  # each test reads the whole package: parse each file once per run
def _tree(path: pathlib.Path, mtime_ns: int) -> ast.Module:
    return ast.parse(path.read_text())


def _parse(path: pathlib.Path) -> ast.Module:
    return _tree(path, path.stat().st_mtime_ns)


def _imports(name: str, path: pathlib.Path, module_level_only: bool, mods: dict | None = None) -> set[str]:
    tree = _parse(path)
    is_pkg = path.name == "__init__.py"
    nodes = tree.body if module_level_only else list(ast.walk(tree))
    out = set()
    for n in nodes:
        if isinstance(n, ast.Import):
            out |= {a.name for a in n.names if a.name.startswith("ln_lightning")}
        elif isinstance(n, ast.ImportFrom):
            if n.level:
                base = name.split(".")
                base = base[: len(base) - n.level + (1 if is_pkg else 0)]
                target = ".".join(base + ([n.module] if n.module else []))
            else:
                target = n.module or ""
            if target.startswith("ln_lightning"):
                for a in n.names:
                    # `from pkg import submodule` depends on the submodule; `from pkg import name`, on pkg.
                    sub = f"{target}.{a.name}"
                    out.add(sub if mods is not None and sub in mods else target)
    return out


def test_no_import_cycles_at_module_level():
    mods = _modules()
    graph = {m: {d for d in _imports(m, p, True, mods) if d in mods and d != m} for m, p in mods.items()}
    state: dict[str, int] = {}
    path: list[str] = []
    cycles: list[list[str]] = []

    def visit(u):
        state[u] = 1
        path.append(u)
        for v in graph[u]:
            if state.get(v) == 1 and not u.startswith(v + "."):  # a package importing its own child is no cycle
                cycles.append(path[path.index(v):] + [v])
            elif not state.get(v):
                visit(v)
        path.pop()
        state[u] = 2

    for m in graph:
        if not state.get(m):
            visit(m)
    assert not cycles, cycles


def _graph(module_level_only: bool, mods: dict[str, pathlib.Path]) -> dict[str, set[str]]:
    """Module -> the package modules it imports; a module importing its own ancestor package is no cycle."""
    return {m: {d for d in _imports(m, p, module_level_only, mods) if d in mods and d != m and not m.startswith(d + ".")}
            for m, p in mods.items()}


def _cyclic_groups(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components with more than one module (Tarjan): every module on some cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return groups


# Subpackages with no import cycle even through imports inside functions: moving an import into a function
# hides a cycle from the module-level check, it does not remove the dependency.
NO_HIDDEN_CYCLES = ("ln_lightning",)  # the whole package: no cycle, even through imports inside functions


def test_no_import_cycles_through_function_level_imports():
    cyclic = _cyclic_groups(_graph(False, _modules()))
    touching = [sorted(g) for g in cyclic if any(m == s or m.startswith(s + ".") for m in g for s in NO_HIDDEN_CYCLES)]
    assert not touching, touching


def test_the_cycle_check_sees_imports_inside_functions(tmp_path):
    # The cycle callbacks/_common.py <-> callbacks/dashboard.py once had, both sides inside functions.
    common, dashboard = tmp_path / "_common.py", tmp_path / "dashboard.py"
    common.write_text("def on_fit_start():\n    from ln_lightning.callbacks.dashboard import write_layout_once\n")
    dashboard.write_text("def monitor_layout():\n    from ln_lightning.callbacks._common import MonitorBase\n")
    mods = {"ln_lightning.callbacks._common": common, "ln_lightning.callbacks.dashboard": dashboard}
    assert _cyclic_groups(_graph(True, mods)) == []
    assert _cyclic_groups(_graph(False, mods)) == [set(mods)]


# The warning class and helpers, and the registry of attach hooks: they import nothing from the package.
LEAF_MODULES = {"ln_lightning._warnings", "ln_lightning._attach_hooks"}


def test_norm_imports_nothing_else_from_the_package():
    """Not even inside functions: placement builds on norm, never the other way (the leaf module with
    the package's warning class aside)."""
    mods = _modules()
    for name, path in mods.items():
        if name == "ln_lightning.norm" or name.startswith("ln_lightning.norm."):
            outside = {d for d in _imports(name, path, False, mods) if not d.startswith("ln_lightning.norm") and d not in LEAF_MODULES}
            assert not outside, f"{name} imports {sorted(outside)}"
    for leaf in LEAF_MODULES:
        assert not {d for d in _imports(leaf, mods[leaf], False, mods) if d != leaf}, f"{leaf} must stay a leaf"


def test_the_check_can_fail(tmp_path):
    p = tmp_path / "m.py"
    p.write_text("def f():\n    from ln_lightning.placement import hooks\n")
    assert "ln_lightning.placement" in _imports("ln_lightning.norm.m", p, False)


def _function_level_imports(path: pathlib.Path) -> list[int]:
    tree = _parse(path)
    return sorted({s.lineno for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                   for s in ast.walk(f) if isinstance(s, (ast.Import, ast.ImportFrom))})


# Imports inside functions that stay, with why: the command line dispatches so that `ln-lightning inspect` does not
# import Lightning; the fused norm's backends load on first use (no Triton, no C++ build at import); the package root
# registers export's save guard with the engine, loaded at the first rewrite (`import ln_lightning` imports no torch).
# A ratchet: lower it when one goes, never raise it to make room for a new one (move the import up or fix the cycle).
MAX_FUNCTION_LEVEL_IMPORTS = 8  # was 67 before issue 32; none in placement/


def test_imports_inside_functions_only_go_down_in_number():
    found = {p.relative_to(ROOT.parent).as_posix(): lines for p in sorted(ROOT.rglob("*.py"))
             if (lines := _function_level_imports(p))}
    total = sum(len(v) for v in found.values())
    assert total <= MAX_FUNCTION_LEVEL_IMPORTS, f"{total} imports inside functions (at most {MAX_FUNCTION_LEVEL_IMPORTS}): {found}"


# Layers above placement/ (the engine) that it must not import, even inside functions.
ABOVE_PLACEMENT = ("ln_lightning.export", "ln_lightning.demo", "ln_lightning.plugin", "ln_lightning.callbacks",
                   "ln_lightning.lightning_cli", "ln_lightning.cli", "ln_lightning.inspect_cli")
# None left: export's save guard reaches the rewrite state through the package root's registration (_attach_hooks).
KNOWN_UPWARD: set[tuple[str, str]] = set()


def test_placement_imports_no_layer_above_it():
    mods = _modules()
    arrows = set()
    for name, path in mods.items():
        if name.startswith("ln_lightning.placement"):
            for d in _imports(name, path, False, mods):
                top = next((a for a in ABOVE_PLACEMENT if d == a or d.startswith(a + ".")), None)
                if top is not None:
                    arrows.add((name, top))
    assert arrows <= KNOWN_UPWARD, sorted(arrows - KNOWN_UPWARD)
    assert arrows == KNOWN_UPWARD, f"an arrow went: drop it from KNOWN_UPWARD ({sorted(KNOWN_UPWARD - arrows)})"


def test_exports_plan_reads_the_rewrite_through_the_modules_that_own_its_tags():
    """Issue 32: export's plan never reads the rewrite's tags off modules itself (`__dict__`); the transition's and
    LayerNorm Scaling's own modules say which module reads what (`stream_sites`, `blends`, `scaled_norms`)."""
    text = (ROOT / "export" / "plan.py").read_text()
    assert "__dict__" not in text and "_ATTR" not in text and ".ATTR" not in text
