#!/usr/bin/env bash
# Simulate a two-node run on one machine: two processes on 127.0.0.1, one per "node"
# (num_nodes=2, devices=1, accelerator="cpu", strategy="ddp"), training the demo CharLM with
# LNPlacement("pre") and the three monitors. Waits for both, checks both exit 0, that the two
# ranks end with identical weights, and that rank 0 wrote the monitors' TensorBoard scalars.
#
# Lightning reads the cluster layout from the environment, exactly as on real nodes:
#   MASTER_ADDR / MASTER_PORT  the rendezvous (node 0's address and a free port)
#   NODE_RANK                  this node's index (0 or 1)
#   WORLD_SIZE                 total processes (num_nodes * devices)
#   LOCAL_RANK                 the process's index on its node (0: one device per node)
#
# Usage: bash examples/simulate_two_nodes.sh [--quick] [--out DIR]
#   --quick   3 training steps (CI smoke test); default 30
#   --out     output folder (default outputs/simulate_two_nodes)
set -euo pipefail

STEPS=30
OUT=outputs/simulate_two_nodes
while [[ $# -gt 0 ]]; do
  case "$1" in
    --quick) STEPS=3; shift ;;
    --out) OUT="$2"; shift 2 ;;
    --steps) STEPS="$2"; shift 2 ;;
    *) echo "simulate_two_nodes.sh: unknown argument $1 (use --quick, --out DIR, --steps N)" >&2; exit 2 ;;
  esac
done
PYTHON="${PYTHON:-python}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
rm -rf "$OUT/tb" "$OUT"/node*.log "$OUT"/rank*.json

# The training script every node runs (as you would put it in a file of your own).
cat > "$OUT/train_node.py" <<'PY'
import json, os, sys, warnings
import torch
import lightning as L
from lightning.pytorch.loggers import TensorBoardLogger
from ln_lightning import LNPlacement
from ln_lightning.callbacks import ClipAttributionMonitor, LayerNormInputMonitor, StreamNormMonitor
from ln_lightning.demo.lightning import CharDataModule, CharLM

warnings.filterwarnings("ignore", ".*does not have many workers.*")
out, steps = sys.argv[1], int(sys.argv[2])
torch.set_num_threads(1)
L.seed_everything(0, verbose=False)
model = CharLM(n_layers=2, d_model=32, n_heads=2, block_size=32)
data = CharDataModule(block_size=32, batch_size=8, max_chars=50_000)
trainer = L.Trainer(
    accelerator="cpu", devices=1, num_nodes=2, strategy="ddp", max_steps=steps,
    plugins=[LNPlacement("pre", fused=False)],
    callbacks=[StreamNormMonitor(), LayerNormInputMonitor(), ClipAttributionMonitor()],
    gradient_clip_val=1.0, log_every_n_steps=1, limit_val_batches=0,
    logger=TensorBoardLogger(os.path.join(out, "tb"), name="two_nodes", version=""),
    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
)
trainer.fit(model, datamodule=data)
flat = torch.cat([p.detach().flatten() for p in model.parameters()])
record = {"global_rank": trainer.global_rank, "node_rank": trainer.node_rank, "world_size": trainer.world_size,
          "global_step": trainer.global_step, "n_params": flat.numel(), "param_sum": flat.double().sum().item(),
          "param_sq": flat.double().square().sum().item(), "placement": LNPlacement.applied_config(model)}
with open(os.path.join(out, f"rank{trainer.global_rank}.json"), "w") as f:
    json.dump(record, f)
print(record)
PY

PORT="$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
echo "simulating 2 nodes on 127.0.0.1:$PORT, $STEPS steps, output in $OUT"
PIDS=()
for NODE in 0 1; do
  env MASTER_ADDR=127.0.0.1 MASTER_PORT="$PORT" NODE_RANK="$NODE" WORLD_SIZE=2 LOCAL_RANK=0 \
    PYTHONWARNINGS=ignore "$PYTHON" "$OUT/train_node.py" "$OUT" "$STEPS" > "$OUT/node$NODE.log" 2>&1 &
  PIDS+=($!)
done

STATUS=0
for NODE in 0 1; do
  if wait "${PIDS[$NODE]}"; then
    echo "node $NODE: exit 0"
  else
    CODE=$?
    echo "node $NODE: FAILED with exit $CODE; last lines of $OUT/node$NODE.log:" >&2
    tail -n 40 "$OUT/node$NODE.log" >&2
    STATUS=1
  fi
done
[[ $STATUS -eq 0 ]] || exit 1

# Both ranks trained the same rewritten model in lockstep; rank 0 logged the monitors.
"$PYTHON" - "$OUT" <<'PY'
import glob, json, os, sys
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

out = sys.argv[1]
recs = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in (0, 1)]
assert [r["node_rank"] for r in recs] == [0, 1] and all(r["world_size"] == 2 for r in recs), recs
assert recs[0]["param_sum"] == recs[1]["param_sum"] and recs[0]["param_sq"] == recs[1]["param_sq"], "ranks diverged"
assert all(r["placement"] and r["placement"]["placement"] == "pre" for r in recs), recs
acc = EventAccumulator(os.path.join(out, "tb", "two_nodes"), size_guidance={"scalars": 0})
acc.Reload()
tags = acc.Tags()["scalars"]
families = {f: sorted(t for t in tags if t.startswith(f)) for f in ("stream/rms/", "ln/amp_max/", "clip/total_norm")}
missing = [f for f, ts in families.items() if not ts]
assert not missing, f"no {missing} scalars in rank 0's TensorBoard log ({len(tags)} tags: {tags[:10]})"
norm = acc.Scalars("clip/total_norm")
lines = [
    "# simulate_two_nodes: 2 processes as 2 nodes on 127.0.0.1 (ddp, CPU)",
    "",
    f"- both nodes exited 0; world_size {recs[0]['world_size']}, {recs[0]['global_step']} steps",
    f"- identical weights on both ranks after training: sum {recs[0]['param_sum']:.6f}, sum of squares {recs[0]['param_sq']:.6f} ({recs[0]['n_params']} parameters)",
    f"- placement recorded on both ranks: {recs[0]['placement']}",
    f"- rank 0 TensorBoard: {len(tags)} scalars; {len(families['stream/rms/'])} stream/rms, {len(families['ln/amp_max/'])} ln/amp_max; "
    f"clip/total_norm at step {norm[-1].step}: {norm[-1].value:.4g}",
]
open(os.path.join(out, "results.md"), "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PY
