"""Whether the Trainer runs an `LNPlacement` transition: the one thing the dashboard asks about the plugin.

Read by duck typing, so that the monitors import nothing of the plugin or of its Trainer patch: an object whose
class is named `LNPlacement` (in either Lightning namespace), given as the Trainer's plugin or among its callbacks,
with `transition_steps` set. Kept to this one function so that it can become a reader of the model's own rewrite
state without touching the dashboard.
"""

from __future__ import annotations

from typing import Any

from ln_lightning.callbacks._lightning_internals import layer_sync_plugin


def placement_transition_configured(trainer: Any) -> bool:
    """True when the Trainer holds an `LNPlacement(transition_steps=N)`."""
    candidates = [layer_sync_plugin(trainer), *trainer.callbacks]
    return any(type(c).__name__ == "LNPlacement" and getattr(c, "transition_steps", None) for c in candidates)
