"""Whether the model a Trainer fits is in a placement transition: the one thing the dashboard asks about a rewrite.

Read from the model's own rewrite state (``ln_lightning.placement.state``), which says so whoever started the
transition (``LNPlacement(transition_steps=N)``, a checkpoint loaded mid-transition); the monitors import nothing
of the plugin or of its Trainer patch.
"""

from __future__ import annotations

from typing import Any

from ln_lightning.placement import state as rewrite_state


def placement_transition_configured(trainer: Any) -> bool:
    """True when the LightningModule the Trainer runs is in a placement transition."""
    module = getattr(trainer, "lightning_module", None)
    found = rewrite_state.find(module) if module is not None else None
    return found is not None and found[0].transition is not None
