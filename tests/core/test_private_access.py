"""No module of the package reads another module's private names: found by scanning every module's AST.

An attribute ``E._name`` (one leading underscore) is a private read unless ``E`` is ``self``, ``cls`` or
``super()``, or ``_name`` is defined in the same module (a method, a class attribute or a ``self._name``
assignment of one of its classes). Two kinds of torch names are allowed, as torch.optim itself uses them:
the multi-tensor ``torch._foreach_*`` kernels and ``Optimizer._group_tensors_by_device_and_dtype``.
Private Lightning names live in ``lit_slowcal/experiments/_lightning.py`` (``tests/experiments/test_lightning.py`` checks those).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "lit_slowcal"
TORCH_ALLOWED = {"_group_tensors_by_device_and_dtype"}


def _defined_here(tree: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return names


def private_reads(source: str) -> list[tuple[int, str]]:
    """(line, expression) of every read of another module's private name in ``source``."""
    tree = ast.parse(source)
    own = _defined_here(tree)
    out = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
            continue
        value = node.value
        if isinstance(value, ast.Name) and value.id in ("self", "cls"):
            continue
        if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "super":
            continue
        if node.attr in own:
            continue
        if (
            isinstance(value, ast.Name) and value.id == "torch" and node.attr.startswith("_foreach_")
        ) or node.attr in TORCH_ALLOWED:
            continue
        out.append((node.lineno, ast.unparse(node)))
    return out


def test_the_scan_finds_a_read_of_another_objects_private_name_and_spares_ones_own():
    source = (
        "class A:\n"
        "    def __init__(self):\n"
        "        self._mine = 1\n"
        "    def f(self, other, data):\n"
        "        return self._mine + other._mine + data._train + torch._foreach_add(x, y)\n"
    )
    assert private_reads(source) == [(5, "data._train")]


def test_no_module_reads_another_modules_private_names():
    found = {
        f"{path.relative_to(PACKAGE.parent)}:{line} {expr}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path != PACKAGE / "experiments" / "_lightning.py"
        for line, expr in private_reads(path.read_text())
    }
    assert not found, "private names read across modules (make them public, or move the code): " + ", ".join(
        sorted(found)
    )
