"""One training run, ``python -m lit_slowcal fit|validate|test``: the LightningCLI and what it owns.

- ``cli``: the training CLI (``SlowcalCLI``, ``run``): builds the model, the data and the trainer of a run.
- ``options``: its command line: the options, the settings linked from them, the one-line refusals.
- ``run_folder``: where a run writes: its name, its version folder, its loggers (CSV, W&B).
- ``identity``: what defines a run, stored in its checkpoints and in a sweep's records.
- ``resume``: the checks made before a checkpoint is loaded (a resume must be the same run).
- ``last_checkpoint``: a last.ckpt every few rounds and when training ends.
- ``threads``: torch's intra-op threads for the run (``--threads auto|N|0``).
- ``summary``: the lines a fit prints when it ends.

It uses ``train/``, ``data/`` and ``measure/``; none of them imports it.
"""
