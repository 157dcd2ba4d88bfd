"""Compressed synchronisation (``PeriodicAverager(compression=...)``, ``lit_slowcal.compression``): what is
sent is each machine's change since the anchor, encoded per block; every result is checked against a
reference written here from the documented steps (float32 where the code works in float32, float64 to
bound), never by calling the code under test."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor, nn

from lit_slowcal import AdaptiveSlowcal, PeriodicAverager, SimulatedMachines, SlowcalSGD
from lit_slowcal._server import participant_weights
from lit_slowcal.compression import Code, Compressor, Int8
from tests.helpers import resumed

M = 4
B = 256  # Int8's default block


def _machines(seed: int = 0, din: int = 300, dout: int = 5) -> SimulatedMachines:
    torch.manual_seed(seed)
    return SimulatedMachines(nn.Linear(din, dout), M)


def _round(machines: nn.Module, optimizer: torch.optim.Optimizer, g: torch.Generator, scale: float = 1.0) -> None:
    """One local step on every machine, with gradients that differ per machine (heterogeneous)."""
    for p in machines.parameters():
        p.grad = torch.randn(p.shape, generator=g) * scale
    optimizer.step()


def _values(machines: nn.Module) -> list[Tensor]:
    return [p.detach().clone() for p in machines.parameters()]


# ---------------------------------------------------------------------- the hand-written references


def _blocks(v: Tensor) -> list[Tensor]:
    """One machine's flat values of one tensor, cut into blocks of B (the last shorter)."""
    return [v[i : i + B] for i in range(0, v.numel(), B)]


def _int8(v: Tensor) -> tuple[Tensor, Tensor]:
    """A float32 block as the documented int8 code: scale max|v|/127 (float32), round half to even, clamp."""
    scale = (v.abs().max() / 127).to(torch.float32)
    if scale == 0:
        return torch.zeros_like(v, dtype=torch.int8), scale
    return torch.round(v / scale).clamp(-127, 127).to(torch.int8), scale


def _int8_decoded(v: Tensor) -> Tensor:
    q, scale = _int8(v)
    return q.to(torch.float32) * scale


def _int8_round(
    changes: list[Tensor], errors: list[Tensor], owner_error: Tensor, feedback: bool
) -> tuple[Tensor, list[Tensor], Tensor]:
    """One two-stage int8 round of one tensor (each machine's flat float32 change): the applied mean,
    and the new error buffers."""
    sent, new_errors = [], []
    for d, e in zip(changes, errors):
        x = d + e if feedback else d
        dec = torch.cat([_int8_decoded(b) for b in _blocks(x)])
        sent.append(dec)
        new_errors.append(x - dec if feedback else e)
    mean = sent[0].clone()
    for s in sent[1:]:
        mean = mean + s  # float32, in machine order
    mean = mean / len(sent)
    y = mean + owner_error if feedback else mean
    applied = torch.cat([_int8_decoded(b) for b in _blocks(y)])
    return applied, new_errors, (y - applied if feedback else owner_error)


# ---------------------------------------------------------------------- semantics


@pytest.mark.parametrize("compression", ["bf16", "int8"])
def test_the_first_sync_is_exact_and_sets_the_anchor(compression):
    """Without an anchor yet a tensor is averaged exactly (the same bits as compression=None)."""
    runs = []
    for comp in (None, compression):
        machines = _machines()
        opt = torch.optim.SGD(machines.parameters(), lr=0.1)
        averager = PeriodicAverager(machines, opt, sync_every=3, compression=comp)
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            _round(machines, opt, g)
            averager.step()
        runs.append(_values(machines))
        if comp is not None:
            anchors = averager.state_dict()["compression"]["ranks"][0]["anchors"]
            assert all(torch.equal(a, p[0]) for a, p in zip(anchors, machines.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_bf16_is_the_anchor_plus_the_mean_of_the_bf16_changes_with_error_feedback():
    machines = _machines()
    opt = torch.optim.SGD(machines.parameters(), lr=0.05)
    averager = PeriodicAverager(machines, opt, sync_every=2, compression="bf16")
    g = torch.Generator().manual_seed(2)
    before: list[list[Tensor]] = []
    averager.register_sync_pre_hook(lambda a: before.append(_values(machines)))
    anchor: list[Tensor] = []
    errors = [torch.zeros(M, p[0].numel()) for p in machines.parameters()]
    for r in range(5):
        for _ in range(2):
            _round(machines, opt, g)
            averager.step()
        if r == 0:  # exact: it sets the anchor
            anchor = [p[0].detach().clone().reshape(-1) for p in machines.parameters()]
            continue
        for k, p in enumerate(machines.parameters()):
            values = before[-1][k].reshape(M, -1)
            x = (values - anchor[k]) + errors[k]  # float32, as documented
            sent = x.to(torch.bfloat16).to(torch.float32)
            errors[k] = x - sent
            expected = anchor[k].double() + sent.double().mean(0)
            got = p.detach().reshape(M, -1)
            assert torch.equal(got[0], got[-1])
            torch.testing.assert_close(got[0].double(), expected, rtol=1e-7, atol=1e-9)
            anchor[k] = got[0].clone()


@pytest.mark.parametrize("feedback", [True, False])
def test_int8_is_the_two_stage_reduce_element_for_element(feedback):
    """Against the documented steps written out block by block: each machine's code, the float32 mean
    in machine order, the owner's second code (with its error feedback)."""
    machines = _machines(din=600)  # 3000 weights: 12 blocks, the last of 184; a bias of 5: one short block
    opt = SlowcalSGD(machines.parameters(), lr=0.05)
    averager = PeriodicAverager(machines, opt, sync_every=2, compression="int8", error_feedback=feedback)
    g = torch.Generator().manual_seed(3)
    before: list[list[Tensor]] = []
    tensors = lambda: [t for t, _ in averager._tensors()]  # noqa: E731 (x and w, each stacked)
    averager.register_sync_pre_hook(lambda a: before.append([t.detach().clone() for t in tensors()]))
    anchor: list[Tensor] = []
    errors: list[list[Tensor]] = []
    owner: list[Tensor] = []
    for r in range(4):
        for _ in range(2):
            _round(machines, opt, g)
            averager.step()
        if r == 0:
            anchor = [t[0].detach().clone().reshape(-1) for t in tensors()]
            errors = [[torch.zeros_like(a) for _ in range(M)] for a in anchor]
            owner = [torch.zeros_like(a) for a in anchor]
            continue
        for k, t in enumerate(tensors()):
            values = before[-1][k].reshape(M, -1)
            changes = [values[i] - anchor[k] for i in range(M)]
            applied, errors[k], owner[k] = _int8_round(changes, errors[k], owner[k], feedback)
            expected = anchor[k] + applied
            got = t.detach().reshape(M, -1)
            for i in range(M):
                assert torch.equal(got[i], expected), (r, k, i)
            anchor[k] = expected
        if feedback:
            saved = averager.state_dict()["compression"]["ranks"][0]
            for k, t in enumerate(tensors()):
                assert torch.equal(saved["errors"][k].reshape(M, -1), torch.stack(errors[k]))
                assert torch.equal(saved["owner_errors"][k].reshape(-1), owner[k])


def test_one_int8_round_is_within_the_two_quanta_of_the_exact_mean():
    """Per block: half the largest first-stage quantum (max |delta_i| / 127) plus half the second's."""
    machines = _machines()
    opt = torch.optim.SGD(machines.parameters(), lr=0.1)
    averager = PeriodicAverager(machines, opt, sync_every=1, compression="int8", error_feedback=False)
    g = torch.Generator().manual_seed(4)
    _round(machines, opt, g)
    averager.step()  # exact: the anchor
    anchor = [p[0].detach().double().reshape(-1) for p in machines.parameters()]
    _round(machines, opt, g)
    values = [p.detach().double().reshape(M, -1) for p in machines.parameters()]
    averager.step()
    worst = 0.0
    for p, a, v in zip(machines.parameters(), anchor, values):
        got, exact = p[0].detach().double().reshape(-1), v.mean(0)
        for start in range(0, got.numel(), B):
            block = slice(start, start + B)
            q1 = max(float((v[i, block] - a[block]).abs().max()) for i in range(M)) / 127
            q2 = (float((exact - a)[block].abs().max()) + q1 / 2) / 127  # the decoded mean's largest value / 127
            err = float((got[block] - exact[block]).abs().max())
            assert err <= q1 / 2 + q2 / 2 + 1e-7, (start, err, q1, q2)
            worst = max(worst, err / (q1 + q2))
    assert worst > 0.05  # lossy: not the exact mean


def test_with_error_feedback_what_the_rounds_applied_does_not_drift():
    """Changes too small for their blocks' scale are lost every round without error feedback (a drift
    of R times them); with it, the sum applied over R rounds stays within one quantum of the true sum."""
    R = 40
    applied = {}
    for feedback in (True, False):
        machines = _machines(din=300, dout=1)
        opt = torch.optim.SGD(machines.parameters(), lr=1.0)
        averager = PeriodicAverager(machines, opt, sync_every=1, compression="int8", error_feedback=feedback)
        w = machines.weight
        for p in machines.parameters():
            p.grad = torch.zeros_like(p)
        opt.step()
        averager.step()  # exact first round
        start = w[0].detach().double().reshape(-1).clone()
        true_sum = torch.zeros(300, dtype=torch.float64)
        g = torch.Generator().manual_seed(5)
        for _ in range(R):
            delta = (1 + 0.2 * torch.randn(M, 1, 300, generator=g)) * 1e-3  # below half a quantum, one sign
            delta[:, :, ::B] = 1.0  # one large value per block sets the scale: the others are below half a quantum
            w.grad = -delta
            machines.bias.grad = torch.zeros_like(machines.bias)
            opt.step()
            true_sum += delta.double().mean(0).reshape(-1)
            averager.step()
        applied[feedback] = (w[0].detach().double().reshape(-1) - start, true_sum)
    got, true = applied[True]
    quantum = 1.0 / 127
    assert float((got - true).abs().max()) <= quantum
    small = torch.ones(300, dtype=torch.bool)
    small[::B] = False
    drift_off = float((applied[False][0] - applied[False][1])[small].abs().max())
    drift_on = float((got - true)[small].abs().max())
    assert drift_off > 0.9 * R * 1e-3 and drift_on < 0.2 * drift_off  # without feedback they are lost, every round


# ---------------------------------------------------------------------- counts


def test_the_counts_are_the_compressed_bytes_of_both_stages():
    """Linear(300, 5): 1,500 weights (6 blocks, 5 of 256 and one of 220) and 5 biases (one block)."""
    for compression, first, second in (
        ("int8", 1500 + 6 * 4 + 5 + 4, 1500 + 6 * 4 + 5 + 4),
        ("bf16", 1505 * 2, 1505 * 4),
    ):
        machines = _machines()
        opt = torch.optim.SGD(machines.parameters(), lr=0.1)
        averager = PeriodicAverager(machines, opt, sync_every=2, compression=compression)
        assert averager.bytes_per_sync() == first
        g = torch.Generator().manual_seed(6)
        for _ in range(6):  # 3 syncs: the first exact (1,505 floats), two compressed
            _round(machines, opt, g)
            averager.step()
        exact = 1505 * 4
        assert averager.bytes_communicated == exact + 2 * first
        counts = averager.link_counts
        assert counts.syncs == 3 and counts.payload_bytes == exact + 2 * first
        assert counts.ring_hops == 3 * 2 * (M - 1)
        assert math.isclose(counts.ring_bytes, 2 * (M - 1) / M * exact + 2 * (M - 1) / M * (first + second))


# ---------------------------------------------------------------------- layouts and resume


def test_a_tensor_compresses_alike_whatever_is_averaged_with_it():
    """Blocks never span two tensors: two models under one averager (the app's stacked trials) end
    with the same bits as each under its own."""
    alone = []
    for seed in (0, 1):
        machines = _machines(seed)
        opt = SlowcalSGD(machines.parameters(), lr=0.05)
        averager = PeriodicAverager(machines, opt, sync_every=2, compression="int8")
        g = torch.Generator().manual_seed(10 + seed)
        for _ in range(8):
            _round(machines, opt, g)
            averager.step()
        alone.append(_values(machines))
    models = [_machines(0), _machines(1)]
    opt = SlowcalSGD([{"params": list(m.parameters())} for m in models], lr=0.05)
    averager = PeriodicAverager(models, opt, sync_every=2, compression="int8")
    gens = [torch.Generator().manual_seed(10), torch.Generator().manual_seed(11)]
    for _ in range(8):
        for m, g in zip(models, gens):
            for p in m.parameters():
                p.grad = torch.randn(p.shape, generator=g)
        opt.step()
        averager.step()
    for m, ref in zip(models, alone):
        assert all(torch.equal(a, b) for a, b in zip(_values(m), ref))


@pytest.mark.parametrize("stop", [5, 6])  # mid-round, and at a round's end
def test_a_resume_from_the_state_dict_is_exact(stop):
    def build():
        machines = _machines()
        opt = SlowcalSGD(machines.parameters(), lr=0.05)
        return machines, opt, PeriodicAverager(machines, opt, sync_every=2, compression="int8")

    def steps(machines, opt, averager, gens, n):
        for _ in range(n):
            _round(machines, opt, gens)
            averager.step()

    machines, opt, averager = build()
    g = torch.Generator().manual_seed(7)
    steps(machines, opt, averager, g, 12)
    reference = _values(machines)

    machines, opt, averager = build()
    g = torch.Generator().manual_seed(7)
    steps(machines, opt, averager, g, stop)
    assert averager.state_dict()["compression"]["ranks"][0]["errors"][0] is not None
    machines, opt, averager, g = resumed(build, machines, opt, averager, g)
    steps(machines, opt, averager, g, 12 - stop)
    assert all(torch.equal(a, b) for a, b in zip(_values(machines), reference))


def test_the_anchors_survive_an_optimizer_state_loaded_after_the_averagers():
    """Kept by the tensors' places, not the tensor objects: the optimizer's load_state_dict (new w tensors) after
    the averager's load leaves a resume exact (the other order than test_a_resume_from_the_state_dict_is_exact)."""

    def run(reload_at=None):
        machines = _machines()
        opt = SlowcalSGD(machines.parameters(), lr=0.05)
        averager = PeriodicAverager(machines, opt, sync_every=2, compression="int8")
        g = torch.Generator().manual_seed(9)
        for step in range(10):
            if step == reload_at:
                saved = (machines.state_dict(), opt.state_dict(), averager.state_dict())
                machines = _machines()
                opt = SlowcalSGD(machines.parameters(), lr=0.05)
                averager = PeriodicAverager(machines, opt, sync_every=2, compression="int8")
                machines.load_state_dict(saved[0])
                averager.load_state_dict(saved[2])
                opt.load_state_dict(saved[1])  # after: its w tensors are new objects
            _round(machines, opt, g)
            averager.step()
        return _values(machines) + [opt.state[p]["w"] for p in machines.parameters()]

    assert all(torch.equal(a, b) for a, b in zip(run(), run(reload_at=6)))


def test_a_compressor_of_ones_own_plugs_in():
    class Halves(Compressor):
        """float16 codes, the mean in float32: a code written by a user."""

        second_stage = False
        name = "fp16"

        def encode(self, blocks):
            return blocks.to(torch.float16), None

        def decode(self, codes, per_block, dtype):
            return codes.to(dtype)

    machines = _machines()
    opt = torch.optim.SGD(machines.parameters(), lr=0.1)
    averager = PeriodicAverager(machines, opt, sync_every=1, compression=Halves())
    g = torch.Generator().manual_seed(8)
    _round(machines, opt, g)
    averager.step()
    anchor = machines.weight[0].detach().clone()
    _round(machines, opt, g)
    before = machines.weight.detach().clone()
    averager.step()
    sent = (before - anchor).to(torch.float16).double()
    torch.testing.assert_close(machines.weight[0].double(), anchor.double() + sent.mean(0), rtol=1e-7, atol=1e-9)
    assert averager.link_counts.payload_bytes == 1505 * 4 + 1505 * 2


# ---------------------------------------------------------------------- never-negative state


class _Multiples(Code):
    """Each value to the nearest multiple of ``h`` (a user's lossy code; its mean, in machine order)."""

    name = "multiples"

    def __init__(self, h: float) -> None:
        self.h = h

    def encode(self, change):
        return torch.round(change / self.h)

    def decode(self, message, numel, dtype):
        return message.to(dtype) * self.h

    def message_bytes(self, numel, dtype):
        return numel * 2

    def reduce(self, messages, numel, dtype):
        total = torch.zeros(numel, dtype=dtype)
        for message in messages:
            total += message.to(dtype) * self.h
        return total / len(messages)


def _decayed(values: Tensor, g: torch.Generator) -> Tensor:
    """A second moment spread over four decades, then decayed on every machine to a little of its value, but for
    machine 0's first value of each block, which grows large (the block's scale)."""
    out = values * torch.rand(values.shape, generator=g, dtype=values.dtype) * 1e-2
    out[0, ..., ::B] = 10.0
    return out


NONNEGATIVE_RUNS = {
    "AdamW": (lambda p: torch.optim.AdamW(p, lr=1e-3, betas=(0.9, 0.5)), "exp_avg_sq", ("exp_avg", "exp_avg_sq")),
    "RMSprop": (lambda p: torch.optim.RMSprop(p, lr=1e-3, alpha=0.5), "square_avg", ("square_avg",)),
    "AdaptiveSlowcal": (lambda p: AdaptiveSlowcal(p, lr=1e-3, beta2=0.5, average_second_moment=True), "v", ()),
}


@pytest.mark.parametrize("compression", ["int8", "bf16", "multiples"])
@pytest.mark.parametrize("method", list(NONNEGATIVE_RUNS))
def test_a_second_moment_averaged_with_compression_stays_nonnegative_and_the_next_step_finite(method, compression):
    """Machines whose second moment decays to almost nothing in a round: each machine's change is nearly minus the
    anchor, and its code's rounding takes the mean below it (before: exp_avg_sq -0.0068 after bf16's second round,
    NaN at the next step). Every machine lands at no less than 0, the same values on all."""
    factory, key, average_state = NONNEGATIVE_RUNS[method]
    torch.manual_seed(0)
    machines = SimulatedMachines(nn.Linear(300, 1), M)
    opt = factory(machines.parameters())
    code = _Multiples(0.05) if compression == "multiples" else compression
    averager = PeriodicAverager(machines, opt, sync_every=16, compression=code, average_state=average_state)
    g = torch.Generator().manual_seed(1)
    landed = []
    for step in range(64):
        first = step < 16  # the first round's gradients, then silence: every second moment decays
        machines.weight.grad = torch.rand(machines.weight.shape, generator=g) * 2 * first
        machines.bias.grad = torch.zeros_like(machines.bias)
        opt.step()
        if averager.step():
            v = opt.state[machines.weight][key].detach().clone()
            assert torch.equal(v, v[:1].expand_as(v))
            landed.append(v)
    assert all(float(v.min()) >= 0 for v in landed), [float(v.min()) for v in landed]
    assert bool((landed[1] == 0).any())  # the code's rounding did go below 0 there
    opt.step()
    assert all(bool(p.isfinite().all()) for p in machines.parameters())


@pytest.mark.parametrize("feedback", [True, False])
def test_int8_lands_a_nonnegative_state_at_max_of_anchor_plus_mean_and_0_element_for_element(feedback):
    """Adam's exp_avg_sq, each round against the two-stage reference (``_int8_round``): every machine ends at
    max(anchor + applied, 0); with error feedback min(anchor + applied, 0), what was not applied, joins every
    machine's buffer."""
    machines = _machines(din=600, dout=1)  # 600 values: blocks of 256, 256, 88
    opt = torch.optim.Adam(machines.parameters(), lr=1e-3)
    averager = PeriodicAverager(
        machines, opt, sync_every=1, compression="int8", error_feedback=feedback, average_state=("exp_avg_sq",)
    )
    g = torch.Generator().manual_seed(11)
    v = lambda: opt.state[machines.weight]["exp_avg_sq"]  # noqa: E731
    clamped = 0
    for r in range(4):
        _round(machines, opt, g)
        if r == 0:  # exact: the anchor, spread over four decades
            v().copy_(10 ** (-4 * torch.rand(M, 1, 600, generator=g)))
            averager.step()
            anchor = v()[0].detach().clone().reshape(-1)
            errors = [torch.zeros(600) for _ in range(M)]
            owner = torch.zeros(600)
            continue
        v().copy_(_decayed(v().detach().clone(), g))
        before = v().detach().clone().reshape(M, -1)
        averager.step()
        applied, errors, owner = _int8_round([before[i] - anchor for i in range(M)], errors, owner, feedback)
        new = anchor + applied  # float32, as the round adds
        clamped += int((new < 0).sum())
        if feedback:
            errors = [e + new.clamp(max=0) for e in errors]
        expected = new.clamp(min=0)
        got = v().detach().reshape(M, -1)
        for i in range(M):
            assert torch.equal(got[i], expected), (r, i)
        if feedback:
            saved = averager.state_dict()["compression"]["ranks"][0]
            k = saved["names"].index("param 0 exp_avg_sq")
            assert torch.equal(saved["errors"][k].reshape(M, -1), torch.stack(errors))
            assert torch.equal(saved["owner_errors"][k].reshape(-1), owner)
        anchor = expected
    assert clamped > 10  # the rounding did take values below 0


@pytest.mark.parametrize("participation", [None, 2])
def test_a_code_of_ones_own_lands_a_nonnegative_state_as_the_float64_hand_reference(participation):
    """RMSprop's square_avg in float64 with a user's ``Code``: c_i = v_i - anchor + e_i, e_i <- c_i - decode;
    new = anchor + mean of the participants' decoded; every machine (taking part or not) adds min(new, 0) to its
    buffer, and every machine ends at max(new, 0)."""
    h = 0.05
    torch.manual_seed(0)
    machines = SimulatedMachines(nn.Linear(300, 1, bias=False), M).double()
    opt = torch.optim.RMSprop(machines.parameters(), lr=1e-3)
    averager = PeriodicAverager(
        machines, opt, sync_every=1, compression=_Multiples(h), average_state=("square_avg",),
        participation=participation, participation_seed=3,
    )  # fmt: skip
    g = torch.Generator().manual_seed(12)
    v = lambda: opt.state[machines.weight]["square_avg"]  # noqa: E731
    clamped = 0
    for r in range(5):
        machines.weight.grad = torch.randn(machines.weight.shape, generator=g, dtype=torch.float64)
        opt.step()
        if r == 0:
            v().copy_(10 ** (-4 * torch.rand(M, 1, 300, generator=g, dtype=torch.float64)))
            averager.step()
            anchor = v()[0].detach().clone().reshape(-1)
            errors = [torch.zeros(300, dtype=torch.float64) for _ in range(M)]
            continue
        v().copy_(_decayed(v().detach().clone(), g))
        before = v().detach().clone().reshape(M, -1)
        weights = participant_weights(M, participation or M, 3, averager.num_syncs)
        taking_part = [True] * M if weights is None else [bool(w > 0) for w in weights]
        averager.step()
        total = torch.zeros(300, dtype=torch.float64)
        for i in range(M):
            c = before[i] - anchor + errors[i]
            decoded = torch.round(c / h) * h
            if taking_part[i]:
                errors[i] = c - decoded
                total = total + decoded
        new = anchor + total / sum(taking_part)
        clamped += int((new < 0).sum())
        errors = [e + new.clamp(max=0) for e in errors]
        expected = new.clamp(min=0)
        got = v().detach().reshape(M, -1)
        for i in range(M):
            assert torch.equal(got[i], expected), (r, i)
        saved = averager.state_dict()["compression"]["ranks"][0]
        assert torch.equal(
            saved["errors"][saved["names"].index("param 0 square_avg")].reshape(M, -1), torch.stack(errors)
        )
        anchor = expected
    assert clamped > 10


def test_a_resume_with_a_clamped_nonnegative_state_is_exact():
    """The error feedback that holds what a clamp did not apply travels in ``state_dict()``: resumed mid-run, the
    run ends with the uninterrupted one's bits."""

    def build():
        torch.manual_seed(0)
        machines = SimulatedMachines(nn.Linear(300, 1), M)
        opt = torch.optim.AdamW(machines.parameters(), lr=1e-3, betas=(0.9, 0.5))
        averager = PeriodicAverager(
            machines, opt, sync_every=4, compression="int8", average_state=("exp_avg", "exp_avg_sq")
        )
        return machines, opt, averager

    def steps(machines, opt, averager, g, start, stop):
        for step in range(start, stop):
            machines.weight.grad = torch.rand(machines.weight.shape, generator=g) * 2 * (step < 4)
            machines.weight.grad[0, 0, 0] = 100.0 * (
                step // 4 % 2
            )  # machine 0's value: a large scale every other round
            machines.bias.grad = torch.zeros_like(machines.bias)
            opt.step()
            averager.step()

    machines, opt, averager = build()
    g = torch.Generator().manual_seed(7)
    steps(machines, opt, averager, g, 0, 40)
    reference = _values(machines) + [opt.state[machines.weight]["exp_avg_sq"].clone()]
    assert bool((reference[-1] == 0).any())  # clamped

    machines, opt, averager = build()
    g = torch.Generator().manual_seed(7)
    steps(machines, opt, averager, g, 0, 22)
    machines, opt, averager, g = resumed(build, machines, opt, averager, g)
    steps(machines, opt, averager, g, 22, 40)
    got = _values(machines) + [opt.state[machines.weight]["exp_avg_sq"]]
    assert all(torch.equal(a, b) for a, b in zip(got, reference))


# ---------------------------------------------------------------------- refused


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"compression": "fp4"},
            r"^Invalid compression: 'fp4' \(None, one of 'bf16', 'int8', 'int4', 'int2', 'topk:<fraction>\[:<bits>\]', "
            r"a lit_slowcal.compression.Compressor or a lit_slowcal",
        ),
        ({"compression": "topk:0.01:3"}, r"^Invalid TopK bits: 3 \(one of 2, 4, 8, 16, 32\)$"),
        ({"compression": "int4:1"}, r"^Invalid compression: 'int4:1' \(None, one of"),
        ({"compression": "int8", "error_feedback": "yes"}, r"^Invalid error_feedback: 'yes' \(True, False, or None"),
        (
            {"compression": "int8", "overlap_delay": 1},
            r"^Invalid compression: 'int8' with overlap_delay=1, fragments=1 \(compressed rounds are blocking",
        ),
    ],
)
def test_bad_options_are_one_line(kwargs, message):
    machines = _machines()
    with pytest.raises(ValueError, match=message):
        PeriodicAverager(machines, torch.optim.SGD(machines.parameters(), lr=0.1), sync_every=2, **kwargs)


def test_int8_block_size_is_checked():
    with pytest.raises(ValueError, match=r"block_size"):
        Int8(block_size=0)


def test_tensors_outside_the_simulated_machines_are_refused_with_compression():
    model = nn.Sequential(SimulatedMachines(nn.Linear(3, 2), M), nn.LayerNorm(2))
    with pytest.raises(ValueError, match=r"^Invalid compression: 'int8' with 4 simulated machines per process and 2 "):
        PeriodicAverager(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=2, compression="int8")


def test_compressed_state_is_refused_by_an_averager_without_compression():
    machines = _machines()
    opt = torch.optim.SGD(machines.parameters(), lr=0.1)
    state = PeriodicAverager(machines, opt, sync_every=2, compression="int8").state_dict()
    with pytest.raises(ValueError, match=r"compression=None; build it with the same compression$"):
        PeriodicAverager(machines, opt, sync_every=2).load_state_dict(state)
