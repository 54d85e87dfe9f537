"""The base of every method schema, and the registry of tasks and their methods."""

from __future__ import annotations

import dataclasses

from runner.checks import check_literals

# The registry, filled by `register_task` (each task's config module, runner/configs/<task>.py, at import):
# task name -> its entry; and two views of its methods, task -> {method -> schema}, method -> schema.
TASKS: dict[str, TaskEntry] = {}
TASK_METHODS: dict[str, dict[str, type]] = {}
METHODS: dict[str, type] = {}


@dataclasses.dataclass(frozen=True)
class TaskEntry:
    """What the runner knows of a task and its methods, registered once (`register_task`) and read by
    the CLI's presets, `runner-eval`, `make bench-gpu` and the parametrized tests.

    - `module`: the dotted path of the module defining its `TASK` (a `runner.task.Task`).
    - `methods`: its methods' schemas by name; each is the base of `conf/method/<name>.yaml`.
    - `presets`: each preset of the task (conf/experiment/NAME.yaml) -> the methods it serves, named: the
      presets `+method=NAME` may get (on the dataset a preset chooses), declared here, never inferred.
    - `main_presets`: dataset -> the preset `+method=NAME` applies where several presets serving it choose
      that dataset (None: the default dataset, none named on the command line).
    - `evaluable`: `runner-eval` re-evaluates its runs' checkpoints on other evaluation splits.
    - `bench_presets`, `bench_baseline`, `bench_target`: its rows in `make bench-gpu`, the overrides that
      turn a row into its baseline, and its target: ("step", bound on the step time over the baseline's)
      or ("allocation", bound on the method's solver time as a share of the epoch's training).
    """

    name: str
    module: str
    methods: dict[str, type]
    presets: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    main_presets: dict[str | None, str] = dataclasses.field(default_factory=dict)
    evaluable: bool = False
    bench_presets: tuple[str, ...] = ()
    bench_baseline: tuple[str, ...] = ()
    bench_target: tuple[str, float] | None = None


def register_task(entry: TaskEntry) -> TaskEntry:
    """Add `entry` to the registry and store each method's defaults as `schema/method/<name>` in Hydra's
    ConfigStore (plain values: `validate` types them), the base its YAML extends."""
    from hydra.core.config_store import ConfigStore

    strangers = sorted({m for served in entry.presets.values() for m in served} - entry.methods.keys())
    if strangers:
        raise ValueError(f"task {entry.name!r}: its presets serve {', '.join(strangers)}, not its methods")
    clash = sorted(entry.methods.keys() & METHODS.keys() - TASK_METHODS.get(entry.name, {}).keys())
    if clash:
        raise ValueError(f"task {entry.name!r}: method names {', '.join(clash)} are registered already")
    TASKS[entry.name] = entry
    TASK_METHODS[entry.name] = entry.methods
    METHODS.update(entry.methods)
    store = ConfigStore.instance()
    for name, schema in entry.methods.items():
        store.store(group="schema/method", name=name, node=dataclasses.asdict(schema()), provider="runner")
    return entry


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
