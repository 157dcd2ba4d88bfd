"""The global training objective f of the linear model, its values for many points at once, and the heterogeneity G_*.

The paper's guarantees bound the excess loss f(x) - f(x*) of

    f(x) = (1/M) sum_i f_i(x),   f_i(x) = (1/n_i) sum_{j in shard i} loss(x; z_j) + (lambda/2) ||x||^2,

the average over machines of each machine's mean loss on its whole shard; a sample of a machine
with n_i samples weighs 1/(M n_i), so x* depends on the split, not only on the data. lambda is
``model.weight_decay``, and the penalty covers every parameter, the bias included, exactly as the
training update does (``SlowcalSGD`` and ``torch.optim.SGD`` add lambda x to every gradient).

``Objective`` evaluates f for the linear model of ``lit_slowcal.experiments.model`` in one pass over
all shards (one matrix product), with float64 reductions. Problems up to 2^24 input values keep a
float64 copy of their inputs and are exact to float64; larger ones (MNIST: 47M) use the float32
inputs as they are, without a copy, and the logits of one float32 product carry a relative error of
about 1e-7 (measured on MNIST at x*: 2e-8 in f).

Its optimum x* and f* = f(x*), in float64 and cached on disk, are ``lit_slowcal.experiments.optimum``'s.

``heterogeneity`` gives G_*^2 = 2 (1/M) sum_i ||grad f_i(x*)||^2, the smallest G_* of the paper's
G_*-dissimilarity assumption (1/M) sum_i ||grad f_i(x*)||^2 <= G_*^2 / 2.
"""

from __future__ import annotations

import hashlib
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from lit_slowcal.experiments.problems import ProblemData

__all__ = ["Objective", "affine_rows", "heterogeneity", "values"]

#: Problems with at most this many input values keep a float64 copy (exact objective).
FLOAT64_LIMIT = 2**24
LOSSES = ("cross_entropy", "squared")


def _loss(loss: str, logits: Tensor, y: Tensor) -> Tensor:
    """Per-sample loss from float64 logits ``(n, outputs)``."""
    if loss == "cross_entropy":
        return F.cross_entropy(logits, y, reduction="none")
    return 0.5 * (logits.squeeze(1) - y) ** 2


class Objective:
    """f(x) of a linear model (``weight`` ``(outputs, d)``, ``bias`` ``(outputs,)``) on every machine's shard.

    Args:
        data: the problem's samples and shards (all M machines).
        loss: ``cross_entropy`` or ``squared``.
        weight_decay: lambda; the penalty (lambda/2) ||x||^2 covers weight and bias.
    """

    def __init__(self, data: ProblemData, loss: str, weight_decay: float = 0.0) -> None:
        if loss not in LOSSES:
            raise ValueError(f"Invalid loss: {loss!r} (allowed: {', '.join(LOSSES)})")
        self.loss = loss
        self.weight_decay = float(weight_decay)
        self.shards = data.shards
        self.num_machines = len(data.shards)
        n = len(data.train_y)
        weights = torch.zeros(n, dtype=torch.float64)
        for shard in data.shards:
            if len(shard):
                weights.index_add_(0, shard, torch.full((len(shard),), 1.0 / (self.num_machines * len(shard)), dtype=torch.float64))
        used = weights.nonzero().squeeze(1)
        everything = len(used) == n
        # The whole training set the shards index: for per-machine gradients (heterogeneity) and the
        # optimum's cache key.
        self.train_x, self.train_y = data.train_x, data.train_y
        # Large inputs (MNIST: 188 MB) are not copied: f is evaluated on all of them and the rows of the
        # used samples are kept from the product. A matrix product computes every row on its own, so
        # those rows are bitwise the product of the used rows alone, and a run's set-up saves the copy.
        self._rows: Optional[Tensor] = None if everything else used
        if len(used) * (data.train_x.numel() // max(1, n)) <= FLOAT64_LIMIT:
            self.x = (data.train_x if everything else data.train_x[used]).double()
            self._rows = None
        else:
            self.x = data.train_x
        self.y = (data.train_y if everything else data.train_y[used]).to(torch.int64 if loss == "cross_entropy" else torch.float64)
        self.weights = weights if everything else weights[used]

    def share_to(self, device: torch.device, shared: dict[tuple, tuple[Tensor, Tensor, Tensor, Optional[Tensor]]]) -> None:
        """Move the samples f reads (inputs, labels, weights, the used rows) to ``device``, sharing them with
        the objectives already moved there whose split is the same (``shared``, keyed by the inputs'
        shape, the loss and the shards: one copy of each split's samples for several runs)."""
        digest = hashlib.sha256()
        for shard in self.shards:
            digest.update(shard.to(torch.int64).numpy().tobytes())
            digest.update(b"|")
        key = (tuple(self.x.shape), self.loss, digest.hexdigest())
        if key not in shared:
            rows = self._rows  # all inputs kept (large ones): the used samples' rows of the product
            shared[key] = (self.x.to(device), self.y.to(device), self.weights.to(device), None if rows is None else rows.to(device))
        self.x, self.y, self.weights, self._rows = shared[key]

    @property
    def exact(self) -> bool:
        """Whether f is evaluated in float64 throughout (inputs kept in float64)."""
        return self.x.dtype == torch.float64

    def inputs64(self) -> Tensor:
        """The used samples' inputs in float64 (a new tensor unless they are kept so): the solver's."""
        return (self.x if self._rows is None else self.x[self._rows]).double()

    def _value(self, x: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
        return self.value_from_logits(torch.addmm(bias.to(x.dtype), x, weight.to(x.dtype).T), weight, bias)

    def value_from_logits(self, logits: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
        """f from the logits of the inputs ``x`` at (weight, bias): of the used samples, or of all inputs
        (``self.x`` when large), whose used samples' rows are kept."""
        if self._rows is not None and len(logits) != len(self.y):  # all inputs: keep the used samples' rows
            logits = logits[self._rows]
        value = (self.weights * _loss(self.loss, logits.double(), self.y)).sum()
        if self.weight_decay:
            value = value + 0.5 * self.weight_decay * (weight.double().square().sum() + bias.double().square().sum())
        return value

    @torch.no_grad()
    def __call__(self, params: dict[str, Tensor]) -> float:
        """f at ``params`` (``{"weight": ..., "bias": ...}``, any float dtype, on any device), as a float.

        f is evaluated where the objective's samples are (the CPU): a model trained on a GPU is copied there.
        """
        device = self.x.device
        return float(self._value(self.x, params["weight"].detach().to(device), params["bias"].detach().to(device)))

    def value_and_grad64(self, params: dict[str, Tensor], x64: Optional[Tensor] = None) -> tuple[Tensor, list[Tensor]]:
        """f and its gradient in float64 at ``params`` (on the float64 inputs ``x64``, made when not given)."""
        x64 = self.inputs64() if x64 is None else x64
        weight = params["weight"].detach().double().requires_grad_()
        bias = params["bias"].detach().double().requires_grad_()
        with torch.enable_grad():
            value = self._value(x64, weight, bias)
            grads = torch.autograd.grad(value, [weight, bias])
        return value.detach(), list(grads)


def affine_rows(x: Tensor, weights: list[Tensor], biases: list[Tensor], rows: Optional[int] = None) -> list[Tensor]:
    """``addmm(bias_i, x, weight_i.T)`` for every i, each equal to that one call bit for bit, with ``x`` read
    once: in blocks of ``rows`` rows (default 2,048 on the CPU, where one block stays in cache for all of
    them; all rows at once on a GPU). A row of a product does not depend on the other rows'."""
    if rows is None:
        rows = 2048 if x.device.type == "cpu" else max(1, len(x))
    outs = [x.new_empty((len(x), w.shape[0])) for w in weights]
    for start in range(0, len(x), rows):
        block = x[start : start + rows]
        for out, w, b in zip(outs, weights, biases):
            torch.addmm(b.to(x.dtype), block, w.to(x.dtype).T, out=out[start : start + rows])
    return outs


@torch.no_grad()
def values(objectives: list[Objective], points: list[dict[str, Tensor]]) -> list[float]:
    """``objectives[i](points[i])`` for every i, bit for bit, in one pass over inputs they share (the same
    tensor ``x``: the trials of a stacked group, each with its own split's weights)."""
    out: list[float] = [0.0] * len(objectives)
    by_input: dict[int, list[int]] = {}
    for i, objective in enumerate(objectives):
        by_input.setdefault(id(objective.x), []).append(i)
    for members in by_input.values():
        x = objectives[members[0]].x
        weights = [points[i]["weight"].detach() for i in members]
        biases = [points[i]["bias"].detach() for i in members]
        for i, w, b, logits in zip(members, weights, biases, affine_rows(x, weights, biases)):
            out[i] = float(objectives[i].value_from_logits(logits, w, b))
    return out


def heterogeneity(objective: Objective, params: dict[str, Tensor]) -> float:
    """G_*^2 = 2 (1/M) sum_i ||grad f_i(x)||^2 at ``params`` (x*), in float64. Returns G_* (not squared)."""
    total = 0.0
    weight = params["weight"].detach().double()
    bias = params["bias"].detach().double()
    for shard in objective.shards:
        w, b = weight.clone().requires_grad_(), bias.clone().requires_grad_()
        with torch.enable_grad():
            logits = torch.addmm(b, objective.train_x[shard].double(), w.T)
            y = objective.train_y[shard].to(objective.y.dtype)
            value = _loss(objective.loss, logits, y).mean()
            if objective.weight_decay:
                value = value + 0.5 * objective.weight_decay * (w.square().sum() + b.square().sum())
            grads = torch.autograd.grad(value, [w, b])
        total += float(sum(g.square().sum() for g in grads))
    return math.sqrt(2.0 * total / objective.num_machines)

