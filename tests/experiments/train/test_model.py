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


def test_the_transformer_on_simulated_machines_is_each_machines_own_model():
    """``model.arch=transformer`` (the language model): every machine's mean next-token loss, and its gradient, are
    those of its own copy run alone; the attention is causal (a position's logits ignore later characters)."""
    import torch.nn.functional as F

    from lit_slowcal.experiments.train.architectures import CharTransformer

    torch.manual_seed(0)
    model = MachinesModel(method="adaptive_slowcal", num_machines=3, arch="transformer", init="default",
                          input_dim=12, num_classes=96, loss="next_token")  # fmt: skip
    model.configure_model()
    with torch.no_grad():
        for p in model.machines.parameters():  # the machines differ
            p.add_(0.1 * torch.randn_like(p))
    x = torch.randint(0, 96, (3, 5, 12)).float()
    y = torch.randint(0, 96, (3, 5, 12))
    losses = model._machine_losses(x, y)
    losses.sum().backward()
    for i in range(3):
        alone = CharTransformer(12, 96)
        with torch.no_grad():
            for name, p in alone.named_parameters():
                p.copy_(model.machines.stacked_parameters()[name][i])
        loss = F.cross_entropy(alone(x[i]).flatten(0, 1), y[i].flatten())
        loss.backward()
        assert torch.allclose(losses[i], loss, rtol=1e-5, atol=0)
        for name, p in alone.named_parameters():
            assert torch.allclose(model.machines.stacked_parameters()[name].grad[i], p.grad, rtol=1e-4, atol=1e-6)
    changed = x[0:1].clone()
    changed[0, :, 7:] = 0.0
    alone = model.machines.averaged_module()
    assert torch.equal(alone(changed[0])[:, :7], alone(x[0])[:, :7])
    assert not torch.equal(alone(changed[0])[:, 7:], alone(x[0])[:, 7:])


@pytest.mark.parametrize(
    ("arch", "loss"), [("transformer", "cross_entropy"), ("linear", "next_token"), ("mlp", "next_token")]
)
def test_the_transformer_and_the_next_token_loss_go_together(arch, loss):
    init = "default" if arch != "linear" else "zeros"
    with pytest.raises(ValueError, match=rf"Invalid model.arch: '{arch}' for the {loss} loss \(a language-model"):
        MachinesModel(arch=arch, loss=loss, init=init)
