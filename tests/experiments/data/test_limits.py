"""Resource limits (``lit_slowcal.experiments.data.limits``): a run beyond the memory or the shards is refused
with the numbers, before training."""

import pytest
import torch
from in_process import command, error_line

from lit_slowcal.experiments.data import limits

LIMITS = [
    # (arguments, available memory in bytes, message)
    (["--num_machines=16", "--local_steps=16", "--batch_size=100000"], 20 * 2**30,
     "A round does not fit in memory: 16 machines x 16 steps x 100000 samples per step x 784 features need 150.3 GiB "
     "(with the next round, fetched ahead), and 20.0 GiB are available. Use a batch_size of at most 13306 per step"),
    (["--num_machines=16", "--local_steps=16", "--batch_size=1"], 500_000,  # b is 1 already: no smaller batch helps
     "A round does not fit in memory: 16 machines x 16 steps x 1 samples per step x 784 features need 1.5 MiB (with "
     "the next round, fetched ahead), and 0.5 MiB are available. Not even 1 sample per step fits: at most 4 machines do "
     "with 16 steps per round. Use fewer machines (or more nodes) or fewer local_steps, or free memory."),
    (["--num_machines=16", "--local_steps=16", "--batch_size=20000"], 2**40,
     "Invalid batch_size: each machine takes 20000 samples per step, more than any machine's shard of the split "
     "(16 machines, Dirichlet alpha=0.1, official) holds: 944 to 10190 samples (machine 7). Use a per-step batch of "
     "at most 10190"),
    (["--method=minibatch_sgd", "--num_machines=16", "--local_steps=16", "--batch_size=700"], 2**40,
     "each machine takes 11200 samples per step, more than any machine's shard"),
    (["--num_machines=16", "--data.split=balanced", "--batch_size=5000"], 2**40,
     "(16 machines, Dirichlet alpha=0.1, balanced) holds: 3750 to 3750 samples (machine 0)"),
]  # fmt: skip


@pytest.mark.parametrize(("args", "available", "message"), LIMITS, ids=[" ".join(a) for a, _, _ in LIMITS])
def test_a_run_beyond_the_resources_is_refused_with_the_numbers(
    tmp_path, capsys, monkeypatch, no_training, args, available, message
):
    monkeypatch.setattr(limits, "available_memory", lambda: available)
    code, err = command(capsys, *args, run_dir=tmp_path / "runs")
    assert code == 1 and message in error_line(err)
    assert not no_training


def test_round_bytes_counts_two_rounds_of_samples_labels_and_indices():
    # 2 rounds x 4 machines x 3 steps x 5 samples x (10 float32 features + int64 label + int64 index)
    assert limits.round_bytes(4, 3, 5, 10) == 2 * 60 * (40 + 8 + 8)
    assert limits.available_memory() > 0
    limits.check_round_fits(4, 3, 5, 10, available=limits.round_bytes(4, 3, 5, 10))  # exactly fits


def test_a_batch_larger_than_some_shards_only_is_allowed():
    # The paper's split at M = 64 gives some machines 39 samples; Minibatch-SGD at K = 64 takes 64 a step.
    shards = [torch.arange(39), torch.arange(900)]
    limits.check_shards_hold_a_batch(shards, 900, "2 machines")
    with pytest.raises(ValueError, match="901 samples per step, more than any machine's shard of the split "
                       r"\(2 machines\) holds: 39 to 900 samples \(machine 1\)"):  # fmt: skip
        limits.check_shards_hold_a_batch(shards, 901, "2 machines")
