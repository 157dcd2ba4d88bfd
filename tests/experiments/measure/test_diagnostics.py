"""The diagnostics a fit logs: train objective, excess loss and G_* against closed forms, per-round dispersion and steps."""

import lightning.pytorch as pl
import numpy as np
import pytest
from test_objective import quadratic_closed_form

from lit_slowcal.experiments.data.datamodule import ProblemDataModule
from lit_slowcal.experiments.data.problems import Quadratic, Synthetic
from lit_slowcal.experiments.measure.diagnostics import Diagnostics
from lit_slowcal.experiments.train.model import MachinesModel
from lit_slowcal.strategy import PeriodicAveragingStrategy


class Recorder(pl.Callback):
    """An independent record: the stacked parameters before every sync, and x and w around every step."""

    def on_train_start(self, trainer, pl_module):
        self.syncs, self.steps = [], []
        params = list(pl_module.machines.parameters())
        trainer.strategy.register_sync_pre_hook(
            lambda a: self.syncs.append([p.detach().double().clone() for p in params])
        )
        optimizer = trainer.optimizers[0]

        def state(opt):
            return [p.detach().double().clone() for p in params], [
                opt.state[p]["w"].double().clone() if "w" in opt.state.get(p, {}) else p.detach().double().clone()
                for p in params
            ]

        optimizer.register_step_pre_hook(lambda opt, *a: self.steps.append(state(opt)))
        optimizer.register_step_post_hook(lambda opt, *a: self.steps.append(state(opt)))


def fit(problem, method, weight_decay, tmp_path, machines=4, k=3, per_round=True, step_every=1):
    dm = ProblemDataModule(num_machines=machines, steps_per_round=k, batch_size=2, problem=problem, seed=1)
    model = MachinesModel(
        method=method, num_machines=machines, lr=0.05, weight_decay=weight_decay,
        input_dim=problem.input_dim, num_classes=problem.num_outputs, loss=problem.loss,
    )  # fmt: skip
    diagnostics = Diagnostics(cache_dir=str(tmp_path / "cache"), per_round=per_round, step_every=step_every, tol=1e-10)
    recorder = Recorder()
    trainer = pl.Trainer(
        strategy=PeriodicAveragingStrategy(sync_every=k), accelerator="cpu", devices=1, max_epochs=1,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[diagnostics, recorder], val_check_interval=dm.shape().rounds, num_sanity_val_steps=0,
        default_root_dir=str(tmp_path),
    )  # fmt: skip
    trainer.fit(model, datamodule=dm)
    return trainer, model, dm, diagnostics, recorder


@pytest.mark.parametrize("method, step_every", [("slowcal", 1), ("local_sgd", 1), ("slowcal", 2)])
def test_excess_loss_g_star_dispersion_and_steps_on_the_quadratic(method, step_every, tmp_path):
    problem = Quadratic(dim=5, samples=24, heterogeneity=1.0)
    lam = 1e-3
    trainer, model, dm, diagnostics, recorder = fit(problem, method, lam, tmp_path, step_every=step_every)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    theta, f_star, h, g_star = quadratic_closed_form(dm.problem_data, lam)
    x = model.machines.averaged_state()
    point = np.r_[x["weight"][0].double().numpy(), x["bias"].double().numpy()]
    d = point - theta
    assert abs(metrics["excess_loss"] - 0.5 * d @ h @ d) <= 1e-9
    assert abs(metrics["train_objective"] - (f_star + 0.5 * d @ h @ d)) <= 1e-9
    assert abs(metrics["f_star"] - f_star) <= 1e-9 and abs(metrics["G_star"] - g_star) <= 1e-9
    assert metrics["excess_loss"] > 1e-4  # one epoch of SGD does not reach x*: a real number was checked
    # Dispersion: the mean over the run's syncs of (1/M) sum_i ||x_i - x_bar||^2 before each.
    assert len(recorder.syncs) == dm.shape().rounds
    expected = np.mean([sum(float((p - p.mean(0)).square().sum()) for p in ps) / 4 for ps in recorder.syncs])
    assert expected > 0 and abs(metrics["dispersion"] - expected) <= 1e-6 * expected
    # Per-step movement, mean over machines and the steps of every step_every-th round, of x and (SLowcal) of w.
    pairs = list(zip(recorder.steps[::2], recorder.steps[1::2]))
    assert len(pairs) == dm.shape().rounds * 3 and dm.shape().rounds == 4
    pairs = [pair for i, pair in enumerate(pairs) if (i // 3) % step_every == 0]

    def mean_step(which):
        return np.mean([
            float(sum((a - b).flatten(1).square().sum(1) for a, b in zip(after[which], before[which])).sqrt().mean())
            for before, after in pairs
        ])  # fmt: skip

    assert abs(metrics["query_step"] - mean_step(0)) <= 1e-6 * mean_step(0)
    if method == "slowcal":
        assert abs(metrics["iterate_step"] - mean_step(1)) <= 1e-6 * mean_step(1)
        assert metrics["query_step"] < metrics["iterate_step"]  # the slow query points
    else:
        assert "iterate_step" not in metrics


def test_no_excess_loss_without_an_attained_minimiser_and_one_line_that_says_so(tmp_path, capsys):
    trainer, *_ = fit(Synthetic(dim=4, num_classes=3), "slowcal", 0.0, tmp_path, per_round=False)
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if "excess_loss" in line]
    assert lines == [
        "excess_loss: not logged: Synthetic softmax regression without weight decay has no attained minimiser "
        "(f keeps falling as ||x|| grows), so there is no f*; set --model.weight_decay=1e-4 (recommended: f is "
        "then strongly convex) to measure it"
    ]
    metrics = trainer.callback_metrics
    assert "train_objective" in metrics and "excess_loss" not in metrics and "G_star" not in metrics
    assert "dispersion" not in metrics and "query_step" not in metrics


def test_the_cli_trains_the_quadratic_and_prints_the_optimum_in_its_summary(tmp_path, capsys):
    from lit_slowcal.experiments.run.cli import SlowcalCLI

    args = [
        "fit", "--config", "configs/slowcal.yaml", "--wandb=false", "--trainer.enable_progress_bar=false",
        f"--run_dir={tmp_path / 'runs'}", f"--cache_dir={tmp_path / 'cache'}", "--num_machines=4",
        "--data.problem=Quadratic", "--data.problem.dim=3", "--data.problem.samples=20",
        "--optimum_tol=1e-10", "--eval_every=50",  # more than the problem's R = ceil(80 / (4 * 16)) = 2 rounds: evaluated at the end
    ]  # fmt: skip
    cli = SlowcalCLI(args=args)
    out = capsys.readouterr().out
    assert cli.model.machines.weight.shape == (4, 1, 3) and cli.model.hparams.loss == "squared"
    assert cli.trainer.strategy.num_syncs == cli.datamodule.shape().rounds == 2
    data = cli.datamodule.problem_data
    theta, f_star, h, g_star = quadratic_closed_form(data, 0.0)
    metrics = cli.trainer.callback_metrics
    assert abs(float(metrics["f_star"]) - f_star) <= 1e-9 and abs(float(metrics["G_star"]) - g_star) <= 1e-9
    assert float(metrics["excess_loss"]) > 0
    assert f"f* {f_star:.6f}   G_* {g_star:.4f}" in out and "solved in" in out
    assert not (tmp_path / "runs" / "slowcal_M4_K16_b1_seed1" / "version_0" / "class_distribution.png").exists()
    SlowcalCLI(args=args)  # the same problem again: x* comes from the cache
    assert "(read from " in capsys.readouterr().out
