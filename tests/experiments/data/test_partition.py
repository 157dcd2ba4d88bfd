"""Tests for lit_slowcal.experiments.data.partition on synthetic MNIST-shaped labels (10 classes x 6000),
and the official split on a small label set worked out by hand and on MNIST's own labels."""

import gzip
import math
from pathlib import Path

import numpy as np
import pytest

from lit_slowcal.experiments.data.class_distribution import plot_class_distribution, write_class_counts
from lit_slowcal.experiments.data.partition import class_counts, partition

N, C = 60_000, 10


@pytest.fixture(scope="module")
def labels():
    return np.random.default_rng(1234).permutation(np.repeat(np.arange(C), N // C))


def assert_exact_partition(shards, n):
    assert all(s.dtype == np.int64 for s in shards)
    assert all(np.all(np.diff(s) > 0) for s in shards)  # sorted, no repeats within a shard
    np.testing.assert_array_equal(np.sort(np.concatenate(shards)), np.arange(n))


MODES = {
    "iid": dict(alpha=None),
    "dirichlet": dict(alpha=0.1),
    "balanced": dict(alpha=0.1, split="balanced"),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("m", [1, 16, 64])
def test_exact_partition_in_every_mode(labels, mode, m):
    shards = partition(labels, m, seed=3, **MODES[mode])
    assert len(shards) == m
    assert sum(len(s) for s in shards) == N
    assert_exact_partition(shards, N)


@pytest.mark.parametrize("mode", MODES)
def test_same_seed_same_split_other_seed_other_split(labels, mode):
    a = partition(labels, 16, seed=7, **MODES[mode])
    b = partition(labels, 16, seed=7, **MODES[mode])
    c = partition(labels, 16, seed=8, **MODES[mode])
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))


def test_does_not_touch_global_rng(labels):
    np.random.seed(0)
    before = np.random.random()
    np.random.seed(0)
    partition(labels, 16, 0.1, seed=1)
    partition(labels, 16, 0.1, split="balanced", seed=1)
    partition(labels, 16, 0.1, split="official", seed=1)
    assert np.random.random() == before


@pytest.mark.parametrize("split", ["dirichlet", "balanced"])
def test_alpha_1000_is_near_uniform(labels, split):
    # Global class proportions are 0.1 each.
    counts = class_counts(labels, partition(labels, 16, 1000.0, split=split, seed=0))
    share = counts / counts.sum(axis=1, keepdims=True)
    deviation = np.abs(share - 0.1).max(axis=1)
    if split == "balanced":
        # Machines fill their quotas in order, so the last one takes what is left and collects
        # the earlier machines' sampling noise: measured ~0.01 for the others, up to ~0.06 for it.
        assert np.all(deviation[:-1] <= 0.03)
        assert deviation[-1] <= 0.08
    else:
        assert np.all(deviation <= 0.02)  # measured <= 0.012 over 10 seeds


def test_alpha_001_gives_mostly_one_class_per_machine(labels):
    # Plain mode at alpha=0.01 sends nearly all of a class to one machine; with M=16 > C=10 some
    # machines get nothing (hence min_size=0) and some get two whole classes, so the check is
    # pooled over seeds: on most non-empty machines (>= 50%; measured ~69%) one class holds
    # >= 90% of the samples, and the mean effective number of classes (1 / sum of squared
    # shares) is below 2 (measured ~1.35; it is ~10 for IID).
    dominant, effective = [], []
    for seed in range(5):
        counts = class_counts(labels, partition(labels, 16, 0.01, seed=seed, min_size=0))
        counts = counts[counts.sum(axis=1) > 0]
        share = counts / counts.sum(axis=1, keepdims=True)
        dominant.extend(share.max(axis=1))
        effective.extend(1.0 / (share**2).sum(axis=1))
    assert np.mean(np.array(dominant) >= 0.9) >= 0.5
    assert np.mean(effective) < 2.0

    iid = class_counts(labels, partition(labels, 16, None))
    iid_share = iid / iid.sum(axis=1, keepdims=True)
    assert np.all(1.0 / (iid_share**2).sum(axis=1) > 9.9)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("m", [16, 32, 64])
@pytest.mark.parametrize("min_size", [1, 10])
def test_min_size_respected_at_paper_alpha(labels, m, seed, min_size):
    shards = partition(labels, m, 0.1, seed=seed, min_size=min_size)
    assert min(len(s) for s in shards) >= min_size
    assert_exact_partition(shards, N)


def test_too_few_retries_raises():
    # 1024 machines, 10 classes, alpha=0.1: tens of machines get nothing in every draw.
    y = np.repeat(np.arange(C), 600)
    with pytest.raises(ValueError, match=r"min_size=1 .*alpha=0.1 in 3 draws.*larger alpha"):
        partition(y, 1024, 0.1, max_retries=2)
    assert len(partition(y, 1024, 0.1, min_size=0)) == 1024  # allowed when empty machines are


@pytest.mark.parametrize("m", [16, 64, 1000])
def test_balanced_sizes_are_quotas(labels, m):
    shards = partition(labels, m, 0.1, split="balanced", seed=0)
    sizes = np.array([len(s) for s in shards])
    assert sizes.min() >= N // m and sizes.max() <= math.ceil(N / m)
    assert np.all(np.abs(sizes - N / m) <= 0.1 * N / m)
    assert_exact_partition(shards, N)


def test_balanced_keeps_skew(labels):
    for m in (16, 64):
        counts = class_counts(labels, partition(labels, m, 0.1, split="balanced", seed=0))
        dominant = counts.max(axis=1) / counts.sum(axis=1)
        assert dominant.mean() >= 0.5  # measured 0.53..0.75; IID would give 0.1
        iid = class_counts(labels, partition(labels, m, None, seed=0))
        assert (iid.max(axis=1) / iid.sum(axis=1)).max() < 0.11


@pytest.mark.parametrize("alpha", [0.05, 1e-3])
def test_balanced_handles_uneven_classes(alpha):
    # Class 0 is 90% of the data, so machines drawing the small classes run out of them. At
    # alpha=1e-3 the mixes q_m are one-hot in floating point, so a machine whose only class is
    # exhausted has no mass left and must fall back to drawing in proportion to the supply.
    y = np.concatenate([np.zeros(900, dtype=int), np.repeat(np.arange(1, 5), 25)])
    shards = partition(y, 7, alpha, split="balanced", seed=2)
    assert [len(s) for s in shards] == [143, 143, 143, 143, 143, 143, 142]
    assert_exact_partition(shards, 1000)


@pytest.mark.parametrize("m", [16, 7, 64])
def test_iid_is_stratified(labels, m):
    shards = partition(labels, m, None, seed=5)
    counts = class_counts(labels, shards)
    assert np.all(np.abs(counts - (N // C) / m) < 1)  # floor or ceil of 6000 / m per class
    sizes = counts.sum(axis=1)
    assert sizes.min() >= N // m and sizes.max() <= math.ceil(N / m)
    assert_exact_partition(shards, N)


def test_iid_with_uneven_classes_and_gaps():
    y = np.array([0] * 7 + [3] * 5 + [9] * 2)  # classes 1, 2, 4..8 absent
    shards = partition(y, 3, None, seed=0)
    counts = class_counts(y, shards)
    assert counts.shape == (3, 10)
    np.testing.assert_array_equal(counts.sum(axis=0)[[0, 3, 9]], [7, 5, 2])
    assert np.all(np.abs(counts[:, [0, 3, 9]] - np.array([7, 5, 2]) / 3) < 1)
    assert sorted(counts.sum(axis=1)) == [4, 5, 5]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_machines=0), r"Invalid num_machines: 0 \(must be an integer between 1 and"),
        (dict(num_machines=101), r"Invalid num_machines: 101 .*number of samples \(100\)\)"),
        (dict(num_machines=2.0), r"Invalid num_machines: 2.0 \(must be an integer"),
        (dict(num_machines=True), r"Invalid num_machines: True"),
        (dict(alpha=0.0), r"Invalid alpha: 0.0 \(must be a finite number > 0, or None for IID\)"),
        (dict(alpha=-1), r"Invalid alpha: -1 "),
        (dict(alpha=float("inf")), r"Invalid alpha: inf "),
        (dict(alpha=float("nan")), r"Invalid alpha: nan "),
        (dict(alpha="0.1"), r"Invalid alpha: '0.1' "),
        (dict(alpha=np.float32(-0.5)), r"Invalid alpha: -0.5 "),
        (dict(min_size=-1), r"Invalid min_size: -1 \(must be an integer >= 0\)"),
        (dict(min_size=11), r"min_size=11 is impossible: 10 machines x 11 samples > 100"),
        (dict(max_retries=-1), r"Invalid max_retries: -1 \(must be an integer >= 0\)"),
        (dict(split="plain"), r"Invalid split: 'plain' \(allowed: official, balanced, dirichlet\)"),
        (
            dict(split="official", seed=2**32),
            r"Invalid seed: 4294967296 \(the official split's RandomState takes seeds < 2\*\*32\)",
        ),
        (dict(seed=-1), r"Invalid seed: -1 \(must be an integer >= 0\)"),
        (dict(seed=1.5), r"Invalid seed: 1.5 "),
        (
            dict(labels=np.zeros((10, 10), dtype=int)),
            r"labels must be a 1-D array, got shape \(10, 10\)",
        ),
        (dict(labels=np.array([], dtype=int)), r"labels must not be empty"),
        (dict(labels=np.linspace(0, 1, 100)), r"labels must be integers, got dtype float64"),
        (dict(labels=np.arange(100) - 1), r"labels must be non-negative, got -1"),
    ],
)
def test_bad_arguments(kwargs, match):
    args = dict(labels=np.arange(100) % 10, num_machines=10, alpha=0.1)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        partition(args.pop("labels"), args.pop("num_machines"), args.pop("alpha"), **args)


def test_numpy_scalars_are_accepted(labels):
    plain = partition(labels, 16, 0.1, seed=3, min_size=1, max_retries=5)
    numpy = partition(
        labels, np.int64(16), np.float64(0.1), seed=np.int32(3), min_size=np.int8(1), max_retries=np.uint8(5)
    )
    assert all(np.array_equal(a, b) for a, b in zip(plain, numpy))


# ------------------------------------------------------------------ the official split


def test_official_split_by_hand():
    """Classes of 13, 7 and 10 samples (N = 30, C = 3) over M = 3 machines, alpha = 1, seed 1.

    RandomState(1).dirichlet([1, 1, 1], 3) draws, one row per class (checked below to 4 places):
        class 0: 0.2975 0.7024 0.0001
        class 1: 0.5848 0.2578 0.1574
        class 2: 0.1815 0.3734 0.4451
    Greedy placement, threshold C / M = 1, loads in brackets:
        class 0: 0.2975 -> m0 (load 0); 0.7024 -> m1 (m0 holds class 0; m1 load 0); 0.0001 -> m2.
                 [0.2975, 0.7024, 0.0001]
        class 1: 0.5848 -> m0 (0.2975 + 0.5848 = 0.8823 < 1); 0.2578 -> m1 (0.9602 < 1);
                 0.1574 -> m2.  [0.8823, 0.9602, 0.1575]
        class 2: 0.1815 -> m2 (m0: 1.0638, m1: 1.1417 do not fit; m2: 0.3390 does);
                 0.3734: no machine without class 2 fits (m0: 1.2557, m1: 1.3336) -> the one with
                 the smaller load, m0; 0.4451 -> m1, the last without class 2.
    Amounts floor(share * N / C) = floor(share * 10):
        class 0: m0 2, m1 7, m2 0 -> 9 of 13 dealt, 4 left out
        class 1: m0 5, m1 2, m2 1 -> the class has 7: m2's run starts at its end and gets 0
        class 2: m0 3, m1 4, m2 1 -> 8 of 10 dealt, 2 left out
    Shards: m0 2 + 5 + 3 = 10, m1 7 + 2 + 4 = 13, m2 0 + 0 + 1 = 1; 24 of 30 samples.
    """
    y = np.array([0] * 13 + [1] * 7 + [2] * 10)
    y = y[np.random.default_rng(0).permutation(y.size)]  # classes interleaved
    rs = np.random.RandomState(1)
    drawn = rs.dirichlet(np.ones(3), 3)
    np.testing.assert_allclose(
        drawn, [[0.2975, 0.7024, 0.0001], [0.5848, 0.2578, 0.1574], [0.1815, 0.3734, 0.4451]], atol=6e-5
    )
    shards = partition(y, 3, 1.0, split="official", seed=1)
    assert [len(s) for s in shards] == [10, 13, 1]
    np.testing.assert_array_equal(class_counts(y, shards), [[2, 5, 3], [7, 2, 4], [0, 0, 1]])
    # Which samples: each class's indices shuffled by the same RandomState after the proportions,
    # dealt in runs of the amounts above to machines 0, 1, 2.
    amounts = [[2, 7, 0], [5, 2, 1], [3, 4, 1]]
    expected = [[], [], []]
    for c in range(3):
        pool = rs.permutation(np.flatnonzero(y == c))
        start = 0
        for k in range(3):
            expected[k] += list(pool[start : start + amounts[c][k]])
            start += amounts[c][k]
    for got, want in zip(shards, expected):
        np.testing.assert_array_equal(got, np.sort(want))


def test_official_split_is_determined_by_the_seed(labels):
    a = partition(labels, 16, 0.1, split="official", seed=7)
    b = partition(labels, 16, 0.1, split="official", seed=7)
    c = partition(labels, 16, 0.1, split="official", seed=8)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))
    for shards in (a, c):  # disjoint, sorted, some left out
        assert all(s.dtype == np.int64 and np.all(np.diff(s) > 0) for s in shards)
        every = np.concatenate(shards)
        assert np.unique(every).size == every.size and every.min() >= 0 and every.max() < N
        assert N - 1000 < every.size < N


def mnist_train_labels() -> np.ndarray:
    """MNIST's 60,000 training labels in file order, read from the shipped IDX file."""
    path = Path(__file__).parents[3] / "data" / "MNIST" / "raw" / "train-labels-idx1-ubyte.gz"
    with gzip.open(path, "rb") as f:
        return np.frombuffer(f.read(), dtype=np.uint8, offset=8).astype(np.int64)


def test_official_split_check_figure_on_mnist():
    """The paper code's split on MNIST, M = 64, alpha = 0.1, seed 1 (issue 11's check figure):
    58,809 of the 60,000 training images assigned, shards of 108 to 3,637."""
    y = mnist_train_labels()
    shards = partition(y, 64, 0.1, split="official", seed=1)
    sizes = [len(s) for s in shards]
    assert (sum(sizes), min(sizes), max(sizes)) == (58_809, 108, 3_637)
    counts = class_counts(y, shards)
    assert np.all(counts.sum(axis=0) <= np.bincount(y))


def test_official_split_refuses_an_empty_machine():
    # 1024 machines and 10 classes of 600: the greedy placement leaves tens of machines empty.
    y = np.repeat(np.arange(C), 600)
    with pytest.raises(ValueError, match=r"the official split gives machine \d+ 0 samples, fewer than min_size=1"):
        partition(y, 1024, 0.1, split="official", seed=0)
    shards = partition(y, 1024, 0.1, split="official", seed=0, min_size=0)
    assert len(shards) == 1024 and min(len(s) for s in shards) == 0


def test_write_class_counts(tmp_path):
    counts = np.array([[2, 5, 3], [7, 2, 4], [0, 0, 1]])
    path = tmp_path / "class_counts.csv"
    write_class_counts(counts, path)
    lines = path.read_text().splitlines()
    assert lines[0] == "machine,class,count"
    rows = [tuple(map(int, line.split(","))) for line in lines[1:]]
    assert rows == [(k, c, int(counts[k, c])) for k in range(3) for c in range(3)]
    with pytest.raises(ValueError, match=r"counts must be a 2-D \(machines, classes\) array, got shape \(3,\)"):
        write_class_counts(np.array([1, 2, 3]), path)
    assert path.read_text().splitlines() == lines  # a refused write leaves the file as it was


def test_class_counts_small_example():
    y = np.array([0, 2, 2, 1, 0, 2, 1])
    shards = [np.array([0, 1, 2]), np.array([3, 6]), np.array([4, 5]), np.array([], dtype=np.int64)]
    expected = np.array([[1, 0, 2], [0, 2, 0], [1, 0, 1], [0, 0, 0]])
    np.testing.assert_array_equal(class_counts(y, shards), expected)
    np.testing.assert_array_equal(class_counts(y, shards, num_classes=5)[:, 3:], np.zeros((4, 2)))
    with pytest.raises(ValueError, match=r"Invalid num_classes: 2 \(must be an integer >= max\(labels\) \+ 1 = 3\)"):
        class_counts(y, shards, num_classes=2)
    np.testing.assert_array_equal(class_counts(y, shards, num_classes=np.int64(3)), expected)


def test_plot_class_distribution(labels, tmp_path):
    counts = class_counts(labels, partition(labels, 16, 0.1, seed=0))
    path = tmp_path / "figs" / "dist.png"
    title = "Class distribution across 16 machines (Dirichlet alpha=0.1)"
    fig = plot_class_distribution(counts, path, title=title)

    data = path.read_bytes()
    assert len(data) > 1000 and data[:8] == b"\x89PNG\r\n\x1a\n"
    (ax,) = fig.axes
    (points,) = ax.collections
    offsets = np.asarray(points.get_offsets())
    assert len(offsets) == np.count_nonzero(counts)
    machine, cls = offsets[:, 0].astype(int), offsets[:, 1].astype(int)
    np.testing.assert_array_equal(np.sort(counts[machine, cls]), np.sort(counts[counts > 0]))
    sizes = points.get_sizes()
    np.testing.assert_allclose(sizes / sizes.max(), counts[machine, cls] / counts.max())
    assert ax.get_xlabel() == "Machine" and ax.get_ylabel() == "Class"
    assert ax.get_title() == title
    np.testing.assert_array_equal(ax.get_yticks(), np.arange(C))


def test_plot_without_path_returns_figure():
    fig = plot_class_distribution(np.array([[5, 0], [1, 3]]))
    assert len(fig.axes[0].collections[0].get_offsets()) == 3
    assert fig.axes[0].get_title() == "Class distribution across 2 machines"
