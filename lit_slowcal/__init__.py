"""lit_slowcal: SLowcal-SGD and periodic averaging (Local-SGD) for PyTorch, Fabric and Lightning.

The core, importable with torch and lightning alone:

* ``SlowcalSGD`` -- the optimizer of SLowcal-SGD (Dahan & Levy, NeurIPS 2024), and ``AdaptiveSlowcal`` -- its
  anytime averaging with Adam- or AdaGrad-normalised steps (schedule-free AdamW on one machine);
* ``AcceleratedSGD`` -- AC-SA (Lan 2012), the Accelerated Minibatch-SGD baseline, and ``Scaffold`` --
  SCAFFOLD (Karimireddy et al. 2020, option II), the paper's other baselines of Table 1;
* ``PeriodicAverager`` -- averages parameters, floating buffers and declared optimizer state over
  all machines every K optimizer steps; framework-free (a plain torch loop, Fabric, Lightning);
  ``AveragingOptions`` -- its options (and the strategies'), checked alone and together, in one value;
* ``SimulatedMachines`` -- m machines stacked in one module and run as one vectorized call;
* ``PeriodicAveragingStrategy`` -- the Lightning ``Trainer`` strategy, a thin adapter over
  ``PeriodicAverager``; ``PeriodicAveragingFabricStrategy`` the same for Fabric;
  ``ShardedAveragingStrategy`` the Trainer's for FSDP2-sharded models, averaged over their replicas;
* ``Link`` and ``LinkCounts`` -- what a synchronisation costs on a network link (a ring all-reduce
  model, in bytes and seconds), the counts every averager keeps, and the DDP reference (``lit_slowcal.link``);
* ``AtomicCheckpointIO`` -- a Lightning ``CheckpointIO`` whose checkpoints are whole or absent
  (the strategies' default; pass it to any ``Trainer`` or Fabric strategy).

``__all__`` is the library's API, each name documented in docs/api.md. The file helpers behind
``AtomicCheckpointIO`` (``atomic_path``, ``atomic_write``, ``locked``) live in ``lit_slowcal.files``.

``import lit_slowcal`` needs torch only: the Lightning pieces load on first use, and the names
``strategy="periodic_averaging"`` (and ``"periodic_averaging_spawn"``, ``"sharded_averaging"``) are registered with the
Trainer and with Fabric as soon as Lightning is imported, before or after this package.

The paper's MNIST experiment (data, model, CLI, sweeps, report) is an application on top of this
core, ``lit_slowcal.experiments``, with extra dependencies: ``pip install "lit_slowcal[experiments]"``.
"""

from lit_slowcal import _registration
from lit_slowcal.accelerated import AcceleratedSGD
from lit_slowcal.adaptive import AdaptiveSlowcal
from lit_slowcal.averaging import PeriodicAverager
from lit_slowcal.link import Link, LinkCounts
from lit_slowcal.optimizer import SlowcalSGD
from lit_slowcal.options import AveragingOptions
from lit_slowcal.scaffold import Scaffold
from lit_slowcal.simulated import SimulatedMachines

__all__ = [
    "AcceleratedSGD",
    "AdaptiveSlowcal",
    "AtomicCheckpointIO",
    "AveragingOptions",
    "Link",
    "LinkCounts",
    "PeriodicAverager",
    "PeriodicAveragingFabricStrategy",
    "PeriodicAveragingStrategy",
    "Scaffold",
    "ShardedAveragingStrategy",
    "SimulatedMachines",
    "SlowcalSGD",
]
__version__ = "0.2.0"

# The pieces that import Lightning, loaded on first use.
_LAZY = {
    "PeriodicAveragingStrategy": "lit_slowcal.strategy",
    "PeriodicAveragingFabricStrategy": "lit_slowcal.fabric",
    "ShardedAveragingStrategy": "lit_slowcal.sharded_strategy",
    "AtomicCheckpointIO": "lit_slowcal.checkpoint_io",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'lit_slowcal' has no attribute {name!r}")


def __dir__() -> list:
    return sorted({*globals(), *_LAZY})


_registration.install()
