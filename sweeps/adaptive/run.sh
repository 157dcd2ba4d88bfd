#!/bin/sh
# The runs of docs/adaptive.md (run from the repository root): sweeps/adaptive/run.sh [python] [workers]
# A second run skips the trials the results files hold.
#   1. the language model's seed-1 grids (one trial at a time per worker, 1 thread each);
#   2. seeds 2 and 3 at each (method, K)'s contenders, the rates within 5 % of seed 1's best (figures.py seeds);
#   3. the convex MNIST grid, seeds 1-3, stacked;
#   4. the tuned runs' test curves, then docs/adaptive.csv, the tables and docs/adaptive/*.png.
set -e
PY=${1:-python}
WORKERS=${2:-2}
export OMP_NUM_THREADS=1
sweep() { "$PY" -m lit_slowcal sweep "$1" --results "$2" --workers "$WORKERS" --threads 1 --wandb=false; }
for f in lm_adaptive_slowcal lm_local_adamw lm_diloco lm_slowcal; do
  sweep sweeps/adaptive/$f.yaml sweeps/results/adaptive_lm.jsonl
done
"$PY" sweeps/adaptive/figures.py seeds
for f in sweeps/adaptive/seeds/*.yaml; do
  sweep "$f" sweeps/results/adaptive_lm.jsonl
done
"$PY" -m lit_slowcal sweep sweeps/adaptive/mnist_convex.yaml --results sweeps/results/adaptive_mnist.jsonl --wandb=false
"$PY" sweeps/adaptive/figures.py curves
"$PY" sweeps/adaptive/figures.py
