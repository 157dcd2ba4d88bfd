"""What each trial of a stacked group gets as its single run gets it, built by the single run's own classes:
its data module and model (``data_and_model``), its CSV log folder with the split's class counts and its
``config.yaml`` (``trial_logger``, ``config_yaml``), and its own W&B run (``wandb_run``).
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional

from lit_slowcal.experiments.sweep.grouping import StackedTrial, trial_problem, trial_shape
from lit_slowcal.experiments.train.shape import RunShape

__all__ = ["config_yaml", "data_and_model", "model_settings", "trial_logger", "wandb_run"]


def model_settings(config: dict[str, Any]) -> dict[str, Any]:
    """The model's arguments as the CLI instantiates it: the parsed ``model`` section with the shape and
    loss that the CLI links from the problem (``model.input_dim``, ``model.num_classes``, ``model.loss``)."""
    problem = trial_problem(config)
    return {**config["model"], "input_dim": problem.input_dim, "num_classes": problem.num_outputs, "loss": problem.loss}


def data_and_model(config: dict[str, Any], shape: Optional[RunShape] = None) -> tuple[Any, Any]:
    """A trial's data module (set up) and model (configured), built by its single run's own classes, both in the
    trial's ``shape`` (``None``: ``trial_shape(config)``), as its single run's CLI gives it to them."""
    from lightning.fabric.utilities.seed import seed_everything

    from lit_slowcal.experiments.data.datamodule import ProblemDataModule
    from lit_slowcal.experiments.train.model import MachinesModel

    data = ProblemDataModule(**{k: v for k, v in config["data"].items()})
    shape = trial_shape(config) if shape is None else shape
    data.use_shape(shape)
    data.setup("fit")
    seed_everything(config["seed_everything"], verbose=False)  # as the CLI, for init=default
    model = MachinesModel(**model_settings(config))
    model.use_shape(shape)
    model.configure_model()
    return data, model


def trial_logger(trial: StackedTrial, data: Any, config_text: Optional[Any]) -> Any:
    """The trial's CSV logger in its own version folder (claimed as a single run claims it), with the
    split's class counts and its ``config.yaml``."""
    from lightning.pytorch.loggers import CSVLogger

    from lit_slowcal.experiments.data.class_distribution import write_class_counts
    from lit_slowcal.experiments.run.run_folder import claim_version, run_name

    name = run_name(trial.config.get)
    logger = CSVLogger(
        save_dir=trial.config["run_dir"], name=name, version=claim_version(trial.config["run_dir"], name)
    )
    logger.experiment
    write_class_counts(data.class_counts(), os.path.join(logger.log_dir, "class_counts.csv"))
    if config_text is not None:
        with open(os.path.join(logger.log_dir, "config.yaml"), "w") as f:
            f.write(config_text(trial))
    return logger


def wandb_run(config: dict[str, Any], name: str, folder: str, history: list, failed: bool) -> None:
    """The trial's own W&B run, written when its group ends: its config, every logged row at its
    step, in the sweep's W&B group; online or offline as a single run's (``run_folder.start_wandb``)."""
    import wandb

    from lit_slowcal.experiments.run.run_folder import flat_config, start_wandb

    kwargs = dict(
        project=config.get("wandb_project"), name=name, dir=folder, group=os.environ.get("WANDB_RUN_GROUP"),
        config=flat_config(config), reinit="finish_previous",
    )  # fmt: skip
    run, _ = start_wandb(lambda offline: wandb.init(mode="offline" if offline else "online", **kwargs), folder)
    for step, row in history:
        run.log(row, step=step)
    run.finish(exit_code=1 if failed else 0)


def config_yaml(trial: StackedTrial) -> str:
    """The ``config.yaml`` written into a stacked trial's log folder: its parsed ``fit`` configuration."""
    import yaml

    plain = json.loads(json.dumps({k: v for k, v in trial.config.items() if k != "config"}, default=str))
    return yaml.safe_dump(plain, sort_keys=False)
