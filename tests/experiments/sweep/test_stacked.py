"""``sweep`` (``--stack``, the default): trials stacked into one program give exactly their single runs' results."""

import csv
import json
from pathlib import Path

import pytest
import torch
import yaml
from test_sweep import wandb_records

from lit_slowcal.experiments import sweep as sw
from lit_slowcal.experiments.sweep import grouping, stacked
from lit_slowcal.experiments.sweep.contract import DIAGNOSTICS, csv_differences, differences
from lit_slowcal.experiments.train.methods import TABLE1_METHODS
from lit_slowcal.experiments.train.model import MachinesModel

REPO = Path(__file__).resolve().parents[3]
LRS = (0.01, 0.03)
#: What was sent, logged with the train loss: the counts, and the seconds at the default link.
LINK_COUNTS = (
    "optimizer_steps", "ring_bytes_per_machine", "ring_hops", "ddp_ring_bytes_per_machine", "ddp_ring_hops",
    "comm_s_10Gbitps_1ms", "ddp_comm_s_10Gbitps_1ms",
)  # fmt: skip
SEEDS = (1, 2)


def grid_file(tmp_path: Path, lrs=LRS, seeds=SEEDS, methods=TABLE1_METHODS, extra=(), ks=(4,)) -> Path:
    """Every method x 2 lrs x 2 seeds, M = 4, K = 4, 7 rounds: evaluations at rounds 3, 6 and 7 (a final
    one off the schedule), train-loss logs every 2 rounds and after the last."""
    cfg = {
        "method": "grid",
        "parameters": {
            "method": {"values": list(methods)},
            "model.lr": {"values": list(lrs)},
            "seed_everything": {"values": list(seeds)},
            "num_machines": {"value": 4},
            "local_steps": {"values": list(ks)},
        },
        "command": [
            "${env}", "python", "-m", "lit_slowcal", "fit", "--config", "configs/paper.yaml",
            "--trainer.limit_train_batches=7", "--eval_every=3", "--trainer.log_every_n_steps=2",
            "--wandb=false", f"--run_dir={tmp_path / 'runs'}", *extra, "${args}",
        ],
    }  # fmt: skip
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "grid.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def single_runs(monkeypatch, sweep, trials):
    """Each trial run alone by the sweep's runner: its outcome, its final parameters and its metrics.csv."""
    final = {}
    monkeypatch.setattr(
        MachinesModel, "on_fit_end",
        lambda self: final.update(last={n: p.detach().clone() for n, p in self.machines.named_parameters()}),
        raising=False,
    )  # fmt: skip
    out = []
    for params in trials:
        outcome = sw.run_trial(sw.trial_args(sweep, params))
        out.append((outcome, final.pop("last", None), metrics_csv(outcome["run_dir"])))
    return out


def metrics_csv(run_dir: str):
    path = Path(run_dir) / "metrics.csv"
    return path.read_text() if path.exists() else None


@pytest.fixture(scope="module")
def command_line():
    return sw.CommandLine()


@pytest.mark.slow
def test_every_method_stacked_equals_its_single_runs_bit_for_bit(tmp_path, monkeypatch, command_line):
    # 20 single runs through Lightning (the reference) and 5 stacked groups: about 20 s, the price
    # of checking every method of the registry against the runner itself.
    monkeypatch.chdir(REPO)
    torch.set_num_threads(1)
    sweep = sw.load_sweep(grid_file(tmp_path / "single"))
    trials = sw.expand_trials(sweep)
    reference = single_runs(monkeypatch, sweep, trials)

    sweep2 = sw.load_sweep(grid_file(tmp_path / "stacked"))
    parsed = [
        stacked.StackedTrial(p, sw.trial_args(sweep2, p), command_line.parse(sw.trial_args(sweep2, p)).fit.as_dict())
        for p in trials
    ]
    groups = stacked.group_trials(parsed, budget=2**30)
    assert [len(g) for g in groups] == [4] * len(TABLE1_METHODS)  # one group per method: 2 lrs x 2 seeds
    for group in groups:
        stacked.run_group(group)
    for t, (outcome, params, csv_text) in zip(parsed, reference):
        assert outcome["status"] == t.outcome["status"] == "finished"
        # Training and test metrics bit for bit, the diagnostics within 1e-12 relative (the contract).
        assert differences(t.outcome["metrics"], outcome["metrics"]) == [], t.params
        assert all(t.outcome["metrics"][k] == outcome["metrics"][k] for k in outcome["metrics"] if k not in DIAGNOSTICS)
        # The defaults: the training objective and the per-round diagnostics (no f* without weight decay).
        assert set(t.outcome["metrics"]) == {
            "train_loss",
            "round",
            "samples_seen",
            "floats_communicated",
            "test_loss",
            "test_acc",
            "train_objective",
            "dispersion",
            "query_step",
            *LINK_COUNTS,
        } | ({"iterate_step"} if t.params["method"] == "slowcal" else set())
        for name, value in params.items():
            assert torch.equal(t.final_state["params"][name], value), (t.params, name)
        assert csv_differences(metrics_csv(t.outcome["run_dir"]), csv_text) == []
        assert (Path(t.outcome["run_dir"]) / "class_counts.csv").read_text() == (
            Path(outcome["run_dir"]) / "class_counts.csv"
        ).read_text()
    # The trials differ: the grid is not four copies of one run.
    assert len({t.outcome["metrics"]["test_loss"] for t in parsed}) == len(parsed)


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra", [("--compression=int8",), ("--compression=bf16", "--error_feedback=false"), ("--compression=topk:0.01:2",)]
)
def test_compressed_trials_stacked_equal_their_single_runs_bit_for_bit(tmp_path, monkeypatch, command_line, extra):
    """Compression runs stacked (its blocks never span two tensors, so a trial's bits do not depend on the
    others'): SLowcal-SGD, Local-SGD and Minibatch-SGD, each trial as its single run, its counts included (a
    sparse code's rounds are gathers: every message to every other machine, as its single run counts them)."""
    monkeypatch.chdir(REPO)
    torch.set_num_threads(1)
    methods = ("slowcal", "local_sgd", "minibatch_sgd")
    sweep = sw.load_sweep(grid_file(tmp_path / "single", seeds=(1,), methods=methods, extra=extra))
    trials = sw.expand_trials(sweep)
    reference = single_runs(monkeypatch, sweep, trials)
    sweep2 = sw.load_sweep(grid_file(tmp_path / "stacked", seeds=(1,), methods=methods, extra=extra))
    parsed = [
        stacked.StackedTrial(p, sw.trial_args(sweep2, p), command_line.parse(sw.trial_args(sweep2, p)).fit.as_dict())
        for p in trials
    ]
    groups = stacked.group_trials(parsed, budget=2**30)
    assert [len(g) for g in groups] == [2] * len(methods)
    for group in groups:
        stacked.run_group(group)
    exact = sw.load_sweep(grid_file(tmp_path / "exact", seeds=(1,), methods=methods))
    for t, (outcome, params, csv_text) in zip(parsed, reference):
        assert outcome["status"] == t.outcome["status"] == "finished"
        assert differences(t.outcome["metrics"], outcome["metrics"]) == [], t.params
        for name, value in params.items():
            assert torch.equal(t.final_state["params"][name], value), (t.params, name)
        assert csv_differences(metrics_csv(t.outcome["run_dir"]), csv_text) == []
    # Compressed: fewer bytes than the exact run, and not its results.
    plain = sw.run_trial(sw.trial_args(exact, trials[0]))
    assert parsed[0].outcome["metrics"]["ring_bytes_per_machine"] < 0.8 * plain["metrics"]["ring_bytes_per_machine"]
    assert parsed[0].outcome["metrics"]["test_loss"] != plain["metrics"]["test_loss"]


@pytest.mark.slow
def test_trials_of_several_k_stack_and_each_equals_its_single_run(tmp_path, monkeypatch, command_line):
    # K = 2 and 4 in one group for the local methods (SCAFFOLD: an optimizer with pre_sync / post_sync,
    # one per K): 7 rounds are 14 and 28 steps, each K synchronising, logging and evaluating on its own
    # schedule, the K = 2 trials done halfway. Minibatch-SGD's K is its batch: one group per K. The training
    # objective of every 3 evaluations in one pass: rows wait for it mid-run, and are written in order.
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(stacked, "POINTS_PER_PASS", 3)
    torch.set_num_threads(1)
    grid = dict(lrs=(0.03,), seeds=(1, 2), ks=(2, 4))
    sweep = sw.load_sweep(grid_file(tmp_path / "single", methods=("scaffold", "minibatch_sgd"), **grid))
    trials = sw.expand_trials(sweep)
    reference = single_runs(monkeypatch, sweep, trials)
    sweep2 = sw.load_sweep(grid_file(tmp_path / "stacked", methods=("scaffold", "minibatch_sgd"), **grid))
    parsed = [
        stacked.StackedTrial(p, sw.trial_args(sweep2, p), command_line.parse(sw.trial_args(sweep2, p)).fit.as_dict())
        for p in trials
    ]
    groups = stacked.group_trials(parsed, budget=2**30)
    assert [sorted({t.params["local_steps"] for t in g}) for g in groups] == [[2, 4], [2], [4]]
    for group in groups:
        stacked.run_group(group)
    for t, (outcome, params, csv_text) in zip(parsed, reference):
        assert t.outcome["status"] == outcome["status"] == "finished"
        assert differences(t.outcome["metrics"], outcome["metrics"]) == [], t.params
        assert t.outcome["metrics"]["round"] == 7 and t.outcome["stacked"] == len(next(g for g in groups if t in g))
        for name, value in params.items():
            assert torch.equal(t.final_state["params"][name], value), (t.params, name)
        assert csv_differences(metrics_csv(t.outcome["run_dir"]), csv_text) == []
    assert len({t.outcome["metrics"]["test_loss"] for t in parsed}) == len(parsed)


def stacked_and_single(tmp_path, monkeypatch, command_line, **grid):
    """The trials of ``grid_file(**grid)`` run alone (the reference) and stacked: (stacked trials, reference, groups)."""
    sweep = sw.load_sweep(grid_file(tmp_path / "single", **grid))
    trials = sw.expand_trials(sweep)
    reference = single_runs(monkeypatch, sweep, trials)
    sweep2 = sw.load_sweep(grid_file(tmp_path / "stacked", **grid))
    parsed = [
        stacked.StackedTrial(p, sw.trial_args(sweep2, p), command_line.parse(sw.trial_args(sweep2, p)).fit.as_dict())
        for p in trials
    ]
    groups = stacked.group_trials(parsed, budget=2**30)
    for group in groups:
        stacked.run_group(group)
    return parsed, reference, groups


@pytest.mark.slow
@pytest.mark.parametrize("extra", [(), ("--model.beta=0.7", "--model.average_second_moment=true")])
def test_adaptive_slowcal_stacked_equals_its_single_runs_bit_for_bit(tmp_path, monkeypatch, command_line, extra):
    """AdaptiveSlowcal stacks (elementwise steps, per-parameter clocks; with beta < 1 its swap_output around every
    evaluation and post_sync after every average): two K in one group, each trial its single run bit for bit."""
    monkeypatch.chdir(REPO)
    torch.set_num_threads(1)
    grid = dict(lrs=(0.003, 0.01), seeds=(1,), ks=(2, 4), methods=("adaptive_slowcal",), extra=extra)
    parsed, reference, groups = stacked_and_single(tmp_path, monkeypatch, command_line, **grid)
    assert [len(g) for g in groups] == [4]
    for t, (outcome, params, csv_text) in zip(parsed, reference):
        assert t.outcome["status"] == outcome["status"] == "finished"
        assert differences(t.outcome["metrics"], outcome["metrics"]) == [], t.params
        assert "iterate_step" in t.outcome["metrics"]  # w is averaged: the diagnostics see the iterate
        for name, value in params.items():
            assert torch.equal(t.final_state["params"][name], value), (t.params, name)
        assert csv_differences(metrics_csv(t.outcome["run_dir"]), csv_text) == []
    assert len({t.outcome["metrics"]["test_loss"] for t in parsed}) == len(parsed)


@pytest.mark.slow
def test_a_diverging_trial_is_frozen_and_the_others_equal_their_single_runs(tmp_path, monkeypatch, command_line):
    monkeypatch.chdir(REPO)
    torch.set_num_threads(1)
    # With weight decay: f*, G_* and the excess loss too (a loose solver tolerance keeps the solve short).
    extra = ("--model.weight_decay=1e-4", "--optimum_tol=0.5", f"--cache_dir={tmp_path / 'cache'}")
    sweep = sw.load_sweep(grid_file(tmp_path, lrs=(0.01, 1e38), seeds=(1,), methods=("local_sgd",), extra=extra))
    trials = sw.expand_trials(sweep)
    reference = single_runs(monkeypatch, sweep, trials)
    parsed = [
        stacked.StackedTrial(p, sw.trial_args(sweep, p), command_line.parse(sw.trial_args(sweep, p)).fit.as_dict())
        for p in trials
    ]
    stacked.run_group(parsed)
    ok, bad = parsed
    assert ok.outcome["status"] == "finished" and differences(ok.outcome["metrics"], reference[0][0]["metrics"]) == []
    assert {"f_star", "G_star", "optimum_grad_norm", "excess_loss", "train_objective"} <= set(ok.outcome["metrics"])
    assert torch.equal(ok.final_state["params"]["weight"], reference[0][1]["weight"])
    assert reference[1][0]["status"] == bad.outcome["status"] == "diverged"
    assert bad.outcome["error"] == reference[1][0]["error"]
    assert differences(bad.outcome["metrics"], reference[1][0]["metrics"]) == []
    for t, (outcome, _, csv_text) in zip(parsed, reference):
        assert csv_differences(metrics_csv(t.outcome["run_dir"]), csv_text) == []


def test_groups_split_to_the_memory_budget(command_line):
    args = lambda m, lr, s: ["fit", "--config", "configs/paper.yaml", f"--num_machines={m}", f"--model.lr={lr}",
                             f"--seed_everything={s}", "--wandb=false"]  # fmt: skip
    trials = [
        stacked.StackedTrial({}, a, command_line.parse(a).fit.as_dict())
        for a in [args(16, lr, s) for lr in (0.01, 0.1) for s in (1, 2, 3)] + [args(32, 0.01, 1)]
    ]
    one = stacked.trial_bytes(trials[0].config)
    # M=16, K=16: parameters and their copies, 235 rounds x 16 steps x 16 machines of int64 indices, a round
    assert one == 6 * 16 * 7850 * 4 + 235 * 16 * 16 * 8 + 2 * 16 * 16 * (784 * 4 + 8)
    assert [len(g) for g in stacked.group_trials(trials, budget=10 * one)] == [6, 1]
    assert [len(g) for g in stacked.group_trials(trials, budget=4 * one)] == [4, 2, 1]
    assert [len(g) for g in stacked.group_trials(trials, budget=1)] == [1] * 7


def test_stacked_sweep_killed_between_groups_reruns_only_the_unfinished_trials(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    path = grid_file(tmp_path, lrs=(0.01, 0.03), seeds=(1,), methods=("slowcal", "local_sgd"))
    results = tmp_path / "results.jsonl"
    run_group, calls = stacked.run_group, []

    def killed_in_second_group(group, *args):
        calls.append(len(group))
        if len(calls) == 2:
            raise KeyboardInterrupt
        run_group(group, *args)

    monkeypatch.setattr(stacked, "run_group", killed_in_second_group)
    assert sw.main([str(path), "--results", str(results), "--stack", "--workers", "1"]) == 130
    first = [json.loads(line) for line in results.read_text().splitlines()]
    assert [r["params"]["method"] for r in first] == ["slowcal", "slowcal"] and calls == [2, 2]
    out = capsys.readouterr().out
    assert (
        "stacking: 4 trials in 2 groups (memory budget" in out and "method=slowcal M=4 K=4 b=1: 2 trials stacked" in out
    )

    monkeypatch.setattr(stacked, "run_group", run_group)
    assert sw.main([str(path), "--results", str(results), "--stack", "--workers", "1"]) == 0
    out = capsys.readouterr().out
    assert "4 trials, 2 already in" in out and "stacking: 2 trials in 1 groups" in out
    records = [json.loads(line) for line in results.read_text().splitlines()]
    assert records[:2] == first and [r["params"]["method"] for r in records[2:]] == ["local_sgd", "local_sgd"]
    assert all(r["status"] == "finished" and r["metrics"]["round"] == 7 for r in records)
    assert len({r["run_dir"] for r in records}) == 4  # a folder each, the two lrs of a seed included


def test_stacked_trials_with_wandb_get_one_offline_run_each_in_the_sweeps_group(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("WANDB_MODE", "offline")  # no account here: the runs are written offline
    monkeypatch.setenv("WANDB_SILENT", "true")
    path = grid_file(tmp_path, lrs=(0.01, 0.03), seeds=(1,), methods=("local_sgd",))
    path.write_text(path.read_text().replace("--wandb=false", "--wandb=true"))
    assert sw.main([str(path), "--results", str(tmp_path / "r.jsonl"), "--stack"]) == 0
    assert "stacking: 2 trials in 1 groups" in capsys.readouterr().out
    records = [json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()]
    for r in records:
        (run_file,) = Path(r["run_dir"]).glob("wandb/offline-run-*/run-*.wandb")  # its own run, in its folder
        items = list(wandb_records(run_file))
        (run,) = [i.run for i in items if i.WhichOneof("record_type") == "run"]
        config = {item.key: json.loads(item.value_json) for item in run.config.update}
        assert run.run_group == "sweep-grid" and config["model.lr"] == r["params"]["model.lr"]
        rows = [
            {(h.key or "/".join(h.nested_key)): json.loads(h.value_json) for h in i.history.item}
            for i in items
            if i.WhichOneof("record_type") == "history"
        ]
        assert [row["test_acc"] for row in rows if "test_acc" in row][-1] == r["metrics"]["test_acc"]
        assert [row["train_loss"] for row in rows if "train_loss" in row][-1] == r["metrics"]["train_loss"]


def test_trials_that_cannot_be_stacked_run_one_at_a_time_and_say_why(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    path = grid_file(tmp_path, lrs=(0.01,), seeds=(1,), methods=("local_sgd",), extra=("--trainer.max_epochs=2",))
    assert sw.main([str(path), "--results", str(tmp_path / "r.jsonl"), "--stack"]) == 0
    out = capsys.readouterr().out
    assert "stacking: 0 trials in 0 groups" in out and "1 trials not stacked: trainer.max_epochs is 2" in out
    (record,) = [json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert record["status"] == "finished" and "stacked" not in record


def test_trials_of_another_problem_run_one_at_a_time_and_say_why(command_line):
    base = ["fit", "--config", "configs/paper.yaml", "--wandb=false"]
    assert stacked.stackable(command_line.parse(base).fit.as_dict()) is None  # objective and diagnostics on
    config = command_line.parse(base + ["--data.problem=Quadratic"]).fit.as_dict()
    assert stacked.stackable(config) == (
        "data.problem is set (stacking trains the default problem, MNIST, only; use data.problem=null)"
    )
    for extra in (["--overlap_delay=1"], ["--fragments=2"]):  # overlapped rounds: one at a time
        config = command_line.parse(base + extra).fit.as_dict()
        assert stacked.stackable(config) == "overlap_delay or fragments is set (stacking runs blocking rounds)"
    config = command_line.parse(base + ["--state_every=2"]).fit.as_dict()  # the stack averages the state every round
    assert stacked.stackable(config) == "state_every is set (stacking averages the state every round)"
    config = command_line.parse(base + ["--average_state=momentum_buffer"]).fit.as_dict()
    assert stacked.stackable(config) == "average_state is set (stacking averages the method's own state only)"
    assert stacked.stackable(command_line.parse(base + ["--compression=int8"]).fit.as_dict()) is None  # stacked


def test_stack_memory_must_be_positive(tmp_path, capsys):
    path = grid_file(tmp_path, methods=("local_sgd",))
    assert sw.main([str(path), "--stack", "--stack-memory", "0"]) == 2
    assert "--stack-memory" in capsys.readouterr().err


@pytest.mark.parametrize("b", [1, 3])
def test_linear_gradients_equal_autograds(b):
    # The stacked step forms the linear layer's gradients itself, into buffers kept from step to step:
    # the values autograd gives SimulatedMachines (b = 1: products instead of a matmul of inner size 1).
    from lit_slowcal.simulated import SimulatedMachines

    torch.manual_seed(0)
    machines = SimulatedMachines(torch.nn.Linear(784, 10), 6)
    x, y = torch.randn(6, b, 784), torch.randint(0, 10, (6, b))
    x[:, :, :100] = 0  # zero features: zero products, of either sign
    model = MachinesModel(num_machines=6, lr=0.1)
    model.configure_model()
    model.machines = machines
    model._machine_losses(x, y).sum().backward()
    with torch.no_grad():
        logits = machines(x)
    logits.requires_grad_()
    (grad_logits,) = torch.autograd.grad(model.losses_of(logits, y).sum(), logits)
    weight, bias = torch.full_like(machines.weight, float("nan")), torch.full_like(machines.bias, float("nan"))
    stacked._linear_grads(x, grad_logits, weight, bias)
    assert torch.equal(weight, machines.weight.grad) and torch.equal(bias, machines.bias.grad)
    assert (machines.weight.grad == 0).any()  # the zero products are among those compared


@pytest.mark.slow
def test_workers_run_groups_and_lone_trials_with_the_same_results(tmp_path, monkeypatch, capfd):
    # --workers 2: two processes, each a group (or, with --no-stack, a trial) at a time; every trial
    # recorded once, with the metrics of the same sweep run in one process. Forked workers (Linux) also
    # check the trials' arguments; spawned ones (elsewhere, or once CUDA is in use) only run them.
    from lit_slowcal.experiments.sweep import workers

    monkeypatch.chdir(REPO)
    path = grid_file(tmp_path, lrs=(0.01, 0.03), seeds=(1,), methods=("slowcal", "local_sgd"))
    runs = {}
    variants = (
        ("one", ["--stack", "--workers", "1"]), ("stacked", ["--stack", "--workers", "2"]),
        ("alone", ["--no-stack", "--workers", "2"]), ("spawned", ["--no-stack", "--workers", "2"]),
    )  # fmt: skip
    for name, extra in variants:
        results = tmp_path / f"{name}.jsonl"
        with monkeypatch.context() as m:
            if name == "spawned":
                m.setattr(workers, "_forks", lambda: False)
            assert sw.main([str(path), "--results", str(results), *extra]) == 0
        records = [json.loads(line) for line in results.read_text().splitlines()]
        assert len(records) == 4 and len({sw.trial_key(r["params"]) for r in records}) == 4
        runs[name] = {sw.trial_key(r["params"]): (r["status"], r["metrics"]) for r in records}
        out = capfd.readouterr().out
        if name != "one":
            assert "workers: 2 (--workers 2, 1 thread each)" in out
    for name in ("stacked", "alone", "spawned"):  # by the contract: the diagnostics within 1e-12 relative
        assert runs[name].keys() == runs["one"].keys()
        for key, (status, metrics) in runs[name].items():
            assert status == runs["one"][key][0] and differences(metrics, runs["one"][key][1]) == [], (name, key)
    assert all(status == "finished" for status, _ in runs["one"].values())


def test_workers_must_be_a_positive_integer(tmp_path, capsys):
    path = grid_file(tmp_path, seeds=(1,), methods=("slowcal",))
    assert sw.main([str(path), "--results", str(tmp_path / "r.jsonl"), "--workers", "0"]) == 2
    assert "Invalid --workers: 0 (must be an integer >= 1)" in capsys.readouterr().err


def test_groups_are_halved_only_while_that_shortens_the_workers_time():
    def group(n, method="slowcal", k=16):
        config = {"method": method, "num_machines": 16, "local_steps": k, "batch_size": 1, "eval_every": 10}
        return [stacked.StackedTrial({"seed": i}, [], config) for i in range(n)]

    # One group of 6 M = 16 trials (3,750 steps, 234 rounds of K = 16: 24 evaluations each) on 2 workers: two
    # halves of 3 (each 3,750 x (48 + 40) + 72 evaluations against 3,750 x (96 + 40) + 144 for the whole);
    # halving again would not end sooner.
    parts = stacked.balance_groups([group(6)], 2)
    assert [len(p) for p in parts] == [3, 3] and [t.params["seed"] for p in parts for t in p] == list(range(6))
    # Two long groups and a short one (Minibatch-SGD, K = 16: 234 steps): already balanced on 2 workers.
    groups = [group(6), group(6, "local_sgd"), group(6, "minibatch_sgd")]
    assert stacked.balance_groups(groups, 2) == groups
    assert stacked.group_cost(group(6)) == 3750 * (96 + 40) + 6 * 24 * grouping.EVALUATION_COST
    # Without the objective an evaluation is the test set's alone; the smaller K, the more evaluations.
    bare = [stacked.StackedTrial(t.params, [], {**t.config, "objective": False}) for t in group(6)]
    assert stacked.group_cost(bare) == 3750 * (96 + 40) + 6 * 24 * grouping.TEST_COST
    assert stacked.group_cost(group(6, k=4)) == 3750 * (96 + 40) + 6 * 94 * grouping.EVALUATION_COST


def test_stacked_trials_claim_their_own_run_folders_when_another_sweep_lists_the_same_versions(
    tmp_path, monkeypatch, capsys
):
    """Two sweeps (or a sweep's workers) may both see version_0 as the next free folder of a run name: each trial
    claims its folder by creating it, as a single run does, so no two trials share one."""
    from lightning.pytorch.loggers import CSVLogger

    monkeypatch.chdir(REPO)
    monkeypatch.setattr(CSVLogger, "_get_next_version", lambda self: 0)  # what a concurrent lister saw
    path = grid_file(tmp_path, lrs=(0.01, 0.03, 0.1), seeds=(1,), methods=("slowcal",))
    results = tmp_path / "results.jsonl"
    assert sw.main([str(path), "--results", str(results), "--stack", "--workers", "1"]) == 0
    records = [json.loads(line) for line in results.read_text().splitlines()]
    assert [r["status"] for r in records] == ["finished"] * 3
    folders = [Path(r["run_dir"]) for r in records]
    assert sorted(f.name for f in folders) == ["version_0", "version_1", "version_2"]
    for r, folder in zip(records, folders):
        assert yaml.safe_load((folder / "config.yaml").read_text())["model"]["lr"] == r["params"]["model.lr"]
        rows = list(csv.DictReader(open(folder / "metrics.csv")))
        assert [row["round"] for row in rows if row.get("test_acc")] == ["3.0", "6.0", "7.0"]  # its own rows only
        assert float(rows[-1]["test_acc"]) == r["metrics"]["test_acc"]


def test_a_stacked_sweep_reads_the_results_again_before_each_group(tmp_path, monkeypatch, capsys):
    """Another sweep on the same results file (stacked or not) may record a planned group's trials meanwhile:
    those are not run again."""
    from lit_slowcal.experiments.sweep import checks

    monkeypatch.chdir(REPO)
    path = grid_file(tmp_path, lrs=(0.01, 0.03), seeds=(1,), methods=("slowcal", "local_sgd"))
    results = tmp_path / "results.jsonl"
    sweep, run_group, calls = sw.load_sweep(path), stacked.run_group, []

    def with_another_sweep(group, *args):
        calls.append([t.params["method"] for t in group])
        run_group(group, *args)
        if len(calls) == 1:  # meanwhile another sweep records one trial of the next group
            params = {
                "local_steps": 4,
                "method": "local_sgd",
                "model.lr": 0.03,
                "num_machines": 4,
                "seed_everything": 1,
            }
            identity = checks.trial_identity_of(sw.CommandLine().parse(sw.trial_args(sweep, params)))
            sw.ResultsFile(results).put(
                {"params": params, "identity": identity, "status": "finished", "metrics": {"test_acc": 0.5}}
            )

    monkeypatch.setattr(stacked, "run_group", with_another_sweep)
    assert sw.main([str(path), "--results", str(results), "--stack", "--workers", "1"]) == 0
    assert calls == [["slowcal", "slowcal"], ["local_sgd"]]
    assert "(1 already in" in capsys.readouterr().out
    records = [json.loads(line) for line in results.read_text().splitlines()]
    assert len(records) == 4 and records[0]["metrics"] == {"test_acc": 0.5}  # the other sweep's record stays
    assert [r["params"]["method"] for r in records[1:]] == ["slowcal", "slowcal", "local_sgd"]
