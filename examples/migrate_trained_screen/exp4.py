import sys, random
import os
import screen
seed = int(sys.argv[1]); which = sys.argv[2]
os.makedirs(screen.LOG_DIR, exist_ok=True)
log = f"{screen.LOG_DIR}/exp4_{which}_seed{seed}.jsonl"
R = dict(path="rescaled")
def lookahead():
    def f(step, a, af):
        if a[0] < 1.0:
            u = random.Random(step * 7919 + 1).random()
            b = a[0] + (1 - a[0]) * u
            return [b] * len(a), b
        return a, af
    return f
if which == "a":
    screen.run(seed, "rescaled_lin700_antic0.5", screen.linear(700), step_blend_fn=screen.anticipate(0.5), log=log, **R)
    screen.run(seed, "rescaled_lin700_lookahead", screen.linear(700), step_blend_fn=lookahead(), log=log, **R)
else:
    screen.run(seed, "rescaled_lin700_antic0.25_distill1", screen.linear(700), step_blend_fn=screen.anticipate(0.25), distill=1.0, log=log, **R)
    screen.run(seed, "rescaled_lin1000_antic0.25", screen.linear(1000), step_blend_fn=screen.anticipate(0.25), log=log, **R)
