"""The registry of tasks and their methods (`TaskEntry`, `register_task`): one dataclass per method,
with its task, hyperparameters, defaults and checks, the one source of them, stored as
`schema/method/<name>` in Hydra's ConfigStore, the base that `conf/method/<name>.yaml` extends;
`validate` checks a composed `method` node against it. Each task's config module here registers its
entry on import, and every module of this package is imported: a new task's config module is found by
its file alone (adding a method: docs/adding-a-method.md).
"""

from __future__ import annotations

import importlib
import pkgutil

from runner.configs._base import METHODS, TASK_METHODS, TASKS, TaskEntry, register_task

__all__ = ["METHODS", "TASK_METHODS", "TASKS", "TaskEntry", "register_task"]

for _module in pkgutil.iter_modules(__path__):
    if not _module.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_module.name}")
