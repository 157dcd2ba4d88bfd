"""The package's layers: ``import lit_slowcal`` loads no experiment dependency, no core module imports the
app, and there are no import cycles."""

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


def test_no_core_module_imports_the_app_and_there_are_no_cycles():
    import ast

    package = REPO / "lit_slowcal"
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
        graph[module] = {
            d
            for d in deps
            if d
            in {
                ".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
                for p in package.rglob("*.py")
            }
        }
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
