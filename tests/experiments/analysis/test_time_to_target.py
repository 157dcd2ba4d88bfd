"""``report --target``: the modelled wall time to a target, against times worked by hand."""

import json

import pytest

from lit_slowcal.experiments.analysis import report
from lit_slowcal.experiments.analysis.time_to_target import Target, cell_times, trajectory
from lit_slowcal.link import Link


def trial(tmp_path, method, seed, accs, *, k=4, m=16, payload=62_800):
    """A finished trial of R = len(accs) rounds evaluated after each, SLowcal-like: K = k, b = 1, M = m."""
    run_dir = tmp_path / f"{method}_{seed}"
    run_dir.mkdir()
    rows = ["round,test_acc,train_loss"] + [f"{r},{a}," for r, a in enumerate(accs, 1)]
    (run_dir / "metrics.csv").write_text("\n".join(rows) + "\n")
    rounds = len(accs)
    metrics = {
        "round": float(rounds),
        "samples_seen": float(k * m * rounds),
        "ring_bytes_per_machine": rounds * payload * 2 * (m - 1) / m,
        "ring_hops": float(rounds * 2 * (m - 1)),
        "test_acc": accs[-1],
        "test_loss": 0.3,
    }
    params = {"method": method, "num_machines": m, "local_steps": k, "seed_everything": seed}
    return {"params": params, "status": "finished", "metrics": metrics, "run_dir": str(run_dir)}


def test_target_parsing_and_direction():
    assert Target.parse("test_acc=0.9").reached(0.9) and not Target.parse("test_acc=0.9").reached(0.89)
    assert Target.parse("excess_loss=0.1").reached(0.1) and not Target.parse("excess_loss=0.1").reached(0.2)
    for bad in ("test_acc", "accuracy=0.9", "test_acc=x", "test_acc=nan"):
        with pytest.raises(ValueError, match="Invalid --target"):
            Target.parse(bad)


def test_time_to_target_by_hand(tmp_path):
    link = Link.parse("1Gbit/s,10ms")
    records = [
        trial(tmp_path, "slowcal", 1, [0.5, 0.85, 0.91, 0.92]),  # reaches 0.9 at round 3
        trial(tmp_path, "slowcal", 2, [0.6, 0.91, 0.92, 0.93]),  # at round 2
        trial(tmp_path, "local_sgd", 1, [0.5, 0.6, 0.7, 0.8]),  # never
    ]
    times, trajectories = cell_times(records, Target.parse("test_acc=0.9"), [link], sample_seconds=1e-3)
    # A round: 4 samples x 1 ms of compute, 30 hops x 10 ms, 2 * 15 / 16 * 62,800 bytes at 1.25e8 B/s.
    per_round = 4 * 1e-3 + 30 * 10e-3 + 117_750 / 1.25e8
    cell = times[16, 4, "slowcal"][link]
    assert cell.seconds == pytest.approx((3 * per_round + 2 * per_round) / 2, rel=1e-12)
    assert cell.rounds == 2.5 and cell.reached == cell.seeds == 2
    never = times[16, 4, "local_sgd"][link]
    assert never.seconds is None and never.text() == "not reached (0/1)"
    big = cell_times(records, Target.parse("test_acc=0.9"), [link], sample_seconds=0.5, scale=1000)[0]
    big_round = 4 * 0.5 + 1000 * 117_750 / 1.25e8 + 30 * 10e-3  # the bytes x 1000, the larger model's compute given
    assert big[16, 4, "slowcal"][link].seconds == pytest.approx(2.5 * big_round, rel=1e-12)
    assert [len(t.points) for t in trajectories[16, 4, "slowcal"]] == [4, 4]


def test_report_writes_the_time_to_target_table_and_figure(tmp_path, capsys):
    records = [trial(tmp_path, "slowcal", 1, [0.5, 0.91]), trial(tmp_path, "minibatch_sgd", 1, [0.92, 0.93], k=1)]
    results = tmp_path / "r.jsonl"
    results.write_text(
        "".join(json.dumps({**r, "identity": f"i{n}", "error": None}) + "\n" for n, r in enumerate(records))
    )
    out = tmp_path / "out"
    code = report.main([str(results), "--out", str(out), "--target", "test_acc=0.9", "--sample_seconds", "1e-3",
                        "--link", "10Gbit/s,1ms"])  # fmt: skip
    assert code == 0, capsys.readouterr().err
    table = (out / "r_test_acc_time_to_target.md").read_text()
    assert (out / "r_test_acc_time_to_target.png").stat().st_size > 0
    # Minibatch-SGD at K = 1: one sample and one sync a round, reached at round 1; SLowcal-SGD at round 2.
    mb = 1 * 1e-3 + 30 * 1e-3 + 117_750 / 1.25e9
    sc = 2 * (4 * 1e-3 + 30 * 1e-3 + 117_750 / 1.25e9)
    assert f"| 16 | 1 | Minibatch-SGD | **{mb:.3g} s (1 rounds)** |" in table
    assert f"| 16 | 4 | SLowcal-SGD | {sc:.3g} s (2 rounds) |" in table
    tuned = tmp_path / "tuned.csv"
    tuned.write_text("method,M,K,lr\nslowcal,16,4,0.5\n")  # not the rate the SLowcal trial ran at
    for r in records:
        r["params"]["model.lr"] = 0.01
    results.write_text(
        "".join(json.dumps({**r, "identity": f"i{n}", "error": None}) + "\n" for n, r in enumerate(records))
    )
    code = report.main([str(results), "--out", str(out), "--target", "test_acc=0.9", "--sample_seconds", "1e-3",
                        "--link", "10Gbit/s,1ms", "--tuned", str(tuned)])  # fmt: skip
    assert code == 0, capsys.readouterr().err
    assert "SLowcal-SGD" not in (out / "r_test_acc_time_to_target.md").read_text()  # only the tuned rate is kept
    assert report.main([str(results), "--out", str(out), "--target", "test_acc=0.9"]) == 2
    assert "Invalid --sample_seconds: None" in capsys.readouterr().err
    assert report.main([str(results), "--out", str(out), "--link", "10Gbit/s,1ms"]) == 2
    assert "need --target" in capsys.readouterr().err


def test_a_record_without_counts_is_refused_in_one_line(tmp_path):
    record = trial(tmp_path, "slowcal", 1, [0.9])
    del record["metrics"]["ring_hops"]
    with pytest.raises(ValueError, match="logged no ring_hops.*rerun the sweep with this version"):
        trajectory(record, "test_acc", 16)


def test_tuned_keeps_each_cells_tuned_rate_and_the_cells_it_does_not_hold(tmp_path):
    from lit_slowcal.experiments.analysis.time_to_target import at_tuned_rates

    records = []
    for method, lr in (("slowcal", 0.01), ("slowcal", 0.0215), ("diloco", 0.001)):
        r = trial(tmp_path, method, len(records), [0.9])
        r["params"]["model.lr"] = lr
        records.append(r)
    tuned = tmp_path / "tuned.csv"
    tuned.write_text("method,M,K,lr\nslowcal,16,4,0.0215\nslowcal,64,4,0.01\n")
    kept = at_tuned_rates(records, tuned)
    assert [(r["params"]["method"], r["params"]["model.lr"]) for r in kept] == [("slowcal", 0.0215), ("diloco", 0.001)]
