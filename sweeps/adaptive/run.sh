#!/bin/sh
# The language-model grid of docs/adaptive.md (run from the repository root), one trial at a time per worker:
#   sweeps/adaptive/run.sh [python] [workers]
# A second run skips the trials the results file holds. Then:
#   python -m lit_slowcal tune sweeps/results/adaptive_lm.jsonl --criterion train_loss
set -e
PY=${1:-python}
WORKERS=${2:-1}
export OMP_NUM_THREADS=1
for f in lm_adaptive_slowcal lm_slowcal lm_diloco lm_local_adamw; do
  "$PY" -m lit_slowcal sweep sweeps/adaptive/$f.yaml --results sweeps/results/adaptive_lm.jsonl --workers "$WORKERS" --threads 1 --wandb=false
done
