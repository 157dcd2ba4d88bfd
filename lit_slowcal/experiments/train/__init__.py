"""What trains: the model over M simulated machines and the methods' rounds.

- ``model``: the app's LightningModule (``MachinesModel``): M machines' models, one round per step.
- ``methods``: the methods, one entry each (``--method slowcal|local_sgd|...``).
- ``architectures``: the models a machine can train (``--model.arch``).
- ``rounds``: the pieces of a method's round, defined once for a single run and a stacked sweep.
- ``shape``: a run's shape (``RunShape``), the one owner of K, M, the machines per process, the rounds and
  the batch shape; the only reader of the way ``methods`` maps K.
"""
