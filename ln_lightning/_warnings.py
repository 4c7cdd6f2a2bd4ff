"""The one warning category of ln_lightning.

A leaf module (standard library only), so the class can be imported, filtered or raised without
importing Lightning or torch::

    python -W error::ln_lightning.LNLightningWarning -m pytest     # every package warning is an error
    warnings.filterwarnings("ignore", category=LNLightningWarning)  # or silence them all

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

__all__ = ["LNLightningWarning"]


class LNLightningWarning(UserWarning):
    """The category of every warning ln_lightning emits (a :class:`UserWarning` subclass).

    Filter on it to silence the package's warnings, or to turn them into errors, without touching
    other libraries' warnings: ``python -W error::ln_lightning.LNLightningWarning``, or
    ``warnings.filterwarnings("error", category=LNLightningWarning)``. Being a ``UserWarning``,
    it is shown by default, and existing filters on ``UserWarning`` still apply to it.
    """

    __module__ = "ln_lightning"
