"""The global training objective f of the linear model, its values for many points at once, and the heterogeneity G_*.

The paper's guarantees bound the excess loss f(x) - f(x*) of

    f(x) = (1/M) sum_i f_i(x),   f_i(x) = (1/n_i) sum_{j in shard i} loss(x; z_j) + (lambda/2) ||x||^2,

the average over machines of each machine's mean loss on its whole shard; a sample of a machine
with n_i samples weighs 1/(M n_i), so x* depends on the split, not only on the data. lambda is
``model.weight_decay``, and the penalty covers every parameter, the bias included, exactly as the
training update does (``SlowcalSGD`` and ``torch.optim.SGD`` add lambda x to every gradient).

``Objective`` evaluates f for the linear model of ``lit_slowcal.experiments.train.model`` in float64 throughout,
for one point or for many at once (``values``: the trials of a stacked group evaluated at a step), in
one pass over the training inputs arranged by ``lit_slowcal.experiments.measure.float64_product``. The logits of one
point are the same, to within the float64 bound stated there, whatever other points share the pass
(measured on MNIST: equal, or within 1e-15 relative).

Its optimum x* and f* = f(x*), in float64 and cached on disk, are ``lit_slowcal.experiments.measure.optimum``'s.

``heterogeneity`` gives G_*^2 = 2 (1/M) sum_i ||grad f_i(x*)||^2, the smallest G_* of the paper's
G_*-dissimilarity assumption (1/M) sum_i ||grad f_i(x*)||^2 <= G_*^2 / 2.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from lit_slowcal.experiments.data.problems import ProblemData
from lit_slowcal.experiments.measure.float64_product import BlockedInputs, prepared

__all__ = ["Objective", "affine_rows", "heterogeneity", "values"]

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
        image: ``(height, width)`` when each input is an image (``Problem.image``): the samples' order in the
            product (``lit_slowcal.experiments.measure.float64_product``), not the value.
    """

    def __init__(
        self, data: ProblemData, loss: str, weight_decay: float = 0.0, image: Optional[tuple[int, int]] = None
    ) -> None:
        if loss not in LOSSES:
            raise ValueError(f"Invalid loss: {loss!r} (allowed: {', '.join(LOSSES)})")
        self.loss = loss
        self.weight_decay = float(weight_decay)
        self.image = image
        self.shards = data.shards
        self.num_machines = len(data.shards)
        n = len(data.train_y)
        weights = torch.zeros(n, dtype=torch.float64)
        for shard in data.shards:
            if len(shard):
                weights.index_add_(
                    0, shard, torch.full((len(shard),), 1.0 / (self.num_machines * len(shard)), dtype=torch.float64)
                )
        used = weights.nonzero().squeeze(1)
        everything = len(used) == n
        # The whole training set the shards index: for per-machine gradients (heterogeneity) and the
        # optimum's cache key.
        self.train_x, self.train_y = data.train_x, data.train_y
        # f reads every input as it is (MNIST: 188 MB, not copied), a sample the split leaves out with weight
        # 0: so the objectives of every split of these inputs share one arrangement of them (``inputs``).
        self.x = data.train_x
        labels = data.train_y.to(torch.int64 if loss == "cross_entropy" else torch.float64)
        self._all = (labels, weights)  # every sample's label and weight
        # The used samples' rows, labels and weights: the solver's (``inputs64``, ``value_and_grad64``).
        self._rows: Optional[Tensor] = None if everything else used
        self.y = labels if everything else labels[used]
        self.weights = weights if everything else weights[used]
        self._in_order: Optional[tuple[BlockedInputs, Tensor, Tensor]] = (
            None  # (inputs, labels, weights) in their row order
        )

    def share_to(self, device: torch.device, shared: dict[tuple, Any]) -> None:
        """Move the samples f reads to ``device``, sharing them with the objectives already moved there
        (``shared``): the inputs with every objective of the same inputs, the labels and weights with those
        whose split is the same (keyed by the inputs' shape, the loss and the shards)."""
        digest = hashlib.sha256()
        for shard in self.shards:
            digest.update(shard.to(torch.int64).numpy().tobytes())
            digest.update(b"|")
        inputs_key = ("inputs", id(self.x), self.x.data_ptr())
        if inputs_key not in shared:
            shared[inputs_key] = self.x.to(device)
        key = (tuple(self.x.shape), self.loss, digest.hexdigest())
        if key not in shared:
            own = (self.y, self.weights, self._rows, *self._all)
            shared[key] = tuple(None if t is None else t.to(device) for t in own)
        self.x = shared[inputs_key]
        self.y, self.weights, self._rows, *all_samples = shared[key]
        self._all = tuple(all_samples)
        self._in_order = None

    def inputs(self) -> tuple[BlockedInputs, Tensor, Tensor]:
        """The inputs arranged for the products (shared with every objective of these inputs in this process,
        whatever its split), and this objective's labels and sample weights in their row order."""
        inputs = prepared(self.x, self.image)
        if self._in_order is None or self._in_order[0] is not inputs:
            labels, weights = self._all
            self._in_order = (inputs, inputs.sorted(labels), inputs.sorted(weights))
        return self._in_order

    def inputs64(self) -> Tensor:
        """The used samples' inputs in float64 (a new tensor unless they are kept so): the solver's."""
        return (self.x if self._rows is None else self.x[self._rows]).double()

    def _value(self, x64: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
        """f at (weight, bias) from the used samples' float64 inputs ``x64``, differentiable (the solver's)."""
        value = (self.weights * _loss(self.loss, torch.addmm(bias, x64, weight.T), self.y)).sum()
        if self.weight_decay:
            value = value + 0.5 * self.weight_decay * (weight.square().sum() + bias.square().sum())
        return value

    @torch.no_grad()
    def __call__(self, params: dict[str, Tensor]) -> float:
        """f at ``params`` (``{"weight": ..., "bias": ...}``, any float dtype, on any device), as a float.

        f is evaluated where the objective's samples are (the CPU): a model trained on a GPU is copied there.
        """
        return values([self], [params])[0]

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
    once: in blocks of ``rows`` rows (default 1,024 on the CPU, where one block stays in cache for all of
    them: 7.0 ms a point for 3 points on MNIST's test set, against 8.0 ms in blocks of 2,048; all rows at once
    on a GPU). A row of a product does not depend on the other rows'."""
    if rows is None:
        rows = 1024 if x.device.type == "cpu" else max(1, len(x))
    outs = [x.new_empty((len(x), w.shape[0])) for w in weights]
    for start in range(0, len(x), rows):
        block = x[start : start + rows]
        for out, w, b in zip(outs, weights, biases):
            torch.addmm(b.to(x.dtype), block, w.to(x.dtype).T, out=out[start : start + rows])
    return outs


@torch.no_grad()
def values(objectives: list[Objective], points: list[dict[str, Tensor]]) -> list[float]:
    """``objectives[i](points[i])`` for every i (each within the float64 bound of ``float64_product`` of its value
    alone), in one pass over the inputs the objectives share (the trials of a stacked group: one
    arrangement of the training inputs, each trial with its own split's weights)."""
    out: list[float] = [0.0] * len(objectives)
    arranged = [objective.inputs() for objective in objectives]  # (inputs, labels, sample weights) of each
    by_inputs: dict[tuple[int, str], list[int]] = {}
    for i, objective in enumerate(objectives):
        by_inputs.setdefault((id(arranged[i][0]), objective.loss), []).append(i)
    for members in by_inputs.values():
        inputs, y, _ = arranged[members[0]]
        device = inputs.center.device
        weight = torch.stack([points[i]["weight"].detach().to(device) for i in members])
        bias = torch.stack([points[i]["bias"].detach().to(device) for i in members])
        sample_weights = torch.stack([arranged[i][2] for i in members], 1)  # (n, P)
        loss = objectives[members[0]].loss
        total = torch.zeros(len(members), dtype=torch.float64, device=device)
        for start, stop, z in inputs.logits(weight, bias):
            total += (_point_losses(loss, z, y[start:stop]) * sample_weights[start:stop]).sum(0)
        for j, i in enumerate(members):
            value = total[j]
            decay = objectives[i].weight_decay
            if decay:
                value = value + 0.5 * decay * (weight[j].double().square().sum() + bias[j].double().square().sum())
            out[i] = float(value)
    return out


def _point_losses(loss: str, z: Tensor, y: Tensor) -> Tensor:
    """Per-sample losses ``(rows, P)`` of P points from their float64 logits ``z`` ``(rows, P, outputs)``.

    Cross-entropy is log sum_c exp(z_c - z_y), shifted by the label's logit (the terms stay below
    exp(709) unless a logit exceeds the label's by 709: then by the largest, as logsumexp does)."""
    if loss == "cross_entropy":
        label = z.gather(2, y.view(-1, 1, 1).expand(-1, z.shape[1], 1))
        out = torch.sub(z, label).exp_().sum(2).log_()
        if not bool(torch.isfinite(out).all()):
            top = z.amax(2, keepdim=True)
            out = torch.sub(z, top).exp_().sum(2).log_().add_(top.squeeze(2)).sub_(label.squeeze(2))
        return out
    return 0.5 * (z.squeeze(2) - y.unsqueeze(1)) ** 2


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
