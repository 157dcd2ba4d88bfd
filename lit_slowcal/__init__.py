"""SLowcal-SGD for PyTorch Lightning.

``SlowcalSGD`` depends on torch alone; the Lightning pieces are imported on first use, so
``from lit_slowcal import SlowcalSGD`` works without Lightning installed.
"""

from lit_slowcal.optimizer import SlowcalSGD

__all__ = ["SlowcalSGD", "PeriodicAveragingStrategy", "SimulatedMachines", "MNISTDataModule", "LogisticRegression"]
__version__ = "0.1.0"

_LAZY = {
    "PeriodicAveragingStrategy": "lit_slowcal.strategy",
    "SimulatedMachines": "lit_slowcal.simulated",
    "MNISTDataModule": "lit_slowcal.data",
    "LogisticRegression": "lit_slowcal.model",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'lit_slowcal' has no attribute {name!r}")
