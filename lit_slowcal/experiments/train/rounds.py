"""A method's round, driven once over a trial dimension T (a single run is T = 1).

The single run (``model.MachinesModel`` in a Lightning ``Trainer``) and the stacked trials
(``sweep.stacked``: T trials of one shape trained as T x M machines) both drive their rounds with one
``RoundDriver``: its ``step`` takes an optimizer step (and, without a strategy, the averager's), its
``end_round`` ends a round (each trial's round loss, the finiteness check, the train loss averaged
since the last log, whether the round logs and whether it is evaluated) and its ``train_rows`` are
the rows logged. Each path supplies only what differs: the forward and gradient of a step, its
averager's counts, and what it does with a ``RoundEnd`` (a single run raises on divergence and logs
through Lightning, whose loop evaluates at the same rounds; the stacked trials freeze a diverged
trial and evaluate their blocks together). The pieces it is made of:

* ``round_losses`` and ``diverged_trials``: each trial's round loss, and the finiteness check of the
  losses and parameters (one host sync when everything is finite); ``divergence`` the error that
  stops a diverged trial, ``TrainingDiverged``, and ``trial_status`` the status a sweep records;
* ``add_round_loss``, ``mean_train_loss`` and ``train_row``: the training loss averaged over the
  rounds since the last log, and the row logged with it, with the counts of what was sent
  (``RoundCounts``, ``count_columns``);
* ``swap_outputs``: the optimizers whose trained model is not their query point exchange the two
  around an evaluation;
* ``cross_entropy``: the cross-entropy of a training step and of an evaluation;
* ``test_loss``, ``epoch_mean``, ``epoch_value`` and ``evaluation_row``: an evaluation's metrics as
  Lightning's epoch-level logging gives them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from lit_slowcal.experiments.train.shape import RunShape
from lit_slowcal.link import Link, LinkCounts, hidden_seconds
from lit_slowcal.protocol import declared

__all__ = [
    "RoundCounts", "RoundDriver", "RoundEnd", "RoundSchedule", "TrainingDiverged", "add_round_loss", "count_columns",
    "cross_entropy", "divergence", "diverged_trials", "epoch_mean", "epoch_value", "epoch_values", "evaluation_row",
    "link_columns", "link_tag", "mean_train_loss", "modelled_wall", "round_losses", "swap_outputs", "test_loss", "train_row", "trial_status",
]  # fmt: skip


class TrainingDiverged(FloatingPointError):
    """A run's training loss or parameters became non-finite (NaN or infinite) in a round.

    A ``FloatingPointError``: code that catches those catches it too. A sweep records the trial as
    ``diverged`` (``trial_status``); any other error is a failure.
    """


def trial_status(error: Optional[BaseException]) -> str:
    """A sweep trial's status from how its training ended: ``finished`` (no error), ``diverged``
    (``TrainingDiverged``) or ``failed`` (any other error)."""
    if error is None:
        return "finished"
    return "diverged" if isinstance(error, TrainingDiverged) else "failed"


def round_losses(losses: Tensor) -> Tensor:
    """Each trial's round loss: ``losses`` ``(k, T, M)``, every step's per-machine losses of the round,
    -> ``(T,)``, the mean over the round's steps and machines (each trial's ``(k, M)`` block reduced
    contiguously, as the single run reduces its own)."""
    return torch.stack([losses[:, i].clone().mean() for i in range(losses.shape[1])])


def diverged_trials(round_loss: Tensor, params: Iterable[Tensor], trials: int) -> list[int]:
    """The trials whose round loss or parameters are not finite (``[]`` when all are: one host sync).

    Args:
        round_loss: ``(T,)`` (or one value when T = 1), each trial's round loss.
        params: tensors ``(T * M, ...)`` (or ``(T, ...)``), trial i's rows the i-th T-th of them.
        trials: T.
    """
    rows = [p.detach() for p in params]
    # A tensor is finite when its min and max are (aminmax propagates NaN): one pass without a boolean
    # copy, several times faster than isfinite().all() on the stacked weights.
    extremes = torch.stack([v for p in rows for v in torch.aminmax(p)])
    if bool(torch.isfinite(round_loss).all() & torch.isfinite(extremes).all()):
        return []
    per_trial = torch.cat([torch.stack(torch.aminmax(p.reshape(trials, -1), dim=1), 1) for p in rows], 1)
    finite = (torch.isfinite(round_loss.reshape(trials)) & torch.isfinite(per_trial).all(1)).tolist()
    return [i for i, ok in enumerate(finite) if not ok]


def divergence(round_loss: float, round_index: int, method: str, lr: float) -> TrainingDiverged:
    """The error of a trial that diverged in round ``round_index`` (its loss there: ``round_loss``)."""
    what = f"train loss {round_loss}" if not math.isfinite(round_loss) else "non-finite parameters"
    return TrainingDiverged(
        f"Training diverged: {what} in round {round_index} (method={method}, lr={lr}). Try a smaller lr."
    )


def add_round_loss(sums: Tensor, round_loss: Tensor) -> Tensor:
    """The train-loss sums since the last log, ``(..., 2)`` (float64: the round losses' sum, the rounds),
    with the rounds' losses ``round_loss`` ``(...)`` added; on the loss's device."""
    loss = round_loss.detach().double()
    return sums.to(loss.device) + torch.stack([loss, torch.ones_like(loss)], -1)


def mean_train_loss(sums: Tensor) -> Tensor:
    """The train loss logged: the mean round loss since the last log, ``(...)`` in float32, from the sums
    ``(..., 2)`` of ``add_round_loss``."""
    return (sums[..., 0] / sums[..., 1]).float()


@dataclass(frozen=True)
class RoundCounts:
    """What one machine of a trial has done and sent so far: its optimizer steps, the synchronisations,
    the floats it sent, what it sent on the ring (``sent``, ``lit_slowcal.link.LinkCounts``: one
    participating machine's) and what DDP would have sent over the same steps (``ddp``)."""

    steps: int
    syncs: int
    floats: Union[int, float]
    sent: LinkCounts = LinkCounts()
    ddp: LinkCounts = LinkCounts()
    overlapped: LinkCounts = LinkCounts()  # the part of ``sent`` in overlapped rounds
    overlap_delay: int = 0  # tau: the optimizer steps an overlapped round's communication hides behind
    short: tuple[tuple[int, int], ...] = ()  # (s, rounds): overlapped rounds closed after s < tau steps in flight


def count_columns(counts: RoundCounts) -> dict[str, float]:
    """The link-independent counts of a logged row: the optimizer steps of one machine, the ring bytes one
    participating machine sent and the ring's latency terms (``LinkCounts``), and DDP's over the same steps;
    seconds at any link follow (``lit_slowcal.experiments.measure.communication``)."""
    return {
        "optimizer_steps": float(counts.steps),
        "ring_bytes_per_machine": float(counts.sent.ring_bytes),
        "ring_hops": float(counts.sent.ring_hops),
        "ddp_ring_bytes_per_machine": float(counts.ddp.ring_bytes),
        "ddp_ring_hops": float(counts.ddp.ring_hops),
    }


def link_tag(link: Link) -> str:
    """A link as a metric name's suffix: ``10Gbit/s,1ms`` -> ``10Gbitps_1ms`` (no ``/`` or ``,``)."""
    return str(link).replace("/s", "ps").replace(",", "_")


def modelled_wall(counts: RoundCounts, link: Link, step_seconds: float) -> tuple[float, float]:
    """The modelled wall time at ``link`` with ``step_seconds`` of compute an optimizer step, and DDP's: compute
    plus communication (blocking rounds: the two add), less what overlapped rounds hide behind the tau steps
    after each, or the s < tau steps of one closed early (``lit_slowcal.link.hidden_seconds``)."""
    compute = counts.steps * step_seconds
    short = {s * step_seconds: n for s, n in counts.short}
    hidden = hidden_seconds(counts.overlapped, link, counts.overlap_delay * step_seconds, short)
    return compute + counts.sent.seconds(link) - hidden, compute + counts.ddp.seconds(link)


def link_columns(counts: RoundCounts, links: Sequence[Link], step_seconds: Optional[float] = None) -> dict[str, float]:
    """Per link, the modelled communication seconds so far (``comm_s_<tag>``: the link busy, overlapped or not)
    and DDP's over the same steps (``ddp_comm_s_<tag>``); with a compute time per optimizer step, the modelled
    wall time (``wall_s_<tag>``, ``ddp_wall_s_<tag>``: ``modelled_wall``)."""
    out: dict[str, float] = {}
    for link in links:
        tag = link_tag(link)
        out[f"comm_s_{tag}"], out[f"ddp_comm_s_{tag}"] = counts.sent.seconds(link), counts.ddp.seconds(link)
        if step_seconds is not None:
            out[f"wall_s_{tag}"], out[f"ddp_wall_s_{tag}"] = modelled_wall(counts, link, step_seconds)
    return out


def train_row(
    train_loss: Any,
    *,
    counts: RoundCounts,
    steps_per_round: int,
    batch_size: int,
    machines: int,
    rounds_done: int,
    links: Sequence[Link] = (),
    step_seconds: Optional[float] = None,
) -> dict[str, Any]:
    """The row logged with the train loss after round ``rounds_done``: the rounds so far (the
    synchronisations), the samples all ``machines`` have drawn, the floats they sent (``counts.floats``
    per machine), the counts of ``count_columns`` and, for each of ``links``, ``link_columns``."""
    return {
        "train_loss": train_loss,
        "round": float(counts.syncs),
        "samples_seen": float(steps_per_round * batch_size * machines * rounds_done),
        "floats_communicated": float(counts.floats * machines),
        # float64 tensors: logged as they are (Lightning makes a Python number a float32 tensor)
        **{
            k: torch.tensor(v, dtype=torch.float64)
            for k, v in {**count_columns(counts), **link_columns(counts, links, step_seconds)}.items()
        },
    }


@dataclass(frozen=True)
class RoundSchedule:
    """Which rounds log their train loss and which are evaluated: every ``log_every`` and every ``eval_every``
    rounds (counted from 1), and the run's last round. A single run gives Lightning the same numbers
    (``trainer.log_every_n_steps``, ``val_check_interval``); the stacked trials follow it themselves."""

    log_every: int
    eval_every: int

    def logs(self, index: int, last: bool = False) -> bool:
        """Whether round ``index`` (from 1) logs its train loss."""
        return index % self.log_every == 0 or last

    def evaluates(self, index: int, last: bool = False) -> bool:
        """Whether the averaged model is evaluated after round ``index`` (from 1)."""
        return index % self.eval_every == 0 or last


@dataclass
class RoundEnd:
    """The end of round ``index`` (from 1), per trial.

    Attributes:
        index: the round, counted from 1 over the whole run.
        round_loss: ``(T,)``, each trial's mean loss over the round's steps and machines.
        diverged: the trials whose round loss or parameters are not finite, each with its error.
        train_loss: ``(T,)`` float32, the mean round loss since the last log, when this round logs; else ``None``.
        evaluate: whether the averaged model is evaluated after this round.
    """

    index: int
    round_loss: Tensor
    diverged: list[tuple[int, TrainingDiverged]]
    train_loss: Optional[Tensor]
    evaluate: bool


class RoundDriver:
    """Drives the rounds of T trials of one shape that step one optimizer (a single run: T = 1).

    Args:
        optimizer: the trials' optimizer; ``step`` steps it.
        schedule: when a round logs and when it is evaluated.
        shape: the run's ``RunShape`` (its steps per round, per-step batch and M), for the rows logged.
        method: the method's name, and ``lrs`` each trial's learning rate, for a divergence's error.
        counts: ``() -> RoundCounts`` so far, of one machine of one trial.
        sync: called after each optimizer step where no strategy synchronises (the stacked trials'
            ``PeriodicAverager.step``); returns whether it synchronised.
        device: where the train-loss sums live.
        links, step_seconds: the links whose modelled seconds the rows carry, and the compute time of one
            optimizer step of one machine (``None``: the rows carry no modelled wall time), ``link_columns``.
    """

    def __init__(
        self,
        optimizer: Any,
        schedule: RoundSchedule,
        shape: RunShape,
        *,
        method: str,
        lrs: Sequence[float],
        counts: Callable[[], RoundCounts],
        sync: Optional[Callable[[], bool]] = None,
        device: Optional[torch.device] = None,
        links: Sequence[Link] = (),
        step_seconds: Optional[float] = None,
    ) -> None:
        self.optimizer, self.schedule, self.sync, self.counts = optimizer, schedule, sync, counts
        self.shape = shape
        self.method, self.lrs = method, list(lrs)
        self.links, self.step_seconds = tuple(links), step_seconds
        self.trials = len(self.lrs)
        self.loss_since_log = torch.zeros(self.trials, 2, dtype=torch.float64, device=device)

    def step(self) -> bool:
        """One optimizer step of every trial, after its gradients, and the synchronisation it is due (``sync``):
        whether it synchronised (``False`` where a strategy does it)."""
        self.optimizer.step()
        return bool(self.sync()) if self.sync is not None else False

    def end_round(self, losses: Tensor, index: int, params: Iterable[Tensor], *, last: bool = False) -> RoundEnd:
        """End round ``index`` (from 1): ``losses`` ``(steps, T, M)`` its steps' per-machine losses, ``params``
        the trials' parameters (``diverged_trials``), ``last`` whether it is the run's last round."""
        round_loss = round_losses(losses)
        diverged = [
            (i, divergence(round_loss[i].item(), index, self.method, self.lrs[i]))
            for i in diverged_trials(round_loss, params, self.trials)
        ]
        self.loss_since_log = add_round_loss(self.loss_since_log, round_loss)
        train_loss = None
        if self.schedule.logs(index, last):
            train_loss = mean_train_loss(self.loss_since_log)
            self.loss_since_log = torch.zeros_like(self.loss_since_log)
        return RoundEnd(index, round_loss, diverged, train_loss, self.schedule.evaluates(index, last))

    def train_rows(self, end: RoundEnd) -> list[dict[str, Any]]:
        """Each trial's row logged with its train loss after a round that logs (``end.train_loss``)."""
        assert end.train_loss is not None, "a round that logs"
        counts = self.counts()
        return [
            train_row(
                loss,
                counts=counts,
                steps_per_round=self.shape.steps_per_round,
                batch_size=self.shape.per_step_batch,
                machines=self.shape.num_machines,
                rounds_done=end.index,
                links=self.links,
                step_seconds=self.step_seconds,
            )
            for loss in end.train_loss.unbind()
        ]


def swap_outputs(optimizers: Iterable[Any]) -> None:
    """Around an evaluation: an optimizer whose trained model is not its query point (AC-SA: x^ag, not
    x^md) exchanges the two in the parameters (optimizer protocol: ``swap_output()``); called before
    and after, it swaps back."""
    for optimizer in optimizers:
        swap = declared(optimizer).swap_output
        if swap is not None:
            swap()


#: ``cross_entropy`` pads its samples to a multiple of this many: of every CPU's vector width in floats.
_LANES = 64


def cross_entropy(logits: Tensor, y: Tensor, reduction: str = "mean") -> Tensor:
    """``F.cross_entropy(logits, y, reduction=reduction)`` of logits ``(n, classes)`` and labels ``(n,)``: the
    negative log-likelihood of ``log_softmax`` over the classes, differentiable, with the classes laid along the
    first dimension.

    PyTorch's CPU ``log_softmax`` over a short last dimension (MNIST's 10 classes) takes one sample at a time;
    over the first dimension it takes a vector of samples at a time, several times faster
    (``benchmarks/bench_evaluation.py``).
    Each sample's value comes from its own classes alone, in the same operations in the same order whatever
    the other samples (the samples are padded with zeros to a multiple of ``_LANES``, so that none falls in the
    kernel's scalar tail). On an AVX-512 CPU these are ``F.cross_entropy``'s values and gradients bit for bit
    (``tests/experiments/train/test_rounds.py``); on others its sum over the classes may round differently. The
    single run and the stacked trials both train and evaluate with it.
    """
    n = logits.shape[0]
    log_p = torch.log_softmax(_ClassesFirst.apply(logits), 0)[:, :n].T
    return F.nll_loss(log_p, y, reduction=reduction)


class _ClassesFirst(torch.autograd.Function):
    """Logits ``(n, classes)`` -> ``(classes, n + padding)``, zero-padded to a multiple of ``_LANES`` samples, whose
    gradient goes back laid out as the logits (as ``F.cross_entropy``'s: the matmul before it reads that layout,
    and its backward's bits depend on it)."""

    @staticmethod
    def forward(ctx: Any, logits: Tensor) -> Tensor:
        ctx.n = logits.shape[0]
        return F.pad(logits.T, (0, -ctx.n % _LANES))

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return grad[:, : ctx.n].T.contiguous()


def test_loss(logits: Tensor, y: Tensor, loss: str) -> Tensor:
    """The mean loss of the averaged model's outputs ``logits`` ``(n, outputs)`` on labels ``y`` ``(n,)``:
    ``cross_entropy``, or ``squared``, (z - y)^2 / 2 on one output, or ``next_token``, the cross-entropy of every
    position's next token (``(n, length, tokens)`` on ``(n, length)``)."""
    if loss == "squared":
        return 0.5 * (logits.squeeze(-1) - y).square().mean()
    if loss == "next_token":  # (n, length, tokens) on (n, length): the mean over every position
        return cross_entropy(logits.flatten(0, -2), y.flatten())
    return cross_entropy(logits, y)


def epoch_mean(value: Tensor, n: int) -> Tensor:
    """Lightning's epoch-level mean of a value logged once with batch size n: (0 + v * n) / n."""
    return (torch.tensor(0.0, dtype=value.dtype) + value * n) / (torch.tensor(0) + n)


def epoch_value(value: Any, n: int = 1) -> float:
    """A value logged once in an epoch hook or step with batch size n, as Lightning gives it at the
    epoch's end: a Python number as a float32 tensor, a tensor in its dtype, ``epoch_mean``."""
    return float(epoch_mean(value if isinstance(value, Tensor) else torch.tensor(value), n))


def epoch_values(metrics: dict[str, Any]) -> dict[str, float]:
    """Each of ``metrics`` as ``epoch_value`` gives it (one value logged once in the epoch)."""
    return {k: epoch_value(v) for k, v in metrics.items()}


def evaluation_row(logits: Tensor, y: Tensor, loss: str) -> dict[str, float]:
    """An evaluation on one batch of ``len(y)`` samples, as the single run logs it: ``test_loss`` and,
    for classes, ``test_acc`` (micro accuracy)."""
    from torchmetrics.functional.classification import multiclass_accuracy

    row = {"test_loss": epoch_value(test_loss(logits, y, loss), len(y))}
    if loss == "cross_entropy":
        row["test_acc"] = float(multiclass_accuracy(logits, y, num_classes=logits.shape[-1], average="micro"))
    return row
