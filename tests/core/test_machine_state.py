"""Each machine's own optimizer state across a resume (lit_slowcal._machine_state), the set-up every rank
must share, and the models the averager refuses or now averages (sharded, complex).

The Trainer's exact resume of AdamW, DiLoCo, momentum and SCAFFOLD on two processes is in
tests/library/test_user_project.py; here the rules themselves, and two gloo processes of a plain loop.
"""

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from helpers import finish_rank, spawn_ranks
from torch import nn

from lit_slowcal import PeriodicAverager, SimulatedMachines
from lit_slowcal._machine_state import select


def _state(value: float) -> dict:
    return {0: {"exp_avg": torch.full((3,), value)}}


def test_select_gives_each_rank_its_own_and_refuses_what_no_machine_of_the_run_held():
    saved = {"world_size": 2, "ranks": {0: _state(1.0), 1: _state(2.0)}}
    assert torch.equal(select(saved, 1, 2)[0]["exp_avg"], torch.full((3,), 2.0))  # 2 -> 2: its own
    with pytest.raises(
        ValueError, match=r"^Cannot resume the per-machine optimizer state \(exp_avg\) of 2 processes on 1: it differs"
    ):
        select(saved, 0, 1)  # 2 -> 1: which machine's?
    agreeing = {"world_size": 2, "ranks": {0: _state(1.0), 1: _state(1.0)}}
    assert torch.equal(select(agreeing, 0, 1)[0]["exp_avg"], torch.ones(3))  # 2 -> 1, the same everywhere
    one = {"world_size": 1, "ranks": {0: _state(3.0)}}
    assert all(torch.equal(select(one, r, 2)[0]["exp_avg"], torch.full((3,), 3.0)) for r in (0, 1))  # 1 -> 2
    with pytest.raises(ValueError, match=r"holds rank\(s\) \[0\] of 2 processes and this is rank 1 of 2"):
        select({"world_size": 2, "ranks": {0: _state(1.0)}}, 1, 2)  # rank 0's state_dict() alone, on rank 1
    assert select({"world_size": 2, "ranks": {0: {}, 1: {}}}, 0, 1) is None  # nothing kept per machine


def test_simulated_machines_keep_their_own_adamw_moments_across_a_state_dict():
    """One process, 3 machines: AdamW's moments differ per machine (stacked), are not averaged, and a
    fresh optimizer and averager resume them exactly; averaged state is not duplicated in the averager's."""
    torch.manual_seed(0)
    machines = SimulatedMachines(nn.Linear(4, 2), 3)
    optimizer = torch.optim.AdamW(machines.parameters(), lr=0.1)
    averager = PeriodicAverager(machines, optimizer, sync_every=2).attach()
    for _ in range(3):
        optimizer.zero_grad()
        machines(torch.randn(3, 5, 4)).square().sum().backward()
        optimizer.step()
    exp_avg = optimizer.state[machines.weight]["exp_avg"]
    assert not torch.equal(exp_avg[0], exp_avg[1])  # per machine indeed
    state = averager.state_dict()
    assert sorted(state["per_machine"]["ranks"][0][0]) == ["exp_avg", "exp_avg_sq", "step"]
    fresh = torch.optim.AdamW(machines.parameters(), lr=0.1)
    fresh.load_state_dict(optimizer.state_dict())
    for p in machines.parameters():  # what a file of another machine's state would put there
        fresh.state[p]["exp_avg"].zero_()
    PeriodicAverager(machines, fresh, sync_every=2).load_state_dict(state)
    for p in machines.parameters():
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(fresh.state[p][key], optimizer.state[p][key])


def test_complex_parameters_are_averaged_and_counted_as_two_floats():
    machines = SimulatedMachines(nn.Linear(4, 3, dtype=torch.complex64), 2)
    with torch.no_grad():
        machines.weight[1].mul_(1j)  # the machines differ
    expected = machines.weight.mean(0).clone()
    averager = PeriodicAverager(machines, torch.optim.SGD(machines.parameters(), lr=0.1), sync_every=1)
    assert averager.floats_per_sync() == 2 * (12 + 3)
    averager.sync()
    assert torch.equal(machines.weight[0], machines.weight[1]) and torch.allclose(machines.weight[0], expected)
    assert averager.floats_communicated == 30


def test_participation_seed_beyond_64_bits_is_refused_and_the_largest_draws():
    machines = SimulatedMachines(nn.Linear(2, 1), 4)
    sgd = torch.optim.SGD(machines.parameters(), lr=0.1)
    with pytest.raises(
        ValueError,
        match=r"^Invalid participation_seed: 1180591620717411303424 \(must be an integer >= 0 and < 2\*\*63\)$",
    ):
        PeriodicAverager(machines, sgd, sync_every=1, participation=2, participation_seed=2**70)
    averager = PeriodicAverager(machines, sgd, sync_every=1, participation=2, participation_seed=2**63 - 1)
    for r in range(3):
        weights = averager.participant_weights(r)
        assert sorted(weights.tolist()) == [0.0, 0.0, 0.5, 0.5]
    averager.sync()


def test_an_outer_optimizers_state_is_not_dropped_by_an_averager_without_one():
    machines = SimulatedMachines(nn.Linear(2, 1), 2)
    sgd = torch.optim.SGD(machines.parameters(), lr=0.1)
    diloco = PeriodicAverager(machines, sgd, 1, outer_optimizer=lambda p: torch.optim.SGD(p, lr=0.7, momentum=0.9))
    diloco.sync()
    with pytest.raises(ValueError, match=r"^Cannot load the averager's state: it holds an outer optimizer's state"):
        PeriodicAverager(machines, sgd, 1).load_state_dict(diloco.state_dict())


def _worker(rank: int, init_file: str, out: str) -> None:
    """Two ranks of a plain loop, each case's outcome recorded: the set-up checks, a model sharded over them, and
    one rank's per-machine state loaded on another."""
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=2, timeout=timedelta(seconds=30)
    )
    torch.set_num_threads(1)
    outcomes = {}

    def attempt(name, fn):
        try:
            outcomes[name] = ("ok", fn())
        except (RuntimeError, ValueError) as err:
            outcomes[name] = (type(err).__name__, str(err))

    def train(model, averager, steps):
        optimizer = averager.optimizer
        for _ in range(steps):
            optimizer.zero_grad()
            model(torch.randn(2, 3)).sum().backward()
            optimizer.step()
            averager.step()

    def different(**per_rank):
        """An averager whose options differ by rank: sync_every, participation or the model's width."""
        width = per_rank.get("width", (2, 2))[rank]
        model = nn.Linear(3, width)
        options = {"participation": per_rank["participation"][rank]} if "participation" in per_rank else {}
        averager = PeriodicAverager(
            model, torch.optim.SGD(model.parameters(), lr=0.1), per_rank.get("k", (2, 2))[rank], **options
        )
        train(model, averager, 4)

    attempt("k", lambda: different(k=(2, 3)))
    attempt("participation", lambda: different(participation=(1, None)))
    attempt("width", lambda: different(width=(2, 3)))

    def broadcast_width():
        model = nn.Linear(3, 2 + rank)
        PeriodicAverager(model, torch.optim.SGD(model.parameters(), lr=0.1), 2).broadcast()

    attempt("broadcast_width", broadcast_width)

    def sharded():
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        model = nn.Sequential(nn.Linear(5, 3))
        fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
        PeriodicAverager(model, torch.optim.SGD(model.parameters(), lr=0.1), 2)

    attempt("sharded", sharded)

    def rank0_state_on_rank1():
        torch.manual_seed(rank)
        model = nn.Linear(3, 2)
        averager = PeriodicAverager(model, torch.optim.AdamW(model.parameters(), lr=0.1), 2)
        train(model, averager, 3)
        states = [None, None]
        dist.all_gather_object(states, averager.state_dict())
        gathered = averager.gather_state_dict()
        return {
            "gathered_ranks": None if gathered is None else sorted(gathered["per_machine"]["ranks"]),
            "load": averager.load_state_dict(states[0]),
        }

    attempt("rank0_state", rank0_state_on_rank1)
    finish_rank(outcomes, out, rank)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("two_ranks"))
    return spawn_ranks(_worker, 2, out)


@pytest.mark.parametrize(
    "case, field",
    [
        ("k", r"sync_every \(rank 0: 2, rank 1: 3\)"),
        ("participation", r"participation \(S\) \(rank 0: 1, rank 1: 2\)"),
        ("width", r"averaged tensors|their shapes, dtypes and contiguity"),
        (
            "broadcast_width",
            r"their shapes, dtypes and contiguity",
        ),  # broadcast() checks first: no mismatched broadcast
    ],
)
@pytest.mark.slow
def test_ranks_set_up_differently_raise_one_line_on_every_rank_naming_what_differs(two_ranks, case, field):
    for outcomes in two_ranks:
        kind, message = outcomes[case]
        assert kind == "RuntimeError" and "\n" not in message
        assert message.startswith("PeriodicAverager: the ranks were set up differently: ")
        assert __import__("re").search(field, message), message


def test_a_model_sharded_over_the_averaged_ranks_is_refused_at_construction_in_one_line(two_ranks):
    for rank, outcomes in enumerate(two_ranks):
        kind, message = outcomes["sharded"]
        assert kind == "ValueError" and "\n" not in message
        assert message.startswith(
            f"PeriodicAverager: '0.weight' is sharded with ranks [{1 - rank}] of the process_group"
        )
        assert message.endswith("as process_group (docs/sharded.md)")


def test_one_ranks_per_machine_state_is_refused_on_another_rank_and_the_gather_holds_both(two_ranks):
    rank0, rank1 = two_ranks
    assert rank0["rank0_state"] == ("ok", {"gathered_ranks": [0, 1], "load": None})  # its own state: fine
    kind, message = rank1["rank0_state"]
    assert kind == "ValueError"
    assert message.startswith(
        "Cannot resume the per-machine optimizer state (exp_avg, exp_avg_sq, step): the state holds rank(s) [0] of 2"
    )
