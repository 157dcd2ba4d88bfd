"""The link model (lit_slowcal.link) and the byte counts every averager keeps, against values computed by
hand here: parsing, the ring formula, the main job's counts (SLowcal-SGD, M = K = 16, 235 syncs, 7,850
parameters), float64, partial participation, two processes, a resumed run, and the DDP reference."""

import json
import math

import pytest
import torch
from test_averaging import run_ranks
from torch import nn

from lit_slowcal import Link, LinkCounts, PeriodicAverager, SimulatedMachines, SlowcalSGD
from lit_slowcal.link import compare, ddp_counts, payload_bytes, ring_bytes_sent, ring_hops

# -- parsing --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, bandwidth, latency",
    [
        ("8bit/s,1s", 1.0, 1.0),
        ("8Kbit/s,1ms", 1e3, 1e-3),
        ("8Mbit/s,1us", 1e6, 1e-6),
        ("10Gbit/s,1ms", 1.25e9, 1e-3),
        ("1Gbit/s,10ms", 1.25e8, 1e-2),
        ("100Gbit/s,10us", 1.25e10, 1e-5),
        ("1Tbit/s,1ns", 1.25e11, 1e-9),
        ("5B/s,2µs", 5.0, 2e-6),  # the micro sign
        ("5KB/s,2μs", 5e3, 2e-6),  # the Greek mu
        ("5MB/s,0s", 5e6, 0.0),
        ("25GB/s,2us", 2.5e10, 2e-6),
        ("2TB/s,3ms", 2e12, 3e-3),
        (" 1.5e3 Mbit/s , .5ns ", 1.875e8, 5e-10),  # spaces, exponents, a leading point
    ],
)
def test_every_unit_parses_to_bytes_per_second_and_seconds(text, bandwidth, latency):
    link = Link.parse(text)
    assert (link.bandwidth, link.latency) == (bandwidth, latency)
    assert Link.parse(str(link)) == link


@pytest.mark.parametrize(
    "text",
    ["10Gb/s,1ms", "10gbit/s,1ms", "10Gbit/s", "10Gbit/s,1", "10Gbit/s,1min", "0Gbit/s,1ms", "-1Gbit/s,1ms",
     "10Gbit/s,-1ms", "1e999Gbit/s,1ms", "Gbit/s,1ms", "10Gbit/s;1ms", "", "10 Gbit/s 1ms"],
)  # fmt: skip
def test_anything_else_is_refused_in_one_line_naming_the_text_and_what_is_allowed(text):
    with pytest.raises(ValueError) as error:
        Link.parse(text)
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith(f"Invalid link: {text!r} (")
    for unit in ("bit/s", "Gbit/s", "Tbit/s", "B/s", "GB/s", "TB/s", " s,", "ms", "us", "µs", "ns"):
        assert unit in message


def test_a_link_refuses_a_bandwidth_of_zero_and_a_negative_latency():
    with pytest.raises(ValueError, match=r"^Invalid bandwidth: 0 \(must be a finite number > 0\)$"):
        Link(0, 1e-3)
    with pytest.raises(ValueError, match=r"^Invalid latency: -1 \(must be a finite number >= 0\)$"):
        Link(1e9, -1)
    with pytest.raises(ValueError, match="Invalid link: None"):
        Link.parse(None)


def test_str_round_trips_through_parse_in_the_units_written():
    for text in ("10Gbit/s,1ms", "1Gbit/s,10ms", "100Gbit/s,10us", "25GB/s,2us", "1Tbit/s,0s"):
        assert str(Link.parse(text)) == text
    assert str(Link.parse("1e3Mbit/s,0.5ns")) == "1Gbit/s,0.5ns"
    assert str(Link.parse("5KB/s,2µs")) == "5KB/s,2us"
    for link in (Link(1 / 3, 1 / 7), Link(1.25e9, 1e-3), Link(7.0, 0.0), Link(1e-300, 1e300), Link(3e17, -0.0)):
        assert Link.parse(str(link)) == link, str(link)


# -- the ring formula -----------------------------------------------------------------------------


def test_the_ring_formula_against_hand_values():
    link = Link.parse("10Gbit/s,1ms")  # 1.25e9 bytes/s, 1e-3 s
    # P = 1: nothing to send, no latency.
    assert ring_bytes_sent(62_800, 1) == 0 and ring_hops(1) == 0 and link.all_reduce_seconds(62_800, 1) == 0
    assert link.all_reduce_seconds(62_800, 0) == 0
    # P = 2: 2 hops, every participant sends 2 * 1/2 * n = n.
    assert ring_bytes_sent(62_800, 2) == 62_800 and ring_hops(2) == 2
    assert link.all_reduce_seconds(62_800, 2) == pytest.approx(2 * 1e-3 + 62_800 / 1.25e9, rel=1e-15)
    # P = 16: 30 hops, 2 * 15/16 * 62,800 = 117,750 bytes.
    assert ring_bytes_sent(62_800, 16) == 117_750 and ring_hops(16) == 30
    assert link.all_reduce_seconds(62_800, 16) == pytest.approx(0.030 + 117_750 / 1.25e9, rel=1e-15)
    assert Link(1000.0, 0.5).all_reduce_seconds(1000, 2) == 2.0  # 2 * 0.5 s + 1000 B / 1000 B/s


def test_counts_seconds_equal_the_sum_of_every_syncs_all_reduce_seconds():
    link = Link.parse("1Gbit/s,10ms")
    syncs = [(62_800, 16), (100, 3), (4_000_000, 2), (8, 1), (12_345, 7)] * 3
    counts = sum((LinkCounts.of_syncs(n, p) for n, p in syncs), LinkCounts())
    assert counts.syncs == 15
    assert counts.payload_bytes == 3 * (62_800 + 100 + 4_000_000 + 8 + 12_345)
    assert counts.ring_hops == 3 * (30 + 4 + 2 + 0 + 12)
    assert counts.seconds(link) == pytest.approx(sum(link.all_reduce_seconds(n, p) for n, p in syncs), rel=1e-12)
    assert LinkCounts.of_syncs(62_800, 16, syncs=235) == LinkCounts(235, 235 * 62_800, 235 * 117_750.0, 235 * 30)
    assert LinkCounts(check_bytes=152).seconds(link) == 0  # the checks are counted apart
    assert LinkCounts.from_state_dict(counts.state_dict()) == counts
    assert LinkCounts.from_state_dict({}) == LinkCounts()


def test_payload_bytes_are_one_machines_slice_in_the_dtype_sent():
    tensors = [
        (torch.zeros(4, 3, dtype=torch.complex64), True),  # stacked: one machine's 3 values, 8 bytes each
        (torch.zeros(5, dtype=torch.float16), False),  # 5 values, 2 bytes each
        (torch.zeros(2, 2, dtype=torch.float64), False),  # 4 values, 8 bytes each
    ]
    assert payload_bytes(tensors) == 3 * 8 + 5 * 2 + 4 * 8


# -- the averager's counts ------------------------------------------------------------------------


def _main_job():
    """SLowcal-SGD on 16 simulated machines of nn.Linear(784, 10): 7,850 parameters, x and w in float32."""
    torch.manual_seed(0)
    machines = SimulatedMachines(nn.Linear(784, 10), 16)
    optimizer = SlowcalSGD(machines.parameters(), lr=0.1)
    for p in machines.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()  # SlowcalSGD holds its w from the first step on
    return machines, optimizer


def test_the_main_job_by_hand():
    """M = K = 16, 235 syncs of x and w: 2 * 7,850 * 4 = 62,800 bytes a sync."""
    machines, optimizer = _main_job()
    averager = PeriodicAverager(machines, optimizer, sync_every=16)
    assert averager.bytes_per_sync() == 62_800
    for _ in range(235 * 16):
        averager.step()
    assert averager.num_syncs == 235 and averager.steps == 3_760
    link = Link.parse("10Gbit/s,1ms")
    # Per sync a machine sends 2 * 15/16 * 62,800 = 117,750 bytes on the ring, in 2 * 15 = 30 hops.
    assert averager.link_counts == LinkCounts(
        syncs=235, payload_bytes=14_758_000, ring_bytes=27_671_250.0, ring_hops=7_050, check_bytes=0
    )
    assert averager.bytes_communicated == 14_758_000 and averager.floats_communicated == 235 * 15_700
    # 7,050 * 1 ms + 27,671,250 B / 1.25e9 B/s = 7.05 s + 0.022137 s.
    assert averager.link_counts.seconds(link) == pytest.approx(7.072137, rel=1e-12)
    assert averager.link_counts.seconds(link) == pytest.approx(235 * link.all_reduce_seconds(62_800, 16), rel=1e-12)
    # DDP: 3,760 all-reduces of 7,850 float32 gradients (31,400 bytes) among 16:
    # 2 * 15/16 * 31,400 = 58,875 bytes and 30 hops a step.
    ddp = averager.ddp_counts()
    assert ddp == LinkCounts(
        syncs=3_760, payload_bytes=118_064_000, ring_bytes=221_370_000.0, ring_hops=112_800, check_bytes=0
    )
    assert ddp == ddp_counts(31_400, 3_760, 16)
    assert ddp.seconds(link) == pytest.approx(112.8 + 0.177096, rel=1e-12)
    bytes_ratio, seconds_ratio = compare(averager.link_counts, ddp, link)
    assert bytes_ratio == 8.0  # x and w every 16 steps against one gradient every step
    assert seconds_ratio == pytest.approx(112.977096 / 7.072137, rel=1e-12)


def test_a_float64_run_sends_8_bytes_a_value():
    torch.manual_seed(0)
    machines = SimulatedMachines(nn.Linear(3, 2).double(), 4)  # 8 values a machine
    averager = PeriodicAverager(machines, torch.optim.SGD(machines.parameters(), lr=0.1), sync_every=1)
    for _ in range(5):
        averager.step()
    # 8 * 8 = 64 bytes a sync; P = 4: 2 * 3/4 * 64 = 96 bytes and 6 hops.
    assert averager.link_counts == LinkCounts(syncs=5, payload_bytes=320, ring_bytes=480.0, ring_hops=30)
    assert averager.bytes_communicated == 320 and averager.floats_communicated == 40
    assert averager.ddp_counts() == LinkCounts(syncs=5, payload_bytes=320, ring_bytes=480.0, ring_hops=30)


def test_partial_participation_counts_s_participants_on_the_ring_and_s_over_m_per_machine():
    torch.manual_seed(0)
    machines = SimulatedMachines(nn.Linear(3, 2), 4)  # 8 float32 values: 32 bytes
    optimizer = torch.optim.SGD(machines.parameters(), lr=0.1)
    averager = PeriodicAverager(machines, optimizer, sync_every=2, participation=2)
    for _ in range(12):
        averager.step()
    assert averager.participants == 2 and averager.num_syncs == 6
    # P = S = 2: a participant sends 2 * 1/2 * 32 = 32 bytes in 2 hops a sync.
    assert averager.link_counts == LinkCounts(syncs=6, payload_bytes=192, ring_bytes=192.0, ring_hops=12)
    # Per machine on average: S/M = 2/4 of the payload, as floats_communicated.
    assert averager.bytes_per_sync() == 16.0 and averager.bytes_communicated == 96.0
    assert averager.floats_communicated == 6 * 8 * 2 / 4
    link = Link.parse("1Gbit/s,10ms")
    assert averager.link_counts.seconds(link) == pytest.approx(6 * link.all_reduce_seconds(32, 2), rel=1e-12)
    assert averager.link_counts.seconds(link) == pytest.approx(12 * 0.01 + 192 / 1.25e8, rel=1e-12)
    # DDP has no partial participation: all 4 machines every one of the 12 steps.
    assert averager.ddp_counts() == LinkCounts(syncs=12, payload_bytes=384, ring_bytes=12 * 48.0, ring_hops=72)


def test_one_machine_counts_nothing():
    model = nn.Linear(3, 2)
    averager = PeriodicAverager(model, SlowcalSGD(model.parameters(), lr=0.1), sync_every=1)
    for _ in range(3):
        averager.step()
    assert averager.num_syncs == 3
    assert averager.link_counts == LinkCounts() and averager.bytes_communicated == 0 == averager.bytes_per_sync()
    assert averager.ddp_counts() == LinkCounts()
    bytes_ratio, seconds_ratio = compare(averager.link_counts, averager.ddp_counts(), Link.parse("10Gbit/s,1ms"))
    assert math.isnan(bytes_ratio) and math.isnan(seconds_ratio)
    assert compare(LinkCounts(), ddp_counts(4, 1, 2), Link.parse("10Gbit/s,1ms")) == (math.inf, math.inf)


def test_a_resumed_run_continues_the_counts_of_the_uninterrupted_one():
    def build():
        torch.manual_seed(0)
        machines = SimulatedMachines(nn.Linear(3, 2), 3)
        optimizer = SlowcalSGD(machines.parameters(), lr=0.1)
        return machines, optimizer, PeriodicAverager(machines, optimizer, sync_every=2)

    def steps(machines, optimizer, averager, n):
        for _ in range(n):
            optimizer.zero_grad()
            machines(torch.ones(3, 1, 3)).sum().backward()
            optimizer.step()
            averager.step()

    whole = build()
    steps(*whole, 14)
    first = build()
    steps(*first, 8)
    saved = first[2].state_dict()
    resumed = build()
    resumed[0].load_state_dict(first[0].state_dict())
    resumed[1].load_state_dict(first[1].state_dict())
    resumed[2].load_state_dict(saved)
    steps(*resumed, 6)
    # x and w of 8 float32 values: 64 bytes; P = 3: 2 * 2/3 * 64 bytes and 4 hops a sync; 7 syncs.
    assert whole[2].link_counts == resumed[2].link_counts
    counts = whole[2].link_counts
    assert (counts.syncs, counts.payload_bytes, counts.ring_hops, counts.check_bytes) == (7, 448, 28, 0)
    assert counts.ring_bytes == pytest.approx(7 * 2 * 2 / 3 * 64, rel=1e-15)
    assert saved["link_counts"] == {"syncs": 4, "payload_bytes": 256, "ring_bytes": 4 * 256 / 3, "ring_hops": 16,
                                    "check_bytes": 0}  # fmt: skip
    assert whole[2].bytes_communicated == resumed[2].bytes_communicated == 448
    assert whole[2].state_dict() == resumed[2].state_dict()

    # A state saved before the byte counts existed: num_syncs syncs of what is averaged now.
    old = PeriodicAverager(whole[0], whole[1], sync_every=2)
    old.load_state_dict({"steps": 8, "num_syncs": 4, "last_sync_step": 8, "floats_communicated": 64})
    assert old.link_counts == LinkCounts(syncs=4, payload_bytes=256, ring_bytes=4 * 256 / 3, ring_hops=16)
    assert old.bytes_communicated == 256 and old.floats_communicated == 64
    # resume(steps), start_step: the same.
    started = PeriodicAverager(whole[0], whole[1], sync_every=2, start_step=9)
    assert started.link_counts == old.link_counts and started.bytes_communicated == 256


# -- two processes --------------------------------------------------------------------------------

_TWO_RANKS = """
import json, os, sys

import torch
import torch.distributed as dist
from torch import nn

from lit_slowcal import PeriodicAverager, SimulatedMachines, SlowcalSGD

rank, folder = int(sys.argv[1]), sys.argv[2]
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method="file://" + os.path.join(folder, "rendezvous"), rank=rank, world_size=2)
torch.manual_seed(0)


def build():
    machines = SimulatedMachines(nn.Linear(5, 3), 2)  # 2 machines a process, M = 4
    optimizer = SlowcalSGD(machines.parameters(), lr=0.05)
    return machines, optimizer, PeriodicAverager(machines, optimizer, sync_every=4)


def steps(machines, optimizer, averager, start, end):
    for step in range(start, end):
        g = torch.Generator().manual_seed(100 * rank + step)
        optimizer.zero_grad()
        (machines(torch.randn(2, 4, 5, generator=g)) ** 2).sum().backward()
        optimizer.step()
        averager.step()


machines, optimizer, averager = build()
averager.broadcast()  # one set-up check
steps(machines, optimizer, averager, 0, 12)  # 3 syncs, each with its schedule check
out = {"whole": averager.link_counts.state_dict(), "ddp": averager.ddp_counts().state_dict(),
       "bytes": averager.bytes_communicated, "syncs": averager.num_syncs}
# Resumed at step 8 in these processes: a new averager loaded from the state saved there.
machines, optimizer, averager = build()
averager.broadcast()
steps(machines, optimizer, averager, 0, 8)
saved = (machines.state_dict(), optimizer.state_dict(), averager.state_dict())
machines, optimizer, resumed = build()
machines.load_state_dict(saved[0])
optimizer.load_state_dict(saved[1])
resumed.load_state_dict(saved[2])
steps(machines, optimizer, resumed, 8, 12)
out["resumed"] = resumed.link_counts.state_dict()
print(json.dumps(out))
dist.barrier()
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_two_processes_count_the_hand_value_and_the_checks_apart(tmp_path):
    ranks = run_ranks(_TWO_RANKS, str(tmp_path))
    for proc in ranks:
        assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads(proc.stdout.strip().splitlines()[-1]) for proc in ranks]
    assert results[0] == results[1]
    out = results[0]
    # x and w of one machine's 15 + 3 float32 parameters: 2 * 18 * 4 = 144 bytes a sync. M = 4 machines
    # (2 processes x 2): 2 * 3/4 * 144 = 216 bytes and 6 hops a sync, 3 syncs.
    # The checks: 2 all-gathers (broadcast's set-up check, the first sync's: the others are not due, the check
    # runs every 16th round) of 27 int64 values (2 counts, 24 set-up slots, the collective's code) that each
    # process sends to the 1 other: 2 * 27 * 8 = 432 bytes.
    whole = {"syncs": 3, "payload_bytes": 432, "ring_bytes": 648.0, "ring_hops": 18, "check_bytes": 432}
    assert out["syncs"] == 3 and out["whole"] == whole and out["bytes"] == 432
    # The resumed averager's first sync checks its set-up and its counts in the same single all-gather, which
    # the first round after a load always runs: one check more than the run without the load.
    assert out["resumed"] == {**whole, "check_bytes": 432 + 216}
    link = Link.parse("10Gbit/s,1ms")
    counts = LinkCounts.from_state_dict(out["whole"])
    assert counts.seconds(link) == pytest.approx(3 * link.all_reduce_seconds(144, 4), rel=1e-12)  # checks apart
    # DDP: 12 steps of one machine's 18 float32 gradients (72 bytes) among 4: 108 bytes and 6 hops a step.
    assert out["ddp"] == {"syncs": 12, "payload_bytes": 864, "ring_bytes": 1296.0, "ring_hops": 72, "check_bytes": 0}


def test_hidden_seconds_are_each_overlapped_rounds_up_to_the_delay():
    from lit_slowcal.link import hidden_seconds

    link = Link.parse("1Gbit/s,10ms")
    rounds = LinkCounts.of_syncs(1_000_000, 4, syncs=5)  # each round: 6 latencies and 1.5 MB on the ring
    one = 6 * 0.01 + 1_500_000 / 1.25e8
    assert hidden_seconds(rounds, link, 1.0) == pytest.approx(5 * one, rel=1e-15)  # all of it hidden
    assert hidden_seconds(rounds, link, 0.02) == pytest.approx(5 * 0.02, rel=1e-15)  # up to the delay a round
    assert hidden_seconds(LinkCounts(), link, 1.0) == 0.0
    # Two of the five closed early, after 0 s and 0.01 s of compute in flight: each hides up to that only.
    assert hidden_seconds(rounds, link, 1.0, {0.0: 1, 0.01: 1}) == pytest.approx(3 * one + 0.01, rel=1e-15)
    with pytest.raises(ValueError, match=r"^Invalid short: 6 rounds \(must be <= the 5 overlapped rounds\)$"):
        hidden_seconds(rounds, link, 1.0, {0.0: 6})


@pytest.mark.parametrize("bad", [-1, -0.5, float("nan"), float("inf")])
def test_negative_or_infinite_bytes_are_refused_in_one_line(bad):
    """A negative payload gave negative seconds (a link that saves time by sending)."""
    link = Link.parse("1Gbit/s,1ms")
    with pytest.raises(ValueError, match=r"^Invalid nbytes: .* \(must be a finite number >= 0\)$"):
        link.all_reduce_seconds(bad, 4)
    with pytest.raises(ValueError, match=r"^Invalid nbytes: "):
        ring_bytes_sent(bad, 2)
    assert link.all_reduce_seconds(0, 4) == 6 * 0.001
