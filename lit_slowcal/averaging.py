"""Periodic averaging of a model and its optimizer state over machines, with or without a framework.

``PeriodicAverager`` is the parameter server of Local-SGD and SLowcal-SGD (Algorithm 2 of the
paper): every ``sync_every`` optimizer steps it replaces, on every machine, the parameters, the
floating-point buffers and the optimizer state the optimizer declares by their average over all
M machines. A machine is a process of the process group, or one of the m machines a
``SimulatedMachines`` module hosts in a process (M = processes x m, each with equal weight).

It needs only torch. It attaches to a plain training loop (an optimizer step hook, or explicit
``step()`` calls), to Fabric (``PeriodicAveragingFabricStrategy``) and to Lightning's ``Trainer``
(``PeriodicAveragingStrategy``); those adapters only call ``step()``.

The optimizer protocol
----------------------
What a synchronisation does with an optimizer is declared by the optimizer, never special-cased
here: ``averaged_state`` (state averaged with the parameters, SlowcalSGD's w), ``pre_sync()`` and
``post_sync()`` (around the average), an ``outer_optimizer`` of its own, ``supports_participation``.
Every member is optional (``torch.optim.SGD`` declares nothing and gets plain Local-SGD); they are
listed once, in ``lit_slowcal.protocol``, and read through ``protocol.declared``. What is averaged
is what a machine sends: ``floats_communicated`` counts it (``Scaffold``: y and delta_c, 2d floats
a machine a round; ``AcceleratedSGD`` and SGD synchronised every step: d), ``bytes_communicated`` in
the dtypes sent, and ``link_counts`` for the ring model of ``lit_slowcal.link`` (seconds at any
link; ``ddp_counts()`` the same for DDP). State not averaged stays per machine and travels in
``state_dict()`` (``lit_slowcal._machine_state``).

The server's side of a round
----------------------------
By default the round's new model is the plain average of the machines. ``outer_optimizer`` (a
factory ``params -> Optimizer`` over one copy of the global parameters; DiLoCo, FedAvgM, FedAdam)
steps on the pseudo-gradient x_s - x_bar instead, and ``participation`` averages over S machines of
the M drawn afresh every round (``lit_slowcal._server`` gives the details).

Round boundaries and one schedule
---------------------------------
A round ends after every K-th step (``steps % sync_every == 0``). Code that takes the model out of
training mid-round (evaluation, a checkpoint, the end of training) calls ``close_round()``: every
machine then holds the same averaged model, and the next synchronisation is still at the next
multiple of K. ``state_dict()`` records the schedule, so a run resumed from it continues exactly.
The Trainer and Fabric strategies close the round before every validation and checkpoint and at
the end of ``fit``; a plain loop calls it itself. Every machine must count ``step()`` alike (see
``step``: a ``GradScaler`` may skip an ``optimizer.step()``, and ``check_schedule``).

Observers that are not the optimizer (diagnostics) register with ``register_sync_pre_hook``. The
tensors travel in buckets, one all-reduce each, at most two in flight (``lit_slowcal._communication``).

Overlapped rounds
-----------------
With ``overlap_delay`` tau >= 1 a round's average travels while training goes on and lands tau steps
later as live <- avg + (live - snapshot); with ``fragments`` F > 1 the model's parts take turns, one
every K / F steps (``lit_slowcal._overlap``, docs/communication.md). The defaults block, as above.
"""

from __future__ import annotations

import zlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, Optional, Union

import torch
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from lit_slowcal import _averager_state, _collectives, _communication, _overlap, _selection, _server, link
from lit_slowcal._averager_state import COMPRESSION_KEY, IN_FLIGHT_KEY
from lit_slowcal._coded import CodedAverage
from lit_slowcal._collectives import broadcast_module
from lit_slowcal._compressed import CompressedAverage
from lit_slowcal._counts import Counts, counted
from lit_slowcal._hooks import after_every_step, on_every_backward
from lit_slowcal._rounds import CodedRound, Engine, ExactRound
from lit_slowcal._selection import Modules, Tensors, buffer_owners, machines_per_process
from lit_slowcal._validation import check_int
from lit_slowcal.compression import Code
from lit_slowcal.options import AveragingOptions
from lit_slowcal.protocol import declared

__all__ = [
    "COMPRESSION_KEY",
    "IN_FLIGHT_KEY",
    "PeriodicAverager",
    "broadcast_module",
    "buffer_owners",
    "machines_per_process",
]


class PeriodicAverager:
    """Average parameters, floating buffers and declared optimizer state over all machines every K steps.

    Args:
        module: the model (or a list of modules) whose floating buffers are averaged and whose
            ``SimulatedMachines`` submodules hold machines stacked along dimension 0.
        optimizer: the optimizer stepping the machines; its parameters and declared state (see the
            module docstring) are averaged.
        sync_every: K, optimizer steps between synchronisations (>= 1; ``options.sync_every``).
        options: every synchronisation option (``lit_slowcal.options.AveragingOptions``); ``settings``,
            the same options by name (``compression="int8"``), replace its fields.
        process_group: the processes to average over; ``None``: the default group when
            ``torch.distributed`` is initialised, else this process alone. An FSDP2-sharded model's
            local shards are averaged over it: the mesh's replicate group (docs/sharded.md).
        start_step: optimizer steps already taken (a resumed run keeps its sync schedule).
        buffers: the buffers this averager averages; ``None``: every floating buffer of ``module``.
            With several optimizers each buffer belongs to one averager (see ``buffer_owners``).

    A combination of options that cannot work with this optimizer or model is refused here, in one
    line (``AveragingOptions.check_with``).

    Overlapped rounds (tau >= 1 or F > 1; docs/communication.md): the averaged tensors are cut into F
    fragments (``_overlap.partition``: contiguous runs of ``_tensors()``, a parameter with its averaged
    optimizer state never cut from it, the largest run's parameter and buffer bytes as small as can be,
    the same on every rank). Fragment f's round starts where ``steps % K == f * K / F``: the schedule
    check, the sync pre-hooks, ``optimizer.pre_sync()``, then a snapshot of the fragment's tensors
    whose average starts (all-reduces in flight; with one process, computed at once and held).
    Training goes on on the live tensors; tau steps later (counted by ``step()``) the round lands:
    with an outer optimizer its step is taken on the snapshot's average, then live <- avg + (live -
    snapshot) (the round's average plus the local progress since the snapshot), then
    ``optimizer.post_sync()``. With tau = 0 a fragment's round is a blocking average of the fragment.
    A round's weights (``participation``) are drawn when it starts. Each fragment's round is one of
    ``num_syncs`` and sends that fragment's bytes (K steps send the whole model once, as with F = 1);
    ``last_sync_step`` is the step it started at. While a round is in flight it holds two copies of
    its tensors (the snapshot and the average). ``close_round()`` (and ``sync()``) lands a round in
    flight, then synchronises the whole model, blocking. ``state_dict()`` taken while a round is in
    flight waits for its average and holds the round (each machine's snapshot, the average, the step it
    lands at, its fragment); ``load_state_dict()`` restores it, and the resumed run lands it at that
    step with the same values. An optimizer that declares
    ``pre_sync`` or ``post_sync`` acts on the whole model at once: it is refused with F > 1.

    Example, a plain torch loop (one process per machine, ``torch.distributed`` initialised)::

        optimizer = SlowcalSGD(model.parameters(), lr=0.01)
        with PeriodicAverager(model, optimizer, sync_every=16):  # syncs after every 16th step
            for x, y in loader:
                optimizer.zero_grad()
                loss_fn(model(x), y).backward()
                optimizer.step()

    or call ``averager.step()`` after each ``optimizer.step()`` instead of attaching it.
    """

    def __init__(
        self,
        module: Modules,
        optimizer: Optimizer,
        sync_every: Optional[int] = None,
        *,
        options: Optional[AveragingOptions] = None,
        process_group: Optional[Any] = None,
        start_step: int = 0,
        buffers: Optional[Sequence[Tensor]] = None,
        **settings: Any,
    ) -> None:
        #: Every synchronisation option (``lit_slowcal.options``): ``options`` with ``sync_every`` and ``settings``.
        self.options = AveragingOptions.build(
            options, **settings, **({} if sync_every is None else {"sync_every": sync_every})
        )
        self.modules: list[nn.Module] = [module] if isinstance(module, nn.Module) else list(module)
        if not all(isinstance(m, nn.Module) for m in self.modules):
            raise TypeError(f"Invalid module: {module!r} (an nn.Module or a sequence of them)")
        # Wrappers (Lightning's or Fabric's optimizer) expose the torch optimizer as `.optimizer`.
        while not isinstance(optimizer, Optimizer) and isinstance(getattr(optimizer, "optimizer", None), Optimizer):
            optimizer = optimizer.optimizer
        if not isinstance(optimizer, Optimizer):
            raise TypeError(f"Invalid optimizer: {optimizer!r} (a torch.optim.Optimizer)")
        self.optimizer = optimizer
        #: Whether the model holds FSDP2 shards (DTensors), averaged by their local tensors (docs/sharded.md).
        self.sharded = _selection.check_sharding(self.modules, optimizer, process_group)
        factory = self.options.check_with(
            optimizer, sharded=self.sharded, machines_per_process=machines_per_process(self.modules)
        )
        self.process_group = process_group
        self.buffers = None if buffers is None else list(buffers)
        self.steps = 0
        self.num_syncs = 0
        self.last_sync_step = 0  # steps at the last synchronisation (scheduled or closing a round)
        self._settled_step = 0  # steps at the last blocking synchronisation of the whole model
        self._in_flight: Optional[_overlap.Round] = None  # an overlapped round started and not landed
        #: What was sent so far, every kind of round counted alike (``lit_slowcal._counts``).
        self.counts = Counts()
        self.backward_passes = 0  # counted by a gradient hook; compared across ranks at every sync
        self._machines: Optional[int] = None  # m, counted once
        self._setup_checked = False  # the ranks compared their set-up (before the first average)
        # What a rank whose count fell behind should do; the strategies give their own advice.
        self.skip_advice = "call averager.step() once per iteration rather than attaching it to the optimizer"
        self._backward_hook = on_every_backward(optimizer, self._count_backward)
        self._hooks: list[Any] = []
        self._reload_hook: Optional[RemovableHandle] = None  # per-machine state put back after an optimizer load
        self._sync_pre_hooks: OrderedDict[int, Callable[[PeriodicAverager], None]] = (
            OrderedDict()
        )  # weakly referenced by handles
        self.outer: Optional[Optimizer] = None  # the server's optimizer over self.global_params
        self.global_params: list[Tensor] = []  # x_s, the round's start, one machine's shape
        if factory is not None:
            self.global_params, self.outer = _server.start_outer(factory, self._outer_pairs())
        self.options.check_tensors(self._tensors(), self.machines_per_process)
        #: How a round's tensors become their average, and what that sends (``lit_slowcal._rounds``).
        self.engine: Engine = _engine(self.options, self.num_machines, self.machines_per_process, process_group)
        if self.options.fragments > 1:
            self._fragments()  # at least F units, or one line now
        if start_step:
            self.resume(start_step)

    # -- schedule ----------------------------------------------------------------------------

    @property
    def sync_every(self) -> int:
        """K, optimizer steps between synchronisations (``options.sync_every``)."""
        return self.options.sync_every

    @sync_every.setter
    def sync_every(self, value: int) -> None:
        """K, set mid-run: the options with it (checked against tau and F)."""
        self.options = self.options.with_sync_every(value)

    @property
    def _overlapped(self) -> bool:
        """Whether rounds overlap training or take turns by fragment (tau >= 1 or F > 1)."""
        return self.options.overlap_delay > 0 or self.options.fragments > 1

    def step(self) -> bool:
        """Count one step of the schedule; synchronise when it is a multiple of K. Returns whether it did.
        With overlapped rounds: land the round in flight at its step, and start a fragment's round every
        K / F steps (returns whether one started).

        ``attach()`` calls it after every ``optimizer.step()``. A loop whose optimizer step may be
        skipped on one machine (``GradScaler``) calls it itself once per iteration, after
        ``scaler.step(optimizer)`` and ``scaler.update()``, so every machine counts alike::

            scaler.scale(loss).backward()
            scaler.step(optimizer)  # skipped where the gradients hold inf/NaN
            scaler.update()
            averager.step()  # counted on every machine, skipped or not
        """
        self._drop_reload_hook()  # training goes on: a later optimizer load is the loop's own
        self.steps += 1
        if self._overlapped:
            return self._overlapped_step()
        if self.steps % self.sync_every:
            return False
        self.sync()
        return True

    def _overlapped_step(self) -> bool:
        """``step()``'s schedule with overlapped rounds: land the round in flight at its step, start a
        fragment's round every K / F steps. Returns whether one started."""
        if self._in_flight is not None and self.steps >= self._in_flight.land_step:
            self._land()
        period = self.sync_every // self.options.fragments
        if self.steps % period:
            return False
        self._start_round((self.steps // period) % self.options.fragments)
        return True

    @property
    def in_round(self) -> bool:
        """Whether the machines may differ: a step was taken since the last synchronisation of the whole
        model, or a round is in flight."""
        return self.steps != self._settled_step or self._in_flight is not None

    def close_round(self) -> bool:
        """Synchronise now if a step was taken since the last synchronisation of the whole model, or a
        round is in flight (it lands first). Returns whether it did.

        Call it where the model leaves training mid-round (evaluation, a checkpoint, the end of
        training): every machine then holds the same averaged model. The schedule is unchanged:
        the next synchronisation is still after the next multiple of K steps (of K / F with fragments).
        A round in flight restored by ``load_state_dict`` lands here as one started in this run does.
        """
        if not self.in_round:
            return False
        self.sync()
        return True

    def resume(self, steps: int) -> None:
        """Continue a schedule after ``steps`` optimizer steps that synchronised every K (and nowhere else).

        The counts of what was sent are those of ``num_syncs`` synchronisations of what is averaged
        now (``floats_communicated``, ``bytes_communicated``, ``link_counts``; its ``check_bytes`` from 0).
        """
        check_int("steps", steps, minimum=0)
        self._refuse_in_flight("resume()")
        period = self.sync_every // self.options.fragments
        self.steps = steps
        self.num_syncs = steps // period
        self.last_sync_step = self._settled_step = self.num_syncs * period
        self._count_from_syncs()

    def _count_from_syncs(self, floats: bool = True) -> None:
        """The counts of what was sent, rebuilt as ``num_syncs`` rounds of what is averaged now (with
        fragments, round j sends fragment j mod F; with ``compression``, every round counted as
        compressed); ``floats``: ``floats_communicated`` too."""
        n, F = self.num_syncs, self.options.fragments
        parts = [self._tensors()] if F == 1 else self._fragments()
        S = self.participants
        rounds = [
            (tensors, self.engine.sent(tensors, S), len(range(f or F, n + 1, F))) for f, tensors in enumerate(parts)
        ]
        sent = Counts.rebuilt(rounds, self.num_machines, self.participants, overlapped=self.options.overlap_delay > 0)
        if not floats:
            sent.floats = self.counts.floats
        self.counts = sent

    def stage_bytes(self) -> tuple[int, int]:
        """One participant's bytes in the two stages of a synchronisation (``LinkCounts.of_stages``): the
        payload twice (the ring all-reduce's halves), or with ``compression`` its first-stage message and
        the mean's (as if every tensor had an anchor)."""
        if self.compressed is None:
            payload = link.payload_bytes(self._tensors())
            return payload, payload
        return self.compressed.message_bytes(self._tensors())

    @property
    def compressed(self) -> Optional[CompressedAverage]:
        """With ``compression``, the anchors and error feedback (``CompressedAverage``, or ``CodedAverage`` for a
        ``Code``); ``None`` for the exact average."""
        return self.engine.state if isinstance(self.engine, CodedRound) else None

    def state_dict(self) -> dict[str, Any]:
        """The schedule, this process's per-machine optimizer state (``"per_machine"``, where the optimizer
        keeps tensors a synchronisation leaves per machine, e.g. AdamW's moments; see
        ``lit_slowcal._machine_state``), with an outer optimizer the round's start and the outer
        optimizer's state, with ``compression`` the anchors and error feedback (``"compression"``); the
        keys: ``lit_slowcal._averager_state``.

        Local: it holds this process's machines only. A single file for all processes is
        ``gather_state_dict()``'s. With overlapped rounds it also holds ``"settled_step"`` (the last
        synchronisation of the whole model) and, while a round is in flight, waits for its average and
        keeps the round under ``"in_flight"`` (``_overlap.Round.state_dict``): a run loaded from it lands
        the round at the same step with the same values, without communicating it again.
        """
        settled = self._settled_step if self._overlapped else None
        return _averager_state.state_dict(self, self._averaged_keys(), settled, self._in_flight, self._tensors)

    def gather_state_dict(self, dst: int = 0) -> Optional[dict[str, Any]]:
        """``state_dict()`` with every process's per-machine state, on group rank ``dst`` (``None`` on the
        others). A collective: every rank calls it. Save what rank ``dst`` gets; every rank then resumes
        its own machines' state from it with ``load_state_dict``::

            state = averager.gather_state_dict()       # on every rank
            if rank == 0:
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "averager": state}, path)
            ...
            optimizer.load_state_dict(saved["optimizer"])  # first: it holds rank 0's per-machine state
            averager.load_state_dict(saved["averager"])    # then each rank's own
        """
        return _averager_state.gather_state_dict(self, dst)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict()`` or ``gather_state_dict()`` returned: the schedule, this process's
        per-machine optimizer state (best after the optimizer's own ``load_state_dict``, whose state it
        completes; an optimizer loaded after it, before the next step, gets it put back) and the server's
        state.

        A state saved while a round was in flight (``"in_flight"``) restores that round, its average
        already computed: the step ``land_step`` lands it as the saved run would have (``close_round()``
        lands it, then synchronises the whole model), bit for bit on the same machines. It finds its
        live tensors when it lands, so the optimizer's own state may be loaded before or after.

        Raises ``ValueError`` (one line) for per-machine state this process cannot take (another
        number of processes with state that differs between them; see ``lit_slowcal._machine_state``),
        for an outer optimizer's state given to an averager without one, and for a round in flight
        given to an averager with another ``overlap_delay`` or ``fragments``, another number of
        processes or of machines per process, and for a compressed run's state (``"compression"``) given
        to an averager without ``compression`` or on another number of processes. Raises ``RuntimeError``
        while this averager has a round in flight of its own (``close_round()`` first).
        """
        self._refuse_in_flight("load_state_dict()")
        recount = lambda: self._count_from_syncs(floats=False)  # noqa: E731
        loaded = _averager_state.load_state_dict(self, state, self._averaged_keys(), recount)
        self._settled_step, self._in_flight = loaded.settled_step, loaded.in_flight
        if loaded.reload is not None:  # this rank's per-machine state, put back after the optimizer's own load
            self._drop_reload_hook()
            self._reload_hook = self.optimizer.register_load_state_dict_post_hook(loaded.reload)

    def _refuse_in_flight(self, what: str) -> None:
        """One ``RuntimeError`` line while a round is in flight (``what`` cannot run then)."""
        if self._in_flight is not None:
            raise RuntimeError(
                f"PeriodicAverager.{what}: a round is in flight (it lands at step {self._in_flight.land_step}); "
                "call close_round() first"
            )

    def _drop_reload_hook(self) -> None:
        if self._reload_hook is not None:
            self._reload_hook.remove()
            self._reload_hook = None

    def _count_backward(self, _: Tensor) -> None:
        self.backward_passes += 1

    # -- attaching to a loop -----------------------------------------------------------------

    def attach(self) -> PeriodicAverager:
        """Call ``step()`` after every ``optimizer.step()`` (optimizer step hooks). Returns self.

        An optimizer subclass whose ``step`` calls ``super().step()`` runs torch's step hooks at both
        levels; a pre-hook/post-hook pair counts nesting so that one ``optimizer.step()`` is one step.
        """
        if not self._hooks:
            self._hooks = after_every_step(self.optimizer, self.step)
        return self

    def detach(self) -> None:
        """Stop counting ``optimizer.step()`` calls (undo ``attach``)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def remove_hooks(self) -> None:
        """Detach, and remove the gradient hook that counts backward passes (the averager is done)."""
        self.detach()
        self._drop_reload_hook()
        if self._backward_hook is not None:
            self._backward_hook.remove()
            self._backward_hook = None

    def __enter__(self) -> PeriodicAverager:
        return self.attach()

    def __exit__(self, *exc: Any) -> None:
        self.detach()

    @property
    def bucket_views(self) -> bool:
        """Whether the averaged tensors live in flat buffers that a synchronisation all-reduces where they lie
        (``options.bucket_views``; the exact engine's pool holds it)."""
        return self.engine.pool.bucket_views

    # -- machines ----------------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        """Processes averaged over (1 without an initialised process group)."""
        return _collectives.world_size(self.process_group)

    @property
    def rank(self) -> int:
        """This process's rank in the process group (0 without an initialised process group)."""
        return _collectives.rank(self.process_group)

    @property
    def machines_per_process(self) -> int:
        """m: machines hosted by this process (1 unless the model holds ``SimulatedMachines``)."""
        if self._machines is None:
            self._machines = machines_per_process(self.modules)
        return self._machines

    @property
    def num_machines(self) -> int:
        """M = processes x m."""
        return self.world_size * self.machines_per_process

    floats_communicated = counted("floats", "Floats one machine has sent over all rounds (S/M of a participant's).")
    bytes_communicated = counted("bytes", "The same in bytes, in the dtypes sent (a compressed round's message).")
    link_counts = counted("link", "One participant's ``LinkCounts`` over all rounds, for the ring model.")
    overlapped_counts = counted("overlapped", "The part of ``link_counts`` sent by overlapped rounds (tau >= 1).")

    def floats_per_sync(self) -> Union[int, float]:
        """Floats one machine sends per synchronisation: one machine's averaged tensors (S/M of them with S < M
        participants; with F fragments, a round sends one fragment: 1/F of them on average); 0 with one machine."""
        if self.num_machines == 1:
            return 0
        return _selection.floats_sent(self._tensors(), self.num_machines, self.participants) / self.options.fragments

    def bytes_per_sync(self) -> Union[int, float]:
        """Bytes one machine sends per synchronisation, as ``floats_per_sync`` in the dtypes sent (with
        ``compression``, the first stage's message: codes and per-block values); so that ``bytes_per_sync()
        x num_syncs`` is ``bytes_communicated`` after whole periods of K steps. On the ring a participant
        sends 2 (S - 1) / S times its payload (``link_counts``)."""
        first = self.engine.sent(self._tensors(), self.participants).bytes
        return Counts.per_machine(first, self.num_machines, self.participants) / self.options.fragments

    def ddp_counts(self) -> link.LinkCounts:
        """The DDP reference: what DDP would have sent over the ``steps`` taken so far, one all-reduce of one
        machine's parameter gradients (the optimizer's parameters, in their dtype) among all M machines
        every step (``lit_slowcal.link.ddp_counts``; no participation, no check)."""
        return link.ddp_counts(link.payload_bytes(self._outer_pairs()), self.steps, self.num_machines)

    @property
    def participants(self) -> int:
        """S: the machines that take part in each round."""
        return _server.num_participants(self.options.participation, self.num_machines)

    def participant_weights(self, round_index: Optional[int] = None) -> Optional[Tensor]:
        """The weights (1/S for the participants, 0 for the others) of the M machines in round
        ``round_index`` (the next synchronisation's by default); ``None`` when all take part."""
        r = self.num_syncs if round_index is None else round_index
        return _server.participant_weights(self.num_machines, self.participants, self.options.participation_seed, r)

    # -- the synchronisation -----------------------------------------------------------------

    def register_sync_pre_hook(self, hook: Callable[[PeriodicAverager], None]) -> RemovableHandle:
        """Call ``hook(self)`` at the start of every ``sync()`` (and overlapped round), before ``optimizer.pre_sync()``.

        The machines then hold their parameters after the round's last local step. Returns a handle
        whose ``remove()`` unregisters the hook.
        """
        handle = RemovableHandle(self._sync_pre_hooks)
        self._sync_pre_hooks[handle.id] = hook
        return handle

    def sync(self) -> None:
        """Synchronise now: the sync pre-hooks, ``optimizer.pre_sync()``, the average over all machines,
        ``optimizer.post_sync()``. A round in flight lands first.

        With several processes it first checks that every rank is at the same point of the schedule
        (``check_schedule``) and raises ``RuntimeError`` on every rank when not.
        """
        if self._in_flight is not None:
            self._land()
        self._blocking_round(self._begin_round(None))
        self._settled_step = self.steps

    def _blocking_round(self, tensors: Tensors) -> None:
        """A blocking round of ``tensors`` (all of them, or a fragment's): the average (exact, or compressed where
        every tensor has an anchor), the outer step on it, its counts, ``optimizer.post_sync()``, the anchors."""
        with torch.no_grad():
            sent = self.engine.average(tensors, self.participant_weights())
            self._outer_step(tensors, tensors)
        self.counts.add(tensors, sent, self.num_machines, self.participants)
        self._end_round()
        self.engine.settle(tensors)  # what every machine holds now: a coded round's next anchors

    def _begin_round(self, fragment: Optional[int]) -> Tensors:
        """What a round does before its average: the checks, the sync pre-hooks, ``optimizer.pre_sync()``.
        Returns the tensors it averages (``fragment``'s, or all)."""
        if self.world_size > 1 and (self.options.check_schedule or not self._setup_checked):
            # Every rank at the same step (and, the first time, set up alike), or one error on all.
            self.check_setup(counts=self.options.check_schedule)
        for hook in tuple(self._sync_pre_hooks.values()):
            hook(self)
        if self.sharded:  # the full parameters an evaluation left gathered would outlive the average
            _selection.reshard(self.modules)
        protocol = declared(self.optimizer)
        if protocol.pre_sync is not None:
            protocol.pre_sync()
        return self._tensors() if fragment is None else self._fragments()[fragment]

    def _end_round(self, count: bool = True) -> None:
        """What a round does after its average: ``optimizer.post_sync()`` and, with ``count``, count the
        round (an overlapped round is counted when it starts)."""
        protocol = declared(self.optimizer)
        if protocol.post_sync is not None:
            protocol.post_sync()
        if count:
            self.num_syncs += 1
            self.last_sync_step = self.steps

    def _start_round(self, fragment: int) -> None:
        """Fragment ``fragment``'s scheduled round: blocking with tau = 0, else started to land tau steps later."""
        if self._in_flight is not None:  # K made smaller mid-run: the last round lands before the next starts
            self._land()
        tensors = self._begin_round(fragment if self.options.fragments > 1 else None)
        if self.options.overlap_delay == 0:
            self._blocking_round(tensors)
            return
        weights = self.participant_weights()
        with torch.no_grad():
            land = self.steps + self.options.overlap_delay
            start = lambda result: self.engine.start(result, weights)  # noqa: E731
            self._in_flight = _overlap.Round(tensors, land, start, fragment)
        sent = self.engine.sent(tensors, self.participants)
        self.counts.add(tensors, sent, self.num_machines, self.participants, overlapped=True)
        self.num_syncs += 1
        self.last_sync_step = self.steps

    def _land(self) -> None:
        """The round in flight lands: wait for its average, the outer optimizer's step on it, the merge
        live <- avg + (live - snapshot), ``optimizer.post_sync()``."""
        landing = self._in_flight
        assert landing is not None
        live = landing.bind(self._tensors)  # a restored round finds its live tensors (one line if it cannot)
        self._in_flight = None
        landing.wait()
        with torch.no_grad():
            self._outer_step(live, landing.result)
            landing.merge()
        self._end_round(count=False)

    def _outer_step(self, live: Tensors, averaged: Tensors) -> None:
        """With an outer optimizer, its step on the parameters among ``live`` (a fragment's, or all), whose
        averages ``averaged`` holds in the same order: the new global parameters are written there."""
        if self.outer is None:
            return
        where = {id(t): i for i, (t, _) in enumerate(live)}
        chosen = [
            (g, averaged[where[id(p)]]) for g, (p, _) in zip(self.global_params, self._outer_pairs()) if id(p) in where
        ]
        _server.outer_step(self.outer, [g for g, _ in chosen], [pair for _, pair in chosen])

    def setup_fingerprint(self) -> dict[str, tuple[int, str]]:
        """What every rank must agree on before anything is averaged: every option (``AveragingOptions.agreement``)
        and what the model and optimizer make of them, each as (an integer code, its readable value)."""
        tensors = self._tensors()
        shapes = ";".join(f"{tuple(t.shape)}:{t.dtype}:{int(s)}:{int(t.is_contiguous())}" for t, s in tensors)
        keys = ",".join(self._averaged_keys())
        kind = type(self.optimizer).__qualname__
        crc = lambda text: zlib.crc32(text.encode())  # noqa: E731
        return {
            **self.options.agreement(),
            "machines per process": (self.machines_per_process, str(self.machines_per_process)),
            "participation (S)": (self.participants, str(self.participants)),
            "an outer optimizer in use": (int(self.outer is not None), str(self.outer is not None)),
            "averaged tensors": (len(tensors), str(len(tensors))),
            "their shapes, dtypes and contiguity": (crc(shapes), f"crc32 {crc(shapes):08x}"),
            "averaged state keys": (crc(keys), repr(keys)),
            "optimizer": (crc(kind), kind),
        }

    def check_setup(self, counts: bool = False) -> None:
        """With several processes, check in one small all-gather (a collective: every rank calls it) that
        every rank built the averager alike (``setup_fingerprint``: every option, the machines, the optimizer,
        the shapes, dtypes and contiguity of what is averaged), and
        with ``counts`` that every rank is at the same step; raise one ``RuntimeError`` on every rank
        naming what differs.

        ``sync()`` does it before the first average; the Trainer strategy at the start of ``fit``.
        What this process sends in it is counted apart, in ``link_counts.check_bytes``.
        """
        if self.world_size == 1:
            return
        setup = None if self._setup_checked else self.setup_fingerprint()
        point = (self.steps, self.backward_passes) if counts else (0, 0)
        _collectives.check_same_point(self.optimizer, point, self.process_group, self.skip_advice, setup)
        self._setup_checked = True
        # What this process sends in the check's ring all-gather: its int64 values to each other process.
        sent = (self.world_size - 1) * _collectives.CHECK_VALUES * 8
        self.counts.link += link.LinkCounts(check_bytes=sent)

    def broadcast(self, src: int = 0) -> None:
        """Give every process the parameters, buffers and averaged state of group rank ``src``.

        Makes every machine start from the same point x_0, as the algorithms assume (machines
        simulated in one process are identical copies already). No-op with one process. With an
        outer optimizer, the round's start becomes that point. The ranks' set-up is checked first
        (``check_setup``): tensors of other shapes on two ranks would not travel. With ``compression``
        the point becomes every tensor's anchor, so the first synchronisation is compressed too
        (machines simulated in one process share machine 0's slice as theirs).
        """
        self.check_setup()
        if self.sharded:
            _selection.reshard(self.modules)
        tensors = self._tensors()
        broadcast_module(self.modules, src, process_group=self.process_group, extra=[t for t, _ in tensors])
        if self.outer is not None:
            _server.reset_round_start(self.global_params, self._outer_pairs())
        self.engine.settle(tensors)

    # -- what is averaged ---------------------------------------------------------------------

    def _outer_pairs(self, tensors: Optional[Tensors] = None) -> Tensors:
        """The optimizer's parameters, each with whether it is stacked (one slice per machine);
        ``tensors``: ``_tensors()`` where the caller has it already."""
        return _server.parameters(self.optimizer, self._tensors() if tensors is None else tensors)

    def _averaged_keys(self) -> tuple[str, ...]:
        """The optimizer state keys a synchronisation averages: the optimizer's declared ones and ``average_state``."""
        return tuple(dict.fromkeys((*declared(self.optimizer).averaged_state, *self.options.average_state)))

    def _tensors(self) -> Tensors:
        """The floating tensors to average (``_selection.averaged_tensors``): the parameters, the
        optimizer's declared state and ``average_state``, the buffers."""
        return _selection.averaged_tensors(self.modules, self.optimizer, self._averaged_keys(), self.buffers)

    def _units(self) -> list[Tensors]:
        """``_tensors()`` in units: a parameter with its averaged state, or a buffer (``_selection.averaged_units``)."""
        return _selection.averaged_units(self.modules, self.optimizer, self._averaged_keys(), self.buffers)

    def _fragments(self) -> list[Tensors]:
        """The F fragments of ``_tensors()``: runs of units balanced by the bytes of the units' parameters
        and buffers, which do not change as optimizer state appears (``_overlap.partition``)."""
        units = self._units()
        starts = _overlap.partition([link.payload_bytes(unit[:1]) for unit in units], self.options.fragments)
        ends = [*starts[1:], len(units)]
        return [[pair for unit in units[a:b] for pair in unit] for a, b in zip(starts, ends)]

    def _buckets(self, tensors: Tensors) -> list[Tensors]:
        """The buckets of one synchronisation: one all-reduce each (``_communication.buckets``)."""
        return _communication.buckets(tensors, self.options.bucket_cap_bytes)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(sync_every={self.sync_every}, optimizer={type(self.optimizer).__name__}, "
            f"steps={self.steps}, num_syncs={self.num_syncs})"
        )


def _engine(options: AveragingOptions, machines: int, machines_per_process: int, group: Optional[Any]) -> Engine:
    """The round engine of ``options``: exact, or coded by its compressor (a block ``Compressor`` or a ``Code``)."""
    exact = ExactRound(machines, machines_per_process, group, options.bucket_cap_bytes, options.bucket_views)
    code = options.compressor
    if code is None:
        return exact
    state = (CodedAverage if isinstance(code, Code) else CompressedAverage)(code, options.lossy_feedback)
    return CodedRound(state, exact)
