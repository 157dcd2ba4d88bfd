"""The problems: deterministic per seed, with the statistics their docstrings promise."""

import numpy as np
import pytest
import torch

from lit_slowcal.experiments.data.datamodule import ProblemDataModule
from lit_slowcal.experiments.data.problems import MNIST, PROBLEMS, Quadratic, Synthetic


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
    assert set(PROBLEMS) == {"MNIST", "Synthetic", "Quadratic"}
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
