import sys
import os
import screen
seed = int(sys.argv[1]); which = sys.argv[2]
os.makedirs(screen.LOG_DIR, exist_ok=True)
log = f"{screen.LOG_DIR}/exp3_{which}_seed{seed}.jsonl"
R = dict(path="rescaled")
if which == "a":
    screen.run(seed, "rescaled_lin700_snap", screen.linear(700), save_at=(350, 560, 630, 690, 700, 760), log=log, **R)
    screen.run(seed, "rescaled_lin400_antic0.25", screen.linear(400), step_blend_fn=screen.anticipate(0.25), log=log, **R)
else:
    screen.run(seed, "rescaled_lin700_antic0.25", screen.linear(700), step_blend_fn=screen.anticipate(0.25), log=log, **R)
    screen.run(seed, "rescaled_lin400_distill3", screen.linear(400), distill=3.0, log=log, **R)
