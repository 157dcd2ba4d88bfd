"""The models a machine can train: one entry per architecture (``--model.arch``).

``linear`` is the paper's model (multinomial logistic regression, or least squares for regression
problems): convex, so the training objective, its optimum f* and G_* are defined for it, and the
stacked sweep engine trains it. ``mlp`` and ``cnn`` are non-convex models for the same data: the
methods, the averager and the server options work unchanged, the objective's diagnostics do not
apply (f* is the linear model's), and a sweep runs them one trial at a time. ``transformer`` is the
language model of the sequence problems (``next_token``: ``StdlibChars``), and only of those.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

__all__ = ["ARCHITECTURES", "Architecture", "get_architecture"]


@dataclass(frozen=True)
class Architecture:
    """One model: how to build one machine's copy, and whether the problem it trains is convex (linear)."""

    name: str
    description: str
    build: Callable[[int, int], nn.Module]  # (input_dim, outputs) -> module
    linear: bool = False
    image_input: bool = False  # needs 28 x 28 single-channel inputs (input_dim = 784)
    sequence: bool = False  # a language model: token ids in, every position's next-token logits out (next_token)


def _mlp(input_dim: int, outputs: int) -> nn.Module:
    return nn.Sequential(nn.Linear(input_dim, 64), nn.ReLU(), nn.Linear(64, outputs))


def _cnn(input_dim: int, outputs: int) -> nn.Module:
    return nn.Sequential(
        nn.Unflatten(-1, (1, 28, 28)),
        nn.Conv2d(1, 8, 5, stride=2, padding=2), nn.ReLU(),  # 14 x 14
        nn.Conv2d(8, 16, 5, stride=2, padding=2), nn.ReLU(),  # 7 x 7
        nn.Flatten(-3), nn.Linear(16 * 7 * 7, outputs),
    )  # fmt: skip


class CausalBlock(nn.Module):
    """A pre-norm transformer block: causal multi-head self-attention, then a 4x MLP, each a residual. The
    attention is written out in matmuls (``torch.vmap`` over machines takes every operation of it)."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: Tensor) -> Tensor:
        n, length, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(n, length, 3, self.heads, width // self.heads).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (n, heads, length, head width)
        scores = q @ k.transpose(-2, -1) / math.sqrt(width // self.heads)
        future = torch.ones(length, length, dtype=torch.bool, device=x.device).triu(1)
        attention = scores.masked_fill(future, float("-inf")).softmax(-1) @ v
        x = x + self.out(attention.transpose(1, 2).reshape(n, length, width))
        return x + self.mlp(self.norm2(x))


class CharTransformer(nn.Module):
    """A small causal transformer over token ids (given as floats, as every problem's inputs are): token
    embeddings and learned positions, ``depth`` blocks, a linear head; ``(n, context)`` -> ``(n, context,
    vocabulary)``. The shape of ``examples/sharded_lm.py``'s model (width 32, 2 heads, 2 blocks)."""

    def __init__(self, context: int, vocabulary: int, width: int = 32, heads: int = 2, depth: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocabulary, width)
        self.position = nn.Parameter(0.02 * torch.randn(context, width))
        self.blocks = nn.Sequential(*(CausalBlock(width, heads) for _ in range(depth)))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocabulary)

    def forward(self, ids: Tensor) -> Tensor:
        x = self.embed(ids.long()) + self.position[: ids.shape[-1]]
        return self.head(self.norm(self.blocks(x)))


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
        Architecture(
            "transformer",
            "a causal character transformer (width 32, 2 heads, 2 blocks); the next_token problems",
            CharTransformer,
            sequence=True,
        ),
    )
}


def get_architecture(name: str) -> Architecture:
    """The entry of ``name``; else one line naming the field, the value and the allowed names."""
    try:
        return ARCHITECTURES[name]
    except (KeyError, TypeError):
        raise ValueError(f"Invalid model.arch: {name!r} (allowed: {', '.join(ARCHITECTURES)})") from None
