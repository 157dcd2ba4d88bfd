"""Overlapped rounds (``PeriodicAverager(overlap_delay=tau, fragments=F)``) against references written
here in float64: a round's snapshot is averaged while training goes on, and lands tau steps later as
live <- avg + (live - snapshot); with F fragments, fragment f's round starts where steps % K == f K / F.
tau = 0 and F = 1 is the blocking schedule, bit for bit; two gloo processes equal the same machines
simulated in one; a round closed while one is in flight resumes exactly."""

import copy
import os
import re
import tempfile
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import Quadratics, finish_rank, spawn_ranks
from test_strategy import Regression, fit, machine_data
from torch import nn

from lit_slowcal import PeriodicAverager, PeriodicAveragingStrategy, Scaffold, SimulatedMachines, SlowcalSGD
from lit_slowcal._overlap import partition
from lit_slowcal._rounds import ExactRound, OverlappedRound
from lit_slowcal.link import Link, hidden_seconds

M, DIM, LR = 4, 3, 0.05
PROBLEMS = (Quadratics(M, DIM, steps=64, seed=0), Quadratics(M, DIM, steps=64, seed=1))  # one for a, one for b


class Pair(nn.Module):
    """Two parameters of the same size: with F = 2, fragment 0 is ``a`` (and its state), fragment 1 ``b``."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(PROBLEMS[0].x0.clone())
        self.b = nn.Parameter(PROBLEMS[1].x0.clone())


def diloco(params):
    """DiLoCo's outer optimizer."""
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


def make(optimizer: str, dtype: torch.dtype = torch.float64, **options):
    """``machines`` (M) simulated machines of a Pair in ``dtype``, their optimizer and an averager with
    ``options``. ``optimizer``: "sgd", "slowcal", or "diloco" (SGD with momentum, kept per machine, and
    DiLoCo's outer optimizer)."""
    machines = SimulatedMachines(Pair(), options.pop("machines", M)).to(dtype)
    params = list(machines.parameters())
    opt: torch.optim.Optimizer = (
        SlowcalSGD(params, lr=LR)
        if optimizer == "slowcal"
        else torch.optim.SGD(params, lr=LR, momentum=0.9 if optimizer == "diloco" else 0)
    )
    if optimizer == "diloco":
        options["outer_optimizer"] = diloco
    return machines, opt, PeriodicAverager(machines, opt, sync_every=options.pop("K", 4), **options)


def train(machines, opt, averager, steps: range, machine_ids=range(M)) -> None:
    """The optimizer steps ``steps`` (their gradients' noise index), each machine on its own quadratic."""
    for t in steps:
        for p, problem in zip((machines.a, machines.b), PROBLEMS):
            grads = [problem.grad(i, p[k].detach(), t) for k, i in enumerate(machine_ids)]
            p.grad = torch.stack(grads).to(p.dtype)
        opt.step()
        averager.step()


def reference(optimizer: str, steps: int, K: int, tau: int, F: int = 1, outer_lr=None, S: int = M):
    """The machines' a and b (and w) after ``steps`` steps, by hand in float64. ``outer_lr``: an outer SGD
    on the rounds' averages; ``S``: participants of each round, drawn as ``participation_seed=0`` draws."""
    names = ("a", "b")
    x = {n: [PROBLEMS[j].x0.clone() for _ in range(M)] for j, n in enumerate(names)}
    w = {n: [v.clone() for v in x[n]] for n in names}  # SlowcalSGD's iterate, averaged with x
    start = {n: x[n][0].clone() for n in names}  # the outer optimizer's global parameters
    fragment_of = {"a": 0, "b": 1} if F == 2 else {"a": 0, "b": 0}
    flight = None  # (landing step, names, snapshot of x and w, their averages)
    rounds = 0
    for t in range(steps):
        for j, n in enumerate(names):
            for i in range(M):
                g = PROBLEMS[j].grad(i, x[n][i], t)
                if optimizer == "slowcal":
                    w[n][i] = w[n][i] - LR * g
                    c = 2.0 / (t + 3)  # alpha_{t+1} / alpha_{0:t+1} with alpha_t = t + 1
                    x[n][i] = x[n][i] + c * (w[n][i] - x[n][i])
                else:
                    x[n][i] = x[n][i] - LR * g
        step = t + 1
        if step % (K // F) == 0:  # with tau >= 1 the last round landed before (tau < K / F)
            which = [n for n in names if fragment_of[n] == (step // (K // F)) % F]
            snap = {key: {n: [v.clone() for v in state[n]] for n in which} for key, state in (("x", x), ("w", w))}
            draw = torch.randperm(M, generator=torch.Generator().manual_seed(rounds))  # seed 0: 0 * 1_000_003 + r
            chosen = draw[:S].tolist() if S < M else range(M)
            avg = {key: {n: sum(snap[key][n][i] for i in chosen) / S for n in which} for key in snap}
            flight = (step + tau, which, snap, avg)
            rounds += 1
        if flight is not None and step == flight[0]:
            _, which, snap, avg = flight
            for n in which if outer_lr is not None else ():
                start[n] = start[n] - outer_lr * (start[n] - avg["x"][n])  # the pseudo-gradient start - avg
                avg["x"][n] = start[n]
            for key, state in (("x", x), ("w", w)):
                for n in which:
                    for i in range(M):
                        state[n][i] = avg[key][n] + (state[n][i] - snap[key][n][i])
            flight = None
    return [torch.stack(x[n]) for n in names] + ([torch.stack(w[n]) for n in names] if optimizer == "slowcal" else [])


def tensors(machines, opt) -> list[torch.Tensor]:
    out = [machines.a.detach().clone(), machines.b.detach().clone()]
    return out + [opt.state[p]["w"].clone() for p in (machines.a, machines.b) if "w" in opt.state[p]]


def assert_close(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("optimizer", ["sgd", "slowcal"])
def test_no_overlap_is_the_blocking_schedule_bit_for_bit(optimizer):
    runs = []
    for options in ({}, {"overlap_delay": 0, "fragments": 1}):
        machines, opt, averager = make(optimizer, **options)
        train(machines, opt, averager, range(11))
        averager.close_round()
        runs.append((tensors(machines, opt), averager.state_dict()))
    (plain, plain_state), (zero, zero_state) = runs
    assert all(torch.equal(a, b) for a, b in zip(plain, zero)) and zero_state == plain_state
    assert "settled_step" not in zero_state  # the state of the blocking schedule, as it was


@pytest.mark.parametrize("tau", [1, 2])
@pytest.mark.parametrize("optimizer", ["sgd", "slowcal"])
def test_overlapped_rounds_equal_a_delayed_reference(optimizer, tau):
    K, steps = 4, 22  # five rounds; the last, started at step 20, lands at 20 + tau
    machines, opt, averager = make(optimizer, K=K, overlap_delay=tau)
    for step in range(steps):
        train(machines, opt, averager, range(step, step + 1))
        in_flight = step + 1 >= K and (step + 1) % K < tau
        assert averager.in_round and (averager.engine.in_flight is not None) == in_flight, step
    assert_close(tensors(machines, opt), reference(optimizer, steps, K, tau))
    # Each round is counted as a blocking one, when it starts: x (and w) of 6 floats a machine.
    floats = 6 * (2 if optimizer == "slowcal" else 1)
    assert averager.num_syncs == 5 and averager.last_sync_step == 20
    assert averager.floats_communicated == 5 * floats and averager.bytes_communicated == 5 * floats * 8
    assert averager.link_counts.syncs == 5
    assert not torch.equal(machines.a[0], machines.a[1])  # no round closed: the machines differ


@pytest.mark.parametrize("tau", [0, 1])
@pytest.mark.parametrize("optimizer", ["sgd", "slowcal"])
def test_fragments_take_turns_as_in_a_reference(optimizer, tau):
    K, F, steps = 4, 2, 13
    machines, opt, averager = make(optimizer, K=K, overlap_delay=tau, fragments=F)
    train(machines, opt, averager, range(steps))
    assert_close(tensors(machines, opt), reference(optimizer, steps, K, tau, F))
    # A fragment's round sends that fragment: rounds at steps 2, 4, ..., 12, each of 3 floats of x (and w).
    floats = 3 * (2 if optimizer == "slowcal" else 1)
    assert averager.num_syncs == 6 and averager.floats_communicated == 6 * floats
    assert averager.link_counts.payload_bytes == 6 * floats * 8
    # A schedule resumed at step 12 counts the same rounds (its fragments: the same tensors, w included).
    resumed = PeriodicAverager(machines, opt, sync_every=K, overlap_delay=tau, fragments=F, start_step=12)
    assert resumed.num_syncs == 6 and resumed.floats_communicated == averager.floats_communicated
    assert resumed.link_counts == averager.link_counts


@pytest.mark.parametrize("F", [1, 2])
def test_an_outer_optimizer_steps_on_the_average_when_it_lands_and_participants_are_drawn_when_it_starts(F):
    K, tau, steps = 4, 1, 15
    outer = lambda params: torch.optim.SGD(params, lr=0.5)  # noqa: E731
    machines, opt, averager = make("sgd", K=K, overlap_delay=tau, fragments=F, outer_optimizer=outer, participation=2)
    train(machines, opt, averager, range(steps))
    assert_close(tensors(machines, opt), reference("sgd", steps, K, tau, F, outer_lr=0.5, S=2))
    assert averager.floats_communicated == averager.num_syncs * 6 / F * 2 / M  # S/M of each round's floats


def test_partition_balances_contiguous_fragments():
    assert partition([5, 1, 1, 1, 1, 1], 2) == [0, 1]  # 5 | 5
    assert partition([1, 1, 1, 1], 3) == [0, 2, 3]  # every fragment gets one
    assert partition([2, 2, 2, 2, 2, 2], 3) == [0, 2, 4]
    assert partition([1, 2, 3, 4, 5], 2) == [0, 3]  # 6 | 9: the largest as small as can be
    with pytest.raises(
        ValueError, match=r"^Invalid fragments: 3 \(must be <= 2, the parameters and buffers averaged\)$"
    ):
        partition([1, 1], 3)


def test_closing_a_round_in_flight_leaves_identical_machines_and_resumes_exactly():
    K, tau, stop, end = 4, 2, 5, 16  # the round started at step 4 is in flight at step 5
    machines, opt, averager = make("slowcal", K=K, overlap_delay=tau)
    train(machines, opt, averager, range(stop))
    assert averager.state_dict()["in_flight"]["ranks"][0]["land_step"] == 6  # saved mid-flight: see below
    assert averager.close_round() and not averager.in_round and averager.num_syncs == 2
    for t in (machines.a, machines.b, opt.state[machines.a]["w"], opt.state[machines.b]["w"]):
        assert torch.equal(t, t[:1].expand_as(t))
    saved = copy.deepcopy((machines.state_dict(), opt.state_dict(), averager.state_dict()))
    assert saved[2]["settled_step"] == stop
    train(machines, opt, averager, range(stop, end))
    assert averager.num_syncs == 5  # rounds at 8, 12 and 16: the schedule is unchanged

    machines2, opt2, averager2 = make("slowcal", K=K, overlap_delay=tau)
    machines2.load_state_dict(saved[0])
    opt2.load_state_dict(saved[1])
    averager2.load_state_dict(saved[2])
    train(machines2, opt2, averager2, range(stop, end))
    assert all(torch.equal(a, b) for a, b in zip(tensors(machines, opt), tensors(machines2, opt2)))
    assert averager.close_round() and averager2.close_round()  # the round started at 16 was in flight
    assert all(torch.equal(a, b) for a, b in zip(tensors(machines, opt), tensors(machines2, opt2)))
    assert averager2.state_dict() == averager.state_dict()


def everything(machines, opt) -> list[torch.Tensor]:
    """The averaged tensors and every machine's own optimizer state (SGD's momentum buffers)."""
    own = [opt.state[p]["momentum_buffer"] for p in (machines.a, machines.b) if "momentum_buffer" in opt.state[p]]
    return tensors(machines, opt) + [b.clone() for b in own]


def assert_same(a: Any, b: Any) -> None:
    """``a`` and ``b`` (nested dicts, lists and tensors) equal, the tensors bit for bit."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            assert_same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b


K_SAVE, END = 8, 25  # rounds every K / F steps; the last, at 24, in flight at the end when tau = 2


def save_point(tau: int, F: int) -> tuple[int, int]:
    """(the step a round starts, the step the checkpoint is taken): the round is in flight there, tau - 1
    steps after it started; with F = 2 it is fragment 1's (b), with F = 1 the whole model's."""
    start = 12 if F == 2 else K_SAVE
    return start, start + tau - 1


@pytest.mark.parametrize("F", [1, 2])
@pytest.mark.parametrize("tau", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("optimizer", ["slowcal", "diloco"])
def test_a_checkpoint_taken_while_a_round_is_in_flight_resumes_bit_for_bit(optimizer, dtype, tau, F, tmp_path):
    """state_dict() mid-flight holds the round (each machine's snapshot, the average, the landing step, the
    fragment) as plain tensors; new machines, optimizer and averager loaded from the file land it at the same
    step and end with the bits of the run that never saved, before and after the final close_round()."""
    options = {"K": K_SAVE, "overlap_delay": tau, "fragments": F}
    uninterrupted = make(optimizer, dtype, **options)
    train(*uninterrupted, range(END))

    machines, opt, averager = make(optimizer, dtype, **options)
    start, stop = save_point(tau, F)
    train(machines, opt, averager, range(stop))
    held = [t.clone() for t, _ in averager._tensors()]  # by place
    assert averager.engine.in_flight is not None and averager.engine.in_flight.land_step == start + tau
    path = tmp_path / "checkpoint.pt"
    torch.save({"model": machines.state_dict(), "optimizer": opt.state_dict(), "averager": averager.state_dict()}, path)
    saved = torch.load(path, weights_only=True)  # plain data
    flight = saved["averager"]["in_flight"]
    assert {k: v for k, v in flight.items() if k != "ranks"} == {
        "world_size": 1, "machines_per_process": M, "overlap_delay": tau, "fragments": F
    }  # fmt: skip
    (rank,) = flight["ranks"].values()
    assert (rank["land_step"], rank["fragment"]) == (start + tau, 1 if F == 2 else 0)
    # By place in the averager's tensors (a, b, or SlowcalSGD's a, w_a, b, w_b): with F = 2 only b's.
    places = len(averager._tensors())
    in_round = [k for k in range(places) if F == 1 or k >= places // 2]
    assert [k for k, v in enumerate(rank["snapshot"]) if v is not None] == in_round
    assert [k for k, v in enumerate(rank["result"]) if v is not None] == in_round
    for k in in_round:
        snapshot, result = rank["snapshot"][k], rank["result"][k]
        assert snapshot.shape == (M, DIM) and result.shape == (DIM,) and snapshot.dtype == result.dtype == dtype
        assert result.untyped_storage().nbytes() == result.nbytes  # one machine's average, not a view of M
        torch.testing.assert_close(result, snapshot.mean(0), rtol=0, atol=0)  # the snapshot's average
    if tau == 1:  # saved at the step the round started: the snapshot is what the machines hold
        assert all(torch.equal(rank["snapshot"][k], held[k]) for k in in_round)
    train(machines, opt, averager, range(stop, END))  # the run that saved goes on

    resumed = make(optimizer, dtype, **options)
    machines2, opt2, averager2 = resumed
    machines2.load_state_dict(saved["model"])
    if optimizer == "slowcal":  # the averager first: the round finds the optimizer's loaded w when it lands
        averager2.load_state_dict(saved["averager"])
        opt2.load_state_dict(saved["optimizer"])
    else:
        opt2.load_state_dict(saved["optimizer"])
        averager2.load_state_dict(saved["averager"])
    assert averager2.in_round and averager2.engine.in_flight is not None
    assert_same(averager2.state_dict(), saved["averager"])  # saved again before it lands: the same state
    train(machines2, opt2, averager2, range(stop, END))

    runs = [uninterrupted, (machines, opt, averager), resumed]
    for run in runs[1:]:
        assert_same(everything(*run[:2]), everything(*uninterrupted[:2]))
        assert_same(run[2].state_dict(), uninterrupted[2].state_dict())
    assert [run[2].close_round() for run in runs] == [True] * 3
    for run in runs[1:]:
        assert_same(everything(*run[:2]), everything(*uninterrupted[:2]))
        assert_same(run[2].state_dict(), uninterrupted[2].state_dict())


def test_a_round_in_flight_is_refused_where_it_cannot_continue():
    """A state with a round in flight loaded into an averager with another tau or F, another number of
    processes or of machines per process: one line each, before anything is loaded."""
    machines, opt, averager = make("sgd", K=8, overlap_delay=1)
    train(machines, opt, averager, range(8))  # the round of step 8 lands at 9
    state = averager.state_dict()
    two = copy.deepcopy(state)
    two["in_flight"]["world_size"] = 2
    two["in_flight"]["ranks"][1] = two["in_flight"]["ranks"][0]
    what = r"^Cannot resume the round in flight \(it lands at step 9\)"
    cases = [
        (
            {"overlap_delay": 2},
            state,
            what
            + r": it was started with overlap_delay=1, fragments=1 and this averager has overlap_delay=2, fragments=1; build it with the same, or save after close_round\(\)$",
        ),  # fmt: skip
        ({"overlap_delay": 1, "fragments": 2}, state, r"this averager has overlap_delay=1, fragments=2;"),
        ({}, state, r"this averager has overlap_delay=0, fragments=1;"),
        (
            {"overlap_delay": 1, "machines": 2},
            state,
            what
            + r": it was saved on 1 process\(es\) of 4 machines each and this averager runs on 1 of 2; each machine's snapshot is its own: resume on the same machines, or save after close_round\(\)$",
        ),  # fmt: skip
        ({"overlap_delay": 1}, two, r"saved on 2 process\(es\) of 4 machines each and this averager runs on 1 of 4;"),
    ]
    for options, saved, message in cases:
        _, _, other = make("sgd", K=8, **options)
        with pytest.raises(ValueError, match=message) as error:
            other.load_state_dict(saved)
        one_line(error)
        assert other.steps == 0 and other.engine.in_flight is None  # nothing loaded
    # An averager with a round of its own in flight loads nothing.
    with pytest.raises(RuntimeError, match=r"^PeriodicAverager.load_state_dict\(\): a round is in flight \(it lands at step 9\); call close_round\(\) first$"):  # fmt: skip
        averager.load_state_dict(state)
    # A restored round lands where the live tensors are those it was taken of, or says which one is not.
    _, _, restored = make("sgd", K=8, overlap_delay=1)
    small = copy.deepcopy(state)
    small["in_flight"]["ranks"][0]["snapshot"][1] = torch.zeros(M, DIM + 1, dtype=torch.float64)
    restored.load_state_dict(small)
    with pytest.raises(ValueError, match=r"^Cannot land the restored round in flight: averaged tensor 1 has shape \(4, 3\) and dtype torch.float64, its snapshot \(4, 4\) and torch.float64; resume the same model$") as error:  # fmt: skip
        restored.close_round()
    one_line(error)


def test_the_trainer_strategy_overlaps_rounds_as_a_plain_loop_does():
    K, tau, steps = 4, 1, 10  # rounds at 4 and 8 land at 5 and 9; fit's end closes the round at 10
    strategy = PeriodicAveragingStrategy(sync_every=K, overlap_delay=tau)
    trainer = fit(Regression("slowcal"), strategy, steps)
    (averager,) = strategy.averagers.values()
    assert (averager.options.overlap_delay, averager.num_syncs, averager.in_round) == (tau, 3, False)

    plain = Regression("slowcal")
    opt = plain.configure_optimizers()
    loop = PeriodicAverager(plain, opt, sync_every=K, overlap_delay=tau)
    for i, batch in enumerate(machine_data(steps)):
        opt.zero_grad()
        plain.training_step(batch, i).backward()
        opt.step()
        loop.step()
    loop.close_round()
    for p, q in zip(trainer.lightning_module.parameters(), plain.parameters()):
        assert torch.equal(p, q)


def one_line(error: pytest.ExceptionInfo) -> str:
    assert "\n" not in str(error.value)
    return str(error.value)


def test_bad_values_are_one_line_each():
    machines = SimulatedMachines(Pair(), 2)
    sgd = torch.optim.SGD(machines.parameters(), lr=0.1)
    cases = [
        ({"overlap_delay": -1}, r"Invalid overlap_delay: -1 \(must be an integer >= 0\)"),
        ({"overlap_delay": 1.0}, r"Invalid overlap_delay: 1.0 \(must be an integer >= 0\)"),
        ({"fragments": 0}, r"Invalid fragments: 0 \(must be an integer >= 1\)"),
        ({"fragments": 3}, r"Invalid fragments: 3 \(must divide sync_every = 4\)"),
        ({"overlap_delay": 4}, r"Invalid overlap_delay: 4 \(must be < sync_every // fragments = 4: a round lands"),
        ({"overlap_delay": 2, "fragments": 2}, r"Invalid overlap_delay: 2 \(must be < sync_every // fragments = 2"),
        ({"fragments": 4}, r"Invalid fragments: 4 \(must be <= 2, the parameters and buffers averaged\)"),
    ]
    for options, message in cases:
        with pytest.raises(ValueError, match=message) as error:
            PeriodicAverager(machines, sgd, sync_every=4, **options)
        one_line(error)
        if "must be <= 2" not in message:  # the strategies refuse the same at construction
            with pytest.raises(ValueError, match=message):
                PeriodicAveragingStrategy(sync_every=4, **options)
    with pytest.raises(
        ValueError, match=r"Invalid fragments: 2 \(Scaffold's pre_sync/post_sync act on the whole"
    ) as error:
        PeriodicAverager(machines, Scaffold(machines.parameters(), lr=0.1), sync_every=4, fragments=2)
    one_line(error)
    with pytest.raises(
        ValueError, match=r"Invalid overlap_delay: 1 \(Scaffold's post_sync takes the round's average in the step"
    ) as error:
        PeriodicAverager(machines, Scaffold(machines.parameters(), lr=0.1), sync_every=4, overlap_delay=1)
    one_line(error)
    averager = PeriodicAverager(machines, sgd, sync_every=4, overlap_delay=1, fragments=2)
    with pytest.raises(ValueError, match=r"Invalid sync_every: 2 \(must be a multiple of fragments = 2 and >= \(overlap_delay \+ 1\) x fragments = 4\)") as error:  # fmt: skip
        averager.sync_every = 2
    one_line(error)
    assert averager.sync_every == 4
    strategy = PeriodicAveragingStrategy(sync_every=4, overlap_delay=1, fragments=2)
    with pytest.raises(ValueError, match=r"Invalid sync_every: 3 \(must be a multiple of fragments = 2"):
        strategy.sync_every = 3
    assert (strategy.options.overlap_delay, strategy.options.fragments, strategy.sync_every) == (1, 2, 4)


# -- two gloo processes --------------------------------------------------------------------------

RUNS: dict[str, dict[str, Any]] = {
    "default": {},
    "zero": {"overlap_delay": 0, "fragments": 1},
    "tau": {"overlap_delay": 1},
    "fragments": {"overlap_delay": 1, "fragments": 2},
}


def _worker(rank: int, init_file: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    results = {}
    for name, options in RUNS.items():
        machines = SimulatedMachines(Pair(), M // 2)  # this process hosts machines 2 rank, 2 rank + 1
        opt = SlowcalSGD(machines.parameters(), lr=LR)
        averager = PeriodicAverager(machines, opt, sync_every=4, **options)
        train(machines, opt, averager, range(14), machine_ids=range(2 * rank, 2 * rank + 2))
        results[name] = tensors(machines, opt)
        averager.close_round()
        results[name + " closed"] = tensors(machines, opt)
    torch.save(results, f"{out}.{rank}")
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
def test_two_gloo_processes_equal_the_same_machines_simulated_in_one(tmp_path):
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(os.path.join(tmp, "rendezvous"), str(tmp_path / "out")), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"out.{rank}") for rank in range(2)]
    both = {name: [torch.cat(pair) for pair in zip(ranks[0][name], ranks[1][name])] for name in ranks[0]}
    for suffix in ("", " closed"):
        assert all(torch.equal(a, b) for a, b in zip(both["default" + suffix], both["zero" + suffix]))
    for name in ("tau", "fragments"):
        machines, opt, averager = make("slowcal", **RUNS[name])
        train(machines, opt, averager, range(14))
        assert_close(both[name], tensors(machines, opt))  # the sums grouped otherwise: not bitwise
        averager.close_round()
        assert_close(both[name + " closed"], tensors(machines, opt))


def test_overlapped_rounds_are_counted_apart_for_the_time_they_hide():
    """``overlapped_counts``: the rounds started overlapped (each a whole round's counts here, F = 1), not the
    blocking synchronisation that closes a round; saved and restored with the schedule."""
    machines, opt, averager = make("sgd", overlap_delay=1)
    train(machines, opt, averager, range(13))  # rounds start at 4, 8 and 12, each landing a step later
    one = 2 * DIM * 8 * 2 * (M - 1) / M  # a and b, float64, on the ring among M
    assert averager.overlapped_counts.syncs == 3 and averager.overlapped_counts.ring_bytes == 3 * one
    averager.close_round()  # lands, then one blocking synchronisation of the whole model
    assert averager.link_counts.syncs == 4 and averager.overlapped_counts.syncs == 3
    state = averager.state_dict()
    _, _, restored = make("sgd", overlap_delay=1)
    restored.load_state_dict(state)
    assert restored.overlapped_counts == averager.overlapped_counts


def test_a_round_closed_before_its_tau_steps_is_counted_with_the_steps_it_was_in_flight():
    """``short_rounds``: a round that ``close_round()`` lands after s < tau steps in flight can hide only those
    steps' compute; rounds that land on schedule are not in it. Saved and restored with the counts."""
    machines, opt, averager = make("sgd", K=8, overlap_delay=3)
    train(machines, opt, averager, range(10))  # round 1 starts at 8; closed after 2 of its 3 steps
    averager.close_round()
    train(machines, opt, averager, range(10, 16))  # round 2 starts at 16, closed at once (0 steps)
    averager.close_round()
    train(machines, opt, averager, range(16, 27))  # round 3 starts at 24 and lands on schedule at 27
    assert averager.overlapped_counts.syncs == 3 and averager.short_rounds == {2: 1, 0: 1}
    restored = make("sgd", K=8, overlap_delay=3)[2]
    restored.load_state_dict(averager.state_dict())
    assert restored.short_rounds == {2: 1, 0: 1}
    link, step = Link.parse("1Gbit/s,10ms"), 1e-3
    one = averager.overlapped_counts.seconds(link) / 3  # each round's seconds (> 3 steps' compute)
    assert one > 3 * step
    short = {s * step: n for s, n in averager.short_rounds.items()}
    # round 3 hides 3 steps, round 1 two, round 2 none
    assert hidden_seconds(averager.overlapped_counts, link, 3 * step, short) == pytest.approx(5 * step, rel=1e-15)


#: The gloo runs saved mid-flight: (optimizer, dtype, tau, F).
CHECKPOINT_RUNS = {"slowcal": ("slowcal", torch.float64, 2, 1), "diloco": ("diloco", torch.float32, 1, 2)}


def _checkpoint_worker(rank: int, init_file: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    ids = range(2 * rank, 2 * rank + 2)  # this process hosts machines 2 rank, 2 rank + 1
    results: dict[str, Any] = {}
    for name, (optimizer, dtype, tau, F) in CHECKPOINT_RUNS.items():
        options = {"K": K_SAVE, "overlap_delay": tau, "fragments": F, "machines": M // 2}
        uninterrupted = make(optimizer, dtype, **options)
        train(uninterrupted[0], uninterrupted[1], uninterrupted[2], range(END), machine_ids=ids)
        machines, opt, averager = make(optimizer, dtype, **options)
        _, stop = save_point(tau, F)
        train(machines, opt, averager, range(stop), machine_ids=ids)
        assert averager.engine.in_flight is not None
        own = os.path.join(out, f"{name}.{rank}.pt")  # each rank's machines differ mid-round: a file each
        torch.save(
            {"model": machines.state_dict(), "optimizer": opt.state_dict(), "averager": averager.state_dict()}, own
        )
        gathered = averager.gather_state_dict()  # a collective, mid-flight
        if rank == 0:
            torch.save(gathered, os.path.join(out, f"{name}.gathered.pt"))
        dist.barrier()
        train(machines, opt, averager, range(stop, END), machine_ids=ids)
        runs = [uninterrupted, (machines, opt, averager)]
        for source in ("own", "gathered"):
            saved = torch.load(own, weights_only=True)
            if source == "gathered":
                saved["averager"] = torch.load(os.path.join(out, f"{name}.gathered.pt"), weights_only=True)
                results[f"{name} gathered ranks"] = sorted(saved["averager"]["in_flight"]["ranks"])
            run = make(optimizer, dtype, **options)
            run[0].load_state_dict(saved["model"])
            run[1].load_state_dict(saved["optimizer"])
            run[2].load_state_dict(saved["averager"])
            train(run[0], run[1], run[2], range(stop, END), machine_ids=ids)
            runs.append(run)
        if rank == 1:  # rank 0's own state, without rank 1's round
            other = torch.load(os.path.join(out, f"{name}.0.pt"), weights_only=True)["averager"]
            try:
                make(optimizer, dtype, **options)[2].load_state_dict(other)
            except ValueError as error:
                results[f"{name} refused"] = str(error)
        results[name] = [everything(*run[:2]) for run in runs]
        for run in runs:
            run[2].close_round()
        results[name + " closed"] = [everything(*run[:2]) for run in runs]
    finish_rank(results, out, rank)


@pytest.mark.slow
def test_two_gloo_processes_resume_a_round_in_flight_bit_for_bit(tmp_path):
    """Two processes of two machines each save mid-flight (each its own file, and one gathered file); resumed
    from either, every rank ends with the bits of the run that never saved, before and after close_round()."""
    ranks = spawn_ranks(_checkpoint_worker, 2, str(tmp_path))
    for results in ranks:
        for name in CHECKPOINT_RUNS:
            assert results[f"{name} gathered ranks"] == [0, 1]
            for key in (name, name + " closed"):
                uninterrupted, *others = results[key]
                for other in others:
                    assert_same(other, uninterrupted)
    for name in CHECKPOINT_RUNS:  # DiLoCo's momentum buffers, per machine, are refused first
        assert f"{name} refused" not in ranks[0] and "the state holds rank(s) [0]" in ranks[1][f"{name} refused"]
    assert re.fullmatch(
        r"Cannot resume the round in flight \(it lands at step 10\): the state holds rank\(s\) \[0\] and this is "
        r"rank 1; save it with gather_state_dict\(\) on every rank, or every rank's state_dict\(\) in a file of its own",
        ranks[1]["slowcal refused"],
    )
    # The machines of the two ranks differ mid-round; the closed rounds leave one model on both.
    for name in CHECKPOINT_RUNS:
        first, second = (results[name + " closed"][0] for results in ranks)
        assert all(torch.equal(a[0], b[0]) for a, b in zip(first, second[:2]))


def test_the_overlapped_engine_lands_the_snapshots_average_plus_the_progress_since_and_counts_the_exact_round():
    """``OverlappedRound`` alone, behind the engines' seam: ``start`` takes the snapshot and counts what the exact
    round sends; the live tensors train on; ``land`` gives the snapshot's mean over the machines, which the merge
    makes avg + (live - snapshot); float64 reference by hand."""
    engine = OverlappedRound(ExactRound(2, 2, None, 1 << 20, False), delay=3)
    live = torch.tensor([[1.0, 2.0, 4.0], [3.0, -2.0, 0.5]], dtype=torch.float64)  # two machines stacked
    before = live.clone()
    sent = engine.start([(live, True)], None, step=8, fragment=0)
    assert sent == engine.inner.sent([(live, True)], None) and sent.bytes == 3 * 8  # one machine's payload
    assert engine.in_flight is not None and engine.in_flight.land_step == 11
    live += torch.tensor([[0.25, 0.0, -1.0], [0.5, 1.0, 0.0]], dtype=torch.float64)  # training goes on
    progress = live - before
    tensors, landing = engine.land(lambda: [(live, True)])
    assert engine.in_flight is None and tensors[0][0] is live
    expected_avg = before.mean(0, keepdim=True).expand_as(before)
    assert torch.equal(landing.result[0][0], expected_avg)
    landing.merge()
    assert torch.equal(live, expected_avg + progress)
