"""The optimum x* of the training objective f in float64, found by Newton-CG and cached on disk.

``solve`` finds x* in float64 by Newton's method from x = 0: conjugate gradients on exact
Hessian-vector products, preconditioned by the Hessian's diagonal and, once that is too slow, by the
whole Hessian factorised; a line search on f far from x*, unit steps near it. It stops when
||grad f(x)||_2 <= ``tol`` (default 1e-8); with lambda > 0, f is lambda-strongly convex and then
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

f itself, and G_* at x*, are ``lit_slowcal.experiments.measure.objective``'s.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from lit_slowcal.experiments.measure.objective import Objective
from lit_slowcal.files import atomic_path

__all__ = ["Optimum", "cache_key", "default_cache_dir", "optimum", "solve"]

#: Part of every cache key: bump it when the solver's result for the same inputs changes.
SOLVER_VERSION = 2
#: The solver preconditions with the whole Hessian only up to this many entries (MNIST: 7,850^2 = 62M, 490 MB).
HESSIAN_LIMIT = 2**26


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
    cg_iterations: int = 0  # conjugate-gradient iterations (Hessian-vector products) of the Newton steps

    @property
    def converged(self) -> bool:
        return self.grad_norm <= self.tol

    @property
    def params(self) -> dict[str, Tensor]:
        return {"weight": self.weight, "bias": self.bias}


class _Newton:
    """f, its gradient, Hessian-vector products and the Hessian of the linear model in closed form, in float64.

    The parameters are ``theta = [W | b]``, ``(outputs, d + 1)``; X~ = [X | 1]. For the cross-entropy,
    with P = softmax(logits) and U = X V^T + v_b the logits' change along ``(V, v_b)``, the logits'
    gradient changes by P * U - P * (sum_k P * U); for the squared loss by U.
    """

    def __init__(self, objective: Objective, x64: Tensor, outputs: int) -> None:
        self.x, self.y, self.w = x64, objective.y, objective.weights
        self.lam, self.cross_entropy = objective.weight_decay, objective.loss == "cross_entropy"
        self.outputs = outputs
        self.onehot = F.one_hot(self.y, outputs).double() if self.cross_entropy else None
        self._squares: Optional[Tensor] = None

    def _back(self, logits_grad: Tensor, theta: Tensor) -> Tensor:
        """X~^T R + lambda theta for the per-sample logit gradients R ``(n, outputs)``."""
        return torch.cat([logits_grad.T @ self.x, logits_grad.sum(0)[:, None]], 1) + self.lam * theta

    def _logits(self, theta: Tensor) -> Tensor:
        return torch.addmm(theta[:, -1], self.x, theta[:, :-1].T)

    def _curvature(self, p: Tensor) -> Tensor:
        """The diagonal of each sample's logit Hessian, times its weight."""
        return self.w[:, None] * p * (1 - p) if self.cross_entropy else self.w[:, None]

    def evaluate(self, theta: Tensor) -> tuple[float, Tensor, Tensor]:
        """f, grad f and P (the cross-entropy's probabilities; for the squared loss, empty)."""
        logits = self._logits(theta)
        penalty = 0.5 * self.lam * theta.square().sum()
        if self.cross_entropy:
            lse = torch.logsumexp(logits, 1)
            value = (self.w * (lse - logits.gather(1, self.y[:, None])[:, 0])).sum() + penalty
            p = torch.exp(logits - lse[:, None])
            return float(value), self._back(self.w[:, None] * (p - self.onehot), theta), p
        residual = logits[:, 0] - self.y
        value = 0.5 * (self.w * residual.square()).sum() + penalty
        return float(value), self._back((self.w * residual)[:, None], theta), logits.new_empty(0)

    def hvp(self, p: Tensor, v: Tensor) -> Tensor:
        """The Hessian at the point of P times ``v`` ``(outputs, d + 1)``."""
        u = self._logits(v)
        if self.cross_entropy:
            pu = p * u
            u = pu - p * pu.sum(1, keepdim=True)
        return self._back(self.w[:, None] * u, v)

    def diagonal(self, p: Tensor) -> Tensor:
        """The Hessian's diagonal (Jacobi preconditioner)."""
        if self._squares is None:
            self._squares = self.x.square()
        s = self._curvature(p)
        return torch.cat([s.T @ self._squares, s.sum(0)[:, None]], 1) + self.lam

    def _gram(self, rows: Optional[Tensor], s: Tensor) -> Tensor:
        """X~^T diag(s) X~ over the samples ``rows`` (all: ``None``), ``(d + 1)^2``."""
        x = self.x if rows is None else self.x[rows]
        scaled = x * s[:, None]
        gram = x.new_empty(x.shape[1] + 1, x.shape[1] + 1)
        gram[:-1, :-1] = x.T @ scaled
        gram[-1, :-1] = gram[:-1, -1] = scaled.sum(0)
        gram[-1, -1] = s.sum()
        return gram

    def hessian(self, p: Tensor, drop: float = 1e-10) -> Tensor:
        """The Hessian, ``(outputs (d + 1))^2``.

        For the cross-entropy, block (c, k), c != k, is -X~^T diag(w p_c p_k) X~, and block (c, c)
        is minus the sum of the others in its row (each sample's logit Hessian diag(p) - p p^T has
        rows summing to 0): only the outputs (outputs - 1) / 2 blocks below the diagonal are
        computed, each over the samples with p_c p_k >= ``drop``. Dropping a pair keeps each
        sample's matrix a graph Laplacian (positive semi-definite), and the dropped part has a norm
        of at most ``drop`` outputs (outputs - 1) max_j ||x~_j||^2 sum_j w_j (MNIST: 2.2e-5, a fifth of
        lambda = 1e-4): a preconditioner, not the exact Hessian (``hvp`` is exact).
        """
        m = self.x.shape[1] + 1
        if not self.cross_entropy:
            return self._gram(None, self.w) + self.lam * torch.eye(m, dtype=torch.float64)
        hess = torch.zeros(self.outputs * m, self.outputs * m, dtype=torch.float64)
        for c in range(self.outputs):
            for k in range(c):
                pair = p[:, c] * p[:, k]
                rows = (pair >= drop).nonzero().squeeze(1)
                gram = self._gram(rows, self.w[rows] * pair[rows])
                hess[c * m : (c + 1) * m, k * m : (k + 1) * m] = -gram
                hess[k * m : (k + 1) * m, c * m : (c + 1) * m] = -gram
                hess[c * m : (c + 1) * m, c * m : (c + 1) * m] += gram
                hess[k * m : (k + 1) * m, k * m : (k + 1) * m] += gram
        hess.diagonal().add_(self.lam)
        return hess


def _dot(a: Tensor, b: Tensor) -> float:
    return float((a * b).sum())


def _cholesky_apply(factor: Tensor, r: Tensor) -> Tensor:
    """H^-1 r for H = factor factor^T (``r`` shaped like theta)."""
    return torch.cholesky_solve(r.reshape(-1, 1), factor).reshape(r.shape)


def _pcg(
    hvp: Callable[[Tensor], Tensor],
    grad: Tensor,
    precondition: Callable[[Tensor], Tensor],
    target: float,
    max_iter: int,
) -> tuple[Tensor, int]:
    """s with ||H s + grad|| <= ``target`` by preconditioned conjugate gradients from 0: (s, iterations)."""
    step = torch.zeros_like(grad)
    residual = -grad
    z = precondition(residual)
    direction = z.clone()
    rz = _dot(residual, z)
    for iteration in range(1, max_iter + 1):
        hd = hvp(direction)
        curvature = _dot(direction, hd)
        if curvature <= 0:  # (lambda = 0 and a flat direction): stop with what we have
            return (step if iteration > 1 else -grad), iteration
        alpha = rz / curvature
        step.add_(direction, alpha=alpha)
        residual.sub_(hd, alpha=alpha)
        if float(residual.norm()) <= target:
            return step, iteration
        z = precondition(residual)
        rz, previous = _dot(residual, z), rz
        direction.mul_(rz / previous).add_(z)
    return step, max_iter


def _factorised(model: _Newton, p: Tensor, previous: Optional[Tensor]) -> Optional[Tensor]:
    """The Cholesky factor of the whole Hessian at P, or ``previous`` where it has none."""
    factor, info = torch.linalg.cholesky_ex(model.hessian(p))
    return factor if info == 0 else previous  # (lambda = 0: H may be singular; keep what we had)


def _preconditioner(model: _Newton, p: Tensor, factor: Optional[Tensor]) -> Callable[[Tensor], Tensor]:
    """r -> H^-1 r by the whole Hessian's Cholesky factor where there is one, else by the Hessian's diagonal at P."""
    if factor is not None:
        return partial(_cholesky_apply, factor)
    return partial(torch.div, other=model.diagonal(p))


def _newton_step(
    model: _Newton, theta: Tensor, value: float, grad: Tensor, p: Tensor,
    precondition: Callable[[Tensor], Tensor], target: float, max_cg: int,
) -> tuple[Tensor, int, bool]:  # fmt: skip
    """theta after one Newton step from theta (where f is ``value``, grad f ``grad``): the step s with
    ||H s + grad f|| <= ``target`` by ``_pcg``, times a step length. Returns (the new theta, CG
    iterations, whether the step's predicted decrease of f was resolved in float64)."""
    step, used = _pcg(lambda v: model.hvp(p, v), grad, precondition, target, max_cg)
    slope = _dot(grad, step)
    # Armijo on f, unless the predicted decrease is below what float64 resolves of f: then unit
    # steps, which must keep cutting ||grad f|| (the caller ends the solve after three misses in a row).
    resolved = -slope > 1e-12 * max(1.0, abs(value))
    length = 1.0
    while resolved and length > 1e-10 and model.evaluate(theta + length * step)[0] > value + 1e-4 * length * slope:
        length *= 0.5
    return theta + length * step, used, resolved


def _result(
    objective: Objective, theta: Tensor, x64: Tensor, tol: float, iterations: int, cg_iterations: int, began: float
) -> Optimum:
    """The ``Optimum`` at theta, with f and ||grad f|| recomputed by autograd (``Objective.value_and_grad64``)."""
    weight, bias = theta[:, :-1].contiguous(), theta[:, -1].contiguous()
    value64, grads = objective.value_and_grad64({"weight": weight, "bias": bias}, x64)
    return Optimum(
        weight=weight, bias=bias, value=float(value64), grad_norm=float(torch.cat([g.reshape(-1) for g in grads]).norm()),
        tol=tol, iterations=iterations, seconds=time.perf_counter() - began, cg_iterations=cg_iterations,
    )  # fmt: skip


def solve(
    objective: Objective,
    shape: tuple[int, int],
    tol: float = 1e-8,
    max_iter: int = 100,
    progress: Optional[Callable[[int, float, float], None]] = None,
    start: Optional[Optimum] = None,
    max_cg: int = 500,
    refresh: int = 40,
) -> Optimum:
    """x* of ``objective`` by Newton's method in float64 from 0, until ||grad f||_2 <= ``tol`` or ``max_iter`` Newton steps.

    ``shape`` is the weight's ``(outputs, d)``. Each Newton step solves H s = -grad f by
    preconditioned conjugate gradients (``_pcg``) on exact Hessian-vector products (closed form,
    ``_Newton``) to a relative residual of min(0.5, sqrt(||grad f||)) (superlinear convergence), or to
    ``tol`` / 4 when that is larger; then a backtracking (Armijo) line search on f (``_newton_step``).
    Near x* the predicted decrease falls below float64's resolution of f and the unit step is taken:
    Newton's convergence there does not need a measurable decrease of f, and the stopping test is on
    ||grad f||. The preconditioner is the Hessian's diagonal until a step needs more than ``refresh``
    CG iterations (MNIST near x*: hundreds); then the whole Hessian at the new point, factorised once
    (Cholesky), preconditions every later step, and is computed anew when a step needs more than
    ``refresh`` iterations again (up to ``HESSIAN_LIMIT`` entries; MNIST: 45 weighted Gram matrices of
    the inputs, ``_Newton.hessian``; then a few CG iterations per step). The squared loss's f is
    quadratic: one Newton step (plus, at most, one that corrects rounding). At most ``max_cg`` CG
    iterations per step.

    Deterministic: same inputs, same x*. The reported f* and ||grad f(x*)|| are recomputed at the
    end by ``Objective.value_and_grad64`` (autograd), and the result says whether it converged
    (``Optimum.converged``). ``progress(newton steps, f, ||grad f||)`` is called after every step.
    ``start``: begin at a previous result instead of 0 (and with the whole Hessian as preconditioner).
    """
    began = time.perf_counter()
    x64 = objective.inputs64()
    model = _Newton(objective, x64, shape[0])
    theta = torch.zeros(shape[0], shape[1] + 1, dtype=torch.float64)
    if start is not None:
        theta[:, :-1], theta[:, -1] = start.weight, start.bias
    whole = (shape[0] * (shape[1] + 1)) ** 2 <= HESSIAN_LIMIT
    iterations = cg_iterations = misses = 0
    value, grad, p = model.evaluate(theta)
    grad_norm = float(grad.norm())
    best = (grad_norm, theta)
    # The Cholesky factor of a whole Hessian, once one is needed; at once from a previous result (near x*).
    hessian = _factorised(model, p, None) if start is not None and whole and grad_norm > tol else None
    while iterations < max_iter and grad_norm > tol and misses < 3:
        forcing = 0.0 if objective.loss == "squared" else min(0.5, math.sqrt(grad_norm))
        target = max(forcing * grad_norm, tol / 4)
        theta, used, resolved = _newton_step(
            model, theta, value, grad, p, _preconditioner(model, p, hessian), target, max_cg
        )
        cg_iterations += used
        value, grad, p = model.evaluate(theta)
        grad_norm = float(grad.norm())
        iterations += 1
        misses = 0 if resolved or grad_norm < best[0] else misses + 1
        if resolved or grad_norm < best[0]:
            best = (grad_norm, theta)
        if used > refresh and grad_norm > tol and whole:
            hessian = _factorised(model, p, hessian)
        if progress is not None:
            progress(iterations, value, grad_norm)
    return _result(objective, best[1], x64, tol, iterations, cg_iterations, began)


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/lit_slowcal``, else ``~/.cache/lit_slowcal``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "lit_slowcal"


def cache_key(objective: Objective, identity: dict[str, Any]) -> str:
    """SHA-256 of everything x* depends on (see the module docstring)."""
    h = hashlib.sha256()
    meta = {
        "identity": identity,
        "loss": objective.loss,
        "weight_decay": objective.weight_decay,
        "solver": SOLVER_VERSION,
    }
    h.update(json.dumps(meta, sort_keys=True, default=str).encode())
    for shard in objective.shards:
        h.update(len(shard).to_bytes(8, "little"))
        h.update(shard.to(torch.int64).numpy().tobytes())
    h.update(objective.train_y.numpy().tobytes())
    x = objective.train_x
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
    max_iter: int = 100,
    progress: Optional[Callable[[int, float, float], None]] = None,
    solving: Optional[Callable[[Path], None]] = None,
) -> tuple[Optimum, Path, bool]:
    """``solve``'s result from the cache, or solved and cached: ``(optimum, cache file, whether it was cached)``.

    ``identity`` names the problem and its settings (part of the key, and stored in the file). A
    cached optimum serves every request with a tolerance it meets; one that does not meet ``tol``
    is the solver's starting point (its time and iterations add up), and the better result replaces it.
    Before a solve, the cache folder is checked (``OSError`` naming it when the result could not be
    stored there) and ``solving(cache file)`` is called.
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
    try:  # before the solve, not after it: its result is stored there
        path.parent.mkdir(parents=True, exist_ok=True)
        writable = os.access(path.parent, os.W_OK | os.X_OK)
    except OSError as err:
        raise OSError(
            f"--cache_dir {folder}: cannot create {path.parent} ({err.strerror or err}); pass --cache_dir <a writable folder>"
        ) from None
    if not writable:
        raise OSError(f"--cache_dir {folder}: {path.parent} is not writable; pass --cache_dir <a writable folder>")
    if solving is not None:
        solving(path)
    found = solve(objective, shape, tol=tol, max_iter=max_iter, progress=progress, start=start)
    if start is not None:
        found = replace(
            found, iterations=start.iterations + found.iterations, cg_iterations=start.cg_iterations + found.cg_iterations,
            seconds=start.seconds + found.seconds,
        )  # fmt: skip
        if found.grad_norm >= start.grad_norm:
            return found, path, False
    with atomic_path(path) as tmp:
        torch.save({"key": key, "identity": identity, "optimum": asdict(found)}, tmp)
    return found, path, False
