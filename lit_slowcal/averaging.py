"""Periodic averaging of a model and its optimizer state over machines, with or without a framework.

``PeriodicAverager`` is the parameter server of Local-SGD and SLowcal-SGD (Algorithm 2 of the paper):
every K = ``sync_every`` optimizer steps it replaces, on every machine, the parameters, the floating
buffers and the optimizer state the optimizer declares (``lit_slowcal.protocol``) by their average over
all M machines: processes of the process group, or machines a ``SimulatedMachines`` module hosts
(M = processes x m, equal weights). It needs only torch; the Trainer and Fabric strategies only call
``step()``. Its options are one ``AveragingOptions`` (``lit_slowcal.options``). It keeps the schedule,
the state and the checks; its parts: the round engines (``_rounds``: exact, coded, overlapped), the
server's step (``_server``), the overlapped schedule (``_overlap``), the counts (``_counts``), the saved state
(``_averager_state``), the loop's hooks (``_hooks``), the ranks' checks (``_schedule_check``), what is averaged
(``_averaged_tensors``). docs/architecture.md draws them.

A round ends after every K-th step. Code that takes the model out of training mid-round (evaluation,
a checkpoint, the end of training) calls ``close_round()``: every machine then holds the same averaged
model, and the next round is still at the next multiple of K. Every machine must count ``step()`` alike
(``check_schedule``: compared in the first round, every ``check_every``-th round, at ``close_round()`` and after a
resume, a load or a new K).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from lit_slowcal import _averager_state, _communication, _selection, _server
from lit_slowcal._averaged_tensors import AveragedTensors
from lit_slowcal._averager_state import COMPRESSION_KEY, IN_FLIGHT_KEY
from lit_slowcal._collectives import Machines, broadcast_module
from lit_slowcal._compressed import CompressedAverage
from lit_slowcal._counts import Counted, Counts
from lit_slowcal._hooks import LoopHooks, on_every_backward
from lit_slowcal._option_access import HoldsOptions
from lit_slowcal._overlap import OverlappedSchedule
from lit_slowcal._rounds import CodedRound, Engine, OverlappedRound, engine_for
from lit_slowcal._schedule_check import CHECK_EVERY, ScheduleCheck
from lit_slowcal._selection import Modules, Tensors, buffer_owners, machines_per_process
from lit_slowcal._validation import check_int
from lit_slowcal.options import AveragingOptions
from lit_slowcal.protocol import declared

__all__ = [
    "CHECK_EVERY", "COMPRESSION_KEY", "IN_FLIGHT_KEY", "PeriodicAverager", "broadcast_module", "buffer_owners", "machines_per_process",
]  # fmt: skip


class PeriodicAverager(HoldsOptions, Machines, LoopHooks, Counted, OverlappedSchedule, ScheduleCheck, AveragedTensors):
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
            local shards are averaged over it, the mesh's replicate group; its buffers over its shard mesh first.
        start_step: optimizer steps already taken (a resumed run keeps its sync schedule).
        buffers: the buffers this averager averages; ``None``: every floating buffer of ``module``.
            With several optimizers each buffer belongs to one averager (see ``buffer_owners``).

    A combination of options that cannot work with this optimizer or model is refused here, in one
    line (``AveragingOptions.check_with``).

    Overlapped rounds (tau >= 1 or F > 1): ``lit_slowcal._overlap``; compressed rounds:
    ``lit_slowcal.compression``; both in docs/communication.md.

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
        # Every synchronisation option: ``options`` with ``sync_every`` and ``settings``; fixed but for K (``HoldsOptions``).
        self.options = AveragingOptions.build(options, sync_every, **settings)
        self.modules: list[nn.Module] = [module] if isinstance(module, nn.Module) else list(module)
        if not all(isinstance(m, nn.Module) for m in self.modules):
            raise TypeError(f"Invalid module: {module!r} (an nn.Module or a sequence of them)")
        # Whether the model holds SimulatedMachines, looked for once (as m, ``machines_per_process``, is counted once).
        self._simulated = _selection.has_simulated(self.modules)
        # Wrappers (Lightning's or Fabric's optimizer) expose the torch optimizer as `.optimizer`.
        while not isinstance(optimizer, Optimizer) and isinstance(getattr(optimizer, "optimizer", None), Optimizer):
            optimizer = optimizer.optimizer
        if not isinstance(optimizer, Optimizer):
            raise TypeError(f"Invalid optimizer: {optimizer!r} (a torch.optim.Optimizer)")
        self.optimizer = optimizer
        #: Whether the model holds FSDP2 shards (DTensors), averaged by their local tensors (docs/sharded.md).
        self.sharded = _selection.check_sharding(self.modules, optimizer, process_group)
        self._shard_group = _selection.shard_group(self.modules, optimizer) if self.sharded else None  # its machine
        factory = self.options.check_with(
            optimizer, sharded=self.sharded, machines_per_process=machines_per_process(self.modules)
        )
        self.process_group = process_group
        self.buffers = None if buffers is None else list(buffers)
        self.steps = 0
        self.num_syncs = 0
        self.last_sync_step = 0  # steps at the last synchronisation (scheduled or closing a round)
        self._settled_step = 0  # steps at the last blocking synchronisation of the whole model and its state
        #: What was sent so far, every kind of round counted alike (``lit_slowcal._counts``).
        self.counts = Counts()
        self.backward_passes = 0  # counted by a gradient hook; compared in the rounds that check
        self._machines: Optional[int] = None  # m, counted once
        self._keys_checked = not self.options.average_state  # average_state's keys found in the optimizer's state
        self._init_checks()  # the set-up and the counts compared by the rounds that check (``ScheduleCheck``)
        self._init_protocol()  # read at each use but during a blocking round (``AveragedTensors``)
        # What a rank whose count fell behind should do; the strategies give their own advice.
        self.skip_advice = "call averager.step() once per iteration rather than attaching it to the optimizer"
        self._backward_hook = on_every_backward(optimizer, self._count_backward)
        self._hooks: list[Any] = []
        self._reload_hook: Optional[RemovableHandle] = None  # per-machine state put back after an optimizer load
        self._sync_pre_hooks: OrderedDict[int, Callable[[PeriodicAverager], None]] = OrderedDict()  # by handles
        self.outer: Optional[Optimizer] = None  # the server's optimizer over self.global_params
        self.global_params: list[Tensor] = []  # x_s, the round's start, one machine's shape
        if factory is not None:
            self.global_params, self.outer = _server.start_outer(factory, self._outer_pairs())
        self.options.check_tensors(self._tensors(), self.machines_per_process)
        #: How a round's tensors become their average, and what that sends (``lit_slowcal._rounds``).
        names = lambda ts: _selection.names_of(ts, self.modules, optimizer, self._averaged_keys(), self.buffers)  # noqa: E731
        self.engine: Engine = engine_for(
            self.options, self.num_machines, self.machines_per_process, process_group, names,
            declared(optimizer).nonnegative_state, self._bucket_views(),
        )  # fmt: skip
        if self.options.fragments > 1:
            self._fragments()  # at least F units, or one line now
        if start_step:
            self.resume(start_step)

    # -- schedule ----------------------------------------------------------------------------

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
        self.sync(state=self.options.state_round(self.steps))
        return True

    @property
    def in_round(self) -> bool:
        """Whether the machines may differ: a step was taken since the last synchronisation of the whole
        model, or a round is in flight."""
        return self.steps != self._settled_step or self.engine.in_flight is not None

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
        self._sync(closing=True)
        return True

    def resume(self, steps: int) -> None:
        """Continue a schedule after ``steps`` optimizer steps that synchronised every K (and nowhere else).

        The counts of what was sent are those of ``num_syncs`` synchronisations of what is averaged
        now (``floats_communicated``, ``bytes_communicated``, ``link_counts``; its ``check_bytes`` from 0).
        """
        check_int("steps", steps, minimum=0)
        self._refuse_in_flight("resume()")
        self._check_at_boundary()
        period = self.sync_every // self.options.fragments
        self.steps = steps
        self.num_syncs = steps // period
        self.last_sync_step = self.num_syncs * period
        whole = self.sync_every * (self.options.state_every if self._averaged_keys() else 1)  # the last with the state
        self._settled_step = self.last_sync_step if self._overlapped else steps // whole * whole
        self._count_from_syncs()

    @property
    def compressed(self) -> Optional[CompressedAverage]:
        """With ``compression``, the anchors and error feedback (``CompressedAverage``, or ``CodedAverage`` for a
        ``Code``); ``None`` for the exact average."""
        return self.engine.state if isinstance(self.engine, CodedRound) else None

    def state_dict(self) -> dict[str, Any]:
        """This process's state (``lit_slowcal._averager_state`` lists the keys): the schedule and counts, its
        machines' per-machine optimizer state, the outer optimizer's, a coded round's anchors and error
        feedback, a round in flight (waited for). Local; ``gather_state_dict()`` holds every process's."""
        settled = self._settled_step if self._overlapped or self.options.state_every > 1 else None
        return _averager_state.state_dict(self, self._averaged_keys(), settled, self.engine.in_flight, self._tensors)

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
        """Restore what ``state_dict()`` or ``gather_state_dict()`` returned, this process's part (an optimizer
        loaded after it, before the next step, gets this rank's per-machine state put back); a round in flight
        lands at its step with the saved values. One ``ValueError`` line for a state this averager cannot take
        (``lit_slowcal._averager_state``); ``RuntimeError`` while a round of its own is in flight."""
        self._refuse_in_flight("load_state_dict()")
        self._check_at_boundary()
        recount = lambda: self._count_from_syncs(floats=False)  # noqa: E731
        loaded = _averager_state.load_state_dict(self, state, self._averaged_keys(), recount)
        self._settled_step = loaded.settled_step
        if isinstance(self.engine, OverlappedRound):  # a round in flight is only saved with the same tau (or refused)
            self.engine.in_flight = loaded.in_flight
        if loaded.reload is not None:  # this rank's per-machine state, put back after the optimizer's own load
            self._drop_reload_hook()
            self._reload_hook = self.optimizer.register_load_state_dict_post_hook(loaded.reload)

    @property
    def bucket_views(self) -> bool:
        """Whether the averaged tensors live in flat buffers that a synchronisation all-reduces where they lie
        (``options.bucket_views``; the exact engine's pool holds it)."""
        return self.engine.pool.bucket_views

    # -- the synchronisation -----------------------------------------------------------------

    def sync(self, state: bool = True) -> None:
        """Synchronise now: the sync pre-hooks, ``optimizer.pre_sync()``, the average over all machines,
        ``optimizer.post_sync()``. A round in flight lands first. ``state=False``: the parameters and buffers
        only (a scheduled round that ``state_every`` skips).

        With several processes it first checks that every rank is at the same point of the schedule
        (``check_schedule``) and raises ``RuntimeError`` on every rank when not: in the rounds ``check_every``
        divides (the first among them), the first after a resume, a load or a new K, and in ``close_round()``.
        """
        self._sync(state)

    def _sync(self, state: bool = True, closing: bool = False) -> None:
        """``sync()``; ``closing``: ``close_round()``'s, whose round always compares the ranks' counts."""
        if self.engine.in_flight is not None:
            self._land()
        check = self._check_due(closing)
        counts = self._carried(closing, state) if check else None
        with self._protocol_held():
            self._blocking_round(self._begin_round(None, state, check and counts is None), state=state, counts=counts)
            if state or not self._averaged_keys():  # after a round without the optimizer state, it may differ
                self._settled_step = self.steps

    def _blocking_round(self, tensors: Tensors, state: bool = True, counts: Optional[tuple[int, int]] = None) -> None:
        """A blocking round of ``tensors`` (all of them, or a fragment's): the average (exact, or compressed where
        every tensor has an anchor), the outer step on it, its counts, ``optimizer.post_sync()``, the anchors.
        ``counts``: the ranks' counts compared in the average's own message (``_carried``)."""
        with torch.no_grad():
            try:
                sent = self.engine.average(tensors, self.participant_weights(), counts)
            except RuntimeError as error:  # the backend's, where another rank is in another collective
                unreached = self._unreached(error)
                if unreached is None:
                    raise
                raise unreached from error
            except _communication.CountsDiffer:  # nothing averaged: the check of its own names every rank's counts
                self._counts_differ()
            if counts is not None:
                self._counts_carried(tensors)
            self._outer_step(tensors, tensors)
        self.counts.add(tensors, sent, self.num_machines, self.participants)
        self._end_round()
        self.engine.settle(tensors, state)  # what every machine holds now: a coded round's next anchors

    def _begin_round(self, fragment: Optional[int], state: bool = True, check: bool = True) -> Tensors:
        """What a round does before its average: the checks, the sync pre-hooks, ``optimizer.pre_sync()``.
        Returns the tensors it averages (``fragment``'s, or all; with ``state=False``, no optimizer state).
        ``check``: whether this round compares the ranks' counts (with ``check_schedule``; the set-up is
        compared before the first average whatever it says)."""
        self._check_round(check)
        for hook in tuple(self._sync_pre_hooks.values()):
            hook(self)
        if self.sharded:  # resharded (an evaluation's gathered parameters would outlive the average), buffers as one
            _selection.machine_buffers(self.modules, self.buffers, self._shard_group)
        protocol = self._declared()
        if protocol.pre_sync is not None:
            protocol.pre_sync()
        if not self._keys_checked:  # once the optimizer holds state: a misspelt average_state key, one line
            self._keys_checked = _selection.check_state_keys(self.optimizer, self.options.average_state)
        tensors = self._tensors() if fragment is None else self._fragments()[fragment]
        return tensors if state else _selection.among(tensors, self._tensors(state=False))

    def _end_round(self, count: bool = True) -> None:
        """What a round does after its average: ``optimizer.post_sync()`` and, with ``count``, count the
        round (an overlapped round is counted when it starts)."""
        protocol = self._declared()
        if protocol.post_sync is not None:
            protocol.post_sync()
        if count:
            self.num_syncs += 1
            self.last_sync_step = self.steps

    def _outer_step(self, live: Tensors, averaged: Tensors) -> None:
        """With an outer optimizer, its step on the parameters among ``live`` (a fragment's, or all), whose
        averages ``averaged`` holds in the same order: the new global parameters are written there."""
        if self.outer is None:
            return
        key = lambda t: (t.data_ptr(), t.shape, t.dtype)  # noqa: E731 (a DTensor's local shard is a new object each time)
        where = {key(t): i for i, (t, _) in enumerate(live)}
        pairs = zip(self.global_params, self._outer_pairs())
        chosen = [(g, averaged[where[key(p)]]) for g, (p, _) in pairs if key(p) in where]
        _server.outer_step(self.outer, [g for g, _ in chosen], [pair for _, pair in chosen])

    def broadcast(self, src: int = 0) -> None:
        """Give every process the parameters, buffers and averaged state of group rank ``src``.

        Makes every machine start from the same point x_0, as the algorithms assume (machines
        simulated in one process are identical copies already). No-op with one process. With an
        outer optimizer, the round's start becomes that point. The ranks' set-up is checked first
        (``check_setup``): tensors of other shapes on two ranks would not travel. With ``compression``
        the point becomes every tensor's anchor: the first synchronisation codes them, and averages exactly,
        once, state that appears later (SLowcal-SGD's w, at the first step).
        """
        self.check_setup()
        if self.sharded:
            _selection.machine_buffers(self.modules, self.buffers, self._shard_group)
        tensors = self._tensors()
        broadcast_module(self.modules, src, process_group=self.process_group, extra=[t for t, _ in tensors])
        if self.outer is not None:
            _server.reset_round_start(self.global_params, self._outer_pairs())
        self.engine.settle(tensors)

    def anchor(self) -> None:
        """With ``compression``, every averaged tensor without an anchor takes its value now as one (machine 0's
        slice). Only where every machine holds the same values: the strategies call it after their set-up broadcast."""
        if isinstance(self.engine, CodedRound):
            self.engine.anchor_missing(self._tensors())

    def _sync_every_changed(self, value: int) -> None:
        """K set mid-run: the next blocking round compares the ranks' counts."""
        self._check_at_boundary()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(sync_every={self.sync_every}, optimizer={type(self.optimizer).__name__}, "
            f"steps={self.steps}, num_syncs={self.num_syncs})"
        )
