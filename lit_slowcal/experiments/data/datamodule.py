"""The data module: a problem's training set over M machines, streamed one communication round at a time.

``ProblemDataModule`` builds the problem's samples and the M machines' shards (MNIST: read by
``lit_slowcal.experiments.data.mnist``, split by class with ``partition_shards``) and serves this
process's machines' ``MachineStreams`` (``lit_slowcal.experiments.data.streams``): one training batch is
one round, for each of the round's steps and each of this rank's m machines b samples, as tensors
``(steps, m, b, 784)`` and ``(steps, m, b)``. The samples are kept normalised in memory: the loop
only gathers.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Optional

import lightning.pytorch as pl
import torch
from torch import Tensor

from lit_slowcal._validation import check_int, is_number
from lit_slowcal.experiments._lightning import batches_done_in_epoch
from lit_slowcal.experiments.data.class_distribution import plot_class_distribution, write_class_counts
from lit_slowcal.experiments.data.limits import check_round_fits, check_shards_hold_a_batch
from lit_slowcal.experiments.data.mnist import MNIST_MEAN, MNIST_STD, load_mnist, prepare_mnist
from lit_slowcal.experiments.data.partition import SPLITS, class_counts, partition
from lit_slowcal.experiments.data.problems import MNIST, Problem, ProblemData
from lit_slowcal.experiments.data.streams import MachineStreams
from lit_slowcal.experiments.train.model import MachinesModel
from lit_slowcal.experiments.train.shape import RunShape

# load_mnist, the normalisation constants and MachineStreams are defined beside this module, exported here too.
__all__ = ["ProblemDataModule", "MachineStreams", "load_mnist", "partition_shards", "MNIST_MEAN", "MNIST_STD"]

MNIST_TRAIN_SIZE = MNIST.TRAIN_SIZE  # the problem registry's


#: Per process, the most splits (and their figures) kept for the runs that follow (a sweep's runs
#: repeat a few (M, seed) pairs).
_CACHE_SIZE = 32
# (M, alpha, split, seed) -> (the labels split, the shards); see partition_shards.
_PARTITIONS: dict[tuple, tuple[Tensor, list[Tensor]]] = {}
# (counts shape, counts bytes, title) -> the class-distribution PNG.
_FIGURES: dict[tuple, bytes] = {}


def partition_shards(labels: Tensor, num_machines: int, alpha: Optional[float], split: str, seed: int) -> list[Tensor]:
    """``partition(labels, num_machines, alpha, split=split, seed=seed)`` as int64 tensors.

    Computed once per process for the same labels tensor (``load_mnist``'s) and settings: the runs
    of a sweep that share M and the seed share the split. Every call returns its own copies, so a
    caller that modifies its shards changes nobody else's.
    """
    # With the types: 1 == True == 1.0 as keys, but partition refuses some of them.
    key = tuple((type(v), v) for v in (num_machines, alpha, split, seed))
    try:
        hit = _PARTITIONS.get(key)
    except TypeError:  # an unhashable argument: partition says what is wrong with it
        key, hit = None, None
    if hit is None or hit[0] is not labels:
        shards = partition(labels.numpy(), num_machines, alpha, split=split, seed=seed)
        hit = (labels, [torch.from_numpy(s) for s in shards])
        if key is not None:
            _PARTITIONS.pop(key, None)
            _PARTITIONS[key] = hit
            while len(_PARTITIONS) > _CACHE_SIZE:
                _PARTITIONS.pop(next(iter(_PARTITIONS)))
    return [s.clone() for s in hit[1]]


class _Slices:
    """Consecutive batches of in-memory tensors: no per-sample indexing or collation."""

    def __init__(self, x: Tensor, y: Tensor, batch_size: int) -> None:
        self.x, self.y, self.batch_size = x, y, batch_size

    def __len__(self) -> int:
        return math.ceil(len(self.y) / self.batch_size)

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        for i in range(0, len(self.y), self.batch_size):
            yield self.x[i : i + self.batch_size], self.y[i : i + self.batch_size]


class ProblemDataModule(pl.LightningDataModule):
    """MNIST split over ``num_machines`` machines by class with Dirichlet(``dirichlet_alpha``), or another problem.

    ``problem`` picks what is trained on (``lit_slowcal.experiments.data.problems``): ``None`` or
    ``MNIST()`` for the paper's experiment, ``Synthetic(alpha, beta)`` or ``Quadratic(...)``; the
    split settings below apply to MNIST only, the other problems generate their machines' data.

    One epoch is R = ceil(N / (M * steps_per_round * batch_size)) rounds of ``steps_per_round``
    steps, so that all machines together see about N samples per epoch (N = 60,000 for MNIST; the
    problem's ``train_size``). Each training batch is one round (see ``MachineStreams``). Each rank
    hosts the m = M / world_size consecutive machines ``rank * m ... rank * m + m - 1``. These numbers
    are the data module's ``shape()``, a ``RunShape``: the run's, which the CLI gives it with
    ``use_shape`` (the one the strategy's ``sync_every`` and the model's machines come from), or, built
    by hand, its own arguments'. Validation and test use the problem's test set (the 10,000 MNIST test
    images).

    Args:
        root: folder holding ``MNIST/raw/`` (MNIST's files) and ``stdlib/`` (StdlibChars's corpus); the repository
            ships both in ``data/``. Another problem reads nothing there.
        num_machines: M, machines over all processes.
        batch_size: samples per machine per optimizer step (``None``: the run shape's, 1 without one).
        steps_per_round: optimizer steps per communication round (K for the local methods, 1 for
            Minibatch-SGD, whose per-step batch is K * b; ``None``: the run shape's, 16 without one).
            The CLI leaves both unset and gives the run's shape (``use_shape``); given, they must agree with it.
        dirichlet_alpha: concentration of the class split (the paper: 0.1); ``None`` for a stratified IID split.
        split: which Dirichlet split (``lit_slowcal.experiments.data.partition.partition``): ``official``
            (the paper's code, draw for draw: shards of about N / M samples, some samples left out),
            ``balanced`` (every machine N / M samples, each with its own Dirichlet class mix) or
            ``dirichlet`` (plain, Hsu et al. 2019: shard sizes vary widely).
        seed: seeds the partition and every machine's stream.
        eval_batch_size: batch size of the test set.
        problem: the problem (``None``: MNIST).
    """

    def __init__(
        self,
        root: str = "data",
        num_machines: int = 16,
        batch_size: Optional[int] = None,
        steps_per_round: Optional[int] = None,
        dirichlet_alpha: Optional[float] = 0.1,
        split: str = "dirichlet",
        seed: int = 1,
        eval_batch_size: int = 10_000,
        problem: Optional[Problem] = None,
    ) -> None:
        super().__init__()
        for name, value in (
            ("num_machines", num_machines),
            ("batch_size", batch_size),
            ("steps_per_round", steps_per_round),
            ("eval_batch_size", eval_batch_size),
        ):
            if value is not None or name == "num_machines":
                check_int(f"data.{name}", value)
        if dirichlet_alpha is not None and not (
            is_number(dirichlet_alpha) and math.isfinite(dirichlet_alpha) and dirichlet_alpha > 0
        ):
            raise ValueError(
                f"Invalid data.dirichlet_alpha: {dirichlet_alpha!r} (must be a finite number > 0, or null for IID)"
            )
        if split not in SPLITS:
            raise ValueError(f"Invalid data.split: {split!r} (allowed: {', '.join(SPLITS)})")
        self.root = root
        self.num_machines = num_machines
        self._given = (steps_per_round, batch_size)  # the arguments; the shape says what is served
        self.dirichlet_alpha = dirichlet_alpha
        self.split = split
        self.seed = seed
        self.eval_batch_size = eval_batch_size
        if problem is not None and not isinstance(problem, Problem):
            raise ValueError(
                f"Invalid data.problem: {problem!r} (a Problem: MNIST, Synthetic, Quadratic or StdlibChars)"
            )
        self.problem = MNIST() if problem is None else problem
        self.problem_data: Optional[ProblemData] = None
        self.shards: list[Tensor] = []
        self.partition_png: Optional[Path] = None
        self._train: Optional[MachineStreams] = None
        self._shape: Optional[RunShape] = None

    @property
    def num_train_samples(self) -> int:
        """N, the samples one epoch's rounds cover: the problem's ``train_size`` (60,000 for MNIST)."""
        return self.problem.train_size(self.num_machines, self.seed, self)

    def use_shape(self, shape: RunShape) -> None:
        """Serve the rounds of ``shape``, the run's (the CLI's one shape, whose ``sync_every`` the strategy has):
        its M must be this data module's, and its steps per round and per-step batch the arguments given, if any.
        """
        if not isinstance(shape, RunShape):
            raise ValueError(f"Invalid shape: {shape!r} (a RunShape)")
        if shape.num_machines != self.num_machines:
            raise ValueError(
                f"Invalid shape: num_machines {shape.num_machines} (the data module splits the data over "
                f"data.num_machines={self.num_machines})"
            )
        shape.check_data_settings(*self._given)
        served = self.shape() if self._train is not None else shape
        if (shape.steps_per_round, shape.per_step_batch) != (served.steps_per_round, served.per_step_batch):
            raise ValueError(
                f"Invalid shape: {shape} (the streams are set up for num_machines={served.num_machines}, "
                f"steps_per_round={served.steps_per_round}, batch_size={served.per_step_batch}; give the shape "
                "before setup)"
            )
        self._shape = shape

    def shape(self) -> RunShape:
        """The run's shape: the one given by ``use_shape``, else the constructor's arguments' over the trainer's
        processes."""
        if self._shape is not None:
            return self._shape
        world = self.trainer.world_size if self.trainer is not None else 1
        steps, batch = self._given
        return RunShape(
            self.num_machines,
            16 if steps is None else steps,
            1 if batch is None else batch,
            self.num_train_samples,
            world,
        )

    @property
    def steps_per_round(self) -> int:
        """Optimizer steps per round: the shape's."""
        return self.shape().steps_per_round

    @property
    def batch_size(self) -> int:
        """Samples per machine per step: the shape's per-step batch."""
        return self.shape().per_step_batch

    @property
    def train_streams(self) -> MachineStreams:
        """This process's machines' training streams (``setup`` builds them): what ``train_dataloader`` gives."""
        if self._train is None:
            raise RuntimeError("the data module has no training streams before setup('fit')")
        return self._train

    def problem_samples(self) -> ProblemData:
        """The problem's training and test samples and the M machines' shards (built once)."""
        return self._build()

    def _build(self) -> ProblemData:
        if self.problem_data is None:
            self.problem_data = self.problem.build(self.num_machines, self.seed, self)
        return self.problem_data

    def mnist_data(self, num_machines: int, seed: int) -> ProblemData:
        """MNIST from ``root``, split by ``dirichlet_alpha`` and ``split`` (the ``MNIST`` problem's data)."""
        x, y, test_x, test_y = load_mnist(self.root)
        shards = partition_shards(y, num_machines, self.dirichlet_alpha, self.split, seed)
        return ProblemData(x, y, tuple(shards), test_x, test_y)

    def _layout(self) -> tuple[RunShape, int]:
        """The run's shape (checked: M a multiple of the processes) and this process's rank."""
        shape = self.shape()
        if self.trainer is None:
            return shape, 0
        if shape.world_size != self.trainer.world_size:
            raise ValueError(
                f"Invalid shape: world_size {shape.world_size} (the trainer runs {self.trainer.world_size} processes; "
                "give the data module the run's shape over them)"
            )
        rank = self.trainer.global_rank
        if not 0 <= rank < shape.world_size:  # an outside launcher's rank (RANK, WORLD_SIZE) beyond the trainer's count
            raise ValueError(
                f"Invalid trainer.num_nodes / trainer.devices: this process is rank {rank} of the launch, the trainer "
                f"runs {shape.world_size} process(es) (num_nodes x devices); give the launch's count, e.g. "
                "--trainer.num_nodes=<nodes> --trainer.devices=<processes a node>"
            )
        return shape, rank

    def prepare_data(self) -> None:
        """Decompress and check the MNIST files once, before any rank reads them (Lightning calls this on
        one process per node, then all of them call ``setup``); another problem needs no MNIST file."""
        if isinstance(self.problem, MNIST):
            prepare_mnist(Path(self.root))

    def setup(self, stage: str) -> None:
        model = self.trainer.lightning_module if self.trainer is not None else None
        if isinstance(model, MachinesModel) and model.shape is None:  # a model built by hand: this data's shape
            model.use_shape(self._layout()[0])
        if self._train is not None:
            return
        shape, rank = self._layout()
        m = shape.machines_per_process
        processes = getattr(self.trainer, "num_devices", 1)  # this node's processes share its memory
        check_round_fits(m * processes, shape.steps_per_round, shape.per_step_batch, features=self.problem.input_dim)
        data = self._build()
        x, y, self.test_x, self.test_y = data.train_x, data.train_y, data.test_x, data.test_y
        self.shards = list(data.shards)
        check_shards_hold_a_batch(
            self.shards, shape.per_step_batch, f"{self.num_machines} machines, {self.split_name()}"
        )
        machines = list(range(rank * m, (rank + 1) * m))
        self._train = MachineStreams(
            x, y, self.shards, machines, shape.per_step_batch, shape.steps_per_round, shape.rounds, self.seed
        )
        self._train_labels = y
        if stage == "fit" and self.trainer is not None and self.problem.loss == "cross_entropy":
            folder = self.trainer.log_dir or self.trainer.default_root_dir  # a collective: every rank asks
            if self.trainer.is_global_zero:
                self._log_partition(Path(folder))

    def split_name(self) -> str:
        """``Dirichlet alpha=0.1, official``: the split, as the figure's title and the errors give it
        (another problem than MNIST: the problem, e.g. ``Synthetic(alpha=1, ...)``)."""
        if not isinstance(self.problem, MNIST):
            return self.problem.describe()
        if self.dirichlet_alpha is None:
            return "IID"
        return f"Dirichlet alpha={self.dirichlet_alpha:g}" + ("" if self.split == "dirichlet" else f", {self.split}")

    def class_counts(self):
        """Class counts per machine, shape ``(M, classes)``."""
        return class_counts(self._train_labels.numpy(), [s.numpy() for s in self.shards], self.problem.num_outputs)

    def _log_partition(self, folder: Path) -> None:
        trainer = self.trainer
        title = f"Class distribution across {self.num_machines} machines ({self.split_name()})"
        self.partition_png = folder / "class_distribution.png"
        counts = self.class_counts()
        folder.mkdir(parents=True, exist_ok=True)
        write_class_counts(counts, folder / "class_counts.csv")
        # Drawing the figure takes longer than a short run trains; the runs of a sweep that share a
        # split (same M and seed) share its PNG, drawn once per process and copied.
        key = (counts.shape, counts.tobytes(), title)
        png = _FIGURES.get(key)
        figure = None
        if png is None:
            figure = plot_class_distribution(counts, self.partition_png, title=title)
            _FIGURES[key] = png = self.partition_png.read_bytes()
            while len(_FIGURES) > _CACHE_SIZE:
                _FIGURES.pop(next(iter(_FIGURES)))
        else:
            self.partition_png.write_bytes(png)
        for logger in trainer.loggers:
            if hasattr(logger, "log_image"):  # WandbLogger
                logger.log_image(key="class_distribution", images=[str(self.partition_png)])
            elif hasattr(getattr(logger, "experiment", None), "add_figure"):  # TensorBoardLogger
                if figure is None:
                    figure = plot_class_distribution(counts, title=title)
                logger.experiment.add_figure("class_distribution", figure)

    def state_dict(self) -> dict[str, int]:
        """The streams' position, saved in checkpoints: the epoch and the rounds trained in it.

        Every machine's stream is a function of (seed, machine, position), so this is all a resumed
        run needs to draw exactly the samples an uninterrupted run would have drawn.
        """
        trainer = self.trainer
        if trainer is None or self._train is None:
            return {}
        return {
            "epoch": trainer.current_epoch,
            "rounds_done": batches_done_in_epoch(trainer),
        }

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        if state_dict and self._train is not None:
            self._train.resume_at(state_dict["epoch"], state_dict["rounds_done"])

    def train_dataloader(self) -> MachineStreams:
        # Batches are whole rounds gathered from in-memory tensors: a DataLoader would add nothing.
        return self._train

    def _test_loader(self) -> _Slices:
        return _Slices(self.test_x, self.test_y, self.eval_batch_size)

    val_dataloader = _test_loader
    test_dataloader = _test_loader
