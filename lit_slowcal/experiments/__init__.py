"""The paper's experiment, an application on the lit_slowcal core.

MNIST logistic regression split over M machines by a Dirichlet class skew, trained with one of the
methods of ``train.methods.METHODS`` (SLowcal-SGD, Local-SGD, Minibatch-SGD, Accelerated Minibatch-SGD,
SCAFFOLD, DiLoCo; ``python -m lit_slowcal fit --config configs/slowcal.yaml``),
W&B sweep files run locally (``python -m lit_slowcal sweep``) and the results report
(``python -m lit_slowcal report``). Needs the extras: ``pip install "lit_slowcal[experiments]"``.

The rooms, each with its own map (its ``__init__``); imports point one way, from the top down:

- ``main``: the command line, ``python -m lit_slowcal fit|validate|test|sweep|report|tune``: hands each
  command to its room.
- ``sweep/``: W&B sweep files run here, trial by trial or stacked; runs trials through ``run/``.
- ``analysis/``: the figures and tables from a sweep's results (``report``, ``tune``).
- ``run/``: one training run: the training CLI, its options, its folder, resume, identity, threads, summary.
- ``train/``: what trains: the model, the methods, the architectures, a round's pieces, the run's shape.
- ``data/``: what it trains on: the problems, MNIST, the split over machines, the per-machine streams.
- ``measure/``: what the theory talks about, measured: the objective f, its optimum, the diagnostics.
- ``print_once``: lines said once per sweep, not once per run (used by every room).
- ``_lightning``: every Lightning internal the project relies on, and no other module uses one.

Imports point from here into the core (``lit_slowcal.*``), never back.
"""
