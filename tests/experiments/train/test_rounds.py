"""The pieces of a round (``lit_slowcal.experiments.train.rounds``), each against an independent computation, and
the single run and the stacked trials diverging through the same type."""

import csv
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from in_process import RUN, command
from test_stacked import REPO, grid_file
from torch import nn

from lit_slowcal.averaging import PeriodicAverager
from lit_slowcal.experiments import sweep as sw
from lit_slowcal.experiments.measure.diagnostics import Diagnostics
from lit_slowcal.experiments.sweep import stacked
from lit_slowcal.experiments.train import rounds
from lit_slowcal.experiments.train.model import MachinesModel
from lit_slowcal.experiments.train.rounds import TrainingDiverged
from lit_slowcal.experiments.train.shape import RunShape
from lit_slowcal.link import Link, LinkCounts
from lit_slowcal.simulated import SimulatedMachines


def test_round_losses_are_each_trials_mean_and_the_single_runs_own_reduction():
    g = torch.Generator().manual_seed(0)
    losses = torch.rand(5, 3, 4, generator=g)  # (k, T, M)
    got = rounds.round_losses(losses)
    want = [float(np.mean(losses[:, i].double().numpy())) for i in range(3)]
    assert got.shape == (3,) and got.dtype == torch.float32
    assert got.tolist() == pytest.approx(want, rel=1e-6)
    # T = 1: bitwise the mean of the round's per-step (M,) losses stacked, as a run of its own reduces them
    steps = [losses[k, 1] for k in range(5)]
    assert torch.equal(rounds.round_losses(torch.stack(steps).unsqueeze(1))[0], torch.stack(steps).mean())


def test_diverged_trials_are_those_with_a_non_finite_loss_or_parameter():
    T, M = 4, 3
    g = torch.Generator().manual_seed(1)
    weight, bias = torch.randn(T * M, 2, 5, generator=g), torch.randn(T * M, 2, generator=g)
    loss = torch.rand(T, generator=g)
    assert rounds.diverged_trials(loss, [weight, bias], T) == []
    weight[1 * M + 2, 1, 3] = float("nan")  # trial 1: a weight
    bias[3 * M, 0] = float("-inf")  # trial 3: a bias
    loss[2] = float("inf")  # trial 2: its loss
    expected = [
        i for i in range(T)
        if not (math.isfinite(loss[i]) and all(math.isfinite(v) for p in (weight, bias) for v in p[i * M : (i + 1) * M].flatten().tolist()))
    ]  # fmt: skip
    assert expected == [1, 2, 3]
    assert rounds.diverged_trials(loss, [weight, bias], T) == expected
    # The single run: one trial, a scalar loss
    assert rounds.diverged_trials(torch.tensor(float("nan")), [torch.zeros(3, 2)], 1) == [0]
    assert rounds.diverged_trials(torch.tensor(0.5), [torch.zeros(3, 2)], 1) == []


def test_divergence_and_the_trial_status_it_gives():
    err = rounds.divergence(float("nan"), 3, "slowcal", 0.5)
    assert isinstance(err, TrainingDiverged) and isinstance(err, FloatingPointError)
    assert str(err) == "Training diverged: train loss nan in round 3 (method=slowcal, lr=0.5). Try a smaller lr."
    assert str(rounds.divergence(1.25, 7, "local_sgd", 2.0)).startswith(
        "Training diverged: non-finite parameters in round 7 "
    )
    assert rounds.trial_status(None) == "finished"
    assert rounds.trial_status(err) == "diverged"
    # The type decides, not the message
    assert rounds.trial_status(FloatingPointError("Training diverged: a look-alike")) == "failed"
    assert rounds.trial_status(ValueError("x")) == "failed"


def test_the_train_loss_is_the_float32_mean_of_the_rounds_since_the_last_log():
    g = torch.Generator().manual_seed(2)
    per_round = torch.rand(3, 2, generator=g)  # 3 rounds of T = 2 trials
    sums = torch.zeros(2, 2, dtype=torch.float64)
    for r in range(3):
        sums = rounds.add_round_loss(sums, per_round[r])
    assert sums[:, 1].tolist() == [3.0, 3.0]
    want = [np.float32(sum(float(per_round[r, i]) for r in range(3)) / 3) for i in range(2)]
    got = rounds.mean_train_loss(sums)
    assert got.dtype == torch.float32 and got.tolist() == [float(w) for w in want]
    one = rounds.add_round_loss(torch.zeros(2, dtype=torch.float64), torch.tensor(0.25))  # the single run's (2,)
    assert one.tolist() == [0.25, 1.0] and float(rounds.mean_train_loss(one)) == 0.25


def test_train_row():
    # SLowcal's x and w of the 7,850-parameter model in float32 (62,800 bytes a sync), M = 16, 6 rounds of K = 4.
    sent = LinkCounts.of_syncs(62_800, 16, syncs=6)
    ddp = LinkCounts.of_syncs(31_400, 16, syncs=24)  # DDP: the gradients, every step
    counts = rounds.RoundCounts(steps=24, syncs=6, floats=6 * 15700, sent=sent, ddp=ddp)
    link = Link.parse("10Gbit/s,1ms")
    row = rounds.train_row(
        0.5, counts=counts, steps_per_round=4, batch_size=2, machines=16, rounds_done=6, links=[link], step_seconds=1e-4
    )
    by_hand = {
        "train_loss": 0.5,
        "round": 6.0,
        "samples_seen": 4 * 2 * 16 * 6.0,
        "floats_communicated": 6 * 15700 * 16.0,
        "optimizer_steps": 24.0,
        "ring_bytes_per_machine": 6 * 62_800 * 30 / 16,  # 2 (M - 1) / M of the payload, every round
        "ring_hops": 6 * 30.0,
        "ddp_ring_bytes_per_machine": 24 * 31_400 * 30 / 16,
        "ddp_ring_hops": 24 * 30.0,
        "comm_s_10Gbitps_1ms": 180 * 1e-3 + 706_500 / 1.25e9,
        "ddp_comm_s_10Gbitps_1ms": 720 * 1e-3 + 1_413_000 / 1.25e9,
        "wall_s_10Gbitps_1ms": 24 * 1e-4 + 180 * 1e-3 + 706_500 / 1.25e9,
        "ddp_wall_s_10Gbitps_1ms": 24 * 1e-4 + 720 * 1e-3 + 1_413_000 / 1.25e9,
    }
    assert list(row) == list(by_hand)
    for name, value in by_hand.items():
        assert float(row[name]) == pytest.approx(value, rel=1e-15), name
    assert all(row[k].dtype == torch.float64 for k in list(by_hand)[4:])  # logged as they are, not in float32
    without = rounds.train_row(0.5, counts=counts, steps_per_round=4, batch_size=2, machines=16, rounds_done=6)
    assert list(without) == list(by_hand)[:9]  # no link: the counts alone


def test_swap_outputs_calls_each_optimizers_swap_and_skips_the_others():
    calls = []

    class Swaps:
        def swap_output(self):
            calls.append(self)

    class NotCallable:
        swap_output = None

    a, b = Swaps(), Swaps()
    rounds.swap_outputs(iter([a, NotCallable(), object(), b]))
    assert calls == [a, b]


def test_test_loss_against_float64():
    g = torch.Generator().manual_seed(3)
    logits, y = torch.randn(50, 10, generator=g), torch.randint(0, 10, (50,), generator=g)
    z = logits.double().numpy()
    lse = np.log(np.exp(z - z.max(1, keepdims=True)).sum(1)) + z.max(1)
    want = float(np.mean(lse - z[np.arange(50), y.numpy()]))
    assert float(rounds.test_loss(logits, y, "cross_entropy")) == pytest.approx(want, rel=1e-6)
    out, target = torch.randn(50, 1, generator=g), torch.randn(50, generator=g)
    want = float(np.mean(0.5 * (out.double().numpy()[:, 0] - target.double().numpy()) ** 2))
    assert float(rounds.test_loss(out, target, "squared")) == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("classes", [10, 2, 3])
@pytest.mark.parametrize("n", [1, 17, 64, 240, 3072, 10000])
def test_cross_entropy_is_torchs_with_its_gradient_and_each_samples_value_its_own(n, classes):
    """``rounds.cross_entropy`` (classes along the first dimension) against ``F.cross_entropy``: values and
    gradients bit for bit on an AVX-512 CPU (the machine the stored results come from), within a few float32
    roundings on any other (there exp and the sum over the classes round differently: on AVX2 at most
    1.31 eps (1 + |value|) apart, eps = 1.19e-7 the rounding step of 1.0); the gradient laid out as torch's;
    and a sample's value and gradient do not depend on the samples beside it (what makes the single run's and
    the stacked trials' losses the same), also where the count is not a multiple of the padding."""
    g = torch.Generator().manual_seed(n * classes)
    exact = torch.backends.cpu.get_cpu_capability() == "AVX512"
    eps = torch.finfo(torch.float32).eps
    for scale in (0.01, 1.0, 30.0):
        z = (torch.randn(n, classes, generator=g) * scale).requires_grad_()
        y = torch.randint(0, classes, (n,), generator=g)
        for reduction in ("none", "mean"):
            got = rounds.cross_entropy(z, y, reduction)
            want = F.cross_entropy(z, y, reduction=reduction)
            (got_grad,) = torch.autograd.grad(got.sum(), z)
            (want_grad,) = torch.autograd.grad(want.sum(), z)
            assert got_grad.stride() == want_grad.stride()  # the layout the matmul's backward reads
            if exact:
                assert torch.equal(got, want) and torch.equal(got_grad, want_grad)
            else:
                # |got - want| <= 4 eps (unit + |want|): a value is log(sum exp(z - max)) - (z_y - max), the log
                # of a sum >= 1 (rounded to an absolute eps or so, however small the loss) less a difference both
                # compute alike; a gradient is softmax - onehot (p_y - 1 rounded at eps), / n with "mean". 4 eps
                # is 3 times the AVX2 differences seen, and an error of 1e-4 in a loss below 200 still fails.
                unit = 1.0 if reduction == "none" else 1.0 / n
                torch.testing.assert_close(got, want, rtol=4 * eps, atol=4 * eps)
                torch.testing.assert_close(got_grad, want_grad, rtol=4 * eps, atol=4 * eps * unit)
        per_sample = rounds.cross_entropy(z, y, "none")
        for part in (slice(0, 1), slice(n // 3, n), slice(n - 1, n)):
            alone = rounds.cross_entropy(z[part], y[part], "none")
            assert torch.equal(alone, per_sample[part])
            stacked = torch.cat([z[part], z[part]])  # the same samples at other positions
            assert torch.equal(rounds.cross_entropy(stacked, y[part].repeat(2), "none"), alone.repeat(2))


def test_epoch_value_is_lightnings_float32_mean_of_one_logged_value():
    for v, n in ((0.1, 10000), (1 / 3, 7), (2.5, 1)):
        want = (np.float32(0) + np.float32(v) * np.float32(n)) / np.float32(n)  # float32 throughout
        assert rounds.epoch_value(torch.tensor(v), n) == float(want)
        assert rounds.epoch_value(v, n) == float(want)  # a Python float: logged as float32
    assert rounds.epoch_value(torch.tensor(1 / 3, dtype=torch.float64)) == 1 / 3  # float64 kept


def test_evaluation_row_against_an_independent_count():
    g = torch.Generator().manual_seed(4)
    logits, y = torch.randn(200, 10, generator=g), torch.randint(0, 10, (200,), generator=g)
    row = rounds.evaluation_row(logits, y, "cross_entropy")
    assert row["test_acc"] == float(np.float32((logits.argmax(1) == y).sum().item() / 200))
    assert row["test_loss"] == rounds.epoch_value(rounds.test_loss(logits, y, "cross_entropy"), 200)
    assert set(rounds.evaluation_row(logits[:, :1], y.float(), "squared")) == {"test_loss"}


def test_diagnostics_without_a_trainer_measure_the_dispersion_and_the_steps():
    # Two machines of a 1 -> 1 linear model (weight, bias), SGD lr 1 with gradients set by hand: the
    # dispersion before the sync and the per-step movement in closed form.
    machines = SimulatedMachines(nn.Linear(1, 1), 2)
    with torch.no_grad():
        machines.weight.copy_(torch.tensor([[[1.0]], [[3.0]]]))
        machines.bias.copy_(torch.tensor([[0.0], [2.0]]))
    model = nn.Module()
    model.machines = machines
    optimizer = torch.optim.SGD(machines.parameters(), lr=1.0)
    averager = PeriodicAverager([machines], optimizer, sync_every=1)
    diagnostics = Diagnostics(objective=False, per_round=True, step_every=1)
    diagnostics.attach(model, averager, optimizer)
    diagnostics.start_round(0)
    machines.weight.grad = torch.tensor([[[0.0]], [[-4.0]]])  # weights 1, 7: mean 4, squares 9 + 9
    machines.bias.grad = torch.tensor([[0.0], [0.0]])  # biases 0, 2: mean 1, squares 1 + 1
    optimizer.step()
    assert averager.step()  # synchronises: the pre-hook measured the dispersion
    diagnostics.end_round()
    diagnostics.detach()
    out = diagnostics.evaluate(model)  # without the objective: the per-round values alone
    assert set(out) == {"dispersion", "query_step"}  # SGD keeps no iterate w
    assert out["dispersion"] == pytest.approx((9 + 9 + 1 + 1) / 2)
    assert out["query_step"] == pytest.approx((0.0 + 4.0) / 2)  # machine 0 did not move, machine 1 by 4
    diagnostics.objective = lambda point: 1.5  # any f; the per-round values started over
    out = diagnostics.evaluate(model)
    assert set(out) == {"train_objective"} and out["train_objective"].dtype == torch.float64
    assert float(out["train_objective"]) == 1.5
    assert diagnostics.evaluate(model, value=2.0) == {"train_objective": torch.tensor(2.0, dtype=torch.float64)}


def test_the_single_run_and_the_stacked_trial_diverge_through_the_same_type(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    torch.set_num_threads(1)
    made = []
    divergence = rounds.divergence

    def recording(*args):
        made.append(divergence(*args))
        return made[-1]

    monkeypatch.setattr(rounds, "divergence", recording)  # both paths end their rounds with one RoundDriver
    sweep = sw.load_sweep(grid_file(tmp_path, lrs=(1e38,), seeds=(1,), methods=("local_sgd",)))
    (params,) = sw.expand_trials(sweep)
    args = sw.trial_args(sweep, params)
    alone = sw.run_trial(args)  # raises TrainingDiverged out of the fit; the runner records it by its type
    trial = stacked.StackedTrial(params, args, sw.CommandLine().parse(args).fit.as_dict())
    stacked.run_group([trial])
    assert [type(e) for e in made] == [TrainingDiverged, TrainingDiverged]
    assert alone["status"] == trial.outcome["status"] == "diverged"
    assert alone["error"] == trial.outcome["error"] == str(made[0]) == str(made[1])


@pytest.mark.parametrize(
    "error, status",
    [(TrainingDiverged("anything"), "diverged"), (FloatingPointError("Training diverged: look-alike"), "failed")],
)
def test_the_runner_takes_the_status_from_the_type(tmp_path, monkeypatch, error, status):
    monkeypatch.chdir(REPO)
    torch.set_num_threads(1)

    def fails(self, batch, batch_idx):
        raise error

    monkeypatch.setattr(MachinesModel, "training_step", fails)
    sweep = sw.load_sweep(grid_file(tmp_path, lrs=(0.01,), seeds=(1,), methods=("local_sgd",)))
    (params,) = sw.expand_trials(sweep)
    outcome = sw.run_trial(sw.trial_args(sweep, params))
    assert outcome["status"] == status and outcome["error"] == str(error)


# ---------------------------------------------------------------------- the final round's metrics, in a run of the command


@pytest.mark.parametrize("eval_every", [4, 3])  # R = 4: eval_every divides R, and does not
def test_the_final_rounds_train_metrics_are_written(tmp_path, capsys, eval_every):
    assert command(capsys, f"--eval_every={eval_every}", run_dir=tmp_path)[0] == 0
    rows = (tmp_path / RUN / "version_0" / "metrics.csv").read_text().splitlines()
    header = rows[0].split(",")
    trained = [dict(zip(header, r.split(","))) for r in rows[1:]]
    trained = [r for r in trained if r["train_loss"]]
    assert [float(r["round"]) for r in trained] == [4.0]  # log_every_n_steps = 10 > R: only the final round
    assert float(trained[0]["samples_seen"]) == 4 * 4 * 64 * 64


def test_the_round_driver_ends_rounds_by_its_schedule_and_names_the_diverged_trials():
    steps = []
    counts = rounds.RoundCounts(steps=12, syncs=3, floats=7850.0)
    driver = rounds.RoundDriver(
        type("Opt", (), {"step": lambda self: steps.append(1)})(),
        rounds.RoundSchedule(log_every=2, eval_every=3),
        RunShape(num_machines=3, steps_per_round=4, per_step_batch=2, train_size=1000),
        method="slowcal", lrs=[0.1, 0.2],
        counts=lambda: counts, sync=lambda: len(steps) % 4 == 0,
    )  # fmt: skip
    assert [driver.step() for _ in range(4)] == [False, False, False, True] and len(steps) == 4
    losses = torch.arange(24, dtype=torch.float32).view(4, 2, 3)  # (steps, T, M)
    finite = [torch.zeros(6, 5)]
    first = driver.end_round(losses, 1, finite)
    assert first.train_loss is None and not first.evaluate and first.diverged == []
    assert first.round_loss.tolist() == [losses[:, 0].mean().item(), losses[:, 1].mean().item()]
    second = driver.end_round(losses + 1, 2, finite)  # logs: the mean of rounds 1 and 2
    assert second.train_loss.tolist() == [(first.round_loss[i].item() * 2 + 1) / 2 for i in range(2)]
    assert not second.evaluate
    bad = torch.zeros(6, 5)
    bad[4, 0] = float("nan")  # trial 1's second machine
    third = driver.end_round(losses, 3, [bad], last=False)
    assert third.evaluate and third.train_loss is None
    assert [i for i, _ in third.diverged] == [1]
    assert str(third.diverged[0][1]) == str(rounds.divergence(third.round_loss[1].item(), 3, "slowcal", 0.2))
    last = driver.end_round(losses, 5, finite, last=True)  # the run's last round logs and is evaluated
    assert last.evaluate and last.train_loss is not None
    rows = driver.train_rows(last)
    assert [r["train_loss"].item() for r in rows] == last.train_loss.tolist()
    assert rows[0] == {**rows[0], "round": 3.0, "samples_seen": 4 * 2 * 3 * 5.0, "floats_communicated": 7850.0 * 3}
    assert float(rows[0]["optimizer_steps"]) == 12.0


def test_a_rows_new_column_is_written_once_for_the_single_run_and_the_stacked_trials(tmp_path, monkeypatch):
    """Both paths log their rounds through ``RoundDriver``: a column added to ``rounds.train_row`` reaches the
    single run's metrics.csv and the stacked trial's, unchanged elsewhere."""
    monkeypatch.chdir(REPO)
    torch.set_num_threads(1)
    train_row = rounds.train_row
    monkeypatch.setattr(rounds, "train_row", lambda loss, **kw: {**train_row(loss, **kw), "probe": kw["rounds_done"]})
    sweep = sw.load_sweep(grid_file(tmp_path, lrs=(0.01,), seeds=(1,), methods=("slowcal",)))
    (params,) = sw.expand_trials(sweep)
    args = sw.trial_args(sweep, params)
    alone = sw.run_trial(args)
    trial = stacked.StackedTrial(params, args, sw.CommandLine().parse(args).fit.as_dict())
    stacked.run_group([trial])
    probes = []
    for run_dir in (alone["run_dir"], trial.outcome["run_dir"]):
        with open(Path(run_dir) / "metrics.csv") as f:
            probes.append([float(r["probe"]) for r in csv.DictReader(f) if r.get("probe")])
    assert probes[0] == probes[1] == [2.0, 4.0, 6.0, 7.0]  # log_every_n_steps = 2, and the last of 7 rounds
