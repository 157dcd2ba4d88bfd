"""``import lit_slowcal`` registers the strategy name with Lightning (``lit_slowcal._registration``): the
Trainer and Fabric know ``strategy="periodic_averaging"``, whichever is imported first."""

import subprocess
import sys

import pytest
from helpers import subprocess_env


@pytest.mark.parametrize("imports", ["import lit_slowcal, lightning as L", "import lightning as L, lit_slowcal"])
@pytest.mark.slow
def test_fabric_and_trainer_know_the_strategy_name_after_import_lit_slowcal(imports):
    code = (
        f"{imports}\n"
        "t = L.Trainer(strategy='periodic_averaging', accelerator='cpu', devices=1, logger=False)\n"
        "f = L.Fabric(strategy='periodic_averaging', accelerator='cpu', devices=1)\n"
        "s = lit_slowcal.PeriodicAveragingStrategy(sync_every=16)\n"
        "print(type(t.strategy).__name__, t.strategy.sync_every, type(f.strategy).__name__, s.sync_every)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], env=subprocess_env(), capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split()[-4:] == ["PeriodicAveragingStrategy", "1", "PeriodicAveragingFabricStrategy", "16"]
