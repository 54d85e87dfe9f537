"""The task protocol: what the runner calls of a task. Each task module (runner/tasks/<name>.py, or the module
its `runner.configs.TaskEntry` names) defines one `TASK = Task(...)`; `task_of(cfg)` finds it for a job
config."""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable

from runner.checks import ConfigError
from runner.configs import TASKS


def _no_smoke(cfg) -> None:
    """Nothing of the method's own to bound: `+debug=smoke`'s epochs, batches and subsets suffice."""


def _dataset_name(cfg) -> str:
    return cfg.dataset.name


def _config_network(cfg, data):
    from runner.models import build_model

    return build_model(cfg.model, data.input_shape, data.num_classes)


@dataclasses.dataclass(frozen=True)
class Task:
    """A task of the runner: one run of a job config, and what the tools around it need to know.

    - `metric`: the summary key of its headline number and its direction, ("test/acc", "max"); a search
      optimises its validation twin (`runner.schema.objective_key`), a preset may name another (`metric:`).
    - `run(cfg, ctx) -> dict`: train and/or solve for the typed job config `cfg` on `ctx`
      (`runner.hardware.RunContext`); the summary's metrics.
    - `smoke(cfg)`: bound the method's own keys in place under `+debug=smoke` (e.g. fewer solver
      iterations), beyond the epochs, batches and subsets `apply_debug` bounds for every task.
    - `data_name(cfg)`: the data the run reads, for its log line (a task that builds its own sets names them).
    - `network(cfg, data)`: the network a checkpoint of its runs holds, as `runner-eval` rebuilds it.
    """

    name: str
    metric: tuple[str, str]
    run: Callable[..., dict]
    smoke: Callable[..., None] = _no_smoke
    data_name: Callable[..., str] = _dataset_name
    network: Callable = _config_network


def task_of(cfg) -> Task:
    """The task a config runs: its method's `task` (runner.configs.TASKS), or plain classification
    without a method."""
    method = cfg.get("method")
    name = method.get("task", None) if method is not None else "classify"
    if name is None:
        raise ConfigError("method.task is missing; every method config names its task")
    if name not in TASKS:
        raise ConfigError(f"method.task={name!r} is not a task; choices: {', '.join(TASKS)}")
    return task_named(name)


def task_named(name: str) -> Task:
    """The `TASK` of the registered task `name` (its module imported on first use)."""
    return importlib.import_module(TASKS[name].module).TASK
