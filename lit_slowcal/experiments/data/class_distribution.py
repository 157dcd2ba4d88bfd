"""What a split gives each machine, written and drawn: the class counts as CSV and as a figure.

``lit_slowcal.experiments.data.partition.class_counts`` counts them; a run writes them beside its
metrics (``class_counts.csv``) and can draw them as the paper's appendix figure.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from lit_slowcal.files import atomic_write

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["write_class_counts", "plot_class_distribution"]


def write_class_counts(counts: np.ndarray, path: str | Path) -> None:
    """Write ``counts[machine, class]`` (:func:`class_counts`) to ``path`` as CSV.

    A header ``machine,class,count``, then one row per machine and class, zeros included, machine
    by machine. The file is whole or absent (``lit_slowcal.files.atomic_write``).

    Examples
    --------
    >>> import tempfile, pathlib
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "class_counts.csv"
    >>> write_class_counts(np.array([[1, 0], [2, 3]]), path)
    >>> print(path.read_text(), end="")
    machine,class,count
    0,0,1
    0,1,0
    1,0,2
    1,1,3
    """
    c = np.asarray(counts)
    if c.ndim != 2:
        raise ValueError(f"counts must be a 2-D (machines, classes) array, got shape {c.shape}")
    machines, classes = c.shape
    with atomic_write(path) as f:
        f.write("machine,class,count\n")
        f.writelines(f"{k},{j},{int(c[k, j])}\n" for k in range(machines) for j in range(classes))


def plot_class_distribution(
    counts: np.ndarray,
    path: str | Path | None = None,
    *,
    title: str | None = None,
) -> Figure:
    """Scatter the class counts per machine, as in the paper's appendix figure.

    One dot per nonzero ``counts[m, c]`` at (machine ``m``, class ``c``); the dot's area is
    proportional to the count, the largest count getting the largest dot that still fits the
    grid. The figure is drawn with the Agg canvas and never touches pyplot's global state.

    Parameters
    ----------
    counts : array_like of int, shape (M, C)
        Output of :func:`class_counts`.
    path : str or Path, optional
        Where to save a PNG (120 dpi); parent folders are created.
    title : str, optional
        Defaults to ``"Class distribution across M machines"``; e.g. pass
        ``f"Class distribution across {M} machines (Dirichlet alpha={alpha})"``.

    Returns
    -------
    matplotlib.figure.Figure

    Examples
    --------
    >>> fig = plot_class_distribution([[5, 0], [1, 3]])
    >>> len(fig.axes[0].collections[0].get_offsets())
    3
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    c = _check_counts(counts)
    m, num_classes = c.shape
    machine, cls = np.nonzero(c)
    values = c[machine, cls].astype(np.float64)

    width, height = min(max(4.0 + 0.12 * m, 8.0), 14.0), 4.5
    fig = Figure(figsize=(width, height))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    # Largest dot's diameter in points: 90% of the class spacing, or 1.5 machine spacings when
    # machines are denser (neighbouring big dots rarely share a class, so overlap is rare).
    dx, dy = 0.8 * width * 72 / m, 0.75 * height * 72 / num_classes
    max_area = max(min(1.5 * dx, 0.9 * dy), 2.0) ** 2
    top = values.max() if values.size else 1.0
    ax.scatter(
        machine,
        cls,
        s=max_area * values / top,
        c=cls,
        cmap="tab10" if num_classes <= 10 else "tab20",
        vmin=0,
        vmax=max(num_classes - 1, 1),
        alpha=0.8,
        edgecolors="none",
    )
    ax.set_xlim(-0.75, m - 0.25)
    ax.set_ylim(-0.75, num_classes - 0.25)
    ax.set_yticks(np.arange(num_classes))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("Machine")
    ax.set_ylabel("Class")
    ax.set_title(title if title is not None else f"Class distribution across {m} machines")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    if path is not None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, format="png", dpi=120)
    return fig


def _check_counts(counts: np.ndarray) -> np.ndarray:
    """``counts`` as a non-empty, non-negative 2-D (machines, classes) array."""
    c = np.asarray(counts)
    if c.ndim != 2 or c.size == 0:
        raise ValueError(f"counts must be a non-empty 2-D (machines, classes) array, got shape {c.shape}")
    if (c < 0).any():
        raise ValueError("counts must be non-negative")
    return c
