#!/bin/sh
# The runs of docs/communication.md (run from the repository root): sweeps/communication/run.sh [python]
# A second run skips the trials the results files hold.
set -e
PY=${1:-python}
for f in main_exact main_compressed main_codes mnist_slowcal_exact mnist_slowcal_compressed mnist_local_sgd_exact \
    mnist_local_sgd_compressed mnist_diloco_exact mnist_diloco_compressed; do
  "$PY" -m lit_slowcal sweep sweeps/communication/$f.yaml --results sweeps/results/communication_mnist.jsonl --wandb=false
done
for f in slowcal local_sgd; do
  for v in exact int8 overlap; do
    "$PY" -m lit_slowcal sweep sweeps/communication/cnn_${f}_$v.yaml --results sweeps/results/communication_cnn.jsonl --wandb=false
  done
done
