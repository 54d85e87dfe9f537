"""Structured-config schemas: every key's type, range and choices, checked once before a job starts.

`validate(cfg)` turns a composed config into these dataclasses or raises `ConfigError` with a one-line
message that names the bad key, its value and what is allowed. Datasets and models register their own
subclasses (`register_dataset(..., schema=)`, `MODEL_SCHEMAS`); tasks declare their methods' schemas in
their module attribute `METHODS`.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException


class ConfigError(ValueError):
    """A bad config value; the message is one line meant for the user."""


def check_choice(key: str, value: Any, choices) -> None:
    if value not in choices:
        raise ConfigError(
            f"{key}={value!r} is not a valid choice; choose one of: {', '.join(map(str, choices))}"
        )


def check_range(key: str, value, lo=None, hi=None, lo_open=False, hi_open=False) -> None:
    """Raise unless lo <= value <= hi (strict where `*_open`)."""
    bad = (lo is not None and (value < lo or (lo_open and value == lo))) or (
        hi is not None and (value > hi or (hi_open and value == hi))
    )
    if bad:
        left = "(" if lo_open else "["
        right = ")" if hi_open else "]"
        interval = f"{left}{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}{right}"
        raise ConfigError(f"{key}={value!r} is out of range; must be in {interval}")


@dataclass
class LabelNoiseConfig:
    kind: str = "none"
    rate: float = 0.0

    def __post_init__(self):
        check_choice("dataset.label_noise.kind", self.kind, ("none", "symmetric", "asymmetric"))
        check_range("dataset.label_noise.rate", self.rate, 0.0, 1.0)


@dataclass
class DatasetConfig:
    name: str = "digits"
    root: str = "data"
    download: bool = False
    val_fraction: float = 0.1
    test_fraction: float = 0.2
    augment: str = "none"
    label_noise: LabelNoiseConfig = field(default_factory=LabelNoiseConfig)
    imbalance: float = 1.0

    def __post_init__(self):
        check_range("dataset.val_fraction", self.val_fraction, 0.0, 1.0, hi_open=True)
        check_range("dataset.test_fraction", self.test_fraction, 0.0, 1.0, hi_open=True)
        check_choice("dataset.augment", self.augment, ("none", "crop_flip"))
        check_range("dataset.imbalance", self.imbalance, 1.0)


@dataclass
class SyntheticConfig(DatasetConfig):
    num_classes: int = 5
    dim: int = 10
    n_samples: int = 2000
    separation: float = 3.0

    def __post_init__(self):
        super().__post_init__()
        check_range("dataset.num_classes", self.num_classes, 2)
        check_range("dataset.dim", self.dim, 1)
        check_range("dataset.n_samples", self.n_samples, 10)
        check_range("dataset.separation", self.separation, 0.0)


@dataclass
class ModelConfig:
    name: str = "mlp"


@dataclass
class MLPConfig(ModelConfig):
    hidden: list[int] = field(default_factory=lambda: [256, 128])
    dropout: float = 0.0

    def __post_init__(self):
        check_range("model.dropout", self.dropout, 0.0, 1.0, hi_open=True)


@dataclass
class CNNConfig(ModelConfig):
    channels: list[int] = field(default_factory=lambda: [32, 64, 128])

    def __post_init__(self):
        if not self.channels or min(self.channels) < 1:
            raise ConfigError(f"model.channels={self.channels}: must be a non-empty list of positive ints")


MODEL_SCHEMAS: dict[str, type] = {"mlp": MLPConfig, "cnn": CNNConfig}


@dataclass
class HardwareConfig:
    name: str = "cpu"
    device: str = "cpu"
    amp: bool = False
    distributed: bool = False
    deterministic: bool = False
    threads: int = 0

    def __post_init__(self):
        check_choice("hardware.device", self.device, ("cpu", "cuda"))
        check_range("hardware.threads", self.threads, 0)


@dataclass
class LoggerConfig:
    name: str = "wandb"
    mode: str = "offline"
    project: str = "runner"
    entity: str | None = None
    group: str | None = None
    tags: list[str] = field(default_factory=list)

    def __post_init__(self):
        check_choice("logger.name", self.name, ("wandb", "none"))
        check_choice("logger.mode", self.mode, ("offline", "online", "disabled"))


@dataclass
class TrainConfig:
    epochs: int = 30
    batch_size: int = 64
    eval_batch_size: int = 1024
    optimizer: str = "sgd"
    lr: float = 0.1
    momentum: float = 0.9
    nesterov: bool = False
    weight_decay: float = 5e-4
    schedule: str = "cosine"
    milestones: list[int] = field(default_factory=list)
    gamma: float = 0.1
    checkpoint: bool = True
    progress: bool = True

    def __post_init__(self):
        check_range("train.epochs", self.epochs, 0)
        check_range("train.batch_size", self.batch_size, 1)
        check_range("train.eval_batch_size", self.eval_batch_size, 1)
        check_choice("train.optimizer", self.optimizer, ("sgd", "adam"))
        check_range("train.lr", self.lr, 0.0, lo_open=True)
        check_range("train.momentum", self.momentum, 0.0, 1.0, hi_open=True)
        check_range("train.weight_decay", self.weight_decay, 0.0)
        check_choice("train.schedule", self.schedule, ("cosine", "step", "none"))
        check_range("train.gamma", self.gamma, 0.0, 1.0, lo_open=True)


TOP_LEVEL = {
    "dataset": DatasetConfig,
    "model": ModelConfig,
    "hardware": HardwareConfig,
    "logger": LoggerConfig,
    "train": TrainConfig,
}
SCALARS = {"seed": int, "name": str}


def _to_schema(node: DictConfig, schema: type, path: str):
    """Merge `node` into `schema`, returning the dataclass instance; one-line errors."""
    names = [f.name for f in dataclasses.fields(schema)]
    for key in node:
        if key not in names:
            raise ConfigError(f"unknown key {path}.{key}; valid keys: {', '.join(names)}")
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), node))
    except ConfigError:
        raise
    except OmegaConfBaseException as e:
        key = f"{path}.{e.full_key}" if e.full_key else path
        reason = str(e).splitlines()[0]
        raise ConfigError(f"bad value for {key}: {reason}") from None
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{path}: {e}") from None


def task_module(cfg: DictConfig):
    """The task module a config runs: the method's `task`, or plain classification without a method."""
    method = cfg.get("method")
    name = method.get("task", None) if method is not None else "classify"
    if name is None:
        raise ConfigError("method.task is missing; every method config names its task")
    try:
        return importlib.import_module(f"tasks.{name}")
    except ModuleNotFoundError as e:
        if e.name != f"tasks.{name}":
            raise
        raise ConfigError(f"method.task={name!r} has no module tasks/{name}.py") from None


def validate(cfg: DictConfig) -> dict[str, Any]:
    """Check every group of a composed config; return the schema objects by group name."""
    from runner.data import DATASET_SCHEMAS

    checked: dict[str, Any] = {}
    known = set(TOP_LEVEL) | set(SCALARS) | {"method"}
    for key in cfg:
        if key not in known:
            raise ConfigError(f"unknown key {key}; valid top-level keys: {', '.join(sorted(known))}")
    for key, kind in SCALARS.items():
        if key in cfg and not isinstance(cfg[key], kind):
            raise ConfigError(f"{key}={cfg[key]!r} must be of type {kind.__name__}")
    for group, base in TOP_LEVEL.items():
        node = cfg[group]
        if group == "dataset":
            base = DATASET_SCHEMAS.get(node.name, base)
        elif group == "model":
            base = MODEL_SCHEMAS.get(node.name, base)
        checked[group] = _to_schema(node, base, group)
    method = cfg.get("method")
    if method is not None:
        module = task_module(cfg)
        schemas = getattr(module, "METHODS", {})
        name = method.get("name")
        if name not in schemas:
            raise ConfigError(
                f"method.name={name!r} is not a method of task {method.task!r}; choices: {', '.join(schemas)}"
            )
        checked["method"] = _to_schema(method, schemas[name], "method")
    return checked
