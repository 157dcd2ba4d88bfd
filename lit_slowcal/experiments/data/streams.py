"""Endless per-machine sample streams over in-memory tensors, served one communication round at a time.

Every machine i draws from its own distribution D_i: the empirical distribution of its shard. Its
stream reshuffles and cycles its shard with a generator of its own (seeded from the seed and i), so
the samples machine i sees do not depend on how machines are laid out over processes. One item is
one round: for each of the round's steps and each of the m machines hosted here, b samples, as
tensors ``(steps, m, b, ...)`` and ``(steps, m, b)``. The samples stay in memory: a round only gathers.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

__all__ = ["MachineStreams"]


class MachineStreams:
    """Endless per-machine sample streams, served one communication round at a time.

    Machine i's stream is the concatenation of independent random permutations of its shard drawn
    from ``torch.Generator().manual_seed(seed * 1_000_003 + i)``. Each item is one round: the next
    ``steps_per_round * batch_size`` draws of every hosted machine, as tensors of shapes
    ``(steps_per_round, m, batch_size, ...)`` and ``(steps_per_round, m, batch_size)``. Iterating
    gives ``rounds`` items (one epoch); the next iteration continues the streams.

    Args:
        x, y: the whole training set (already normalised).
        shards: sample indices of every machine (all M of them).
        machine_ids: the machines hosted here.
        batch_size: samples per machine per step.
        steps_per_round: optimizer steps per round.
        rounds: rounds per epoch.
        seed: seeds every machine's stream.
    """

    def __init__(
        self,
        x: Tensor,
        y: Tensor,
        shards: list[Tensor],
        machine_ids: list[int],
        batch_size: int,
        steps_per_round: int,
        rounds: int,
        seed: int,
    ) -> None:
        self.x, self.y = x, y
        self.shards = [shards[i] for i in machine_ids]
        self.machine_ids = list(machine_ids)
        self.batch_size = batch_size
        self.steps_per_round = steps_per_round
        self.rounds = rounds
        self.seed = seed
        self.epoch = 0
        self.start_round = 0

    def __len__(self) -> int:
        return self.rounds

    def indices(self, epoch: int) -> Tensor:
        """Sample indices of one epoch, shape ``(rounds, steps_per_round, m, batch_size)``."""
        count = self.rounds * self.steps_per_round * self.batch_size  # draws per machine per epoch
        start = epoch * count
        columns = []
        for i, shard in zip(self.machine_ids, self.shards):
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
            n = len(shard)
            first, last = start // n, (start + count - 1) // n
            # Permutation k of the stream is the k-th draw from g: draw them all up to `last` in one
            # vectorised call and keep this epoch's window.
            perms = torch.rand(last + 1, n, generator=g).argsort(dim=1)[first:]
            offset = start - first * n
            columns.append(shard[perms.reshape(-1)[offset : offset + count]])
        idx = torch.stack(columns)  # (m, count)
        return idx.view(len(columns), self.rounds, self.steps_per_round, self.batch_size).permute(1, 2, 0, 3)

    def resume_at(self, epoch: int, rounds_done: int) -> None:
        """Make the next iteration continue epoch ``epoch`` after its first ``rounds_done`` rounds."""
        self.epoch, self.start_round = (epoch + 1, 0) if rounds_done >= self.rounds else (epoch, rounds_done)

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        epoch, start = self.epoch, self.start_round
        self.epoch, self.start_round = epoch + 1, 0
        idx = self.indices(epoch)
        for r in range(start, self.rounds):
            yield self.x[idx[r]], self.y[idx[r]]
