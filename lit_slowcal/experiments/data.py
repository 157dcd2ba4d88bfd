"""MNIST split over M machines by class (Dirichlet), streamed one communication round at a time.

Every machine i draws from its own distribution D_i: the empirical distribution of its shard. Its
stream reshuffles and cycles its shard with a generator of its own (seeded from the seed and i), so
the samples machine i sees do not depend on how machines are laid out over processes. One training
batch is one round: for each of the round's steps and each of this rank's m machines, b samples,
as tensors ``(steps, m, b, 784)`` and ``(steps, m, b)``. Images are decoded once and kept
normalised in memory: the loop only gathers.
"""

from __future__ import annotations

import gzip
import math
import shutil
from pathlib import Path
from typing import Iterator, Optional

import lightning.pytorch as pl
import torch
from torch import Tensor

from lit_slowcal._lightning import batches_done_in_epoch
from lit_slowcal._validation import check_int, is_number
from lit_slowcal.experiments.limits import check_round_fits, check_shards_hold_a_batch
from lit_slowcal.experiments.class_distribution import plot_class_distribution, write_class_counts
from lit_slowcal.experiments.partition import SPLITS, class_counts, partition
from lit_slowcal.experiments.problems import MNIST, Problem, ProblemData
from lit_slowcal.experiments.shape import RunShape
from lit_slowcal.files import atomic_path, locked

__all__ = ["ProblemDataModule", "MachineStreams", "load_mnist", "partition_shards", "MNIST_MEAN", "MNIST_STD"]

MNIST_MEAN, MNIST_STD = 0.1307, 0.3081
MNIST_TRAIN_SIZE = MNIST.TRAIN_SIZE  # the problem registry's

# name -> (IDX magic number, decompressed size in bytes)
_MNIST_FILES = {
    "train-images-idx3-ubyte": (2051, 16 + 60000 * 28 * 28),
    "train-labels-idx1-ubyte": (2049, 8 + 60000),
    "t10k-images-idx3-ubyte": (2051, 16 + 10000 * 28 * 28),
    "t10k-labels-idx1-ubyte": (2049, 8 + 10000),
}
MNIST_CLASSES = 10


def _check_idx_file(path: Path, magic: int, size: int) -> None:
    """The file's size, its IDX magic number and its header's dimensions (count, and 28 x 28 for images)."""
    actual = path.stat().st_size
    if actual != size:
        raise ValueError(f"Corrupt MNIST file {path}: {actual} bytes, expected {size}. Replace it with the original file.")
    dims = 3 if magic == 2051 else 1
    with open(path, "rb") as f:
        header = f.read(4 + 4 * dims)
    found = int.from_bytes(header[:4], "big")
    if found != magic:
        raise ValueError(f"Corrupt MNIST file {path}: magic number {found}, expected {magic}. Replace it with the original file.")
    shape = [int.from_bytes(header[4 + 4 * i : 8 + 4 * i], "big") for i in range(dims)]
    expected = [(size - 4 - 4 * dims) // (28 * 28 if dims == 3 else 1), *([28, 28] if dims == 3 else [])]
    if shape != expected:
        raise ValueError(
            f"Corrupt MNIST file {path}: its header gives the shape {' x '.join(map(str, shape))}, but its size holds "
            f"{' x '.join(map(str, expected))}. Replace it with the original file."
        )


def _check_labels(labels: Tensor, path: Path) -> None:
    """Every label is a class 0..9; else name the file, the first label outside and where it is."""
    bad = ((labels < 0) | (labels >= MNIST_CLASSES)).nonzero()
    if len(bad):
        i = int(bad[0])
        raise ValueError(
            f"Corrupt MNIST file {path}: label {int(labels[i])} at index {i} ({len(bad)} labels outside 0..{MNIST_CLASSES - 1}). "
            "Replace it with the original file."
        )


def _prepare_raw_files(root: Path) -> None:
    """Decompress the shipped ``.gz`` files next to them (torchvision reads only decompressed files)
    and check every file's size and magic number. Downloads with torchvision when nothing is there.

    Processes preparing the same folder at once (the ranks of a job, two jobs on a fresh clone)
    take turns under a lock on ``raw/`` (``lit_slowcal.files.locked``): the first decompresses, the
    others find the files done. Each file appears whole (``atomic_path``) or not at all."""
    raw = root / "MNIST" / "raw"
    if not raw.is_dir():
        return _download(root, list(_MNIST_FILES))
    if all((raw / name).exists() for name in _MNIST_FILES):  # prepared: no lock (the folder may be read-only)
        return _decompress_and_check(raw)
    with locked(raw / "prepare"):
        _decompress_and_check(raw)


def _decompress_and_check(raw: Path) -> None:
    missing = []
    for name, (magic, size) in _MNIST_FILES.items():
        path, gz = raw / name, raw / f"{name}.gz"
        if not path.exists() and gz.exists():
            try:
                with gzip.open(gz, "rb") as src, atomic_path(path) as tmp, open(tmp, "wb") as dst:
                    shutil.copyfileobj(src, dst)
            except (OSError, EOFError) as err:
                raise ValueError(f"Corrupt MNIST file {gz}: {err}. Replace it with the original file.") from err
        if path.exists():
            _check_idx_file(path, magic, size)
        else:
            missing.append(name)
    if missing:
        _download(raw.parent.parent, missing)


def _download(root: Path, missing: list[str]) -> None:
    raw = root / "MNIST" / "raw"
    from torchvision.datasets import MNIST

    try:
        MNIST(str(root), train=True, download=True)
        MNIST(str(root), train=False, download=True)
    except Exception as err:  # no network, blocked mirror, ...
        raise FileNotFoundError(
            f"MNIST files {', '.join(missing)} are missing from {raw} and could not be downloaded ({err}). "
            f"Put the four MNIST files (train-images-idx3-ubyte.gz, train-labels-idx1-ubyte.gz, "
            f"t10k-images-idx3-ubyte.gz, t10k-labels-idx1-ubyte.gz) in {raw}, or set data.root to the "
            f"folder that holds MNIST/raw/."
        ) from err


_CACHE: dict[tuple, tuple[Tensor, Tensor, Tensor, Tensor]] = {}


def load_mnist(root: str | Path = "data") -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """MNIST as normalised float32 tensors ``(N, 784)`` and int64 labels: train x, train y, test x, test y.

    Decoded once per process (runs of a sweep share it); the tensors must not be modified.
    """
    from torchvision.datasets import MNIST

    root = Path(root)
    _prepare_raw_files(root)
    raw = root / "MNIST" / "raw"
    key = (str(root.resolve()), *((raw / n).stat().st_mtime_ns for n in _MNIST_FILES))
    if key in _CACHE:
        return _CACHE[key]
    out = []
    for train in (True, False):
        ds = MNIST(str(root), train=train, download=False)
        _check_labels(ds.targets, raw / ("train-labels-idx1-ubyte" if train else "t10k-labels-idx1-ubyte"))
        x = ds.data.reshape(len(ds.data), -1).to(torch.float32).div_(255.0).sub_(MNIST_MEAN).div_(MNIST_STD)
        out += [x, ds.targets.to(torch.int64)]
    _CACHE.clear()
    _CACHE[key] = (out[0], out[1], out[2], out[3])
    return _CACHE[key]


#: Per process, the most splits (and their figures) kept for the runs that follow (a sweep's runs
#: repeat a few (M, seed) pairs).
_CACHE_SIZE = 32
# (M, alpha, split, seed) -> (the labels split, the shards); see partition_shards.
_PARTITIONS: dict[tuple, tuple[Tensor, list[Tensor]]] = {}
# (counts shape, counts bytes, title) -> the class-distribution PNG.
_FIGURES: dict[tuple, bytes] = {}


def partition_shards(
    labels: Tensor, num_machines: int, alpha: Optional[float], split: str, seed: int
) -> list[Tensor]:
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


def num_rounds(num_samples: int, num_machines: int, steps_per_round: int, batch_size: int) -> int:
    """R = ceil(N / (M * steps_per_round * batch_size)): rounds for all machines to see N samples (``RunShape.rounds``)."""
    return RunShape(num_machines, steps_per_round, batch_size, train_size=num_samples).rounds


class MachineStreams:
    """Endless per-machine sample streams, served one communication round at a time.

    Machine i's stream is the concatenation of independent random permutations of its shard drawn
    from ``torch.Generator().manual_seed(seed * 1_000_003 + i)``. Each item is one round: the next
    ``steps_per_round * batch_size`` draws of every hosted machine, as tensors of shapes
    ``(steps_per_round, m, batch_size, ...)`` and ``(steps_per_round, m, batch_size)``. Iterating
    gives ``rounds`` items (one epoch); the next iteration continues the streams.

    Args:
        x, y: the whole training set (already normalised).
        shards: sample indices of every machine (all M of them).
        machine_ids: the machines hosted here.
        batch_size: samples per machine per step.
        steps_per_round: optimizer steps per round.
        rounds: rounds per epoch.
        seed: seeds every machine's stream.
    """

    def __init__(
        self,
        x: Tensor,
        y: Tensor,
        shards: list[Tensor],
        machine_ids: list[int],
        batch_size: int,
        steps_per_round: int,
        rounds: int,
        seed: int,
    ) -> None:
        self.x, self.y = x, y
        self.shards = [shards[i] for i in machine_ids]
        self.machine_ids = list(machine_ids)
        self.batch_size = batch_size
        self.steps_per_round = steps_per_round
        self.rounds = rounds
        self.seed = seed
        self.epoch = 0
        self.start_round = 0

    def __len__(self) -> int:
        return self.rounds

    def indices(self, epoch: int) -> Tensor:
        """Sample indices of one epoch, shape ``(rounds, steps_per_round, m, batch_size)``."""
        count = self.rounds * self.steps_per_round * self.batch_size  # draws per machine per epoch
        start = epoch * count
        columns = []
        for i, shard in zip(self.machine_ids, self.shards):
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
            n = len(shard)
            first, last = start // n, (start + count - 1) // n
            # Permutation k of the stream is the k-th draw from g: draw them all up to `last` in one
            # vectorised call and keep this epoch's window.
            perms = torch.rand(last + 1, n, generator=g).argsort(dim=1)[first:]
            offset = start - first * n
            columns.append(shard[perms.reshape(-1)[offset : offset + count]])
        idx = torch.stack(columns)  # (m, count)
        return idx.view(len(columns), self.rounds, self.steps_per_round, self.batch_size).permute(1, 2, 0, 3)

    def resume_at(self, epoch: int, rounds_done: int) -> None:
        """Make the next iteration continue epoch ``epoch`` after its first ``rounds_done`` rounds."""
        self.epoch, self.start_round = (epoch + 1, 0) if rounds_done >= self.rounds else (epoch, rounds_done)

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        epoch, start = self.epoch, self.start_round
        self.epoch, self.start_round = epoch + 1, 0
        idx = self.indices(epoch)
        for r in range(start, self.rounds):
            yield self.x[idx[r]], self.y[idx[r]]


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

    ``problem`` picks what is trained on (``lit_slowcal.experiments.problems``): ``None`` or
    ``MNIST()`` for the paper's experiment, ``Synthetic(alpha, beta)`` or ``Quadratic(...)``; the
    split settings below apply to MNIST only, the other problems generate their machines' data.

    One epoch is R = ceil(N / (M * steps_per_round * batch_size)) rounds of ``steps_per_round``
    steps, so that all machines together see about N samples per epoch (N = 60,000 for MNIST; the
    problem's ``train_size``). Each training batch is one round (see ``MachineStreams``). Each rank
    hosts the m = M / world_size consecutive machines ``rank * m ... rank * m + m - 1``. These numbers
    are the data module's ``shape()`` (a ``RunShape``); the CLI hands it the run's own with
    ``use_shape``, the one the strategy's ``sync_every`` comes from. Validation and test use the
    problem's test set (the 10,000 MNIST test images).

    Args:
        root: folder holding ``MNIST/raw/`` (the repository ships the files in ``data/``).
        num_machines: M, machines over all processes.
        batch_size: samples per machine per optimizer step.
        steps_per_round: optimizer steps per communication round (K for the local methods, 1 for
            Minibatch-SGD, whose per-step batch is K * b).
        dirichlet_alpha: concentration of the class split (the paper: 0.1); ``None`` for a stratified IID split.
        split: which Dirichlet split (``lit_slowcal.experiments.partition.partition``): ``official``
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
        batch_size: int = 1,
        steps_per_round: int = 16,
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
        self.batch_size = batch_size
        self.steps_per_round = steps_per_round
        self.dirichlet_alpha = dirichlet_alpha
        self.split = split
        self.seed = seed
        self.eval_batch_size = eval_batch_size
        if problem is not None and not isinstance(problem, Problem):
            raise ValueError(f"Invalid data.problem: {problem!r} (a Problem: MNIST, Synthetic or Quadratic)")
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
        """Serve the rounds of ``shape``: its machines, steps per round and per-step batch replace the
        constructor's (the CLI's one shape of the run, whose ``sync_every`` the strategy has)."""
        if not isinstance(shape, RunShape):
            raise ValueError(f"Invalid shape: {shape!r} (a RunShape)")
        if self._train is not None and (shape.num_machines, shape.steps_per_round, shape.per_step_batch) != (
            self.num_machines, self.steps_per_round, self.batch_size
        ):
            raise ValueError(
                f"Invalid shape: {shape} (the streams are set up for num_machines={self.num_machines}, "
                f"steps_per_round={self.steps_per_round}, batch_size={self.batch_size}; give the shape before setup)"
            )
        self.num_machines, self.steps_per_round, self.batch_size = shape.num_machines, shape.steps_per_round, shape.per_step_batch
        self._shape = shape

    def shape(self) -> RunShape:
        """The run's shape: the one given by ``use_shape``, else the constructor's over the trainer's processes."""
        if self._shape is not None:
            return self._shape
        world = self.trainer.world_size if self.trainer is not None else 1
        return RunShape(self.num_machines, self.steps_per_round, self.batch_size, self.num_train_samples, world)

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

    @property
    def num_rounds(self) -> int:
        """R = ceil(N / (M * steps_per_round * batch_size)) (``RunShape.rounds``)."""
        return self.shape().rounds

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
        return shape, self.trainer.global_rank

    def prepare_data(self) -> None:
        """Decompress and check the MNIST files once, before any rank reads them (Lightning calls this on
        one process per node, then all of them call ``setup``)."""
        _prepare_raw_files(Path(self.root))

    def setup(self, stage: str) -> None:
        if self._train is not None:
            return
        shape, rank = self._layout()
        m = shape.machines_per_process
        processes = getattr(self.trainer, "num_devices", 1)  # this node's processes share its memory
        check_round_fits(m * processes, shape.steps_per_round, shape.per_step_batch, features=self.problem.input_dim)
        data = self._build()
        x, y, self.test_x, self.test_y = data.train_x, data.train_y, data.test_x, data.test_y
        self.shards = list(data.shards)
        check_shards_hold_a_batch(self.shards, self.batch_size, f"{self.num_machines} machines, {self.split_name()}")
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

    def _test_loader(self) -> "_Slices":
        return _Slices(self.test_x, self.test_y, self.eval_batch_size)

    val_dataloader = _test_loader
    test_dataloader = _test_loader
