"""``train_s``: the measured seconds of a run's rounds (local steps and synchronisations), logged at each evaluation
of a fit, carried across a resume; what a measured time to accuracy reads (docs/time_to_accuracy.md)."""

import csv
import time

import torch
from in_process import RUN, command


def evaluation_rows(run_dir, version=0):
    with open(run_dir / RUN / f"version_{version}" / "metrics.csv", newline="") as f:
        return [r for r in csv.DictReader(f) if r.get("test_acc")]


def test_each_evaluation_logs_the_seconds_of_the_rounds_before_it_within_the_fits_own_time(tmp_path, capsys):
    began = time.perf_counter()
    code, err = command(capsys, "--eval_every=1", run_dir=tmp_path)
    elapsed = time.perf_counter() - began
    assert code == 0, err[-2000:]
    rows = evaluation_rows(tmp_path)
    rounds = [float(r["round"]) for r in rows]
    seconds = [float(r["train_s"]) for r in rows]
    assert rounds == [1.0, 2.0, 3.0, 4.0]  # one evaluation a round (an evaluation closes the round)
    assert 0 < seconds[0] and all(a < b for a, b in zip(seconds, seconds[1:]))
    assert seconds[-1] < elapsed  # the rounds' time only: less than the whole command's


def test_a_resumed_run_goes_on_from_its_checkpoints_seconds(tmp_path, capsys):
    args = ("--eval_every=1", "--checkpoint_every=2")
    assert command(capsys, *args, "--trainer.max_steps=128", run_dir=tmp_path)[0] == 0
    saved = torch.load(tmp_path / RUN / "version_0" / "checkpoints" / "last.ckpt", weights_only=True)["train_s"]
    first = evaluation_rows(tmp_path)
    # the checkpoint after round 2 holds the seconds logged at round 2 (logged as a float32 tensor)
    assert float(torch.tensor(saved, dtype=torch.float32)) == float(first[-1]["train_s"])
    assert command(capsys, *args, "--ckpt_path=last", run_dir=tmp_path)[0] == 0
    resumed = [float(r["train_s"]) for r in evaluation_rows(tmp_path, version=1)]
    assert len(resumed) == 2 and saved < resumed[0] < resumed[1]
