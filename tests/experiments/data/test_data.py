"""Tests for lit_slowcal.experiments.data.datamodule, .mnist and .streams: loading MNIST, per-machine streams and the data module."""

import gzip
import math
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torchvision
from helpers import BARRIER, REPO, subprocess_env

import lit_slowcal.experiments.data.datamodule as data_module
from lit_slowcal.experiments.data.class_distribution import plot_class_distribution
from lit_slowcal.experiments.data.datamodule import ProblemDataModule, partition_shards
from lit_slowcal.experiments.data.mnist import MNIST_MEAN, MNIST_STD, load_mnist
from lit_slowcal.experiments.data.partition import partition
from lit_slowcal.experiments.data.streams import MachineStreams

DATA = Path(__file__).parents[3] / "data"
FILES = ["train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"]
TRAIN_COUNTS = [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]
TEST_COUNTS = [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]


@pytest.fixture(scope="module")
def mnist():
    return load_mnist(DATA)


@pytest.fixture
def cached_mnist(mnist, monkeypatch):
    """Make the data module reuse the module's MNIST tensors instead of reading the files again."""
    calls = []

    def fake_load(root):
        calls.append(root)
        return mnist

    monkeypatch.setattr(data_module, "load_mnist", fake_load)
    return calls


@pytest.fixture
def raw_copy(tmp_path):
    """tmp_path/MNIST/raw holding copies of the four shipped .gz files only."""
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for name in FILES:
        shutil.copy(DATA / "MNIST" / "raw" / f"{name}.gz", raw / f"{name}.gz")
    return raw


# --------------------------------------------------------------------------- load_mnist


def test_load_mnist_shapes_dtypes_and_label_counts(mnist):
    x, y, tx, ty = mnist
    assert x.shape == (60000, 784) and y.shape == (60000,)
    assert tx.shape == (10000, 784) and ty.shape == (10000,)
    assert x.dtype == tx.dtype == torch.float32
    assert y.dtype == ty.dtype == torch.int64
    assert torch.bincount(y, minlength=10).tolist() == TRAIN_COUNTS
    assert torch.bincount(ty, minlength=10).tolist() == TEST_COUNTS
    # The first training image is a 5 and the first test image a 7.
    assert y[0].item() == 5 and ty[0].item() == 7


def test_load_mnist_normalisation(mnist):
    x, _, tx, _ = mnist
    for images in (x, tx):
        pixels = images * MNIST_STD + MNIST_MEAN
        assert pixels.min().item() == pytest.approx(0.0, abs=1e-6)
        assert pixels.max().item() == pytest.approx(1.0, abs=1e-6)
    # Background pixels are 0, which normalise to -mean / std.
    assert x[0, 0].item() == pytest.approx(-0.1307 / 0.3081, rel=1e-6)

    rows = [0, 1, 12345, 59999]
    raw_train = torchvision.datasets.MNIST(str(DATA), train=True, download=False).data
    raw_test = torchvision.datasets.MNIST(str(DATA), train=False, download=False).data
    assert raw_train.dtype == torch.uint8
    for images, raw, idx in ((x, raw_train, rows), (tx, raw_test, [0, 9999])):
        expected = raw[idx].reshape(len(idx), -1).double() / 255.0
        torch.testing.assert_close((images[idx].double() * 0.3081 + 0.1307), expected, rtol=0, atol=1e-6)
        # Images are not blank: some pixels are ink.
        assert (raw[idx].reshape(len(idx), -1) > 128).sum(1).min().item() > 20


def test_load_mnist_decompresses_the_shipped_gz_files(raw_copy, mnist):
    loaded = load_mnist(raw_copy.parents[1])
    for name in FILES:
        assert (raw_copy / name).stat().st_size == (DATA / "MNIST" / "raw" / name).stat().st_size
    assert not list(raw_copy.glob("*.tmp"))
    for a, b in zip(loaded, mnist):
        assert torch.equal(a, b)


def test_wrong_size_file_is_refused(raw_copy):
    name = "train-labels-idx1-ubyte"
    (raw_copy / name).write_bytes(b"\x00\x00\x08\x01" + b"\x00" * 100)  # truncated: 104 bytes
    with pytest.raises(ValueError, match=name) as err:
        load_mnist(raw_copy.parents[1])
    message = str(err.value)
    assert "expected" in message
    assert "104 bytes" in message and str(8 + 60000) in message


def test_wrong_magic_number_is_refused(raw_copy):
    name = "t10k-labels-idx1-ubyte"
    good = (DATA / "MNIST" / "raw" / name).read_bytes()
    assert int.from_bytes(good[:4], "big") == 2049
    (raw_copy / name).write_bytes((2051).to_bytes(4, "big") + good[4:])  # right size, image magic
    with pytest.raises(ValueError, match="magic") as err:
        load_mnist(raw_copy.parents[1])
    message = str(err.value)
    assert name in message
    assert "2051" in message and "expected 2049" in message


@pytest.mark.parametrize("corruption", ["garbage", "truncated"])
def test_corrupt_gz_is_refused(raw_copy, corruption):
    name = "train-labels-idx1-ubyte"
    gz = raw_copy / f"{name}.gz"
    if corruption == "garbage":
        gz.write_bytes(b"this is not a gzip file" * 10)
    else:
        gz.write_bytes(gz.read_bytes()[:1000])
    with pytest.raises(ValueError, match=f"{name}.gz"):
        load_mnist(raw_copy.parents[1])
    # Nothing half-written is left behind under the decompressed name.
    assert not (raw_copy / name).exists()
    assert not list(raw_copy.glob("*.tmp"))


def test_missing_files_say_where_to_put_them(tmp_path, monkeypatch):
    def no_download(self):
        raise RuntimeError("no network in this test")

    monkeypatch.setattr(torchvision.datasets.MNIST, "download", no_download)
    with pytest.raises(FileNotFoundError) as err:
        load_mnist(tmp_path)
    message = str(err.value)
    assert str(tmp_path / "MNIST" / "raw") in message
    assert "MNIST/raw" in message
    for name in FILES:
        assert f"{name}.gz" in message
    assert "no network in this test" in message
    assert "data.root" in message


# --------------------------------------------------------------------------- MachineStreams

# 15 synthetic samples; x[j] = (j, -j) and y[j] = j, so a label names its sample.
N = 15
X = torch.stack([torch.arange(N, dtype=torch.float32), -torch.arange(N, dtype=torch.float32)], dim=1)
Y = torch.arange(N)
SHARDS = [torch.tensor([0, 3, 5, 7, 9]), torch.tensor([1, 2, 4]), torch.tensor([6, 8, 10, 11, 12, 13, 14])]
B, K, R = 2, 3, 4  # 24 draws per machine per epoch: not a multiple of 5 or 7


def _streams(machine_ids=(0, 1, 2), seed=5, rounds=R) -> MachineStreams:
    return MachineStreams(X, Y, SHARDS, list(machine_ids), B, K, rounds, seed)


def _drawn(streams: MachineStreams, epochs: int = 1) -> list[list[int]]:
    """Labels every hosted machine drew over ``epochs`` iterations, in stream order."""
    seen = [[] for _ in streams.machine_ids]
    for _ in range(epochs):
        for xb, yb in streams:
            for j in range(len(seen)):
                seen[j] += yb[:, j, :].reshape(-1).tolist()
    return seen


def test_streams_shapes_and_sample_consistency():
    streams = _streams()
    assert len(streams) == R
    items = list(streams)
    assert len(items) == R
    for xb, yb in items:
        assert xb.shape == (K, 3, B, 2) and xb.dtype == torch.float32
        assert yb.shape == (K, 3, B) and yb.dtype == torch.int64
        assert torch.equal(xb[..., 0], yb.float())
        assert torch.equal(xb[..., 1], -yb.float())
    idx = streams.indices(0)
    assert idx.shape == (R, K, 3, B)


def test_each_machine_sees_only_its_shard_and_cycles_through_permutations():
    seen = _drawn(_streams(), epochs=2)
    for j, shard in enumerate(SHARDS):
        draws = seen[j]
        assert len(draws) == 2 * R * K * B
        assert set(draws) <= set(shard.tolist())
        n = len(shard)
        for start in range(0, len(draws) - n + 1, n):
            assert sorted(draws[start : start + n]) == shard.tolist()
        # The permutations are reshuffled, not one order repeated.
        blocks = {tuple(draws[s : s + n]) for s in range(0, len(draws) - n + 1, n)}
        assert len(blocks) > 1


def test_stream_follows_the_documented_generator():
    seed = 5
    seen = _drawn(_streams(seed=seed), epochs=2)
    for i, shard in enumerate(SHARDS):
        g = torch.Generator().manual_seed(seed * 1_000_003 + i)
        n = len(shard)
        expected = []
        while len(expected) < len(seen[i]):
            expected += shard[torch.rand(1, n, generator=g).argsort(dim=1)[0]].tolist()
        assert seen[i] == expected[: len(seen[i])]


def test_stream_does_not_depend_on_the_layout():
    together = _drawn(_streams((0, 1, 2)), epochs=2)
    for i in range(3):
        alone = _drawn(_streams((i,)), epochs=2)
        assert alone == [together[i]]
    pair = _drawn(_streams((2, 0)), epochs=2)
    assert pair == [together[2], together[0]]


def test_second_epoch_continues_the_stream():
    streams = _streams()
    first = _drawn(streams)
    second = _drawn(streams)
    assert streams.epoch == 2
    one_long_epoch = _drawn(_streams(rounds=2 * R))
    for j in range(3):
        assert first[j] + second[j] == one_long_epoch[j]
        assert first[j] != second[j]
    # indices(epoch) is the same window whether asked directly or reached by iterating.
    assert torch.equal(streams.indices(1), _streams().indices(1))


def test_seed_fixes_the_stream():
    assert _drawn(_streams(seed=5), epochs=2) == _drawn(_streams(seed=5), epochs=2)
    a, b = _drawn(_streams(seed=5)), _drawn(_streams(seed=6))
    for j in range(3):
        assert a[j] != b[j]


# --------------------------------------------------------------------------- ProblemDataModule


@pytest.mark.parametrize(
    "machines, steps, batch, rounds",
    [
        (16, 16, 1, 235),
        (64, 64, 1, 15),
        (1024, 16, 1, 4),
        (16, 16, 8, 30),
        (16, 1, 16, 235),
        (1, 1, 1, 60000),
        (1, 1, 60000, 1),
    ],
)
def test_rounds_of_the_shape(machines, steps, batch, rounds):
    dm = ProblemDataModule(num_machines=machines, steps_per_round=steps, batch_size=batch)
    assert dm.shape().rounds == rounds
    assert rounds == math.ceil(60000 / (machines * steps * batch))


def test_setup_without_trainer_reads_mnist_and_serves_rounds(mnist):
    dm = ProblemDataModule(root=str(DATA), num_machines=16, batch_size=1, steps_per_round=16, seed=1)
    dm.setup("fit")
    assert dm.partition_png is None  # no trainer, no figure
    assert len(dm.shards) == 16
    assert sum(len(s) for s in dm.shards) == 60000
    assert torch.equal(torch.sort(torch.cat(dm.shards)).values, torch.arange(60000))
    assert torch.equal(dm.test_x, mnist[2]) and torch.equal(dm.test_y, mnist[3])

    loader = dm.train_dataloader()
    assert isinstance(loader, MachineStreams)
    assert loader.machine_ids == list(range(16))
    assert len(loader) == dm.shape().rounds == 235
    x, y = mnist[0], mnist[1]
    idx = loader.indices(0)
    xb, yb = next(iter(loader))
    assert xb.shape == (16, 16, 1, 784) and yb.shape == (16, 16, 1)
    assert torch.equal(xb, x[idx[0]]) and torch.equal(yb, y[idx[0]])
    for i, shard in enumerate(dm.shards):
        assert torch.isin(idx[:, :, i, :], shard).all()

    # A second setup (e.g. "validate" after "fit") keeps the same streams.
    dm.setup("validate")
    assert dm.train_dataloader() is loader


def test_balanced_shards(cached_mnist):
    dm = ProblemDataModule(num_machines=7, dirichlet_alpha=0.1, split="balanced")
    dm.setup("fit")
    sizes = sorted(len(s) for s in dm.shards)
    assert sizes == [8571] * 4 + [8572] * 3  # 60000 = 7 * 8571 + 3
    assert all(abs(n - 60000 / 7) < 1 for n in sizes)
    assert cached_mnist == ["data"]


def test_eval_loaders_serve_the_test_set(cached_mnist, mnist):
    dm = ProblemDataModule(num_machines=4, eval_batch_size=4096)
    dm.setup("validate")
    for loader in (dm.val_dataloader(), dm.test_dataloader()):
        assert len(loader) == 3
        batches = list(loader)
        assert [len(yb) for _, yb in batches] == [4096, 4096, 1808]
        assert [xb.shape for xb, _ in batches] == [(4096, 784), (4096, 784), (1808, 784)]
        assert torch.equal(torch.cat([xb for xb, _ in batches]), mnist[2])
        assert torch.equal(torch.cat([yb for _, yb in batches]), mnist[3])
    default = ProblemDataModule(num_machines=4)
    default.setup("test")
    assert [len(yb) for _, yb in default.test_dataloader()] == [10000]


@pytest.mark.parametrize(
    "field, value",
    [
        ("num_machines", 0),
        ("num_machines", True),
        ("batch_size", 0),
        ("batch_size", 1.5),
        ("steps_per_round", 0),
        ("eval_batch_size", -3),
        ("dirichlet_alpha", 0),
        ("dirichlet_alpha", -1),
        ("dirichlet_alpha", float("nan")),
        ("dirichlet_alpha", float("inf")),
        ("dirichlet_alpha", "0.1"),
        ("dirichlet_alpha", True),
        ("split", "plain"),
        ("split", None),
    ],
)
def test_constructor_rejects_bad_values(field, value):
    with pytest.raises(ValueError, match=rf"data\.{field}"):
        ProblemDataModule(**{field: value})


def test_split_names_the_allowed_values():
    with pytest.raises(
        ValueError, match=r"^Invalid data\.split: 'Official' \(allowed: official, balanced, dirichlet\)$"
    ):
        ProblemDataModule(split="Official")


def test_iid_split_matches_global_class_mix(cached_mnist):
    dm = ProblemDataModule(num_machines=16, dirichlet_alpha=None)
    dm.setup("fit")
    counts = dm.class_counts()
    assert counts.shape == (16, 10)
    assert counts.sum(0).tolist() == TRAIN_COUNTS
    expected = np.array(TRAIN_COUNTS) / 16
    assert (np.abs(counts - expected) < 1).all()
    assert sorted({int(n) for n in counts.sum(1)}) == [3750]
    shares = counts / counts.sum(1, keepdims=True)
    assert np.abs(shares - np.array(TRAIN_COUNTS) / 60000).max() < 1e-3


def test_dirichlet_split_is_skewed(cached_mnist):
    dm = ProblemDataModule(num_machines=16, dirichlet_alpha=0.1, seed=1)
    dm.setup("fit")
    counts = dm.class_counts()
    assert counts.shape == (16, 10)
    assert counts.sum() == 60000
    assert counts.sum(0).tolist() == TRAIN_COUNTS
    assert (counts.sum(1) >= 1).all()
    dominant = counts.max(1) / counts.sum(1)
    assert dominant.mean() > 0.5
    # Each machine's counts match its shard's labels.
    labels = dm._train_labels
    for i, shard in enumerate(dm.shards):
        assert np.bincount(labels[shard].numpy(), minlength=10).tolist() == counts[i].tolist()


def test_layout_over_processes(cached_mnist):
    alone = ProblemDataModule(num_machines=16, dirichlet_alpha=0.1, seed=3)
    alone.setup("validate")
    ranked = ProblemDataModule(num_machines=16, dirichlet_alpha=0.1, seed=3)
    ranked.trainer = SimpleNamespace(world_size=2, global_rank=1, lightning_module=None)
    ranked.setup("validate")
    stream = ranked.train_dataloader()
    assert stream.machine_ids == list(range(8, 16))
    assert torch.equal(stream.indices(0), alone.train_dataloader().indices(0)[:, :, 8:, :])

    uneven = ProblemDataModule(num_machines=16)
    uneven.trainer = SimpleNamespace(world_size=3, global_rank=0, lightning_module=None)
    with pytest.raises(ValueError, match="not divisible"):
        uneven.setup("fit")

    # An outside launcher's rank 1 (RANK=1, WORLD_SIZE=2) under a trainer of one process: one line, not an
    # IndexError of machine ids past the last shard.
    launched = ProblemDataModule(num_machines=16)
    launched.trainer = SimpleNamespace(world_size=1, global_rank=1, lightning_module=None)
    with pytest.raises(ValueError, match=r"^Invalid trainer.num_nodes / trainer.devices: this process is rank 1 of"):
        launched.setup("fit")


def test_partition_plot_is_written(cached_mnist, tmp_path):
    dm = ProblemDataModule(num_machines=16, dirichlet_alpha=0.1)
    dm.setup("fit")
    counts = dm.class_counts()
    path = tmp_path / "figures" / "class_distribution.png"
    fig = plot_class_distribution(counts, path, title="Class distribution across 16 machines")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert path.stat().st_size > 1000
    assert len(fig.axes[0].collections[0].get_offsets()) == int((counts > 0).sum())
    assert fig.axes[0].get_title() == "Class distribution across 16 machines"


# ------------------------------------------------------- the split and its figure, once per process


@pytest.fixture
def counted_partition(monkeypatch):
    """An empty split cache, and the (M, alpha, split, seed) of every split actually computed."""
    calls = []
    real = data_module.partition

    def counting(labels, num_machines, alpha, *, split="dirichlet", seed=0, **kwargs):
        calls.append((num_machines, alpha, split, seed))
        return real(labels, num_machines, alpha, split=split, seed=seed, **kwargs)

    monkeypatch.setattr(data_module, "partition", counting)
    monkeypatch.setattr(data_module, "_PARTITIONS", {})
    return calls


def test_split_is_computed_once_per_settings_and_handed_out_as_copies(mnist, counted_partition):
    y = mnist[1]
    expected = [torch.from_numpy(s) for s in partition(y.numpy(), 16, 0.1, split="balanced", seed=7)]
    first = partition_shards(y, 16, 0.1, "balanced", 7)
    assert len(first) == 16 and all(torch.equal(a, b) for a, b in zip(first, expected))
    for shard in first:  # a run that scribbles over its shards...
        shard.fill_(-1)
    second = partition_shards(y, 16, 0.1, "balanced", 7)
    assert counted_partition == [(16, 0.1, "balanced", 7)]  # ...and the next run with the same settings
    assert all(torch.equal(a, b) for a, b in zip(second, expected))  # gets the split intact
    assert all(a.data_ptr() != b.data_ptr() for a, b in zip(first, second))

    # Any other setting, or other labels, is a split of its own.
    partition_shards(y, 16, 0.1, "balanced", 8)
    partition_shards(y, 16, 0.1, "dirichlet", 7)
    partition_shards(y, 16, 0.1, "official", 7)
    partition_shards(y, 32, 0.1, "balanced", 7)
    partition_shards(y, 16, None, "balanced", 7)
    partition_shards(y.clone(), 16, 0.1, "balanced", 7)
    assert len(counted_partition) == 7
    # A value partition refuses is refused every time, even when an equal one is cached (1 == 1.0).
    partition_shards(y, 16, 0.1, "balanced", 1)
    for _ in range(2):
        with pytest.raises(ValueError, match="Invalid split"):
            partition_shards(y, 16, 0.1, "plain", 7)
        with pytest.raises(ValueError, match="Invalid seed"):
            partition_shards(y, 16, 0.1, "balanced", 1.0)


def test_data_modules_of_the_same_split_share_it_and_cannot_corrupt_each_other(cached_mnist, counted_partition):
    first = ProblemDataModule(num_machines=8, dirichlet_alpha=0.1, split="balanced", seed=2)
    first.setup("fit")
    expected = [s.clone() for s in first.shards]
    indices = first.train_dataloader().indices(0)
    first.shards[0].zero_()
    first.train_dataloader().shards[1].zero_()
    second = ProblemDataModule(num_machines=8, dirichlet_alpha=0.1, split="balanced", seed=2)
    second.setup("fit")
    assert len(counted_partition) == 1
    assert all(torch.equal(a, b) for a, b in zip(second.shards, expected))
    assert torch.equal(second.train_dataloader().indices(0), indices)


class FigureLogger:
    """A logger taking figures (TensorBoard's interface)."""

    def __init__(self):
        self.figures = []
        self.experiment = SimpleNamespace(add_figure=lambda key, figure: self.figures.append((key, figure)))


def test_class_distribution_figure_is_drawn_once_per_split_and_copied(cached_mnist, tmp_path, monkeypatch):
    drawn = []
    real = data_module.plot_class_distribution

    def counting(counts, path=None, **kwargs):
        drawn.append(path)
        return real(counts, path, **kwargs)

    monkeypatch.setattr(data_module, "plot_class_distribution", counting)
    monkeypatch.setattr(data_module, "_FIGURES", {})

    def setup(folder, num_machines=8, loggers=()):
        dm = ProblemDataModule(num_machines=num_machines, dirichlet_alpha=0.1, seed=4)
        dm.trainer = SimpleNamespace(
            world_size=1, global_rank=0, is_global_zero=True, log_dir=str(tmp_path / folder),
            default_root_dir=str(tmp_path), loggers=list(loggers), lightning_module=None,
        )  # fmt: skip
        dm.setup("fit")
        return dm

    first, second = setup("a"), setup("b")
    assert len(drawn) == 1
    # Each run folder gets the split's class counts next to its figure, drawn or copied.
    counts = first.class_counts()
    for folder in ("a", "b"):
        lines = (tmp_path / folder / "class_counts.csv").read_text().splitlines()
        assert lines[0] == "machine,class,count" and len(lines) == 1 + 8 * 10
        table = np.zeros_like(counts)
        for line in lines[1:]:
            k, c, n = map(int, line.split(","))
            table[k, c] = n
        np.testing.assert_array_equal(table, counts)
    assert first.partition_png == tmp_path / "a" / "class_distribution.png"
    assert second.partition_png == tmp_path / "b" / "class_distribution.png"
    assert second.partition_png.read_bytes() == first.partition_png.read_bytes()
    fresh = tmp_path / "fresh.png"
    real(first.class_counts(), fresh, title="Class distribution across 8 machines (Dirichlet alpha=0.1)")
    assert first.partition_png.read_bytes() == fresh.read_bytes()
    # A logger that takes the figure object still gets one; another split gets its own figure.
    logger = FigureLogger()
    setup("c", loggers=[logger])
    assert [key for key, _ in logger.figures] == ["class_distribution"]
    setup("d", num_machines=4)
    assert len(drawn) == 3
    assert (tmp_path / "d" / "class_distribution.png").read_bytes() != fresh.read_bytes()


@pytest.mark.parametrize(
    ("name", "offset", "value", "shape"),
    [
        ("train-labels-idx1-ubyte", 4, 50000, "the shape 50000, but its size holds 60000"),
        ("t10k-images-idx3-ubyte", 4, 9000, "the shape 9000 x 28 x 28, but its size holds 10000 x 28 x 28"),
        ("train-images-idx3-ubyte", 8, 784, "the shape 60000 x 784 x 28, but its size holds 60000 x 28 x 28"),
    ],
)
def test_a_header_that_disagrees_with_the_files_size_is_refused_naming_the_file(raw_copy, name, offset, value, shape):
    load_mnist(raw_copy.parents[1])  # decompresses the shipped files
    data = bytearray((raw_copy / name).read_bytes())
    data[offset : offset + 4] = value.to_bytes(4, "big")
    (raw_copy / name).write_bytes(bytes(data))
    with pytest.raises(ValueError) as err:
        load_mnist(raw_copy.parents[1])
    assert f"Corrupt MNIST file {raw_copy / name}: its header gives {shape}" in str(err.value)


def test_a_label_outside_the_classes_is_refused_when_read_naming_the_file(raw_copy):
    name = "t10k-labels-idx1-ubyte"
    load_mnist(raw_copy.parents[1])  # decompresses the shipped files
    data = bytearray((raw_copy / name).read_bytes())
    data[8 + 1234] = 200
    (raw_copy / name).write_bytes(bytes(data))
    with pytest.raises(ValueError) as err:
        load_mnist(raw_copy.parents[1])
    assert str(err.value).startswith(
        f"Corrupt MNIST file {raw_copy / name}: label 200 at index 1234 (1 labels outside 0..9)"
    )


def test_the_data_module_exports_what_its_neighbours_define():
    """``from lit_slowcal.experiments.data.datamodule import load_mnist, MachineStreams, ...`` keeps working after the split."""
    import lit_slowcal.experiments.data.mnist as mnist_module
    import lit_slowcal.experiments.data.streams as streams_module

    assert (
        data_module.load_mnist is mnist_module.load_mnist
        and data_module.MachineStreams is streams_module.MachineStreams
    )
    assert (data_module.MNIST_MEAN, data_module.MNIST_STD) == (0.1307, 0.3081)
    assert {"load_mnist", "MachineStreams", "MNIST_MEAN", "MNIST_STD"} <= set(data_module.__all__)


# ---------------------------------------------------------------------- concurrent processes


def test_two_processes_preparing_mnist_on_a_fresh_copy_both_succeed(tmp_path):
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for gz in (REPO / "data" / "MNIST" / "raw").glob("*.gz"):
        shutil.copy(gz, raw / gz.name)
    prepare = (
        "from pathlib import Path\nfrom lit_slowcal.experiments.data.mnist import prepare_mnist\n"
        + BARRIER
        + ("prepare_mnist(Path(sys.argv[1]))\n")
    )
    env = subprocess_env(PYTHONPATH=str(REPO))
    procs = [
        subprocess.Popen([sys.executable, "-c", prepare, str(tmp_path), name, str(tmp_path)], env=env, stderr=subprocess.PIPE, text=True)
        for name in "ab"
    ]  # fmt: skip
    errors = [p.communicate(timeout=120)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errors
    names = ["t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte", "train-images-idx3-ubyte", "train-labels-idx1-ubyte"]
    assert sorted(p.name for p in raw.iterdir() if not p.name.endswith(".gz")) == [".prepare.lock", *names]  # no temp
    for name in names:
        with gzip.open(raw / f"{name}.gz") as f:
            assert (raw / name).read_bytes() == f.read(), name
