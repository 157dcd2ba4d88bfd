"""One owner of the run's shape (``lit_slowcal.experiments.train.shape.RunShape``): every run the CLI builds, for
every method of the registry, at one and two processes and on every problem, gives its data module, its model,
its strategy and torch's threads the values of its one ``RunShape``; and no module of the package outside
``train/shape.py`` computes K, M, the machines per process or the rounds itself (the scan below)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from lit_slowcal.experiments.data.problems import PROBLEMS
from lit_slowcal.experiments.train.methods import METHODS
from lit_slowcal.experiments.train.shape import RunShape

PACKAGE = Path(__file__).resolve().parents[3] / "lit_slowcal"
OWNER = PACKAGE / "experiments" / "train" / "shape.py"

#: What only the shape computes: calls of these functions or methods ...
SHAPE_CALLS = ("steps_per_round", "per_step_batch", "sync_period", "hosted_machines", "limited_rounds")
#: ... and a division by the world size (machines per process).
DIVIDES_BY_WORLD = re.compile(r"//\s*\(?\s*[\w.]*world", re.IGNORECASE)

#: Calls the scan allows outside shape.py, with the reason: (file relative to the package, function called).
ALLOWED = {
    # The registry's own definition of a method's sync period (its steps per round): the registry, which only
    # shape.py asks, defines itself; no value of a run is computed there.
    ("experiments/train/methods.py", "steps_per_round"),
}

# (M, K, b) per process count: M a multiple of the processes, b and K small enough for every problem's shards.
SIZES = {1: (6, 2, 1), 2: (4, 3, 2)}
PROBLEM_ARGS = {
    "MNIST": [],
    "Synthetic": ["--data.problem=Synthetic"],
    "Quadratic": ["--data.problem=Quadratic", "--data.problem.samples=30"],
    "StdlibChars": ["--data.problem=StdlibChars", "--model.arch=transformer", "--model.init=default",
                    "--data.dirichlet_alpha=0.5", "--data.split=balanced"],
}  # fmt: skip


def _shape_calls(path: Path) -> list[tuple[str, int]]:
    """``(name, line)`` of every call in ``path`` of a function or method named in ``SHAPE_CALLS``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
            if name in SHAPE_CALLS:
                found.append((name, node.lineno))
    return found


def test_no_module_but_the_shape_computes_k_m_or_the_rounds():
    """AST scan: ``steps_per_round(``, ``per_step_batch(``, ``sync_period(``, ``hosted_machines(`` and
    ``limited_rounds(`` are called in ``train/shape.py`` only (``ALLOWED`` aside), and no module divides by the
    world size."""
    offenders, used = [], set()
    files = sorted(p for p in PACKAGE.rglob("*.py") if p != OWNER)
    assert len(files) > 50 and PACKAGE / "experiments" / "sweep" / "stacked.py" in files
    for path in files:
        rel = path.relative_to(PACKAGE).as_posix()
        for name, line in _shape_calls(path):
            if (rel, name) in ALLOWED:
                used.add((rel, name))
            else:
                offenders.append(f"{rel}:{line} calls {name}()")
        for number, text in enumerate(path.read_text().splitlines(), 1):
            if DIVIDES_BY_WORLD.search(text.split("#")[0]):
                offenders.append(f"{rel}:{number} divides by the world size: {text.strip()}")
    assert offenders == [], "only train/shape.py computes the run's shape:\n" + "\n".join(offenders)
    assert used == ALLOWED  # every exception is still needed
    assert {name for name, _ in _shape_calls(OWNER)} >= set(SHAPE_CALLS) - {"hosted_machines", "limited_rounds"}


def test_the_scan_finds_what_it_looks_for(tmp_path):
    """The scan's own check: each form it refuses is found."""
    source = tmp_path / "m.py"
    source.write_text(
        "entry.steps_per_round(k)\nper_step_batch(m, k, b)\nx.sync_period(k)\nhosted_machines(m, w)\n"
        "limited_rounds(r, l)\nm = machines // world\nm = n // self.trainer.world_size\n"
    )
    assert [name for name, _ in _shape_calls(source)] == list(SHAPE_CALLS)
    assert sum(bool(DIVIDES_BY_WORLD.search(line)) for line in source.read_text().splitlines()) == 2


@pytest.mark.parametrize("devices", sorted(SIZES))
@pytest.mark.parametrize("problem", sorted(PROBLEM_ARGS))
def test_every_run_takes_k_m_and_the_rounds_from_its_one_shape(problem, devices, tmp_path, monkeypatch):
    """As the CLI builds a run (``run=False``; two processes built without being started): the data module's
    batches, the model's machines, the strategy's sync period and the threads' work size are the ``RunShape``'s,
    for every method of the registry."""
    import lit_slowcal.experiments.run.threads as threads
    from lit_slowcal.experiments.run.run_folder import RUN_VERSION_ENV
    from lit_slowcal.experiments.sweep.single import _trial_cli

    assert set(PROBLEM_ARGS) == set(PROBLEMS)
    works = []
    configure = threads.configure_threads
    monkeypatch.setattr(
        threads, "configure_threads", lambda s, work, **kw: works.append(work) or configure(s, work, **kw)
    )
    cli_class = _trial_cli()  # the CLI, its parsers built once for all cases
    monkeypatch.setenv(RUN_VERSION_ENV, "")  # unset again when the test ends (run=False keeps the version)
    M, K, b = SIZES[devices]
    for method in METHODS:
        args = [
            "--config=configs/slowcal.yaml", f"--method={method}", f"--num_machines={M}", f"--local_steps={K}",
            f"--batch_size={b}", f"--trainer.devices={devices}", *PROBLEM_ARGS[problem], "--wandb=false",
            f"--run_dir={tmp_path}", "--eval_every=3", "--trainer.limit_train_batches=5",
        ]  # fmt: skip
        monkeypatch.delenv(RUN_VERSION_ENV, raising=False)  # run=False keeps the version for its children
        works.clear()
        cli = cli_class(args=args, run=False)
        shape, data, model, trainer = cli.shape, cli.datamodule, cli.model, cli.trainer
        try:
            expected = RunShape.of(
                method, M, K, b, train_size=data.problem.train_size(M, 1, data), world_size=devices, eval_every=3,
                limit_train_batches=5,
            )  # fmt: skip
            assert shape == expected and trainer.world_size == devices
            local = METHODS[method].local
            assert (shape.steps_per_round, shape.per_step_batch) == ((K, b) if local else (1, K * b))
            # The strategy: one synchronisation per round of the shape.
            assert trainer.strategy.sync_every == shape.sync_every == shape.steps_per_round
            # The threads: sized for the shape's machines per process and per-step batch.
            assert [(w.machines, w.samples, w.per_process) for w in works] == [
                (shape.machines_per_process, shape.per_step_batch, devices > 1)
            ]
            # The model: the run's shape, and this process's machines.
            assert model.shape is shape
            model.configure_model()
            assert model.machines.num_machines == shape.machines_per_process == M // devices
            # The data module: the run's shape, its batches the shape's rounds.
            assert data.shape() is shape and (data.steps_per_round, data.batch_size) == (
                shape.steps_per_round,
                shape.per_step_batch,
            )
            data.trainer = trainer
            data.setup("validate")  # the training streams, without the class figure (a collective)
            loader = data.train_dataloader()
            x, y = next(iter(loader))
            assert len(loader) == data.shape().rounds == shape.rounds
            targets = (data.problem.input_dim,) if data.problem.loss == "next_token" else ()  # every position's
            assert tuple(x.shape) == shape.batch_shape(data.problem.input_dim)
            assert tuple(y.shape) == shape.batch_shape() + targets
            assert trainer.val_check_interval == shape.val_check_interval and shape.trained_rounds == min(
                5, shape.rounds
            )
        finally:
            trainer.strategy.teardown()


def test_a_config_file_of_an_earlier_version_loads_when_its_data_settings_agree(tmp_path, monkeypatch, capsys):
    """A run folder's config.yaml written when K was linked into the data module (``data.steps_per_round``,
    ``data.batch_size``): accepted where they are the shape's, refused in one line where not; the run's identity
    is the same as without them (its checkpoints resume, its records are recognised)."""
    import yaml

    from lit_slowcal.experiments.main import main
    from lit_slowcal.experiments.run.run_folder import RUN_VERSION_ENV
    from lit_slowcal.experiments.sweep.single import _trial_cli

    config = yaml.safe_load(Path("configs/minibatch_sgd.yaml").read_text())
    base = ["--wandb=false", f"--run_dir={tmp_path}", "--local_steps=4", "--batch_size=2"]
    identities = []
    monkeypatch.setenv(RUN_VERSION_ENV, "")  # unset again when the test ends (run=False keeps the version)
    for data in ({}, {"steps_per_round": 1, "batch_size": 8}):
        path = tmp_path / f"config{len(identities)}.yaml"
        path.write_text(yaml.safe_dump({**config, "data": {**config.get("data", {}), **data}}))
        monkeypatch.delenv(RUN_VERSION_ENV, raising=False)
        cli = _trial_cli()(args=[f"--config={path}", *base], run=False)
        assert (cli.shape.steps_per_round, cli.shape.per_step_batch) == (1, 8)
        assert (cli.datamodule.steps_per_round, cli.datamodule.batch_size) == (1, 8)
        identities.append(cli.identity)
        cli.trainer.strategy.teardown()
    assert identities[0] == identities[1] and not any(k.startswith("data.steps") for k in identities[0])
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({**config, "data": {**config.get("data", {}), "batch_size": 2}}))
    with pytest.raises(SystemExit) as info:
        main(["fit", f"--config={path}", *base])
    assert info.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(
        "lit_slowcal: error: Invalid data.batch_size: 2 (the run's shape has 8, from method, local_steps and "
        "batch_size; leave it unset or give 8)"
    )
