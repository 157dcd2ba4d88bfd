"""The paper's experiment, an application on the lit_slowcal core.

MNIST logistic regression split over M machines by a Dirichlet class skew, trained with one of the
methods of ``methods.METHODS`` (SLowcal-SGD, Local-SGD, Minibatch-SGD, Accelerated Minibatch-SGD,
SCAFFOLD, DiLoCo; ``python -m lit_slowcal fit --config configs/slowcal.yaml``),
W&B sweep files run locally (``python -m lit_slowcal sweep``) and the results report
(``python -m lit_slowcal report``). Needs the extras: ``pip install "lit_slowcal[experiments]"``.

Imports point from here into the core (``lit_slowcal.*``), never back.
"""
