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
here. Every attribute is optional; ``torch.optim.SGD`` declares nothing and gets plain Local-SGD.

``averaged_state: Sequence[str]``
    Per-parameter state keys (``optimizer.state[p][key]``, floating tensors) averaged together with
    the parameters. ``SlowcalSGD`` declares ``("w",)``: its iterate w is averaged with its query point x.
    State not named here stays per machine (e.g. SGD's momentum, or SCAFFOLD's control variates).
``pre_sync() -> None``
    Called on every machine just before the average (e.g. compute what the round sends:
    ``Scaffold`` its control variate's change delta_c, ``AcceleratedSGD`` its new x, put in the
    parameters).
``post_sync() -> None``
    Called just after the average (e.g. fold the averaged values into per-machine state:
    ``Scaffold``'s server step, ``AcceleratedSGD``'s new middle point).

What is averaged is what a machine sends: ``floats_communicated`` counts it (``Scaffold``: y and
delta_c, 2d floats a machine a round; ``AcceleratedSGD`` and SGD synchronised every step: d).

``outer_optimizer: Callable[[list[Tensor]], Optimizer] | None``
    A server step of the optimizer's own (``Scaffold`` with ``server_lr != 1``: SGD at that rate),
    used when the averager is given no ``outer_optimizer`` (below).

The server's side of a round
----------------------------
By default the round's new model is the plain average of the machines. Two server-side options
change that, on every path (plain loop, Fabric, Trainer, simulated machines, several processes):

``outer_optimizer``: a factory ``params -> torch.optim.Optimizer`` over the *global* parameters (one
copy of the model's parameters per process, of one machine's shape; not one per simulated machine).
At every synchronisation the machines' parameters are averaged to x_bar; the global parameters
still hold the round's start x_s; the outer optimizer is fed the pseudo-gradient
Delta = x_s - x_bar as their gradient and steps; every machine then starts the next round at the new
global parameters. DiLoCo is an outer ``SGD(lr=0.7, momentum=0.9, nesterov=True)``; FedAvgM an outer
SGD with momentum; FedAdam an outer Adam; an outer ``SGD(lr=1)`` is the plain average. The
optimizer's declared averaged state (SLowcal-SGD's w) and the buffers are averaged plainly, not
stepped. The outer optimizer's state and x_s travel in ``state_dict()``.

``participation``: S machines of the M take part in each round (an int S, or a fraction of M), drawn
afresh every round from ``participation_seed`` and the round's index, the same on every rank. The
new model is the average over the S participants (each with weight 1/S); every machine, the others
included, starts the next round from it. ``floats_communicated`` counts what the participants send
(per machine on average: S/M of a full round's floats). With S = M it is the plain average, bitwise.

Observers that are not the optimizer (diagnostics: how far the machines drifted apart in the round)
register with ``register_sync_pre_hook``: ``hook(averager)`` runs at the start of every
synchronisation, after the K-th step and before ``pre_sync()`` and the average.

The averager's own ``average_state`` argument adds keys for optimizers that do not declare them
(``average_state=["momentum_buffer"]`` averages SGD's momentum too).

Round boundaries and one schedule
---------------------------------
A round ends after every K-th step (``steps % sync_every == 0``). Code that takes the model out of
training mid-round (evaluation, a checkpoint, the end of training) calls ``close_round()``: it
synchronises now when a step was taken since the last synchronisation, so that every machine holds
the same averaged model, and the schedule goes on unchanged (the next synchronisation is still at
the next multiple of K). ``state_dict()`` records the schedule, the last synchronisation included,
so a run resumed from it continues exactly. The Trainer and Fabric strategies close the round
before every validation and checkpoint and at the end of ``fit``; a plain loop calls it itself.

The schedule counts ``step()`` calls, so every machine must make them alike. A skipped
``optimizer.step()`` (a ``GradScaler`` that found inf/NaN, a loop that skips a step) does not fire the
step hooks of ``attach()``; that machine's count then falls behind the others'. With several
processes every synchronisation first compares, over all ranks, the step count and the number of
backward passes through the model since the averager was created (one small all-gather): when
they differ it raises one ``RuntimeError`` on every rank before anything is averaged. Loops that may
skip steps call ``step()`` once per iteration instead of attaching (see ``step``).

Communication: the tensors are grouped by device and dtype and flattened into buckets of at most
``bucket_cap_mb`` megabytes; each bucket is one all-reduce (a small model: one collective per
device and dtype per synchronisation). At most two buckets are in flight, so a synchronisation
needs at most two buckets of extra memory, not a second copy of the model. A tensor larger than a
bucket is reduced in place. With one process nothing is communicated.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from lit_slowcal._validation import check_int, check_number
from lit_slowcal.simulated import SimulatedMachines

if dist.is_available():
    # torch.distributed.nn.functional binds ``group.WORLD`` as its functions' default argument when
    # it is imported (torch._dynamo imports it, on the first optimizer's construction in a plain
    # torch loop). Imported after init_process_group it would keep the default group alive past
    # destroy_process_group: gloo's threads would then run into the interpreter's exit, where a
    # process occasionally aborts ("terminate called without an active exception"). Imported here,
    # with lit_slowcal and before any process group, it binds None (2 ms).
    import torch.distributed.nn.functional  # noqa: F401

__all__ = ["PeriodicAverager", "broadcast_module", "buffer_owners", "check_participation", "machines_per_process"]

Modules = Union[nn.Module, Sequence[nn.Module]]


class PeriodicAverager:
    """Average parameters, floating buffers and declared optimizer state over all machines every K steps.

    Args:
        module: the model (or a list of modules) whose floating buffers are averaged and whose
            ``SimulatedMachines`` submodules hold machines stacked along dimension 0.
        optimizer: the optimizer stepping the machines; its parameters and declared state (see the
            module docstring) are averaged.
        sync_every: K, optimizer steps between synchronisations (>= 1).
        process_group: the processes to average over; ``None``: the default group when
            ``torch.distributed`` is initialised, else this process alone.
        average_state: extra per-parameter optimizer state keys to average.
        bucket_cap_mb: the largest flattened buffer of one collective, in megabytes (> 0).
        start_step: optimizer steps already taken (a resumed run keeps its sync schedule).
        buffers: the buffers this averager averages; ``None``: every floating buffer of ``module``.
            With several optimizers each buffer belongs to one averager (see ``buffer_owners``).
        check_schedule: with several processes, compare the ranks' step and backward counts at
            every synchronisation and raise on a difference (one small all-gather a sync).
        outer_optimizer: ``params -> Optimizer``, the server's optimizer on the pseudo-gradient
            (see the module docstring); ``None``: the optimizer's own ``outer_optimizer`` if it
            declares one, else the plain average.
        participation: machines taking part in each round: an int S (1 <= S <= M) or a fraction of
            M in (0, 1]; ``None``: all of them.
        participation_seed: the seed of the per-round sample of participants.

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
        sync_every: int,
        *,
        process_group: Optional[Any] = None,
        average_state: Sequence[str] = (),
        bucket_cap_mb: float = 25.0,
        start_step: int = 0,
        buffers: Optional[Sequence[Tensor]] = None,
        check_schedule: bool = True,
        outer_optimizer: Optional[Callable[[list[Tensor]], Optimizer]] = None,
        participation: Optional[Union[int, float]] = None,
        participation_seed: int = 0,
    ) -> None:
        self.modules: list[nn.Module] = [module] if isinstance(module, nn.Module) else list(module)
        if not all(isinstance(m, nn.Module) for m in self.modules):
            raise TypeError(f"Invalid module: {module!r} (an nn.Module or a sequence of them)")
        # Wrappers (Lightning's or Fabric's optimizer) expose the torch optimizer as `.optimizer`.
        while not isinstance(optimizer, Optimizer) and isinstance(getattr(optimizer, "optimizer", None), Optimizer):
            optimizer = optimizer.optimizer
        if not isinstance(optimizer, Optimizer):
            raise TypeError(f"Invalid optimizer: {optimizer!r} (a torch.optim.Optimizer)")
        self.optimizer = optimizer
        self.sync_every = sync_every
        if isinstance(average_state, str) or not all(isinstance(k, str) for k in average_state):
            raise ValueError(f"Invalid average_state: {average_state!r} (a sequence of state key names)")
        self.average_state = tuple(average_state)
        check_number("bucket_cap_mb", bucket_cap_mb)
        self.bucket_cap_bytes = max(1, int(bucket_cap_mb * 2**20))
        self.process_group = process_group
        self.buffers = None if buffers is None else list(buffers)
        self.check_schedule = bool(check_schedule)
        self.steps = 0
        self.num_syncs = 0
        self.last_sync_step = 0  # steps at the last synchronisation (scheduled or closing a round)
        self.floats_communicated = 0  # per machine, over all synchronisations; 0 with one machine
        self.backward_passes = 0  # counted by a gradient hook; compared across ranks at every sync
        self._machines: Optional[int] = None  # m, counted once
        # What a rank whose count fell behind should do; the strategies give their own advice.
        self.skip_advice = "call averager.step() once per iteration rather than attaching it to the optimizer"
        first = next((p for g in optimizer.param_groups for p in g["params"] if p.requires_grad), None)
        self._backward_hook = None if first is None else first.register_post_accumulate_grad_hook(self._count_backward)
        self._hooks: list[Any] = []
        self._sync_pre_hooks: OrderedDict[int, Callable[["PeriodicAverager"], None]] = OrderedDict()  # weakly referenced by handles
        self.participation = check_participation(participation)
        self.participation_seed = check_int("participation_seed", participation_seed, minimum=0)
        if self.participation is not None and not getattr(optimizer, "supports_participation", True):
            raise ValueError(
                f"Invalid participation: {participation!r} ({type(optimizer).__name__} keeps per-machine state that "
                "machines outside a round would update; use participation=None)"
            )
        factory = outer_optimizer if outer_optimizer is not None else getattr(optimizer, "outer_optimizer", None)
        if factory is not None and not callable(factory):
            raise TypeError(f"Invalid outer_optimizer: {factory!r} (a callable params -> torch.optim.Optimizer)")
        self._outer_factory = factory
        self.outer: Optional[Optimizer] = None  # the server's optimizer over self.global_params
        self.global_params: list[Tensor] = []  # x_s, the round's start, one machine's shape
        if factory is not None:
            self._start_outer()
        if start_step:
            self.resume(start_step)

    # -- schedule ----------------------------------------------------------------------------

    @property
    def sync_every(self) -> int:
        return self._sync_every

    @sync_every.setter
    def sync_every(self, value: int) -> None:
        self._sync_every = check_int("sync_every", value)

    def step(self) -> bool:
        """Count one step of the schedule; synchronise when it is a multiple of K. Returns whether it did.

        ``attach()`` calls it after every ``optimizer.step()``. A loop whose optimizer step may be
        skipped on one machine (``GradScaler``) calls it itself once per iteration, after
        ``scaler.step(optimizer)`` and ``scaler.update()``, so every machine counts alike::

            scaler.scale(loss).backward()
            scaler.step(optimizer)  # skipped where the gradients hold inf/NaN
            scaler.update()
            averager.step()  # counted on every machine, skipped or not
        """
        self.steps += 1
        if self.steps % self.sync_every:
            return False
        self.sync()
        return True

    @property
    def in_round(self) -> bool:
        """Whether a step was taken since the last synchronisation (the machines may differ)."""
        return self.steps != self.last_sync_step

    def close_round(self) -> bool:
        """Synchronise now if a step was taken since the last synchronisation. Returns whether it did.

        Call it where the model leaves training mid-round (evaluation, a checkpoint, the end of
        training): every machine then holds the same averaged model. The schedule is unchanged:
        the next synchronisation is still after the next multiple of K steps.
        """
        if not self.in_round:
            return False
        self.sync()
        return True

    def resume(self, steps: int) -> None:
        """Continue a schedule after ``steps`` optimizer steps that synchronised every K (and nowhere else)."""
        check_int("steps", steps, minimum=0)
        self.steps = steps
        self.num_syncs = steps // self.sync_every
        self.last_sync_step = self.num_syncs * self.sync_every
        self.floats_communicated = self.num_syncs * self.floats_per_sync()

    def state_dict(self) -> dict[str, Any]:
        """The schedule (and, with an outer optimizer, the round's start and the outer optimizer's state)."""
        state: dict[str, Any] = {
            "steps": self.steps,
            "num_syncs": self.num_syncs,
            "last_sync_step": self.last_sync_step,
            "floats_communicated": self.floats_communicated,
        }
        if self.outer is not None:
            state["outer"] = {"round_start": [g.detach().clone() for g in self.global_params], "optimizer": self.outer.state_dict()}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = int(state["steps"])
        self.num_syncs = int(state["num_syncs"])
        # States saved before the key existed come from schedules that synchronised every K only.
        self.last_sync_step = int(state.get("last_sync_step", self.steps - self.steps % self.sync_every))
        floats = state["floats_communicated"]
        self.floats_communicated = floats if isinstance(floats, float) else int(floats)
        if self.outer is not None and "outer" in state:
            with torch.no_grad():
                for g, saved in zip(self.global_params, state["outer"]["round_start"]):
                    g.copy_(saved)
            self.outer.load_state_dict(state["outer"]["optimizer"])

    def _count_backward(self, _: Tensor) -> None:
        self.backward_passes += 1

    # -- attaching to a loop -----------------------------------------------------------------

    def attach(self) -> "PeriodicAverager":
        """Call ``step()`` after every ``optimizer.step()`` (optimizer step hooks). Returns self.

        An optimizer subclass whose ``step`` calls ``super().step()`` runs torch's step hooks at both
        levels; a pre-hook/post-hook pair counts nesting so that one ``optimizer.step()`` is one step.
        """
        if self._hooks:
            return self
        depth = [0]

        def pre(*_: Any) -> None:
            depth[0] += 1

        def post(*_: Any) -> None:
            depth[0] -= 1
            if depth[0] == 0:
                self.step()

        self._hooks = [self.optimizer.register_step_pre_hook(pre), self.optimizer.register_step_post_hook(post)]
        return self

    def detach(self) -> None:
        """Stop counting ``optimizer.step()`` calls (undo ``attach``)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def remove_hooks(self) -> None:
        """Detach, and remove the gradient hook that counts backward passes (the averager is done)."""
        self.detach()
        if self._backward_hook is not None:
            self._backward_hook.remove()
            self._backward_hook = None

    def __enter__(self) -> "PeriodicAverager":
        return self.attach()

    def __exit__(self, *exc: Any) -> None:
        self.detach()

    # -- machines ----------------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        """Processes averaged over (1 without an initialised process group)."""
        if not (dist.is_available() and dist.is_initialized()):
            return 1
        return dist.get_world_size(self.process_group)

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

    def floats_per_sync(self) -> int:
        """Floats one machine sends per synchronisation (the averaged tensors of one machine); 0 with
        one machine in all, which sends nothing."""
        return self._floats(self._tensors())

    def _floats(self, tensors: list[tuple[Tensor, bool]]) -> Union[int, float]:
        if self.num_machines == 1:
            return 0
        floats = sum(t[0].numel() if s else t.numel() for t, s in tensors)
        participants = self.participants
        if participants == self.num_machines:
            return floats
        return floats * participants / self.num_machines  # what the participants send, per machine

    @property
    def participants(self) -> int:
        """S: the machines that take part in each round."""
        M, p = self.num_machines, self.participation
        if p is None:
            return M
        if isinstance(p, float):
            return max(1, round(p * M))
        if p > M:
            raise ValueError(f"Invalid participation: {p} (must be <= M = {M}, the machines in all)")
        return p

    def participant_weights(self, round_index: Optional[int] = None) -> Optional[Tensor]:
        """The weights (1/S for the participants, 0 for the others) of the M machines in round
        ``round_index`` (the next synchronisation's by default); ``None`` when all take part."""
        M, S = self.num_machines, self.participants
        if S == M:
            return None
        r = self.num_syncs if round_index is None else round_index
        g = torch.Generator().manual_seed(self.participation_seed * 1_000_003 + r)
        weights = torch.zeros(M, dtype=torch.float64)
        weights[torch.randperm(M, generator=g)[:S]] = 1.0 / S
        return weights

    # -- the synchronisation -----------------------------------------------------------------

    def register_sync_pre_hook(self, hook: Callable[["PeriodicAverager"], None]) -> RemovableHandle:
        """Call ``hook(self)`` at the start of every ``sync()``, before ``optimizer.pre_sync()`` and the average.

        The machines then hold their parameters after the round's last local step. Returns a handle
        whose ``remove()`` unregisters the hook.
        """
        handle = RemovableHandle(self._sync_pre_hooks)
        self._sync_pre_hooks[handle.id] = hook
        return handle

    def sync(self) -> None:
        """Synchronise now: the sync pre-hooks, ``optimizer.pre_sync()``, the average over all machines,
        ``optimizer.post_sync()``.

        With several processes it first checks that every rank is at the same point of the schedule
        (``check_schedule``) and raises ``RuntimeError`` on every rank when not.
        """
        if self.check_schedule and self.world_size > 1:
            self._check_schedule()
        for hook in tuple(self._sync_pre_hooks.values()):
            hook(self)
        pre = getattr(self.optimizer, "pre_sync", None)
        if callable(pre):
            pre()
        tensors = self._tensors()
        self.floats_communicated += self._floats(tensors)
        with torch.no_grad():
            self._average(tensors, self.participant_weights())
            if self.outer is not None:
                self._outer_step(tensors)
        post = getattr(self.optimizer, "post_sync", None)
        if callable(post):
            post()
        self.num_syncs += 1
        self.last_sync_step = self.steps

    def _check_schedule(self) -> None:
        """All ranks at the same step and backward count, or one ``RuntimeError`` on every rank."""
        device = next((p.device for g in self.optimizer.param_groups for p in g["params"]), torch.device("cpu"))
        if device.type == "cpu" and dist.get_backend(self.process_group) == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        mine = torch.tensor([self.steps, self.backward_passes], dtype=torch.int64, device=device)
        everyone = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(everyone, mine, group=self.process_group)
        counts = [tuple(int(v) for v in t.tolist()) for t in everyone]
        if len(set(counts)) > 1:
            ranks = ", ".join(f"rank {r}: {s} steps, {b} backward passes" for r, (s, b) in enumerate(counts))
            raise RuntimeError(
                f"PeriodicAverager: the ranks reached this synchronisation at different points ({ranks}); "
                "an optimizer step was skipped on some rank (a GradScaler that found inf/NaN, or a loop that "
                f"skipped optimizer.step()), and averaging now would mix different steps: {self.skip_advice}."
            )

    def broadcast(self, src: int = 0) -> None:
        """Give every process the parameters, buffers and averaged state of group rank ``src``.

        Makes every machine start from the same point x_0, as the algorithms assume (machines
        simulated in one process are identical copies already). No-op with one process. With an
        outer optimizer, the round's start becomes that point.
        """
        extra = [t for t, _ in self._tensors()]
        broadcast_module(self.modules, src, process_group=self.process_group, extra=extra)
        if self.outer is not None:
            with torch.no_grad():
                for g, (p, stacked) in zip(self.global_params, self._outer_pairs()):
                    g.copy_(p[0] if stacked else p)

    # -- the server's optimizer --------------------------------------------------------------

    def _outer_pairs(self, tensors: Optional[list[tuple[Tensor, bool]]] = None) -> list[tuple[Tensor, bool]]:
        """The optimizer's parameters, each with whether it is stacked (one slice per machine);
        ``tensors``: ``_tensors()`` where the caller has it already."""
        stacked = {id(t) for t, s in (self._tensors() if tensors is None else tensors) if s}
        return [(p, id(p) in stacked) for group in self.optimizer.param_groups for p in group["params"]]

    def _start_outer(self) -> None:
        """The global parameters (the round's start: machine 0's parameters now) and the outer optimizer."""
        self.global_params = [(p[0] if s else p).detach().clone() for p, s in self._outer_pairs()]
        self.outer = self._outer_factory(self.global_params)
        if not isinstance(self.outer, Optimizer):
            raise TypeError(f"Invalid outer_optimizer: it returned {self.outer!r} (must return a torch.optim.Optimizer)")

    def _outer_step(self, tensors: list[tuple[Tensor, bool]]) -> None:
        """The pseudo-gradient x_s - x_bar into the outer optimizer; its step is everyone's next start."""
        pairs = self._outer_pairs(tensors)
        for g, (p, stacked) in zip(self.global_params, pairs):
            g.grad = g - (p[0] if stacked else p)
        self.outer.step()
        for g, (p, stacked) in zip(self.global_params, pairs):
            p.copy_(g.expand_as(p) if stacked else g)
            g.grad = None

    def _tensors(self) -> list[tuple[Tensor, bool]]:
        """The floating tensors to average, each with whether it has a leading machine dimension.

        A tensor is stacked when it is a parameter or buffer of a ``SimulatedMachines`` module, or
        optimizer state of such a parameter with the parameter's shape.
        """
        stacked_ids: set[int] = set()
        for module in _all_modules(self.modules):
            if isinstance(module, SimulatedMachines):
                stacked_ids.update(id(t) for t in (*module.parameters(), *module.buffers()))
        keys = tuple(dict.fromkeys((*getattr(self.optimizer, "averaged_state", ()), *self.average_state)))
        seen: set[int] = set()
        out: list[tuple[Tensor, bool]] = []

        def add(t: Tensor, owner: Tensor) -> None:
            if id(t) not in seen and t.is_floating_point():
                seen.add(id(t))
                out.append((t, id(owner) in stacked_ids and t.shape == owner.shape))

        for group in self.optimizer.param_groups:
            for p in group["params"]:
                add(p, p)
                state = self.optimizer.state.get(p, {})
                for key in keys:
                    if isinstance(state.get(key), Tensor):
                        add(state[key], p)
        buffers = self.buffers if self.buffers is not None else (b for m in self.modules for b in m.buffers())
        for b in buffers:
            add(b, b)
        return out

    def _average(self, tensors: list[tuple[Tensor, bool]], weights: Optional[Tensor] = None) -> None:
        """Replace every tensor by its average over the machines: the mean, or with ``weights`` (one
        per machine of all M, summing to 1) the weighted sum."""
        world = self.world_size
        local = None
        if weights is not None:
            m = self.machines_per_process
            rank = dist.get_rank(self.process_group) if world > 1 else 0
            local = weights[rank * m : (rank + 1) * m]

        def combine(t: Tensor, s: bool) -> Tensor:
            """This process's share: the machines' mean (or weighted sum) over its machine dimension."""
            if local is None:
                return t.mean(0) if s else t
            w = local.to(device=t.device, dtype=t.dtype)
            return torch.tensordot(w, t, dims=1) if s else t * w[0]

        if world == 1:
            for t, s in tensors:
                if s:
                    t.copy_((t.mean(0, keepdim=True) if local is None else combine(t, s).unsqueeze(0)).expand_as(t))
            return
        divide = world if local is None else 1  # the weights already sum to 1 over all machines
        pending: list[tuple[list[tuple[Tensor, bool]], Optional[Tensor], Any]] = []
        for bucket in self._buckets(tensors):
            if len(pending) == 2:
                self._finish(*pending.pop(0), divide)
            t, s = bucket[0]
            if len(bucket) == 1 and not s and t.is_contiguous():  # reduce in place: no copy at all
                if local is not None:
                    t.mul_(local[0].item())
                pending.append((bucket, None, dist.all_reduce(t, group=self.process_group, async_op=True)))
                continue
            flat = torch.cat([combine(t, s).reshape(-1) for t, s in bucket])
            pending.append((bucket, flat, dist.all_reduce(flat, group=self.process_group, async_op=True)))
        for item in pending:
            self._finish(*item, divide)

    @staticmethod
    def _finish(bucket: list[tuple[Tensor, bool]], flat: Optional[Tensor], work: Any, world: int) -> None:
        work.wait()
        if flat is None:
            if world != 1:
                bucket[0][0].div_(world)
            return
        if world != 1:
            flat.div_(world)
        offset = 0
        for t, s in bucket:
            n = t[0].numel() if s else t.numel()
            avg = flat[offset : offset + n].view(t.shape[1:] if s else t.shape)
            t.copy_(avg.unsqueeze(0).expand_as(t) if s else avg)
            offset += n

    def _buckets(self, tensors: list[tuple[Tensor, bool]]) -> list[list[tuple[Tensor, bool]]]:
        """Tensors grouped by (device, dtype), in order, cut where a bucket would exceed the cap."""
        by_kind: dict[tuple[torch.device, torch.dtype], list[tuple[Tensor, bool]]] = {}
        for t, s in tensors:
            by_kind.setdefault((t.device, t.dtype), []).append((t, s))
        buckets: list[list[tuple[Tensor, bool]]] = []
        for items in by_kind.values():
            current: list[tuple[Tensor, bool]] = []
            size = 0
            for t, s in items:
                nbytes = (t[0].numel() if s else t.numel()) * t.element_size()
                if current and size + nbytes > self.bucket_cap_bytes:
                    buckets.append(current)
                    current, size = [], 0
                current.append((t, s))
                size += nbytes
            if current:
                buckets.append(current)
        return buckets

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(sync_every={self.sync_every}, optimizer={type(self.optimizer).__name__}, "
            f"steps={self.steps}, num_syncs={self.num_syncs})"
        )


def check_participation(value: Any, num_machines: Optional[int] = None) -> Optional[Union[int, float]]:
    """``value`` if it is ``None``, an int >= 1 (and <= ``num_machines`` when given), or a fraction in (0, 1]."""
    if value is None:
        return None
    if isinstance(value, float) and not isinstance(value, bool):
        if not (0.0 < value <= 1.0):
            raise ValueError(f"Invalid participation: {value!r} (a number of machines >= 1, or a fraction in (0, 1])")
        return value
    check_int("participation", value)
    if num_machines is not None and value > num_machines:
        raise ValueError(f"Invalid participation: {value} (must be <= M = {num_machines}, the machines in all)")
    return value


def _all_modules(modules: Modules) -> Iterable[nn.Module]:
    for module in [modules] if isinstance(modules, nn.Module) else modules:
        yield from module.modules()


def machines_per_process(modules: Modules) -> int:
    """m: machines the ``SimulatedMachines`` of ``modules`` host in this process (1 without any)."""
    sims = {m.num_machines for m in _all_modules(modules) if isinstance(m, SimulatedMachines)}
    if len(sims) > 1:
        raise ValueError(f"All SimulatedMachines of a model must host the same number of machines, got {sorted(sims)}")
    return sims.pop() if sims else 1


def buffer_owners(module: nn.Module, optimizers: Sequence[Optimizer]) -> list[list[Tensor]]:
    """Each floating buffer of ``module`` given to exactly one optimizer's averager: ``out[i]`` for ``optimizers[i]``.

    A buffer belongs to the optimizer that steps the parameters of the smallest submodule holding
    it whose parameters one optimizer alone steps (a discriminator's BatchNorm statistics go with
    the discriminator's optimizer); a buffer no single optimizer claims goes to the first. So a
    buffer is averaged once per round, by one averager, however many optimizers there are.
    """
    owner = {id(p): i for i, opt in enumerate(optimizers) for g in opt.param_groups for p in g["params"]}
    parents: dict[int, Optional[nn.Module]] = {id(module): None}
    for m in module.modules():
        for child in m.children():
            parents.setdefault(id(child), m)
    out: list[list[Tensor]] = [[] for _ in optimizers]
    seen: set[int] = set()
    for m in module.modules():
        for b in m.buffers(recurse=False):
            if id(b) in seen or not b.is_floating_point():
                continue
            seen.add(id(b))
            index, node = 0, m
            while node is not None:
                claims = {owner[id(p)] for p in node.parameters() if id(p) in owner}
                if len(claims) == 1:
                    index = claims.pop()
                    break
                if len(claims) > 1:
                    break
                node = parents.get(id(node))
            out[index].append(b)
    return out


def broadcast_module(
    modules: Modules, src: int = 0, *, process_group: Optional[Any] = None, extra: Sequence[Tensor] = ()
) -> None:
    """Copy group rank ``src``'s parameters and buffers (and the ``extra`` tensors) to every process.

    No-op without an initialised process group of more than one process.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(process_group) == 1:
        return
    group = process_group if process_group is not None else dist.group.WORLD
    src_rank = dist.get_global_rank(group, src)
    seen: set[int] = set()
    with torch.no_grad():
        for module in [modules] if isinstance(modules, nn.Module) else modules:
            for t in (*module.parameters(), *module.buffers(), *extra):
                if id(t) not in seen:
                    seen.add(id(t))
                    dist.broadcast(t, src=src_rank, group=process_group)
