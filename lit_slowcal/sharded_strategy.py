"""Lightning's ``Trainer`` with an FSDP2-sharded model averaged over its replicas: ``strategy="sharded_averaging"``.

``ShardedAveragingStrategy`` is a ``ModelParallelStrategy`` whose processes form a 2-D mesh of R
replicas x S shards (rank = r S + s). The S processes of a replica are one machine: the user's
``configure_model`` shards the model over them with FSDP2's ``fully_shard(..., mesh=shard_mesh)``,
and FSDP2 reduce-scatters their gradients every step as usual. The R replicas step on their own data
and a ``PeriodicAverager`` per optimizer averages each local shard over the replicate group every K
steps (docs/sharded.md): HSDP with the cross-replica gradient all-reduce replaced by a periodic
average. The round boundaries are the other Trainer strategy's (``TrainerRounds``): one averaged
model at every validation, checkpoint and at the end of ``fit``.

Checkpoints are ``ModelParallelStrategy``'s: a directory written by torch's distributed checkpoint
(the sharded model and optimizer state, and Lightning's ``meta.pt``), and beside them one file per
process, ``periodic_averaging.rank{r}.pt``, with its averagers' states: the schedule and counts, the
optimizer state each replica keeps for itself (of its local shard: a distributed checkpoint keeps
one replica's), the outer optimizer's round start and state, the compression's anchors and error
feedback. A resume on the same mesh continues the run exactly; on another mesh it is refused, and so is a
checkpoint missing a process's file (every rank stops with the same line naming the missing files).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Literal, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import ModelParallelStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from lit_slowcal._averagers import CHECKPOINT_KEY
from lit_slowcal._collectives import broadcast_module
from lit_slowcal._selection import local
from lit_slowcal._trainer_rounds import TrainerRounds
from lit_slowcal._validation import check_int
from lit_slowcal.checkpoint_io import read_checkpoint
from lit_slowcal.files import atomic_path
from lit_slowcal.options import AveragingOptions, option_keywords

__all__ = ["ShardedAveragingStrategy"]

log = logging.getLogger(__name__)

Size = Union[Literal["auto"], int]


class ShardedAveragingStrategy(TrainerRounds, ModelParallelStrategy):
    """FSDP2 within each replica, the replicas' shards averaged every ``sync_every`` steps.

    The mesh is Lightning's (``self.device_mesh`` in ``configure_model``), of shape (R, S) under
    Lightning's dimension names: ``"data_parallel"`` is the replicate dimension (the machines,
    averaged every K steps) and ``"tensor_parallel"`` the shard dimension (no tensor parallelism:
    FSDP2 over it). ``shard_mesh`` and ``replicate_mesh`` name them plainly; shard with
    ``fully_shard(module, mesh=self.trainer.strategy.shard_mesh)``. Every process takes its own part of
    the data (a sampler of ``world_size`` replicas), so a machine's batch is its S processes' batches.
    Rank 0's replica is broadcast at setup, so all machines start from the same point.

    What is averaged and how it travels is ``PeriodicAverager``'s (each parameter's local shard, the
    declared optimizer state, floating buffers, each first averaged over its machine's shard processes, so every
    process holds the same buffers after a round; ``outer_optimizer``, ``participation``,
    ``compression``, ``overlap_delay`` as there, M = R machines). Refused in one line: a shard size
    above 1 with a model holding no DTensor (shard it in ``configure_model``), other placements and
    FSDP1 (``PeriodicAverager``), ``fragments`` > 1, ``SimulatedMachines``, and
    ``save_distributed_checkpoint=False`` (the averagers' states live beside the distributed checkpoint).

    Args:
        sync_every: K, optimizer steps between synchronisations (>= 1; ``None``: ``options``'s, 1 by default).
        replicate_size: R, the replicas (machines): ``"auto"``, the number of nodes.
        shard_size: S, the processes a replica is sharded over: ``"auto"``, the devices of a node.
            R x S must be the number of processes.
        options: every synchronisation option, or each by name, as ``PeriodicAveragingStrategy``'s
            (``fragments`` > 1 and ``bucket_views`` are refused with a sharded model).
        **kwargs: the options by name; the rest passed to ``ModelParallelStrategy`` (``process_group_backend``,
            ``timeout``).

    Example:
        >>> trainer = Trainer(strategy=ShardedAveragingStrategy(sync_every=16), num_nodes=2, devices=8)  # doctest: +SKIP
    """

    strategy_name = "sharded_averaging"

    @option_keywords
    def __init__(
        self,
        sync_every: Optional[int] = None,
        replicate_size: Size = "auto",
        shard_size: Size = "auto",
        *,
        options: Optional[AveragingOptions] = None,
        **kwargs: Any,
    ) -> None:
        for name, size in (("replicate_size", replicate_size), ("shard_size", shard_size)):
            if size != "auto":
                check_int(name, size)
        averaging = AveragingOptions.build(options, sync_every, **AveragingOptions.take(kwargs))
        averaging.check_sharded()  # F = 1, no bucket views: refused now, in one line
        for name in ("data_parallel_size", "tensor_parallel_size"):
            if name in kwargs:
                raise ValueError(f"ShardedAveragingStrategy sets {name} itself; give replicate_size and shard_size")
        if kwargs.pop("save_distributed_checkpoint", True) is not True:
            raise ValueError(
                "Invalid save_distributed_checkpoint: False (ShardedAveragingStrategy saves a distributed "
                "checkpoint, each process's averager state beside it; use True)"
            )
        super().__init__(data_parallel_size=replicate_size, tensor_parallel_size=shard_size, **kwargs)
        self.replicate_size, self.shard_size = replicate_size, shard_size
        self._init_rounds(averaging)

    # -- the mesh --------------------------------------------------------------------------

    def mesh_shape(self) -> tuple[int, int]:
        """(R, S) for this run's processes (``"auto"`` resolved: the nodes, the devices of a node)."""
        replicate = self.num_nodes if self.replicate_size == "auto" else int(self.replicate_size)
        shard = self.num_processes if self.shard_size == "auto" else int(self.shard_size)
        return replicate, shard

    @override
    def setup_environment(self) -> None:
        replicate, shard = self.mesh_shape()
        world = self.num_nodes * self.num_processes
        if replicate * shard != world:
            raise ValueError(
                f"Invalid replicate_size x shard_size: {replicate} x {shard} (must be the number of processes, "
                f"{self.num_nodes} nodes x {self.num_processes} devices = {world})"
            )
        super().setup_environment()

    @property
    def replicate_mesh(self) -> Any:
        """The 1-D mesh of this process's replicate dimension (the R machines averaged every K steps)."""
        return self.device_mesh["data_parallel"]

    @property
    def shard_mesh(self) -> Any:
        """The 1-D mesh of this process's shard dimension: the S processes of its machine (``fully_shard`` over it)."""
        return self.device_mesh["tensor_parallel"]

    def _averaging_group(self) -> Optional[Any]:
        return self.replicate_mesh.get_group()

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Every process its own data: a replica's batch is its shards' batches (FSDP2 averages their gradients).
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        if trainer.state.fn != TrainerFn.FITTING:
            return
        assert self.model is not None
        tensors = [*self.model.parameters(), *self.model.buffers()]
        if self.mesh_shape()[1] > 1 and not any(local(t) is not t for t in tensors):
            raise ValueError(
                f"ShardedAveragingStrategy: the model holds no DTensor with shard_size={self.mesh_shape()[1]}; shard it in "
                "configure_model with fully_shard(module, mesh=self.trainer.strategy.shard_mesh) (docs/sharded.md)"
            )
        # x_0 the same on every machine: replica 0's shards to the others.
        log.debug(f"{type(self).__name__}: broadcasting replica 0's shards over the replicate group")
        broadcast_module(self.model, src=0, process_group=self._averaging_group())

    # -- checkpoints -----------------------------------------------------------------------

    def _state_file(self, path: Path, rank: Optional[int] = None) -> Path:
        return path / f"{CHECKPOINT_KEY}.rank{self.global_rank if rank is None else rank}.pt"

    def _put_schedules(self, checkpoint: dict[str, Any]) -> None:
        optimizers = self._torch_optimizers()
        if optimizers and all(id(o) in self.averagers for o in optimizers):
            replicate, shard = self.mesh_shape()
            checkpoint[CHECKPOINT_KEY] = {"mesh": {"replicate": replicate, "shard": shard}}

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        optimizers = self._torch_optimizers()
        saved = bool(optimizers) and all(id(o) in self.averagers for o in optimizers)
        states = [self.averagers[id(o)].state_dict() for o in optimizers] if saved else None
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
        if states is not None:
            with atomic_path(self._state_file(Path(self.broadcast(filepath)))) as tmp:
                torch.save({"averagers": states}, tmp)
        self.barrier("sharded_averaging.save_checkpoint")

    def _take_schedules(self, checkpoint: dict[str, Any], checkpoint_path: Any) -> Optional[list[dict[str, Any]]]:
        saved = checkpoint.get(CHECKPOINT_KEY)
        if saved is None:
            return None
        replicate, shard = self.mesh_shape()
        mesh = saved.get("mesh") if isinstance(saved, dict) else None
        if mesh != {"replicate": replicate, "shard": shard}:
            where = f"a {mesh['replicate']} x {mesh['shard']} mesh" if mesh else "an unsharded run"
            raise ValueError(
                f"Cannot resume the averagers' states of {where} on a {replicate} x {shard} mesh: each process's "
                "optimizer state is its shard's and its replica's; resume on the same mesh"
            )
        folder = Path(self.broadcast(checkpoint_path))
        # Every rank learns which processes' files are there, so that all stop on the same line, before any
        # collective of the resume (one rank stopping alone would leave the others waiting in one).
        found_here = torch.tensor([self._state_file(folder).is_file()], dtype=torch.int32, device=self.root_device)
        there = self.all_gather(found_here)
        missing = [str(self._state_file(folder, r)) for r, found in enumerate(there.flatten().tolist()) if not found]
        if missing:
            raise FileNotFoundError(
                f"Cannot resume from {folder}: {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} missing "
                f"(each process saves its averagers' state beside the distributed checkpoint, "
                f"{CHECKPOINT_KEY}.rank<r>.pt); copy the checkpoint folder whole, or start afresh without ckpt_path"
            )
        return read_checkpoint(self._state_file(folder))["averagers"]

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            "sharded_averaging",
            cls,
            description="FSDP2 within each replica, the replicas' shards averaged every K steps",
            override=True,
        )


ShardedAveragingStrategy.register_strategies(StrategyRegistry)
