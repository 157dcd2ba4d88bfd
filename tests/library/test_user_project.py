"""The library in a user's own Lightning project (examples/lightning_cnn.py: a CNN with BatchNorm, its
own LightningModule and data module) on two gloo processes: one averaged model at every round
boundary (validation, checkpoints, the end of fit), one schedule on every rank, exact resumes on
2 -> 2, 2 -> 1 and 1 -> 2 processes mid-round; two optimizers (a GAN); a GradScaler's skipped step.

A round is closed (the machines averaged) after every K-th step and wherever the model leaves
training: so the synchronisations of a run are the union of the multiples of K, the validations,
the checkpoints and the last step, which ``sync_points`` computes independently of the code.
"""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import subprocess_env

pytestmark = pytest.mark.slow  # every test launches the user project on two processes

SCRIPT = Path(__file__).with_name("user_project.py")
K, STEPS, EPOCH = 7, 30, 12  # K, max_steps, batches per epoch (384 images, 2 shards, batch 16)
CNN_ARGS = [
    "--sync-every",
    str(K),
    "--max-steps",
    str(STEPS),
    "--train-size",
    "384",
    "--batch-size",
    "16",
    "--val-size",
    "128",
]
# SlowcalSGD sends x and w of the CNN's 9,114 parameters and BatchNorm's 16 running statistics.
CNN_FLOATS_PER_SYNC = 2 * 9114 + 16
# What one schedule or set-up check sends: its int64 values (2 counts, 24 set-up slots, the collective's code)
# to the one other process.
CHECK_BYTES = 27 * 8


def schedules(states: list[dict]) -> list[dict]:
    """The averagers' ``state_dict()``s without their ``configuration`` record (what the state's meaning
    depends on; its content is the configuration tests'), which every one holds."""
    out = []
    for state in states:
        state = dict(state)
        assert set(state.pop("configuration")) == {"compression", "error_feedback", "optimizer", "optimizer options"}
        out.append(state)
    return out


def averager_state(steps: int, syncs: int, sent: int, checks: int, floats: int = CNN_FLOATS_PER_SYNC) -> dict:
    """An averager's ``state_dict()`` after ``steps`` steps and ``syncs`` synchronisations (the last at
    ``steps``), ``sent`` of them among M = 2 machines (the others, on one process, send nothing), and
    ``checks`` schedule or set-up checks; ``floats`` float32 values a sync. Among M = 2 a machine sends
    2 * 1/2 of the payload on the ring in 2 hops."""
    payload = 4 * floats
    return {
        "steps": steps,
        "num_syncs": syncs,
        "last_sync_step": steps,
        "floats_communicated": sent * floats,
        "bytes_communicated": sent * payload,
        "link_counts": {
            "syncs": sent,
            "payload_bytes": sent * payload,
            "ring_bytes": float(sent * payload),
            "ring_hops": 2 * sent,
            "check_bytes": checks * CHECK_BYTES,
        },
    }


def sync_points(start: int, end: int, k: int, boundaries) -> set[int]:
    """Steps after which a run that goes from ``start`` to ``end`` synchronises."""
    return {s for s in range(start + 1, end + 1) if s % k == 0} | {b for b in boundaries if start < b <= end} | {end}


def run(scenario: str, out: Path, *args: str) -> list[dict]:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), scenario, str(out), "--", *args],
        cwd=out.parent, env=subprocess_env(PYTHONFAULTHANDLER="1"), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, f"stdout: {proc.stdout[-2000:]}\nstderr: {proc.stderr[-4000:]}"
    return [torch.load(p, weights_only=False) for p in sorted(out.glob("rank*.pt"))]


def assert_same(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), what
    for key in a:
        assert torch.equal(a[key], b[key]), (
            f"{what}: {key} differs by {(a[key].double() - b[key].double()).abs().max():.3g}"
        )


def assert_ranks_agree(ranks: list[dict]) -> None:
    """Every rank ends with the same model (BatchNorm statistics included), optimizer state and schedule."""
    first = ranks[0]
    for other in ranks[1:]:
        assert_same(first["final"], other["final"], "final model")
        for mine, theirs in zip(first["optimizers"], other["optimizers"]):
            assert_same(
                {k: v for k, v in mine.items() if not k.endswith("step")},
                {k: v for k, v in theirs.items() if not k.endswith("step")},
                "optimizer state",
            )
        assert first["averagers"] == other["averagers"]


@pytest.fixture(scope="module")
def cnn(tmp_path_factory):
    """A: 2 processes from scratch; B: A resumed at step 12 on 2 processes, with ``--bucket-views`` (the
    same bits); C: A resumed at step 12 on 1 process; D: C resumed at step 24 on 2 processes. K = 7:
    steps 12 and 24 (epoch ends, with a validation and checkpoints) are mid-round."""
    root = tmp_path_factory.mktemp("cnn")
    a = run("cnn", root / "A", *CNN_ARGS, "--devices", "2", "--run-dir", str(root / "A" / "run"))
    at12 = root / "A" / "run" / "epochs" / "epoch=0-step=12.ckpt"
    b = run(
        "cnn", root / "B", *CNN_ARGS, "--devices", "2", "--run-dir", str(root / "B" / "run"), "--ckpt-path", str(at12),
        "--bucket-views",
    )  # fmt: skip
    c = run(
        "cnn", root / "C", *CNN_ARGS, "--devices", "1", "--run-dir", str(root / "C" / "run"), "--ckpt-path", str(at12)
    )
    at24 = root / "C" / "run" / "epochs" / "epoch=1-step=24.ckpt"
    d = run(
        "cnn", root / "D", *CNN_ARGS, "--devices", "2", "--run-dir", str(root / "D" / "run"), "--ckpt-path", str(at24)
    )
    return {"A": a, "B": b, "C": c, "D": d, "root": root}


def test_fit_ending_mid_round_returns_one_averaged_model_on_every_rank(cnn):
    a = cnn["A"]
    assert [r["world_size"] for r in a] == [2, 2]
    assert_ranks_agree(a)
    expected = len(sync_points(0, STEPS, K, {EPOCH, 2 * EPOCH}))  # 7, 12, 14, 21, 24, 28, 30
    assert expected == 7
    for rank in a:
        assert rank["num_syncs"] == expected
        # The checks: one at the start of fit, one before each sync that checks: the first (7) and the round
        # closes (12, 24 and 30; the scheduled rounds 14, 21 and 28 are not due: the check runs every 16th).
        assert schedules(rank["averagers"]) == [averager_state(STEPS, expected, expected, checks=1 + 4)]
        assert rank["floats_communicated"] == expected * CNN_FLOATS_PER_SYNC
        assert rank["link_counts"] == rank["averagers"][0]["link_counts"]
        # DDP: 30 steps of one all-reduce of the 9,114 float32 gradients among 2 machines.
        assert rank["ddp_counts"] == {
            "syncs": STEPS,
            "payload_bytes": STEPS * 9114 * 4,
            "ring_bytes": STEPS * 9114 * 4.0,
            "ring_hops": 2 * STEPS,
            "check_bytes": 0,
        }


def test_validation_and_checkpoints_see_the_averaged_model(cnn):
    a = cnn["A"]
    validated = [[step for step, _ in r["validated"]] for r in a]
    assert validated == [[EPOCH, 2 * EPOCH]] * 2
    for (step0, model0), (step1, model1) in zip(a[0]["validated"], a[1]["validated"]):
        assert_same(model0, model1, f"model validated at step {step0}")
    evaluated = dict(a[0]["validated"])
    saved_steps = sorted({step for step, _, _ in a[0]["saved"]})
    assert saved_steps == [EPOCH, 2 * EPOCH, STEPS]
    for (step, state0, schedules), (_, state1, _) in zip(a[0]["saved"], a[1]["saved"]):
        assert_same(state0, state1, f"checkpoint at step {step}")
        if step in evaluated:
            assert_same(state0, evaluated[step], f"checkpoint vs validated model at step {step}")
        assert schedules[0]["num_syncs"] == len(sync_points(0, step, K, {EPOCH, 2 * EPOCH}))
        assert schedules[0]["last_sync_step"] == step
    # The monitored checkpoint holds exactly the model whose val_acc chose it.
    best = torch.load(a[0]["best_model_path"], weights_only=False)
    assert_same(best["state_dict"], evaluated[best["global_step"]], "best checkpoint")
    assert best["periodic_averaging"][0]["last_sync_step"] == best["global_step"]


def test_resume_mid_round_on_two_processes_equals_the_uninterrupted_run(cnn):
    """B resumes A's checkpoint with bucket_views: its parameters end as views of one buffer, and every
    value is A's, bit for bit."""
    a, b = cnn["A"], cnn["B"]
    assert [r["storages"] for r in a] == [8, 8] and [r["storages"] for r in b] == [1, 1]
    checkpoint = {step: state for step, state, _ in a[0]["saved"]}[EPOCH]
    for rank_a, rank_b in zip(a, b):
        assert_same(rank_b["start"], checkpoint, "resumed start")
        assert_same(rank_a["final"], rank_b["final"], "final model of the resumed run")
        # The same counts, but for the resumed fit's own set-up check at its start and its first round's check
        # (14, the first after the load; A's round there is not due).
        syncs = len(sync_points(0, STEPS, K, {EPOCH, 2 * EPOCH}))
        assert schedules(rank_a["averagers"]) == [averager_state(STEPS, syncs, syncs, checks=1 + 4)]
        assert schedules(rank_b["averagers"]) == [averager_state(STEPS, syncs, syncs, checks=1 + 4 + 2)]
        assert rank_a["optimizers"][0].keys() == rank_b["optimizers"][0].keys()
        assert_same(rank_a["optimizers"][0], rank_b["optimizers"][0], "optimizer state of the resumed run")


def test_resume_mid_round_two_to_one_and_one_to_two_processes(cnn):
    a, (c,), d = cnn["A"], cnn["C"], cnn["D"]
    assert c["world_size"] == 1 and [r["world_size"] for r in d] == [2, 2]
    at12 = {step: state for step, state, _ in a[0]["saved"]}[EPOCH]
    assert_same(c["start"], at12, "2 -> 1: the resumed start is the averaged checkpoint")
    syncs_at_12 = len(sync_points(0, EPOCH, K, {EPOCH}))  # 7, 12
    c_syncs = syncs_at_12 + len(sync_points(EPOCH, STEPS, K, {2 * EPOCH}))  # + 14, 21, 24, 28, 30
    # One machine sends nothing: C's counts stay where A's checkpoint left them (2 syncs, 3 checks).
    assert schedules(c["averagers"]) == [averager_state(STEPS, c_syncs, syncs_at_12, checks=1 + syncs_at_12)]
    at24 = {step: state for step, state, _ in c["saved"]}[2 * EPOCH]
    syncs_at_24 = syncs_at_12 + len(sync_points(EPOCH, 2 * EPOCH, K, {2 * EPOCH}))
    assert_ranks_agree(d)
    for rank in d:
        assert_same(rank["start"], at24, "1 -> 2: both ranks start from the checkpoint")
        syncs = syncs_at_24 + len(sync_points(2 * EPOCH, STEPS, K, ()))  # + 28, 30
        # Sent: A's 2 syncs and checks before step 12, then D's: its set-up check and 2 syncs.
        assert schedules(rank["averagers"]) == [
            averager_state(STEPS, syncs, syncs_at_12 + 2, checks=1 + syncs_at_12 + 1 + 2)
        ]


def _floats(module: torch.nn.Module) -> int:
    """SlowcalSGD's x and w of ``module``'s parameters and its BatchNorm running statistics."""
    bn = [m for m in module.modules() if isinstance(m, torch.nn.BatchNorm1d)]
    return 2 * sum(p.numel() for p in module.parameters()) + sum(
        m.running_mean.numel() + m.running_var.numel() for m in bn
    )


def test_two_optimizers_keep_their_own_schedules_across_a_resume_and_average_each_buffer_once(tmp_path):
    """Manual optimization, a generator and a discriminator, K = 6, 10 batches an epoch. Uninterrupted:
    both sync after batches 6, 10 (checkpoint), 12, 18, 20 (checkpoint, end). Resumed from the
    epoch-0 checkpoint: the same schedules, counts and final model, bit for bit."""
    sys.path.insert(0, str(SCRIPT.parent))
    from user_project import GAN

    whole = run("gan", tmp_path / "whole", "--max-epochs", "2")
    resumed = run(
        "gan",
        tmp_path / "resumed",
        "--max-epochs",
        "2",
        "--ckpt-path",
        str(tmp_path / "whole" / "checkpoints" / "epoch=0.ckpt"),
    )
    model = GAN()
    per_sync = [_floats(model.generator), _floats(model.discriminator)]
    syncs = len(sync_points(0, 20, 6, {10}))
    assert syncs == 5
    # The checks of each averager: one at the start of each fit, one before each sync that checks: the first (6)
    # and the round closes (10, 20; 12 and 18 are not due), and in the resumed fit the first after the load (12).
    for run_, checks in ((whole, 1 + 3), (resumed, 1 + 3 + 2)):
        assert_ranks_agree(run_)
        for rank in run_:
            assert schedules(rank["averagers"]) == [
                averager_state(20, syncs, syncs, checks, floats=n) for n in per_sync
            ]
    for rank_w, rank_r in zip(whole, resumed):
        assert_same(rank_w["final"], rank_r["final"], "final model of the resumed GAN")


def test_a_gradscaler_skip_on_one_rank_is_caught_attached_and_harmless_counted_per_iteration(tmp_path):
    """A real GradScaler; rank 1's loss is inf at iteration 1, so only its scaler skips optimizer.step().
    Attached to the optimizer (the step hooks), the ranks' counts part: the first synchronisation
    raises on both ranks, naming the counts, before anything is averaged. Counting iterations with
    ``averager.step()`` (the README's pattern for loops that may skip), both sync after iterations 4
    and 8 and end with one model."""
    ranks = run("gradscaler", tmp_path / "out")
    for rank in ranks:
        message = rank["attached"]["error"]
        assert "rank 0: 4 steps, 4 backward passes, rank 1: 4 steps, 5 backward passes" in message
        assert "call averager.step() once per iteration" in message
        # broadcast()'s set-up check and one before the first of the 2 syncs (the second is not due).
        assert schedules([rank["explicit"]["state"]])[0] == averager_state(8, 2, 2, checks=2, floats=2 * 29 + 8)
    assert ranks[1]["explicit"]["scale"] < ranks[0]["explicit"]["scale"]  # rank 1's scaler did skip
    assert_same(ranks[0]["explicit"]["final"], ranks[1]["explicit"]["final"], "model")
    w = [{k: v for k, v in r["explicit"]["w"].items() if k.endswith(".w")} for r in ranks]
    assert_same(w[0], w[1], "SlowcalSGD's w")


INNER = ("adamw", "diloco", "momentum", "scaffold")


@pytest.fixture(scope="module")
def per_machine(tmp_path_factory):
    """A small character-level transformer on 2 processes, K = 5, 3 epochs of 6 steps, checkpoints at
    steps 6 and 12 (mid-round); for each inner optimizer, the fit and the same fit resumed from step 6."""
    out = tmp_path_factory.mktemp("per_machine")
    ranks = run("per_machine", out, *INNER)
    return {"ranks": ranks, "out": out}


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(((a[k].double() - b[k].double()).abs().max().item() for k in a), default=0.0)


@pytest.mark.parametrize("inner", INNER)
def test_a_resume_on_two_processes_restores_every_machines_own_optimizer_state(per_machine, inner):
    """AdamW's moments (plain averaging and DiLoCo), SGD's momentum and SCAFFOLD's control variates stay
    per machine; a checkpoint holds every rank's, and the resumed run ends bit-identical to the whole one."""
    ranks = per_machine["ranks"]
    # The state is per machine indeed: the two ranks held different state when the checkpoint was written.
    assert _max_diff(ranks[0][inner, "whole"]["saved"][6], ranks[1][inner, "whole"]["saved"][6]) > 1e-3
    for rank in ranks:
        whole, resumed = rank[inner, "whole"], rank[inner, "resumed"]
        assert whole["global_step"] == resumed["global_step"] == 18
        assert_same(whole["saved"][6], resumed["first_step"], f"{inner}: this rank's optimizer state after the resume")
        assert_same(whole["final"], resumed["final"], f"{inner}: final model of the resumed run")
        assert_same(whole["optimizer"], resumed["optimizer"], f"{inner}: final optimizer state of the resumed run")


def test_per_machine_state_of_two_processes_is_refused_on_one(per_machine):
    """2 -> 1: AdamW's moments differ between the two saved processes and belong to no machine of a
    one-process run: the resume is refused in one line before training (the Trainer and the averager)."""
    import lightning.pytorch as L
    from user_project import CharData, CharLM

    from lit_slowcal import PeriodicAverager, PeriodicAveragingStrategy

    ckpt = per_machine["out"] / "adamw" / "whole" / "epoch=0.ckpt"
    saved = torch.load(ckpt, weights_only=True)  # plain data: readable without running code
    assert sorted(saved["periodic_averaging"][0]["per_machine"]["ranks"]) == [0, 1]
    model = CharLM("adamw")
    optimizer = model.configure_optimizers()
    optimizer.load_state_dict(saved["optimizer_states"][0])
    with pytest.raises(
        ValueError,
        match=r"^Cannot resume the per-machine optimizer state \(exp_avg, exp_avg_sq\) of 2 processes on 1: it differs",
    ):
        PeriodicAverager(model, optimizer, sync_every=5).load_state_dict(saved["periodic_averaging"][0])
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_epochs=3, strategy=PeriodicAveragingStrategy(sync_every=5), logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, reload_dataloaders_every_n_epochs=1,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"of 2 processes on 1: it differs between the saved processes"):
        trainer.fit(CharLM("adamw"), CharData(), ckpt_path=ckpt)


def test_trainer_ranks_with_different_k_stop_with_one_error_before_the_first_step(tmp_path):
    """Lightning broadcasts a SIGTERM flag every step, so ranks averaging at different steps hung in
    mismatched collectives (over 900 s). The set-up is compared when training starts instead."""
    ranks = run("different_k", tmp_path)
    for rank in ranks:
        kind, message = rank["outcome"]
        assert kind == "RuntimeError", rank
        assert message.startswith(
            "PeriodicAverager: the ranks were set up differently: sync_every (rank 0: 10, rank 1: 20);"
        )
        assert rank["global_step"] == 0 and rank["seconds"] < 60
