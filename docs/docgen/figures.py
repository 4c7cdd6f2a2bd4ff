"""Measured figures in the docs come from results files: `{{ ... }}` placeholders and the rule that checks prose.

A placeholder is a small expression over the results files, then an optional Python format spec:

    {{ results.migrate_trained.summary.hard.eval_peak_excess | +.2f }}
    {{ max(values(results.depth_scaling.analysis.pre_depth.final_rms_by_depth)) | .3f }}
    {{ results.depth_scaling.analysis.pre.var_linear.slope / results.depth_scaling.analysis.pre_c05.var_linear.slope | .1f }}
    {{ tables.bench_norm_layernorm }}

`results.NAME` is the JSON file SOURCES names; `.key` or `["key"]` reads a dict, `[i]` a list. Allowed:
numbers, strings, + - * / **, unary minus, comparisons, `and` / `or`, one-loop comprehensions
(`mean(r.final_loss for r in results.warmup_study.runs if r.config == "post")`) and the functions in FUNCTIONS. `tables.NAME` is a
markdown table rendered from results files by docs/docgen/tables.py. Anything else, a missing file
or key, or a value the format can't take, raises, so `mkdocs build --strict` fails on it. Placeholders
in fenced or inline code are left as they are (that is how a page can show the syntax).

The rule for prose (`bare_figures`): outside code, placeholders, links and HTML comments, a number with
a decimal point or an exponent, a percentage, a factor (`1.3x`, `2×`) or a number with a unit of time,
size or rate is a measured figure typed by hand, and fails tests/test_docs_figures.py. Integers without
a unit (layers, steps, widths, seeds) are configuration and pass; so do version numbers after a
package's name (`Lightning 2.5`), and literals in inline code (`eps=1e-5`, a threshold the code uses).
"""

from __future__ import annotations

import ast
import json
import math
import re
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable

DOCS = Path(__file__).resolve().parents[1]
RESULTS = DOCS / "results"

# name -> results file (relative to docs/). Each is written by the command in its comment.
SOURCES: dict[str, str] = {
    # examples/*.py (full mode, --out docs/results/NAME)
    "depth_scaling": "results/depth_scaling/results.json",
    "warmup_study": "results/warmup_study/results.json",
    "warmup_study_lr1e_2": "results/warmup_study_lr1e-2/results.json",
    # examples/warmup_study.py --configs post pre pre+lns deepnorm --layers 24 (issue 34: the depth-aware forms)
    "depth_placements": "results/depth_placements/results.json",
    "layernorm_jacobian": "results/layernorm_jacobian/results.json",
    "migrate_post_norm": "results/migrate_post_norm/results.json",
    "migrate_trained": "results/migrate_trained/results.json",
    "migrate_trained_screen": "results/migrate_trained_screen/results.json",
    # examples/migrate_trained.py --arms unchanged plugin_400 plugin_700 plugin_plain_400 --no-why --out docs/results/migrate_trained_plugin
    "migrate_trained_plugin": "results/migrate_trained_plugin/results.json",
    # examples/migrate_suite.py (--out outputs/migrate_suite; its results.json and results.md copied here)
    "migrate_suite": "results/migrate_suite/results.json",
    # examples/migrate_suite/drift_positions.py (on the suite's pretrained checkpoints; writes here itself)
    "migrate_drift_positions": "results/migrate_drift_positions/results.json",
    # examples/migrate_why_depth.py (full mode copies its results.json and results.md here)
    "migrate_why_depth": "results/migrate_why_depth/results.json",
    # benchmarks/*.py (--json / --out)
    "bench_convert": "results/bench_convert/results.json",
    "bench_transition": "results/bench_transition/results.json",
    "bench_monitors": "results/bench_monitors/results.json",
    # benchmarks/bench_exact_rewrites.py --json docs/results/bench_exact_rewrites/runN.json (two runs, one after the other)
    "bench_exact_rewrites_run1": "results/bench_exact_rewrites/run1.json",
    "bench_exact_rewrites_run2": "results/bench_exact_rewrites/run2.json",
    "bench_norm_cpu_threads1": "results/bench_norm/cpu_threads1.json",
    "bench_norm_cpu_threads2": "results/bench_norm/cpu_threads2.json",
    "bench_norm_rms_cpu_run1": "results/bench_norm/rms_cpu_run1.json",
    "bench_norm_rms_cpu_run2": "results/bench_norm/rms_cpu_run2.json",
    "triton_aot": "results/triton_aot/ci_subset.json",
    # docs/docgen/depth_images.py (the depth-profile images in docs/img/depth/)
    "depth_images": "img/depth/provenance.json",
}

PLACEHOLDER = re.compile(r"\{\{\s*(.+?)\s*\}\}", re.S)


class FigureError(ValueError):
    """A placeholder that does not resolve: the message names it and why."""


LOADED: set[str] = set()  # the sources read so far (the tests check every source is used)


@lru_cache(maxsize=None)
def load(name: str) -> Any:
    LOADED.add(name)
    if name not in SOURCES:
        raise FigureError(f"no results source {name!r}; known: {', '.join(sorted(SOURCES))} (docs/docgen/figures.py SOURCES)")
    path = DOCS / SOURCES[name]
    if not path.is_file():
        raise FigureError(f"results source {name!r}: {path.relative_to(DOCS.parent)} does not exist (run the command that writes it)")
    return json.loads(path.read_text(encoding="utf-8"))


class _Node:
    """A value read from a results file, with the path it came from (for error messages)."""

    def __init__(self, value: Any, where: str):
        self.value, self.where = value, where

    def get(self, key: Any) -> "_Node":
        v = self.value
        try:
            if isinstance(v, dict):
                if key not in v and isinstance(key, int) and str(key) in v:
                    key = str(key)  # JSON keys are strings: by_depth[128]
                return _Node(v[key], f"{self.where}[{key!r}]")
            if isinstance(v, list) and isinstance(key, int):
                return _Node(v[key], f"{self.where}[{key}]")
        except (KeyError, IndexError):
            pass
        keys = f"; keys: {', '.join(map(str, list(v)[:30]))}" if isinstance(v, dict) else ""
        raise FigureError(f"{self.where} has no {key!r}{keys}")


class _Results:
    def get(self, name: str) -> _Node:
        return _Node(load(name), f"results.{name}")


def _mean(xs):
    xs = list(xs)
    return sum(xs) / len(xs)


FUNCTIONS: dict[str, Callable] = {
    "min": min, "max": max, "abs": abs, "len": len, "sum": sum, "sqrt": math.sqrt, "mean": _mean, "round": round,
    "values": lambda d: list(d.values()), "keys": lambda d: list(d.keys()),
}
_BINOPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
           ast.Div: lambda a, b: a / b, ast.Pow: lambda a, b: a ** b}
_CMPOPS = {ast.Lt: lambda a, b: a < b, ast.LtE: lambda a, b: a <= b, ast.Gt: lambda a, b: a > b,
           ast.GtE: lambda a, b: a >= b, ast.Eq: lambda a, b: a == b, ast.NotEq: lambda a, b: a != b}


def _value(x):
    return x.value if isinstance(x, _Node) else x


def _items(x):
    """Iterate a list read from a results file as nodes (so `r.key` works on each item)."""
    if isinstance(x, _Node) and isinstance(x.value, list):
        return [_Node(v, f"{x.where}[{i}]") for i, v in enumerate(x.value)]
    if isinstance(x, _Node) and isinstance(x.value, dict):
        return [_Node(v, f"{x.where}[{k!r}]") for k, v in x.value.items()]
    if isinstance(x, list):
        return x
    raise FigureError(f"can't iterate a {type(_value(x)).__name__}")


class Evaluator:
    """Evaluates placeholder expressions; counts what it resolved (figures and tables) per source."""

    def __init__(self, tables: Any = None):
        self.tables = tables
        self._scope: dict[str, Any] = {}  # a comprehension's loop variable
        self.used: dict[str, int] = {}
        self.figures = 0
        self.tables_rendered = 0

    def _eval(self, node: ast.AST):
        if isinstance(node, ast.Expression):
            return self._eval(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float, str)):
            return node.value
        if isinstance(node, ast.Name):
            if node.id in self._scope:
                return self._scope[node.id]
            if node.id == "results":
                return _Results()
            if node.id in ("True", "False", "None"):
                return {"True": True, "False": False, "None": None}[node.id]
            raise FigureError(f"unknown name {node.id!r} (use results.NAME..., tables.NAME or a function call)")
        if isinstance(node, (ast.GeneratorExp, ast.ListComp)) and len(node.generators) == 1:
            gen = node.generators[0]
            if not isinstance(gen.target, ast.Name) or gen.is_async:
                raise FigureError(f"not allowed in a placeholder: {ast.unparse(node)!r}")
            out = []
            for item in _items(self._eval(gen.iter)):
                self._scope[gen.target.id] = item
                try:
                    if all(_value(self._eval(c)) for c in gen.ifs):
                        out.append(_value(self._eval(node.elt)))
                finally:
                    del self._scope[gen.target.id]
            return out
        if isinstance(node, ast.BoolOp):
            vals = [_value(self._eval(v)) for v in node.values]
            return all(vals) if isinstance(node.op, ast.And) else any(vals)
        if isinstance(node, ast.Attribute):
            if isinstance(node.value, ast.Name) and node.value.id == "tables":
                if self.tables is None:
                    raise FigureError("tables are not available here")
                self.tables_rendered += 1
                return self.tables.render(node.attr)
            base = self._eval(node.value)
            if isinstance(base, _Results):
                self.used[node.attr] = self.used.get(node.attr, 0) + 1
                return base.get(node.attr)
            if isinstance(base, _Node):
                return base.get(node.attr)
            raise FigureError(f"can't read .{node.attr} of a {type(base).__name__}")
        if isinstance(node, ast.Subscript):
            base = self._eval(node.value)
            key = _value(self._eval(node.slice))
            if isinstance(base, _Node):
                return base.get(key)
            raise FigureError(f"can't index a {type(base).__name__}")
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            return _BINOPS[type(node.op)](_value(self._eval(node.left)), _value(self._eval(node.right)))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -_value(self._eval(node.operand))
        if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _CMPOPS:
            return _CMPOPS[type(node.ops[0])](_value(self._eval(node.left)), _value(self._eval(node.comparators[0])))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in FUNCTIONS and not node.keywords:
            args = [a for a in node.args]
            if len(args) == 1 and isinstance(args[0], ast.GeneratorExp):
                return FUNCTIONS[node.func.id](self._eval(args[0]))
            return FUNCTIONS[node.func.id](*[_value(self._eval(a)) for a in args])
        raise FigureError(f"not allowed in a placeholder: {ast.unparse(node)!r}")

    def evaluate(self, text: str) -> str:
        """`EXPR` or `EXPR | FORMAT` -> the formatted value."""
        expr, _, spec = text.partition(" | ")
        expr, spec = expr.strip(), spec.strip()
        try:
            tree = ast.parse(expr, mode="eval")
        except SyntaxError as err:
            raise FigureError(f"{{{{ {text} }}}}: not an expression ({err.msg})") from None
        try:
            value = _value(self._eval(tree))
        except FigureError as err:
            raise FigureError(f"{{{{ {text} }}}}: {err}") from None
        if isinstance(tree.body, ast.Attribute) and isinstance(tree.body.value, ast.Name) and tree.body.value.id == "tables":
            return value  # a rendered table
        if isinstance(value, (dict, list)) or value is None:
            raise FigureError(f"{{{{ {text} }}}}: is a {type(value).__name__}, not a figure; read one value from it")
        try:
            out = format(value, spec) if spec else str(value)
        except (ValueError, TypeError) as err:
            raise FigureError(f"{{{{ {text} }}}}: format {spec!r} of {value!r}: {err}") from None
        self.figures += 1
        return out


# ------------------------------------------------------------------ markdown: code spans, placeholders, prose

FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})")


def split_fenced(markdown: str) -> list[tuple[bool, str]]:
    """[(is_code, text)] in order: fenced code blocks (with their fences) and everything between."""
    out: list[tuple[bool, str]] = []
    buf: list[str] = []
    fence = None
    for line in markdown.splitlines(keepends=True):
        m = FENCE.match(line)
        if fence is None and m:
            if buf:
                out.append((False, "".join(buf)))
            buf, fence = [line], m.group(2)[0] * len(m.group(2))
        elif fence is not None and line.strip().startswith(fence) and line.strip().strip(fence[0]) == "":
            buf.append(line)
            out.append((True, "".join(buf)))
            buf, fence = [], None
        else:
            buf.append(line)
    if buf:
        out.append((fence is not None, "".join(buf)))
    return out


INLINE_CODE = re.compile(r"(`+)(.+?)\1", re.S)


def resolve(markdown: str, evaluator: Evaluator) -> str:
    """Replace every placeholder outside code with its value."""
    parts = []
    for is_code, text in split_fenced(markdown):
        if is_code:
            parts.append(text)
            continue
        pieces, last = [], 0
        for m in INLINE_CODE.finditer(text):
            pieces.append(PLACEHOLDER.sub(lambda p: evaluator.evaluate(p.group(1)), text[last:m.start()]))
            pieces.append(m.group(0))
            last = m.end()
        pieces.append(PLACEHOLDER.sub(lambda p: evaluator.evaluate(p.group(1)), text[last:]))
        parts.append("".join(pieces))
    return "".join(parts)


def placeholders(markdown: str) -> list[str]:
    """The placeholder expressions outside code, in order."""
    found = []
    for is_code, text in split_fenced(markdown):
        if not is_code:
            found += [m.group(1) for m in PLACEHOLDER.finditer(INLINE_CODE.sub("", text))]
    return found


# The prose rule. What is removed before looking: code, placeholders, HTML comments, link and image
# targets, and version numbers after a package's name.
_HTML_COMMENT = re.compile(r"<!--.*?-->", re.S)
_LINK_TARGET = re.compile(r"\]\([^)]*\)")
_VERSION = re.compile(
    r"\b(?:Lightning|lightning|pytorch_lightning|PyTorch|torch|Python|triton|Triton|transformers|CUDA|mkdocs|format|version)"
    r"\s+v?\d+(?:\.\d+)*(?:\.x)?(?:(?:\s*(?:and|or|to|,|/)\s*)v?\d+(?:\.\d+)*(?:\.x)?)*"
)
_UNIT = r"(?:%|x\b|×|\s?(?:s|ms|µs|us|ns|min|minutes?|seconds?|hours?|h|MB|GB|GiB|MiB|KB|TB/s|GB/s|B)\b)"
MEASURED = re.compile(
    r"(?<![\w.-])[-+−]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)(?![\w.])"  # 1e-5, 4.6e-2
    r"|(?<![\w.-])[-+−]?\d+\.\d+(?![\w.])(?!\.\d)"  # 0.986, +0.26 (not Apache-2.0)
    r"|(?<![\w.-])[-+−]?\d+(?:\.\d+)?" + _UNIT  # 27%, 1.08x, 30 s, 12.6 min, 537 MB
)


def bare_figures(markdown: str) -> list[tuple[int, str, str]]:
    """[(line number, figure, line)] of hand-typed measured figures in the prose of a page."""
    hits = []
    line_no = 1
    def blank(m):  # keep the line count: code spans and comments may run over several lines
        return " " + "\n" * m.group(0).count("\n")

    for is_code, text in split_fenced(markdown):
        if not is_code:
            clean = _HTML_COMMENT.sub(blank, text)
            clean = PLACEHOLDER.sub(blank, clean)
            clean = INLINE_CODE.sub(blank, clean)
            original = text.splitlines()
            for i, line in enumerate(clean.splitlines()):
                prose = _LINK_TARGET.sub("]", line)
                prose = _VERSION.sub(" ", prose)
                prose = re.sub(r"<[^>]+>", " ", prose)  # HTML tags' attributes
                for m in MEASURED.finditer(prose):
                    hits.append((line_no + i, m.group(0).strip(), original[i].strip() if i < len(original) else line))
        line_no += text.count("\n")
    return hits
