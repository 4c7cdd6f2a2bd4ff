import sys, math
import os
import screen
seed = int(sys.argv[1]); which = sys.argv[2]
os.makedirs(screen.LOG_DIR, exist_ok=True)
log = f"{screen.LOG_DIR}/exp2_{which}_seed{seed}.jsonl"
R = dict(path="rescaled")
cos = lambda T: screen.uniform(lambda s: 0.5 * (1 - math.cos(math.pi * min(1.0, s / T))))
sq = lambda T: screen.uniform(lambda s: math.sqrt(min(1.0, s / T)))
if which == "a":
    screen.run(seed, "rescaled_cos700", cos(700), log=log, **R)
    screen.run(seed, "rescaled_sqrt700", sq(700), log=log, **R)
    screen.run(seed, "rescaled_hard", screen.linear(1), log=log, **R)
else:
    screen.run(seed, "rescaled_lin400_distill1", screen.linear(400), distill=1.0, log=log, **R)
    screen.run(seed, "rescaled_lin700_distill1", screen.linear(700), distill=1.0, log=log, **R)
    screen.run(seed, "rescaled_lin400_lr3e-4", screen.linear(400), lr_fn=lambda s: 3e-4 if s < 400 else 1e-4, log=log, **R)
