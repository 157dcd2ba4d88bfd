"""``--link`` and ``--step_seconds``: the counts and modelled seconds a fit logs and prints, against hand values."""

import csv

import pytest
from in_process import RUN, command, error_line

# The tiny run of in_process: SLowcal-SGD, M = 4, K = 64, b = 64, R = 4 rounds of 64 steps. x and w of the
# 7,850-parameter model in float32: 62,800 bytes a round, of which a machine sends 2 (M - 1) / M on the ring.
ROUNDS, STEPS, M = 4, 256, 4
RING = ROUNDS * 62_800 * 2 * (M - 1) / M  # 376,800
HOPS = ROUNDS * 2 * (M - 1)
DDP_RING = STEPS * 31_400 * 2 * (M - 1) / M  # the gradients of x, every step
DDP_HOPS = STEPS * 2 * (M - 1)


def last_train_row(run_dir):
    with open(run_dir / RUN / "version_0" / "metrics.csv", newline="") as f:
        return [r for r in csv.DictReader(f) if r["train_loss"]][-1]


def test_the_fit_logs_and_prints_bytes_and_seconds_per_link(tmp_path, capsys):
    code, err = command(
        capsys, '--link=["1Gbit/s,10ms"]', "--link+=100Gbit/s,10us", "--step_seconds=1e-3", run_dir=tmp_path
    )
    assert code == 0, err
    row = last_train_row(tmp_path)
    assert float(row["optimizer_steps"]) == STEPS and float(row["round"]) == ROUNDS
    assert float(row["ring_bytes_per_machine"]) == RING and float(row["ring_hops"]) == HOPS
    assert float(row["ddp_ring_bytes_per_machine"]) == DDP_RING and float(row["ddp_ring_hops"]) == DDP_HOPS
    comm = HOPS * 10e-3 + RING / 1.25e8
    ddp = DDP_HOPS * 10e-3 + DDP_RING / 1.25e8
    assert float(row["comm_s_1Gbitps_10ms"]) == pytest.approx(comm, rel=1e-15)
    assert float(row["ddp_comm_s_1Gbitps_10ms"]) == pytest.approx(ddp, rel=1e-15)
    assert float(row["wall_s_1Gbitps_10ms"]) == pytest.approx(STEPS * 1e-3 + comm, rel=1e-15)
    assert float(row["ddp_wall_s_100Gbitps_10us"]) == pytest.approx(
        STEPS * 1e-3 + DDP_HOPS * 10e-6 + DDP_RING / 1.25e10, rel=1e-15
    )


def test_the_summary_has_one_line_per_link_with_the_ratios(tmp_path, capsys, monkeypatch):
    from lit_slowcal.experiments.run import cli

    said = []
    monkeypatch.setattr(cli, "say_lines", said.extend)
    code, err = command(capsys, "--link=1Gbit/s,10ms", "--step_seconds=1e-3", run_dir=tmp_path)
    assert code == 0, err
    comm = HOPS * 10e-3 + RING / 1.25e8
    ddp = DDP_HOPS * 10e-3 + DDP_RING / 1.25e8
    compute = STEPS * 1e-3
    (line,) = [str(x) for x in said if "1Gbit/s,10ms:" in str(x)]
    assert line == (
        f"  1Gbit/s,10ms: sent 376.8 kB, {comm:.3g} s; wall {compute + comm:.3g} s | DDP: 12.1 MB, {ddp:.3g} s; "
        f"wall {compute + ddp:.3g} s | {DDP_RING / RING:.1f}x fewer bytes, {ddp / comm:.1f}x less communication, "
        f"{(compute + ddp) / (compute + comm):.1f}x less wall time"
    )
    assert any("compute 0.26 s (given: 1000.0 us a step x 256 steps)" in str(x) for x in said)


@pytest.mark.parametrize(
    ("arg", "message"),
    [
        ("--link=fast", "Invalid link: 'fast' (a bandwidth and a latency"),
        ("--link=[]", "Invalid link: [] (give at least one"),
        ("--link=[1Gbit/s,10ms]", "Invalid link: '1Gbit/s' (a bandwidth and a latency"),
        ("--link=[1Gbit/s,10ms]", """in a list, quote each link: --link '["1Gbit/s,10ms","10Gbit/s,1ms"]'"""),
        ("--step_seconds=-1", "Invalid step_seconds: -1.0 (must be a finite number > 0 and <= 1e+06)"),
        # out of the range where the modelled seconds stay finite (1e307 s gave "inf s" and "nanx less")
        ("--link=1Gbit/s,1e307s", "Invalid link latency: 1e+307 s in '1Gbit/s,1e307s' (allowed: 0 to 1e+06 s)"),
        (
            "--link=1e-3bit/s,1ms",
            "Invalid link bandwidth: 0.000125 B/s in '1e-3bit/s,1ms' (allowed: 1 bit/s = 0.125 B/s",
        ),
        ("--step_seconds=1e307", "Invalid step_seconds: 1e+307 (must be a finite number > 0 and <= 1e+06)"),
    ],
)
def test_a_bad_link_or_step_time_is_one_line_before_training(tmp_path, capsys, arg, message):
    code, err = command(capsys, arg, run_dir=tmp_path)
    assert code != 0 and message in error_line(err)
    assert not (tmp_path / RUN).exists()  # refused before anything is built


@pytest.mark.parametrize("F", [1, 2])
def test_the_summary_counts_rounds_apart_and_hides_no_more_than_the_steps_a_round_was_in_flight(
    tmp_path, capsys, monkeypatch, F
):
    """tau = 2, evaluations after rounds 2 and 4: F rounds of a fragment every round of K = 64 steps (4 F in all);
    the rounds that start at steps 128 and 256 are closed at once by the evaluation (0 steps in flight, nothing
    hidden), each then one blocking sync of the whole model; the 4 F - 2 others hide tau steps of compute each.
    The summary said "rounds 6/4" (F = 1) and credited every overlapped round tau steps."""
    from lit_slowcal.experiments.run import cli

    said = []
    monkeypatch.setattr(cli, "say_lines", said.extend)
    args = ["--overlap_delay=2", f"--fragments={F}", "--eval_every=2", "--link=1Gbit/s,10ms", "--step_seconds=1e-3"]
    code, err = command(capsys, *args, run_dir=tmp_path)
    assert code == 0, err
    scheduled, closing = ROUNDS * F, 2
    kind = "fragment rounds (F=2 a round)" if F == 2 else "scheduled"
    syncs = scheduled + closing
    assert any(
        f"rounds {ROUNDS}/{ROUNDS}; {syncs} synchronisations: {scheduled} {kind} + {closing} closing a round early"
        in str(x)
        for x in said
    ), said
    assert any(f"per machine: {syncs} synchronisations" in str(x) for x in said)
    # The F fragments of a round send the whole model once: 4 whole models, and the 2 closing syncs 2 more.
    comm = syncs * 2 * (M - 1) * 10e-3 + (ROUNDS + closing) * (RING / ROUNDS) / 1.25e8
    # Every round's seconds (> 60 ms of latency) exceed tau steps of compute: a round hides 2 ms, or nothing.
    wall = STEPS * 1e-3 + comm - (scheduled - closing) * 2e-3
    (line,) = [str(x) for x in said if "1Gbit/s,10ms:" in str(x)]
    assert f"; wall {wall:.3g} s |" in line, (line, wall)
