"""The problems: deterministic per seed, with the statistics their docstrings promise."""

import numpy as np
import pytest
import torch

from lit_slowcal.experiments.data import problems as problems_module
from lit_slowcal.experiments.data.datamodule import ProblemDataModule
from lit_slowcal.experiments.data.problems import MNIST, PROBLEMS, VOCABULARY, Quadratic, StdlibChars, Synthetic


def _equal(a, b):
    return (
        torch.equal(a.train_x, b.train_x)
        and torch.equal(a.train_y, b.train_y)
        and torch.equal(a.test_x, b.test_x)
        and len(a.shards) == len(b.shards)
        and all(torch.equal(s, t) for s, t in zip(a.shards, b.shards))
    )


@pytest.mark.parametrize("problem", [Synthetic(alpha=1, beta=1), Quadratic()])
def test_the_same_seed_gives_the_same_data_and_another_seed_other_data(problem):
    first = problem.build(6, seed=5)
    type(problem)._build.__globals__["_synthetic"].cache_clear()  # built afresh, not from the cache
    type(problem)._build.__globals__["_quadratic"].cache_clear()
    again = type(problem)(**problem.settings()).build(6, seed=5)
    assert first is not again and _equal(first, again)
    assert not _equal(first, problem.build(6, seed=6))


def test_synthetic_sizes_labels_and_feature_covariance_are_fedprox_s():
    machines, seed = 16, 11
    data = Synthetic(alpha=0.5, beta=0.5).build(machines, seed)
    # n_i = floor(lognormal(4, 2)) + 50, the first of the seed's draws; 90 % of each train.
    sizes = np.random.default_rng(seed).lognormal(4, 2, machines).astype(np.int64) + 50
    assert [len(s) for s in data.shards] == [int(0.9 * n) for n in sizes]
    assert len(data.test_y) == int(sizes.sum()) - sum(int(0.9 * n) for n in sizes)
    assert data.train_x.shape[1] == 60 and data.train_y.dtype == torch.int64
    assert 0 <= int(data.train_y.min()) and int(data.train_y.max()) < 10
    # Within a machine the features have covariance diag(j^-1.2): pooled variance about each machine's mean.
    x = data.train_x.double()
    centred = torch.cat([x[s] - x[s].mean(0) for s in data.shards])
    variance = centred.square().sum(0) / (len(x) - machines)
    expected = torch.arange(1, 61, dtype=torch.float64) ** -1.2
    assert len(x) > 2000  # enough samples for a 15 % check
    assert torch.allclose(variance / expected, torch.ones(60, dtype=torch.float64), atol=0.15)

    # beta spreads the machines' input means: the spread of machine means grows with beta.
    def spread(beta):
        d = Synthetic(alpha=0.0, beta=beta).build(machines, seed)
        means = torch.stack([d.train_x[s].double().mean() for s in d.shards])
        return float(means.std())

    assert spread(5.0) > 3 * spread(0.0)


def test_quadratic_sizes_and_the_data_module_builds_any_problem():
    data = Quadratic(dim=3, samples=7, test_samples=2).build(4, seed=0)
    assert [len(s) for s in data.shards] == [7] * 4 and data.test_x.shape == (8, 3)
    assert data.train_y.dtype == torch.float32
    dm = ProblemDataModule(num_machines=4, steps_per_round=2, batch_size=1, problem=Quadratic(dim=3, samples=7))
    assert dm.num_train_samples == 28 and dm.shape().rounds == 4  # ceil(28 / (4 * 2 * 1))
    dm.setup("fit")
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (2, 4, 1, 3) and y.shape == (2, 4, 1)
    assert set(PROBLEMS) == {"MNIST", "Synthetic", "Quadratic", "StdlibChars"}
    assert isinstance(ProblemDataModule().problem, MNIST)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: Synthetic(alpha=-1), r"Invalid data.problem.alpha: -1 \(must be a finite number >= 0\)"),
        (lambda: Quadratic(samples=0), r"Invalid data.problem.samples: 0 \(must be an integer >= 1\)"),
        (lambda: ProblemDataModule(problem="Synthetic"), r"Invalid data.problem: 'Synthetic'"),
        (lambda: MNIST().build(4, 1), r"MNIST is built by its data module"),
    ],
)
def test_bad_settings_are_refused_in_one_line(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_a_config_written_before_the_rooms_still_names_its_problem():
    """Run folders' config.yaml files name ``lit_slowcal.experiments.problems.X``: the same classes."""
    from jsonargparse import ArgumentParser

    from lit_slowcal.experiments.data import problems

    parser = ArgumentParser()
    parser.add_argument("--problem", type=problems.Problem)
    config = parser.parse_args(
        ["--problem", '{"class_path": "lit_slowcal.experiments.problems.Quadratic", "init_args": {"dim": 3}}']
    )
    built = parser.instantiate_classes(config).problem
    assert type(built) is problems.Quadratic and built.dim == 3


def test_stdlib_chars_windows_targets_test_split_and_dirichlet_over_modules():
    """Windows of the corpus's characters with their next characters as targets, each module's last 10 % for
    the test, and the training windows split over the machines by their module (the label)."""
    from types import SimpleNamespace

    documents = problems_module.stdlib_documents()
    assert len(documents) == 16 and 2e5 < sum(len(ids) for _, ids in documents) < 4e5
    text = (problems_module.STDLIB_DIR / "textwrap.py.txt").read_text()
    ids = dict(documents)["textwrap.py.txt"]
    assert "".join(VOCABULARY[i] for i in ids[:40]) == text[:40] and len(VOCABULARY) == 96
    data = StdlibChars(context=16, stride=4).build(4, 1, SimpleNamespace(dirichlet_alpha=0.3, split="balanced"))
    assert data.train_x.shape[1] == data.test_x.shape[1] == 16 and data.train_y.dtype == torch.int64
    assert torch.equal(data.train_x[:, 1:].long(), data.train_y[:, :-1])  # the targets: the window shifted by one
    first = documents[0][1]  # the first window of the first module, and its fourth (stride 4)
    assert torch.equal(data.train_x[3].long(), first[12:28]) and torch.equal(data.train_y[3], first[13:29])
    cut = int(0.9 * len(first))
    assert torch.equal(data.test_x[0].long(), first[cut : cut + 16])  # the test: past the training windows
    # balanced: every machine the same windows; Dirichlet(0.3): each its own mix of the modules
    sizes = [len(s) for s in data.shards]
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) <= len(data.train_x)
    modules = torch.cat([torch.full((len(_windows),), i) for i, _windows in enumerate(_per_module(16, 4))])
    mixes = torch.stack([torch.bincount(modules[s], minlength=16).double() / len(s) for s in data.shards])
    assert (mixes - mixes.mean(0)).abs().max() > 0.1


def _per_module(context, stride):
    return [problems_module._windows(ids[: int(0.9 * len(ids)) + 1], context, stride)[0] for _, ids in
            problems_module.stdlib_documents()]  # fmt: skip


def _corpus_copy(folder):
    folder.mkdir(parents=True)
    for path in problems_module.STDLIB_DIR.iterdir():
        (folder / path.name).write_bytes(path.read_bytes())
    return folder


def test_stdlib_chars_refuses_a_changed_corpus(tmp_path, monkeypatch):
    corpus = _corpus_copy(tmp_path / "stdlib")
    with open(corpus / "heapq.py.txt", "a") as f:
        f.write("# changed\n")
    monkeypatch.setattr(problems_module, "STDLIB_DIR", corpus)
    with pytest.raises(ValueError, match=r"Invalid corpus file: .*heapq.py.txt \(its SHA-256 is not SHA256SUMS's"):
        problems_module.stdlib_documents()
    # Another corpus with its own sums is not StdlibChars's either.
    sums = (corpus / "SHA256SUMS").read_text().splitlines()
    (corpus / "SHA256SUMS").write_text("\n".join(line for line in sums if "heapq" not in line) + "\n")
    with pytest.raises(ValueError, match=r"^Invalid corpus file: .*SHA256SUMS \(its SHA-256 is not StdlibChars's"):
        problems_module.stdlib_documents(tmp_path)


def test_stdlib_chars_reads_its_corpus_from_data_root_and_says_where_it_looked(tmp_path, monkeypatch):
    """An install made with ``pip install .`` has no clone's ``data/stdlib/`` (here: the package's clone folder
    gone, the run elsewhere): the corpus is read from ``data.root``'s ``stdlib/``, and without one there the
    refusal is one line naming both folders looked in and ``data.root``."""
    from types import SimpleNamespace

    expected = StdlibChars(context=16, stride=64).build(2, 1, SimpleNamespace(dirichlet_alpha=None, split="dirichlet"))
    _corpus_copy(tmp_path / "mine" / "stdlib")  # the clone's data/stdlib/, elsewhere
    monkeypatch.setattr(problems_module, "STDLIB_DIR", tmp_path / "site-packages" / "data" / "stdlib")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError) as err:
        StdlibChars(context=16, stride=64).build(2, 1, ProblemDataModule(root="data", num_machines=2))
    message = str(err.value)
    assert message.startswith("StdlibChars's corpus") and "\n" not in message, message
    assert f"not in {tmp_path / 'data' / 'stdlib'} nor in {tmp_path / 'site-packages' / 'data' / 'stdlib'}" in message
    assert "set data.root to the folder that holds stdlib/" in message

    dm = ProblemDataModule(root=str(tmp_path / "mine"), num_machines=2, dirichlet_alpha=None, split="dirichlet")
    assert _equal(StdlibChars(context=16, stride=64).build(2, 1, dm), expected)


def _largest_context():
    """One less than the shortest test part (a module's last 10 %): its windows' targets need one more character."""
    return min(len(ids) - int(0.9 * len(ids)) for _, ids in problems_module.stdlib_documents()) - 1


@pytest.mark.parametrize("excess", [1, 2000, 10**12])
def test_stdlib_chars_context_beyond_the_shortest_test_part_is_refused_in_one_line(excess):
    largest = _largest_context()
    with pytest.raises(ValueError) as err:
        StdlibChars(context=largest + excess, stride=4).build(2, 1)
    assert str(err.value).startswith(
        f"Invalid data.problem.context: {largest + excess} (must be an integer >= 2 and <= {largest}: a window"
    ) and "\n" not in str(err.value), str(err.value)
    data = StdlibChars(context=largest, stride=1000).build(2, 1)  # the largest: the shortest part's one window
    parts = [len(ids) - int(0.9 * len(ids)) - 1 for _, ids in problems_module.stdlib_documents()]  # ids with targets
    assert data.test_x.shape == (sum(n // largest for n in parts), largest) and data.train_x.shape[1] == largest


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"context": 1}, r"^Invalid data.problem.context: 1 \(must be an integer >= 2\)$"),
        ({"context": -3}, r"^Invalid data.problem.context: -3 \(must be an integer >= 2\)$"),
        ({"stride": 0}, r"^Invalid data.problem.stride: 0 \(must be an integer >= 1\)$"),
        ({"stride": -1}, r"^Invalid data.problem.stride: -1 \(must be an integer >= 1\)$"),
    ],
)
def test_stdlib_chars_settings_below_their_minimum_are_refused_in_one_line(settings, message):
    with pytest.raises(ValueError, match=message):
        StdlibChars(**settings)


def test_a_problem_other_than_mnist_needs_no_mnist_file(tmp_path, monkeypatch):
    """``prepare_data`` with an empty ``data.root`` (and no network): Quadratic trains, nothing is fetched or written."""
    from lit_slowcal.experiments.data import mnist

    def offline(root, missing):
        raise FileNotFoundError(f"MNIST files {', '.join(missing)} are missing from {root}")

    monkeypatch.setattr(mnist, "_download", offline)
    dm = ProblemDataModule(root=str(tmp_path), num_machines=2, steps_per_round=2, batch_size=1, problem=Quadratic())
    dm.prepare_data()
    dm.setup("fit")
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (2, 2, 1, 10) and list(tmp_path.iterdir()) == []
    with pytest.raises(FileNotFoundError, match="MNIST files train-images-idx3-ubyte"):  # MNIST itself still needs them
        ProblemDataModule(root=str(tmp_path)).prepare_data()


@pytest.mark.slow
@pytest.mark.parametrize("method", ["adaptive_slowcal", "diloco"])
def test_the_language_model_trains_in_fit_and_logs_bits_per_character(tmp_path, monkeypatch, capsys, method):
    """``fit --config configs/charlm.yaml`` as a sweep runs a trial: three rounds of the transformer on StdlibChars,
    its test loss in bits per character (``test_bpc`` = ``test_loss`` / ln 2), below the uniform 96 characters',
    and in the summary."""
    import math
    from pathlib import Path

    from lit_slowcal.experiments import sweep as sw

    monkeypatch.chdir(Path(__file__).resolve().parents[3])
    outcome = sw.run_trial(
        ["fit", "--config", "configs/charlm.yaml", f"--method={method}", "--trainer.limit_train_batches=3",
         "--trainer.max_epochs=1", "--model.lr=0.01", f"--run_dir={tmp_path}"]
    )  # fmt: skip
    assert outcome["status"] == "finished", outcome["error"]
    metrics = outcome["metrics"]
    assert metrics["round"] == 3 and metrics["test_bpc"] == pytest.approx(metrics["test_loss"] / math.log(2), rel=1e-6)
    assert metrics["test_bpc"] < math.log2(96) - 2  # learnt more than the characters' frequencies
    assert 0 < metrics["test_acc"] < 1
    assert f"bits per character {metrics['test_bpc']:.4f}" in capsys.readouterr().out
