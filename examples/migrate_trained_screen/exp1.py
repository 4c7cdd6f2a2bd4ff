import sys
import os
import screen
seed = int(sys.argv[1]); which = sys.argv[2]
os.makedirs(screen.LOG_DIR, exist_ok=True)
log = f"{screen.LOG_DIR}/exp1_{which}_seed{seed}.jsonl"
if which == "a":
    screen.run(seed, "unchanged", screen.uniform(lambda s: 0.0), log=log)
    for T in (400, 1000):
        screen.run(seed, f"rescaled_lin{T}", screen.linear(T), path="rescaled", log=log)
else:
    screen.run(seed, "plain_lin400", screen.linear(400), log=log)
    for T in (200, 700):
        screen.run(seed, f"rescaled_lin{T}", screen.linear(T), path="rescaled", log=log)
