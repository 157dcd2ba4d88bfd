"""The package's layers: ``import lit_slowcal`` loads no experiment dependency, no core module imports the
app, the app's rooms point one way, and there are no import cycles."""

import subprocess
import sys

from helpers import REPO, subprocess_env


def test_import_lit_slowcal_loads_no_experiment_dependency():
    # Not even Lightning (which loads torchmetrics, and through it torchvision and matplotlib where
    # installed): the Lightning pieces load on first use.
    code = (
        "import sys, lit_slowcal\n"
        "print(sorted(m for m in ('wandb', 'matplotlib', 'torchvision', 'jsonargparse', 'torchmetrics', 'yaml',"
        " 'lightning', 'lit_slowcal.experiments') if m in sys.modules))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], env=subprocess_env(), capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]"


def _import_graph() -> dict[str, set[str]]:
    """Every module of the package -> the package's modules it imports (at the top or in a function)."""
    import ast

    package = REPO / "lit_slowcal"
    modules = {
        ".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__") for p in package.rglob("*.py")
    }
    graph = {}
    for path in package.rglob("*.py"):
        module = ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                deps.add(node.module)
                deps.update(f"{node.module}.{a.name}" for a in node.names)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
        graph[module] = deps & modules
    return graph


def test_no_core_module_imports_the_app_and_there_are_no_cycles():
    graph = _import_graph()
    core = [m for m in graph if not m.startswith("lit_slowcal.experiments") and m != "lit_slowcal.__main__"]
    wrong = {m: sorted(d for d in graph[m] if d.startswith("lit_slowcal.experiments")) for m in core}
    assert not any(wrong.values()), f"core modules import the app: {wrong}"

    def visit(m, stack):
        if m in stack:
            raise AssertionError(f"import cycle: {' -> '.join(stack[stack.index(m) :] + [m])}")
        for d in graph.get(m, ()):
            if d != "lit_slowcal" and not m.startswith(d + "."):  # a module importing its own package
                visit(d, stack + [m])

    for m in graph:
        visit(m, [])


# The app's rooms (lit_slowcal/experiments/), from the ground up: a room imports only rooms below it.
# ``problems`` is the problems' former import path (experiments/problems.py), kept for old config files.
ROOMS = ["_lightning", "print_once", "train", "data", "measure", "run", "sweep", "analysis", "problems", "main"]


def test_the_apps_rooms_point_one_way():
    def room(module: str) -> str:
        return module.removeprefix("lit_slowcal.experiments.").split(".")[0]

    graph = _import_graph()
    app = [m for m in graph if m.startswith("lit_slowcal.experiments.")]
    assert {room(m) for m in app} == set(ROOMS), "a room was added or renamed: place it in ROOMS"
    upward = sorted(
        f"{m} -> {d}"
        for m in app
        for d in graph[m]
        if d.startswith("lit_slowcal.experiments.") and ROOMS.index(room(d)) > ROOMS.index(room(m))
    )
    assert not upward, "imports that run up the app's rooms:\n" + "\n".join(upward)
