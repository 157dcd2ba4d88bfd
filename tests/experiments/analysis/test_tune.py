"""``python -m lit_slowcal tune``: the rate per (method, M, K) chosen by a training criterion over seeds,
the test figures read at it afterwards, edges flagged; checked against hand computation."""

import csv
import json
import math
from pathlib import Path

import pytest

from lit_slowcal.experiments.analysis import tune
from lit_slowcal.experiments.main import main as app_main

HEADER = (
    "method,M,K,lr,lr_at_edge,n_seeds,train_objective_mean,excess_loss_mean,excess_loss_std,"
    "test_acc_mean,test_acc_std,test_loss_mean,test_loss_std"
)
F_STAR = {1: 0.20, 2: 0.19, 3: 0.21}  # f* of each seed's split: excess_loss = train_objective - f*


def record(method, m, k, seed, lr, objective, acc, loss, status="finished", excess=True, **extra):
    params = {"local_steps": k, "method": method, "num_machines": m, "seed_everything": seed, **extra}
    if lr is not None:
        params["model.lr"] = lr
    metrics = {"test_acc": acc, "test_loss": loss, "round": 10.0}
    if objective is not None:
        metrics["train_objective"] = objective
        if excess:
            metrics["excess_loss"] = objective - F_STAR[seed]
    return {
        "params": params,
        "status": status,
        "error": None if status == "finished" else "Training diverged: ...",
        "metrics": metrics,
    }


RECORDS = [
    # slowcal M=16 K=4, seeds 1, 2. lr 0.003 has the best test accuracy but not the best objective.
    record("slowcal", 16, 4, 1, 0.003, 0.30, 0.95, 0.20),
    record("slowcal", 16, 4, 2, 0.003, 0.32, 0.95, 0.22),
    record("slowcal", 16, 4, 1, 0.01, 0.25, 0.90, 0.30),  # chosen: mean objective 0.26
    record("slowcal", 16, 4, 2, 0.01, 0.27, 0.92, 0.36),
    record("slowcal", 16, 4, 1, 0.03, 0.20, 0.97, 0.10),  # the lowest objective, but seed 2 diverged at 0.03
    record("slowcal", 16, 4, 2, 0.03, None, None, None, status="diverged"),
    # local_sgd M=16 K=4, seeds 1-3: the largest rate wins (edge: high).
    *(record("local_sgd", 16, 4, s, 0.01, 0.50, 0.80, 0.60) for s in (1, 2, 3)),
    record("local_sgd", 16, 4, 1, 0.1, 0.30, 0.85, 0.40),
    record("local_sgd", 16, 4, 2, 0.1, 0.39, 0.88, 0.45),
    record("local_sgd", 16, 4, 3, 0.1, 0.51, 0.91, 0.47),  # mean 0.4 < 0.5
    # minibatch_sgd M=32 K=8, seed 1: the smallest rate wins (edge: low).
    record("minibatch_sgd", 32, 8, 1, 0.1, 0.40, 0.86, 0.45),
    record("minibatch_sgd", 32, 8, 1, 0.3, 0.41, 0.87, 0.44),
    # AC-SA M=64 K=64: no model.lr (the paper-config rate 0.01), one rate, no weight decay (no excess loss).
    record("accel_minibatch_sgd", 64, 64, 1, None, 0.70, 0.84, 0.79, excess=False),
]


def write(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def read_csv(path: Path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_tune_chooses_by_the_objective_and_reports_the_test_figures_at_the_choice(tmp_path, capsys):
    results = write(tmp_path / "grid.jsonl", RECORDS)
    out = tmp_path / "docs" / "tuned.csv"
    assert app_main_exit(["tune", str(results), "--out", str(out)]) == 0
    assert out.read_text().splitlines()[0] == HEADER
    rows = {(r["method"], int(r["M"]), int(r["K"])): r for r in read_csv(out)}
    assert list(rows) == [
        ("slowcal", 16, 4),
        ("local_sgd", 16, 4),
        ("minibatch_sgd", 32, 8),
        ("accel_minibatch_sgd", 64, 64),
    ]

    slowcal = rows["slowcal", 16, 4]
    assert (float(slowcal["lr"]), slowcal["lr_at_edge"], slowcal["n_seeds"]) == (0.01, "no", "2")
    assert float(slowcal["train_objective_mean"]) == pytest.approx(0.26, abs=1e-15)
    # excess: 0.25 - 0.20 = 0.05 and 0.27 - 0.19 = 0.08: mean 0.065, sample std 0.03 / sqrt(2)
    assert float(slowcal["excess_loss_mean"]) == pytest.approx(0.065, abs=1e-15)
    assert float(slowcal["excess_loss_std"]) == pytest.approx(0.03 / math.sqrt(2), abs=1e-15)
    assert float(slowcal["test_acc_mean"]) == pytest.approx(0.91, abs=1e-15)
    assert float(slowcal["test_acc_std"]) == pytest.approx(0.02 / math.sqrt(2), abs=1e-15)
    assert float(slowcal["test_loss_mean"]) == pytest.approx(0.33, abs=1e-15)
    assert float(slowcal["test_loss_std"]) == pytest.approx(0.06 / math.sqrt(2), abs=1e-15)

    local = rows["local_sgd", 16, 4]
    assert (float(local["lr"]), local["lr_at_edge"], local["n_seeds"]) == (0.1, "high", "3")
    assert float(local["train_objective_mean"]) == pytest.approx(0.40, abs=1e-15)
    # excess: 0.10, 0.20, 0.30: mean 0.2, std 0.1; accuracy 0.85, 0.88, 0.91: mean 0.88, std 0.03
    assert float(local["excess_loss_mean"]) == pytest.approx(0.20, abs=1e-15)
    assert float(local["excess_loss_std"]) == pytest.approx(0.10, abs=1e-15)
    assert float(local["test_acc_mean"]) == pytest.approx(0.88, abs=1e-15)
    assert float(local["test_acc_std"]) == pytest.approx(0.03, abs=1e-15)
    assert float(local["test_loss_std"]) == pytest.approx(
        math.sqrt(((0.40 - 0.44) ** 2 + 0.01**2 + 0.03**2) / 2), abs=1e-15
    )

    minibatch = rows["minibatch_sgd", 32, 8]
    assert (float(minibatch["lr"]), minibatch["lr_at_edge"], minibatch["n_seeds"]) == (0.1, "low", "1")
    assert (float(minibatch["excess_loss_std"]), float(minibatch["test_acc_std"])) == (0.0, 0.0)  # one seed

    accel = rows["accel_minibatch_sgd", 64, 64]
    assert (float(accel["lr"]), accel["lr_at_edge"]) == (0.01, "only")
    assert accel["excess_loss_mean"] == accel["excess_loss_std"] == ""  # no weight decay: not in the records
    assert float(accel["test_acc_mean"]) == 0.84

    printed = capsys.readouterr().out
    assert "| slowcal | 16 | 4 | 0.01 | no | 2 | 0.26 |" in printed
    assert (
        "At the edge of its grid (3): local_sgd M=16 K=4 (high); minibatch_sgd M=32 K=8 (low); accel_minibatch_sgd M=64 K=64 (only)."
        in printed
    )


def app_main_exit(argv):
    with pytest.raises(SystemExit) as exit_info:
        app_main(argv)
    return exit_info.value.code


def test_excess_loss_and_validation_criteria(tmp_path):
    chosen = {(c.method, c.M, c.K): (c.lr, c.criterion_mean) for c in tune.tune(RECORDS[:12], "excess_loss")}
    assert chosen[("slowcal", 16, 4)] == (0.01, pytest.approx(0.065, abs=1e-15))
    assert chosen[("local_sgd", 16, 4)] == (0.1, pytest.approx(0.20, abs=1e-15))
    # A validation accuracy is maximised, a validation loss minimised.
    val = [
        {
            **record("scaffold", 16, 16, 1, lr, 0.3, 0.9, 0.3),
            "metrics": {"val_acc": acc, "val_loss": loss, "test_acc": 0.5},
        }
        for lr, acc, loss in ((0.003, 0.80, 0.50), (0.01, 0.85, 0.45), (0.03, 0.83, 0.40))
    ]
    assert [c.lr for c in tune.tune(val, "val_acc")] == [0.01]
    assert [(c.lr, c.lr_at_edge) for c in tune.tune(val, "val_loss")] == [(0.03, "high")]


@pytest.mark.parametrize("criterion", ["test_acc", "test_loss"])
def test_the_test_set_is_never_a_criterion(tmp_path, capsys, criterion):
    results = write(tmp_path / "grid.jsonl", RECORDS)
    assert app_main_exit(["tune", str(results), "--criterion", criterion, "--out", str(tmp_path / "x.csv")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"lit_slowcal tune: error: Invalid --criterion: '{criterion}' (the test set is never a tuning criterion; "
        "allowed: train_objective, excess_loss, train_loss, val_<metric>)"
    )
    assert not (tmp_path / "x.csv").exists()
    with pytest.raises(ValueError, match="Invalid --criterion: 'loss' \\(allowed: train_objective"):
        tune.tune(RECORDS, "loss")


def test_refusals_name_the_cell(tmp_path, capsys):
    mixed = [
        record("accel_minibatch_sgd", 16, 16, 1, 30.0, 0.3, 0.9, 0.3, **{"model.horizon_aware": flag})
        for flag in (True, False)
    ]
    with pytest.raises(
        ValueError, match=r"model.horizon_aware takes several values \(false, true\) at accel_minibatch_sgd M=16 K=16"
    ):
        tune.tune(mixed)
    no_objective = [
        record("slowcal", 16, 4, 1, 0.01, None, 0.9, 0.3),
        record("slowcal", 16, 4, 1, 0.03, None, 0.9, 0.3),
    ]
    results = write(tmp_path / "old.jsonl", no_objective)
    assert app_main_exit(["tune", str(results)]) == 2
    assert capsys.readouterr().err.startswith(
        "lit_slowcal tune: error: no rate at slowcal M=16 K=4 has every seed finished with train_objective in its metrics "
        "(rates: 0.01, 0.03)"
    )


def test_the_tuned_grid_files_expand_to_the_five_methods_rate_grids():
    from lit_slowcal.experiments import sweep as sw
    from lit_slowcal.experiments.data.datamodule import MNIST_TRAIN_SIZE
    from lit_slowcal.experiments.train.methods import METHODS, TABLE1_METHODS
    from lit_slowcal.experiments.train.shape import RunShape

    sweeps = Path(__file__).resolve().parents[3] / "sweeps"
    lr_grid, c_grid = sw.load_sweep(sweeps / "table1_tuned.yaml"), sw.load_sweep(sweeps / "table1_tuned_acsa.yaml")
    trials = sw.expand_trials(lr_grid) + sw.expand_trials(c_grid)
    assert (len(sw.expand_trials(lr_grid)), len(sw.expand_trials(c_grid))) == (1800, 360)
    assert len({sw.trial_key(t) for t in trials}) == 2160
    assert {t["method"] for t in trials} == set(TABLE1_METHODS)
    cells = {(t["method"], t["num_machines"], t["local_steps"], t["seed_everything"]) for t in trials}
    assert len(cells) == 5 * 3 * 5 * 3
    for sweep, centre in ((lr_grid, None), (c_grid, 0.01 * 236**1.5)):
        rates = next(p.spec["values"] for p in sweep.params if p.name == "model.lr")
        ratios = [b / a for a, b in zip(rates, rates[1:])]
        assert len(rates) >= 6 and all(abs(r / 10 ** (1 / 3) - 1) < 0.01 for r in ratios), rates  # log-spaced
        centres = (
            [centre]
            if centre
            else [m.paper_lr for m in METHODS.values() if m.table1 and m.name != "accel_minibatch_sgd"]
        )
        for rate in centres:  # every method's registry rate inside its grid, 3 rates or more on either side
            assert sum(r < rate * 0.99 for r in rates) >= 3 and sum(r > rate * 1.01 for r in rates) >= 3, (rate, rates)
        args = sweep.args_before
        assert "--model.weight_decay=1e-4" in args and "--diagnostics=false" in args
        # One evaluation, after the last round, however long the run (M = 16, K = 4: 938 rounds).
        every = int(next(a for a in args if a.startswith("--eval_every=")).split("=")[1])
        assert every >= RunShape(16, 4, 1, train_size=MNIST_TRAIN_SIZE).rounds == 938
    assert (
        "--model.horizon_aware=true" in c_grid.args_before and "--model.horizon_aware=true" not in lr_grid.args_before
    )


def test_winners_and_docs_by_hand(tmp_path):
    """In cell (16, 4): slowcal's excess loss at its rate 0.01 is [0.05, 0.08] (mean 0.065, std 0.0212),
    local_sgd's at 0.1 is [0.10, 0.20, 0.30] (mean 0.2, std 0.1): slowcal wins by 0.135 = 1.35 sigma."""
    choices = tune.tune(RECORDS, "train_objective")
    wins = {(w.M, w.K): w for w in tune.winners(choices, "excess_loss")}
    w = wins[16, 4]
    assert (w.best, w.runner_up) == ("slowcal", "local_sgd")
    assert math.isclose(w.margin, 0.2 - 0.065, rel_tol=1e-12) and math.isclose(w.spread, 0.1, rel_tol=1e-12)
    assert math.isclose(w.margin_in_spreads, 1.35, rel_tol=1e-12)
    assert wins[32, 8].runner_up is None and (64, 64) not in wins  # one method; no excess loss logged
    written = tune.write_docs(choices, "train_objective", tmp_path, "table1_tuned")
    assert [p.name for p in written] == [
        "table1_tuned.md",
        "table1_tuned_excess_loss.png",
        "table1_tuned_test_acc.png",
        "table1_tuned_wins.png",
    ]
    text = (tmp_path / "table1_tuned.md").read_text()
    assert "**SLowcal-SGD** over Local-SGD: 1.35e-01 (1.35 σ)" in text and "**Minibatch-SGD** (alone)" in text
    assert all(p.stat().st_size > 1000 for p in written)


def cnn_record(method, k, seed, lr, train_loss, acc, floats, participation=None):
    """A non-linear model's trial: train_loss and the test figures, no training objective."""
    params = {"local_steps": k, "method": method, "model.lr": lr, "num_machines": 16, "seed_everything": seed}
    if participation is not None:
        params["participation"] = participation
    metrics = {"train_loss": train_loss, "round": 8.0, "floats_communicated": floats, "test_acc": acc, "test_loss": 0.3}
    return {"params": params, "status": "finished", "error": None, "metrics": metrics}


CNN_RECORDS = [
    # local_sgd K=4: train_loss means 0.45, 0.33 (chosen, interior), 0.35; the best test accuracy is at 0.0464.
    cnn_record("local_sgd", 4, 1, 0.01, 0.50, 0.80, 16 * 1000.0),
    cnn_record("local_sgd", 4, 2, 0.01, 0.40, 0.82, 16 * 1000.0),
    cnn_record("local_sgd", 4, 1, 0.0215, 0.30, 0.90, 16 * 1000.0),
    cnn_record("local_sgd", 4, 2, 0.0215, 0.36, 0.92, 16 * 1000.0),
    cnn_record("local_sgd", 4, 1, 0.0464, 0.20, 0.99, 16 * 1000.0),
    cnn_record("local_sgd", 4, 2, 0.0464, 0.50, 0.99, 16 * 1000.0),
    # local_sgd K=16: a quarter of the rounds, a quarter of the floats; the larger rate wins (edge: high).
    cnn_record("local_sgd", 16, 1, 0.01, 0.60, 0.70, 16 * 250.0),
    cnn_record("local_sgd", 16, 2, 0.01, 0.62, 0.74, 16 * 250.0),
    cnn_record("local_sgd", 16, 1, 0.0215, 0.41, 0.84, 16 * 250.0),
    cnn_record("local_sgd", 16, 2, 0.0215, 0.43, 0.88, 16 * 250.0),
    # diloco K=16 with 25% participation: S/M of the floats; one seed (std 0).
    cnn_record("diloco", 16, 1, 0.001, 0.70, 0.60, 16 * 62.5, participation=0.25),
    cnn_record("diloco", 16, 1, 0.00215, 0.80, 0.65, 16 * 62.5, participation=0.25),
]


def test_train_loss_criterion_chooses_by_the_seeds_mean_train_loss(tmp_path, capsys):
    choices = tune.tune(CNN_RECORDS, "train_loss")
    assert [(c.method, c.K, c.lr, c.lr_at_edge) for c in choices] == [
        ("local_sgd", 4, 0.0215, "no"), ("local_sgd", 16, 0.0215, "high"), ("diloco", 16, 0.001, "low"),
    ]  # fmt: skip
    assert [c.criterion_mean for c in choices] == [pytest.approx(0.33, abs=1e-15), pytest.approx(0.42, abs=1e-15), 0.70]
    assert choices[0].mean("test_acc") == pytest.approx(0.91, abs=1e-15)  # not 0.99: the test set never chooses
    assert choices[0].std("train_loss") == pytest.approx(0.06 / math.sqrt(2), abs=1e-15)
    # The records of a non-linear model hold no train_objective: the default criterion finds no rate.
    with pytest.raises(
        ValueError,
        match=r"no rate at local_sgd M=16 K=4 has every seed finished with train_objective .* runs log train_loss",
    ):
        tune.tune(CNN_RECORDS, "train_objective")
    results = write(tmp_path / "cnn.jsonl", CNN_RECORDS)
    assert app_main_exit(["tune", str(results), "--criterion", "train_loss"]) == 0
    assert "| local_sgd | 16 | 4 | 0.0215 | no | 2 | 0.33 |" in capsys.readouterr().out


def test_communication_table_and_the_accuracy_against_floats_figure(tmp_path, capsys):
    choices = tune.tune(CNN_RECORDS, "train_loss")
    assert [tune.floats_per_machine(c) for c in choices] == [1000.0, 250.0, 62.5]
    lines = tune.communication_table(choices).splitlines()
    assert lines[2] == "| Local-SGD | 16 | 4 | 0.0215 | no | 2 | 0.3300 ± 0.0424 | 0.9100 ± 0.0141 | 1e+03 |"
    assert lines[3] == "| Local-SGD | 16 | 16 | 0.0215 | high | 2 | 0.4200 ± 0.0141 | 0.8600 ± 0.0283 | 250 |"
    assert lines[4] == "| DiLoCo | 16 | 16 | 0.001 | low | 1 | 0.7000 ± 0.0000 | 0.6000 ± 0.0000 | 62.5 |"
    figure = tmp_path / "acc_vs_floats.png"
    results = write(tmp_path / "cnn.jsonl", CNN_RECORDS)
    assert app_main_exit(["tune", str(results), "--criterion", "train_loss", "--floats", str(figure)]) == 0
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and figure.stat().st_size > 5000
    out = capsys.readouterr().out
    assert lines[2] in out and f"wrote {figure}" in out
    # Records without the floats (or the accuracy): nothing to draw, one line naming the file.
    bare = [
        {**r, "metrics": {k: v for k, v in r["metrics"].items() if k != "floats_communicated"}} for r in CNN_RECORDS
    ]
    with pytest.raises(ValueError, match="no chosen cell has test_acc and floats_communicated"):
        tune.plot_accuracy_vs_floats(tune.tune(bare, "train_loss"), tmp_path / "none.png", "t")


def test_the_nonconvex_grid_files_give_every_method_and_k_the_same_budget():
    """sweeps/nonconvex/: the CNN runs of docs/nonconvex.md. Every file trains with the same arguments before
    the swept ones; the fraction 0.137 of an epoch keeps 512 samples per machine at K = 4, 16 and 64
    (Lightning keeps int(fraction x rounds) rounds); the committed results hold every trial, at that budget."""
    from lit_slowcal.experiments import sweep as sw
    from lit_slowcal.experiments.analysis.report import load_results
    from lit_slowcal.experiments.data.datamodule import MNIST_TRAIN_SIZE
    from lit_slowcal.experiments.train.shape import RunShape

    repo = Path(__file__).resolve().parents[3]
    files = sorted((repo / "sweeps" / "nonconvex").glob("*.yaml"))
    sweeps = {f.stem: sw.load_sweep(f) for f in files}
    assert sorted(sweeps) == [
        "diloco", "local", "minibatch", "participation_diloco", "participation_local", "participation_minibatch",
        "scaffold_low",
    ]  # fmt: skip
    args = {tuple(s.args_before) for s in sweeps.values()}
    assert len(args) == 1
    (common,) = args
    assert {"--model.arch=cnn", "--model.init=default", "--trainer.limit_train_batches=0.137"} <= set(common)
    for k in (4, 16, 64):
        assert int(RunShape(16, k, 1, train_size=MNIST_TRAIN_SIZE).rounds * 0.137) * k == 512
    for name, s in sweeps.items():
        rates = next(p.spec["values"] for p in s.params if p.name == "model.lr")
        assert all(abs(b / a / 10 ** (1 / 3) - 1) < 0.01 for a, b in zip(rates, rates[1:])), (name, rates)
    trials = {name: sw.expand_trials(s) for name, s in sweeps.items()}
    main = [t for name, ts in trials.items() if not name.startswith("participation") for t in ts]
    part = [t for name, ts in trials.items() if name.startswith("participation") for t in ts]
    assert (len(main), len(part)) == (5 * 3 * 5 * 3 + 6, 4 * 5 * 3)
    assert {t["method"] for t in main} == {"slowcal", "local_sgd", "minibatch_sgd", "scaffold", "diloco"}
    assert {t["method"] for t in part} == {"slowcal", "local_sgd", "minibatch_sgd", "diloco"}  # SCAFFOLD refuses
    assert {(t["local_steps"], t["participation"]) for t in part} == {(16, 0.25)}
    for stem, expected in (("nonconvex", main), ("nonconvex_participation", part)):
        records = load_results(repo / "sweeps" / "results" / f"{stem}.jsonl")
        assert sorted(sw.trial_key(r["params"]) for r in records) == sorted(sw.trial_key(t) for t in expected)
        for r in records:
            if r["status"] == "finished":
                k = r["params"]["local_steps"]
                assert (r["metrics"]["samples_seen"], r["metrics"]["round"]) == (512 * 16, 512 / k), r["params"]


# ------------------------------------------------------------- one record per trial, hand-edited lines


def test_a_results_file_concatenated_with_itself_counts_each_trial_once(tmp_path, capsys):
    """Merging two machines' results by concatenation: a trial recorded twice with the same values is one seed,
    as the sweep counts it; recorded twice with different values, it is refused, naming both lines."""
    from lit_slowcal.experiments import sweep as sw

    once, twice = write(tmp_path / "once.jsonl", RECORDS), write(tmp_path / "twice.jsonl", RECORDS + RECORDS)
    assert app_main_exit(["tune", str(once), "--out", str(tmp_path / "once.csv")]) == 0
    capsys.readouterr()
    assert app_main_exit(["tune", str(twice), "--out", str(tmp_path / "twice.csv")]) == 0
    assert (tmp_path / "twice.csv").read_text() == (tmp_path / "once.csv").read_text()
    slowcal = read_csv(tmp_path / "twice.csv")[0]
    assert (slowcal["n_seeds"], float(slowcal["excess_loss_std"])) == (
        "2",
        pytest.approx(0.03 / math.sqrt(2), abs=1e-15),
    )
    err = capsys.readouterr().err
    assert (
        err
        == f"note: {twice}: {len(RECORDS)} records repeat another of the same trial with the same status and metrics; each trial is counted once\n"
    )
    assert len(sw.ResultsFile(twice).records) == len(RECORDS)  # the sweep counts them so too

    # A third seed out of a duplicate with another value: refused, the file and both lines named.
    other = {**RECORDS[2], "metrics": {**RECORDS[2]["metrics"], "train_objective": 0.10}}
    clash = write(tmp_path / "clash.jsonl", [*RECORDS, other])
    assert app_main_exit(["tune", str(clash)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(
        f"lit_slowcal tune: error: {clash}, lines 3 and {len(RECORDS) + 1}: two records of one trial ("
    )
    assert '"model.lr":0.01' in err and "with different status or metrics" in err
    with pytest.raises(ValueError, match=f"lines 3 and {len(RECORDS) + 1}: two records of one trial"):
        sw.ResultsFile(clash)


def test_tune_of_an_empty_results_file_is_refused(tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    assert app_main_exit(["tune", str(empty)]) == 2
    assert (
        capsys.readouterr().err
        == f"lit_slowcal tune: error: {empty}: no trial records (the file is empty); give the results file a sweep wrote\n"
    )


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda r: r["params"].update(num_machines=[16]), "num_machines is [16], expected an integer"),
        (lambda r: r["params"].update(local_steps=float("inf")), "local_steps is inf, expected an integer"),
        (lambda r: r["params"].update({"model.lr": [0.01]}), "model.lr is [0.01], expected a finite number"),
        (
            lambda r: r["params"].update({"model.lr": {"a": {"b": 1}}}),
            "model.lr is {'a': {'b': 1}}, expected a finite number",
        ),
        (lambda r: r["params"].pop("method"), "a trial lacks method in its params"),
        (lambda r: r["params"].update(method=["slowcal"]), "method is ['slowcal'], expected a method's name"),
        (
            lambda r: r["params"].update(deep=json.loads("[" * 40 + "]" * 40)),
            "not a trial record: nested more than 32 levels deep",
        ),
        (
            lambda r: r.update(wall_time_s=[1.5]),
            "not a trial record: 'wall_time_s' is [1.5], expected a number or null",
        ),
    ],
)
def test_a_hand_edited_record_is_one_line_naming_the_file_and_line(tmp_path, capsys, edit, message):
    edited = json.loads(json.dumps(RECORDS[3]))
    edit(edited)
    path = write(tmp_path / "edited.jsonl", [*RECORDS[:3], edited, *RECORDS[4:]])
    assert app_main_exit(["tune", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"lit_slowcal tune: error: {path}, line 4: {message}"), err


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("[" * 100000 + "]" * 100000, "not a trial record: nested too deeply (at most 32 levels)"),
        (
            '{"params": ' + "[" * 100000 + "]" * 100000 + ', "status": "finished"}',
            "not a trial record: nested too deeply",
        ),
    ],
)
def test_a_line_nested_too_deeply_is_one_line_for_tune_report_and_sweep(tmp_path, capsys, line, message):
    from lit_slowcal.experiments import sweep as sw

    path = write(tmp_path / "r.jsonl", RECORDS[:2])
    with open(path, "a") as f:
        f.write(line + "\n")
    assert app_main_exit(["tune", str(path)]) == 2
    assert app_main_exit(["report", str(path), "--out", str(tmp_path / "out")]) == 2
    for err in capsys.readouterr().err.splitlines():
        assert f"{path}, line 3: {message}" in err
    with pytest.raises(ValueError, match=f"line 3: {message[:20]}"):
        sw.ResultsFile(path)


def test_records_of_one_cell_run_with_another_command_are_refused_and_one_run_counts_once(tmp_path, capsys):
    """Results files of two commands merged: a cell whose rates (or seeds) were run with other settings is
    refused, as the report refuses it; one run recorded under two spellings of its rate (one identity) counts once."""
    base = ["fit", "--config", "configs/paper.yaml", "--method=slowcal", "--num_machines=16", "--local_steps=4"]
    records = [json.loads(json.dumps(r)) for r in RECORDS[:4]]
    for r in records:
        seed, lr = r["params"]["seed_everything"], r["params"]["model.lr"]
        r["args"] = [*base, f"--seed_everything={seed}", f"--model.lr={lr}", "--model.weight_decay=1e-4"]
    records[3]["args"][-1] = "--model.weight_decay=0"  # lr 0.01, seed 2: another objective
    path = write(tmp_path / "merged.jsonl", records)
    assert app_main_exit(["tune", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the trials at M=16, K=4, slowcal were run with different command lines" in err
    assert (
        "--model.weight_decay 1e-4 in one, 0 in another" in err
        and "tuning compares rates averaged over seeds only" in err
    )
    # The same arguments, identities of two settings at one rate (a config file edited between two sweeps).
    for i, r in enumerate(records):
        r["args"][-1] = "--model.weight_decay=1e-4"
        r["identity"] = f"{'ab'[i == 3] * 16}-{i:08d}"
    write(path, records)
    assert app_main_exit(["tune", str(path)]) == 2
    assert "were run with different settings (the same arguments, 2 identities" in capsys.readouterr().err
    # One setting per rate (identities differ between rates only): tuned; the rate written 1e-2 is that run again.
    for r in records:
        r["identity"] = f"{str(r['params']['model.lr']) * 2}-{r['params']['seed_everything']:08d}"
    again = {**json.loads(json.dumps(records[2])), "params": {**records[2]["params"], "model.lr": "1e-2"}}
    write(path, [*records, again])
    assert app_main_exit(["tune", str(path), "--out", str(tmp_path / "t.csv")]) == 0
    (row,) = read_csv(tmp_path / "t.csv")
    assert (row["lr"], row["n_seeds"], float(row["train_objective_mean"])) == (
        "0.01",
        "2",
        pytest.approx(0.26, abs=1e-15),
    )
    assert "1 record repeats another of the same trial" in capsys.readouterr().err


def test_output_paths_of_the_wrong_kind_are_one_line_naming_the_option(tmp_path, capsys):
    results = write(tmp_path / "grid.jsonl", RECORDS)
    assert app_main_exit(["tune", str(results), "--out", str(tmp_path)]) == 2
    assert (
        capsys.readouterr().err
        == f"lit_slowcal tune: error: Invalid --out: {tmp_path} is a folder; give a file's path\n"
    )
    assert app_main_exit(["tune", str(results), "--docs", str(results)]) == 2
    assert (
        capsys.readouterr().err
        == f"lit_slowcal tune: error: Invalid --docs: {results} is a file; give a folder (made if missing)\n"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["grid.jsonl"]


def test_two_records_of_one_trial_within_float_rounding_are_the_same_values(tmp_path, capsys):
    """The same trial stacked and alone (or on two machines) agrees within 1e-12 in its diagnostics: counted once."""
    close = {
        **RECORDS[0],
        "metrics": {**RECORDS[0]["metrics"], "train_objective": 0.30 * (1 + 1e-12)},
        "run_dir": "elsewhere",
    }
    far = {**RECORDS[0], "metrics": {**RECORDS[0]["metrics"], "train_objective": 0.30 * (1 + 1e-6)}}
    assert app_main_exit(["tune", str(write(tmp_path / "close.jsonl", [*RECORDS, close]))]) == 0
    assert "| slowcal | 16 | 4 | 0.01 | no | 2 | 0.26 |" in capsys.readouterr().out
    assert app_main_exit(["tune", str(write(tmp_path / "far.jsonl", [*RECORDS, far]))]) == 2
    assert f"lines 1 and {len(RECORDS) + 1}: two records of one trial" in capsys.readouterr().err
