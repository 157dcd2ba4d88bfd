"""The models a machine can train: one entry per architecture (``--model.arch``).

``linear`` is the paper's model (multinomial logistic regression, or least squares for regression
problems): convex, so the training objective, its optimum f* and G_* are defined for it, and the
stacked sweep engine trains it. ``mlp`` and ``cnn`` are non-convex models for the same data: the
methods, the averager and the server options work unchanged, the objective's diagnostics do not
apply (f* is the linear model's), and a sweep runs them one trial at a time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

__all__ = ["ARCHITECTURES", "Architecture", "get_architecture"]


@dataclass(frozen=True)
class Architecture:
    """One model: how to build one machine's copy, and whether the problem it trains is convex (linear)."""

    name: str
    description: str
    build: Callable[[int, int], nn.Module]  # (input_dim, outputs) -> module
    linear: bool = False
    image_input: bool = False  # needs 28 x 28 single-channel inputs (input_dim = 784)


def _mlp(input_dim: int, outputs: int) -> nn.Module:
    return nn.Sequential(nn.Linear(input_dim, 64), nn.ReLU(), nn.Linear(64, outputs))


def _cnn(input_dim: int, outputs: int) -> nn.Module:
    return nn.Sequential(
        nn.Unflatten(-1, (1, 28, 28)),
        nn.Conv2d(1, 8, 5, stride=2, padding=2), nn.ReLU(),  # 14 x 14
        nn.Conv2d(8, 16, 5, stride=2, padding=2), nn.ReLU(),  # 7 x 7
        nn.Flatten(-3), nn.Linear(16 * 7 * 7, outputs),
    )  # fmt: skip


ARCHITECTURES: dict[str, Architecture] = {
    a.name: a
    for a in (
        Architecture(
            "linear", "the paper's linear model (logistic regression / least squares)", nn.Linear, linear=True
        ),
        Architecture("mlp", "one hidden layer of 64 ReLU units", _mlp),
        Architecture(
            "cnn",
            "two 5x5 stride-2 convolutions (8, 16 channels) and a linear layer; 28 x 28 images",
            _cnn,
            image_input=True,
        ),
    )
}


def get_architecture(name: str) -> Architecture:
    """The entry of ``name``; else one line naming the field, the value and the allowed names."""
    try:
        return ARCHITECTURES[name]
    except (KeyError, TypeError):
        raise ValueError(f"Invalid model.arch: {name!r} (allowed: {', '.join(ARCHITECTURES)})") from None
