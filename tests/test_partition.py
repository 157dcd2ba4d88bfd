"""Tests for lit_slowcal.experiments.partition on synthetic MNIST-shaped labels (10 classes x 6000)."""

import math

import numpy as np
import pytest

from lit_slowcal.experiments.partition import class_counts, partition, plot_class_distribution

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
        (dict(split="official", seed=2**32), r"Invalid seed: 4294967296 \(the official split's RandomState takes seeds < 2\*\*32\)"),
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
