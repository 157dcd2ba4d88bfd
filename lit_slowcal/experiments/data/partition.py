"""Split a labelled data set over M machines: IID, or non-IID with a Dirichlet class skew.

The paper (Dahan & Levy, NeurIPS 2024, appendix "Data Distribution Across Workers") splits MNIST
over M in {16, 32, 64} machines with Dirichlet(alpha = 0.1) class proportions (Hsu et al., 2019).
Its code (github.com/dahan198/slowcal-sgd, ``split_dataset``) balances them with a procedure of its
own, which ``split="official"`` reproduces draw for draw. Every function here is pure numpy and
deterministic from its ``seed``, so every rank of a distributed run computes the same split
without communicating. What a split gives each machine is counted by ``class_counts``, written and
drawn by ``lit_slowcal.experiments.data.class_distribution``.

The splits of ``partition``
---------------------------
* ``alpha=None`` -- stratified IID, whatever ``split``. Each class's indices are shuffled and
  dealt round-robin, so every machine holds ``floor`` or ``ceil`` of ``n_c / M`` samples of each
  class ``c`` and ``floor`` or ``ceil`` of ``N / M`` samples in all.
* ``split="official"`` -- the paper code's procedure, drawn with
  ``np.random.RandomState(seed)`` in the code's order, so that a seed gives the very shards the
  code gives (with the labels in MNIST's file order). Over the classes ``c = 0 .. C-1`` (the
  sorted labels present):

  1. draw ``p_c ~ Dirichlet(alpha * 1_M)`` for every class at once (a ``(C, M)`` draw);
  2. place each class's proportions on machines greedily, class by class and, within a class,
     in the order drawn: proportion ``p_ci`` goes to the first machine ``k`` that has no share
     of class ``c`` yet and whose load (the sum of the shares it holds) is 0 or stays below
     ``C / M`` with it (``load + p_ci < C / M``); when none qualifies, to the machine without a
     share of ``c`` that has the smallest load (the first of equals);
  3. machine ``k``'s amount of class ``c`` is ``floor(share_ck * N / C)``: with N / C the
     average class size, not class ``c``'s own;
  4. class by class, shuffle the class's indices (``RandomState.permutation``) and deal
     consecutive runs of the amounts to machines ``0 .. M-1``; a run that passes the end of
     the class is cut there (later machines may get fewer, or none), and what is left of a
     class after the last machine is assigned to nobody.

  Samples are dropped (MNIST, M = 64, alpha = 0.1, seed 1: 58,809 of 60,000 assigned, shards
  of 108 to 3,637). The shares placed on one machine sum to about C / M, so machines hold
  about N / M samples, give or take a large share that had to go somewhere.
* ``split="balanced"`` -- same class skew, equal sizes. Machine ``m`` draws its class mix
  ``q_m ~ Dirichlet(alpha * 1_C)`` and has a quota of ``floor`` or ``ceil`` of ``N / M``
  samples. Machines fill their quotas in order from the unassigned pool: multinomial counts
  from ``q_m`` restricted to classes with samples left (renormalised), clipped to what is
  left, repeated until the quota is met.
* ``split="dirichlet"`` -- the plain split of Hsu et al. (2019), the paper's appendix. For each
  class ``c`` draw ``p_c ~ Dirichlet(alpha * 1_M)`` and cut class ``c``'s shuffled indices at
  the cumulative proportions ``p_c``. Machine sizes vary; the draw is repeated while some
  machine holds fewer than ``min_size`` samples.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from lit_slowcal._validation import check_int, is_int, is_number

__all__ = ["SPLITS", "partition", "class_counts"]

#: The Dirichlet splits ``partition`` draws (``alpha`` given): the paper code's procedure, equal
#: shard sizes, and the plain split of Hsu et al. (2019).
SPLITS: tuple[str, ...] = ("official", "balanced", "dirichlet")


def partition(
    labels: np.ndarray | Sequence[int],
    num_machines: int,
    alpha: float | None,
    *,
    split: str = "dirichlet",
    seed: int = 0,
    min_size: int = 1,
    max_retries: int = 100,
) -> list[np.ndarray]:
    """Split sample indices over ``num_machines`` machines (the module docstring describes each split).

    Parameters
    ----------
    labels : array_like of int, shape (N,)
        Class label of every sample; non-negative integers.
    num_machines : int
        Number of machines M, ``1 <= M <= N``.
    alpha : float or None
        Dirichlet concentration, a finite number ``> 0``; ``None`` for the stratified IID split (every
        machine holds ``floor`` or ``ceil`` of ``n_c / M`` samples of each class ``c``, and of ``N / M``
        in all). Smaller ``alpha`` means more skew: at ``alpha = 0.01`` a machine mostly holds one
        class, at ``alpha = 1000`` every machine's class mix is close to the global one.
    split : {"official", "balanced", "dirichlet"}, default "dirichlet"
        Which Dirichlet split ``alpha`` draws: the paper code's procedure, draw for draw (it drops
        some samples); a class skew with equal machine sizes; the plain split of Hsu et al. (2019),
        the paper's appendix. No effect when ``alpha`` is None.
    seed : int, default 0
        Seed of the ``np.random.default_rng`` that makes every draw (``np.random.RandomState`` for
        the official split, as the paper's code; a seed below 2**32); the global RNG is not used.
    min_size : int, default 1
        Least number of samples every machine must receive. The plain Dirichlet split redraws
        when a machine falls short; the official split, which draws once, raises.
    max_retries : int, default 100
        How many times the plain Dirichlet mode may redraw (at most ``1 + max_retries`` draws).

    Returns
    -------
    list of np.ndarray
        ``M`` sorted int64 index arrays. Each index in ``range(N)`` appears in exactly one of them
        (at most one for the official split, which leaves some out).

    Raises
    ------
    ValueError
        For a bad argument, or when a machine would get fewer than ``min_size`` samples (the plain
        Dirichlet split: after ``max_retries`` redraws; the official split, which draws once).

    Examples
    --------
    >>> import numpy as np
    >>> labels = np.repeat(np.arange(10), 100)
    >>> shards = partition(labels, num_machines=4, alpha=0.1, seed=0)
    >>> len(shards), sum(len(s) for s in shards)
    (4, 1000)
    >>> np.array_equal(np.sort(np.concatenate(shards)), np.arange(1000))
    True
    >>> sorted(len(s) for s in partition(labels, 3, alpha=None))
    [333, 333, 334]
    >>> [len(s) for s in partition(labels, 4, alpha=0.1, split="official", seed=1)]  # 988 of 1000
    [236, 353, 172, 227]
    """
    y = _check_labels(labels)
    num_machines, alpha, min_size, max_retries, seed = _check_arguments(
        y.size, num_machines, alpha, split, seed, min_size, max_retries
    )
    if alpha is not None and split == "official":
        shards = _official_split(y, num_machines, alpha, seed, min_size)
    else:
        rng = np.random.default_rng(seed)
        # Indices of every class present, each shuffled once: the pools all modes draw from.
        pools = [rng.permutation(np.flatnonzero(y == c)) for c in np.unique(y)]
        if alpha is None:
            shards = _iid(pools, num_machines, rng)
        elif split == "balanced":
            shards = _balanced_dirichlet(pools, num_machines, float(alpha), rng)
        else:
            shards = _dirichlet(pools, num_machines, float(alpha), rng, min_size, max_retries)
    return [np.sort(s).astype(np.int64, copy=False) for s in shards]


def _check_arguments(
    n: int, num_machines: Any, alpha: Any, split: Any, seed: Any, min_size: Any, max_retries: Any
) -> tuple[int, Any, int, int, int]:
    """``partition``'s arguments checked for ``n`` samples, numpy scalars as Python numbers:
    (num_machines, alpha, min_size, max_retries, seed)."""
    num_machines, alpha, min_size, max_retries, seed = (
        _plain(v) for v in (num_machines, alpha, min_size, max_retries, seed)
    )
    if not is_int(num_machines) or not 1 <= num_machines <= n:
        raise ValueError(
            f"Invalid num_machines: {num_machines!r} (must be an integer between 1 and the number of samples ({n}))"
        )
    if alpha is not None and not (is_number(alpha) and math.isfinite(alpha) and alpha > 0):
        raise ValueError(f"Invalid alpha: {alpha!r} (must be a finite number > 0, or None for IID)")
    check_int("min_size", min_size, minimum=0)
    if min_size * num_machines > n:
        raise ValueError(
            f"min_size={min_size} is impossible: {num_machines} machines x {min_size} samples > {n} samples"
        )
    check_int("max_retries", max_retries, minimum=0)
    if split not in SPLITS:
        raise ValueError(f"Invalid split: {split!r} (allowed: {', '.join(SPLITS)})")
    check_int("seed", seed, minimum=0)  # np.random.default_rng takes no negative seed
    return num_machines, alpha, min_size, max_retries, seed


def _official_split(y: np.ndarray, m: int, alpha: Any, seed: int, min_size: int) -> list[np.ndarray]:
    """The official split (``_official``) with its own RandomState, refused where a machine gets fewer
    than ``min_size`` samples (it draws once)."""
    if seed >= 2**32:
        raise ValueError(f"Invalid seed: {seed!r} (the official split's RandomState takes seeds < 2**32)")
    shards = _official(y, m, float(alpha), np.random.RandomState(seed))
    sizes = [s.size for s in shards]
    if min(sizes) < min_size:
        k = int(np.argmin(sizes))
        raise ValueError(
            f"the official split gives machine {k} {sizes[k]} samples, fewer than min_size={min_size} "
            f"(M={m}, alpha={alpha}, seed={seed}); use another seed, a larger alpha, fewer "
            "machines or another split"
        )
    return shards


def _iid(pools: list[np.ndarray], m: int, rng: np.random.Generator) -> list[np.ndarray]:
    # Laying the classes end to end and dealing position i to machine i mod M gives every
    # machine floor/ceil of each class *and* of the total; the machine order is shuffled so the
    # extra samples do not always land on the first machines.
    stacked = np.concatenate(pools)
    owner = rng.permutation(m)[np.arange(stacked.size) % m]
    order = np.argsort(owner, kind="stable")
    return np.split(stacked[order], np.cumsum(np.bincount(owner, minlength=m))[:-1])


def _dirichlet(
    pools: list[np.ndarray],
    m: int,
    alpha: float,
    rng: np.random.Generator,
    min_size: int,
    max_retries: int,
) -> list[np.ndarray]:
    for _ in range(1 + max_retries):
        pieces: list[list[np.ndarray]] = [[] for _ in range(m)]
        for pool in pools:
            p = rng.dirichlet(np.full(m, alpha))
            cuts = (np.cumsum(p)[:-1] * pool.size).astype(np.int64)
            for k, piece in enumerate(np.split(pool, cuts)):
                pieces[k].append(piece)
        shards = [np.concatenate(ps) for ps in pieces]
        smallest = min(s.size for s in shards)
        if smallest >= min_size:
            return shards
    raise ValueError(
        f"could not give each of {m} machines at least min_size={min_size} samples with "
        f"alpha={alpha} in {1 + max_retries} draws (smallest machine got {smallest}); "
        "use a larger alpha, fewer machines, a smaller min_size or another split"
    )


def _official(y: np.ndarray, m: int, alpha: float, rs: np.random.RandomState) -> list[np.ndarray]:
    # The paper code's split_dataset, draw for draw (see partition's docstring). Every float is
    # computed by the same numpy operation on the same values as there, so that comparisons on the
    # edge (load + p < C / M) and the floors come out the same.
    classes = np.unique(y)
    num_classes, n = classes.size, y.size
    proportions = rs.dirichlet(np.full(m, alpha), num_classes)  # (C, M), row c for class c
    share = np.zeros_like(proportions)  # share[c, k]: class c's proportion placed on machine k
    load = np.zeros(m)  # load[k] = share[:, k].sum(), kept up to date
    threshold = num_classes / m
    for c in range(num_classes):
        for p in proportions[c]:
            free = share[c] == 0
            fits = free & ((load + p < threshold) | (load == 0))
            if fits.any():
                k = int(np.argmax(fits))
            else:
                candidates = np.flatnonzero(free)
                k = int(candidates[np.argmin(share[:, candidates].sum(axis=0))])
            share[c, k] = p
            load[k] = share[:, k].sum()
    amounts = (share * n // num_classes).astype(np.int64)
    pieces: list[list[np.ndarray]] = [[] for _ in range(m)]
    for c, label in enumerate(classes):
        pool = rs.permutation(np.flatnonzero(y == label))
        ends = np.minimum(np.cumsum(amounts[c]), pool.size)
        for k, (start, end) in enumerate(zip(np.concatenate(([0], ends[:-1])), ends)):
            pieces[k].append(pool[start:end])
    return [np.concatenate(p) for p in pieces]


def _balanced_dirichlet(pools: list[np.ndarray], m: int, alpha: float, rng: np.random.Generator) -> list[np.ndarray]:
    n = sum(pool.size for pool in pools)
    num_classes = len(pools)
    quotas = np.full(m, n // m)
    quotas[: n % m] += 1
    mixes = rng.dirichlet(np.full(num_classes, alpha), size=m)
    supply = np.array([pool.size for pool in pools])
    taken = np.zeros(num_classes, dtype=np.int64)  # pool[c][:taken[c]] is assigned
    shards = []
    for k in range(m):
        need = int(quotas[k])
        got = np.zeros(num_classes, dtype=np.int64)
        # Each pass either fills the quota or exhausts at least one class (its count got
        # clipped), so it ends within num_classes passes; total supply always covers it.
        while need > 0:
            left = supply - taken - got
            q = np.where(left > 0, mixes[k], 0.0)
            if q.sum() <= 0.0:
                # Tiny alpha can put all of q_m's mass on exhausted classes (or underflow to
                # exact zeros); fall back to drawing in proportion to what is left.
                q = left.astype(np.float64)
            draw = np.minimum(rng.multinomial(need, q / q.sum()), left)
            got += draw
            need -= int(draw.sum())
        shards.append(np.concatenate([pools[c][taken[c] : taken[c] + got[c]] for c in range(num_classes)]))
        taken += got
    return shards


def class_counts(
    labels: np.ndarray | Sequence[int],
    shards: Sequence[np.ndarray],
    num_classes: int | None = None,
) -> np.ndarray:
    """Count the samples of each class on each machine.

    Parameters
    ----------
    labels : array_like of int, shape (N,)
        Class label of every sample; non-negative integers.
    shards : sequence of array_like of int
        One index array per machine, as returned by :func:`partition`.
    num_classes : int, optional
        Number of classes C; defaults to ``max(labels) + 1``.

    Returns
    -------
    np.ndarray of int64, shape (M, C)
        ``counts[m, c]`` is the number of samples of class ``c`` on machine ``m``.

    Examples
    --------
    >>> class_counts([0, 1, 1, 2], [[0, 1], [2, 3]])
    array([[1, 1, 0],
           [0, 1, 1]])
    """
    y = _check_labels(labels)
    smallest = int(y.max()) + 1
    num_classes = smallest if num_classes is None else _plain(num_classes)
    if not is_int(num_classes) or num_classes < smallest:
        raise ValueError(f"Invalid num_classes: {num_classes!r} (must be an integer >= max(labels) + 1 = {smallest})")
    counts = np.zeros((len(shards), int(num_classes)), dtype=np.int64)
    for k, shard in enumerate(shards):
        counts[k] = np.bincount(y[np.asarray(shard, dtype=np.int64)], minlength=num_classes)
    return counts


def _plain(value: Any) -> Any:
    """A numpy scalar as the Python int or float it holds (so ``np.int64(4)`` is an integer here);
    anything else unchanged. ``np.bool_`` stays itself, and is refused where a number is wanted."""
    if isinstance(value, (np.integer, np.floating)):
        return value.item()
    return value


def _check_labels(labels: np.ndarray | Sequence[int]) -> np.ndarray:
    y = np.asarray(labels)
    if y.ndim != 1:
        raise ValueError(f"labels must be a 1-D array, got shape {y.shape}")
    if y.size == 0:
        raise ValueError("labels must not be empty")
    if not np.issubdtype(y.dtype, np.integer):
        raise ValueError(f"labels must be integers, got dtype {y.dtype}")
    if y.min() < 0:
        raise ValueError(f"labels must be non-negative, got {y.min()}")
    return y
