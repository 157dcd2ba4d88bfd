"""A run's identity (``lit_slowcal.experiments.run.identity``): a resume of a different run is refused naming each
key with both values, and what may change on resume changes without changing the run."""

import shutil

import pytest
import torch
from in_process import RUN, command, error_line

from lit_slowcal.experiments.run.identity import MAY_CHANGE_ON_RESUME

DIFFERENT_RUN = [
    # (arguments, the difference named), each from a case of the issue
    (["--ckpt_path=last", "--model.lr=0.1"], "model.lr 0.01 in the checkpoint, 0.1 now"),
    (["--ckpt_path=last", "--model.weight_power=2"], "model.weight_power 1.0 in the checkpoint, 2.0 now"),
    (["--ckpt_path=last", "--data.dirichlet_alpha=1.0"], "data.dirichlet_alpha 0.1 in the checkpoint, 1.0 now"),
    (["--ckpt_path={ckpt}", "--local_steps=8"], "local_steps 64 in the checkpoint, 8 now"),
    (["--ckpt_path={ckpt}", "--method=local_sgd"], 'method "slowcal" in the checkpoint, "local_sgd" now'),
    (["--ckpt_path={ckpt}", "--num_machines=32"], "num_machines 4 in the checkpoint, 32 now"),
    (["--ckpt_path={ckpt}", "--seed_everything=2", "--model.gamma=0.5"],
     "model.gamma null in the checkpoint, 0.5 now; seed_everything 1 in the checkpoint, 2 now"),
    (["test", "--ckpt_path={ckpt}", "--model.lr=0.1"], "Cannot test with {ckpt}: it is a different run: model.lr"),
]  # fmt: skip


@pytest.mark.parametrize(("args", "named"), DIFFERENT_RUN, ids=[" ".join(a) for a, _ in DIFFERENT_RUN])
def test_resuming_a_different_run_is_refused_naming_each_key_with_both_values(
    half_run, tmp_path, capsys, no_training, args, named
):
    runs = tmp_path / "runs"
    shutil.copytree(half_run / "runs", runs)
    ckpt = runs / RUN / "version_0" / "checkpoints" / "last.ckpt"
    code, err = command(capsys, *(a.format(ckpt=ckpt) for a in args), run_dir=runs)
    line = error_line(err)
    assert code == 1 and named.format(ckpt=ckpt) in line
    assert "(only run_dir, eval_every, checkpoint_every, threads, wandb" in line and "trainer.{max_epochs" in line
    assert not no_training
    assert sorted(p.name for p in (runs / RUN).iterdir()) == ["version_0"]  # nothing new was written


def test_what_may_change_on_resume_changes_and_the_run_ends_as_if_uninterrupted(half_run, tmp_path, capsys):
    runs = tmp_path / "runs"
    shutil.copytree(half_run / "runs", runs)
    allowed = ["--eval_every=3", "--checkpoint_every=2", "--threads=1", "--trainer.log_every_n_steps=1"]
    assert {a[2:].split("=")[0] for a in allowed} <= set(MAY_CHANGE_ON_RESUME)
    code, err = command(capsys, "--ckpt_path=last", *allowed, run_dir=runs)
    assert code == 0, err[-3000:]
    resumed = torch.load(runs / RUN / "version_1" / "checkpoints" / "last.ckpt", weights_only=True)
    full = torch.load(half_run / "full" / RUN / "version_0" / "checkpoints" / "last.ckpt", weights_only=True)
    assert resumed["global_step"] == full["global_step"] == 4 * 64
    for key, value in full["state_dict"].items():
        assert torch.equal(resumed["state_dict"][key], value), key
    assert resumed["lit_slowcal_run"] == full["lit_slowcal_run"]
    assert full["lit_slowcal_run"]["local_steps"] == 64 and full["lit_slowcal_run"]["model.lr"] == 0.01


def test_a_checkpoint_without_an_identity_is_compared_on_the_models_hyperparameters(half_run, tmp_path, capsys):
    old = torch.load(half_run / "runs" / RUN / "version_0" / "checkpoints" / "last.ckpt", weights_only=True)
    del old["lit_slowcal_run"]  # as written before identities were stored
    torch.save(old, tmp_path / "old.ckpt")
    code, err = command(capsys, f"--ckpt_path={tmp_path / 'old.ckpt'}", "--model.lr=0.03", run_dir=tmp_path / "runs")
    assert code == 1 and "model.lr 0.01 in the checkpoint, 0.03 now" in error_line(err)


def test_resume_takes_settings_that_do_not_change_training(half_run, tmp_path, capsys):
    runs = tmp_path / "runs"
    shutil.copytree(half_run / "runs", runs)
    same = ["--objective=false", "--diagnostics=false", f"--cache_dir={tmp_path / 'cache'}", "--data.problem=MNIST"]
    code, err = command(capsys, "--ckpt_path=last", *same, run_dir=runs)
    assert code == 0, err[-3000:]
    resumed = torch.load(runs / RUN / "version_1" / "checkpoints" / "last.ckpt", weights_only=True)
    full = torch.load(half_run / "full" / RUN / "version_0" / "checkpoints" / "last.ckpt", weights_only=True)
    for key, value in full["state_dict"].items():
        assert torch.equal(resumed["state_dict"][key], value), key
