"""The average's buckets: with two processes the large contiguous tensors are reduced alone, in place; with
any number of processes every tensor ends with the same bits as an independent reference (the ranks'
tensors gathered, each rank's share summed in rank order, then divided): mixed sizes, dtypes and
layouts, machines simulated in a process, weighted rounds, and a SlowcalSGD model's parameters and w."""

import copy
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from lit_slowcal import PeriodicAverager, SimulatedMachines, SlowcalSGD
from lit_slowcal import _communication as communication

pytestmark = pytest.mark.slow  # two and three processes

M_LOCAL = 3  # machines each process hosts in the stacked tensors
CAP = 8 * 2**20  # more than a tensor reduced alone with two processes: without that rule, they would share buckets
BIG = communication.IN_PLACE_BYTES // 4 + 1000  # float32 values of a tensor reduced alone with two processes
# Dyadic weights, one per machine of two processes: exact in every dtype, so the reference's product is the library's.
WEIGHTS = torch.tensor([0.25, 0.0, 0.125, 0.125, 0.25, 0.25], dtype=torch.float64)


def _tensors(rank: int, world: int) -> list[tuple[torch.Tensor, bool]]:
    """Every rank's own values; with more than two processes whole numbers, whose sums are exact in any order."""
    g = torch.Generator().manual_seed(rank)

    def values(*shape: int, dtype=torch.float32, stacked: bool = False) -> torch.Tensor:
        t = torch.randn(*shape, generator=g)
        # Whole numbers (sums below 256: exact in bfloat16 too); stacked, multiples of M_LOCAL: whole means.
        return ((t * 8).round() * (M_LOCAL if stacked else 1)).to(dtype) if world > 2 else t.to(dtype)

    return [
        (values(BIG), False),  # alone, in place, with two processes
        (values(37), False),
        (values(BIG // 1000, 1000).t(), False),  # as large, but not contiguous: flattened
        (values(300, dtype=torch.float64), False),
        (values(BIG * 2, dtype=torch.bfloat16), False),  # alone as well (the same bytes)
        (values(33, dtype=torch.bfloat16), False),
        (values(M_LOCAL, 40, 50, stacked=True), True),  # stacked: one slice per machine of this process
        (values(BIG, 2), False),
        (values(M_LOCAL, 7, dtype=torch.float64, stacked=True), True),
    ]


def _reference(gathered: list, stacked: list[bool], world: int, weighted: bool) -> list[torch.Tensor]:
    out = []
    for i, s in enumerate(stacked):
        total = torch.zeros(())
        for r in range(world):  # rank order: with two ranks the order does not matter, with more the sums are exact
            t = gathered[r][i]
            if weighted:
                w = WEIGHTS[r * M_LOCAL : (r + 1) * M_LOCAL].to(t.dtype)
                share = torch.tensordot(w, t, dims=1) if s else t * w[0]
            else:
                share = t.mean(0) if s else t
            total = share if r == 0 else total + share
        avg = total if weighted else total / world
        out.append(avg.unsqueeze(0).expand_as(gathered[0][i]) if s else avg)
    return out


def _worker(rank: int, world: int, init_file: str, out: str, weighted: bool) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    tensors = _tensors(rank, world)
    gathered_lists: list = [None] * world
    dist.all_gather_object(gathered_lists, [t.clone() for t, _ in tensors])
    pointers = {t.data_ptr(): i for i, (t, _) in enumerate(tensors)}
    reduced, all_reduce, isend = [], dist.all_reduce, dist.isend

    def recording(send):  # an all-reduce, or the send of a two-process exchange (the same tensor, where it lies)
        def recorded(tensor, *args, **kwargs):
            reduced.append(pointers.get(tensor.data_ptr(), -tensor.numel() * tensor.element_size()))  # index, or -bytes
            return send(tensor, *args, **kwargs)

        return recorded

    dist.all_reduce, dist.isend = recording(all_reduce), recording(isend)
    try:
        communication.average(
            tensors, WEIGHTS if weighted else None, machines_per_process=M_LOCAL, process_group=None,
            bucket_cap_bytes=CAP,
        )  # fmt: skip
    finally:
        dist.all_reduce, dist.isend = all_reduce, isend
    expected = _reference(gathered_lists, [s for _, s in tensors], world, weighted)

    # A SlowcalSGD model with machines simulated in the process: its parameters and w, averaged by sync().
    torch.manual_seed(rank)
    large = nn.Linear(1100, 1000)  # its weight, 4.4 MB, is reduced in place in pieces with two processes
    model = nn.Sequential(large, SimulatedMachines(nn.Linear(20, 3), M_LOCAL), nn.LayerNorm(3))
    optimizer = SlowcalSGD(model.parameters(), lr=0.1)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    if world > 2:
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(64).round_()
                optimizer.state[p]["w"].mul_(64).round_()
    averager = PeriodicAverager(model, optimizer, sync_every=1)
    pairs = averager._tensors()
    before: list = [None] * world
    dist.all_gather_object(before, [t.clone() for t, _ in pairs])
    averager.sync()
    model_expected = _reference(before, [s for _, s in pairs], world, weighted=False)
    model_after = [t.detach().clone() for t, _ in pairs]
    # Two more syncs: the flattened buckets go through the averager's persistent buffers, the same each time.
    own = {t.untyped_storage().data_ptr() for t, _ in pairs}
    flats: list = []
    weight = large.weight.untyped_storage().data_ptr()
    pieces: list = []

    def recording_sync_all_reduce(tensor, *args, **kwargs):
        storage = tensor.untyped_storage().data_ptr()
        if storage not in own:
            flats[-1].append(storage)
        elif storage == weight:
            pieces.append((tensor.data_ptr() - storage) // tensor.element_size())  # the piece's offset
        return all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = recording_sync_all_reduce
    try:
        for _ in range(2):
            flats.append([])
            averager.sync()
    finally:
        dist.all_reduce = all_reduce
    pool = {b.untyped_storage().data_ptr() for slots in averager.engine.pool.buffers.values() for b in slots}
    plain = {**_plain_syncs(rank, world), **_view_syncs(rank, world)}
    if rank == 0:
        torch.save(
            {
                "after": [t for t, _ in tensors],
                "expected": expected,
                "reduced": reduced,
                "model_after": model_after,
                "model_expected": model_expected,
                "flats": flats,
                "pieces": pieces,
                "pool": pool,
                **plain,
            },
            out,
        )
    dist.barrier()
    dist.destroy_process_group()


def _plain_syncs(rank: int, world: int) -> dict:
    """Two syncs of a model of small tensors, none stacked: its one bucket is copied into the averager's
    buffer and back through the buffer's views, built in the first sync and kept for the second."""
    torch.manual_seed(rank)
    model = nn.Sequential(nn.Linear(30, 20), nn.LayerNorm(20), nn.Linear(20, 5))
    model[2].weight = nn.Parameter(torch.randn(20, 5).t())  # not contiguous: copied through its view all the same
    optimizer = SlowcalSGD(model.parameters(), lr=0.1)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    averager = PeriodicAverager(model, optimizer, sync_every=1)
    pairs = averager._tensors()
    assert not model[2].weight.is_contiguous() and not optimizer.state[model[2].weight]["w"].is_contiguous()
    out: dict = {"plain_after": [], "plain_expected": [], "plain_views": []}
    for sync in range(2):
        with torch.no_grad():  # every rank's own values (whole numbers with three ranks: exact sums)
            for t, _ in pairs:
                values = torch.randn(t.shape)
                t.copy_((values * 64).round() if world > 2 else t + values)
        before: list = [None] * world
        dist.all_gather_object(before, [t.clone() for t, _ in pairs])
        averager.sync()
        out["plain_expected"] += _reference(before, [False] * len(pairs), world, weighted=False)
        out["plain_after"] += [t.detach().clone() for t, _ in pairs]
        out["plain_views"].append([id(v) for *_, views in averager.engine.pool.layouts.values() for v in views])
    return out


def _view_syncs(rank: int, world: int) -> dict:
    """Syncs of a model with ``bucket_views=True``: its float32 tensors (a 4.4 MB weight, small ones, a
    BatchNorm's statistics, and w) live in one buffer after the first sync; a float64 part with a
    non-contiguous parameter stays as it is. Then the optimizer state is loaded anew (w: other tensors)
    and the next sync gives every tensor its place again."""
    torch.manual_seed(rank)
    model = nn.Sequential(nn.Linear(1100, 1000), nn.LayerNorm(1000), nn.BatchNorm1d(1000), nn.Linear(1000, 3))
    other = nn.Linear(4, 6).double()
    other.weight = nn.Parameter(torch.randn(4, 6, dtype=torch.float64).t())  # not contiguous: its kind is flattened
    optimizer = SlowcalSGD([*model.parameters(), *other.parameters()], lr=0.1)
    for p in optimizer.param_groups[0]["params"]:
        p.grad = torch.randn_like(p)
    optimizer.step()
    averager = PeriodicAverager([model, other], optimizer, sync_every=1, bucket_cap_mb=1, bucket_views=True)
    pairs = averager._tensors()
    objects = [id(t) for t, _ in pairs]
    out: dict = {"view_after": [], "view_expected": [], "view_storages": [], "view_reduced": []}
    original = dist.all_reduce
    for sync in range(3):
        if sync == 2:  # a loaded state: w becomes other tensors, of another storage
            optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))
            pairs = averager._tensors()
        with torch.no_grad():  # every rank's own values (whole numbers with three ranks: exact sums)
            for t, _ in pairs:
                values = torch.randn(t.shape, dtype=t.dtype)
                t.copy_((values * 64).round() if world > 2 else t + values)
        before: list = [None] * world
        dist.all_gather_object(before, [t.clone() for t, _ in pairs])
        reduced: list = []

        def recording_all_reduce(tensor, *args, **kwargs):
            reduced.append((tensor.untyped_storage().data_ptr(), tensor.numel()))
            return original(tensor, *args, **kwargs)

        dist.all_reduce = recording_all_reduce
        try:
            averager.sync()
        finally:
            dist.all_reduce = original
        out["view_expected"] += _reference(before, [False] * len(pairs), world, weighted=False)
        out["view_after"] += [t.detach().clone() for t, _ in pairs]
        storages = [t.untyped_storage().data_ptr() for t, _ in pairs]
        out["view_storages"].append(storages)
        out["view_reduced"].append([(storages.index(ptr) if ptr in storages else -1, n) for ptr, n in reduced])
        if sync == 1:  # rebound, not replaced: the tensors the averager found are those it homed
            out["view_objects"] = objects == [id(t) for t, _ in averager._tensors()]
    out["view_offsets"] = [t.storage_offset() for t, _ in pairs]
    out["view_dtypes"] = [t.dtype for t, _ in pairs]
    out["view_numels"] = [t.numel() for t, _ in pairs]
    return out


def _run(tmp_path, world: int, weighted: bool) -> dict:
    out = str(tmp_path / "average.pt")
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(world, os.path.join(tmp, "rendezvous"), out, weighted), nprocs=world, join=True)
    return torch.load(out)


def _assert_bit_identical(result: dict) -> None:
    for key in ("", "model_", "plain_", "view_"):
        for i, (after, expected) in enumerate(zip(result[key + "after"], result[key + "expected"])):
            assert after.dtype == expected.dtype and torch.equal(after, expected), f"{key}tensor {i} ({after.dtype})"


def _assert_views(result: dict, world: int) -> None:
    """``_view_syncs``: the float32 tensors in one buffer, in order, reduced where they lie (one collective per
    piece with two processes, per bucket with more), kept between syncs and given their place again after a load."""
    dtypes, numels = result["view_dtypes"], result["view_numels"]
    homed = [i for i, d in enumerate(dtypes) if d == torch.float32]
    assert len(homed) == 2 * 8 + 2 and len(dtypes) - len(homed) == 2 * 2  # x and w of 8 parameters, 2 statistics
    offsets = [sum(numels[j] for j in homed[:k]) for k in range(len(homed))]
    assert [result["view_offsets"][i] for i in homed] == offsets  # one after another, in the sync's order
    total = sum(numels[i] for i in homed)
    if world == 2:  # the whole buffer, in pieces of at most IN_PLACE_CHUNK_BYTES
        pieces = [len(p) for p in torch.arange(total).tensor_split(-(-total * 4 // communication.IN_PLACE_CHUNK_BYTES))]
    else:  # the buckets a flattened average would have: each value summed in the same order by the ring
        pieces = [
            sum(t.numel() for t, _ in b)
            for b in communication.buckets([(torch.empty(n), False) for n in [numels[i] for i in homed]], 2**20)
        ]
        assert len(pieces) > 1
    assert result["view_objects"]  # the same tensor objects, rebound
    for sync, (storages, reduced) in enumerate(zip(result["view_storages"], result["view_reduced"])):
        assert len({storages[i] for i in homed}) == 1, f"sync {sync}: the float32 tensors are not in one buffer"
        assert not {storages[i] for i in homed} & {storages[i] for i in range(len(dtypes)) if i not in homed}
        assert [n for i, n in reduced if i == homed[0]] == pieces, f"sync {sync}"
        assert all(i == homed[0] or i == -1 for i, _ in reduced)  # the float64 kind: flattened into the pool
    assert result["view_storages"][0] == result["view_storages"][1]  # kept: nothing copied in the second sync


@pytest.mark.parametrize("weighted", [False, True], ids=["mean", "weighted"])
def test_two_processes_reduce_large_contiguous_tensors_in_place_with_the_same_bits(tmp_path, weighted):
    result = _run(tmp_path, 2, weighted)
    _assert_bit_identical(result)
    _assert_views(result, 2)
    # The model's flattened bucket goes through one of the averager's persistent buffers, the same in every sync.
    assert result["flats"][0] == result["flats"][1] and len(result["flats"][0]) == 1
    assert set(result["flats"][0]) <= result["pool"]
    # A bucket of tensors as they are goes in and out through the buffer's views, built once: 12 tensors
    # (6 parameters and their w), the same views in the second sync.
    assert len(result["plain_views"][0]) == 6 * 2 and result["plain_views"][0] == result["plain_views"][1]
    # A tensor reduced in place travels in pieces of at most IN_PLACE_CHUNK_BYTES (views, in place).
    numel = 1100 * 1000
    n = -(-numel * 4 // communication.IN_PLACE_CHUNK_BYTES)
    offsets = [int(c[0]) for c in torch.arange(numel).tensor_split(n)]
    assert n == 2 and result["pieces"] == offsets * 2  # two syncs
    # The large contiguous tensors are all-reduced where they lie (5, the small bfloat16 tensor, is left
    # alone in its bucket: a bucket of one is reduced in place whatever the processes); the rest in buckets.
    assert sorted(i for i in result["reduced"] if i >= 0) == [0, 4, 5, 7]
    assert all(i >= 0 or -i <= CAP for i in result["reduced"])  # no bucket above the cap


def test_three_processes_keep_the_buckets_and_the_same_bits(tmp_path):
    result = _run(tmp_path, 3, weighted=False)
    _assert_bit_identical(result)
    _assert_views(result, 3)
    # The buckets are those of any number of processes: only a tensor larger than the cap is alone.
    tensors = _tensors(0, 3)
    layout = communication.buckets(tensors, CAP)
    alone = [next(i for i, (t, _) in enumerate(tensors) if t is b[0][0]) for b in layout if communication._in_place(b)]
    assert sorted(i for i in result["reduced"] if i >= 0) == sorted(alone)
    assert len(result["reduced"]) == len(layout)
