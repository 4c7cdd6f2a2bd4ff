"""Triton's CPU interpreter (``TRITON_INTERPRET=1``) without the language patching it repeats on every helper call.

The interpreter runs a kernel by patching ``triton.language`` (its builtins become NumPy-backed functions) for the
whole launch: ``GridExecutor.__call__`` patches, runs every program, and restores. But every call of a
``@triton.jit`` helper from inside the kernel (``_cast``, ``_weight``, ``tl.sum``, ...) goes through
``InterpretedFunction.__call__``, which patches the same modules again (``_patch_lang``: ``inspect.getmembers`` over
``triton.language``, ``triton.language.core``, ``math`` and ``tensor``) although nothing was restored in between:
the second patch finds the builtins already replaced and sets the same wrappers again. For the fused norms' kernels,
which call a few helpers per row, that repeat was more than half of the interpreter's time (triton 3.9, the RMSNorm
each-row check of tests/test_norm_triton.py at width 8, 1024 rows: 14.7 CPU s, 6.7 without the repeat).

:func:`skip_repeated_language_patches` makes a helper's call skip ``_patch_lang`` when the running launch has
already patched every language module the helper's globals hold. Anything else goes through Triton's own patching as
before: a helper called outside a launch, or one that sees a language module the launch has not patched yet (e.g.
``tl.sum``, whose module holds ``triton.language.core``; its first call patches it, later ones skip). The kernels,
their arguments and the NumPy arithmetic are untouched: what a test computes is bit for bit what it computed before.

Used by tests/test_norm_triton.py (all its tests run under the interpreter); triton is imported when the function is
called, not with this module, so importing it does not pre-empt ``TRITON_INTERPRET``.
"""

from __future__ import annotations

import threading

_MARK = "_ln_lightning_skips_repeated_patches"


def skip_repeated_language_patches() -> bool:
    """Install the skip in this process (once; later calls do nothing). Returns whether it is installed: False,
    changing nothing, where triton is missing or its interpreter lacks the pieces this relies on (``_patch_lang``,
    ``_LangPatchScope``, ``GridExecutor``)."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    patch_lang = getattr(interpreter, "_patch_lang", None)
    scope_type = getattr(interpreter, "_LangPatchScope", None)
    executor = getattr(interpreter, "GridExecutor", None)
    if patch_lang is None or scope_type is None or not isinstance(executor, type):
        return False
    if getattr(patch_lang, _MARK, False):
        return True

    language = (tl, tl.core)
    local = threading.local()  # per thread: the running launches, innermost last, each with the modules patched in it
    seen: dict = {}  # function -> the language modules its globals hold

    def modules_of(fn) -> frozenset:
        mods = seen.get(fn)
        if mods is None:
            mods = seen[fn] = frozenset(id(v) for v in fn.__globals__.values() if any(v is m for m in language))
        return mods

    def patch_lang_once(fn):
        launches = getattr(local, "launches", None)
        mods = modules_of(fn)
        if launches and mods <= launches[-1]:
            return scope_type()  # nothing changed, nothing to restore
        scope = patch_lang(fn)
        if launches:
            launches[-1].update(mods)
        return scope

    run_grid = executor.__call__

    def run_grid_tracked(self, *args, **kwargs):
        launches = local.__dict__.setdefault("launches", [])
        launches.append(set())
        try:
            return run_grid(self, *args, **kwargs)
        finally:
            launches.pop()

    setattr(patch_lang_once, _MARK, True)
    patch_lang_once.__wrapped__ = patch_lang  # Triton's own (a test compares the two)
    interpreter._patch_lang = patch_lang_once
    executor.__call__ = run_grid_tracked
    return True
