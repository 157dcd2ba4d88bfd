"""The optimizer protocol: one ``typing.Protocol``, read in one place (``lit_slowcal.protocol.declared``)."""

import re
from pathlib import Path

import pytest
import torch
from torch import nn

from lit_slowcal import AcceleratedSGD, AdaptiveSlowcal, PeriodicAverager, Scaffold, SlowcalSGD
from lit_slowcal.protocol import Declared, SyncOptimizer, declared

MEMBERS = (
    "averaged_state", "nonnegative_state", "pre_sync", "post_sync", "outer_optimizer", "supports_participation", "supports_outer_optimizer",
    "swap_output",
)  # fmt: skip


def _params():
    return [nn.Parameter(torch.zeros(3))]


def test_each_optimizer_declares_what_the_docs_say_and_sgd_nothing():
    assert declared(torch.optim.SGD(_params(), lr=0.1)) == Declared()
    slowcal = declared(SlowcalSGD(_params(), lr=0.1))
    assert slowcal.averaged_state == ("w",) and slowcal.pre_sync is None and slowcal.supports_participation
    scaffold = Scaffold(_params(), lr=0.1, server_lr=0.5)
    got = declared(scaffold)
    assert got.averaged_state == ("delta_c",) and not got.supports_participation
    assert got.pre_sync == scaffold.pre_sync and got.post_sync == scaffold.post_sync
    assert isinstance(got.outer_optimizer(_params()), torch.optim.SGD)
    assert declared(Scaffold(_params(), lr=0.1)).outer_optimizer is None  # server_lr = 1: the plain average
    accelerated = AcceleratedSGD(_params(), lr=0.1)
    assert declared(accelerated).swap_output == accelerated.swap_output
    assert set(SyncOptimizer.__annotations__) | {"outer_optimizer", "pre_sync", "post_sync", "swap_output"} == set(
        MEMBERS
    )
    assert tuple(f for f in Declared.__dataclass_fields__) == MEMBERS


def test_the_never_negative_state_is_torch_s_known_keys_by_default_and_an_optimizer_s_own_declaration():
    adam = ("exp_avg_sq", "max_exp_avg_sq")
    for kind, keys in [
        (torch.optim.Adam, adam), (torch.optim.AdamW, adam), (torch.optim.Adagrad, ("sum",)),
        (torch.optim.RMSprop, ("square_avg",)), (torch.optim.Adadelta, ("square_avg", "acc_delta")),
        (torch.optim.SGD, ()), (SlowcalSGD, ()),
    ]:  # fmt: skip
        assert declared(kind(_params(), lr=0.1)).nonnegative_state == keys, kind

    class MyAdam(torch.optim.Adam):
        pass

    assert declared(MyAdam(_params())).nonnegative_state == adam  # a subclass keeps its base's state
    assert declared(AdaptiveSlowcal(_params(), lr=0.1)).nonnegative_state == ("v",)
    mine = torch.optim.Adam(_params())
    mine.nonnegative_state = ()  # an optimizer's own declaration replaces the default
    assert declared(mine).nonnegative_state == ()


@pytest.mark.parametrize(
    "member, value, message",
    [
        ("averaged_state", "w", r"^Invalid SGD\.averaged_state: 'w' \(a tuple of state key names\)$"),
        ("nonnegative_state", 3, r"^Invalid SGD\.nonnegative_state: 3 \(a tuple of state key names\)$"),
        ("supports_participation", "no", r"^Invalid SGD\.supports_participation: 'no' \(True or False\)$"),
        ("pre_sync", 3, r"^Invalid SGD\.pre_sync: 3 \(a method, or absent\)$"),
    ],
)
def test_a_member_of_the_wrong_kind_is_one_line_when_the_averager_is_built(member, value, message):
    optimizer = torch.optim.SGD(_params(), lr=0.1)
    setattr(optimizer, member, value)
    with pytest.raises(TypeError, match=message):
        PeriodicAverager(nn.Linear(1, 1), optimizer, sync_every=1)


def test_no_module_but_the_protocols_reads_its_members_by_name():
    package = Path(__file__).resolve().parents[2] / "lit_slowcal"
    probe = re.compile(r"(getattr|hasattr)\([^)]*[\"'](" + "|".join(MEMBERS) + r")[\"']")
    readers = [str(p.relative_to(package)) for p in package.rglob("*.py") if probe.search(p.read_text())]
    assert readers == ["protocol.py"]
