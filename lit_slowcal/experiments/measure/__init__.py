"""What the theory talks about, measured: the training objective, its optimum, the diagnostics of a run.

- ``objective``: the global training objective f of the linear model, for many points at once, and G_*.
- ``float64_product``: the inputs arranged for f's products, ``X W^T`` in float64 in blocks (``BlockedInputs``).
- ``optimum``: the optimum x* of f in float64 (Newton-CG), cached on disk.
- ``diagnostics``: the callback the CLI adds to every fit: f, the excess loss and the rest the theory names.
"""
