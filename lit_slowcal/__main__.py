"""``python -m lit_slowcal``: the paper experiment's command line (an application on the core).

Not imported by ``import lit_slowcal``; it needs the experiment extras.
"""

import sys

try:
    from lit_slowcal.experiments.main import main
except ModuleNotFoundError as err:  # an extra of the experiment app is not installed
    if err.name and err.name.split(".")[0] in ("jsonargparse", "torchvision", "torchmetrics", "wandb", "matplotlib", "yaml", "numpy"):
        sys.exit(
            f"python -m lit_slowcal: the experiment app needs {err.name!r}, which is not installed. "
            "Install the app's extras: pip install \"lit_slowcal[experiments]\""
        )
    raise

main()
