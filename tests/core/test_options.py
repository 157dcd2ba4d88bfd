"""``AveragingOptions``: every option alone, every pair that works or is refused (docs/communication.md's table,
row by row), refusals where the user constructs the averager or a strategy, and ranks that differ in any option."""

import dataclasses
import functools
import inspect
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lit_slowcal import (
    AdaptiveSlowcal,
    AveragingOptions,
    PeriodicAverager,
    PeriodicAveragingFabricStrategy,
    PeriodicAveragingStrategy,
    Scaffold,
    ShardedAveragingStrategy,
    SimulatedMachines,
    SlowcalSGD,
)
from lit_slowcal.compression import Code, Int4
from lit_slowcal.options import OPTION_NAMES
from tests.helpers import finish_rank, spawn_ranks, subprocess_env

OUTER = functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)
MOMENTUM = ("momentum_buffer",)

#: Every pair of options that is refused on its own (no optimizer or model needed): (id, settings, message start).
REFUSED_PAIRS = [
    ("fragments_not_dividing_k", {"sync_every": 6, "fragments": 4}, "Invalid fragments: 4 (must divide sync_every = 6)"),
    ("overlap_delay_of_a_whole_period", {"sync_every": 4, "fragments": 2, "overlap_delay": 2},
     "Invalid overlap_delay: 2 (must be < sync_every // fragments = 2"),
    ("compression_with_overlap_delay", {"sync_every": 4, "compression": "int8", "overlap_delay": 1},
     "Invalid compression: 'int8' with overlap_delay=1, fragments=1 (compressed rounds are blocking"),
    ("compression_with_fragments", {"sync_every": 4, "compression": "bf16", "fragments": 2},
     "Invalid compression: 'bf16' with overlap_delay=0, fragments=2 (compressed rounds are blocking"),
    ("error_feedback_without_compression", {"error_feedback": True},
     "Invalid error_feedback: True with compression=None (it applies to compressed rounds"),
    ("bucket_views_with_fragments", {"sync_every": 4, "fragments": 2, "bucket_views": True},
     "Invalid bucket_views: True with fragments=2 (those rounds send a fragment or a snapshot"),
    ("bucket_views_with_overlap_delay", {"sync_every": 4, "overlap_delay": 1, "bucket_views": True},
     "Invalid bucket_views: True with overlap_delay=1 (those rounds send a fragment or a snapshot"),
    ("bucket_views_with_state_every", {"sync_every": 2, "state_every": 3, "bucket_views": True},
     "Invalid bucket_views: True with state_every=3 (a round that skips the optimizer state would all-reduce part"),
]  # fmt: skip

#: Every pair that works (each runs a few rounds below): (id, settings).
WORKING_PAIRS = [
    ("participation_with_outer_optimizer", {"sync_every": 2, "participation": 1, "outer_optimizer": OUTER}),
    ("participation_with_compression", {"sync_every": 2, "participation": 0.5, "compression": "int8"}),
    ("participation_with_overlap", {"sync_every": 4, "participation": 1, "overlap_delay": 1, "fragments": 2}),
    ("participation_with_bucket_views", {"sync_every": 2, "participation": 1, "bucket_views": True}),
    ("outer_optimizer_with_compression", {"sync_every": 2, "outer_optimizer": OUTER, "compression": "bf16"}),
    ("outer_optimizer_with_overlap", {"sync_every": 4, "outer_optimizer": OUTER, "overlap_delay": 1, "fragments": 2}),
    ("outer_optimizer_with_bucket_views", {"sync_every": 2, "outer_optimizer": OUTER, "bucket_views": True}),
    ("compression_with_error_feedback_off", {"sync_every": 2, "compression": "int8", "error_feedback": False}),
    ("overlap_delay_with_fragments", {"sync_every": 4, "overlap_delay": 1, "fragments": 2}),
    ("average_state_with_compression", {"sync_every": 2, "average_state": ("momentum_buffer",), "compression": "int8"}),
    ("check_schedule_off_with_overlap", {"sync_every": 4, "check_schedule": False, "overlap_delay": 1}),
    ("bucket_cap_mb_with_bucket_views", {"sync_every": 2, "bucket_cap_mb": 1e-4, "bucket_views": True}),
    ("compression_with_bucket_views", {"sync_every": 2, "compression": "int8", "bucket_views": True}),
    ("state_every_with_compression", {"sync_every": 2, "state_every": 2, "average_state": MOMENTUM, "compression": "int8"}),
    ("state_every_with_participation", {"sync_every": 2, "state_every": 2, "average_state": MOMENTUM, "participation": 0.5}),
    ("state_every_with_outer_optimizer", {"sync_every": 2, "state_every": 2, "average_state": MOMENTUM, "outer_optimizer": OUTER}),
    ("state_every_with_overlap", {"sync_every": 4, "state_every": 2, "average_state": MOMENTUM, "overlap_delay": 1, "fragments": 2}),
]  # fmt: skip


def _one_line(error):
    text = str(error.value)
    assert "\n" not in text, text
    return text


@pytest.mark.parametrize("settings, message", [r[1:] for r in REFUSED_PAIRS], ids=[r[0] for r in REFUSED_PAIRS])
def test_a_refused_pair_is_refused_in_one_line_by_the_options_the_averager_and_every_strategy(settings, message):
    model = nn.Linear(3, 2)
    makers = {
        "AveragingOptions": lambda: AveragingOptions(**settings),
        "PeriodicAverager": lambda: PeriodicAverager(model, torch.optim.SGD(model.parameters(), lr=0.1), **settings),
        # Where the user constructs a strategy: nothing waits for fit.
        "PeriodicAveragingStrategy": lambda: PeriodicAveragingStrategy(**settings),
        "PeriodicAveragingFabricStrategy": lambda: PeriodicAveragingFabricStrategy(**settings),
        "ShardedAveragingStrategy": lambda: ShardedAveragingStrategy(**settings),
    }
    for name, make in makers.items():
        with pytest.raises(ValueError) as error:
            make()
        assert _one_line(error).startswith(message), (name, str(error.value))


@pytest.mark.parametrize("settings", [r[1] for r in WORKING_PAIRS], ids=[r[0] for r in WORKING_PAIRS])
def test_a_working_pair_runs_rounds_on_simulated_machines_and_lands_one_model(settings):
    torch.manual_seed(0)
    machines = SimulatedMachines(nn.Linear(3, 2), 4)
    optimizer = torch.optim.SGD(machines.parameters(), lr=0.1, momentum=0.5)
    averager = PeriodicAverager(machines, optimizer, options=AveragingOptions(**settings)).attach()
    x = torch.randn(4, 5, 3)
    for _ in range(2 * settings["sync_every"]):
        optimizer.zero_grad()
        machines(x).square().sum().backward()
        optimizer.step()
    averager.close_round()
    assert averager.num_syncs >= 2 and averager.bytes_communicated > 0
    weight = machines.weight.detach()
    assert torch.equal(weight, weight[:1].expand_as(weight))  # one model on every machine
    assert torch.isfinite(weight).all()


def test_options_are_one_value_built_once_and_replaced_with_their_checks():
    options = AveragingOptions(sync_every=4, compression="int8")
    assert AveragingOptions.build(options) is options
    assert AveragingOptions.build(options, sync_every=8) == dataclasses.replace(options, sync_every=8)
    assert options.average_state == () and AveragingOptions(average_state=["w"]).average_state == ("w",)
    with pytest.raises(ValueError) as error:
        dataclasses.replace(options, overlap_delay=1)  # replace checks the pair too
    assert _one_line(error).startswith("Invalid compression: 'int8' with overlap_delay=1")
    with pytest.raises(TypeError) as error:
        AveragingOptions.build(options, compresion="int8")
    assert _one_line(error).startswith("Invalid averaging option: 'compresion' (one of sync_every, average_state,")
    strategy = PeriodicAveragingStrategy(sync_every=4, options=options, participation=2)
    assert strategy.options == dataclasses.replace(options, participation=2)
    with pytest.raises(ValueError, match=r"^Invalid sync_every: 6 \(must be a multiple of fragments = 4"):
        PeriodicAveragingStrategy(sync_every=4, fragments=4).sync_every = 6


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"participation": 0}, "Invalid participation: 0 (must be an integer >= 1)"),
        ({"participation": 1.5}, "Invalid participation: 1.5 (a number of machines >= 1, or a fraction in (0, 1])"),
        ({"participation_seed": 2**63}, "Invalid participation_seed: 9223372036854775808 (must be an integer >= 0 and < 2**63)"),
        ({"bucket_views": 1}, "Invalid bucket_views: 1 (True or False)"),
        ({"check_schedule": "yes"}, "Invalid check_schedule: 'yes' (True or False)"),
        ({"compression": "int3"}, "Invalid compression: 'int3' (None, one of 'bf16', 'int8', 'int4', 'int2', 'topk:"),
        ({"error_feedback": "on", "compression": "int8"}, "Invalid error_feedback: 'on' (True, False, or None"),
        ({"average_state": "w"}, "Invalid average_state: 'w' (a sequence of state key names)"),
        ({"bucket_cap_mb": 0}, "Invalid bucket_cap_mb: 0 (must be a finite number > 0)"),
        ({"overlap_delay": -1}, "Invalid overlap_delay: -1 (must be an integer >= 0)"),
    ],
)  # fmt: skip
def test_every_bad_value_is_one_line_at_construction_of_every_strategy(settings, message):
    for make in (
        AveragingOptions,
        PeriodicAveragingStrategy,
        PeriodicAveragingFabricStrategy,
        ShardedAveragingStrategy,
    ):
        with pytest.raises(ValueError) as error:
            make(**settings)
        assert _one_line(error).startswith(message), (make, str(error.value))


def test_the_rules_that_need_the_optimizer_or_the_model_refuse_where_the_averager_is_built():
    w = nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError) as error:
        PeriodicAverager(nn.Linear(1, 1), Scaffold([w], lr=0.1), 4, overlap_delay=1)
    assert _one_line(error).startswith("Invalid overlap_delay: 1 (Scaffold's post_sync takes")
    with pytest.raises(ValueError) as error:
        PeriodicAverager(nn.Linear(1, 1), Scaffold([w], lr=0.1), 2, participation=1)
    assert _one_line(error).startswith("Invalid participation: 1 (Scaffold keeps per-machine state")
    with pytest.raises(ValueError) as error:  # its post_sync would overwrite the outer step: refused, not discarded
        PeriodicAverager(nn.Linear(1, 1), AdaptiveSlowcal([w], lr=0.1, beta=0.5), 2, outer_optimizer=OUTER)
    assert _one_line(error).startswith("Invalid outer_optimizer: partial(torch.optim.sgd.SGD, lr=0.7")
    with pytest.raises(ValueError) as error:
        PeriodicAverager(nn.Linear(1, 1), AdaptiveSlowcal([w], lr=0.1, beta=0.5), 4, overlap_delay=1)
    assert _one_line(error).startswith("Invalid overlap_delay: 1 (AdaptiveSlowcal's post_sync")
    for optimizer in (Scaffold([w], lr=0.1), AdaptiveSlowcal([w], lr=0.1, beta=0.5)):  # hooks fed every round's state
        with pytest.raises(ValueError) as error:
            PeriodicAverager(nn.Linear(1, 1), optimizer, 2, state_every=2)
        name = type(optimizer).__name__
        assert _one_line(error).startswith(f"Invalid state_every: 2 ({name}'s pre_sync/post_sync rebuild its state")
    machines = SimulatedMachines(nn.Linear(3, 2), 2)
    loose = nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.SGD([*machines.parameters(), loose], lr=0.1)
    with pytest.raises(ValueError) as error:
        PeriodicAverager(machines, optimizer, 2, compression="int8")
    assert _one_line(error).startswith("Invalid compression: 'int8' with 2 simulated machines per process and 1")


def test_adaptive_slowcal_with_beta_one_overlaps_and_takes_an_outer_optimizer_as_slowcal_sgd_does():
    """Its sync hooks do nothing with beta = 1: overlapped rounds and an outer step work, and its parameters
    follow SlowcalSGD's (the same x and w recursion with the AdaGrad/Adam normalisation off is not comparable, so
    the check is that the overlapped run equals the same run's plain-loop replay)."""
    runs = []
    for _ in range(2):
        torch.manual_seed(0)
        machines = SimulatedMachines(nn.Linear(3, 1), 2)
        optimizer = AdaptiveSlowcal(machines.parameters(), lr=0.05)
        assert optimizer.post_sync is None
        averager = PeriodicAverager(machines, optimizer, 4, overlap_delay=1, outer_optimizer=OUTER).attach()
        for _ in range(9):
            optimizer.zero_grad()
            machines(torch.randn(2, 6, 3)).square().mean().backward()
            optimizer.step()
        averager.close_round()
        runs.append(machines.weight.detach().clone())
    assert averager.num_syncs == 3 and torch.equal(*runs) and torch.isfinite(runs[0]).all()


def test_the_strategies_list_every_option_by_name_for_lightning_cli_declared_once():
    for cls in (PeriodicAveragingStrategy, PeriodicAveragingFabricStrategy, ShardedAveragingStrategy):
        parameters = inspect.signature(cls.__init__).parameters
        assert set(OPTION_NAMES) | {"options"} <= set(parameters), cls
        assert parameters["compression"].default is None and parameters["sync_every"].default is None
    # K given in the options is kept: the strategies' sync_every is None unless given.
    assert PeriodicAveragingStrategy(options=AveragingOptions(sync_every=16)).sync_every == 16
    assert PeriodicAveragingFabricStrategy(options=AveragingOptions(sync_every=16), participation=2).sync_every == 16
    assert ShardedAveragingStrategy(options=AveragingOptions(sync_every=16)).sync_every == 16
    assert PeriodicAveragingStrategy().sync_every == 1 and PeriodicAveragingStrategy(16).sync_every == 16


def test_a_participation_count_parses_as_a_count_whatever_union_the_process_made_first():
    """A process that imported Lightning before the library (Lightning makes a float-first Union, which typing's cache
    hands back for an equal ``Optional[Union[int, float]]``) still parses ``participation: 2`` as 2 machines, not the
    fraction 2.0."""
    code = (
        "import lightning\n"
        "from jsonargparse import ArgumentParser\n"
        "from lit_slowcal import AveragingOptions\n"
        "parser = ArgumentParser()\n"
        "parser.add_argument('--options', type=AveragingOptions)\n"
        "for given in ('2', '0.5'):\n"
        "    value = parser.parse_args([f'--options.participation={given}']).options.participation\n"
        "    print(type(value).__name__, value)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=subprocess_env()
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split("\n")[:2] == ["int 2", "float 0.5"]
    fields = [f.name for f in dataclasses.fields(AveragingOptions) if f.init]
    assert list(OPTION_NAMES) == fields and "compression" in fields and "error_feedback" in fields


# -- ranks that differ in one option ------------------------------------------------------------

#: Per option: (the settings both ranks share, rank 0's value, rank 1's value, the readable values).
DIFFERING = {
    "sync_every": ({}, 2, 4, ("2", "4")),
    "average_state": ({}, (), ("momentum_buffer",), ("()", "('momentum_buffer',)")),
    "bucket_cap_mb": ({}, 25.0, 1.0, ("25.0", "1.0")),
    "check_schedule": ({}, True, False, ("True", "False")),
    "outer_optimizer": ({}, None, OUTER, ("None", "partial(torch.optim.sgd.SGD, lr=0.7, momentum=0.9, nesterov=True)")),
    "participation": ({}, None, 1, ("None", "1")),
    "participation_seed": ({}, 0, 3, ("0", "3")),
    "compression": ({}, None, "int8", ("None", "Int8(block_size=256)")),
    "error_feedback": ({"compression": "int8"}, None, False, ("None", "False")),
    "overlap_delay": ({"sync_every": 4}, 0, 1, ("0", "1")),
    "fragments": ({"sync_every": 4}, 1, 2, ("1", "2")),
    "bucket_views": ({}, False, True, ("False", "True")),
    "state_every": ({}, 1, 3, ("1", "3")),
}  # fmt: skip


def _differing_worker(rank, init_file, out):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    outcomes = {}
    for name, (shared, *values, _) in DIFFERING.items():
        model = nn.Linear(4, 3)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        averager = PeriodicAverager(model, optimizer, options=AveragingOptions(**{**shared, name: values[rank]}))
        try:
            averager.broadcast()  # where a run starts: before the first step
            outcomes[name] = ("no error", "")
        except RuntimeError as err:
            outcomes[name] = ("RuntimeError", str(err))
    # An outer optimizer built by a closure: the same text on both ranks, another learning rate.
    model = nn.Linear(4, 3)
    lr = (0.7, 0.1)[rank]
    averager = PeriodicAverager(model, torch.optim.SGD(model.parameters(), lr=0.1), 2,
                                outer_optimizer=lambda params: torch.optim.SGD(params, lr=lr))  # fmt: skip
    try:
        averager.broadcast()
        outcomes["outer closure"] = ("no error", "")
    except RuntimeError as err:
        outcomes["outer closure"] = ("RuntimeError", str(err))
    # Bucket views with participation: the same bits as the plain weighted average, each of 2 x 2 machines
    # weighted where it lies (one of two processes' machines takes part in some rounds, both in others).
    for views, code in ((False, None), (True, None), (False, "int8"), (True, "int8")):
        torch.manual_seed(rank)
        model = nn.ModuleList([nn.Linear(300, 500), nn.Linear(5, 3)])  # a tensor reduced alone, and small ones
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        averager = PeriodicAverager(
            model, optimizer, 2, participation=1, participation_seed=4, bucket_views=views, compression=code
        )
        averager.attach()
        for _ in range(6):
            optimizer.zero_grad()
            (model[0](torch.randn(4, 300)).square().mean() + model[1](torch.randn(4, 5)).square().mean()).backward()
            optimizer.step()
        outcomes[f"bucket_views={views},{code}"] = [p.detach().clone() for p in model.parameters()]
        outcomes[f"weights={views}"] = [averager.participant_weights(r).tolist() for r in range(3)]
    finish_rank(outcomes, out, rank)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    return spawn_ranks(_differing_worker, 2, str(tmp_path_factory.mktemp("options")))


@pytest.mark.slow
@pytest.mark.parametrize("code", [None, "int8"])
def test_bucket_views_with_participation_give_the_bits_of_the_plain_weighted_average(two_ranks, code):
    """And with int8 compression, whose first round goes exactly through the views, the others coded."""
    weights = two_ranks[0]["weights=False"]
    assert sorted(map(tuple, weights)) != [weights[0]] * 3 and all(sorted(w) == [0.0, 1.0] for w in weights)
    for outcomes in two_ranks:
        plain, views = outcomes[f"bucket_views=False,{code}"], outcomes[f"bucket_views=True,{code}"]
        assert all(torch.equal(a, b) for a, b in zip(plain, views))
    first, second = (outcomes[f"bucket_views=True,{code}"] for outcomes in two_ranks)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    exact, coded = (two_ranks[0][f"bucket_views=True,{c}"] for c in (None, "int8"))
    assert not all(torch.equal(a, b) for a, b in zip(exact, coded))  # the coded rounds did run


@pytest.mark.slow
def test_ranks_that_differ_in_any_option_stop_before_the_first_step_in_one_line_naming_it_and_both_values(two_ranks):
    """Each option, one rank's value against the other's: one line on every rank, nothing hangs (a rank with
    compression and one without waited forever at the first synchronisation before)."""
    assert set(DIFFERING) == set(OPTION_NAMES)  # a new option is checked here by being declared
    for outcomes in two_ranks:
        for name, (_, _, _, (zero, one)) in DIFFERING.items():
            kind, message = outcomes[name]
            assert kind == "RuntimeError" and "\n" not in message, (name, message)
            assert message.startswith("PeriodicAverager: the ranks were set up differently: "), message
            assert f"{name} (rank 0: {zero}, rank 1: {one})" in message, (name, message)
        # Closures read alike whatever they capture: the outer optimizer built is compared (the ranks diverged).
        kind, message = outcomes["outer closure"]
        assert kind == "RuntimeError" and "\n" not in message, message
        assert "the outer optimizer (rank 0: torch.optim.sgd.SGD[{" in message and "'lr': 0.7" in message, message
        assert "'lr': 0.1" in message, message


def test_momentum_state_on_a_slowcal_run_is_the_declared_w_only():
    """``average_state`` adds to the declared keys (SlowcalSGD's w), once each."""
    model = nn.Linear(2, 1)
    averager = PeriodicAverager(model, SlowcalSGD(model.parameters(), lr=0.1), 2, average_state=("w", "extra"))
    assert averager._averaged_keys() == ("w", "extra")


@pytest.mark.parametrize(
    "settings",
    [
        {"sync_every": 4},
        {"sync_every": 4, "compression": "int8"},
        {"sync_every": 4, "compression": "bf16", "participation": 2},
        {"sync_every": 4, "fragments": 2},
        {"sync_every": 4, "fragments": 4, "overlap_delay": 0},
        {"sync_every": 4, "overlap_delay": 1, "fragments": 2},
        {"sync_every": 4, "overlap_delay": 2},
    ],
    ids=["exact", "int8", "bf16_participation", "fragments", "four_fragments", "overlapped_fragments", "overlapped"],
)
def test_the_counts_agree_for_every_kind_of_round(settings):
    """``bytes_per_sync() x num_syncs == bytes_communicated`` (and the floats) after whole periods of K steps, for
    the exact, compressed, fragmented and overlapped rounds alike (with F fragments this was F times off), and a
    schedule resumed at that step counts the same."""
    torch.manual_seed(0)
    machines = SimulatedMachines(nn.Sequential(nn.Linear(5, 4), nn.Linear(4, 3)), 4)
    optimizer = torch.optim.SGD(machines.parameters(), lr=0.1)
    averager = PeriodicAverager(machines, optimizer, options=AveragingOptions(**settings)).attach()
    averager.broadcast()  # the compressed rounds' anchors: every round compressed
    for _ in range(3 * settings["sync_every"]):
        optimizer.zero_grad()
        machines(torch.randn(4, 2, 5)).square().sum().backward()
        optimizer.step()
    assert averager.num_syncs == 3 * settings.get("fragments", 1)
    assert averager.bytes_per_sync() * averager.num_syncs == pytest.approx(averager.bytes_communicated, rel=1e-12)
    assert averager.floats_per_sync() * averager.num_syncs == pytest.approx(averager.floats_communicated, rel=1e-12)
    floats = sum(p[0].numel() for p in machines.parameters())
    assert averager.floats_communicated == pytest.approx(3 * floats * averager.participants / 4, rel=1e-12)
    resumed = PeriodicAverager(machines, optimizer, options=AveragingOptions(**settings), start_step=averager.steps)
    assert resumed.bytes_communicated == pytest.approx(averager.bytes_communicated, rel=1e-12)
    assert resumed.link_counts.state_dict() == pytest.approx(averager.link_counts.state_dict(), rel=1e-12)
    assert (resumed.overlapped_counts == averager.overlapped_counts) and resumed.floats_communicated == pytest.approx(
        averager.floats_communicated, rel=1e-12
    )


def test_an_option_set_on_the_averager_is_refused_not_ignored():
    """Only K may change once the averager built its engine: an option set as an attribute, or options replaced
    with another compression, overlap, bucket views or participation, were ignored (the engine stayed exact and
    blocking; Scaffold ran with participation, a pair refused at construction); now one line each."""
    model = nn.Linear(2, 1)
    averager = PeriodicAverager(model, torch.optim.SGD(model.parameters(), lr=0.1), 2)
    with pytest.raises(AttributeError, match=r"^PeriodicAverager.check_schedule is an option, fixed when it was built"):
        averager.check_schedule = False
    for name, value in (("compression", "int8"), ("overlap_delay", 1), ("bucket_views", True), ("fragments", 2)):
        with pytest.raises(AttributeError) as error:
            averager.options = dataclasses.replace(averager.options, **{name: value})
        assert _one_line(error).startswith(f"Invalid options: {name}={value!r} (it is "), name
        assert averager.compressed is None and type(averager.engine).__name__ == "ExactRound"
    coded = PeriodicAverager(model, torch.optim.SGD(model.parameters(), lr=0.1), 2, compression="int4")
    coded.options = dataclasses.replace(coded.options, compression=Int4())  # the same code spelt otherwise: kept
    with pytest.raises(TypeError, match=r"^Invalid options: 'junk' \(an AveragingOptions\)"):
        averager.options = "junk"
    averager.options = dataclasses.replace(averager.options, sync_every=4)  # K may change: it replaces the options
    averager.sync_every = 6
    assert averager.options.sync_every == averager.sync_every == 6
    scaffold_model = nn.Linear(2, 1)
    scaffold = PeriodicAverager(scaffold_model, Scaffold(scaffold_model.parameters(), lr=0.1), 2)
    with pytest.raises(AttributeError, match=r"^Invalid options: participation=2 "):
        scaffold.options = dataclasses.replace(scaffold.options, participation=2)


def test_a_strategys_options_are_replaced_before_fit_and_an_option_attribute_is_refused():
    strategy = PeriodicAveragingStrategy(sync_every=4)
    strategy.options = dataclasses.replace(strategy.options, compression="int8")  # before fit builds averagers
    assert strategy.options.compressor is not None
    with pytest.raises(AttributeError, match=r"^PeriodicAveragingStrategy.compression is an option, fixed when"):
        strategy.compression = None


@pytest.mark.parametrize("make", [PeriodicAveragingStrategy, PeriodicAveragingFabricStrategy])
def test_a_misspelt_strategy_keyword_is_refused_naming_the_option_not_kept_for_a_ddp_wrapper(make):
    """``compresion="int8"`` went to DDP's wrapper arguments, which these strategies never build: float32 was sent."""
    with pytest.raises(TypeError) as error:
        make(sync_every=4, compresion="int8")
    assert _one_line(error).startswith(
        f"{make.__name__}() got an unexpected keyword argument 'compresion' (did you mean 'compression'?"
    )
    make(sync_every=4, process_group_backend="gloo")  # the Lightning strategy's own arguments pass


def test_average_state_given_as_an_iterator_keeps_its_keys():
    """A generator was read by the check and stored empty: its keys silently never averaged."""
    options = AveragingOptions(average_state=(k for k in ("momentum_buffer", "exp_avg")))
    assert options.average_state == ("momentum_buffer", "exp_avg")


def test_a_compressor_is_checked_when_given_and_equal_compressors_make_equal_options():
    """An incomplete ``Compressor`` or one with ``block_size=0`` failed inside the second round
    (``NotImplementedError``, ``ZeroDivisionError``); equal codes made unequal options."""
    from lit_slowcal.compression import Compressor, Int8

    class Sign(Compressor):
        def encode(self, blocks):
            return blocks.sign(), None

    with pytest.raises(ValueError) as error:
        AveragingOptions(compression=Sign())
    assert _one_line(error).startswith(
        "Invalid compression: Sign(block_size=256) (a Compressor defines encode and decode; decode missing)"
    )
    with pytest.raises(ValueError, match=r"^Invalid compression: Compressor\(block_size=256\) "):
        AveragingOptions(compression=Compressor())

    class Zero(Int8):
        block_size = 0

    with pytest.raises(ValueError, match=r"^Invalid block_size: 0 \(must be an integer >= 1\)"):
        AveragingOptions(compression=Zero.__new__(Zero))
    assert AveragingOptions(compression=Int8()) == AveragingOptions(compression="int8")
    assert Int8(128) != Int8() and hash(Int8()) == hash(Int8())


class _Scaled(Code):
    """A code whose decode, reduce or message size can be made wrong (``bad``)."""

    lossy = False

    def __init__(self, bad):
        self.bad = bad

    def encode(self, change):
        return change.clone()

    def decode(self, message, numel, dtype):
        return message[:1].to(dtype) if self.bad == "decode" else message.to(dtype)

    def reduce(self, messages, numel, dtype):
        mean = torch.stack(messages).to(dtype).mean(0)
        return mean[:1] if self.bad == "reduce" else mean

    def message_bytes(self, numel, dtype):
        return {"negative": -5, "nan": float("nan"), "float": 2.5}.get(
            self.bad, numel * 2
        )  # smaller than float32: coded


@pytest.mark.parametrize(
    "bad, message",
    [
        ("decode", "Invalid compression: _Scaled(bad='decode').decode returned shape (1,), torch.float32 for 4 values"),
        ("reduce", "Invalid compression: _Scaled(bad='reduce').reduce returned shape (1,), torch.float32 for 4 values"),
        ("negative", "Invalid _Scaled.message_bytes(4, torch.float32): -5 (must be an integer >= 0)"),
        ("nan", "Invalid _Scaled.message_bytes(4, torch.float32): nan (must be an integer >= 0)"),
        ("float", "Invalid _Scaled.message_bytes(4, torch.float32): 2.5 (must be an integer >= 0)"),
    ],
)
def test_a_codes_wrong_shape_or_byte_count_is_one_line_not_broadcast_into_the_model(bad, message):
    """A one-value decode or reduce was broadcast over the tensor (the run went on with wrong weights); a
    negative, NaN or fractional message size went into the counts."""
    model = SimulatedMachines(nn.Linear(2, 2), 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    averager = PeriodicAverager(model, optimizer, 1, compression=_Scaled(bad), error_feedback=bad == "decode")
    averager.sync()  # the first round anchors every tensor
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    with pytest.raises(ValueError) as error:
        averager.sync()
    assert _one_line(error).startswith(message)


def test_a_code_is_checked_when_given_and_compared_across_ranks_with_its_settings():
    class Half(Code):
        def encode(self, change):
            return change

    with pytest.raises(ValueError) as error:
        AveragingOptions(compression=Half())
    assert _one_line(error).startswith("Invalid compression: Half() (a Code defines encode, decode and message_bytes;")

    class Top(Code):
        def __init__(self, k):
            self.k = k

        encode = decode = message_bytes = lambda *a: None

    one, two = AveragingOptions(compression=Top(1)).agreement(), AveragingOptions(compression=Top(2)).agreement()
    assert one["compression"] != two["compression"] and one["compression"][1].endswith("Top(k=1)")


def test_compression_of_a_complex_tensor_is_refused_not_silently_made_real():
    """A compressed round drops a complex tensor's imaginary part (a mean of 2+2j landed as 2+0j): refused."""
    model = nn.Linear(2, 2).to(torch.complex64)
    with pytest.raises(ValueError) as error:
        PeriodicAverager(model, torch.optim.SGD(model.parameters(), lr=0.1), 2, compression="int8")
    assert _one_line(error).startswith("Invalid compression: 'int8' with a complex averaged tensor (of shape (2, 2)")
    PeriodicAverager(model, torch.optim.SGD(model.parameters(), lr=0.1), 2)  # the exact average takes it


def test_a_misspelt_average_state_key_is_refused_at_the_first_round_naming_the_optimizers_keys():
    """``average_state=("momentum_bufer",)`` was never averaged, silently: the machines' momenta stayed apart."""
    model = SimulatedMachines(nn.Linear(2, 1), 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    averager = PeriodicAverager(model, optimizer, 2, average_state=("momentum_bufer",)).attach()
    averager.sync()  # no state yet: nothing to check against
    model(torch.randn(2, 3, 2)).sum().backward()
    optimizer.step()
    model(torch.randn(2, 3, 2)).sum().backward()
    with pytest.raises(ValueError) as error:
        optimizer.step()  # the second step's round
    assert _one_line(error) == (
        "Invalid average_state: 'momentum_bufer' (no parameter's SGD state holds it; its state keys: momentum_buffer)"
    )
    good = PeriodicAverager(model, optimizer, 2, average_state=("momentum_buffer",))
    good.sync()
    for p in model.parameters():
        momentum = optimizer.state[p]["momentum_buffer"]
        assert torch.equal(momentum[0], momentum[1])


def test_numpys_integers_are_integers_and_stored_as_int():
    """A grid written with numpy (``np.int64(16)``) was refused as not an integer."""
    import numpy as np

    options = AveragingOptions(sync_every=np.int64(16), fragments=np.int32(2), overlap_delay=np.int64(1))
    assert (options.sync_every, options.fragments, options.overlap_delay) == (16, 2, 1)
    assert all(type(v) is int for v in (options.sync_every, options.fragments, options.overlap_delay))
    with pytest.raises(
        ValueError, match=r"^Invalid sync_every: np.True_ \(must be an integer >= 1\)|^Invalid sync_every: True"
    ):
        AveragingOptions(sync_every=np.True_)


def test_a_trainer_fit_refuses_an_optimizer_pair_before_the_sanity_check_and_any_step():
    """The rules that need the optimizer fired where fit built the averagers (on_train_start), after the sanity
    check's validation had run; now in the strategy's set-up, before anything runs."""
    import lightning.pytorch as pl

    seen = []

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(2, 1)

        def training_step(self, batch, batch_idx):
            seen.append("train")
            return self.layer(batch).sum()

        def validation_step(self, batch, batch_idx):
            seen.append("validation")

        def configure_optimizers(self):
            return Scaffold(self.parameters(), lr=0.1)

    data = torch.utils.data.DataLoader(torch.randn(8, 2), batch_size=2)
    trainer = pl.Trainer(
        strategy=PeriodicAveragingStrategy(sync_every=2, participation=1), accelerator="cpu", devices=1,
        max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    with pytest.raises(ValueError) as error:
        trainer.fit(Module(), train_dataloaders=data, val_dataloaders=data)
    assert _one_line(error).startswith("Invalid participation: 1 (Scaffold keeps per-machine state")
    assert seen == []
