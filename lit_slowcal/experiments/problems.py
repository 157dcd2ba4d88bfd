"""The problems' former import path, kept for files written before the app moved into its rooms.

A run folder's ``config.yaml`` names its problem by class path (``data.problem: {class_path:
lit_slowcal.experiments.problems.MNIST}``); this module keeps such files loading with ``--config``.
The problems live in ``lit_slowcal.experiments.data.problems``.
"""

from lit_slowcal.experiments.data.problems import MNIST, PROBLEMS, Problem, ProblemData, Quadratic, Synthetic

__all__ = ["MNIST", "PROBLEMS", "Problem", "ProblemData", "Quadratic", "Synthetic"]
