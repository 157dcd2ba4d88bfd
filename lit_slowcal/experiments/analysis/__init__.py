"""A sweep's results turned into figures and tables: ``python -m lit_slowcal report|tune``.

- ``records``: a results file's records: loading them, each one's cell (method, M, K), the labels, saving a figure.
- ``report``: the figures and the table of a results file (``report``); with ``--target``, ``time_to_target``.
- ``time_to_target``: the modelled wall time each method needs to reach a target, per link.
- ``tune``: the tuning command (``tune``): chooses the rates, then writes the figures at them.
- ``rate_choice``: the choice of the learning rate per (method, M, K) by a training criterion.
- ``tuned_output``: the tuned choices written out: the CSV, the markdown tables, the figures.

The test set never chooses: the test figures are read only after the rates are chosen.
"""
