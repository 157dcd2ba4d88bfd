"""lit_slowcal: SLowcal-SGD and periodic averaging (Local-SGD) for PyTorch, Fabric and Lightning.

The core, importable with torch and lightning alone:

* ``SlowcalSGD`` -- the optimizer of SLowcal-SGD (Dahan & Levy, NeurIPS 2024), torch only;
* ``PeriodicAverager`` -- averages parameters, floating buffers and declared optimizer state over
  all machines every K optimizer steps; framework-free (a plain torch loop, Fabric, Lightning);
* ``SimulatedMachines`` -- m machines stacked in one module and run as one vectorized call;
* ``PeriodicAveragingStrategy`` -- the Lightning ``Trainer`` strategy (``strategy="periodic_averaging"``),
  a thin adapter over ``PeriodicAverager``; ``PeriodicAveragingFabricStrategy`` for Fabric;
* ``AtomicCheckpointIO`` and ``atomic_write`` -- files that are whole or absent.

Importing ``lit_slowcal`` registers ``"periodic_averaging"`` (and ``"periodic_averaging_spawn"``)
with Lightning's Trainer and Fabric. The paper's MNIST experiment (data, model, CLI, sweeps,
report) is an application on top of this core, ``lit_slowcal.experiments``, with its own extra
dependencies: ``pip install "lit_slowcal[experiments]"``.
"""

from lit_slowcal.averaging import PeriodicAverager
from lit_slowcal.checkpoint import AtomicCheckpointIO
from lit_slowcal.fabric import PeriodicAveragingFabricStrategy
from lit_slowcal.files import atomic_path, atomic_write
from lit_slowcal.optimizer import SlowcalSGD
from lit_slowcal.simulated import SimulatedMachines
from lit_slowcal.strategy import PeriodicAveragingStrategy

__all__ = [
    "AtomicCheckpointIO",
    "PeriodicAverager",
    "PeriodicAveragingFabricStrategy",
    "PeriodicAveragingStrategy",
    "SimulatedMachines",
    "SlowcalSGD",
    "atomic_path",
    "atomic_write",
]
__version__ = "0.2.0"
