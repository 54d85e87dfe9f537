"""The registry of tasks and their methods: each method is one dataclass declared by `register_method`
(its task, hyperparameters, defaults and checks, its hooks factory and the presets it serves), the one
source of every table here and of `schema/method/<name>` in Hydra's ConfigStore, the base that
`conf/method/<name>.yaml` extends; `validate` checks a composed `method` node against it. Each task's
config module here registers its task (`register_task`) and its methods on import, and every module of
this package is imported: a new task's config module is found by its file alone (adding a method:
docs/adding-a-method.md).
"""

from __future__ import annotations

import importlib
import pkgutil

from runner.configs._base import (
    METHOD_ENTRIES,
    METHODS,
    TASK_METHODS,
    TASKS,
    MethodEntry,
    TaskEntry,
    hooks_factory,
    register_method,
    register_task,
)

__all__ = ["METHODS", "METHOD_ENTRIES", "TASK_METHODS", "TASKS", "MethodEntry", "TaskEntry", "hooks_factory",
           "register_method", "register_task"]  # fmt: skip

for _module in pkgutil.iter_modules(__path__):
    if not _module.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_module.name}")
