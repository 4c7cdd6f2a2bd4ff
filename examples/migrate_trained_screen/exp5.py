import sys
import os
import screen
seed = int(sys.argv[1]); which = sys.argv[2]
os.makedirs(screen.LOG_DIR, exist_ok=True)
log = f"{screen.LOG_DIR}/exp5_{which}_seed{seed}.jsonl"
R = dict(path="rescaled")
if which == "a":
    screen.run(seed, "unchanged", screen.uniform(lambda s: 0.0), log=log)
    screen.run(seed, "rescaled_lin400_antic0.25", screen.linear(400), step_blend_fn=screen.anticipate(0.25), log=log, **R)
    screen.run(seed, "rescaled_lin700_antic0.5", screen.linear(700), step_blend_fn=screen.anticipate(0.5), log=log, **R)
else:
    screen.run(seed, "rescaled_lin400", screen.linear(400), log=log, **R)
    screen.run(seed, "rescaled_lin700_antic0.25_distill1", screen.linear(700), step_blend_fn=screen.anticipate(0.25), distill=1.0, log=log, **R)
    screen.run(seed, "rescaled_lin400_distill1", screen.linear(400), distill=1.0, log=log, **R)
