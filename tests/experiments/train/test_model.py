"""Tests for lit_slowcal.experiments.train.model's initialisations: the paper code's per-machine one."""

import math

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from lit_slowcal.experiments.train.model import MachinesModel, official_init


def paper_code_workers(num_machines: int, seed: int) -> list[nn.Linear]:
    """The paper code's workers as its main.py builds them (after split_dataset reseeds torch):
    for each, the model (nn.Linear(784, 10)), then a shuffling DataLoader whose iterator is made
    at once (Worker.__init__ calls iter)."""
    torch.manual_seed(seed)
    models = []
    for _ in range(num_machines):
        models.append(nn.Linear(784, 10))
        iter(DataLoader(list(range(5)), batch_size=1, shuffle=True))
    return models


@pytest.mark.parametrize("seed", [1, 3])
def test_official_init_is_the_paper_codes_workers(seed):
    weight, bias = official_init(4, seed)
    assert weight.shape == (4, 10, 784) and bias.shape == (4, 10)
    for i, model in enumerate(paper_code_workers(4, seed)):
        assert torch.equal(weight[i], model.weight.detach()), i
        assert torch.equal(bias[i], model.bias.detach()), i
    # Each machine its own draw, within nn.Linear's bound 1 / sqrt(784).
    assert not torch.equal(weight[0], weight[1])
    assert weight.abs().max() <= 1 / math.sqrt(784) and bias.abs().max() <= 1 / math.sqrt(784)


def test_official_init_leaves_the_global_generator_alone():
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    official_init(2, 1)
    assert torch.equal(torch.rand(3), expected)


def test_model_starts_every_machine_from_its_official_weights():
    model = MachinesModel(num_machines=4, init="official", seed=2)
    model.configure_model()
    weight, bias = official_init(4, 2)
    assert torch.equal(model.machines.weight.detach(), weight)
    assert torch.equal(model.machines.bias.detach(), bias)
    # Without a seed it takes the one seed_everything (torch.manual_seed) set.
    torch.manual_seed(2)
    unseeded = MachinesModel(num_machines=4, init="official")
    unseeded.configure_model()
    assert torch.equal(unseeded.machines.weight.detach(), weight)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(init="random"), r"Invalid model\.init: 'random' \(allowed: zeros, default, official\)"),
        (dict(seed=-1), r"Invalid model\.seed: -1 \(must be an integer >= 0\)"),
    ],
)
def test_bad_init_settings_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MachinesModel(**kwargs)


def test_each_process_keeps_its_own_machines_official_weights():
    """Rank 1 of 2 hosts machines 2 and 3. The strategy broadcasts rank 0's weights at setup;
    on_fit_start gives rank 1 its own back, unless the fit resumes from a checkpoint."""
    from types import SimpleNamespace

    weight, bias = official_init(4, 7)
    model = MachinesModel(num_machines=4, init="official", seed=7)
    model.trainer = SimpleNamespace(world_size=2, global_rank=1, ckpt_path=None)
    model.configure_model()
    assert torch.equal(model.machines.weight.detach(), weight[2:])
    assert torch.equal(model.machines.bias.detach(), bias[2:])
    with torch.no_grad():  # the broadcast of rank 0's machines
        model.machines.weight.copy_(weight[:2])
        model.machines.bias.copy_(bias[:2])
    model.on_fit_start()
    assert torch.equal(model.machines.weight.detach(), weight[2:])
    assert torch.equal(model.machines.bias.detach(), bias[2:])
    # A resumed fit keeps the weights the checkpoint restored (and the broadcast then shared).
    model.trainer = SimpleNamespace(world_size=2, global_rank=1, ckpt_path="last.ckpt")
    with torch.no_grad():
        model.machines.weight.fill_(0.5)
    model.on_fit_start()
    assert torch.all(model.machines.weight == 0.5)
