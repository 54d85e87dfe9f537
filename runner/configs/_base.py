"""The base of every method schema, and the registry of tasks and their methods."""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable

from runner.checks import check_literals

# The registry. A method is declared once, by `register_method` on its schema (its name, task, hooks and
# the presets it serves); a task by `register_task`. Every table is a view of these two:
# task name -> its entry; method name -> its declaration; task -> {method -> schema}; method -> schema.
TASKS: dict[str, TaskEntry] = {}
METHOD_ENTRIES: dict[str, MethodEntry] = {}
TASK_METHODS: dict[str, dict[str, type]] = {}
METHODS: dict[str, type] = {}


@dataclasses.dataclass(frozen=True)
class MethodEntry:
    """A method as `register_method` declared it.

    - `schema`: its dataclass; its `name` and `task` defaults name it and its task.
    - `hooks`: "module:attribute" of the factory of its `runner.method_hooks.MethodHooks`, called by its
      task with the task's own arguments (`hooks_factory`); imported only when a run builds it (the
      hooks sit floors above the schemas). None: its task builds what it needs.
    - `presets`: the presets (conf/experiment/NAME.yaml) `+method=NAME` may get, on the dataset each
      chooses (`runner.presets.method_preset`), declared here, never inferred.
    """

    schema: type
    hooks: str | None
    presets: tuple[str, ...]

    @property
    def name(self) -> str:
        return self.schema.name

    @property
    def task(self) -> str:
        return self.schema.task


@dataclasses.dataclass(frozen=True)
class TaskEntry:
    """What the runner knows of a task, registered once (`register_task`) and read by the CLI's presets,
    `runner-eval`, `make bench-gpu` and the parametrized tests; its methods and presets are those its
    methods declare (`register_method`).

    - `module`: the dotted path of the module defining its `TASK` (a `runner.task.Task`).
    - `main_presets`: dataset -> the preset `+method=NAME` applies where several presets serving it choose
      that dataset (None: the default dataset, none named on the command line).
    - `evaluable`: `runner-eval` re-evaluates its runs' checkpoints on other evaluation splits.
    - `bench_presets`, `bench_baseline`, `bench_target`: its rows in `make bench-gpu`, the overrides that
      turn a row into its baseline, and its target: ("step", bound on the step time over the baseline's)
      or ("allocation", bound on the method's solver time as a share of the epoch's training).
    """

    name: str
    module: str
    main_presets: dict[str | None, str] = dataclasses.field(default_factory=dict)
    evaluable: bool = False
    bench_presets: tuple[str, ...] = ()
    bench_baseline: tuple[str, ...] = ()
    bench_target: tuple[str, float] | None = None

    @property
    def methods(self) -> dict[str, type]:
        """Its methods' schemas by name; each is the base of `conf/method/<name>.yaml`."""
        return TASK_METHODS.get(self.name, {})

    @property
    def presets(self) -> dict[str, tuple[str, ...]]:
        """Each preset its methods declare -> the methods it serves, in their registration order."""
        served: dict[str, tuple[str, ...]] = {}
        for name in self.methods:
            for preset in METHOD_ENTRIES[name].presets:
                served[preset] = (*served.get(preset, ()), name)
        return served


def register_task(entry: TaskEntry) -> TaskEntry:
    """Add `entry` to the registry; its methods register after it (`register_method`)."""
    if entry.name in TASKS and TASKS[entry.name] != entry:
        raise ValueError(f"task {entry.name!r} is registered already")
    TASKS[entry.name] = entry
    return entry


def register_method(*, hooks: str | None = None, presets: tuple[str, ...] = ()) -> Callable[[type], type]:
    """Declare the method whose schema the decorated dataclass is, the one place a method is written
    (as timm's `register_model`): its name and task (the schema's `name` and `task` defaults), its hooks
    factory (`hooks`, "module:attribute") and the presets it serves. Adds it to `METHODS` and its task's
    methods, and stores its defaults as `schema/method/<name>` in Hydra's ConfigStore (plain values:
    `validate` types them), the base its YAML extends."""

    def register(schema: type) -> type:
        from hydra.core.config_store import ConfigStore

        defaults = schema()
        name, task = defaults.name, defaults.task
        if task not in TASKS:
            raise ValueError(f"method {name!r}: task {task!r} is not registered; choices: {', '.join(TASKS)}")
        if name in METHODS and METHODS[name]().task != task:
            raise ValueError(f"method {name!r} of task {task!r} is registered already")
        METHOD_ENTRIES[name] = MethodEntry(schema, hooks, tuple(presets))
        TASK_METHODS.setdefault(task, {})[name] = schema
        METHODS[name] = schema
        node = dataclasses.asdict(defaults)
        ConfigStore.instance().store(group="schema/method", name=name, node=node, provider="runner")
        return schema

    return register


def hooks_factory(method: str) -> Callable | None:
    """The hooks factory `method` declares (`register_method(hooks=)`), imported now; None: none."""
    where = METHOD_ENTRIES[method].hooks
    if where is None:
        return None
    module, _, attribute = where.partition(":")
    return getattr(importlib.import_module(module), attribute)


class MethodConfig:
    """A method's schema (a dataclass): `name`, `task` and its hyperparameters with their defaults, the
    one source of them (registered as the `method` group's base configs, see `register_task`).
    Choices are typed `Literal[...]`; `__post_init__` checks them (subclasses call super first)."""

    def __post_init__(self):
        check_literals(self, "method")


def variant(cls_name: str, base: type, doc: str, module: str, **defaults) -> type:
    """A subclass of the schema `base` that changes only `defaults` (`name`, `loss`, ...), its fields
    typed as in `base` (so `Literal` choices keep their checks): one line per baseline or ablation."""
    types = {f.name: f.type for f in dataclasses.fields(base)}
    fields = [(key, types[key], dataclasses.field(default=value)) for key, value in defaults.items()]
    cls = dataclasses.make_dataclass(cls_name, fields, bases=(base,), namespace={"__doc__": doc})
    # its string annotations resolve in `module` (Python 3.12's make_dataclass sets the caller's, this one)
    cls.__module__ = module
    return cls
