"""The methods' solvers: pure functions (arrays in, arrays out, the equation in each docstring), no Hydra,
files or W&B. One façade in POT's manner:

    from runner.methods import cover, allocate, dbot_cluster, assign_codes, comixup_masks

Its names are the functions each solver module here lists in its `__all__` (a new module's join by
themselves), but a name two modules share or that names a module (`dbot`, `comixup`: the module; its
function is `runner.methods.dbot.dbot`). The modules are imported when the façade is first asked for a
name, so importing `runner.methods` (or one solver module) costs nothing more.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import pkgutil


@functools.cache
def _modules() -> tuple[str, ...]:
    return tuple(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))


@functools.cache
def _module_of() -> dict[str, str]:
    """Each exported name -> its solver module."""
    found: dict[str, list[str]] = {}
    for module in _modules():
        solvers = importlib.import_module(f"{__name__}.{module}")
        for name in solvers.__all__:
            if inspect.isfunction(getattr(solvers, name)) and name not in _modules():
                found.setdefault(name, []).append(module)
    return {name: modules[0] for name, modules in found.items() if len(modules) == 1}


def __getattr__(name: str):
    if name == "__all__":
        return sorted(_module_of())
    if name in _modules() or name not in _module_of():  # a submodule: the import system imports it
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_module_of()[name]}"), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_module_of()])
