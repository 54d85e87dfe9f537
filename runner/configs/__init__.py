"""The registry of tasks and their methods (`TaskEntry`, `register_task`): one dataclass per method,
with its task, hyperparameters, defaults and checks, the one source of them, stored as
`schema/method/<name>` in Hydra's ConfigStore, the base that `conf/method/<name>.yaml` extends;
`validate` checks a composed `method` node against it. Each task's config module registers its entry
on import (adding a method: docs/adding-a-method.md).
"""

from __future__ import annotations

from runner.configs import classify, clustering, covering, hashing, longtail, noisy_labels  # noqa: F401
from runner.configs._base import METHODS, TASK_METHODS, TASKS, TaskEntry, register_task

__all__ = ["METHODS", "TASK_METHODS", "TASKS", "TaskEntry", "register_task"]
