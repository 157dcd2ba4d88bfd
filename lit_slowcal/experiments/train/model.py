"""The app's model: one architecture of the registry (the paper's linear model by default), trained on
m simulated machines per process by any method of the registry.

Every method of the comparison is a configuration of the same model: its entry in
``lit_slowcal.experiments.train.methods`` builds the optimizer from the model's hyperparameters; how
often machines synchronise (K or 1) and how large the per-step batch is (b or K * b) are the run's shape
(``lit_slowcal.experiments.train.shape.RunShape``), which the CLI gives the strategy, the data and this
model (``MachinesModel.use_shape``), see ``lit_slowcal.experiments.run.cli``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Literal, Optional

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torchmetrics.classification import MulticlassAccuracy

from lit_slowcal._validation import check_int, check_number
from lit_slowcal.experiments._lightning import batches_started
from lit_slowcal.experiments.train.architectures import get_architecture
from lit_slowcal.experiments.train.methods import get_method
from lit_slowcal.experiments.train.rounds import (
    RoundCounts,
    RoundDriver,
    RoundSchedule,
    cross_entropy,
    swap_outputs,
    test_loss,
)
from lit_slowcal.experiments.train.shape import RunShape
from lit_slowcal.link import Link
from lit_slowcal.simulated import SimulatedMachines
from lit_slowcal.strategy import PeriodicAveragingStrategy

__all__ = ["MachinesModel", "official_init"]


class MachinesModel(pl.LightningModule):
    """A model of ``lit_slowcal.experiments.train.architectures`` (the paper's 784 -> 10 linear model by default;
    ``arch`` picks an MLP or a small CNN), one copy per simulated machine, with cross-entropy (or the
    squared loss of the regression problems).

    A training batch is one communication round, ``(x, y)`` of shapes ``(steps, m, b, 784)`` and
    ``(steps, m, b)``; each of its steps is one optimizer step. Machine i's loss is the mean
    cross-entropy of its b samples, and the loss back-propagated is the sum over machines (so each
    machine's slice gets its own gradient). A non-finite training loss stops the run at once. Validation and test evaluate the synchronised
    model x (the machines' average) on plain ``(n, 784)`` batches, logging ``test_loss`` and ``test_acc``.

    Args:
        method: a name of ``lit_slowcal.experiments.train.methods.METHODS``.
        num_machines: M over all processes; each process hosts M / world_size of them.
        lr: learning rate eta (gamma for AC-SA); ``None`` takes the method's paper-config rate
            (``Method.paper_lr``).
        weight_power: p in alpha_t = (t + 1)^p (SLowcal only).
        scale_lr_by_weight: use eta * alpha_t as in Algorithm 2 (SLowcal only; the paper's
            experiments use a constant eta).
        gamma: fixed x/w interpolation instead of alpha weights (SLowcal only).
        server_lr: SCAFFOLD's server step size eta_g (SCAFFOLD only; 1: x is the average of the
            local models).
        outer: the server step at each synchronisation, on the pseudo-gradient x_s - x_bar
            (``methods.OUTER_STEPS``: none, sgd (FedAvgM), nesterov (DiLoCo), adam (FedAdam));
            ``None``: the method's own (DiLoCo: nesterov at 0.7; the others: none, the plain average).
        outer_lr, outer_momentum: the server step's rate (``None``: the method's, else 1) and momentum.
        arch: the model each machine trains (``architectures.ARCHITECTURES``: linear, the paper's;
            mlp; cnn). The non-linear ones need ``init=default``.
        horizon_aware: Lan's horizon-aware step (AC-SA only): ``lr`` is the constant c and gamma =
            min{max_lr, c (N+1)^-3/2}, N the run's steps (its rounds, read from the trainer when the
            optimizer is built), so that one c serves runs of any length. ``lr`` must then be given.
        max_lr: gamma_max, the cap of the horizon-aware step (AC-SA only; ``None``: no cap).
        weight_decay: L2 penalty added to every gradient.
        init: x_0 = 0 (``zeros``, the usual start of a convex problem: results then depend on the
            seed only through the data), PyTorch's default random ``nn.Linear`` initialisation, the
            same on every machine (``default``), or the paper code's (``official``): machine i starts
            from its own default initialisation, the one the code draws for its worker i (see
            ``official_init``), until the first synchronisation averages them.
        seed: seeds the ``official`` initialisation (the CLI links ``seed_everything`` to it);
            ``None`` takes ``torch.initial_seed()``, the seed ``seed_everything`` set.
        input_dim, num_classes: the linear model's shape (set from ``data.problem`` by the CLI).
        loss: ``cross_entropy`` (classes; logs ``test_acc`` too) or ``squared``, (z - y)^2 / 2 on one
            output (regression, e.g. the ``Quadratic`` problem), or ``next_token`` (a language model, the
            ``StdlibChars`` problem with ``arch=transformer``: the mean cross-entropy over a window's positions;
            logs ``test_bpc``, bits per character, and the per-position ``test_acc`` too).
        beta, beta2, second_moment, average_second_moment: ``AdaptiveSlowcal``'s (adaptive_slowcal only): where
            the gradient is taken (1: x, SLowcal's query point), Adam's decay, ``adam`` or ``adagrad``, and whether
            a synchronisation averages the second moment (docs/adaptive.md).
    """

    def __init__(
        self,
        method: str = "slowcal",
        num_machines: int = 16,
        lr: Optional[float] = None,
        weight_power: float = 1.0,
        scale_lr_by_weight: bool = False,
        gamma: Optional[float] = None,
        server_lr: float = 1.0,
        outer: Optional[str] = None,
        outer_lr: Optional[float] = None,
        outer_momentum: float = 0.9,
        arch: str = "linear",
        horizon_aware: bool = False,
        max_lr: Optional[float] = None,
        weight_decay: float = 0.0,
        init: Literal["zeros", "default", "official"] = "zeros",
        seed: Optional[int] = None,
        input_dim: int = 784,
        num_classes: int = 10,
        loss: Literal["cross_entropy", "squared", "next_token"] = "cross_entropy",
        beta: float = 1.0,
        beta2: float = 0.999,
        second_moment: Literal["adam", "adagrad"] = "adam",
        average_second_moment: bool = False,
    ) -> None:
        super().__init__()
        entry = get_method(method)
        if init not in ("zeros", "default", "official"):
            raise ValueError(f"Invalid model.init: {init!r} (allowed: zeros, default, official)")
        if seed is not None:
            check_int("model.seed", seed, minimum=0)
        if loss not in ("cross_entropy", "squared", "next_token"):
            raise ValueError(f"Invalid model.loss: {loss!r} (allowed: cross_entropy, squared, next_token)")
        architecture = get_architecture(arch)
        if architecture.sequence != (loss == "next_token"):
            raise ValueError(
                f"Invalid model.arch: {arch!r} for the {loss} loss (a language-model problem such as StdlibChars "
                "takes model.arch=transformer, and the transformer only such a problem)"
            )
        if not architecture.linear and init != "default":
            raise ValueError(
                f"Invalid model.init: {init!r} with model.arch={arch} (zeros would leave every hidden unit alike, "
                "official is the linear model's; use model.init=default)"
            )
        if architecture.image_input and input_dim != 28 * 28:
            raise ValueError(
                f"Invalid model.arch: {arch!r} for inputs of {input_dim} features (it needs 28 x 28 images)"
            )
        if lr is None and horizon_aware:
            raise ValueError(
                "Invalid model.lr: None with model.horizon_aware=true (lr is then Lan's constant c of gamma = "
                "c (N+1)^-3/2, not a paper rate; give it, e.g. 36, the registry's gamma 0.01 at N = 235 rounds)"
            )
        if lr is None:
            lr = entry.paper_lr
        check_number("model.lr", lr)
        check_int("num_machines", num_machines)
        self.save_hyperparameters()
        self.hparams.lr = float(lr)
        # Linked from data.problem when the classes are instantiated: some Lightning versions (2.5) save the
        # parsed config as the hyperparameters, which lacks them.
        self.hparams.update(input_dim=input_dim, num_classes=num_classes, loss=loss)
        try:  # the method's own options, checked by its optimizer now rather than when training starts
            entry.optimizer([torch.zeros(1)], self.hparams, steps=1)  # steps: a stand-in, the run's is known at fit
        except ValueError as err:
            raise ValueError(str(err).replace("Invalid ", "Invalid model.", 1)) from None
        self.automatic_optimization = False  # one training batch is a whole round of local steps
        self.machines: Optional[SimulatedMachines] = None
        #: The run's shape: its machines per process are this process's machines, its steps per round a
        #: training batch's (``use_shape``; ``None`` until given or configured).
        self.shape: Optional[RunShape] = None
        self.test_acc = MulticlassAccuracy(num_classes=num_classes, average="micro") if loss != "squared" else None
        self._driver: Optional[RoundDriver] = None  # this fit's, built at its first round
        self.links: tuple[Link, ...] = ()  # use_links
        self.step_seconds: Optional[float] = None
        self._train_time = (0.0, 0)  # (seconds in the training steps' loops, optimizer steps), measured_step_seconds
        self._resumed_loss_since_log = torch.zeros(2, dtype=torch.float64)  # (sum of round losses, rounds)
        self._resumed_train_s = 0.0  # train_s before this fit's first round (a resumed run's, from its checkpoint)

    def use_shape(self, shape: RunShape) -> None:
        """Train in the run's ``shape`` (the CLI's one shape, the data's and the strategy's): host its machines
        per process; its M must be the model's ``num_machines``."""
        if not isinstance(shape, RunShape):
            raise ValueError(f"Invalid shape: {shape!r} (a RunShape)")
        if shape.num_machines != self.hparams.num_machines:
            raise ValueError(
                f"Invalid shape: num_machines {shape.num_machines} (the model trains num_machines="
                f"{self.hparams.num_machines})"
            )
        if self.machines is not None and self.machines.num_machines != shape.machines_per_process:
            raise ValueError(
                f"Invalid shape: {shape} (the model hosts {self.machines.num_machines} machines per process; give "
                "the shape before configure_model)"
            )
        self.shape = shape

    def _own_shape(self) -> RunShape:
        """The shape of a model given none (built by hand, trained on data other than a ``ProblemDataModule``,
        which gives it its own in ``setup``): its M machines over the trainer's processes."""
        try:
            world = self.trainer.world_size
        except RuntimeError:  # not attached to a Trainer (built and configured by hand)
            world = 1
        return RunShape.of_machines(self.hparams.num_machines, world)

    def configure_model(self) -> None:
        if self.machines is not None:
            return
        if self.shape is None:
            self.shape = self._own_shape()
        # Random init is seeded by seed_everything; rank 0's weights are broadcast at setup anyway.
        template = get_architecture(self.hparams.get("arch", "linear")).build(
            self.hparams.input_dim, self.hparams.num_classes
        )
        if self.hparams.init == "zeros":
            nn.init.zeros_(template.weight)
            nn.init.zeros_(template.bias)
        self.machines = SimulatedMachines(template, self.shape.machines_per_process)
        if self.hparams.init == "official":
            self._official_init()

    def _official_init(self) -> None:
        """Give each of this process's machines its own ``official_init`` weights."""
        h = self.hparams
        m = self.machines.num_machines
        try:
            rank = self.trainer.global_rank
        except RuntimeError:
            rank = 0
        seed = torch.initial_seed() if h.seed is None else h.seed
        weight, bias = official_init(h.num_machines, seed, h.input_dim, h.num_classes)
        with torch.no_grad():
            self.machines.weight.copy_(weight[rank * m : (rank + 1) * m])
            self.machines.bias.copy_(bias[rank * m : (rank + 1) * m])

    def on_fit_start(self) -> None:
        # Several processes: the strategy broadcast rank 0's machines at setup; give every process
        # its own machines' weights back (unless the run resumes from a checkpoint).
        if self.hparams.init == "official" and self.trainer.world_size > 1 and not self.trainer.ckpt_path:
            self._official_init()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # N is read only where it is used: estimating it sets up the training data ahead of the fit loop.
        steps = self.run_steps() if self.hparams.get("horizon_aware") else None
        return get_method(self.hparams.method).optimizer(self.machines.parameters(), self.hparams, steps=steps)

    def run_steps(self) -> Optional[int]:
        """N, the optimizer steps of the whole fit (``None`` for a fit without an end): its rounds (the
        trainer's training batches over all epochs, the shape's ``rounds`` per epoch with
        ``limit_train_batches`` applied) times the shape's steps per round, at most ``trainer.max_steps``."""
        trainer = self.trainer
        if self.shape is None:
            self.shape = self._own_shape()
        per_round = self.shape.steps_per_round
        # In rounds (one training batch is one round), already capped by max_steps, which counts optimizer
        # steps: min(min(R, S) K, S) = min(R K, S) for K >= 1.
        rounds = trainer.estimated_stepping_batches
        if not math.isfinite(rounds):
            return None
        steps = int(rounds) * per_round
        return steps if trainer.max_steps == -1 else min(steps, trainer.max_steps)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        """One communication round: ``steps`` local steps on every machine, then (in the strategy) the sync.

        ``batch`` holds the round's samples, shapes ``(steps, m, b, 784)`` and ``(steps, m, b)``.
        """
        xs, ys = batch
        shape = self.shape
        if shape is None or (len(xs), xs.shape[2]) != (shape.steps_per_round, shape.per_step_batch):
            raise ValueError(
                f"Invalid training batch: {len(xs)} steps of {xs.shape[2]} samples a machine (the run's shape: "
                f"{getattr(shape, 'steps_per_round', None)} of {getattr(shape, 'per_step_batch', None)}; give the "
                "model its data's shape, MachinesModel.use_shape, as ProblemDataModule does)"
            )
        driver = self._round_driver(shape)
        losses = []
        start = time.perf_counter()
        for k in range(len(xs)):
            per_machine = self._machine_losses(xs[k], ys[k])
            driver.optimizer.zero_grad()
            self.manual_backward(per_machine.sum())
            driver.step()  # the strategy averages the machines after every K-th step
            losses.append(per_machine.detach())
        seconds, steps = self._train_time
        self._train_time = (seconds + time.perf_counter() - start, steps + len(xs))
        # One check per round (a single host sync): a non-finite loss, or parameters that became
        # non-finite in the round's last step, stop the run instead of training on NaNs.
        # Lightning's self.log costs about a millisecond: the round logs every `log_every_n_steps` rounds, when
        # Lightning writes logs, and after the run's last round (on_train_batch_end makes Lightning
        # write that one too), with the train loss averaged over the rounds since the last log.
        index = batches_started(self.trainer)  # over all epochs, this one included
        end = driver.end_round(
            torch.stack(losses).unsqueeze(1), index, self.machines.parameters(), last=self._last_round(batch_idx)
        )
        for _, error in end.diverged:
            raise error
        if end.train_loss is not None:
            (row,) = driver.train_rows(end)
            self.log_dict(row, on_step=True, on_epoch=False)

    def _round_driver(self, shape: RunShape) -> RoundDriver:
        """This fit's ``RoundDriver`` (one trial), built at its first round; the train-loss sums since the last
        log carry over from a checkpoint."""
        optimizer = self.optimizers()
        if self._driver is None or self._driver.optimizer is not optimizer:
            trainer = self.trainer
            driver = RoundDriver(
                optimizer,
                RoundSchedule(log_every=trainer.log_every_n_steps, eval_every=shape.val_check_interval),
                shape,
                method=self.hparams.method,
                lrs=[self.hparams.lr],
                counts=self.round_counts,
                links=self.links,
                step_seconds=self.step_seconds,
            )
            driver.loss_since_log = self._loss_since_log().view(1, 2)
            self._driver = driver
        return self._driver

    def round_counts(self) -> RoundCounts:
        """What one machine has done and sent so far (the strategy's averagers' counts)."""
        trainer, strategy = self.trainer, self.trainer.strategy
        if not isinstance(strategy, PeriodicAveragingStrategy):  # a strategy that does not average: nothing sent
            return RoundCounts(steps=trainer.global_step, syncs=batches_started(trainer), floats=0)
        return RoundCounts(
            steps=trainer.global_step,
            syncs=strategy.num_syncs,
            floats=strategy.floats_communicated,
            sent=strategy.link_counts,
            ddp=strategy.ddp_counts(),
            overlapped=strategy.overlapped_counts,
            overlap_delay=strategy.options.overlap_delay,
            short=tuple(sorted(strategy.short_rounds.items())),
        )

    def use_links(self, links: Sequence[Link], step_seconds: Optional[float] = None) -> None:
        """Log, with the train loss, the modelled communication time at each of ``links`` and, with the compute
        time of one optimizer step of one machine, the modelled wall time (``rounds.link_columns``)."""
        self.links, self.step_seconds = tuple(links), step_seconds

    @property
    def measured_step_seconds(self) -> float:
        """The compute time of one optimizer step of one machine, measured: the time spent in the training
        steps of the fits so far over their optimizer steps and this process's machines (``nan`` before any)."""
        seconds, steps = self._train_time
        return seconds / (steps * self.machines.num_machines) if steps and self.machines is not None else math.nan

    @property
    def train_seconds(self) -> float:
        """Seconds measured in the run's rounds so far, this process's: the local steps and the synchronisations
        (what a link slows), not data loading, logging or evaluation; a resumed run's go on from its checkpoint."""
        return self._resumed_train_s + self._train_time[0]

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["train_loss_since_log"] = self._loss_since_log().clone()
        checkpoint["train_s"] = self.train_seconds

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self._resumed_train_s = float(checkpoint.get("train_s", 0.0)) - self._train_time[0]
        sums = checkpoint.get("train_loss_since_log", torch.zeros(2, dtype=torch.float64))
        self._driver = None
        self._resumed_loss_since_log = sums

    def _loss_since_log(self) -> Tensor:
        """The train-loss sums since the last log, ``(2,)`` (``rounds.add_round_loss``), as checkpoints store them."""
        if self._driver is not None:
            return self._driver.loss_since_log[0]
        return self._resumed_loss_since_log

    def _machine_losses(self, x: Tensor, y: Tensor) -> Tensor:
        """Each machine's mean loss over its batch: x ``(m, b, 784)``, y ``(m, b)`` -> ``(m,)``."""
        return self.losses_of(self.machines(x), y)

    def losses_of(self, logits: Tensor, y: Tensor) -> Tensor:
        """Each machine's mean loss over its batch, from its outputs: logits ``(m, b, classes)`` -> ``(m,)``."""
        if self.hparams.loss == "squared":
            return 0.5 * (logits.squeeze(-1) - y).square().mean(1)
        if self.hparams.loss == "next_token":  # (m, b, length, tokens) on (m, b, length): every position's
            return cross_entropy(logits.flatten(0, -2), y.flatten(), reduction="none").view(y.shape).flatten(1).mean(1)
        return cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none").view(y.shape).mean(1)

    def _last_round(self, batch_idx: int) -> bool:
        """Whether this batch is the last of the run's last epoch."""
        trainer = self.trainer
        last_batch = batch_idx + 1 >= trainer.num_training_batches
        return last_batch and trainer.max_epochs is not None and 0 <= trainer.max_epochs <= trainer.current_epoch + 1

    def on_train_batch_end(self, outputs: object, batch: object, batch_idx: int) -> None:
        # A run that stops is validated (so the final x is evaluated even when the last round is not
        # a multiple of `val_check_interval`) and has its last train metrics written even when the
        # last round is not a multiple of `log_every_n_steps`: stop after the last round.
        if self._last_round(batch_idx):
            self.trainer.should_stop = True

    def _swap_output(self) -> None:
        swap_outputs(self.trainer.optimizers)  # none in validate/test: the parameters are evaluated

    def on_validation_epoch_start(self) -> None:
        self._swap_output()

    def on_validation_epoch_end(self) -> None:
        self._swap_output()
        if self.trainer.state.fn == "fit":  # measured time to this evaluation: the slowest process's
            self.log("train_s", self.train_seconds, reduce_fx="max", sync_dist=True)

    def on_test_epoch_start(self) -> None:
        self._swap_output()

    def on_test_epoch_end(self) -> None:
        self._swap_output()

    def _evaluate(self, batch: tuple[Tensor, Tensor]) -> None:
        x, y = batch
        logits = self.machines.forward_averaged(x)
        loss = test_loss(logits, y, self.hparams.loss)
        self.log("test_loss", loss, prog_bar=True)
        if self.hparams.loss == "next_token":  # bits per character: the loss in nats over ln 2; accuracy per position
            self.log("test_bpc", loss / math.log(2), prog_bar=True)
            logits, y = logits.flatten(0, -2), y.flatten()
        if self.test_acc is not None:
            # Logged per epoch (Lightning computes and resets it at the end of the evaluation): update
            # only; calling the metric would also compute this batch's accuracy, which nobody reads.
            self.test_acc.update(logits, y)
            self.log("test_acc", self.test_acc, prog_bar=True)
        if self.trainer.state.fn == "fit":
            self.log("round", float(getattr(self.trainer.strategy, "num_syncs", 0)))

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self._evaluate(batch)

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self._evaluate(batch)


def official_init(num_machines: int, seed: int, input_dim: int = 784, num_classes: int = 10) -> tuple[Tensor, Tensor]:
    """Every machine's initial weights in the paper's code: ``(M, num_classes, input_dim)``, ``(M, num_classes)``.

    The code (github.com/dahan198/slowcal-sgd, ``main.py``) seeds torch with the seed, then builds
    one model per worker, PyTorch's default ``nn.Linear`` initialisation (weight and bias uniform on
    +-1 / sqrt(input_dim)), and the worker's ``DataLoader`` iterator, which draws one int64 (its
    base seed) from the same generator. Worker i trains from its own weights; the first
    synchronisation averages them. Here the same draws are made from a private generator seeded
    alike, so torch's global random state is left untouched.
    """
    g = torch.Generator().manual_seed(seed)
    bound = 1 / math.sqrt(input_dim)
    # On the CPU, as the generator, also inside a device context (Lightning's configure_model on a GPU).
    weight = torch.empty(num_machines, num_classes, input_dim, device="cpu")
    bias = torch.empty(num_machines, num_classes, device="cpu")
    for i in range(num_machines):
        nn.init.kaiming_uniform_(weight[i], a=math.sqrt(5), generator=g)  # as nn.Linear.reset_parameters
        nn.init.uniform_(bias[i], -bound, bound, generator=g)
        torch.empty((), dtype=torch.int64, device="cpu").random_(generator=g)  # the DataLoader iterator's base seed
    return weight, bias
