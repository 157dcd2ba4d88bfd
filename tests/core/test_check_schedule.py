"""The schedule check's rounds (issue 50): with ``check_schedule`` a blocking round compares the ranks' counts in
the first round, every ``check_every``-th, every ``close_round()`` and the first after a resume, a load or a new K;
the rounds between send their average alone. A count that parts is caught at the next check, in one line on
every rank; a check that meets a round without one ends both ranks at the process group's timeout, each with
one line. And the default layout: bucket views where no optimizer state is averaged."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_averaging import run_ranks
from torch import nn

from lit_slowcal import PeriodicAverager, SlowcalSGD
from lit_slowcal.averaging import CHECK_EVERY

# Rank 1 runs one extra backward pass before step ``PART`` (its count parts); every iteration then steps, and
# the averager synchronises after every K-th step. Each rank prints the step at which it raised, and the line.
_PARTED = """
import datetime, os, sys

import torch
import torch.distributed as dist
from torch import nn

from lit_slowcal import PeriodicAverager

rank, folder, k, every, part, close_at, steps = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:])
rank = int(rank)
dist.init_process_group("gloo", init_method="file://" + os.path.join(folder, "rendezvous"), rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=20))
torch.manual_seed(0)
model = nn.Linear(3, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
averager = PeriodicAverager(model, optimizer, sync_every=k)
averager.check_every = every
step = 0
try:
    for step in range(1, steps + 1):
        optimizer.zero_grad()
        model(torch.randn(5, 3)).pow(2).mean().backward()
        if rank == 1 and step == part:
            model(torch.randn(5, 3)).pow(2).mean().backward()  # the mistake: a backward pass rank 0 does not run
        optimizer.step()
        averager.step()
        if step == close_at:
            averager.close_round()
    print("no error", averager.num_syncs)
except RuntimeError as e:
    print(step, averager.num_syncs, e)
sys.stdout.flush()
os._exit(0)  # a rank may have left a collective the other never joined: no barrier, no teardown
"""


def _lines(tmp_path, *args: int) -> list[str]:
    procs = run_ranks(_PARTED, str(tmp_path), *map(str, args), timeout=120)
    for proc in procs:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return [proc.stdout for proc in procs]


@pytest.mark.slow
def test_a_count_that_parts_between_checks_is_caught_at_the_next_check_round_on_every_rank(tmp_path):
    """K = 1, check_every = 4: rank 1's extra backward pass at step 2 goes through rounds 1-3 (not checked; before,
    every round checked and round 1 raised) and stops both ranks at round 4, before its average, with the
    same line naming both ranks' counts."""
    outputs = _lines(tmp_path, 1, 4, 2, 0, 12)
    for out in outputs:
        assert out.count("\n") == 1, out
        assert out.startswith("5 4 PeriodicAverager: the ranks reached this synchronisation at different points "
                              "(rank 0: 5 steps, 5 backward passes, rank 1: 5 steps, 6 backward passes)"), out  # fmt: skip
    assert outputs[0][outputs[0].index("PeriodicAverager") :] == outputs[1][outputs[1].index("PeriodicAverager") :]


@pytest.mark.slow
def test_close_round_always_checks_between_check_rounds(tmp_path):
    """K = 2, check_every = 16: the count parts at step 3; the scheduled round after step 4 (round 1) goes without
    the check, and ``close_round()`` after step 5 checks whatever its round's index: both ranks raise there."""
    for out in _lines(tmp_path, 2, 16, 3, 5, 8):
        assert out.startswith("5 2 PeriodicAverager: the ranks reached this synchronisation at different points "
                              "(rank 0: 5 steps, 5 backward passes, rank 1: 5 steps, 6 backward passes)"), out  # fmt: skip


# Rank 0 closes a round alone (or gathers the state alone) after step 3, a check; rank 1 goes on to the round after
# step 4, round 1, which does not check: the two collectives cannot pair. Both end at the group's timeout.
_ALONE = """
import datetime, os, sys

import torch
import torch.distributed as dist
from torch import nn

from lit_slowcal import PeriodicAverager

rank, folder, what = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method="file://" + os.path.join(folder, "rendezvous"), rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=4))
model = nn.Linear(3, 1)
optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
averager = PeriodicAverager(model, optimizer, sync_every=2)
try:
    for step in range(1, 5):
        optimizer.zero_grad()
        model(torch.randn(5, 3)).pow(2).mean().backward()
        optimizer.step()
        averager.step()
        if step == 3 and rank == 0:  # the mistake: a collective called on rank 0 only
            averager.close_round() if what == "close" else averager.gather_state_dict()
except RuntimeError as e:
    print(e)
sys.stdout.flush()
os._exit(0)  # the ranks left collectives that never paired: no barrier, no teardown
"""


@pytest.mark.slow
@pytest.mark.parametrize("what", ["close", "gather"])
def test_a_check_that_meets_a_round_without_one_is_one_line_on_every_rank_at_the_timeout(tmp_path, what):
    """Rank 0's check (``close_round()`` or ``gather_state_dict()`` alone) and rank 1's round 1, which does not check:
    each rank stops at the process group's timeout (4 s here) with one line naming its own counts and the
    backend's error, never a hang. (Before, every round checked: the two checks met, and both ranks raised
    at once naming the two collectives or both counts.)"""
    procs = run_ranks(_ALONE, str(tmp_path), what, timeout=90)
    for proc in procs:
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert proc.stdout.count("\n") == 1, proc.stdout
    # gather_state_dict()'s check compares no counts: its line names none of them (0 steps).
    counts = "3 steps, 3 backward passes" if what == "close" else "0 steps, 0 backward passes"
    collective = "a synchronisation" if what == "close" else "gather_state_dict()"
    assert procs[0].stdout.startswith(
        f"PeriodicAverager: the ranks did not all reach {collective} (this rank: {counts}; the backend: "
    ), procs[0].stdout
    assert procs[1].stdout.startswith(
        "PeriodicAverager: the ranks did not all reach the average of this synchronisation (this rank: 4 steps, 4 "
        "backward passes, round 1, one that does not compare the ranks' counts: they are compared every 16 rounds, "
        "in close_round() and in gather_state_dict(); the backend: "
    ), procs[1].stdout
    assert "every rank calls them alike" in procs[1].stdout


def test_the_check_is_due_every_check_every_rounds_at_close_round_and_after_a_resume_a_load_or_a_new_k(monkeypatch):
    """Which blocking rounds compare the ranks' counts (recorded where ``check_setup`` is called, as if there were
    two processes): rounds 0, n, 2n; every ``close_round()``; the first after ``resume``, ``load_state_dict``, a new K.
    ``check_schedule=False``: the set-up once, before the first average."""
    calls: list[tuple[int, bool]] = []

    def build(**settings) -> PeriodicAverager:
        model = nn.Linear(2, 1)
        averager = PeriodicAverager(model, torch.optim.SGD(model.parameters(), lr=0.1), 1, **settings)
        monkeypatch.setattr(type(averager), "world_size", property(lambda self: 2))

        def check_setup(counts: bool = False) -> None:
            calls.append((averager.num_syncs, counts))
            averager._setup_checked = True

        monkeypatch.setattr(averager, "check_setup", check_setup)
        monkeypatch.setattr(
            averager.engine, "average", lambda tensors, weights, counts=None: averager.engine.sent(tensors, None)
        )
        return averager

    assert CHECK_EVERY == 16
    averager = build()
    assert averager.check_every == 16 and averager.setup_fingerprint()["check_every"] == (16, "16")
    with pytest.raises(ValueError, match=r"^Invalid check_every: 0 \(must be an integer >= 1\)$"):
        averager.check_every = 0
    averager.check_every = 4
    for _ in range(10):
        averager.step()
    assert calls == [(0, True), (4, True), (8, True)]
    calls.clear()
    averager.sync_every = 2  # a new K: the next round checks
    for _ in range(6):
        averager.step()
    assert calls == [(10, True), (12, True)]  # round 11 went without; 12 is due
    calls.clear()
    averager.optimizer.step()  # a step of its own: close_round() synchronises, and checks
    averager.steps += 1
    assert averager.close_round() and calls == [(13, True)]
    calls.clear()
    averager.load_state_dict(averager.state_dict())
    averager.step(), averager.step()
    assert calls == [(14, True)]
    calls.clear()
    averager.resume(averager.steps)
    averager.step(), averager.step()
    assert calls == [(averager.num_syncs - 1, True)]
    calls.clear()
    unchecked = build(check_schedule=False)
    for _ in range(5):
        unchecked.step()
    assert calls == [(0, False)]


def test_bucket_views_are_on_by_default_where_no_optimizer_state_is_averaged_and_rounds_are_blocking_and_exact():
    """``bucket_views=None`` (the default): on for SGD and AdamW; off for SlowcalSGD (w is averaged), with
    ``average_state``, compression, overlap, fragments and ``state_every``; ``True`` and ``False`` as given."""
    model = nn.Linear(2, 1)

    def views(optimizer, **settings) -> bool:
        return PeriodicAverager(model, optimizer, **{"sync_every": 4, **settings}).bucket_views

    sgd = lambda: torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # noqa: E731
    assert views(sgd()) and views(torch.optim.AdamW(model.parameters()))
    assert not views(SlowcalSGD(model.parameters(), lr=0.1))
    assert views(SlowcalSGD(model.parameters(), lr=0.1), bucket_views=True)
    assert not views(sgd(), bucket_views=False)
    for settings in (
        {"average_state": ("momentum_buffer",)},
        {"compression": "int8"},
        {"overlap_delay": 1},
        {"fragments": 2},
        {"state_every": 2, "average_state": ("momentum_buffer",)},
    ):
        assert not views(sgd(), **settings), settings
    options = PeriodicAverager(model, sgd(), 4).options
    assert options.bucket_views is None and dataclasses.replace(options, bucket_views=True).bucket_views is True


# K = 1, check_every = 4, SGD on an nn.Linear (bucket views: its tensors live in one buffer). Every all-gather and
# all-reduce counted; before each round the parameters kept, to compare with what a round that raised left. Rank 1
# runs an extra backward pass before step ``part`` (0: never). Each rank prints one JSON line.
_CARRIED = """
import datetime, json, os, sys

import torch
import torch.distributed as dist
from torch import nn

from lit_slowcal import PeriodicAverager

rank, folder, part = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
dist.init_process_group("gloo", init_method="file://" + os.path.join(folder, "rendezvous"), rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=20))
calls = {"all_gather": 0, "all_reduce": 0, "isend": 0}  # isend: a round's exchange (two processes, small)
for name in calls:
    def counted(*args, _real=getattr(dist, name), _name=name, **kwargs):
        calls[_name] += 1
        return _real(*args, **kwargs)
    setattr(dist, name, counted)
torch.manual_seed(rank)
model = nn.Linear(3, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
averager = PeriodicAverager(model, optimizer, sync_every=1)
averager.check_every = 4  # > 1: the periodic checks ride where they can
out = {}
try:
    for step in range(1, 13):
        optimizer.zero_grad()
        model(torch.randn(5, 3)).pow(2).mean().backward()
        if rank == 1 and step == part:
            model(torch.randn(5, 3)).pow(2).mean().backward()  # the mistake: a backward pass rank 0 does not run
        optimizer.step()
        before = [p.detach().clone() for p in model.parameters()]
        averager.step()
except RuntimeError as e:
    out["error"] = str(e)
    out["step"] = step
    out["as_before"] = all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
out.update(calls, syncs=averager.num_syncs, check_bytes=averager.link_counts.check_bytes,
           parameters=[p.tolist() for p in model.parameters()], before=[b.tolist() for b in before])
print(json.dumps(out))
sys.stdout.flush()
os._exit(0)
"""


def _carried(tmp_path, part: int) -> list[dict]:
    import json

    procs = run_ranks(_CARRIED, str(tmp_path), str(part), timeout=120)
    for proc in procs:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(proc.stdout.strip().splitlines()[-1]) for proc in procs]


@pytest.mark.slow
def test_with_two_processes_a_periodic_check_rides_in_the_rounds_own_message(tmp_path):
    """K = 1, check_every = 4, 12 rounds: the set-up and counts are compared in round 0's all-gather, and rounds 4
    and 8 carry the counts behind the parameters in their one message, here an exchange (before: an all-gather of
    27 int64 values in each of rounds 0, 4 and 8). Every round is the exact mean: both ranks end with the same parameters, the
    mean of what each held before the last round."""
    ranks = _carried(tmp_path, 0)
    for out in ranks:
        assert "error" not in out, out
        assert (out["syncs"], out["all_gather"], out["all_reduce"], out["isend"]) == (12, 1, 0, 12)
        # Round 0's all-gather sends 27 int64 values to the other process; rounds 4 and 8 each carry 8 float32
        # values, of which each of the two processes sends all once (on the ring as in the exchange).
        assert out["check_bytes"] == 27 * 8 + 2 * 8 * 4
    assert ranks[0]["parameters"] == ranks[1]["parameters"]
    for mine, a, b in zip(ranks[0]["parameters"], ranks[0]["before"], ranks[1]["before"]):
        expected = (torch.tensor(a, dtype=torch.float64) + torch.tensor(b, dtype=torch.float64)) / 2
        assert torch.equal(torch.tensor(mine), expected.float())


@pytest.mark.slow
def test_counts_that_part_are_caught_in_the_carrying_round_with_nothing_averaged(tmp_path):
    """Rank 1's extra backward pass at step 2: round 4 (after step 5) carries the counts, finds them different,
    puts the parameters back as they were before the round on both ranks, and the check's all-gather names
    both ranks' counts in the one line that ``check_schedule`` always gave."""
    ranks = _carried(tmp_path, 2)
    for out in ranks:
        assert out["step"] == 5 and out["syncs"] == 4 and out["as_before"], out
        assert out["error"].startswith(
            "PeriodicAverager: the ranks reached this synchronisation at different points (rank 0: 5 steps, 5 backward "
            "passes, rank 1: 5 steps, 6 backward passes)"
        ), out["error"]
        # Round 0's all-gather and the one naming the counts; rounds 0-3 and the carrying round 4's exchanges.
        assert (out["all_gather"], out["all_reduce"], out["isend"]) == (2, 0, 5), out
    assert ranks[0]["parameters"] != ranks[1]["parameters"]  # each rank's own, not averaged
