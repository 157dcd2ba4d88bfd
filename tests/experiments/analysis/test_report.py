"""``python -m lit_slowcal report``: figures and the markdown table from a sweep's results file."""

import json
import struct
from pathlib import Path

import pytest

from lit_slowcal.experiments.analysis import report

PNG = b"\x89PNG\r\n\x1a\n"


def record(method, m, k, seed, acc, loss, status="finished", **extra):
    return {
        "params": {"local_steps": k, "method": method, "num_machines": m, "seed_everything": seed, **extra},
        "status": status,
        "error": None if status == "finished" else "Training diverged: ...",
        "metrics": {"test_acc": acc, "test_loss": loss, "round": 10.0},
    }


# method, M, K -> (accuracies, losses) over seeds 1, 2, 3
DATA = {
    ("slowcal", 16, 4): ([0.90, 0.91, 0.92], [0.30, 0.32, 0.34]),
    ("slowcal", 16, 8): ([0.89, 0.89, 0.92], [0.40, 0.40, 0.40]),
    ("local_sgd", 16, 4): ([0.88, 0.90, 0.92], [0.50, 0.55, 0.60]),
    ("local_sgd", 16, 8): ([0.80, 0.85, 0.90], [0.70, 0.70, 0.70]),
    ("slowcal", 32, 4): ([0.87, 0.88, 0.89], [0.31, 0.33, 0.35]),
    ("local_sgd", 32, 4): ([0.90, 0.90, 0.90], [0.20, 0.20, 0.20]),
}


def write_results(path: Path) -> None:
    records = [
        record(method, m, k, seed, acc, loss)
        for (method, m, k), (accs, losses) in DATA.items()
        for seed, acc, loss in zip((1, 2, 3), accs, losses)
    ]
    # A diverged trial is listed, never averaged; local_sgd at M=32, K=8 has no finished seed.
    records.append(record("local_sgd", 32, 8, 1, None, None, status="diverged"))
    records.append(record("slowcal", 32, 8, 1, 0.85, 0.45))
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_report_writes_both_figures_and_a_table_of_seed_means(tmp_path, capsys):
    results = tmp_path / "paper.jsonl"
    write_results(results)
    assert report.main([str(results), "--out", str(tmp_path / "docs")]) == 0
    docs = tmp_path / "docs"
    # Two panels (M = 16, 32) of 4.2 x 3.6 inches at 120 dpi.
    assert png_size(docs / "paper_accuracy.png") == (1008, 432)
    assert png_size(docs / "paper_loss.png") == (1008, 432)

    table = (docs / "paper_results.md").read_text()
    assert table.startswith("# Results of paper.jsonl\n\n![test accuracy](paper_accuracy.png)")
    rows = [line for line in table.splitlines() if line.startswith("|")]
    assert rows[0] == ("| M | K | SLowcal-SGD acc | Local-SGD acc | SLowcal-SGD loss | Local-SGD loss |")
    # Means and sample standard deviations by hand:
    # slowcal 16/4: acc (0.90+0.91+0.92)/3 = 0.91, std 0.01; loss 0.32, std 0.02
    # local_sgd 16/4: acc 0.90, std 0.02; loss 0.55, std 0.05
    assert rows[2] == "| 16 | 4 | **0.9100 ± 0.0100** | 0.9000 ± 0.0200 | 0.3200 ± 0.0200 | 0.5500 ± 0.0500 |"
    # slowcal 16/8: acc 2.70/3 = 0.90, std sqrt((1e-4 + 1e-4 + 4e-4) / 2) = 0.0173; local_sgd 0.85, std 0.05
    assert rows[3] == "| 16 | 8 | **0.9000 ± 0.0173** | 0.8500 ± 0.0500 | 0.4000 ± 0.0000 | 0.7000 ± 0.0000 |"
    assert rows[4] == "| 32 | 4 | 0.8800 ± 0.0100 | **0.9000 ± 0.0000** | 0.3300 ± 0.0200 | 0.2000 ± 0.0000 |"
    # one seed only: its value, std 0; the diverged local_sgd run is not averaged
    assert rows[5] == "| 32 | 8 | **0.8500 ± 0.0000** | n/a | 0.4500 ± 0.0000 | n/a |"
    assert "Not counted (1): local_sgd M=32 K=8 seed=1 diverged." in table
    assert "\n20 trials (19 finished), 0.0 min of training in all." in table
    assert "\n".join(rows) in capsys.readouterr().out  # the table is printed too


def test_aggregate_means_and_refuses_a_second_varying_parameter():
    records = [record("slowcal", 16, 4, s, a, 0.3) for s, a in ((1, 0.5), (2, 0.7))]
    cells = report.aggregate(records, "test_acc")
    assert list(cells) == [(16, 4, "slowcal")]
    assert cells[16, 4, "slowcal"].mean == pytest.approx(0.6) and cells[16, 4, "slowcal"].n == 2
    records.append(record("slowcal", 16, 4, 3, 0.9, 0.3, **{"model.lr": 0.1}))
    with pytest.raises(ValueError, match="model.lr takes several values"):
        report.aggregate(records, "test_acc")
    with pytest.raises(ValueError, match="lacks num_machines"):
        report.aggregate(
            [{"params": {"method": "slowcal", "local_steps": 4}, "status": "finished", "metrics": {}}], "test_acc"
        )


def test_report_of_a_missing_or_empty_file_is_an_error(tmp_path, capsys):
    assert report.main([str(tmp_path / "none.jsonl"), "--out", str(tmp_path)]) == 2
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps(record("slowcal", 16, 4, 1, None, None, status="failed")) + "\n")
    assert report.main([str(empty), "--out", str(tmp_path)]) == 2
    assert "no finished trial" in capsys.readouterr().err
    assert not list(tmp_path.glob("*.png"))


def test_any_number_of_methods_registry_order_first_then_others(tmp_path):
    names = ["scaffold", "my_method", "accel_minibatch_sgd", "minibatch_sgd", "local_sgd", "slowcal", "another"]
    records = [record(m, 16, k, s, 0.8 + 0.01 * i + 0.001 * s, 0.5 - 0.01 * i) for i, m in enumerate(names)
               for k in (4, 8) for s in (1, 2)]  # fmt: skip
    acc = report.aggregate(records, "test_acc")
    loss = report.aggregate(records, "test_loss")
    table = report.markdown_table(acc, loss)
    header = table.splitlines()[0]
    labels = [
        "SLowcal-SGD",
        "Local-SGD",
        "Minibatch-SGD",
        "Accelerated Minibatch-SGD",
        "SCAFFOLD",
        "another",
        "my_method",
    ]
    assert header == "| M | K | " + " | ".join(f"{lab} acc" for lab in labels) + " | " + " | ".join(
        f"{lab} loss" for lab in labels) + " |"  # fmt: skip
    # The best mean accuracy of a row is bold: "another" (i = 6), 0.86 + 0.0015.
    assert "**0.8615 ± 0.0007**" in table.splitlines()[2]
    path = tmp_path / "seven.png"
    report.plot_metric(acc, "accuracy", "seven methods", path)
    assert png_size(path) == (504, 432)


def test_report_adds_excess_loss_figures_and_g_star_per_split(tmp_path, capsys):
    records = []
    for method, excess in (("slowcal", (0.01, 0.03)), ("local_sgd", (0.04, 0.06))):
        for seed, final in zip((1, 2), excess):
            run = tmp_path / f"{method}{seed}"
            run.mkdir()
            # Validation rows hold round and excess_loss; training rows leave excess_loss empty.
            (run / "metrics.csv").write_text(
                f"epoch,excess_loss,round,step,train_loss\n0,,5.0,4,0.5\n0,{10 * final},5.0,4,\n0,{final},10.0,9,\n"
            )
            r = record(method, 64, 64, seed, 0.9, 0.3)
            r["metrics"].update(excess_loss=final, G_star=2.0 + seed)  # G_* of seed 1's split: 3, seed 2's: 4
            r["run_dir"] = str(run)
            records.append(r)
    results = tmp_path / "wd.jsonl"
    results.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert report.main([str(results), "--out", str(tmp_path / "docs")]) == 0
    docs = tmp_path / "docs"
    assert png_size(docs / "wd_excess_loss.png") == (504, 432)  # one panel (M = 64)
    assert png_size(docs / "wd_excess_rounds.png") == (624, 432)
    table = (docs / "wd_results.md").read_text()
    assert "![excess loss](wd_excess_loss.png)" in table and "![excess rounds](wd_excess_rounds.png)" in table
    rows = [line for line in table.splitlines() if line.startswith("|")]
    assert rows[0].startswith("| M | K | G_* | SLowcal-SGD acc |") and rows[0].endswith(
        "| SLowcal-SGD excess loss | Local-SGD excess loss |"
    )
    # G_*: (3 + 4) / 2 = 3.5, std 0.7071; excess: slowcal 0.02 ± 0.01414, local_sgd 0.05 ± 0.01414
    assert rows[2].startswith("| 64 | 64 | 3.5000 ± 0.7071 |")
    assert rows[2].endswith("| 2.000e-02 ± 1.414e-02 | 5.000e-02 ± 1.414e-02 |")
    # Against rounds: the mean over seeds at each round.
    curves = report.excess_curves(records, 64, 64)
    assert curves["slowcal"] == [(5.0, pytest.approx(0.2)), (10.0, pytest.approx(0.02))]
    assert curves["local_sgd"] == [(5.0, pytest.approx(0.5)), (10.0, pytest.approx(0.05))]
    assert report.main([str(results), "--out", str(tmp_path), "--curve", "64"]) == 2
    assert "Invalid --curve: '64' (must be M,K, two integers, e.g. 64,64)" in capsys.readouterr().err


# ------------------------------------------------------------- one setting per cell, whole records


def test_trials_run_with_different_command_lines_are_never_averaged_into_one_cell(tmp_path, capsys):
    base = ["fit", "--config", "configs/paper.yaml", "--method=slowcal", "--num_machines=16", "--local_steps=4"]
    records = [
        {**record("slowcal", 16, 4, 1, 0.90, 0.30), "args": [*base, "--seed_everything=1", "--model.lr=0.01"]},
        {
            **record("slowcal", 16, 4, 2, 0.10, 9e5),
            "args": [*base, "--seed_everything=2", "--model.lr=3.0", "--wandb=false"],
        },
    ]
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert report.main([str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "M=16, K=4, slowcal" in err and "--model.lr 0.01 in one, 3.0 in another" in err
    assert (
        "--wandb" not in err and "--seed_everything" not in err
    )  # what may differ between the seeds of one setting is not named
    assert not (tmp_path / "out").exists()

    # The same arguments and identities that differ beyond the seed (a config file edited in between): refused too.
    records[1]["args"] = [*base, "--seed_everything=2", "--model.lr=0.01"]
    records[0]["identity"], records[1]["identity"] = "aaaaaaaaaaaaaaaa-11111111", "bbbbbbbbbbbbbbbb-22222222"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert report.main([str(path), "--out", str(tmp_path / "out")]) == 2
    assert "different settings (the same arguments, 2 identities" in capsys.readouterr().err
    records[1]["identity"] = "aaaaaaaaaaaaaaaa-22222222"  # seeds of one setting: averaged
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert report.main([str(path), "--out", str(tmp_path / "out")]) == 0
    assert "| 16 | 4 | 0.5000 ± 0.5657 |" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"params": {"method": "slowcal"}}', "'status' is None, expected one of finished, diverged, failed"),
        (
            '{"params": {"method": "slowcal"}, "status": "finished", "metrics": [1]}',
            "'metrics' is [1], expected an object",
        ),
        (
            '{"params": {"method": "slowcal"}, "status": "finished", "metrics": {"test_acc": "high"}}',
            "metric 'test_acc' is 'high'",
        ),
        ('{"params": 3, "status": "finished"}', "'params' is 3, expected an object"),
        ("[1, 2]", "expected a JSON object, got list"),
        ('{"params": {}, "status": "finished", "args": "fit"}', "'args' is 'fit', expected a list of strings"),
    ],
)
def test_a_line_that_is_json_but_not_a_whole_record_is_one_line_naming_file_and_line(tmp_path, capsys, line, message):
    from lit_slowcal.experiments import sweep as sw

    path = tmp_path / "r.jsonl"
    write_results(path)
    with open(path, "a") as f:
        f.write(line + "\n")
    n = len(path.read_text().splitlines())
    assert report.main([str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{path}, line {n}: not a trial record: {message}" in err
    with pytest.raises(ValueError, match=f"line {n}: not a trial record"):  # the sweep reads it the same way
        sw.ResultsFile(path)


def test_hand_edited_values_of_the_report_are_one_line_naming_the_file_and_line(tmp_path, capsys):
    """Values the report reads besides the metrics: the seed (G_* per split), the wall time, M and K."""
    path = tmp_path / "r.jsonl"
    cases = [
        ({"seed_everything": [1]}, {}, None),  # a list as the seed: one more split of its M, no traceback
        ({}, {"wall_time_s": "12 s"}, "line 2: not a trial record: 'wall_time_s' is '12 s', expected a number or null"),
        ({"num_machines": 16.5}, {}, "line 2: num_machines is 16.5, expected an integer"),
        ({"local_steps": "4"}, {}, None),  # as the CLI reads it from a quoted YAML value
    ]
    for params, fields, message in cases:
        records = [record("slowcal", 16, 4, s, 0.9, 0.3) for s in (1, 2)]
        for r in records:
            r["metrics"]["G_star"] = 2.0 + r["params"]["seed_everything"]
        records[1]["params"].update(params)
        records[1].update(fields)
        del records[0]["metrics"]  # a record without metrics: none to average, no traceback
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        assert report.main([str(path), "--out", str(tmp_path / "out")]) == (2 if message else 0)
        captured = capsys.readouterr()
        if message:
            assert captured.err.count("\n") == 1 and f"{path}, {message}" in captured.err
        else:
            assert "| 16 | 4 | 4.0000 ± 0.0000 | 0.9000 ± 0.0000 |" in captured.out  # G_* of the one split with it
