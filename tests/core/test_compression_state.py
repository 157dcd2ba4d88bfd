"""Compressed rounds around their state: the first round after ``broadcast()`` (each tensor coded once it has an
anchor, state born later averaged exactly in the same round), and a saved state checked against the
configuration it is loaded into. References are written here from the documented steps (float32 where the code
works in float32, float64 for the exact average), never by calling the code under test."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor, nn

from lit_slowcal import AdaptiveSlowcal, PeriodicAverager, SimulatedMachines, SlowcalSGD
from lit_slowcal.compression import Int8
from tests.helpers import int8_mean

M = 4
B = 256  # Int8's default block


def _machines(din: int = 300, dout: int = 2) -> SimulatedMachines:
    torch.manual_seed(0)
    return SimulatedMachines(nn.Linear(din, dout), M)


def _local_steps(machines: nn.Module, optimizer: torch.optim.Optimizer, averager, g: torch.Generator, n: int) -> None:
    """n local steps, every machine its own gradients, each counted by the averager."""
    for _ in range(n):
        for p in machines.parameters():
            p.grad = torch.randn(p.shape, generator=g)
        optimizer.step()
        averager.step()


def _int8_bytes(n: int) -> int:
    """One machine's int8 message of a tensor of n values: n codes and a float32 scale a block."""
    return n + 4 * -(-n // B)


# ---------------------------------------------------------------------- the first round


def test_after_broadcast_the_first_round_codes_the_parameters_and_averages_new_state_exactly():
    """SLowcal-SGD's w appears at the first step, after broadcast(): the first round codes x (anchored) and
    averages w exactly, in one round counted as both parts; the second codes both."""
    machines = _machines()  # Linear(300, 2): 600 weights (3 blocks), 2 biases (1 block)
    opt = SlowcalSGD(machines.parameters(), lr=0.05)
    averager = PeriodicAverager(machines, opt, sync_every=2, compression="int8")
    averager.broadcast()  # one process: the parameters' anchors are their values now
    anchors = [p[0].detach().clone().reshape(-1) for p in machines.parameters()]
    before: list[tuple[list[Tensor], list[Tensor]]] = []
    params = list(machines.parameters())
    averager.register_sync_pre_hook(
        lambda a: before.append(([p.detach().clone() for p in params], [opt.state[p]["w"].clone() for p in params]))
    )
    g = torch.Generator().manual_seed(1)
    _local_steps(machines, opt, averager, g, 2)
    xs, ws = before[0]
    for p, x, a in zip(params, xs, anchors):
        want = a + int8_mean(x.reshape(M, -1) - a)
        got = p.detach().reshape(M, -1)
        for i in range(M):
            assert torch.equal(got[i], want), i
    for p, w in zip(params, ws):
        exact = w.double().reshape(M, -1).mean(0)  # float64: the exact average
        got = opt.state[p]["w"].detach().reshape(M, -1)
        assert all(torch.equal(got[i], got[0]) for i in range(M))
        torch.testing.assert_close(got[0].double(), exact, rtol=0, atol=1e-7)
    coded, exact_bytes = _int8_bytes(600) + _int8_bytes(2), 602 * 4
    assert (coded, exact_bytes) == (618, 2408)
    assert averager.bytes_communicated == coded + exact_bytes == 3026  # exactly: 4,816
    counts = averager.link_counts
    assert counts.syncs == 1 and counts.payload_bytes == 3026
    assert counts.ring_hops == 2 * (M - 1) + 2 * (M - 1)  # the all-reduce's, then the two stages'
    assert counts.ring_bytes == pytest.approx(2 * (M - 1) / M * exact_bytes + (M - 1) / M * 2 * coded, rel=1e-12)
    saved = averager.state_dict()["compression"]["ranks"][0]
    assert saved["names"] == ["param 0", "param 0 w", "param 1", "param 1 w"]  # every tensor has its anchor now
    assert all(torch.equal(a, t[0]) for a, (t, _) in zip(saved["anchors"], averager._tensors()))
    _local_steps(machines, opt, averager, g, 2)
    assert averager.bytes_communicated == 3026 + 2 * coded
    assert averager.link_counts.syncs == 2


# ---------------------------------------------------------------------- a saved state and its configuration


def _trained(optimizer=SlowcalSGD, steps: int = 3, **kwargs):
    """Machines, optimizer and averager after ``steps`` steps (mid-round: error feedback kept) of sync_every=2."""
    machines = _machines()
    options = {k: kwargs.pop(k) for k in ("beta", "lr") if k in kwargs}
    opt = optimizer(machines.parameters(), **{"lr": 0.05, **options})
    averager = PeriodicAverager(machines, opt, sync_every=2, **kwargs)
    _local_steps(machines, opt, averager, torch.Generator().manual_seed(3), steps)
    return machines, opt, averager


@pytest.mark.parametrize(
    ("saved", "loaded", "message"),
    [
        ({"compression": "int8"}, {"compression": "bf16"}, "compression Int8(block_size=256) (this averager's: BFloat16(block_size=256))"),
        ({"compression": "int8"}, {"compression": "int8", "error_feedback": False}, "error_feedback True (this averager's: False)"),
        ({"compression": "int8"}, {"compression": Int8(block_size=128)}, "(this averager's: Int8(block_size=128))"),
        ({}, {"compression": "int8"}, "compression None (this averager's: Int8(block_size=256)); error_feedback False (this averager's: True)"),
        ({"compression": "int8"}, {"compression": "int8", "optimizer": AdaptiveSlowcal}, "optimizer SlowcalSGD (this averager's: AdaptiveSlowcal)"),
        ({"optimizer": AdaptiveSlowcal}, {"optimizer": AdaptiveSlowcal, "beta": 0.5}, "with optimizer option beta 1.0 (this averager's: 0.5); build"),
    ],
)  # fmt: skip
def test_a_state_saved_under_another_configuration_is_refused_in_one_line(saved, loaded, message):
    state = _trained(**saved)[2].state_dict()
    machines, opt, averager = _trained(steps=0, **loaded)
    before = averager.state_dict()
    with pytest.raises(ValueError, match=r"^Cannot load the averager's state: it was saved with ") as error:
        averager.load_state_dict(state)
    assert message in str(error.value) and "\n" not in str(error.value)
    assert averager.steps == before["steps"] == 0  # nothing was set


def test_a_state_loads_under_another_learning_rate():
    state = _trained(AdaptiveSlowcal, compression="int8")[2].state_dict()
    averager = _trained(AdaptiveSlowcal, steps=0, lr=0.01, compression="int8")[2]
    averager.load_state_dict(state)
    assert averager.steps == 3


def test_a_state_saved_before_names_and_the_record_resumes_exactly():
    """A state of the earlier format (anchors by place, no configuration) is taken while the tensors keep its
    signature: the resumed run ends with the bits of the uninterrupted one."""

    def run(stop=None):
        machines = _machines()
        opt = SlowcalSGD(machines.parameters(), lr=0.05)
        averager = PeriodicAverager(machines, opt, sync_every=2, compression="int8")
        g = torch.Generator().manual_seed(4)
        for step in range(10):
            if step == stop:
                saved = (machines.state_dict(), opt.state_dict(), averager.state_dict())
                del saved[2]["configuration"], saved[2]["compression"]["ranks"][0]["names"]
                machines = _machines()
                opt = SlowcalSGD(machines.parameters(), lr=0.05)
                averager = PeriodicAverager(machines, opt, sync_every=2, compression="int8")
                machines.load_state_dict(saved[0])
                opt.load_state_dict(saved[1])
                averager.load_state_dict(saved[2])
            _local_steps(machines, opt, averager, g, 1)
        return [t.detach().clone() for t, _ in averager._tensors()], averager.bytes_communicated

    (want, sent), (got, resumed) = run(), run(stop=5)
    assert all(torch.equal(a, b) for a, b in zip(got, want)) and resumed == sent


def _damaged(state: dict, change: str) -> Any:
    if change == "not a dict":
        return list(state)
    if change == "steps missing":
        del state["steps"]
    elif change == "num_syncs a str":
        state["num_syncs"] = "3"
    elif change == "link_counts a list":
        state["link_counts"] = [1, 2]
    elif change == "compression without ranks":
        del state["compression"]["ranks"]
    elif change == "compression without this rank":
        state["compression"]["ranks"] = {1: state["compression"]["ranks"][0]}
    elif change == "anchors not a list":
        state["compression"]["ranks"][0]["anchors"] = "x"
    elif change == "names of another length":
        state["compression"]["ranks"][0]["names"].pop()
    elif change == "an anchor of another size":  # accepted, then a RuntimeError inside the next round
        anchors = state["compression"]["ranks"][0]["anchors"]
        anchors[0] = anchors[0].reshape(-1)[:-1].clone()
    elif change == "errors of another size":
        errors = state["compression"]["ranks"][0]["errors"]
        i = next(i for i, e in enumerate(errors) if e is not None)
        errors[i] = errors[i].reshape(-1)[1:].clone()
    return state


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("not a dict", r"a list \(PeriodicAverager.state_dict\(\)'s dict\)$"),
        ("steps missing", r"the key 'steps' is missing"),
        ("num_syncs a str", r"'num_syncs' is '3' of type str \(expected int\)$"),
        ("link_counts a list", r"'link_counts' is \[1, 2\] of type list \(expected dict\)$"),
        ("compression without ranks", r"'compression' lacks an int 'world_size' or a dict 'ranks'"),
        ("compression without this rank", r"'compression' holds no state of rank 0 \(its ranks: \[1\]\)"),
        ("anchors not a list", r"'compression' part is damaged: 'anchors' is not a list of tensors or None$"),
        ("names of another length", r"'compression' part is damaged: 'signature' has 4 entries for 3 names$"),
        ("an anchor of another size", r"'compression' part is damaged: anchors entry 0 holds \d+ values for a tensor"),
        ("errors of another size", r"'compression' part is damaged: errors entry \d+ holds \d+ values for a tensor"),
    ],
)
def test_a_damaged_state_is_one_line_naming_the_key(change, message):
    state = _damaged(_trained(steps=5, compression="int8")[2].state_dict(), change)  # two rounds: the second coded
    averager = _trained(steps=0, compression="int8")[2]
    with pytest.raises(ValueError, match=r"^Cannot load the averager's state: .*" + message) as error:
        averager.load_state_dict(state)
    assert "\n" not in str(error.value) and averager.steps == 0


def test_a_code_not_smaller_than_the_tensor_sends_it_exactly():
    """bf16 codes of a bfloat16 model would be 2 bytes a value plus the float32 mean: 1.5x the exact bytes. Such
    a tensor goes exactly (the same bits as compression=None), counted as exact."""
    results = []
    for compression in (None, "bf16"):
        machines = _machines().to(torch.bfloat16)
        opt = torch.optim.SGD(machines.parameters(), lr=0.1)
        averager = PeriodicAverager(machines, opt, sync_every=1, compression=compression)
        averager.broadcast()
        assert averager.bytes_per_sync() == 602 * 2
        g = torch.Generator().manual_seed(5)
        for _ in range(2):
            for p in machines.parameters():
                p.grad = torch.randn(p.shape, generator=g).to(torch.bfloat16)
            opt.step()
            averager.step()
        results.append(([p.detach().clone() for p in machines.parameters()], averager.link_counts))
    (exact, sent_exact), (coded, sent_coded) = results
    assert all(torch.equal(a, b) for a, b in zip(exact, coded))
    # The ring all-reduce's 2 (M - 1) / M of 602 * 2 bytes a round (coded: (M - 1) / M of 602 * 2 + 602 * 4).
    assert sent_coded == sent_exact and sent_coded.ring_bytes == pytest.approx(2 * 2 * (M - 1) / M * 602 * 2)
