"""Training monitors for residual-stream models, logged to the trainer's loggers (TensorBoard first).

- `StreamNormMonitor`: residual-stream rms and each block's relative update, per block.
- `LayerNormInputMonitor`: each LayerNorm's input variance (mean, min) and its amplification 1/sqrt(var+eps).
- `ClipAttributionMonitor`: the gradient norm clipping acts on, its share per parameter group, how often
  clipping fires, the clip coefficient and each group's gradient norm after clipping (starvation warning).
- `SpikeMonitor`: loss and pre-clip gradient-norm spikes, judged on the device every step, each recorded (one
  JSON line) with the groups and blocks it came from; optionally skips the step or checkpoints before it.

All of them log at the steps, and under the step numbers, of Lightning's own `self.log` (automatic or manual
optimisation, gradient accumulation, resumed fits), reduce across ranks exactly (sums and counts, then
divide; min/max), make at most one host synchronisation per logging step each and none on other steps (SpikeMonitor: one more
at the end of the fit; with an `on_spike` action, one per step),
leave no hook or state behind when a fit ends or fails, and add a shared TensorBoard custom-scalars layout
(`ln_lightning.callbacks.dashboard`). They need neither `LNPlacement` nor its Trainer patch.
"""

from ln_lightning.callbacks.clip import ClipAttributionMonitor
from ln_lightning.callbacks.layernorm import LayerNormInputMonitor
from ln_lightning.callbacks.spike import SpikeMonitor
from ln_lightning.callbacks.stream import StreamNormMonitor

__all__ = ["StreamNormMonitor", "LayerNormInputMonitor", "ClipAttributionMonitor", "SpikeMonitor"]
