"""AC-SA's horizon-aware step in the app: N reaches the optimizer from the run's rounds, in a single run
and in a stacked group alike, and the model refuses what the option cannot take."""

import pytest
import torch
from test_stacked import REPO, grid_file, single_runs

from lit_slowcal.experiments import sweep as sw
from lit_slowcal.experiments.sweep import stacked
from lit_slowcal.experiments.sweep.contract import differences
from lit_slowcal.experiments.train.model import MachinesModel

ROUNDS = 7  # grid_file: --trainer.limit_train_batches=7, one epoch; AC-SA takes one step per round


def test_horizon_aware_run_takes_gamma_c_over_rounds_and_stacks_bit_for_bit(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    torch.set_num_threads(1)
    c = 2.0
    gamma = c / (ROUNDS + 1) ** 1.5  # Lan's c (N+1)^-3/2 with N = 7 steps: 0.0883883...
    aware = dict(methods=("accel_minibatch_sgd",), seeds=(1,), extra=("--model.horizon_aware=true",))
    sweep = sw.load_sweep(grid_file(tmp_path / "aware", lrs=(c,), **aware))
    plain = sw.load_sweep(grid_file(tmp_path / "plain", lrs=(gamma,), methods=("accel_minibatch_sgd",), seeds=(1,)))
    horizons = []
    monkeypatch.setattr(
        MachinesModel, "on_train_start",
        lambda self: horizons.append([g["horizon"] for g in self.trainer.optimizers[0].param_groups]), raising=False,
    )  # fmt: skip
    [(aware_run, aware_params, aware_csv)] = single_runs(monkeypatch, sweep, sw.expand_trials(sweep))
    [(plain_run, plain_params, _)] = single_runs(monkeypatch, plain, sw.expand_trials(plain))
    assert horizons == [[ROUNDS], [None]]
    assert aware_run["status"] == plain_run["status"] == "finished" and aware_run["metrics"]["round"] == ROUNDS
    # The horizon-aware run with c is the plain run with gamma = c / 8**1.5, bit for bit.
    assert aware_run["metrics"] == plain_run["metrics"]
    for name, value in aware_params.items():
        assert torch.equal(plain_params[name], value), name

    # Stacked with another c (its own parameter group): the c = 2 trial is its single run, bit for bit.
    sweep2 = sw.load_sweep(grid_file(tmp_path / "stacked", lrs=(c, 8.0), **aware))
    command_line = sw.CommandLine()
    parsed = [
        stacked.StackedTrial(p, sw.trial_args(sweep2, p), command_line.parse(sw.trial_args(sweep2, p)).fit.as_dict())
        for p in sw.expand_trials(sweep2)
    ]
    [group] = stacked.group_trials(parsed, budget=2**30)
    stacked.run_group(group)
    first, second = parsed
    assert differences(first.outcome["metrics"], aware_run["metrics"]) == []  # the contract: diagnostics within 1e-12
    for name, value in aware_params.items():
        assert torch.equal(first.final_state["params"][name], value), name
    assert (
        second.outcome["status"] == "finished"
        and second.outcome["metrics"]["test_loss"] != aware_run["metrics"]["test_loss"]
    )


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"horizon_aware": True}, r"Invalid model.lr: None with model.horizon_aware=true \(lr is then Lan's constant c"),
    ({"lr": 0.01, "max_lr": 0.5}, r"Invalid model.max_lr: 0.5 \(it caps the horizon-aware step; set horizon_aware=true"),
    ({"lr": 30.0, "horizon_aware": True, "max_lr": 0}, r"Invalid model.max_lr: 0 \(must be a finite number > 0\)"),
    ({"lr": -1.0, "horizon_aware": True}, r"Invalid model.lr: -1.0 \(must be a finite number > 0\)"),
])  # fmt: skip
def test_the_model_refuses_what_the_horizon_aware_step_cannot_take(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MachinesModel(method="accel_minibatch_sgd", **kwargs)


def test_a_method_without_the_option_ignores_it_like_any_other_methods_option():
    model = MachinesModel(method="slowcal", lr=0.01, horizon_aware=True)
    assert model.hparams.horizon_aware is True and model.hparams.lr == 0.01
