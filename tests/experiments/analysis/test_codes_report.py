"""sweeps/communication/codes.py (docs/communication.md, "Fewer bytes"): the rate chosen per cell on the training
objective (seed 1, or seeds 1-3 where every rate ran them), the seeds' mean and spread at it, the bytes against
float32's, and the cheapest cell that reaches a target."""

import importlib.util
import json
import math
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def codes():
    spec = importlib.util.spec_from_file_location("codes", ROOT / "sweeps" / "communication" / "codes.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def record(method, lr, seed, objective, acc, sent, compression=None, **extra):
    params = {"method": "diloco" if method == "local_adamw" else method, "num_machines": 64, "local_steps": 64,
              "model.lr": lr, "seed_everything": seed, **extra}  # fmt: skip
    if compression:
        params["compression"] = compression
    args = ["fit", "--model.outer=none"] if method == "local_adamw" else ["fit"]
    metrics = {"train_objective": objective, "test_acc": acc, "ring_bytes_per_machine": sent}
    return {"params": params, "status": "finished", "metrics": metrics, "args": args}


def write(tmp_path, recs):
    """The records as a results file."""
    path = tmp_path / "r.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    return path


def written(tmp_path):
    """The sweep files written (``OUT`` set to ``tmp_path / "out"``)."""
    return sorted(p.name for p in (tmp_path / "out").iterdir())


def test_rows_choose_by_seed_one_then_report_every_seed_at_that_rate(codes, tmp_path):
    recs = [
        record("local_adamw", 0.001, 1, 0.40, 0.80, 100.0),
        record("local_adamw", 0.002, 1, 0.30, 0.70, 100.0),  # lower objective, lower accuracy: still chosen
        record("local_adamw", 0.002, 2, 0.31, 0.72, 100.0),
        record("local_adamw", 0.002, 1, 0.35, 0.71, 10.0, compression="int2"),
        record("slowcal", 0.01, 1, 0.20, 0.90, 200.0, compression="int2"),
        record("slowcal", 0.01, 2, 0.20, 0.88, 200.0, compression="int2"),
        record("slowcal", 0.02, 1, 0.10, 0.91, 200.0, compression="int2"),  # best on seed 1, not on the mean
        record("slowcal", 0.02, 2, 0.40, 0.91, 200.0, compression="int2"),
    ]
    path = write(tmp_path, recs)
    found = {(r["method"], r["code"]): r for r in codes.rows(path)}
    adamw = found["local_adamw", "float32"]
    assert (adamw["lr"], adamw["seeds"], adamw["lr_at_edge"]) == (0.002, 2, "high")
    assert adamw["mean"] == pytest.approx(0.71) and adamw["std"] == pytest.approx(math.sqrt(2) * 0.01)
    assert found["local_adamw", "int2"]["x_float32_bytes"] == pytest.approx(0.1)
    assert found["slowcal", "int2"]["lr"] == 0.01  # seeds 1-2 ran at both rates: their mean picks
    assert math.isnan(found["slowcal", "int2"]["x_float32_bytes"])  # no float32 cell to compare with
    rows = list(found.values())
    assert codes.targets(rows, "mnist64") == [("float32 Local-SGD with AdamW", pytest.approx(0.709))]  # less 0.1 point
    first = codes.cheapest(rows, "mnist64", 0.71)
    assert [(r["method"], r["code"]) for r in first] == [("local_adamw", "int2"), ("local_adamw", "float32"),
                                                          ("slowcal", "int2")]  # fmt: skip
    assert codes.better("test_bpc", 2.4, 2.5) and not codes.better("test_acc", 0.7, 0.8)


def test_edges_write_the_next_rate_out_once_and_only_where_the_chosen_rate_is_an_edge(codes, tmp_path, monkeypatch):
    recs = [  # float32: 0.001 chosen, the highest searched; int2: 0.001 chosen between two others
        record("local_adamw", 0.000464, 1, 0.40, 0.80, 100.0),
        record("local_adamw", 0.001, 1, 0.30, 0.81, 100.0),
        record("local_adamw", 0.001, 2, 0.31, 0.82, 100.0),  # seed 2 at one rate only: the edge runs seed 1
        record("local_adamw", 0.000464, 1, 0.40, 0.70, 10.0, compression="int2"),
        record("local_adamw", 0.001, 1, 0.20, 0.71, 10.0, compression="int2"),
        record("local_adamw", 0.00215, 1, 0.50, 0.60, 10.0, compression="int2"),
        record("slowcal", 0.01, 1, 0.10, 0.90, 200.0, compression="int2", error_feedback="false"),  # lowest
        record("slowcal", 0.01, 2, 0.10, 0.90, 200.0, compression="int2", error_feedback="false"),
        record("slowcal", 0.0215, 1, 0.30, 0.90, 200.0, compression="int2", error_feedback="false"),
        record("slowcal", 0.0215, 2, 0.30, 0.90, 200.0, compression="int2", error_feedback="false"),
    ]
    path = write(tmp_path, recs)
    monkeypatch.setattr(codes, "OUT", tmp_path / "out")
    codes.edges(path)
    names = written(tmp_path)
    assert names == ["mnist64_local_adamw_float32_edge.yaml", "mnist64_slowcal_int2_noef_edge.yaml"]
    adamw = (tmp_path / "out" / names[0]).read_text()
    assert "model.lr: {values: [0.00215]}" in adamw and "seed_everything: {values: [1]}" in adamw
    assert 'compression: {values: ["null"]}' in adamw and "outer: {values: [none]}" in adamw
    slowcal = (tmp_path / "out" / names[1]).read_text()
    assert "model.lr: {values: [0.00464]}" in slowcal and "seed_everything: {values: [1, 2]}" in slowcal
    assert "error_feedback: {values: [false]}" in slowcal
    (tmp_path / "out" / names[0]).write_text("kept")
    codes.edges(path)  # once: a written edge sweep is not written again
    assert (tmp_path / "out" / names[0]).read_text() == "kept"


def test_edges_step_a_tuned_state_cell_out_and_leave_one_its_three_rates_bracket(codes, tmp_path, monkeypatch):
    """A state cell is stepped out once ``tune`` has searched its three rates: a moments cell (DiLoCo, every 4th)
    whose seed 1 chose its highest rate gets the grid's next rate with its own parameters; SLowcal-SGD's w every 4th,
    whose seeds' mean chose its middle rate, gets nothing; a state cell that ran one rate only is ``tune``'s. Once the
    added rate wins on seed 1, ``tune`` runs seeds 2-3 there."""
    monkeypatch.setattr(codes, "OUT", tmp_path / "out")
    moments = {"compression": "int8", "state_every": 4, "average_state": codes.MOMENTS}
    recs = [record("diloco", lr, 1, objective, 0.80, 300.0, **moments)
            for lr, objective in ((0.0001, 0.50), (0.000215, 0.40), (0.000464, 0.30))]  # fmt: skip
    recs += [record("diloco", 0.000464, s, 0.30, 0.80, 300.0, **moments) for s in (2, 3)]
    state = {"compression": "int4", "state_every": 4}
    recs += [record("slowcal", lr, s, objective, 0.90, 200.0, **state)
             for lr, objective in ((0.01, 0.40), (0.0215, 0.20), (0.0464, 0.30)) for s in (1, 2, 3)]  # fmt: skip
    recs += [record("slowcal", 0.0215, s, 0.30, 0.90, 200.0, compression="int2", state_every=4) for s in (1, 2, 3)]
    codes.edges(write(tmp_path, recs))
    assert written(tmp_path) == ["mnist64_diloco_moments_int8_every4_edge.yaml"]
    diloco = (tmp_path / "out" / "mnist64_diloco_moments_int8_every4_edge.yaml").read_text()
    assert "model.lr: {values: [0.001]}" in diloco and "seed_everything: {values: [1]}" in diloco
    assert "state_every: {values: [4]}" in diloco and "compression: {values: [int8]}" in diloco
    assert (
        "average_state" in diloco and "DiLoCo, moments averaged, mnist64, int8, moments every 4: its chosen" in diloco
    )
    # Seed 1 does better at the added rate: ``tune`` runs seeds 2-3 there, in a file of its own (the ``*_rates_seeds``
    # file of an earlier move stays as it ran); the cell that ran one rate gets its two neighbours.
    recs.append(record("diloco", 0.001, 1, 0.25, 0.80, 300.0, **moments))
    codes.tune(write(tmp_path, recs))
    assert written(tmp_path) == [
        "mnist64_diloco_moments_int8_every4_edge.yaml",
        "mnist64_diloco_moments_int8_every4_edge_seeds.yaml",
        "mnist64_slowcal_int2_state4_rates.yaml",
    ]
    seeds = (tmp_path / "out" / "mnist64_diloco_moments_int8_every4_edge_seeds.yaml").read_text()
    assert "model.lr: {values: [0.001]}" in seeds and "seed_everything: {values: [2, 3]}" in seeds


def test_tune_runs_seed_one_either_side_of_a_state_cells_rate_then_seeds_two_and_three_where_it_moved(
    codes, tmp_path, monkeypatch
):
    """A state cell (SLowcal-SGD's w every 4th round, stacked on MNIST) ran seeds 1-3 at its plain cell's rate,
    0.0215: ``tune`` writes seeds 1-3 at the grid's 0.01 and 0.0464, and a moments cell (Local-SGD with AdamW, every
    round) seed 1 at 0.000464 and 0.00215, once. Once the seeds' mean chose 0.0464 for the first, it needs nothing
    more; once seed 1 chose 0.000464 for the second, seeds 2-3 run there."""
    monkeypatch.setattr(codes, "OUT", tmp_path / "out")
    state = {"compression": "int4", "state_every": 4}
    recs = [record("slowcal", 0.0215, s, 0.30, 0.90, 200.0, **state) for s in (1, 2, 3)]
    moments = {"compression": "int4", "state_every": 1, "average_state": codes.MOMENTS}
    recs += [record("local_adamw", 0.001, s, 0.30, 0.85, 300.0, **moments) for s in (1, 2, 3)]
    path = write(tmp_path, recs)
    codes.tune(path)
    names = written(tmp_path)
    assert names == ["mnist64_local_adamw_moments_int4_every1_rates.yaml", "mnist64_slowcal_int4_state4_rates.yaml"]
    slowcal = (tmp_path / "out" / names[1]).read_text()
    assert "model.lr: {values: [0.01, 0.0464]}" in slowcal and "seed_everything: {values: [1, 2, 3]}" in slowcal
    assert "compression: {values: [int4]}" in slowcal and "state_every: {values: [4]}" in slowcal
    adamw = (tmp_path / "out" / names[0]).read_text()
    assert "model.lr: {values: [0.000464, 0.00215]}" in adamw and "average_state" in adamw
    assert "state_every: {values: [1]}" in adamw and "outer: {values: [none]}" in adamw
    for name in names:
        (tmp_path / "out" / name).unlink()
    recs += [record("slowcal", lr, s, objective, 0.90, 200.0, **state)
             for lr, objective in ((0.01, 0.40), (0.0464, 0.20)) for s in (1, 2, 3)]  # fmt: skip
    recs += [
        record("local_adamw", 0.000464, 1, 0.20, 0.84, 300.0, **moments),  # seed 1's lowest objective: chosen
        record("local_adamw", 0.00215, 1, 0.60, 0.83, 300.0, **moments),
    ]
    write(tmp_path, recs)
    codes.tune(path)
    names = written(tmp_path)
    assert names == ["mnist64_local_adamw_moments_int4_every1_rates_seeds.yaml"]
    seeds = (tmp_path / "out" / names[0]).read_text()
    assert "model.lr: {values: [0.000464]}" in seeds and "seed_everything: {values: [2, 3]}" in seeds
