#!/bin/sh
# The non-convex grid of docs/nonconvex.md, one trial at a time on one thread (run from the repository root):
#   sweeps/nonconvex/run.sh [python]
# A second run skips the trials the results files hold.
set -e
PY=${1:-python}
export OMP_NUM_THREADS=1
for f in local minibatch diloco scaffold_low; do
  "$PY" -m lit_slowcal sweep sweeps/nonconvex/$f.yaml --results sweeps/results/nonconvex.jsonl --workers 1 --threads 1 --wandb=false
done
for f in participation_local participation_minibatch participation_diloco; do
  "$PY" -m lit_slowcal sweep sweeps/nonconvex/$f.yaml --results sweeps/results/nonconvex_participation.jsonl --workers 1 --threads 1 --wandb=false
done
