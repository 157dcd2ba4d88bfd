"""The global training objective f, its optimum x* (cached on disk) and the heterogeneity G_*.

The paper's guarantees bound the excess loss f(x) - f(x*) of

    f(x) = (1/M) sum_i f_i(x),   f_i(x) = (1/n_i) sum_{j in shard i} loss(x; z_j) + (lambda/2) ||x||^2,

the average over machines of each machine's mean loss on its whole shard; a sample of a machine
with n_i samples weighs 1/(M n_i), so x* depends on the split, not only on the data. lambda is
``model.weight_decay``, and the penalty covers every parameter, the bias included, exactly as the
training update does (``SlowcalSGD`` and ``torch.optim.SGD`` add lambda x to every gradient).

``Objective`` evaluates f for the linear model of ``lit_slowcal.experiments.model`` in one pass over
all shards (one matrix product), with float64 reductions. Problems up to 2^24 input values keep a
float64 copy of their inputs and are exact to float64; larger ones (MNIST: 47M) keep the float32
inputs, and the logits of one float32 product carry a relative error of about 1e-7 (measured on
MNIST at x*: 2e-8 in f).

``solve`` finds x* in float64 with L-BFGS (strong Wolfe line search) from x = 0 and stops when
||grad f(x)||_2 <= ``tol``; with lambda > 0, f is lambda-strongly convex and then
f(x) - f* <= ||grad f(x)||^2 / (2 lambda). ``optimum`` caches the result under
``<cache_dir>/optima/`` (default cache folder ``$XDG_CACHE_HOME/lit_slowcal``, else
``~/.cache/lit_slowcal``; ``--cache_dir`` to choose), keyed by a SHA-256 of everything x* depends
on: the problem and its settings, every machine's sample indices, the labels, a fingerprint of the
inputs, lambda and the solver's version. A sweep pays for each optimum once; a cached optimum
serves any tolerance it meets, and is the starting point of a solve to a tighter one.

Unregularised MNIST has no minimiser: 33 pixels are non-zero only in images of one class, so
raising that class's weight on them lowers f without limit (L-BFGS reaches f = 0.2119 at
||W|| = 75, then f = 0.1998 at ||W|| ~ 6,500, still falling). No f* is presented there
(``Problem.attained_without_weight_decay``); lambda = 1e-4 makes f strongly convex with an attained x*.
A small gradient alone proves nothing there: on separable data ||grad f|| -> 0 as ||x|| grows.

``heterogeneity`` gives G_*^2 = 2 (1/M) sum_i ||grad f_i(x*)||^2, the smallest G_* of the paper's
G_*-dissimilarity assumption (1/M) sum_i ||grad f_i(x*)||^2 <= G_*^2 / 2.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from lit_slowcal.experiments.problems import ProblemData
from lit_slowcal.files import atomic_path

__all__ = ["Objective", "Optimum", "affine_rows", "default_cache_dir", "heterogeneity", "optimum", "solve", "values"]

#: Part of every cache key: bump it when the solver's result for the same inputs changes.
SOLVER_VERSION = 1
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
        self._train_x = data.train_x  # for per-machine gradients (heterogeneity)
        self._train_y = data.train_y
        x = data.train_x if everything else data.train_x[used]
        self.x = x.double() if x.numel() <= FLOAT64_LIMIT else x
        self.y = (data.train_y if everything else data.train_y[used]).to(torch.int64 if loss == "cross_entropy" else torch.float64)
        self.weights = weights if everything else weights[used]

    @property
    def exact(self) -> bool:
        """Whether f is evaluated in float64 throughout (inputs kept in float64)."""
        return self.x.dtype == torch.float64

    def _value(self, x: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
        return self._value_of(torch.addmm(bias.to(x.dtype), x, weight.to(x.dtype).T), weight, bias)

    def _value_of(self, logits: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
        """f from the logits of the inputs ``self.x`` at (weight, bias)."""
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
        x64 = self.x.double() if x64 is None else x64
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
            out[i] = float(objectives[i]._value_of(logits, w, b))
    return out


@dataclass(frozen=True)
class Optimum:
    """x* and f* = f(x*) in float64, with how the solver got there."""

    weight: Tensor
    bias: Tensor
    value: float
    grad_norm: float
    tol: float
    iterations: int
    seconds: float

    @property
    def converged(self) -> bool:
        return self.grad_norm <= self.tol

    @property
    def params(self) -> dict[str, Tensor]:
        return {"weight": self.weight, "bias": self.bias}


def solve(
    objective: Objective,
    shape: tuple[int, int],
    tol: float = 1e-8,
    max_iter: int = 10_000,
    progress: Optional[Callable[[int, float, float], None]] = None,
    start: Optional[Optimum] = None,
) -> Optimum:
    """x* of ``objective`` by L-BFGS in float64 from 0, until ||grad f||_2 <= ``tol`` or ``max_iter`` iterations.

    ``shape`` is the weight's ``(outputs, d)``. Two phases: L-BFGS with a strong Wolfe line search
    until it reaches ``tol`` or stalls, which it does once f's decrease is below float64's resolution
    of f (||grad f|| ~ sqrt(2 L eps f), a few 1e-8 on MNIST); then L-BFGS steps of length 1 without a
    line search, which need no measurable decrease of f, keeping the point of least gradient norm.
    Deterministic: same inputs, same x*. The result says whether it converged (``Optimum.converged``).
    ``progress(iterations, f, ||grad f||)`` is called every 25 iterations. ``start``: begin at a
    previous result instead of 0.
    """
    began = time.perf_counter()
    x64 = objective.x.double()
    weight = torch.zeros(shape, dtype=torch.float64)
    bias = torch.zeros(shape[0], dtype=torch.float64)
    if start is not None:
        weight.copy_(start.weight)
        bias.copy_(start.bias)
    params = [weight.requires_grad_(), bias.requires_grad_()]
    chunk = 25  # iterations between checks of the 2-norm (LBFGS's own test is on the largest entry)

    def closure() -> Tensor:
        for p in params:
            p.grad = None
        value = objective._value(x64, weight, bias)
        value.backward()
        return value

    def norm() -> tuple[float, float]:
        value, grads = objective.value_and_grad64({"weight": weight, "bias": bias}, x64)
        return float(value), float(torch.cat([g.reshape(-1) for g in grads]).norm())

    iterations = 0
    value, grad_norm = norm()
    best = (grad_norm, value, [p.detach().clone() for p in params])
    for line_search in ("strong_wolfe", None):
        optimizer = torch.optim.LBFGS(
            params, lr=1, max_iter=chunk, max_eval=20 * chunk, history_size=100, line_search_fn=line_search,
            tolerance_grad=0.0, tolerance_change=0.0,
        )  # fmt: skip
        misses = 0
        while iterations < max_iter and best[0] > tol and misses < 4:
            before = optimizer.state[weight].get("n_iter", 0)  # LBFGS keeps its state under the first parameter
            optimizer.step(closure)
            done = optimizer.state[weight]["n_iter"] - before
            value, grad_norm = norm()
            # Unit steps must keep cutting the gradient norm (by 10 % a chunk); the line search phase
            # ends only when it stalls (its gradient norm need not fall monotonically).
            misses = 0 if line_search or grad_norm < 0.9 * best[0] else misses + 1
            if grad_norm < best[0]:
                best = (grad_norm, value, [p.detach().clone() for p in params])
            if progress is not None:
                progress(iterations + done, value, grad_norm)
            stalled = done < chunk  # the line search found no decrease (or the gradient is exactly 0)
            iterations += done
            if line_search and stalled:
                break
        with torch.no_grad():
            for p, b in zip(params, best[2]):
                p.copy_(b)
    grad_norm, value, (w, b) = best
    return Optimum(
        weight=w, bias=b, value=value, grad_norm=grad_norm, tol=tol, iterations=iterations,
        seconds=time.perf_counter() - began,
    )  # fmt: skip


def heterogeneity(objective: Objective, params: dict[str, Tensor]) -> float:
    """G_*^2 = 2 (1/M) sum_i ||grad f_i(x)||^2 at ``params`` (x*), in float64. Returns G_* (not squared)."""
    total = 0.0
    weight = params["weight"].detach().double()
    bias = params["bias"].detach().double()
    for shard in objective.shards:
        w, b = weight.clone().requires_grad_(), bias.clone().requires_grad_()
        with torch.enable_grad():
            logits = torch.addmm(b, objective._train_x[shard].double(), w.T)
            y = objective._train_y[shard].to(objective.y.dtype)
            value = _loss(objective.loss, logits, y).mean()
            if objective.weight_decay:
                value = value + 0.5 * objective.weight_decay * (w.square().sum() + b.square().sum())
            grads = torch.autograd.grad(value, [w, b])
        total += float(sum(g.square().sum() for g in grads))
    return math.sqrt(2.0 * total / objective.num_machines)


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/lit_slowcal``, else ``~/.cache/lit_slowcal``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "lit_slowcal"


def cache_key(objective: Objective, identity: dict[str, Any]) -> str:
    """SHA-256 of everything x* depends on (see the module docstring)."""
    h = hashlib.sha256()
    meta = {"identity": identity, "loss": objective.loss, "weight_decay": objective.weight_decay, "solver": SOLVER_VERSION}
    h.update(json.dumps(meta, sort_keys=True, default=str).encode())
    for shard in objective.shards:
        h.update(len(shard).to_bytes(8, "little"))
        h.update(shard.to(torch.int64).numpy().tobytes())
    h.update(objective._train_y.numpy().tobytes())
    x = objective._train_x
    fingerprint = torch.stack([x.double().sum(), x[:: max(1, len(x) // 1000)].double().square().sum()])
    h.update(fingerprint.numpy().tobytes())
    h.update(str(tuple(x.shape)).encode())
    return h.hexdigest()


def optimum(
    objective: Objective,
    shape: tuple[int, int],
    identity: dict[str, Any],
    cache_dir: Optional[str | Path] = None,
    tol: float = 1e-8,
    max_iter: int = 10_000,
    progress: Optional[Callable[[int, float, float], None]] = None,
) -> tuple[Optimum, Path, bool]:
    """``solve``'s result from the cache, or solved and cached: ``(optimum, cache file, whether it was cached)``.

    ``identity`` names the problem and its settings (part of the key, and stored in the file). A
    cached optimum serves every request with a tolerance it meets; one that does not meet ``tol``
    is the solver's starting point (its time and iterations add up), and the better result replaces it.
    """
    folder = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    key = cache_key(objective, identity)
    path = folder / "optima" / f"{key[:32]}.pt"
    start: Optional[Optimum] = None
    if path.exists():
        try:
            stored = torch.load(path, map_location="cpu", weights_only=True)
            if stored.get("key") == key:
                start = Optimum(**stored["optimum"])
        except Exception:  # an unreadable or foreign file: solve again and replace it
            pass
    if start is not None and start.grad_norm <= tol:
        return replace(start, tol=tol), path, True
    found = solve(objective, shape, tol=tol, max_iter=max_iter, progress=progress, start=start)
    if start is not None:
        found = replace(found, iterations=start.iterations + found.iterations, seconds=start.seconds + found.seconds)
        if found.grad_norm >= start.grad_norm:
            return found, path, False
    with atomic_path(path) as tmp:
        torch.save({"key": key, "identity": identity, "optimum": asdict(found)}, tmp)
    return found, path, False
