"""``--compression``, ``--error_feedback``, ``--overlap_delay`` and ``--fragments``: what a compressed or overlapped
fit logs, against hand counts, and one line for a bad value before anything is built."""

import csv

import pytest
from in_process import RUN, command, error_line

# The tiny run of in_process: SLowcal-SGD, M = 4, K = 64, b = 64, R = 4 rounds. x and w of the 7,850-parameter
# model: 62,800 bytes a round in float32. A coded vector is int8 codes and a float32 scale a block of 256, both
# ways: 7,840 + 31 x 4 + 10 + 4 = 7,978 bytes. The strategy anchors x at set-up, so the first round codes x and
# sends w (born at the first step, without an anchor) exactly; the three others code both.
M = 4
EXACT, INT8 = 62_800, 2 * 7_978
RING = (M - 1) * (INT8 / 2 + INT8 / 2) / M + EXACT / 2 * 2 * (M - 1) / M + 3 * (M - 1) * (INT8 + INT8) / M


def last_train_row(run_dir, run=RUN):
    with open(run_dir / run / "version_0" / "metrics.csv", newline="") as f:
        return [r for r in csv.DictReader(f) if r["train_loss"]][-1]


def test_a_compressed_fit_logs_the_compressed_bytes(tmp_path, capsys):
    code, err = command(capsys, "--compression=int8", run_dir=tmp_path / "int8")
    assert code == 0, err
    row = last_train_row(tmp_path / "int8")
    # the first round two collectives (x coded, w exact), the three others one each
    assert float(row["ring_bytes_per_machine"]) == RING and float(row["ring_hops"]) == (2 + 3) * 2 * (M - 1)
    code, err = command(capsys, run_dir=tmp_path / "exact")
    exact = last_train_row(tmp_path / "exact")
    assert float(exact["ring_bytes_per_machine"]) == 4 * EXACT * 2 * (M - 1) / M
    assert row["train_loss"] != exact["train_loss"]  # it trained on the decoded means, not the exact ones


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--compression=fp4"],
            "Invalid compression: 'fp4' (bf16, int8, int4, int2, topk:<fraction>[:<bits>], or unset: the exact average)",
        ),
        (["--compression=topk:0.01:3"], "Invalid TopK bits: 3 (one of 2, 4, 8, 16, 32)"),
        (["--compression=topk:2"], "Invalid TopK fraction: 2.0 (must be a finite number > 0 and <= 1)"),
        (["--compression=topk:x"], "Invalid compression: 'topk:x' (topk:<fraction>[:<bits>], e.g. 'topk:0.01:2')"),
        (["--error_feedback=false"], "Invalid error_feedback: False (it applies with --compression only"),
        (["--overlap_delay=64"], "Invalid overlap_delay: 64 (must be < sync_every // fragments = 64"),
        (["--overlap_delay=-1"], "Invalid overlap_delay: -1"),
        (["--fragments=3"], "Invalid fragments: 3 (must divide sync_every = 64)"),
        (
            ["--method=minibatch_sgd", "--overlap_delay=1"],
            "Invalid overlap_delay: 1 (must be < sync_every // fragments = 1",
        ),
        (
            ["--compression=int8", "--overlap_delay=1"],
            "Invalid compression: 'int8' with overlap_delay=1, fragments=1 (compressed rounds are blocking",
        ),
        (["--state_every=0"], "Invalid state_every: 0 (must be an integer >= 1)"),
        (["--method=scaffold", "--state_every=2"], "Invalid state_every: 2 (Scaffold"),
        (["--average_state=exp avg"], "Invalid average_state: 'exp avg' (optimizer state keys, comma-separated"),
        (
            ["--method=diloco", "--model.outer=none", "--average_state=exp_avg,moment"],
            "Invalid average_state: 'moment' (no parameter's AdamW state holds it; its state keys: exp_avg, exp_avg_sq, step)",
        ),
    ],
)
def test_a_bad_communication_option_is_one_line_before_training(tmp_path, capsys, args, message):
    code, err = command(capsys, *args, run_dir=tmp_path)
    assert code != 0 and message in error_line(err)
    assert not (tmp_path / RUN).exists()  # refused before anything is built


def test_the_state_on_its_own_period_sends_w_in_every_second_round(tmp_path, capsys):
    """``--state_every=2``: rounds 1 and 3 send x alone (half of EXACT), rounds 2 and 4 x and w; nothing closes a
    round (the last one carries w), so four rounds in all."""
    code, err = command(capsys, "--state_every=2", run_dir=tmp_path / "state")
    assert code == 0, err
    row = last_train_row(tmp_path / "state")
    assert float(row["ring_bytes_per_machine"]) == (2 * EXACT / 2 + 2 * EXACT) * 2 * (M - 1) / M


ADAMW = ("--method=diloco", "--model.outer=none")  # Local-SGD with AdamW: one vector (the model) a round
ADAMW_RUN = "diloco_M4_K64_b64_seed1"
PARAMS = 7_850 * 4  # the model's float32 bytes


def test_adamw_moments_averaged_on_their_own_period_count_in_closed_form(tmp_path, capsys):
    """``--average_state=exp_avg,exp_avg_sq --state_every=2`` (DES-LOC): rounds 2 and 4 send the model and its two
    moments, rounds 1 and 3 the model alone; without the option AdamW's moments never travel."""
    code, err = command(capsys, *ADAMW, run_dir=tmp_path / "model")
    assert code == 0, err
    ring = 2 * (M - 1) / M
    assert float(last_train_row(tmp_path / "model", ADAMW_RUN)["ring_bytes_per_machine"]) == 4 * PARAMS * ring
    run = tmp_path / "moments"
    code, err = command(capsys, *ADAMW, "--average_state=exp_avg,exp_avg_sq", "--state_every=2", run_dir=run)
    assert code == 0, err
    assert float(last_train_row(run, ADAMW_RUN)["ring_bytes_per_machine"]) == (2 * PARAMS + 2 * 3 * PARAMS) * ring


def test_adamw_moments_averaged_every_round_are_every_machines_mean(tmp_path, capsys):
    """After the last round the machines hold one mean of each moment with ``--average_state``, and per-machine
    moments without it (the option reaches the averager; the averaging itself is tested in tests/core)."""
    import torch

    def moments(run, *args):
        assert command(capsys, *ADAMW, *args, "--trainer.max_steps=128", run_dir=run)[0] == 0
        ckpt = torch.load(run / ADAMW_RUN / "version_0" / "checkpoints" / "last.ckpt", weights_only=True)
        return ckpt["optimizer_states"][0]["state"][0]

    shared = moments(tmp_path / "shared", "--average_state=exp_avg,exp_avg_sq")
    own = moments(tmp_path / "own")
    for key in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(shared[key], shared[key][:1].expand_as(shared[key])), key
        assert not torch.equal(own[key], own[key][:1].expand_as(own[key])), key


def test_an_overlapped_fit_lands_every_round_and_counts_what_it_sent(tmp_path, capsys):
    """tau = 1: the rounds started at steps 64, 128 and 192 land a step later (merged with that step's
    progress); the fourth, started at the last step, is landed by the end of fit, which then synchronises
    the whole model once more. The last train row is logged at the last round's end: four rounds."""
    code, err = command(capsys, "--overlap_delay=1", run_dir=tmp_path / "overlap")
    assert code == 0, err
    row = last_train_row(tmp_path / "overlap")
    assert float(row["ring_bytes_per_machine"]) == 4 * EXACT * 2 * (M - 1) / M
    code, err = command(capsys, run_dir=tmp_path / "exact")
    assert row["train_loss"] != last_train_row(tmp_path / "exact")["train_loss"]


@pytest.mark.parametrize("args", [("--compression=int8",), ("--overlap_delay=1", "--fragments=2")])
def test_a_compressed_or_overlapped_run_stopped_mid_epoch_resumes_exactly(tmp_path, capsys, args):
    """Stopped after 2 of 4 rounds (its checkpoint closes the round: the anchors and error feedback saved, nothing
    in flight), then resumed: it ends with the bits of the uninterrupted run, which checkpoints (and so closes the
    round in flight, with overlap) at the same step."""
    import torch

    full, runs = tmp_path / "full", tmp_path / "runs"
    args = (*args, "--checkpoint_every=2")
    assert command(capsys, *args, run_dir=full)[0] == 0
    assert command(capsys, *args, "--trainer.max_steps=128", run_dir=runs)[0] == 0
    code, err = command(capsys, *args, "--ckpt_path=last", run_dir=runs)
    assert code == 0, err[-3000:]
    resumed = torch.load(runs / RUN / "version_1" / "checkpoints" / "last.ckpt", weights_only=True)
    reference = torch.load(full / RUN / "version_0" / "checkpoints" / "last.ckpt", weights_only=True)
    assert resumed["global_step"] == reference["global_step"] == 256
    for key, value in reference["state_dict"].items():
        assert torch.equal(resumed["state_dict"][key], value), key


def test_an_overlapped_rounds_wall_time_hides_up_to_tau_steps_of_each_round(tmp_path, capsys):
    """The link is busy as long (comm_s), but each of the four overlapped rounds hides up to tau = 1 step of
    compute (1 ms) of its 60.75 ms: the modelled wall time is compute + communication - 4 x 1 ms."""
    code, err = command(
        capsys, "--overlap_delay=1", "--link=1Gbit/s,10ms", "--step_seconds=1e-3", run_dir=tmp_path / "overlap"
    )
    assert code == 0, err
    row = last_train_row(tmp_path / "overlap")
    one_round = 2 * (M - 1) * 10e-3 + EXACT * 2 * (M - 1) / M / 1.25e8
    assert float(row["comm_s_1Gbitps_10ms"]) == pytest.approx(4 * one_round, rel=1e-15)
    assert float(row["wall_s_1Gbitps_10ms"]) == pytest.approx(256 * 1e-3 + 4 * one_round - 4 * 1e-3, rel=1e-15)


def test_a_resume_with_another_compression_or_overlap_is_another_run(tmp_path, capsys):
    """The options define the run: left out of its identity at their defaults only (the digests of runs from
    before they existed stay the same), so a resume that drops or changes one is refused, naming it."""
    from lit_slowcal.experiments.run.identity import run_identity

    assert not {"compression", "error_feedback", "overlap_delay", "fragments"} & set(
        run_identity(
            {"method": "slowcal", "compression": None, "error_feedback": None, "overlap_delay": 0, "fragments": 1}
        )
    )
    runs = tmp_path / "runs"
    assert command(capsys, "--compression=int8", "--trainer.max_steps=128", run_dir=runs)[0] == 0
    code, err = command(capsys, "--ckpt_path=last", run_dir=runs)
    assert code != 0 and 'compression "int8" in the checkpoint, null now' in error_line(err)
    code, err = command(capsys, "--compression=int8", "--overlap_delay=1", "--ckpt_path=last", run_dir=runs)
    assert code != 0 and "Invalid compression: 'int8' with overlap_delay=1" in error_line(err)


def test_the_strategys_own_compression_in_a_config_is_kept_and_a_second_value_refused(tmp_path, capsys):
    """``trainer.strategy.init_args.compression: int8`` with ``--compression`` unset sends int8 (it was silently
    replaced by the unset top-level setting, and the run sent float32); given in both places with two values,
    one line names both before anything is built."""
    strategy = ["--trainer.strategy=periodic_averaging", "--trainer.strategy.compression=int8"]
    code, err = command(capsys, *strategy, run_dir=tmp_path / "own")
    assert code == 0, err
    row = last_train_row(tmp_path / "own")
    assert float(row["ring_bytes_per_machine"]) == RING
    code, err = command(capsys, *strategy, "--compression=bf16", run_dir=tmp_path / "both")
    assert code != 0 and (
        "Invalid trainer.strategy.init_args.compression: 'int8' with --compression='bf16' (one setting in two places"
        in error_line(err)
    )
    assert not (tmp_path / "both" / RUN).exists()
