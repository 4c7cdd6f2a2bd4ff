"""The transition of a trained model between placements: the blend the model holds, its schedule and closed loop, the distillation teacher."""
