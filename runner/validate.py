"""`validate`: a composed config checked against the schemas (`runner.schema`) before a job starts, into
the schema objects of its groups, or a `ConfigError` with one line naming the bad key, its value and what
is allowed; `to_node`, a checked object as a typed node again; `option_keys`, what a group's option takes."""

from __future__ import annotations

import dataclasses
from typing import Any

from omegaconf import DictConfig, OmegaConf

from runner.checks import ConfigError, check_choice, check_range, omegaconf_type
from runner.configs import TASK_METHODS
from runner.metrics import MONITORED, parse_metric
from runner.schema import (
    TOP_LEVEL,
    DebugConfig,
    TrainConfig,
    field_names,
    group_schema,
    main_metric,
    paper_values,
    to_schema,
)

# Optional top-level keys and their checks: a method (`+method=NAME`), `+debug=smoke`, a preset's numbers.
OPTIONAL = ("method", "debug", "paper", "per_method")
# Top-level scalars: their type and, for numbers, their range (numpy takes seeds in [0, 2**32 - 1]).
SCALARS = {"seed": (int, 0, 2**32 - 1), "name": (str,), "metric": (str,), "print_config": (bool,)}


def to_node(obj) -> DictConfig:
    """A checked schema object as a typed DictConfig: `OmegaConf.structured(obj)`, through the object's
    `Literal`-free twin (`omegaconf_type`) where it has `Literal` fields (OmegaConf knows none)."""
    twin = omegaconf_type(type(obj))
    if twin is type(obj):
        return OmegaConf.structured(obj)
    return OmegaConf.merge(OmegaConf.structured(twin), dataclasses.asdict(obj))


def option_keys(group: str, name: str | None) -> list[str]:
    """The keys a top-level group's node named `name` (`model.name`: mlp, cnn, ...) may hold."""
    return field_names(group_schema(group, name))


def _with_preset_settings(method: DictConfig, per_method, schemas: dict) -> DictConfig:
    """`method` with a family preset's settings for it: `per_method: {NAME: {key: value}}` (e.g. Co-Mixup's
    ImageNet partition, which the ERM row of the same preset has no key for) sets each key the run leaves
    at its schema default; a value given on the command line (another than the default) wins."""
    if per_method is None:
        return method
    if not isinstance(per_method, DictConfig) or any(name not in schemas for name in per_method):
        raise ConfigError(
            f"per_method={per_method!r} must map method names ({', '.join(schemas)}) to their settings"
        )
    settings = per_method.get(method.name)
    if settings is None:
        return method
    default = schemas[method.name]()
    kept = {key: value for key, value in settings.items() if method.get(key) == getattr(default, key, None)}
    return OmegaConf.merge(method, kept)


def _check_monitor(train: TrainConfig, metric: str | None) -> None:
    """Refuse early stopping or top-k checkpoints beside a run `metric` they would not follow."""
    watched = [
        f"train.{key}={getattr(train, key)}" for key in ("early_stop", "save_top_k") if getattr(train, key)
    ]
    if not metric or not watched:
        return
    key = parse_metric(metric)[0]
    if key.removeprefix("test/").removeprefix("val/") != MONITORED.removeprefix("val/"):
        raise ConfigError(
            f"{' and '.join(watched)} follow {MONITORED}, not metric={metric}; leave metric unset or "
            f"set it to test/acc, or turn them off (train.early_stop=0 train.save_top_k=0)"
        )


def _check_phase_sides(train: TrainConfig, model) -> None:
    """A network that flattens its input (model=mlp) takes one image size: no phase may resize."""
    if model.name != "mlp":
        return
    for i, phase in enumerate(train.phases):
        if phase.image_size:
            raise ConfigError(
                f"train.phases.{i}.image_size={phase.image_size}: model=mlp takes the data's own image "
                f"size only; set it to 0, or choose a convolutional model (model=cnn)"
            )


def validate(cfg: DictConfig, reuse: dict[str, Any] | None = None) -> dict[str, Any]:
    """Check every group of a composed config; return the schema objects by group name. `reuse`: groups
    already checked in a config of the same values (a sweep's first job, for the others)."""
    reuse = reuse or {}
    checked: dict[str, Any] = {}
    known = set(TOP_LEVEL) | set(SCALARS) | set(OPTIONAL)
    for key in cfg:
        if key not in known:
            raise ConfigError(f"unknown key {key}; valid top-level keys: {', '.join(sorted(known))}")
    for key, (kind, *bounds) in SCALARS.items():
        if key in cfg and (
            not isinstance(cfg[key], kind) or (isinstance(cfg[key], bool) and kind is not bool)
        ):
            raise ConfigError(f"{key}={cfg[key]!r} must be of type {kind.__name__}")
        if key in cfg and bounds:
            check_range(key, cfg[key], *bounds)
    if cfg.get("metric"):
        main_metric(cfg, ("", "max"))  # a bad direction
        checked["metric"] = cfg.metric
    random_weights = cfg.get("debug") is not None and OmegaConf.select(cfg, "model.pretrained") == "required"
    if random_weights:  # smoke checks a preset's wiring: random weights have the pretrained ones' shapes
        cfg = OmegaConf.merge(cfg, {"model": {"pretrained": "none"}})
    for group in TOP_LEVEL:
        if group in reuse:
            checked[group] = reuse[group]
            continue
        node = cfg[group]
        name = node.get("name") if isinstance(node, DictConfig) else None
        checked[group] = to_schema(node, group_schema(group, name), group)
    method = cfg.get("method")
    if method is not None:
        task = method.get("task") if isinstance(method, DictConfig) else None
        if task is None:
            raise ConfigError("method.task is missing; every method config names its task")
        check_choice("method.task", task, TASK_METHODS)
        schemas = TASK_METHODS[task]
        name = method.get("name")
        if name not in schemas:
            raise ConfigError(
                f"method.name={name!r} is not a method of task {task!r}; choices: {', '.join(schemas)}"
            )
        method = _with_preset_settings(method, cfg.get("per_method"), schemas)
        checked["method"] = reuse.get("method") or to_schema(method, schemas[name], "method")
    _check_monitor(checked["train"], cfg.get("metric"))
    _check_phase_sides(checked["train"], checked["model"])
    epoch_samples = checked["dataset"].epoch_samples
    if epoch_samples and getattr(checked.get("method"), "task", None) != "noisy_labels":
        raise ConfigError(
            f"dataset.epoch_samples={epoch_samples}: only the noisy_labels task draws a sample per epoch; "
            "set it to 0 (dataset.max_train: one fixed random subset)"
        )
    if cfg.get("debug") is not None:
        checked["debug"] = to_schema(cfg.debug, DebugConfig, "debug")
        checked["debug"].random_weights |= random_weights
    if "paper" in cfg:
        checked["paper"] = paper_values(cfg.paper)
    return checked
