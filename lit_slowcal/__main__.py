"""``python -m lit_slowcal``: the paper experiment's command line (an application on the core).

Not imported by ``import lit_slowcal``; it needs the experiment extras.
"""

import gc
import sys

# The command's imports (torch, Lightning, the app) make many objects and no garbage: the collector is off
# until they are done, and main() then freezes them (lit_slowcal.experiments.main._freeze).
gc.disable()
try:
    from lit_slowcal.experiments.main import main
except ModuleNotFoundError as err:  # an extra of the experiment app is not installed
    if err.name and err.name.split(".")[0] in (
        "jsonargparse",
        "torchvision",
        "torchmetrics",
        "wandb",
        "matplotlib",
        "yaml",
        "numpy",
    ):
        sys.exit(
            f"python -m lit_slowcal: the experiment app needs {err.name!r}, which is not installed. "
            'Install the app\'s extras: pip install "lit_slowcal[experiments]"'
        )
    raise

main(freeze_imports=True)
