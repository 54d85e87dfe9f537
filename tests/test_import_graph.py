"""The house's floors: solvers -> schemas -> data, models, device -> loop -> hooks -> tasks -> sweeper ->
composition -> entry points and tools. Every import (a function's lazy one too) goes down a floor or
stays on its own, and no set of modules imports itself round a circle. Packages whose modules register
into their `__init__` (runner.data, runner.methods, ...) count as one module."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = (
    "runner.data", "runner.methods", "runner.models", "runner.hooks", "runner.configs", "runner.tasks",
)  # fmt: skip
FLOORS = [  # bottom first
    {"runner.checks", "runner.methods", "runner.faults", "runner.untrusted", "runner.plots",
     "runner.augment", "runner.instruments", "runner.interrupts", "runner.losses", "runner.optim",
     "runner.progress"},
    {"runner.configs", "runner.schema", "runner.validate", "runner.metrics"},
    {"runner.data", "runner.models", "runner.hardware"},
    {"runner.train", "runner.batches", "runner.step", "runner.evaluation", "runner.checkpoint",
     "runner.memory", "runner.distributed_passes", "runner.rundir", "runner.canvas_metrics", "runner.task",
     "runner.method_hooks"},
    {"runner.hooks"},
    {"runner.tasks"},  # every task module
    {"runner.sweeper"},  # the Optuna sweeper, whose search-space checks the preflight runs
    {"runner.overrides"},
    {"runner.presets", "runner.smoke"},
    {"runner.compose"},
    {"runner", "runner.cli", "runner.track", "runner.evaluate_run", "runner.data_check", "runner.sync",
     "runner.device_tracking",
     "runner.report", "runner.report.__main__", "runner.report.callback", "runner.report.claims",
     "runner.report.command", "runner.report.plots", "runner.report.render", "runner.report.runs",
     "runner.report.values"},
]  # fmt: skip


def unit(module: str) -> str:
    """The node of the graph a module belongs to: its registering package, runner.tasks, or itself."""
    return next((p for p in PACKAGES if module == p or module.startswith(p + ".")), module)


def modules() -> dict[str, Path]:
    found = {}
    for path in (ROOT / "runner").rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        found[name] = path
    return found


def imported(name: str, path: Path, known: set[str]) -> set[str]:
    """The project's modules that `name` imports anywhere in its file (the longest known prefix)."""
    targets = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package up level - 1
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            subs = {f"{base}.{alias.name}" for alias in node.names} & known
            targets |= subs or {base}
    resolved = set()
    for target in targets:
        while target and target not in known:
            target = target.rpartition(".")[0]
        if target:
            resolved.add(target)
    return resolved


def graph() -> dict[str, set[str]]:
    found = modules()
    edges: dict[str, set[str]] = {}
    for name, path in found.items():
        edges.setdefault(unit(name), set()).update(unit(t) for t in imported(name, path, set(found)))
    return {node: targets - {node} for node, targets in edges.items()}


def floor(node: str) -> int:
    return next(i for i, members in enumerate(FLOORS) if node in members)


def test_every_module_has_a_floor():
    assert sorted(n for n in graph() if not any(n in members for members in FLOORS)) == []


def test_no_import_runs_up_a_floor():
    upward = sorted(
        f"{node} imports {target}" for node, targets in graph().items() for target in targets
        if floor(target) > floor(node)
    )  # fmt: skip
    assert upward == []


def test_no_circle():
    edges, circles, state = graph(), [], {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for target in sorted(edges.get(node, ())):
            if state.get(target) == "open":
                circles.append(" -> ".join(path[path.index(target) :] + [node, target]))
            elif target not in state:
                visit(target, path + [node])
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            visit(node, [])
    assert circles == []


def test_the_graph_sees_lazy_imports(tmp_path):
    """A function's import counts (the old circle ran through one): the checks above can fail."""
    (tmp_path / "m.py").write_text("def f():\n    from runner.cli import main\n")
    assert "runner.cli" in imported("runner.m", tmp_path / "m.py", {"runner.cli", "runner.m"})


def test_the_solvers_facade():
    """`runner.methods` re-exports each solver (POT's `ot` style) without importing a solver module
    before one is asked for."""
    code = (
        "import sys, runner.methods as m; "
        "before = {k for k in sys.modules if k.startswith('runner.methods.')}; "
        "from runner.methods import cover, allocate, dbot_cluster, assign_codes, comixup_masks; "
        "from runner.methods import comixup, pwc; import runner.methods.dbot as dbot; "
        "assert (cover, allocate, comixup_masks) == (pwc.cover, sys.modules['runner.methods.csot'].allocate, "
        "comixup.comixup_masks) and dbot_cluster is dbot.dbot_cluster; "
        "where = m.module_of(m.EXPORTS); "
        "assert all(getattr(m, n).__module__ == 'runner.methods.' + where[n] for n in m.__all__); "
        "assert {'dbot', 'comixup', 'SOLVERS'}.isdisjoint(m.__all__) and len(m.__all__) > 50; "
        "print(sorted(before))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]"


def test_the_facade_lists_every_solver_once():
    """The façade's list is each module's exported functions, no more, no fewer (a new one is listed or
    the test fails), and a name listed under two modules stops the import instead of dropping the name."""
    import importlib
    import inspect
    import pkgutil

    import pytest

    import runner.methods as facade

    modules = {m.name for m in pkgutil.iter_modules(facade.__path__) if not m.name.startswith("_")}
    assert sorted(facade.EXPORTS) == sorted(modules)
    for module, names in facade.EXPORTS.items():
        solvers = importlib.import_module(f"runner.methods.{module}")
        functions = {n for n in solvers.__all__ if inspect.isfunction(getattr(solvers, n))} - modules
        assert sorted(names) == sorted(functions), module
    with pytest.raises(ImportError, match="'cover' is exported by both pwc and csot"):
        facade.module_of({"pwc": ("cover",), "csot": ("allocate", "cover")})
    with pytest.raises(ImportError, match="'dbot' is exported by comixup, and is a module"):
        facade.module_of({"dbot": ("dbot_lp",), "comixup": ("dbot",)})


def test_files_are_named_by_one_rule():
    """Task files carry the task's name (runner/configs/<task>.py registers runner/tasks/<task>.py); method
    files (runner/methods/, runner/hooks/) carry a method's or a family's."""
    from runner.configs import TASKS

    def stems(folder: str) -> set[str]:
        return {p.stem for p in (ROOT / folder).glob("*.py") if not p.stem.startswith("_")}

    assert stems("runner/configs") == stems("runner/tasks") == set(TASKS)
    assert all(entry.module == f"runner.tasks.{name}" for name, entry in TASKS.items())


def test_config_error_is_imported_from_runner_checks_only():
    """`ConfigError` is defined in runner.checks; an import of it through another module (runner.schema
    imports it too) is a second spelling of one name."""
    elsewhere = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module != "runner.checks":
                if any(alias.name == "ConfigError" for alias in node.names):
                    elsewhere.append(f"{name}: from {node.module} import ConfigError")
    assert elsewhere == []
