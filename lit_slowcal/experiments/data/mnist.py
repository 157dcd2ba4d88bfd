"""The MNIST files: checked, decompressed once, read into normalised tensors.

MNIST's four IDX files ship gzip-compressed in ``data/MNIST/raw/``. ``prepare_mnist`` decompresses
them next to themselves (processes starting together take turns under a lock), checks every file's
size, IDX magic number and header, and downloads them with torchvision when they are missing.
``load_mnist`` decodes them once per process into float32 tensors normalised by ``MNIST_MEAN`` and
``MNIST_STD``. A damaged file is refused in one line that names it, what was found and what was
expected.
"""

from __future__ import annotations

import gzip
import shutil
from pathlib import Path

import torch
from torch import Tensor

from lit_slowcal.files import atomic_path, locked

__all__ = ["MNIST_CLASSES", "MNIST_MEAN", "MNIST_STD", "load_mnist", "prepare_mnist"]

MNIST_MEAN, MNIST_STD = 0.1307, 0.3081

# name -> (IDX magic number, decompressed size in bytes)
_MNIST_FILES = {
    "train-images-idx3-ubyte": (2051, 16 + 60000 * 28 * 28),
    "train-labels-idx1-ubyte": (2049, 8 + 60000),
    "t10k-images-idx3-ubyte": (2051, 16 + 10000 * 28 * 28),
    "t10k-labels-idx1-ubyte": (2049, 8 + 10000),
}
MNIST_CLASSES = 10


def _check_idx_file(path: Path, magic: int, size: int) -> None:
    """The file's size, its IDX magic number and its header's dimensions (count, and 28 x 28 for images)."""
    actual = path.stat().st_size
    if actual != size:
        raise ValueError(
            f"Corrupt MNIST file {path}: {actual} bytes, expected {size}. Replace it with the original file."
        )
    dims = 3 if magic == 2051 else 1
    with open(path, "rb") as f:
        header = f.read(4 + 4 * dims)
    found = int.from_bytes(header[:4], "big")
    if found != magic:
        raise ValueError(
            f"Corrupt MNIST file {path}: magic number {found}, expected {magic}. Replace it with the original file."
        )
    shape = [int.from_bytes(header[4 + 4 * i : 8 + 4 * i], "big") for i in range(dims)]
    expected = [(size - 4 - 4 * dims) // (28 * 28 if dims == 3 else 1), *([28, 28] if dims == 3 else [])]
    if shape != expected:
        raise ValueError(
            f"Corrupt MNIST file {path}: its header gives the shape {' x '.join(map(str, shape))}, but its size holds "
            f"{' x '.join(map(str, expected))}. Replace it with the original file."
        )


def _check_labels(labels: Tensor, path: Path) -> None:
    """Every label is a class 0..9; else name the file, the first label outside and where it is."""
    bad = ((labels < 0) | (labels >= MNIST_CLASSES)).nonzero()
    if len(bad):
        i = int(bad[0])
        raise ValueError(
            f"Corrupt MNIST file {path}: label {int(labels[i])} at index {i} ({len(bad)} labels outside 0..{MNIST_CLASSES - 1}). "
            "Replace it with the original file."
        )


def prepare_mnist(root: Path) -> None:
    """Decompress the shipped ``.gz`` files next to them (torchvision reads only decompressed files)
    and check every file's size and magic number. Downloads with torchvision when nothing is there.

    Processes preparing the same folder at once (the ranks of a job, two jobs on a fresh clone)
    take turns under a lock on ``raw/`` (``lit_slowcal.files.locked``): the first decompresses, the
    others find the files done. Each file appears whole (``atomic_path``) or not at all."""
    raw = root / "MNIST" / "raw"
    if not raw.is_dir():
        return _download(root, list(_MNIST_FILES))
    if all((raw / name).exists() for name in _MNIST_FILES):  # prepared: no lock (the folder may be read-only)
        return _decompress_and_check(raw)
    with locked(raw / "prepare"):
        _decompress_and_check(raw)


def _decompress_and_check(raw: Path) -> None:
    missing = []
    for name, (magic, size) in _MNIST_FILES.items():
        path, gz = raw / name, raw / f"{name}.gz"
        if not path.exists() and gz.exists():
            try:
                with gzip.open(gz, "rb") as src, atomic_path(path) as tmp, open(tmp, "wb") as dst:
                    shutil.copyfileobj(src, dst)
            except (OSError, EOFError) as err:
                raise ValueError(f"Corrupt MNIST file {gz}: {err}. Replace it with the original file.") from err
        if path.exists():
            _check_idx_file(path, magic, size)
        else:
            missing.append(name)
    if missing:
        _download(raw.parent.parent, missing)


def _download(root: Path, missing: list[str]) -> None:
    raw = root / "MNIST" / "raw"
    from torchvision.datasets import MNIST

    try:
        MNIST(str(root), train=True, download=True)
        MNIST(str(root), train=False, download=True)
    except Exception as err:  # no network, blocked mirror, ...
        raise FileNotFoundError(
            f"MNIST files {', '.join(missing)} are missing from {raw} and could not be downloaded ({err}). "
            f"Put the four MNIST files (train-images-idx3-ubyte.gz, train-labels-idx1-ubyte.gz, "
            f"t10k-images-idx3-ubyte.gz, t10k-labels-idx1-ubyte.gz) in {raw}, or set data.root to the "
            f"folder that holds MNIST/raw/."
        ) from err


_CACHE: dict[tuple, tuple[Tensor, Tensor, Tensor, Tensor]] = {}


def load_mnist(root: str | Path = "data") -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """MNIST as normalised float32 tensors ``(N, 784)`` and int64 labels: train x, train y, test x, test y.

    Decoded once per process (runs of a sweep share it); the tensors must not be modified.
    """
    from torchvision.datasets import MNIST

    root = Path(root)
    prepare_mnist(root)
    raw = root / "MNIST" / "raw"
    key = (str(root.resolve()), *((raw / n).stat().st_mtime_ns for n in _MNIST_FILES))
    if key in _CACHE:
        return _CACHE[key]
    out = []
    for train in (True, False):
        ds = MNIST(str(root), train=train, download=False)
        _check_labels(ds.targets, raw / ("train-labels-idx1-ubyte" if train else "t10k-labels-idx1-ubyte"))
        x = ds.data.reshape(len(ds.data), -1).to(torch.float32).div_(255.0).sub_(MNIST_MEAN).div_(MNIST_STD)
        out += [x, ds.targets.to(torch.int64)]
    _CACHE.clear()
    _CACHE[key] = (out[0], out[1], out[2], out[3])
    return _CACHE[key]
