"""The problems a run trains on, one entry each: ``--data.problem=MNIST`` (the default), ``Synthetic``, ``Quadratic``,
``StdlibChars``.

A problem provides, for M machines and a seed, the training samples, every machine's shard of them
(machine i's empirical distribution D_i), the test set, and what the model and the objective need:
the input dimension, the number of outputs and the loss (``cross_entropy`` on class labels, or
``squared``: ``(z - y)^2 / 2`` on real targets). The global objective is the paper's

    f(x) = (1/M) sum_i f_i(x),   f_i(x) = (1/n_i) sum_{j in shard i} loss(x; z_j) + (lambda/2) ||x||^2,

with lambda = ``model.weight_decay`` (see ``lit_slowcal.experiments.measure.objective``). A new problem is
one new subclass of ``Problem`` here; the CLI finds it by its class name:
``python -m lit_slowcal fit --config configs/slowcal.yaml --data.problem=Synthetic --data.problem.alpha=0.5``.

``MNIST``
    The paper's experiment: MNIST split by ``data.dirichlet_alpha`` / ``data.split`` (those two
    settings apply to MNIST only), multinomial logistic regression. Without weight decay its
    objective has no attained minimiser (see ``attained_without_weight_decay``).
``Synthetic(alpha, beta)``
    Li et al. 2020 (FedProx, "Federated Optimization in Heterogeneous Networks"), the heterogeneous
    logistic-regression benchmark: machine i has its own model W_i ~ N(u_i, 1), b_i ~ N(u_i, 1) with
    u_i ~ N(0, alpha) (alpha: how much the machines' labelling rules differ) and its own inputs
    x ~ N(v_i, Sigma), v_i ~ N(B_i, 1), B_i ~ N(0, beta) (beta: how much their inputs differ), with
    Sigma = diag(j^-1.2), 60 features, 10 classes, labels argmax(W_i x + b_i), and
    n_i = floor(lognormal(4, 2)) + 50 samples, of which the first 90 % train and the rest join the
    test set, as in FedProx's generator. Drawn in that order from ``numpy.random.default_rng(seed)``
    (a seeded generator instead of FedProx's global one): the same seed and M give the same data.
``Quadratic``
    Heterogeneous least squares, a quadratic with closed-form x*, f* and G_*: machine i's inputs
    a ~ N(mu_i, I) with mu_i ~ N(0, heterogeneity^2 I), targets y = a . theta_i + noise * N(0, 1)
    with theta_i = theta_0 + heterogeneity * N(0, I), theta_0 ~ N(0, I); ``samples`` samples per
    machine and ``test_samples`` more per machine for the test set, all from
    ``numpy.random.default_rng(seed)``. One output, squared loss.
``StdlibChars(context, stride)``
    A character-level language model: the sources of 16 Python standard-library modules (CPython 3.11.7,
    shipped in ``data/stdlib/`` with their SHA-256 sums and the PSF licence), printable ASCII and newline,
    96 characters (any other reads as ``?``). A sample is a window of ``context`` characters, its targets the
    same window shifted by one (``next_token``: the loss is the mean cross-entropy over the window's
    positions, the metric bits per character, ``test_bpc``). Each module's first 90 % give the training
    windows (one every ``stride`` characters), its last 10 % the test windows (one every ``context``); the
    training windows are split over the machines by the data module's Dirichlet split
    (``data.dirichlet_alpha``, ``data.split``) over their module, the label. Model: ``model.arch=transformer``.
    The corpus is read from ``<data.root>/stdlib/``, else from the clone's ``data/stdlib/`` (``stdlib_folder``;
    an install made with ``pip install .`` has no clone: point ``data.root`` at a folder holding ``stdlib/``).
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Optional

import numpy as np
import torch
from torch import Tensor

from lit_slowcal._validation import check_int, check_number

__all__ = ["MNIST", "PROBLEMS", "Problem", "ProblemData", "Quadratic", "StdlibChars", "Synthetic"]


@dataclass(frozen=True)
class ProblemData:
    """A problem's samples for M machines: float32 inputs ``(N, d)``, labels (int64) or targets
    (float32) ``(N,)`` (``next_token``: every position's next character, ``(N, d)``), every machine's sample
    indices into them, and the test set."""

    train_x: Tensor
    train_y: Tensor
    shards: tuple[Tensor, ...]
    test_x: Tensor
    test_y: Tensor


class Problem:
    """One problem: what the data module, the model and the objective need to know of it.

    Subclasses set ``loss``, ``input_dim`` and ``num_outputs`` and implement ``_build``.
    """

    #: ``cross_entropy`` (labels, ``num_outputs`` classes), ``squared`` (real targets, one output) or
    #: ``next_token`` (a sequence of ``input_dim`` tokens, each position's next of ``num_outputs``).
    loss: ClassVar[str] = "cross_entropy"
    #: Whether f has an attained minimiser with ``model.weight_decay = 0`` (an excess loss needs one).
    attained_without_weight_decay: ClassVar[bool] = False
    input_dim: int
    num_outputs: int
    #: ``(height, width)`` when each input is an image (its pixels row by row), else ``None``: the training
    #: objective then orders the samples by the bounding boxes of their pixels (``lit_slowcal.experiments.measure.float64_product``).
    image: ClassVar[Optional[tuple[int, int]]] = None

    @property
    def name(self) -> str:
        return type(self).__name__

    def settings(self) -> dict[str, Any]:
        """The problem's own settings (its constructor's arguments): its identity in caches and logs."""
        return {k: v for k, v in vars(self).items() if not k.startswith("_")}

    def describe(self) -> str:
        args = ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in self.settings().items())
        return f"{self.name}({args})"

    def build(self, num_machines: int, seed: int, data: Any = None) -> ProblemData:
        """The samples for ``num_machines`` machines and ``seed`` (``data``: the data module, whose
        split settings MNIST uses). Built once per process for the same arguments."""
        check_int("num_machines", num_machines)
        return self._build(num_machines, seed, data)

    def _build(self, num_machines: int, seed: int, data: Any) -> ProblemData:
        raise NotImplementedError

    def train_size(self, num_machines: int, seed: int, data: Any = None) -> int:
        """N, the training samples one epoch covers for ``num_machines`` machines and ``seed``: the
        machines' shards together (the run's rounds per epoch follow from it, ``RunShape.rounds``)."""
        return sum(len(s) for s in self.build(num_machines, seed, data).shards)

    def __repr__(self) -> str:
        return self.describe()


class MNIST(Problem):
    """The paper's problem: MNIST, 784 -> 10 logistic regression, split by the data module's settings."""

    input_dim = 784
    num_outputs = 10
    image = (28, 28)
    #: The MNIST training set. An epoch covers all of it, whichever split leaves samples out of the shards.
    TRAIN_SIZE: ClassVar[int] = 60_000

    def train_size(self, num_machines: int, seed: int, data: Any = None) -> int:
        return self.TRAIN_SIZE

    def _build(self, num_machines: int, seed: int, data: Any) -> ProblemData:
        # The files and the split settings are the data module's (lit_slowcal.experiments.data.datamodule).
        if not callable(getattr(data, "mnist_data", None)):
            raise ValueError("MNIST is built by its data module: ProblemDataModule(problem=MNIST()), not on its own")
        return data.mnist_data(num_machines, seed)


def _rng(seed: int) -> np.random.Generator:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise ValueError(f"Invalid seed: {seed!r} (must be an integer)")
    return np.random.default_rng(int(seed) % 2**63)  # default_rng refuses negative seeds


def _assemble(
    parts: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]], label_dtype: torch.dtype
) -> ProblemData:
    """Per-machine (train x, train y, test x, test y) arrays -> one ``ProblemData``, machine after machine."""
    sizes = [len(p[1]) for p in parts]
    starts = np.concatenate([[0], np.cumsum(sizes)])
    shards = tuple(torch.arange(int(a), int(b)) for a, b in zip(starts[:-1], starts[1:]))

    def cat(k: int, dtype: torch.dtype) -> Tensor:
        return torch.from_numpy(np.concatenate([p[k] for p in parts])).to(dtype)

    return ProblemData(cat(0, torch.float32), cat(1, label_dtype), shards, cat(2, torch.float32), cat(3, label_dtype))


@functools.lru_cache(maxsize=8)
def _synthetic(alpha: float, beta: float, dim: int, classes: int, machines: int, seed: int) -> ProblemData:
    rng = _rng(seed)
    sizes = rng.lognormal(4, 2, machines).astype(np.int64) + 50
    mean_w = rng.normal(0, alpha, machines)  # u_i, also the mean of b_i
    big_b = rng.normal(0, beta, machines)
    std_x = np.arange(1, dim + 1, dtype=np.float64) ** -0.6  # Sigma = diag(j^-1.2)
    mean_x = np.stack([rng.normal(big_b[i], 1, dim) for i in range(machines)])
    parts = []
    for i in range(machines):
        w = rng.normal(mean_w[i], 1, (dim, classes))
        b = rng.normal(mean_w[i], 1, classes)
        x = mean_x[i] + rng.standard_normal((sizes[i], dim)) * std_x
        y = np.argmax(x @ w + b, axis=1)
        n_train = int(0.9 * sizes[i])
        parts.append((x[:n_train], y[:n_train], x[n_train:], y[n_train:]))
    return _assemble(parts, torch.int64)


class Synthetic(Problem):
    """Synthetic(alpha, beta) of Li et al. 2020 (FedProx), generated from the seed (see the module docstring).

    Args:
        alpha: spread of the machines' labelling models (0: alike).
        beta: spread of the machines' input distributions (0: alike).
        dim: input features (60 in FedProx).
        num_classes: classes (10 in FedProx).
    """

    def __init__(self, alpha: float = 1.0, beta: float = 1.0, dim: int = 60, num_classes: int = 10) -> None:
        self.alpha = float(check_number("data.problem.alpha", alpha, strict=False))
        self.beta = float(check_number("data.problem.beta", beta, strict=False))
        self.dim = check_int("data.problem.dim", dim)
        self.num_classes = check_int("data.problem.num_classes", num_classes, minimum=2)

    @property
    def input_dim(self) -> int:  # type: ignore[override]
        return self.dim

    @property
    def num_outputs(self) -> int:  # type: ignore[override]
        return self.num_classes

    def _build(self, num_machines: int, seed: int, data: Any) -> ProblemData:
        return _synthetic(self.alpha, self.beta, self.dim, self.num_classes, num_machines, seed)


@functools.lru_cache(maxsize=8)
def _quadratic(
    dim: int, heterogeneity: float, noise: float, samples: int, test_samples: int, machines: int, seed: int
) -> ProblemData:
    rng = _rng(seed)
    theta0 = rng.standard_normal(dim)
    parts = []
    for _ in range(machines):
        mu = heterogeneity * rng.standard_normal(dim)
        theta = theta0 + heterogeneity * rng.standard_normal(dim)
        a = mu + rng.standard_normal((samples + test_samples, dim))
        y = a @ theta + noise * rng.standard_normal(samples + test_samples)
        parts.append((a[:samples], y[:samples], a[samples:], y[samples:]))
    return _assemble(parts, torch.float32)


class Quadratic(Problem):
    """Heterogeneous least squares (see the module docstring): x*, f* and G_* in closed form.

    Args:
        dim: input features.
        heterogeneity: spread of the machines' input means and true models (0: every machine alike).
        noise: standard deviation of the target noise.
        samples: training samples per machine.
        test_samples: test samples per machine.
    """

    loss = "squared"
    attained_without_weight_decay = True  # f is strongly convex once a machine has >= dim + 1 samples
    num_outputs = 1

    def __init__(
        self, dim: int = 10, heterogeneity: float = 1.0, noise: float = 0.1, samples: int = 200, test_samples: int = 50
    ) -> None:
        self.dim = check_int("data.problem.dim", dim)
        self.heterogeneity = float(check_number("data.problem.heterogeneity", heterogeneity, strict=False))
        self.noise = float(check_number("data.problem.noise", noise, strict=False))
        self.samples = check_int("data.problem.samples", samples)
        self.test_samples = check_int("data.problem.test_samples", test_samples)

    @property
    def input_dim(self) -> int:  # type: ignore[override]
        return self.dim

    def train_size(self, num_machines: int, seed: int, data: Any = None) -> int:
        return check_int("num_machines", num_machines) * self.samples

    def _build(self, num_machines: int, seed: int, data: Any) -> ProblemData:
        return _quadratic(self.dim, self.heterogeneity, self.noise, self.samples, self.test_samples, num_machines, seed)


#: The corpus of ``StdlibChars`` in a clone of the repository: its ``data/stdlib/`` (the module sources as
#: ``<name>.py.txt``, their ``SHA256SUMS``, the PSF licence). An install made with ``pip install .`` does not copy it.
STDLIB_DIR = Path(__file__).resolve().parents[3] / "data" / "stdlib"
#: The SHA-256 of the corpus's ``SHA256SUMS``: a folder holds ``StdlibChars``'s corpus when its sums are these.
STDLIB_SUMS_SHA256 = "01fbe26f92e7628c2676a519c090141f49305518bcbbfca6ce144260199a73a2"
#: Printable ASCII and newline; any other character reads as ``?``.
VOCABULARY = "".join(chr(c) for c in range(32, 127)) + "\n"


def stdlib_folder(root: Optional[str | Path] = None) -> Path:
    """The folder holding the corpus: ``<root>/stdlib`` (``root``: the data module's ``data.root``), else the
    clone's ``STDLIB_DIR``; neither holding it, ``FileNotFoundError`` in one line naming both and ``data.root``."""
    candidates = ([Path(root) / "stdlib"] if root is not None else []) + [STDLIB_DIR]
    for folder in candidates:
        if (folder / "SHA256SUMS").is_file():
            return folder
    raise FileNotFoundError(
        f"StdlibChars's corpus (data/stdlib/ of the repository: SHA256SUMS and 16 module files) is not in "
        f"{' nor in '.join(str(c.absolute()) for c in candidates)}: set data.root to the folder that holds stdlib/ "
        "(a clone's data/; an install made with pip install . does not copy it)"
    )


def stdlib_documents(root: Optional[str | Path] = None) -> tuple[tuple[str, Tensor], ...]:
    """The corpus, found by ``stdlib_folder(root)`` and checked against ``SHA256SUMS`` (itself checked against
    ``STDLIB_SUMS_SHA256``): (module file, its characters' ids) in the sums' order. Read once per folder."""
    return _read_corpus(stdlib_folder(root).resolve())


@functools.lru_cache(maxsize=2)
def _read_corpus(folder: Path) -> tuple[tuple[str, Tensor], ...]:
    listing = (folder / "SHA256SUMS").read_bytes()
    if hashlib.sha256(listing).hexdigest() != STDLIB_SUMS_SHA256:
        raise ValueError(
            f"Invalid corpus file: {folder / 'SHA256SUMS'} (its SHA-256 is not StdlibChars's {STDLIB_SUMS_SHA256}: "
            "another corpus; use the repository's data/stdlib/)"
        )
    sums = listing.decode().split()
    documents = []
    index = {c: i for i, c in enumerate(VOCABULARY)}
    unknown = index["?"]
    for digest, name in zip(sums[::2], sums[1::2]):
        raw = (folder / name).read_bytes()
        if hashlib.sha256(raw).hexdigest() != digest:
            raise ValueError(f"Invalid corpus file: {folder / name} (its SHA-256 is not SHA256SUMS's {digest})")
        ids = [index.get(c, unknown) for c in raw.decode("utf-8")]
        documents.append((name, torch.tensor(ids, dtype=torch.int64)))
    return tuple(documents)


def _test_part(ids: Tensor) -> Tensor:
    """A module's test part: its last 10 % (the training windows come from the first 90 %, one more id for targets)."""
    return ids[int(0.9 * len(ids)) :]


def check_context(context: int, documents: tuple[tuple[str, Tensor], ...]) -> int:
    """``context`` if every module's test part holds a window of it and its targets, else ``ValueError`` in one line
    naming the largest allowed and the module that bounds it."""
    name, part = min(((name, _test_part(ids)) for name, ids in documents), key=lambda d: len(d[1]))
    largest = len(part) - 1
    if context > largest:
        raise ValueError(
            f"Invalid data.problem.context: {context} (must be an integer >= 2 and <= {largest}: a window and its "
            f"targets must fit in every module's test part, the last 10 %; {name}'s holds {len(part)} characters)"
        )
    return context


def _windows(ids: Tensor, context: int, stride: int) -> tuple[Tensor, Tensor]:
    """Windows of ``context`` ids every ``stride``, and their targets (the next id of every position)."""
    x = ids[:-1].unfold(0, context, stride)
    return x, ids[1:].unfold(0, context, stride)[: len(x)]


@functools.lru_cache(maxsize=8)
def _stdlib_chars(
    documents: tuple[tuple[str, Tensor], ...],
    context: int,
    stride: int,
    machines: int,
    alpha: Optional[float],
    split: str,
    seed: int,
) -> ProblemData:
    from lit_slowcal.experiments.data.partition import partition

    train, test = [], []
    for label, (_, ids) in enumerate(documents):
        cut = int(0.9 * len(ids))
        x, y = _windows(ids[: cut + 1], context, stride)
        train.append((x, y, torch.full((len(x),), label)))
        test.append(_windows(_test_part(ids), context, context))
    x, y, labels = (torch.cat(parts) for parts in zip(*train))
    shards = partition(labels.numpy(), machines, alpha, split=split, seed=seed)
    return ProblemData(
        x.float(),
        y.contiguous(),
        tuple(torch.from_numpy(s) for s in shards),
        torch.cat([t[0] for t in test]).float(),
        torch.cat([t[1] for t in test]).contiguous(),
    )


class StdlibChars(Problem):
    """Next-character prediction on 16 Python standard-library modules (see the module docstring).

    Args:
        context: characters per window (the model's sequence length): from 2 to one less than the shortest
            module test part's characters (``check_context``, when the problem is built: before training).
        stride: characters between consecutive training windows.
    """

    loss = "next_token"
    num_outputs = len(VOCABULARY)

    def __init__(self, context: int = 64, stride: int = 4) -> None:
        self.context = check_int("data.problem.context", context, minimum=2)
        self.stride = check_int("data.problem.stride", stride)

    @property
    def input_dim(self) -> int:  # type: ignore[override]
        return self.context

    def _build(self, num_machines: int, seed: int, data: Any) -> ProblemData:
        # The corpus from the data module's root (data.root), else the clone's data/stdlib/ (stdlib_folder).
        documents = stdlib_documents(getattr(data, "root", None))
        check_context(self.context, documents)
        alpha = getattr(data, "dirichlet_alpha", None)
        split = getattr(data, "split", "dirichlet")
        return _stdlib_chars(documents, self.context, self.stride, num_machines, alpha, split, seed)


#: The problems by name (``--data.problem=<name>``).
PROBLEMS: dict[str, type[Problem]] = {cls.__name__: cls for cls in (MNIST, Synthetic, Quadratic, StdlibChars)}
