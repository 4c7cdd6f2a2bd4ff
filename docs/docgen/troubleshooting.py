"""The troubleshooting page, generated from the library's own messages.

`collect()` reads every module of ln_lightning with `ast` (nothing is imported) and returns each
message a user can meet:

- the first argument of every `raise SomeError(...)`;
- every warning (`warn(...)`, `warnings.warn(...)`) and `log.warning(...)`;
- what a conversion report says: `report.notes.append(...)`, a block's skip `reason` (assigned, or
  returned by a handler's `can_convert_to`), and the internal exceptions whose text becomes a skip
  reason or note (`Unrecognised`, `CheckFailed`, `NotAdded`).

A message's text is the string as written, with each f-string field shown as `{name}` (or `{…}` for
an expression). A message held in a variable or returned by a helper is followed to the string it is
assigned from, in the same function or module. `docs/troubleshooting.yml` sorts the messages into
groups, each with what to do; `render()` writes them as the page. tests/test_docs_troubleshooting.py
fails when a message is in no group, when a group's `match` finds no message (the message changed),
or when a message can't be read as text.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import yaml

from .figures import DOCS

ROOT = DOCS.parent
PACKAGE = ROOT / "ln_lightning"
GROUPS_FILE = DOCS / "troubleshooting.yml"

# Exceptions whose text a user meets as a report's skip reason or note, not as a raised error.
REASON_EXCEPTIONS = {"Unrecognised": "skip reason", "CheckFailed": "skip reason (probe check)", "NotAdded": "report note (final norm)"}
WARN_CALLS = {"warn", "warnings.warn", "_warn"}
LOG_WARN_SUFFIXES = (".warning",)
# Not messages: a re-raise of a computed exit code, and the warning helper's own forwarding call.
SKIP_SITES = {("ln_lightning/cli.py", "SystemExit"), ("ln_lightning/lightning_cli.py", "SystemExit")}
HELPERS = {("ln_lightning/_warnings.py", "warn")}
# Sites that pass on a message collected elsewhere or written by another library: (path, function) -> what it passes.
PASS_THROUGH = {
    ("ln_lightning/_plugin_arguments.py", "placement_spec"): "LNPlacement's options are checked by `PlacementSpec` (`validate_options`, "
    "and the transition's target by `transition.check_target`): their messages, listed under convert's options, arrive "
    "prefixed `LNPlacement: `.",
    ("ln_lightning/_cli_errors.py", "error"): "`ln-lightning inspect`'s and `ln-lightning export`'s argument errors are "
    "argparse's own messages.",
    ("ln_lightning/inspect_cli.py", "_load_factory"): "`ln-lightning inspect MODULE:FACTORY`: the factory's own exception, "
    "in one line (`FACTORY() raised TypeError: ...`).",
    ("ln_lightning/export/cli.py", "_main"): "`ln-lightning export`: `load_converted`'s message about the checkpoint file "
    "(listed under checkpoints and loading), in one line.",
}


@dataclass
class Message:
    kind: str  # the exception class, "warning", "log warning", "report note", "skip reason", ...
    text: str  # the template; `<...>` marks a part that could not be read as text
    where: str  # path:line
    function: str

    @property
    def readable(self) -> bool:
        """Whether the text says something beyond its fields (a message passed in a variable we could not follow is not)."""
        return len(re.sub(r"\{[^{}]*\}", "", self.text).strip(" .;:")) >= 12


@dataclass
class Group:
    area: str
    title: str
    do: str
    match: list[str]
    messages: list[Message] = field(default_factory=list)


# ------------------------------------------------------------------ reading the source


def _field(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return "{" + node.id + "}"
    if isinstance(node, ast.Attribute):
        return "{" + node.attr + "}"
    return "{…}"


class _Module:
    def __init__(self, path: Path):
        self.path = path
        self.rel = path.relative_to(ROOT).as_posix()
        self.tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        self.functions: dict[str, list[ast.FunctionDef]] = {}
        for node in ast.walk(self.tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.functions.setdefault(node.name, []).append(node)

        def mark(node, fn):  # every node learns its innermost enclosing function
            for child in ast.iter_child_nodes(node):
                inner = child if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else fn
                child._ln_function = inner
                mark(child, inner)
        mark(self.tree, None)

    def texts(self, node: ast.AST, depth: int = 0, top: bool = True) -> list[str]:
        """Every string `node` can evaluate to: several for a message chosen by a top-level conditional or
        assigned in several branches; a conditional part inside a message is shown as a field."""
        if depth > 12:
            return ["{…}"]
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return [node.value]
        if isinstance(node, ast.JoinedStr):
            out = [""]
            for v in node.values:
                if isinstance(v, ast.Constant):
                    out = [o + str(v.value) for o in out]
                else:
                    inner = v.value
                    # a field that is itself a message (f"strict conversion: {msg}") is followed
                    follow = isinstance(inner, ast.Name) and self._assigned_str(inner)
                    sub = self.texts(inner, depth + 1, top=False) if follow else [_field(inner)]
                    out = [o + t for o in out for t in sub]
            return out
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            return [a + b for a in self.texts(node.left, depth + 1, top=False) for b in self.texts(node.right, depth + 1, top=False)]
        if isinstance(node, ast.IfExp):
            if not top:
                return ["{…}"]
            return self.texts(node.body, depth + 1) + self.texts(node.orelse, depth + 1)
        if isinstance(node, ast.Name):
            values = self._assigned_str(node)
            if not values:
                return ["{" + node.id + "}"]
            if not top and len(values) > 1:
                return ["{" + node.id + "}"]  # a part chosen in branches: shown as a field
            return [t for v in values for t in self.texts(v, depth + 1, top=top)]
        if isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            if name in ("join", "format", "str", "repr"):
                return ["{…}"]
            # a helper that builds the message: in this module, or a method defined anywhere in the package
            texts = []
            for module in [self, *(m for m in _all_modules() if m.rel != self.rel)]:
                for fn in module.functions.get(name, []):
                    for r in ast.walk(fn):
                        if isinstance(r, ast.Return) and r.value is not None and _stringy(r.value):
                            texts += module.texts(r.value, depth + 1, top=top)
                if texts and module is self:
                    break  # the module's own helper; an abstract one (no string returned) is looked up elsewhere
            return (texts if top else texts[:1]) or ["{…}"]
        return ["{…}"]

    def _assigned_str(self, name: ast.Name) -> list[ast.AST]:
        """The string expressions assigned to `name` in its function (before its use), or at module level."""
        fn = getattr(name, "_ln_function", None)
        scope = fn if fn is not None else self.tree
        values = []
        for node in ast.walk(scope):
            if isinstance(node, ast.Assign) and getattr(node, "lineno", 0) <= name.lineno:
                for t in node.targets:
                    if isinstance(t, ast.Name) and t.id == name.id and _stringy(node.value):
                        values.append(node.value)
            if isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name) and node.target.id == name.id and values:
                values[-1] = ast.BinOp(values[-1], ast.Add(), node.value)
        return values


def _stringy(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str)
    if isinstance(node, ast.JoinedStr):
        return True
    if isinstance(node, ast.BinOp):
        return _stringy(node.left) or _stringy(node.right)
    if isinstance(node, ast.IfExp):
        return _stringy(node.body) or _stringy(node.orelse)
    return False


_MODULES: list["_Module"] = []


def _all_modules() -> list["_Module"]:
    if not _MODULES:
        _MODULES.extend(_Module(p) for p in _package_files())
    return _MODULES


def _package_files() -> list[Path]:
    # ln_lightning/testing is shipped for the tests, not a user-facing module
    return [p for p in sorted(PACKAGE.rglob("*.py")) if "testing" not in p.relative_to(PACKAGE).parts]


def _call_name(node: ast.Call) -> str:
    try:
        return ast.unparse(node.func)
    except Exception:  # noqa: BLE001
        return ""


def _function_name(node: ast.AST) -> str:
    fn = getattr(node, "_ln_function", None)
    return fn.name if fn is not None else "<module>"


def collect() -> list[Message]:
    """Every message, read from the source (again only when a file changed: mkdocs serve rebuilds in one process)."""
    stamp = tuple((str(p), p.stat().st_mtime_ns) for p in _package_files())
    return list(_collect(PACKAGE, stamp))


@lru_cache(maxsize=4)
def _collect(package: Path, stamp: tuple) -> tuple[Message, ...]:
    _MODULES.clear()
    out: list[Message] = []
    for mod in _all_modules():
        for node in ast.walk(mod.tree):
            site = f"{mod.rel}:{getattr(node, 'lineno', 0)}"
            fn = _function_name(node)
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and node.exc.args:
                cls = _call_name(node.exc).rpartition(".")[2]
                if (mod.rel, cls) in SKIP_SITES:
                    continue
                kind = REASON_EXCEPTIONS.get(cls, cls)
                out += [Message(kind, t, site, fn) for t in mod.texts(node.exc.args[0])]
            elif isinstance(node, ast.Call) and node.args:
                name = _call_name(node)
                if name in WARN_CALLS:
                    if (mod.rel, fn) in HELPERS:
                        continue
                    out += [Message("warning", t, site, fn) for t in mod.texts(node.args[0])]
                elif name.endswith(LOG_WARN_SUFFIXES) and ("log" in name.lower()):
                    out += [Message("log warning", _percent(t), site, fn) for t in mod.texts(node.args[0])]
                elif name.endswith("notes.append"):
                    out += [Message("report note", t, site, fn) for t in mod.texts(node.args[0])]
            elif isinstance(node, ast.Assign):
                for target in node.targets:
                    value = node.value
                    pairs = []
                    if isinstance(target, ast.Attribute) and target.attr == "reason":
                        pairs = [value]
                    elif isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple):
                        pairs = [v for t, v in zip(target.elts, value.elts) if isinstance(t, ast.Attribute) and t.attr == "reason"]
                    for v in pairs:
                        if _stringy(v) or isinstance(v, ast.Name) and mod._assigned_str(v):
                            # `reason = ""` clears a reason before a retry: not a message
                            out += [Message("skip reason", t, site, fn) for t in mod.texts(v) if t]
            elif isinstance(node, ast.Return) and fn in ("can_convert_to", "_refusal") and node.value is not None and _stringy(node.value):
                out += [Message("skip reason", t, site, fn) for t in mod.texts(node.value)]
        # A public module-level constant that reads as a sentence is a message used by name (a skip reason
        # several sites return, the text a saved directory shows its loaders).
        for node in mod.tree.body:
            if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                    and not node.targets[0].id.startswith("_") and _stringy(node.value)):
                for t in mod.texts(node.value):
                    # a sentence, not a formula: BACKWARD_FORM's spaces are between operators
                    if t.count(" ") >= 15 and sum(w.isalpha() for w in t.split()) >= 8:
                        out.append(Message("message", t, f"{mod.rel}:{node.lineno}", "<module>"))
    seen, unique = set(), []
    for m in out:
        key = (m.kind, m.text, m.where)
        if key not in seen:
            seen.add(key)
            unique.append(m)
    return tuple(unique)


def _percent(text: str) -> str:
    return text.replace("%s", "{…}").replace("%r", "{…}").replace("%d", "{…}")


# ------------------------------------------------------------------ the groups and the page


def load_groups() -> list[Group]:
    raw = yaml.safe_load(GROUPS_FILE.read_text(encoding="utf-8"))
    return [Group(g["area"], g["title"], g["do"].strip(), list(g["match"])) for g in raw]


def sort(messages: list[Message] | None = None, groups: list[Group] | None = None):
    """(groups with their messages, messages in no group, match strings that found nothing)."""
    messages = collect() if messages is None else messages
    groups = load_groups() if groups is None else groups
    unsorted = []
    for m in messages:
        if passed_on(m):
            continue
        group = next((g for g in groups if any(s in m.text for s in g.match)), None)
        if group is None:
            unsorted.append(m)
        else:
            group.messages.append(m)
    stale = [(g.title, s) for g in groups for s in g.match if not any(s in m.text for m in messages if not passed_on(m))]
    return groups, unsorted, stale


def passed_on(m: Message) -> bool:
    """A message that is only a prefix and another message, at a site PASS_THROUGH declares."""
    return not m.readable and (m.where.rpartition(":")[0], m.function) in PASS_THROUGH


def _code(text: str) -> str:
    text = " ".join(text.split())
    fence = "``" if "`" in text else "`"
    return f"{fence} {text} {fence}" if fence == "``" else f"`{text}`"


def render() -> str:
    groups, unsorted, _ = sort()
    lines: list[str] = []
    n = sum(len(g.messages) for g in groups)
    lines.append(f"*{n} messages, read from the source of `ln_lightning` when this page was built "
                 "(docs/docgen/troubleshooting.py; the groups and what to do: docs/troubleshooting.yml).*")
    area = None
    for g in groups:
        if not g.messages:
            continue
        if g.area != area:
            area = g.area
            lines += ["", f"## {area}"]
        lines += ["", f"### {g.title}", "", g.do, ""]
        for m in g.messages:
            lines.append(f"- **{m.kind}** {_code(m.text)} <small>({m.where.rpartition(':')[0]}, `{m.function}`)</small>")
    lines += ["", "## Messages passed on", "", "Some sites add a prefix to a message from elsewhere:", ""]
    lines += [f"- {why} <small>({path}, `{fn}`)</small>" for (path, fn), why in PASS_THROUGH.items()]
    if unsorted:
        lines += ["", "## Not sorted yet", ""]
        lines += [f"- **{m.kind}** {_code(m.text)} <small>({m.where})</small>" for m in unsorted]
    return "\n".join(lines) + "\n"
