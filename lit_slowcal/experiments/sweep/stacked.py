"""Stacked trials: a sweep's trials that share a shape train as one vectorized program (the sweep's default).

A group of T trials that differ only in their learning rate, their seed and K (``grouping``) trains as
T x M simulated machines in one process, one step at a time, without a Trainer:

* every trial keeps its own parameters, ``(M, ...)`` slices of one ``(T * M, ...)`` stack: the forward
  and backward of all T trials are the single run's batched matmul on more machines
  (``MachinesModel.losses_of``); the linear layer's gradients are formed from autograd's gradient of
  the outputs into buffers kept from step to step (``_linear_grads``: autograd's values);
* the trials are ordered by K into blocks of rows that step together (one step per b samples whatever
  K; a block whose epoch has fewer steps stops first), each block with its own optimizer, built by the
  method's own factory with one parameter group per learning rate, and its own ``PeriodicAverager``
  over its trials' ``SimulatedMachines`` (each trial averaged over its own M machines);
* each trial's steps draw the samples its single run draws (its own split and ``MachineStreams``);
* each block's rounds are driven by its own ``RoundDriver``, the single run's
  (``lit_slowcal.experiments.train.rounds``): its optimizer and averager steps, the finiteness check, the
  train-loss log and the rounds evaluated, every ``eval_every`` and the last. A block evaluates its
  trials' averaged models, whose test metrics and training objective wait until ``POINTS_PER_PASS`` evaluations need them (or the group ends): one pass over the test set (``objective.affine_rows``, each point's
  own product) and one float64 pass over the training inputs (``objective.values``); rows written in order;
* each trial has its single run's ``Diagnostics``, driven through its trainer-free methods on its own
  data module and model, with its block's averager and optimizer.

The result holds the exactness contract (``contract``): every trial's parameters, training and test
metrics bit for bit those of the same trial run alone on CPU, its diagnostics within 1e-12 relative
(``tests/experiments/sweep/test_stacked.py``, every method of the registry). Each trial gets what a single
run gets: its record in the results file (when its group ends), its CSV log (``metrics.csv`` and
``config.yaml`` in its own version folder), its own W&B run in the sweep's group (``stacked_trial``) and,
when its training loss or parameters become non-finite, the status ``diverged`` (its slices frozen, the
others going on).

A group trains where its trials' single runs train: on the CPU, or on the first CUDA device with all its
tensors there (the initial points drawn on the CPU). On CUDA, float32 sums run in another order: within
1e-6 relative of the CPU run, the per-round diagnostics within 1e-4 (``tests/test_cuda.py``). Which trials
stack, and in which groups, is ``grouping``'s (its names are importable from here too).
"""

from __future__ import annotations

import math
import time
from typing import Any, Optional

import torch
from torch import Tensor, nn

from lit_slowcal._rounds import CodedRound
from lit_slowcal.experiments.run.options import compression_options, links_of
from lit_slowcal.experiments.sweep.grouping import (
    StackedTrial,
    balance_groups,
    default_memory_budget,
    group_cost,
    group_title,
    group_trials,
    plan_stacked,
    stackable,
    trial_bytes,
    trial_device,
    trial_shape,
)
from lit_slowcal.experiments.sweep.stacked_trial import (
    config_yaml,
    data_and_model,
    model_settings,
    trial_logger,
    wandb_run,
)
from lit_slowcal.experiments.train.rounds import (
    RoundCounts,
    RoundDriver,
    RoundSchedule,
    epoch_values,
    evaluation_row,
    swap_outputs,
    trial_status,
)
from lit_slowcal.experiments.train.shape import RunShape
from lit_slowcal.link import LinkCounts, ddp_counts, payload_bytes

__all__ = [
    "StackedTrial", "balance_groups", "config_yaml", "default_memory_budget", "group_cost", "group_title",
    "group_trials", "plan_stacked", "run_group", "stackable", "trial_bytes",
]  # fmt: skip


#: Evaluations computed in one pass over the test set and one over the training inputs: many points a pass cost
#: far less each than one at a time (``benchmarks/bench_evaluation.py`` times it).
POINTS_PER_PASS = 64


class _Block:
    """The trials of a group that share K (their ``RunShape``'s steps per round): rows ``[start, stop)`` of the
    stack, their own optimizer (one parameter group per learning rate) and averager, on their own schedule.

    ``shape`` is the first member's ``RunShape`` (the members differ in their learning rate and seed only);
    ``k``, ``rounds`` and ``steps`` are its steps per round, trained rounds and their steps."""

    def __init__(self, members: list[int], start: int, shape: RunShape) -> None:
        self.members, self.start, self.stop = members, start, start + len(members)
        self.shape = shape
        self.k, self.rounds = shape.steps_per_round, shape.trained_rounds
        self.steps = self.k * self.rounds
        self.optimizer: Any = None
        self.averager: Any = None
        self.driver: Any = None  # its RoundDriver
        self.floats_per_sync = 0  # per machine of one trial, known after the first synchronisation
        self.payload_per_sync = 0  # the same in bytes
        self.stages_per_sync: Optional[tuple[int, int]] = None  # with compression, its two stages' bytes
        self.sent = LinkCounts()  # one trial's machine's, as its single run's averager counts them


def run_group(group: list[StackedTrial], config_text: Optional[Any] = None) -> None:
    """Train the trials of one group together; fills every trial's ``outcome`` as ``run_trial`` returns it.

    Args:
        group: trials whose configurations differ only in the learning rate, the seed and K.
        config_text: ``(trial) -> str``, the ``config.yaml`` written into each trial's log folder.
    """
    _Group(group, config_text).run()


def _blocks(shapes: list[RunShape]) -> list[_Block]:
    """The trials (ordered by K), given by their ``RunShape``, in blocks of one K each."""
    blocks: list[_Block] = []
    for i, shape in enumerate(shapes):
        if not blocks or blocks[-1].k != shape.steps_per_round:
            blocks.append(_Block([], i, shape))
        blocks[-1].members.append(i)
        blocks[-1].stop = i + 1
    return blocks


class _Group:
    """The trials of one group, trained as one stack of T x M machines (``run_group``): built from the
    trials' own data modules and models, then ``run``: every step of the epoch, each block's rounds
    driven by its ``RoundDriver`` (``lit_slowcal.experiments.train.rounds``), the trials' outcomes."""

    def __init__(self, group: list[StackedTrial], config_text: Optional[Any]) -> None:
        from lit_slowcal.experiments.train.methods import get_method

        self.start = time.perf_counter()
        # The stack holds the trials ordered by K (each K's trials in sweep order): every K is a block of rows.
        shapes = [trial_shape(t.config) for t in group]
        order = sorted(range(len(group)), key=lambda i: shapes[i].steps_per_round)
        self.trials = trials = [group[i] for i in order]
        self.shapes = [shapes[i] for i in order]  # each trial's RunShape
        first = self.first = trials[0].config
        self.entry = get_method(first["method"])
        self.T, self.M = len(trials), self.shapes[0].num_machines
        self.log_every = first["trainer"]["log_every_n_steps"]
        self.links = links_of(first["link"])
        self.step_time, self.steps_taken = 0.0, 0  # the compute time of the steps, measured (``step_seconds``)
        self.step_seconds = first.get("step_seconds")
        self.device = trial_device(first)
        self.streams, self.models = map(list, zip(*(data_and_model(t.config, s) for t, s in zip(trials, self.shapes))))
        self.blocks = _blocks(self.shapes)
        self.of = [s for s in self.blocks for _ in s.members]  # each trial's block
        self.steps = max(s.steps for s in self.blocks)  # a block whose epoch is shorter stops stepping earlier
        self.b = self.shapes[0].per_step_batch
        self._place_data()
        self._stack()
        self._optimizers()
        self.loggers = [trial_logger(t, self.streams[i], config_text) for i, t in enumerate(trials)]
        self.active = [True] * self.T
        self.metrics: list[dict[str, float]] = [{} for _ in range(self.T)]
        self.history: list[list[tuple[int, dict[str, float]]]] = [[] for _ in range(self.T)]  # (step, row) as logged
        self.written = [0] * self.T  # rows of each trial's history written to its log and metrics
        self.unscored: list[
            tuple[int, dict[str, Any], dict[str, Tensor]]
        ] = []  # (trial, row, point): test and f to compute
        self.errors: list[Optional[BaseException]] = [None] * self.T
        self.losses = torch.empty(self.steps, self.T, self.M, device=self.device)  # every step's per-machine losses
        self._diagnostics()

    def _place_data(self) -> None:
        """Every trial's sample indices of its epoch, one row per step (its rounds' steps in order), padded
        with sample 0 after its last step; and everything the steps and evaluations read, on the device."""
        M, b, steps, device = self.M, self.b, self.steps, self.device
        columns = []
        for i, d in enumerate(self.streams):
            idx = d.train_streams.indices(0)[: self.of[i].rounds].reshape(-1, M, b)
            columns.append(torch.cat([idx, idx.new_zeros(steps - len(idx), M, b)]) if len(idx) < steps else idx)
        self.indices = torch.cat(columns, dim=1).to(device)  # (steps, T*M, b)
        train = self.streams[0].train_streams
        self.x_all, self.y_all = train.x.to(device), train.y.to(device)
        self.test_x, self.test_y = self.streams[0].test_x.to(device), self.streams[0].test_y.to(device)
        # Steps whose samples are gathered at once: a few MiB on the CPU (they stay in cache until their step),
        # up to 256 MiB on a GPU (fewer launches).
        step_bytes = self.T * M * b * self.x_all.shape[1] * self.x_all.element_size()
        self.chunk = max(1, min(steps, (2**22 if device.type == "cpu" else 2**28) // step_bytes))
        self.xs_buf = self.x_all.new_empty((self.chunk, self.T * M * b, self.x_all.shape[1]))
        self.ys_buf = self.y_all.new_empty((self.chunk, self.T * M * b))

    def _stack(self) -> None:
        """One stack of T * M machines; each trial's ``SimulatedMachines`` holds slices of it, and its
        ``.grad`` slices of the gradient buffers every step writes (allocating them afresh each step
        costs more than computing them: page faults and cold cache)."""
        from lit_slowcal.experiments.train.model import MachinesModel

        M = self.M
        self.stack = stack = MachinesModel(
            **{**model_settings(self.first), "num_machines": self.T * M, "init": "zeros"}
        )
        stack.configure_model()
        stack.to(self.device)  # the trials' initial points are drawn on the CPU, as in their CPU runs, and copied
        big = dict(stack.machines.named_parameters())
        with torch.no_grad():
            for i, model in enumerate(self.models):
                for name, p in model.machines.named_parameters():
                    big[name][i * M : (i + 1) * M].copy_(p)
        for i, model in enumerate(self.models):
            for name in list(dict(model.machines.named_parameters())):
                setattr(model.machines, name, nn.Parameter(big[name].detach()[i * M : (i + 1) * M]))
        self.trial_params = [list(m.machines.parameters()) for m in self.models]
        self.parameter_bytes = payload_bytes((p, True) for p in self.trial_params[0])  # one machine's, for DDP
        self.big_params = list(big.values())
        if list(big) != ["weight", "bias"] or type(stack.machines.template) is not nn.Linear:
            raise ValueError(f"stacking trains a linear model with a bias; this one has {list(big)}")
        self.grad_weight, self.grad_bias = torch.zeros_like(big["weight"]), torch.zeros_like(big["bias"])
        for i, ps in enumerate(self.trial_params):
            for p, whole in zip(ps, (self.grad_weight, self.grad_bias)):
                p.grad = whole[i * M : (i + 1) * M]

    def _optimizers(self) -> None:
        """Each block's optimizer, built by the method's own factory, and its averager (its own K)."""
        from lit_slowcal.averaging import PeriodicAverager

        models = self.models
        for s in self.blocks:
            by_lr: dict[float, list[Tensor]] = {}
            for i in s.members:
                by_lr.setdefault(models[i].hparams.lr, []).extend(self.trial_params[i])
            groups = [{"params": ps, "lr": lr} for lr, ps in by_lr.items()]
            s.optimizer = self.entry.optimizer(groups, models[s.start].hparams, steps=s.steps)
            s.averager = PeriodicAverager(
                [models[i].machines for i in s.members], s.optimizer, s.shape.sync_every,
                **compression_options(self.first.get),
            )  # fmt: skip
            s.averager.anchor()  # every machine starts at x_0: compressed from the first round, as a single run
            s.driver = RoundDriver(
                s.optimizer,
                RoundSchedule(log_every=self.log_every, eval_every=s.shape.val_check_interval),
                s.shape,
                method=self.first["method"],
                lrs=[models[i].hparams.lr for i in s.members],
                counts=lambda s=s: self._counts(s),
                sync=s.averager.step,
                device=self.device,
                links=self.links,
                step_seconds=self.step_seconds,
            )

    def _counts(self, s: _Block) -> RoundCounts:
        """What one machine of a trial of block ``s`` has done and sent so far, as its single run counts it."""
        steps = s.averager.steps
        return RoundCounts(
            steps=steps,
            syncs=s.averager.num_syncs,
            floats=s.floats_per_sync * s.averager.num_syncs,
            sent=s.sent,
            ddp=ddp_counts(self.parameter_bytes, steps, self.M),
        )

    def _diagnostics(self) -> None:
        """Each trial's ``Diagnostics`` (training objective, optimum, per-round diagnostics), built as the CLI
        builds it for every fit (what --objective / --diagnostics switch off it skips), on the trial's
        data module and model, with its block's averager and optimizer; the optimum's metrics at step 0."""
        from lit_slowcal.experiments.run.cli import diagnostics_callback

        self.diagnostics = [diagnostics_callback(t.config.get) for t in self.trials]
        on_device: dict[tuple, Any] = {}  # one copy of the inputs, and of each split's labels and weights
        for i, diagnostics in enumerate(self.diagnostics):
            found = diagnostics.prepare(self.streams[i], float(self.models[i].hparams.get("weight_decay", 0.0)))
            if found:  # f_star, G_star, optimum_grad_norm: logged at step 0
                self.loggers[i].log_metrics(found, step=0)  # as the callback logs them: no epoch
                row = {k: float(v) for k, v in found.items()}
                self.metrics[i].update(row)
                self.history[i].append((0, row))
                self.written[i] = 1
            if diagnostics.objective is not None:
                diagnostics.objective.share_to(self.device, on_device)
        for i, diagnostics in enumerate(self.diagnostics):
            diagnostics.attach(self.models[i], self.of[i].averager, self.of[i].optimizer)

    def run(self) -> None:
        """Every step of the epoch, then the trials' outcomes."""
        due: list[tuple[_Block, int]] = []  # the blocks to evaluate after this step, with their round
        for step in range(self.steps):
            start = time.perf_counter()
            self._step(step)
            for s in self.blocks:
                if step < s.steps and any(self.active[i] for i in s.members):
                    self._advance(s, step, due)
            self.step_time += time.perf_counter() - start  # the steps' compute, measured (evaluations apart)
            self.steps_taken += 1
            if due:
                self._evaluate(due)
                due.clear()
            if not any(self.active):
                break
        for diagnostics in self.diagnostics:
            diagnostics.detach()
        self._score()
        self._finish()

    def _step(self, step: int) -> None:
        """The forward and backward of every machine of the stack at ``step``: its losses, and the linear
        layer's gradients in the buffers."""
        T, M, b, chunk = self.T, self.M, self.b, self.chunk
        if step % chunk == 0:
            idx = self.indices[step : step + chunk].view(-1)
            n = len(idx) // (T * M * b)
            torch.index_select(self.x_all, 0, idx, out=self.xs_buf[:n].view(-1, self.x_all.shape[1]))
            torch.index_select(self.y_all, 0, idx, out=self.ys_buf[:n].view(-1))
        starting = [(i, step // s.k) for s in self.blocks if step % s.k == 0 and step < s.steps for i in s.members]
        for i, r in starting:  # a block starting a round: its trials' per-round diagnostics arm
            if self.active[i] and self.diagnostics[i].per_round:
                self.diagnostics[i].start_round(r)
        xs_step = self.xs_buf[step % chunk].view(T * M, b, -1)
        with torch.no_grad():
            logits = self.stack.machines(xs_step)
        logits.requires_grad_()
        per_machine = self.stack.losses_of(logits, self.ys_buf[step % chunk].view(T * M, b))
        (grad_logits,) = torch.autograd.grad(per_machine.sum(), logits)
        _linear_grads(xs_step, grad_logits, self.grad_weight, self.grad_bias)
        self.losses[step] = per_machine.detach().view(T, M)

    def _advance(self, s: _Block, step: int, due: list[tuple[_Block, int]]) -> None:
        """Block ``s`` after ``step``: its driver's step (the optimizer's, and the averager's: a synchronisation
        every K-th), and after its round's last step, the round's end (``RoundDriver.end_round``): a diverged trial
        stopped (its slices dropped from the optimizer, the others going on), the train-loss rows logged, the
        block due for evaluation."""
        if s.driver.step():
            # As a single run's averager adds them: the first synchronisation codes what had an anchor at the start
            # (the parameters) and sends the state born at the first step exactly; the others compressed.
            if not s.floats_per_sync:  # all active in round 1: one trial's share of the averager's counts
                n = len(s.members)
                s.floats_per_sync = s.averager.floats_communicated // n
                s.payload_per_sync = s.averager.link_counts.payload_bytes // n
                engine = s.averager.engine
                if isinstance(engine, CodedRound):
                    first, second = s.averager.stage_bytes()
                    s.stages_per_sync = (first // n, second // n)
                    s.sent += engine.counted(*(part // n for part in engine.last_parts), self.M).link
                else:
                    s.sent += LinkCounts.of_syncs(s.payload_per_sync, self.M)
            elif s.stages_per_sync is not None:  # the code's own ring counts: two stages, or a sparse code's gather
                s.sent += s.averager.engine.state.link_counts(*s.stages_per_sync, self.M)
            else:
                s.sent += LinkCounts.of_syncs(s.payload_per_sync, self.M)
        if (step + 1) % s.k:
            return
        r = (step + 1) // s.k
        rows = [p[s.start * self.M : s.stop * self.M] for p in self.big_params]
        end = s.driver.end_round(self.losses[step + 1 - s.k : step + 1, s.start : s.stop], r, rows, last=r == s.rounds)
        for j, error in end.diverged:
            i = s.members[j]
            if self.active[i]:
                self.errors[i] = error
                self.active[i] = False
                gone = {id(p) for p in self.trial_params[i]}
                for g in s.optimizer.param_groups:
                    g["params"] = [p for p in g["params"] if id(p) not in gone]
        if end.train_loss is not None:
            for i, row in zip(s.members, s.driver.train_rows(end)):
                if self.active[i]:
                    self._log(i, r, {k: float(v) for k, v in row.items()})
        if end.evaluate:
            due.append((s, r))

    def _log(self, i: int, r: int, row: dict[str, float]) -> None:
        """A row of trial ``i`` at round ``r``, written (to its CSV log and its metrics) in order once every
        evaluation before it has its training objective (``_write``)."""
        self.history[i].append((r - 1, row))
        if not self.unscored:
            self._write(i)

    def _write(self, i: int) -> None:
        for step, row in self.history[i][self.written[i] :]:
            self.metrics[i].update(row)
            self.loggers[i].log_metrics({"epoch": 0, **row}, step=step)
        self.written[i] = len(self.history[i])

    def _evaluate(self, due: list[tuple[_Block, int]]) -> None:
        """The blocks ``due`` after their round r: every live trial's averaged model (its outputs swapped in, as the
        single run's evaluation) and diagnostics; its test metrics and training objective wait for ``_score``."""
        live = [(s, r, i) for s, r in due for i in s.members if self.active[i]]
        swap_outputs(s.optimizer for s, _ in due)
        with torch.no_grad():
            weights = [self.models[i].machines.weight.mean(0) for _, _, i in live]  # averaged_state, per trial
            biases = [self.models[i].machines.bias.mean(0) for _, _, i in live]
        more = [epoch_values(self.diagnostics[i].round_metrics()) for _, _, i in live]  # since the last evaluation
        swap_outputs(s.optimizer for s, _ in due)
        for (s, r, i), weight, bias, extra in zip(live, weights, biases, more):
            row = {"round": float(s.averager.num_syncs), **extra}
            self.unscored.append((i, row, {"weight": weight, "bias": bias}))
            self._log(i, r, row)
        if len(self.unscored) >= POINTS_PER_PASS:
            self._score()

    def _score(self) -> None:
        """The evaluations waiting: their test metrics in one pass over the test set (``affine_rows``: each point's
        logits bit for bit its own product's), first in their rows as the single run logs them, and their training
        objective in one pass over the training inputs (``objective.values``); then every trial's rows written."""
        from lit_slowcal.experiments.measure.objective import affine_rows, values

        if self.unscored:
            points = [p for _, _, p in self.unscored]
            with torch.no_grad():
                logits = affine_rows(self.test_x, [p["weight"] for p in points], [p["bias"] for p in points])
            for (i, row, _), z in zip(self.unscored, logits):
                tested = {**evaluation_row(z, self.test_y, self.models[i].hparams.loss), **row}
                row.clear()
                row.update(tested)  # the row in the trial's history, in the single run's order
            scored = [(j, i) for j, (i, _, _) in enumerate(self.unscored) if self.diagnostics[i].objective is not None]
            found = values([self.diagnostics[i].objective for _, i in scored], [points[j] for j, _ in scored])
            for (j, i), value in zip(scored, found):
                self.unscored[j][1].update(epoch_values(self.diagnostics[i].objective_metrics(value)))
            self.unscored = []
        for i in range(self.T):
            self._write(i)

    def _finish(self) -> None:
        """Every trial's log saved and its outcome, as ``run_trial`` returns it, and final parameters."""
        from lit_slowcal.experiments.run.run_folder import run_name

        wall = (time.perf_counter() - self.start) / self.T
        for i, t in enumerate(self.trials):
            self.loggers[i].save()
            clean = {k: (v if math.isfinite(v) else None) for k, v in self.metrics[i].items()}
            error = self.errors[i]
            t.outcome = {
                "status": trial_status(error),
                "error": None if error is None else str(error),
                "metrics": clean,
                "run_dir": str(self.loggers[i].log_dir),
                "wall_time_s": round(wall, 3),
                "step_seconds": self.step_time / (self.steps_taken * self.T * self.M) if self.steps_taken else None,
                "stacked": self.T,
            }
            if t.config.get("wandb"):
                wandb_run(
                    t.config,
                    run_name(t.config.get),
                    str(self.loggers[i].log_dir),
                    self.history[i],
                    t.outcome["status"] != "finished",
                )
            t.final_state = {
                "params": {n: p.detach().to("cpu", copy=True) for n, p in self.models[i].machines.named_parameters()},
            }


def _linear_grads(x: Tensor, grad_logits: Tensor, grad_weight: Tensor, grad_bias: Tensor) -> None:
    """The gradients autograd gives the machines' linear layer (``weight`` ``(m, out, in)``, ``bias`` ``(m, out)``,
    outputs ``baddbmm(bias, weight, x^T)^T``) from the outputs' gradient ``grad_logits`` ``(m, b, out)``, written
    into ``grad_weight`` and ``grad_bias``: ``bmm(g, x)`` as the matmul's backward; with b = 1 its inner size is 1
    and each entry the single product ``g_i * x_j``, formed by ``torch.mul`` (several times faster on a CPU; the
    same values: a zero product keeps its sign, ``-0.0`` where the matmul gives ``+0.0``, which compare equal and
    leave every sum and update the same)."""
    g = grad_logits.transpose(1, 2)  # (m, out, b)
    if x.shape[1] == 1:
        torch.mul(g, x, out=grad_weight)
        grad_bias.copy_(g.squeeze(-1))
    else:
        torch.bmm(g, x, out=grad_weight)
        grad_bias.copy_(g.sum_to_size(*grad_bias.shape, 1).squeeze(-1))  # the bias broadcast's backward
