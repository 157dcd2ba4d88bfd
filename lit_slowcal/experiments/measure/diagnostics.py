"""What the theory talks about, measured during a run: a Lightning callback the CLI adds to every fit.

At every evaluation (every ``eval_every`` rounds and after the last), of the synchronised model x:

``train_objective``
    f(x), the paper's global objective on every machine's whole shard (``lit_slowcal.experiments.measure.objective``).
``excess_loss``
    f(x) - f*, with x* and f* from the float64 solver (cached on disk). Only where f has an attained
    minimiser: with ``model.weight_decay = 0``, MNIST and Synthetic (softmax regression) have none,
    and the run says so once instead of presenting a number that is not an optimum.

Once per run, before training (logged at step 0, printed in the summary): ``f_star``, ``G_star``
(G_*^2 = 2 (1/M) sum_i ||grad f_i(x*)||^2 for the split in use) and ``optimum_grad_norm``.

Per round, with ``--diagnostics`` (averaged over the rounds or steps since the previous evaluation):

``dispersion``
    (1/M) sum_i ||x_i - x_bar||^2 over all parameters, just before each synchronisation (after the
    round's last local step), through the strategy's sync pre-hook: the drift of the machines that
    Local-SGD's bias comes from. With several processes, the part between processes is added once
    the round is over and the sums meet at the evaluation: no collective during training.
``query_step``, ``iterate_step``
    The machines' mean per-step movement ||x_{t+1} - x_t|| of the parameters (the query point, where
    gradients are taken), and, for an optimizer that keeps an iterate ``w`` in its state (SLowcal-SGD),
    ||w_{t+1} - w_t|| next to it: the paper's slow query points.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch import Tensor, nn

from lit_slowcal._validation import check_int
from lit_slowcal.experiments.measure.objective import Objective, heterogeneity
from lit_slowcal.experiments.measure.optimum import Optimum, optimum
from lit_slowcal.experiments.print_once import note
from lit_slowcal.protocol import declared
from lit_slowcal.simulated import SimulatedMachines

__all__ = ["Diagnostics"]


class Diagnostics(Callback):
    """Logs ``train_objective``, ``excess_loss`` (with ``f_star``, ``G_star``) and the per-round diagnostics.

    A Lightning callback whose hooks call its trainer-free methods, which a loop without a Trainer (the
    stacked trials, ``sweep.stacked``) calls itself: ``prepare`` (the objective and its optimum, before
    training: the metrics of step 0), ``attach`` / ``detach`` (the hooks on a model's machines, its
    averager and its optimizer), ``start_round`` / ``end_round``, and ``evaluate`` (the values to log
    at an evaluation).

    Args:
        objective: log the training objective, and compute x* (or read it from the cache) for the
            excess loss and G_*.
        per_round: log ``dispersion``, ``query_step`` and ``iterate_step``.
        step_every: measure the per-step movement in every ``step_every``-th round only (the first
            included; 0: never): copying x and w around every step would cost half a step (M = 16, K = 16).
        cache_dir: where optima are cached (``None``: ``optimum.default_cache_dir()``).
        tol: the solver's gradient-norm tolerance; with weight decay lambda > 0, f* is then exact to
            tol^2 / (2 lambda) (strong convexity; MNIST, lambda = 1e-4: 5e-13).
    """

    def __init__(
        self,
        objective: bool = True,
        per_round: bool = True,
        step_every: int = 10,
        cache_dir: Optional[str] = None,
        tol: float = 1e-8,
    ) -> None:
        self.measure_objective = objective
        self.per_round = per_round
        self.step_every = check_int("step_every", step_every, minimum=0)
        self._armed = False
        self.cache_dir = cache_dir
        self.tol = tol
        self.objective: Optional[Objective] = None
        self.optimum: Optional[Optimum] = None
        self.g_star: Optional[float] = None
        self.note: Optional[str] = None  # why there is no excess loss, when there is none
        self.cached: Optional[bool] = None
        self._handles: list[Any] = []
        self._step_handles: list[Any] = []  # the optimizer's step hooks, set in the rounds that measure steps
        self._optimizer: Any = None
        self._stacked: list[Tensor] = []
        self._has_iterate = False
        self._before: list[Tensor] = []  # x (and w) before the step: buffers reused every step
        self._before_w: list[Tensor] = []
        self._pending = False
        self._reset()

    def _reset(self) -> None:
        self._dispersion = torch.zeros((), dtype=torch.float64)
        self._syncs = 0
        self._steps = torch.zeros(2, dtype=torch.float64)  # sums of the query point's and the iterate's step norms
        self._step_count = 0
        self._local_means: Optional[list[Tensor]] = None

    # -- the Lightning hooks: each calls the trainer-free method below ------------------------------

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        def say(line: str) -> None:
            if trainer.is_global_zero:
                print(line, flush=True)

        def say_note(line: str) -> None:
            if trainer.is_global_zero:
                note(line)

        metrics = self.prepare(trainer.datamodule, float(pl_module.hparams.get("weight_decay", 0.0)), say, say_note)
        if not metrics:
            return
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=0)
        trainer.callback_metrics.update({k: torch.tensor(v, dtype=torch.float64) for k, v in metrics.items()})

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking or trainer.state.fn != "fit":
            return
        for name, value in self.evaluate(pl_module).items():
            pl_module.log(name, value)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.attach(pl_module, trainer.strategy, trainer.optimizers[0] if trainer.optimizers else None)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.detach()

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self.start_round(batch_idx)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.end_round()

    # -- the objective and its optimum ----------------------------------------------------------

    def prepare(
        self,
        data: Any,
        weight_decay: float = 0.0,
        say: Optional[Callable[[str], None]] = None,
        say_note: Optional[Callable[[str], None]] = None,
    ) -> dict[str, float]:
        """Before training: the training objective of ``data`` (a ``ProblemDataModule``; its problem's samples
        and shards), its optimum x* (solved or read from the cache) and G_*. Returns the metrics logged
        at step 0 (``f_star``, ``G_star``, ``optimum_grad_norm``; none without an optimum); ``say``
        prints the lines on it (``None``: ``print``), ``say_note`` those the same for every run of the problem or
        split (``None``: ``notes.note``, printed once per sweep): why there is no excess loss, the optimum read
        from the cache."""
        say, say_note = say or _print, say_note or note
        problem = getattr(data, "problem", None)
        samples = getattr(data, "problem_samples", None)
        if not self.measure_objective or problem is None or samples is None:  # (not a lit_slowcal data module)
            return {}
        decay = float(weight_decay)
        self.objective = Objective(samples(), problem.loss, decay, image=getattr(problem, "image", None))
        if decay == 0 and not problem.attained_without_weight_decay:
            self.note = (
                f"excess_loss: not logged: {problem.name} {'softmax regression' if problem.loss == 'cross_entropy' else ''} "
                "without weight decay has no attained minimiser (f keeps falling as ||x|| grows), so there is no f*; "
                "set --model.weight_decay=1e-4 (recommended: f is then strongly convex) to measure it"
            ).replace("  ", " ")
            say_note(self.note)
            return {}
        found, path = self._solve(data, problem, say)
        if not found.converged:
            self.note = (
                f"excess_loss: not logged: the solver stopped at ||grad f|| = {found.grad_norm:.2e} > tol {self.tol:g} "
                f"after {found.iterations} Newton steps ({path}); f is not minimised there to that tolerance "
                "(a looser --optimum_tol accepts it; a rerun goes on from it)"
            )
            say_note(self.note)
            return {}
        self.optimum = found
        self.g_star = heterogeneity(self.objective, found.params)
        how_exact = f"; f* exact to {found.grad_norm**2 / (2 * decay):.1e}" if decay > 0 else ""
        how = f"read from {path}" if self.cached else f"solved in {found.seconds:.1f} s, cached in {path}"
        # Read from the cache, the line is the same for every run of this split: once per sweep (a note).
        (say_note if self.cached else say)(
            f"optimum of {problem.describe()} split over M={data.num_machines} with seed {data.seed} (x* depends on the "
            f"split), weight decay {decay:g}: f* = {found.value:.10g}, ||grad f(x*)|| = {found.grad_norm:.1e} after {found.iterations} "
            f"Newton steps, {found.cg_iterations} CG iterations ({how}){how_exact}; G_* = {self.g_star:.6g}"
        )
        return {"f_star": found.value, "G_star": self.g_star, "optimum_grad_norm": found.grad_norm}

    def _solve(self, data: Any, problem: Any, say: Callable[[str], None]) -> tuple[Optimum, Path]:
        """x* of the objective (cached on disk), with progress lines on a long solve."""
        identity = {"problem": problem.describe(), "num_machines": data.num_machines, "seed": data.seed}
        shape = (problem.num_outputs, problem.input_dim)
        shown = [time.perf_counter()]

        def progress(iterations: int, value: float, grad_norm: float) -> None:
            if time.perf_counter() - shown[0] >= 30:  # a long solve (MNIST: minutes) says how far it is
                shown[0] = time.perf_counter()
                say(f"optimum: solving, {iterations} Newton steps, f = {value:.10g}, ||grad f|| = {grad_norm:.1e}")

        def solving(
            path: Path,
        ) -> None:  # said at once: on MNIST the solve takes minutes before its first progress line
            say(
                f"optimum: solving for x* of {problem.describe()} split over M={data.num_machines} with seed {data.seed} "
                f"(once: it is cached in {path}) ..."
            )

        found, path, cached = optimum(
            self.objective, shape, identity, self.cache_dir, tol=self.tol, progress=progress, solving=solving
        )
        self.cached = cached
        return found, path

    def evaluate(self, model: nn.Module, value: Optional[float] = None) -> dict[str, Any]:
        """At an evaluation of ``model``'s synchronised point: the values to log, ``objective_metrics`` there
        and the per-round means since the previous evaluation (``round_metrics``, which then start over).
        ``value``: f there, when already known. Without the objective (``objective=False``, or a model it is
        not defined for), the per-round values alone."""
        out: dict[str, Any] = {}
        if self.objective is not None:
            out.update(
                self.objective_metrics(self.objective(model.machines.averaged_state()) if value is None else value)
            )
        out.update(self.round_metrics())
        return out

    def objective_metrics(self, value: float) -> dict[str, Tensor]:
        """``train_objective`` f(x) = ``value`` and, with an optimum, ``excess_loss`` f(x) - f*: float64 tensors
        (a Python float would be logged as float32, and excess losses are small differences). The stacked
        trials compute f for many evaluations at once and log these when they have it."""
        out = {"train_objective": torch.tensor(value, dtype=torch.float64)}
        if self.optimum is not None:
            out["excess_loss"] = torch.tensor(value - self.optimum.value, dtype=torch.float64)
        return out

    def round_metrics(self) -> dict[str, float]:
        """The per-round means since the previous evaluation (``dispersion``, ``query_step``, ``iterate_step``),
        which then start over."""
        out: dict[str, float] = {}
        if self._syncs:
            total = self._dispersion.clone()
            if _world() > 1:
                dist.all_reduce(total)
            machines = len(self._stacked[0]) * _world()
            out["dispersion"] = float(total) / (machines * self._syncs)
        if self._step_count:
            steps = self._steps / self._step_count
            out["query_step"] = float(steps[0])
            if self._has_iterate:
                out["iterate_step"] = float(steps[1])
        self._reset()
        return out

    # -- per-round diagnostics ------------------------------------------------------------------

    def attach(self, model: nn.Module, averager: Any, optimizer: Any) -> None:
        """Before training: measure ``model``'s machines (its ``SimulatedMachines``) before every
        synchronisation of ``averager`` (its ``register_sync_pre_hook``; none: no per-round diagnostics)
        and around the steps of ``optimizer`` (its step pre- and post-hooks)."""
        self._reset()
        self._has_iterate = False
        self._optimizer = None
        register = getattr(averager, "register_sync_pre_hook", None)
        if not self.per_round or register is None:
            return
        self._stacked = [p for m in model.modules() if isinstance(m, SimulatedMachines) for p in m.parameters()]
        if not self._stacked:
            return
        self._handles.append(register(self._before_sync))
        # An iterate w besides the query point x: SLowcal-SGD declares it as averaged state.
        self._has_iterate = "w" in declared(optimizer).averaged_state
        self._before = [torch.empty_like(p) for p in self._stacked]
        self._before_w = [torch.empty_like(p) for p in self._stacked] if self._has_iterate else []
        self._pending = False
        self._optimizer = optimizer  # its step hooks are set in the rounds that measure steps (start_round)

    def detach(self) -> None:
        """After training: the hooks ``attach`` set are removed."""
        for handle in self._handles + self._step_handles:
            handle.remove()
        self._handles, self._step_handles = [], []
        self._armed, self._optimizer = False, None

    def start_round(self, index: int) -> None:
        """Before round ``index`` (counted from 0): its steps' movement is measured every ``step_every`` rounds."""
        armed = self.step_every > 0 and index % self.step_every == 0 and self._optimizer is not None
        if armed and not self._step_handles:  # hooks only in these rounds: none to call in the others' steps
            self._step_handles = [
                self._optimizer.register_step_pre_hook(self._before_step),
                self._optimizer.register_step_post_hook(self._after_step),
            ]
        elif not armed:
            for handle in self._step_handles:
                handle.remove()
            self._step_handles = []
        self._armed = armed

    @torch.no_grad()
    def end_round(self) -> None:
        """After a round's synchronisation: with several processes, the dispersion's part between them
        (every machine now holds x_bar)."""
        if self._local_means is not None:
            m = len(self._stacked[0])
            gap = sum((mean - p[0]).double().square().sum() for mean, p in zip(self._local_means, self._stacked))
            self._dispersion = self._dispersion + m * gap
            self._local_means = None

    @torch.no_grad()
    def _before_sync(self, averager: Any) -> None:
        # sum_i ||x_i - x_bar||^2 = sum_p [sum_{i in p} ||x_i - m_p||^2 + m ||m_p - x_bar||^2] over the
        # processes p with m machines and local mean m_p. The first part is local; the second needs
        # x_bar, which every machine holds once the round is over (on_train_batch_end): no collective
        # during training. Processes add up their sums at the evaluation.
        means = [p.mean(0) for p in self._stacked]
        total = sum(torch.linalg.vector_norm(p - mean).double().square() for p, mean in zip(self._stacked, means))
        self._dispersion = self._dispersion.to(total.device) + total
        self._local_means = means if _world() > 1 else None
        self._syncs += 1

    @torch.no_grad()
    def _before_step(self, optimizer: Any, *args: Any) -> None:
        if not self._armed:
            return
        torch._foreach_copy_(self._before, self._stacked)
        if self._has_iterate:
            # Before its first step an optimizer with an iterate has none in its state yet: w_0 = x_0.
            state = optimizer.state
            torch._foreach_copy_(
                self._before_w, [state[p]["w"] if "w" in state.get(p, {}) else p for p in self._stacked]
            )
        self._pending = True

    @torch.no_grad()
    def _after_step(self, optimizer: Any, *args: Any) -> None:
        if not self._pending:
            return
        self._pending = False
        norms = [_machine_step(self._before, self._stacked)]
        if self._has_iterate:
            norms.append(_machine_step(self._before_w, [optimizer.state[p]["w"] for p in self._stacked]))
        else:
            norms.append(torch.zeros_like(norms[0]))
        step = torch.stack(norms)
        self._steps = self._steps.to(step.device) + step
        self._step_count += 1


def _print(line: str) -> None:
    print(line, flush=True)


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _machine_step(before: list[Tensor], after: list[Tensor]) -> Tensor:
    """The machines' mean ||after_i - before_i|| over all tensors (stacked along dim 0), in float64.

    ``before`` is overwritten with the differences."""
    torch._foreach_sub_(before, after)
    squares = sum(torch.linalg.vector_norm(d.view(len(d), -1), dim=1).double().square() for d in before)
    return squares.sqrt().mean()
