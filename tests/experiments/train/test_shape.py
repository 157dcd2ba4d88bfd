"""The run's shape (``lit_slowcal.experiments.train.shape.RunShape``): one object gives K and M to the strategy
and to the data, so the strategy's sync period and the batches' steps per round cannot disagree."""

from __future__ import annotations

import math

import pytest

from lit_slowcal.experiments.data.problems import MNIST, Quadratic, Synthetic
from lit_slowcal.experiments.train.methods import METHODS
from lit_slowcal.experiments.train.shape import RunShape, limited_rounds

# (M, K, b, processes)
SIZES = [(16, 16, 1, 1), (8, 4, 2, 2), (64, 1, 64, 4), (6, 3, 5, 3), (1, 7, 1, 1)]


@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize(("M", "K", "b", "world"), SIZES)
def test_every_method_syncs_once_per_round_of_its_batches(method, M, K, b, world):
    """Closed forms: a local method's round is K steps of b samples, a minibatch method's one step of K * b;
    R = ceil(N / (M K b)) either way; each of the P processes hosts M / P machines."""
    local = METHODS[method].local
    shape = RunShape.of(method, M, K, b, train_size=60_000, world_size=world, eval_every=10)
    assert shape.sync_every == shape.steps_per_round == shape.batch_shape()[0] == (K if local else 1)
    assert shape.per_step_batch == (b if local else K * b)
    assert shape.batch_shape(784) == (K if local else 1, M // world, b if local else K * b, 784)
    assert shape.samples_per_round == K * b
    assert shape.rounds == math.ceil(60_000 / (M * K * b))
    assert shape.steps_per_epoch == shape.rounds * (K if local else 1)
    assert shape.val_check_interval == min(10, shape.rounds)
    assert shape.machines_per_process * world == M


def test_a_sync_period_other_than_the_round_is_refused_in_one_line():
    with pytest.raises(ValueError) as info:
        RunShape(num_machines=16, steps_per_round=16, per_step_batch=1, train_size=60_000, sync_every=8)
    assert str(info.value) == (
        "Invalid sync_every: 8 (a round of 16 steps ends with one synchronisation: it must equal steps_per_round, 16)"
    )
    assert RunShape(16, 16, 1, 60_000, sync_every=16).sync_every == RunShape(16, 16, 1, 60_000).sync_every == 16


def test_machines_must_be_a_multiple_of_the_processes():
    shape = RunShape.of("slowcal", 6, 4, 1, train_size=600, world_size=3)
    assert (
        shape.machines_per_process == 2
        and shape.on(2).machines_per_process == 3
        and shape.on(6).machines_per_process == 1
    )
    with pytest.raises(ValueError) as info:
        shape.on(4)
    message = str(info.value)
    assert "\n" not in message and "num_machines = 6 is not divisible by the number of processes (4" in message
    assert "Use a multiple of 4." in message


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"method": "fedavg"}, "Invalid method: 'fedavg' (allowed: slowcal, local_sgd"),
        ({"num_machines": 0}, "Invalid num_machines: 0 (must be an integer >= 1)"),
        ({"local_steps": 0}, "Invalid local_steps: 0 (must be an integer >= 1)"),
        ({"batch_size": 2.0}, "Invalid batch_size: 2.0 (must be an integer >= 1)"),
        ({"train_size": 0}, "Invalid train_size: 0 (must be an integer >= 1)"),
        ({"world_size": 0}, "Invalid world_size: 0 (must be an integer >= 1)"),
        ({"eval_every": True}, "Invalid eval_every: True (must be an integer >= 1)"),
        ({"limit_train_batches": -1}, "Invalid trainer.limit_train_batches: -1 (a count >= 0 or a fraction in [0, 1])"),
    ],
)
def test_bad_values_are_refused_naming_the_field(kwargs, message):
    settings = {"method": "slowcal", "num_machines": 4, "local_steps": 2, "batch_size": 1, "train_size": 100, **kwargs}
    method, m, k, b = (settings.pop(n) for n in ("method", "num_machines", "local_steps", "batch_size"))
    with pytest.raises(ValueError) as info:
        RunShape.of(method, m, k, b, **settings)
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


def test_limits_count_rounds_as_lightning_counts_batches():
    """None or 1.0: every round; a count: at most that many; a fraction f < 1: int(R f)."""
    assert [limited_rounds(235, limit) for limit in (None, 1.0, 12, 500, 0, 0.5, 0.01)] == [
        235,
        235,
        12,
        235,
        0,
        117,
        2,
    ]
    assert RunShape.of("slowcal", 16, 16, 1, train_size=60_000, limit_train_batches=12).trained_rounds == 12


def test_the_problem_gives_its_training_set_size():
    assert MNIST().train_size(16, 1) == 60_000
    assert Quadratic(dim=3, samples=7).train_size(4, 1) == 28 == len(Quadratic(dim=3, samples=7).build(4, 1).train_y)
    synthetic = Synthetic(alpha=0.5, beta=0.5)
    assert (
        synthetic.train_size(5, 3)
        == len(synthetic.build(5, 3).train_y)
        == sum(len(s) for s in synthetic.build(5, 3).shards)
    )


@pytest.mark.parametrize("method", list(METHODS))
def test_the_cli_gives_the_strategy_and_the_batches_the_shapes_k(method, tmp_path, monkeypatch):
    """As the CLI builds a run (two processes, a problem of its own size): the strategy syncs once per training
    batch, every batch is the shape's round, and the rounds and evaluation interval are the problem's."""
    from lit_slowcal.experiments.run.run_folder import RUN_VERSION_ENV
    from lit_slowcal.experiments.sweep.single import _trial_cli

    cli_class = _trial_cli()  # the CLI, its parsers built once for all cases
    monkeypatch.setenv(RUN_VERSION_ENV, "")  # unset again when the test ends (run=False keeps the version)
    for M, K, b, devices in [(4, 3, 2, 2), (6, 2, 1, 1)]:
        args = [
            "--config=configs/slowcal.yaml", f"--method={method}", f"--num_machines={M}", f"--local_steps={K}",
            f"--batch_size={b}", f"--trainer.devices={devices}", "--data.problem=Quadratic", "--data.problem.samples=30",
            "--wandb=false", f"--run_dir={tmp_path}", "--eval_every=100",
        ]  # fmt: skip
        monkeypatch.delenv(RUN_VERSION_ENV, raising=False)  # run=False keeps the version for its children
        cli = cli_class(args=args, run=False)
        shape, data = cli.shape, cli.datamodule
        assert shape == RunShape.of(method, M, K, b, train_size=30 * M, world_size=devices, eval_every=100)
        assert cli.trainer.strategy.sync_every == shape.sync_every
        # Nothing computes K for the data module while parsing: its arguments are unset, it serves the shape.
        assert (cli.config.data.steps_per_round, cli.config.data.batch_size) == (None, None)
        assert (data.steps_per_round, data.batch_size) == (shape.steps_per_round, shape.per_step_batch)
        assert cli.trainer.val_check_interval == shape.rounds == math.ceil(30 / (K * b))
        data.trainer = cli.trainer
        data.setup("fit")
        batches = list(data.train_dataloader())
        assert len(batches) == data.shape().rounds == shape.rounds
        assert {tuple(x.shape) for x, _ in batches} == {shape.batch_shape(10)}
        assert {x.shape[0] for x, _ in batches} == {cli.trainer.strategy.sync_every}
        cli.trainer.strategy.teardown()


def test_the_data_module_refuses_a_shape_other_than_its_arguments_streams_or_trainer():
    from types import SimpleNamespace

    from lit_slowcal.experiments.data.datamodule import ProblemDataModule

    data = ProblemDataModule(num_machines=4, steps_per_round=2, batch_size=1, problem=Quadratic(dim=3, samples=8))
    assert data.shape() == RunShape(4, 2, 1, train_size=32)
    with pytest.raises(ValueError) as info:  # its own arguments are not overwritten
        data.use_shape(RunShape.of("minibatch_sgd", 4, 2, 1, train_size=32))
    assert str(info.value) == (
        "Invalid data.steps_per_round: 2 (the run's shape has 1, from method, local_steps and batch_size; "
        "leave it unset or give 1)"
    )
    data = ProblemDataModule(num_machines=4, problem=Quadratic(dim=3, samples=8))
    assert data.shape() == RunShape(4, 16, 1, train_size=32)  # built by hand without a shape: K = 16, b = 1
    data.use_shape(RunShape.of("minibatch_sgd", 4, 2, 1, train_size=32))
    assert (data.steps_per_round, data.batch_size, data.shape().rounds) == (1, 2, 4)
    with pytest.raises(ValueError, match=r"^Invalid shape: num_machines 8 \(the data module splits the data over"):
        data.use_shape(RunShape.of("minibatch_sgd", 8, 2, 1, train_size=32))
    data.trainer = SimpleNamespace(
        world_size=2, global_rank=0, num_devices=2, is_global_zero=True, lightning_module=None
    )
    with pytest.raises(ValueError, match=r"^Invalid shape: world_size 1 \(the trainer runs 2 processes"):
        data.setup("validate")
    data.use_shape(RunShape.of("minibatch_sgd", 4, 2, 1, train_size=32, world_size=2))
    data.setup("validate")
    with pytest.raises(ValueError, match=r"the streams are set up for num_machines=4, steps_per_round=1, batch_size=2"):
        data.use_shape(RunShape.of("slowcal", 4, 2, 1, train_size=32, world_size=2))


def test_a_configuration_of_an_earlier_version_gives_the_data_module_the_shapes_values_or_is_refused():
    """Config files written when K was linked into the data module (a stacked trial's config.yaml) still load."""
    settings = {"method": "minibatch_sgd", "num_machines": 4, "local_steps": 8, "batch_size": 2, "eval_every": 5}
    given = {**settings, "data": {"steps_per_round": 1, "batch_size": 16}, "trainer": {"limit_train_batches": 3}}
    shape = RunShape.of_settings(given, train_size=640)
    assert shape == RunShape.of("minibatch_sgd", 4, 8, 2, train_size=640, eval_every=5, limit_train_batches=3)
    assert (shape.rounds, shape.trained_rounds) == (RunShape.of_settings(settings, train_size=640).rounds, 3)
    with pytest.raises(ValueError) as info:
        RunShape.of_settings({**settings, "data": {"steps_per_round": 8, "batch_size": 16}}, train_size=640)
    assert str(info.value) == (
        "Invalid data.steps_per_round: 8 (the run's shape has 1, from method, local_steps and batch_size; "
        "leave it unset or give 1)"
    )
