#!/bin/sh
# The runs of docs/communication.md's "Fewer bytes" section (run from the repository root):
#   sweeps/communication/run_codes.sh [python]
# One process, one thread (the host's two cores are shared); a second run skips the trials the results hold.
# In order of need, so that a run cut short keeps the most: MNIST's stacked cells, error feedback off (M = K = 64,
# stacked), MNIST's one-at-a-time seed-1 grids and their seeds 2-3, the language model at K = 16, the state_every
# cells, K = 64, error feedback off one at a time, the rates beyond a grid's edge, the main job's codes.
set -e
PY=${1:-python}
export OMP_NUM_THREADS=1
R=sweeps/results/communication_codes.jsonl
D=sweeps/communication/codes
sweep() { for f in "$@"; do nice -n 5 "$PY" -m lit_slowcal sweep "$D/$f.yaml" --results $R --workers 1 --threads 1 --wandb=false; done; }
"$PY" sweeps/communication/codes.py plan
sweep mnist16_slowcal mnist64_slowcal mnist16_adaptive_slowcal mnist64_adaptive_slowcal
sweep mnist64_slowcal_noef mnist64_adaptive_slowcal_noef
sweep mnist64_local_adamw mnist64_diloco mnist16_local_adamw mnist16_diloco
"$PY" sweeps/communication/codes.py seeds
sweep $(cd $D && ls mnist*_seeds.yaml | sed 's/.yaml$//')
sweep lm16_slowcal lm16_adaptive_slowcal lm16_local_adamw lm16_diloco
sweep $(cd $D && ls mnist*_state4.yaml | sed 's/.yaml$//')
sweep lm64_slowcal lm64_adaptive_slowcal lm64_local_adamw lm64_diloco
"$PY" sweeps/communication/codes.py seeds
sweep $(cd $D && ls lm*_state4.yaml | sed 's/.yaml$//')
sweep mnist64_local_adamw_noef mnist64_diloco_noef
# AdamW's moments averaged (every round, every 4th: DES-LOC), then the language model's Local-SGD with AdamW seeds 2-3
sweep $(cd $D && ls mnist*_moments_*.yaml | sed 's/.yaml$//')
"$PY" sweeps/communication/codes.py seeds
sweep $(cd $D && ls lm*_moments_*.yaml lm*_local_adamw_*_seeds.yaml lm*_diloco_*_seeds.yaml | sed 's/.yaml$//')
# a chosen rate at its grid's edge: the next rate out (once), then seeds 2-3 wherever a chosen rate moved or is new
"$PY" sweeps/communication/codes.py edges
sweep $(cd $D && ls *_edge.yaml | sed 's/.yaml$//')
"$PY" sweeps/communication/codes.py seeds
sweep $(cd $D && ls *_seeds.yaml | sed 's/.yaml$//')
# the state cells tuned: seed 1 at the rates either side of their plain cell's, then seeds 2-3 where seed 1 moved
"$PY" sweeps/communication/codes.py tune
sweep $(cd $D && ls *_rates.yaml | sed 's/.yaml$//')
# a state cell whose chosen rate is now an edge of its three: the next rate out (once); then seeds 2-3 wherever seed 1
# moved (*_rates_seeds; *_edge_seeds at the rate edges added)
"$PY" sweeps/communication/codes.py edges
sweep $(cd $D && ls *_edge.yaml | sed 's/.yaml$//')
"$PY" sweeps/communication/codes.py tune
sweep $(cd $D && ls *_rates_seeds.yaml *_edge_seeds.yaml 2>/dev/null | sed 's/.yaml$//')
nice -n 5 "$PY" -m lit_slowcal sweep sweeps/communication/main_codes.yaml --results sweeps/results/communication_mnist.jsonl \
  --workers 1 --threads 1 --wandb=false
"$PY" sweeps/communication/codes.py
