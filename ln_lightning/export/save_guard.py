"""A converted Hugging Face model's own ``save_pretrained``: it writes what ``ln_lightning.save_pretrained`` writes.

Users call ``model.save_pretrained(directory)`` out of habit, and so do Hugging Face's ``Trainer`` and
``push_to_hub``. On a converted model the class's method would write the weights and a ``config.json`` that
Hugging Face loads as the old function. The rewrite state (``placement.state.attach``) therefore gives each
Hugging Face model that holds part of a rewrite an instance attribute ``save_pretrained`` (this class), which
writes the safe form (``export.directory``); the class is untouched, so other instances save as before.
``placement.state.detach`` takes it away again.
"""

from __future__ import annotations

from torch import nn

from ln_lightning.export import directory

ATTR = "save_pretrained"


class SavePretrained:
    """``model.save_pretrained(save_directory, **kwargs)`` for a converted Hugging Face model (see the module doc).

    ``native=`` as for ``ln_lightning.save_pretrained``; the other keyword arguments go to Hugging Face's.
    """

    def __init__(self, model: nn.Module, state, base: str):
        self.model, self.state, self.base = model, state, base

    def __call__(self, save_directory, **kwargs):
        return directory.write(self.model, save_directory, self.state, self.base, **kwargs)

    def __repr__(self) -> str:
        return f"<ln_lightning save_pretrained of the converted {type(self.model).__name__}>"


def _holds_part(path: str, state) -> bool:
    inside = [p for p, _ in state.converted] + list(state.added)
    return any(not path or p == path or p.startswith(path + ".") for p in inside)


def install(root: nn.Module, state) -> None:
    """Give every Hugging Face model in `root` holding part of `state`'s rewrite the safe ``save_pretrained``."""
    for path, module in root.named_modules():
        if directory.is_hf_model(module) and _holds_part(path, state):
            module.__dict__[ATTR] = SavePretrained(module, state, path)
        elif isinstance(module.__dict__.get(ATTR), SavePretrained):
            del module.__dict__[ATTR]


def uninstall(root: nn.Module) -> None:
    for module in root.modules():
        if isinstance(module.__dict__.get(ATTR), SavePretrained):
            del module.__dict__[ATTR]


__all__ = ["SavePretrained", "install", "uninstall"]
