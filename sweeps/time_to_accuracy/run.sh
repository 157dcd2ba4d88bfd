#!/bin/sh
# The runs of docs/time_to_accuracy.md (run from the repository root): sweeps/time_to_accuracy/run.sh [python]
# A second run skips the trials the results files hold.
set -e
PY=${1:-python}
for f in slowcal local_sgd minibatch_sgd scaffold ddp diloco; do
  "$PY" -m lit_slowcal sweep sweeps/time_to_accuracy/mnist_$f.yaml --results sweeps/results/time_to_accuracy_mnist.jsonl --wandb=false
done
for f in slowcal local_sgd minibatch_sgd scaffold ddp diloco; do
  "$PY" -m lit_slowcal sweep sweeps/time_to_accuracy/cnn_$f.yaml --results sweeps/results/time_to_accuracy_cnn.jsonl --wandb=false
done
