"""What a run trains on: a problem's samples, split over M machines, served one round at a time.

- ``problems``: the problems, one class each (``--data.problem=MNIST|Synthetic|Quadratic``).
- ``mnist``: the MNIST files: checked, decompressed once, read into normalised tensors.
- ``partition``: the split over M machines: IID, or non-IID with a Dirichlet class skew.
- ``streams``: endless per-machine sample streams, one communication round per item.
- ``datamodule``: the data module (``ProblemDataModule``) that puts these together for a run.
- ``limits``: the resource limits checked before training (a round fits in memory, a shard holds a batch).
- ``class_distribution``: what the split gives each machine, as a CSV and a figure.

The problem classes are not re-exported here: their class path (``lit_slowcal.experiments.data.problems.X``)
is what a config dump writes.
"""
