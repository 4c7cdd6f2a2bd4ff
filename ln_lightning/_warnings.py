"""The one warning category of ln_lightning, and how the package warns and logs.

A leaf module (standard library only), so the class can be imported, filtered or raised without
importing Lightning or torch::

    warnings.filterwarnings("error", category=LNLightningWarning)   # every package warning is an error
    warnings.filterwarnings("ignore", category=LNLightningWarning)  # or silence them all
    python -m pytest -W error::ln_lightning.LNLightningWarning      # pytest resolves the category itself
    filterwarnings = ["error::ln_lightning.LNLightningWarning"]     # the same in [tool.pytest.ini_options]

The interpreter's own ``python -W error::ln_lightning.LNLightningWarning`` (or ``PYTHONWARNINGS``) does not work
for an installed package: CPython resolves ``-W`` categories at startup, before site-packages is importable,
and ignores the option ("Invalid -W option ignored: invalid module name: 'ln_lightning'").

Example:
    >>> import warnings
    >>> from ln_lightning import LNLightningWarning
    >>> issubclass(LNLightningWarning, UserWarning)
    True
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     warnings.warn("a package warning", LNLightningWarning)
    >>> caught[0].category.__name__
    'LNLightningWarning'
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

__all__ = ["LNLightningWarning", "LNLightningDeprecationWarning"]


class LNLightningWarning(UserWarning):
    """The category of every warning ln_lightning emits (a :class:`UserWarning` subclass).

    Filter on it to silence the package's warnings, or to turn them into errors, without touching
    other libraries' warnings: ``warnings.filterwarnings("error", category=LNLightningWarning)``, or
    under pytest ``-W error::ln_lightning.LNLightningWarning`` / the ``filterwarnings`` ini option (not
    the interpreter's ``python -W``, which cannot import the package at startup: see the module docstring).
    Being a ``UserWarning``, it is shown by default, and existing filters on ``UserWarning`` still apply to it.
    """

    __module__ = "ln_lightning"


class LNLightningDeprecationWarning(LNLightningWarning, FutureWarning):
    """An option or function that goes in a coming release: an :class:`LNLightningWarning` (so the package's
    filters take it) and a :class:`FutureWarning`, the category Python shows by default for deprecations aimed at
    the people running the code (a plain ``DeprecationWarning`` is hidden outside ``__main__``)."""

    __module__ = "ln_lightning"


# Informational messages go to the "ln_lightning" logger (modules use child loggers, "ln_lightning.plugin",
# ...), so `logging.getLogger("ln_lightning").setLevel(logging.WARNING)` silences them. Shown at INFO by
# default, as Lightning does for its own logger: a handler only when the application configured none.
_logger = logging.getLogger("ln_lightning")
if _logger.level == logging.NOTSET:
    _logger.setLevel(logging.INFO)
if not logging.getLogger().hasHandlers() and not _logger.handlers:
    _logger.addHandler(logging.StreamHandler())
    _logger.propagate = False


# Frames in these packages are not "the user's code": a warning raised inside a Lightning hook is
# attributed to the first frame outside them (the user's `trainer.fit(...)` line, a test, a script).
_LIBRARY_PACKAGES = ("ln_lightning", "lightning", "pytorch_lightning", "lightning_fabric", "lightning_utilities", "torch")


def _library_dirs() -> tuple[str, ...]:
    # Looked up at each warning (they are rare): a namespace imported after the first warning counts too.
    dirs = []
    for name in _LIBRARY_PACKAGES:
        file = getattr(sys.modules.get(name), "__file__", None)
        if file:
            dirs.append(os.path.dirname(os.path.abspath(file)) + os.sep)
    return tuple(dirs)


def _is_import_machinery(filename: str) -> bool:
    return "importlib" in filename and "_bootstrap" in filename  # frames warnings.warn itself does not count


def user_stacklevel() -> int:
    """The `stacklevel` that makes the caller's next `warnings.warn(...)` name the user's frame.

    Counted the way `warnings.warn` counts: from the caller, over frames other than the import machinery.
    """
    dirs = _library_dirs()
    frame, level = sys._getframe(1), 1  # the frame that is about to call warnings.warn
    while True:
        frame = frame.f_back
        while frame is not None and _is_import_machinery(frame.f_code.co_filename):
            frame = frame.f_back
        if frame is None:  # only library frames (e.g. a spawned worker's entry point): name the call site's caller
            return 2
        level += 1
        if not os.path.abspath(frame.f_code.co_filename).startswith(dirs):
            return level


def _is_rank_zero() -> bool:
    # Lightning keeps the process's global rank on lightning_utilities' `rank_zero_only` (one function object
    # shared by lightning.pytorch and pytorch_lightning); read it without importing Lightning.
    utils = sys.modules.get("lightning_utilities.core.rank_zero")
    rank = getattr(getattr(utils, "rank_zero_only", None), "rank", 0)
    return rank == 0


def info(logger: logging.Logger, message: str) -> None:
    """Log `message` at INFO on `logger` (an "ln_lightning..." logger) from global rank 0 only."""
    if _is_rank_zero():
        logger.info(message, stacklevel=2)  # the record names the calling module's line


def warn(message: str, *, rank_zero_only: bool = True) -> None:
    """Emit `message` as an :class:`LNLightningWarning` attributed to the user's code.

    With ``rank_zero_only`` (default) only global rank 0 warns, like Lightning's ``rank_zero_warn``.
    """
    if rank_zero_only and not _is_rank_zero():
        return
    warnings.warn(message, LNLightningWarning, stacklevel=user_stacklevel())  # counted from this frame
