"""Structured-config schemas: every key's type, range and choices, checked once before a job starts.

`validate(cfg)` turns a composed config into these dataclasses or raises `ConfigError` with a one-line
message that names the bad key, its value and what is allowed. Datasets and models register their own
subclasses (`DATASET_SCHEMAS`, filled by `runner.data.register_dataset(..., schema=)`; `MODEL_SCHEMAS`);
the methods' schemas are `runner.configs` (one per method, by task). A field typed `Literal[...]` is
checked against its choices (`runner.checks`).
"""

from __future__ import annotations

import dataclasses
import math
import os
import typing
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from runner.checks import (
    ConfigError,
    at_least,
    build,
    check_choice,
    check_lowest,
    check_range,
    field_types,
    omegaconf_type,
)
from runner.metrics import parse_metric

__all__ = [
    "check_choice",
    "check_range",
    "main_metric",
    "objective_key",
]


# Real human label noise (CIFAR-10N / CIFAR-100N): the label sets of the released files, by dataset.
HUMAN_NOISE_VARIANTS = {
    "cifar10": ("aggre_label", "worse_label", "random_label1", "random_label2", "random_label3"),
    "cifar100": ("noisy_label",),
}


@dataclass
class LabelNoiseConfig:
    kind: str = "none"  # none | symmetric | asymmetric | human (CIFAR-N labels read from dataset.root)
    rate: float = 0.0  # symmetric / asymmetric only: a human set has its own rate
    variant: str = ""  # kind=human: which label set of the file

    def __post_init__(self):
        check_choice("dataset.label_noise.kind", self.kind, ("none", "symmetric", "asymmetric", "human"))
        check_range("dataset.label_noise.rate", self.rate, 0.0, 1.0)
        if self.kind == "human":
            variants = [v for vs in HUMAN_NOISE_VARIANTS.values() for v in vs]
            check_choice("dataset.label_noise.variant", self.variant, variants)
            if self.rate != 0:
                raise ConfigError(
                    f"dataset.label_noise.rate={self.rate} does not apply to kind=human (the file's labels "
                    "set the noise); leave it at 0"
                )
        elif self.variant:
            raise ConfigError(
                f"dataset.label_noise.variant={self.variant!r} applies only to kind=human, not {self.kind!r}"
            )


@dataclass
class DatasetConfig:
    name: str = "digits"
    root: str = "data"
    download: bool = False
    val_fraction: float = 0.1
    test_fraction: float = 0.2
    augment: str = "none"  # training augmentation: none | crop_flip | rrc_flip (RandomResizedCrop + flip)
    crop_pad: int = at_least(4, 0)  # crop_flip: zero padding before the random crop
    # file-backed images: the side after resizing/cropping (0: the dataset's default)
    image_size: int = at_least(0, 0)
    # rrc_flip's evaluation view: resize to this side, then crop (0: image_size / 0.875)
    eval_resize: int = at_least(0, 0)
    label_noise: LabelNoiseConfig = field(default_factory=LabelNoiseConfig)
    imbalance: float = at_least(1.0, 1.0)
    # at most this many training samples, a random subset (0: all); +debug=smoke sets it
    max_train: int = at_least(0, 0)
    max_eval: int = at_least(0, 0)  # likewise for each evaluation split
    # > 0: the max_train subset keeps this many of every class, max_eval ones one
    min_per_class: int = at_least(0, 0)
    imagenet_boxes: str = ""  # dataset=imagenet: val box XMLs -> CAM localisation, corruption metrics
    # > 0: each epoch a fresh class-balanced sample of this many training samples (noisy_labels task;
    # DivideMix's Clothing1M protocol); 0: all of them
    epoch_samples: int = at_least(0, 0)
    bad_images: str = "error"  # error | skip: an unreadable image file stops the run, or is replaced

    def __post_init__(self):
        check_range("dataset.val_fraction", self.val_fraction, 0.0, 1.0, hi_open=True)
        check_range("dataset.test_fraction", self.test_fraction, 0.0, 1.0, hi_open=True)
        check_choice("dataset.augment", self.augment, ("none", "crop_flip", "rrc_flip"))
        if self.imagenet_boxes and self.name != "imagenet":  # the key of one option (the others' default)
            raise ConfigError(
                f"unknown key dataset.imagenet_boxes for dataset={self.name}: the val box annotations of "
                "dataset=imagenet"
            )
        check_choice("dataset.bad_images", self.bad_images, ("error", "skip"))
        check_lowest("dataset", self)


@dataclass
class SyntheticConfig(DatasetConfig):
    num_classes: int = at_least(5, 2)
    dim: int = at_least(10, 1)
    n_samples: int = at_least(2000, 10)
    separation: float = at_least(3.0, 0.0)


# The networks with post-activation residual blocks (a batch norm ends each residual branch), where
# `model.zero_init_residual` applies (runner.models.zero_init_residual finds those norms).
POST_ACTIVATION = ("resnet10", "resnet18", "resnet32", "resnet50", "resnext29")


@dataclass
class ModelConfig:
    name: str = "mlp"
    # false: random initialisation; or the path of a local weights file to start from (a state_dict,
    # or a checkpoint with one under 'state_dict' or 'model'); nothing is downloaded
    pretrained: Any = False
    # The last batch norm of each residual block's branch starts at zero, so every block starts as the
    # identity (Goyal et al. 2017; Co-Mixup's ImageNet code): post-activation ResNets only
    zero_init_residual: bool = False

    def __post_init__(self):
        if self.zero_init_residual and self.name not in POST_ACTIVATION:  # checked before any run starts
            raise ConfigError(
                f"model.zero_init_residual=true: model={self.name} has no post-activation residual blocks; "
                f"use it with {', '.join(POST_ACTIVATION)}"
            )
        if self.pretrained == "none":  # random initialisation, chosen knowingly over a preset's "required"
            self.pretrained = False
        if self.pretrained == "required":  # a preset that starts from pretrained weights (csot_clothing1m)
            raise ConfigError(
                "model.pretrained=required: this preset starts from pretrained (ImageNet) weights; give "
                "their file, model.pretrained=/path/to/weights.pth, or train from random weights knowingly "
                "with model.pretrained=none"
            )
        if self.pretrained is False or self.pretrained is None:
            return
        if not isinstance(self.pretrained, str) or not self.pretrained:
            raise ConfigError(
                f"model.pretrained={self.pretrained!r}: must be false or the path of a local weights file"
            )
        problem = _not_weights(self.pretrained)
        if problem:
            raise ConfigError(f"model.pretrained={self.pretrained!r}: {problem}")


# How the files `runner.models.weights.load_weights` reads begin: torch.save's zip archive, its legacy
# pickle (protocol 2+); .safetensors files are known by their name.
_WEIGHTS_MAGIC = (b"PK\x03\x04", b"\x80")


def _not_weights(path: str) -> str | None:
    """Why `path` is no weights file, checked in its first bytes before any job starts; None if it may be."""
    if os.path.isdir(path):
        return "is a folder; give the weights file in it (torch.save's .pt / .pth, or .safetensors)"
    if not os.path.isfile(path):
        return "no such file"
    if path.endswith(".safetensors"):
        return None
    with open(path, "rb") as f:
        head = f.read(4)
    if head.startswith(_WEIGHTS_MAGIC):
        return None
    return f"not a weights file (it starts with {head!r}; torch.save writes a zip archive), nor .safetensors"


@dataclass
class MLPConfig(ModelConfig):
    hidden: list[int] = field(default_factory=lambda: [256, 128])
    dropout: float = 0.0

    def __post_init__(self):
        super().__post_init__()
        check_range("model.dropout", self.dropout, 0.0, 1.0, hi_open=True)


@dataclass
class CNNConfig(ModelConfig):
    channels: list[int] = field(default_factory=lambda: [32, 64, 128])

    def __post_init__(self):
        super().__post_init__()
        if not self.channels or min(self.channels) < 1:
            raise ConfigError(f"model.channels={self.channels}: must be a non-empty list of positive ints")


@dataclass
class CifarResNetConfig(ModelConfig):
    stem_stride: int = 1  # 2: the Tiny-ImageNet (64 px) variant of the Co-Mixup code

    def __post_init__(self):
        super().__post_init__()
        check_choice("model.stem_stride", self.stem_stride, (1, 2))


MODEL_SCHEMAS: dict[str, type] = {
    "mlp": MLPConfig,
    "cnn": CNNConfig,
    **dict.fromkeys(("preactresnet18", "wrn16_8", "resnext29"), CifarResNetConfig),
}


def model_config(node: DictConfig) -> ModelConfig:
    """The checked schema object of a `model` config node, defaults filled in."""
    return to_schema(node, group_schema("model", node.name), "model")


COMPILE_MODES = ("false", "default", "reduce-overhead", "max-autotune")


@dataclass
class HardwareConfig:
    name: str = "cpu"
    device: str = "cpu"
    precision: str = "fp32"  # fp32 | fp16 (autocast + grad scaler) | bf16 (autocast, no scaler)
    channels_last: bool = False
    compile: str = "false"  # false | default | reduce-overhead | max-autotune: torch.compile's mode
    cuda_graph: bool = False  # replay a capturable training step as one CUDA graph
    sync_bn: bool = False  # under DDP: batch norm over the global batch (per-GPU batches below ~16)
    distributed: bool = False
    deterministic: bool = False
    threads: int = 0
    num_workers: int = 0  # DataLoader decoding processes for file-backed datasets (0: in the main process)

    def __post_init__(self):
        check_choice("hardware.device", self.device, ("cpu", "cuda"))
        check_choice("hardware.precision", self.precision, ("fp32", "fp16", "bf16"))
        # YAML's false / true arrive as "False" / "True": off, and torch.compile's default mode
        yaml_bools = {"False": "false", "True": "default", "true": "default"}
        self.compile = yaml_bools.get(self.compile, self.compile)
        check_choice("hardware.compile", self.compile, COMPILE_MODES)
        check_range("hardware.threads", self.threads, 0)
        check_range("hardware.num_workers", self.num_workers, 0)


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


RESUME_MODES = ("auto", "must", "never", "force")


@dataclass
class PhaseConfig:
    """One entry of `train.phases`: `epochs` epochs of training images at side `image_size` (0: the data's
    own) in global batches of `batch_size`, the lr linear from `lr[0]` to `lr[1]` over the phase."""

    epochs: int = 1
    image_size: int = 0
    batch_size: int = 64
    lr: list[float] = field(default_factory=lambda: [0.1, 0.1])


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
    warmup_epochs: int = 0  # linear learning-rate warm-up over these epochs, per step, from lr / (steps + 1)
    cosine_delay: int = 0  # epochs at the initial lr before the cosine (over train.epochs) starts
    milestones: list[int] = field(default_factory=list)
    gamma: float = 0.1
    checkpoint: bool = True
    # Also checkpoint inside an epoch every this many minutes (0: at the end of each epoch only).
    checkpoint_every_minutes: float = 10.0
    # With a checkpoint in the run dir: auto resumes it (none: a fresh start); must resumes it, an
    # error without one; never starts fresh and refuses a run dir holding one (nothing is overwritten);
    # force resumes it even when the config differs from the run dir's config.yaml (see runner/rundir.py).
    resume: str = "auto"
    progress: bool = True  # false: no progress bar and no per-epoch lines (the metrics are still logged)
    # Without a terminal (a pipe, a log file, Slurm), where the bar is off: a line every this many seconds
    # within an epoch (step, loss, images/s, the epoch's estimated end)
    log_every_s: float = 30.0
    # micro-batches per optimizer step (train.batch_size stays the step's batch); auto: the fewest that fit
    # the GPU, probed once at the start (`runner.memory.micro_batches`)
    accumulate: Any = 1
    clip_grad_norm: float = 0.0  # bound on the gradients' total norm (0: off); logs train/grad_norm
    ema: float = 0.0  # decay of an exponential moving average of the weights, evaluated beside them (0: off)
    eval_every: int = 1  # evaluate every this many epochs (and at the last)
    save_top_k: int = 0  # keep the k best epoch-end checkpoints by the validation metric (best.pt)
    early_stop: int = 0  # stop after this many evaluations without improvement of it (0: never)
    # Progressive training, run in order; they cover train.epochs (at least) and set the training batch
    # size, image side and lr (per step, linear within a phase) in place of train.batch_size / lr / schedule.
    phases: list[PhaseConfig] = field(default_factory=list)
    bn_weight_decay: bool = True  # false: no weight decay on normalisation layers' and bias parameters
    ece_bins: int = 15  # equal-width confidence bins of the reported ECE (the Co-Mixup paper: 10)
    # The model a fit ends with and tests: `last` (the last epoch's weights, or a method's own rule) or
    # `best:<metric>` (the weights of the evaluation with the best value of that metric, restored).
    select: str = "last"

    def __post_init__(self):
        check_range("train.epochs", self.epochs, 1)
        check_range("train.batch_size", self.batch_size, 1)
        check_range("train.eval_batch_size", self.eval_batch_size, 1)
        check_choice("train.optimizer", self.optimizer, ("sgd", "adam"))
        check_range("train.lr", self.lr, 0.0, lo_open=True)
        check_range("train.momentum", self.momentum, 0.0, 1.0, hi_open=True)
        check_range("train.weight_decay", self.weight_decay, 0.0)
        check_choice("train.schedule", self.schedule, ("cosine", "step", "none"))
        check_range("train.warmup_epochs", self.warmup_epochs, 0)
        check_range("train.cosine_delay", self.cosine_delay, 0)
        if self.cosine_delay and self.schedule != "cosine":
            raise ConfigError(f"train.cosine_delay={self.cosine_delay} delays a cosine schedule; "
                              f"train.schedule={self.schedule!r}: set train.cosine_delay=0")  # fmt: skip
        check_range("train.gamma", self.gamma, 0.0, 1.0, lo_open=True)
        check_range("train.checkpoint_every_minutes", self.checkpoint_every_minutes, 0.0)
        check_range("train.log_every_s", self.log_every_s, 0.0, lo_open=True)
        check_choice("train.resume", self.resume, RESUME_MODES)
        if self.accumulate != "auto":
            if isinstance(self.accumulate, bool) or not isinstance(self.accumulate, int):
                raise ConfigError(f"train.accumulate={self.accumulate!r}: give a whole number >= 1, or auto")
            check_range("train.accumulate", self.accumulate, 1)
        check_range("train.clip_grad_norm", self.clip_grad_norm, 0.0)
        check_range("train.ema", self.ema, 0.0, 1.0, hi_open=True)
        check_range("train.eval_every", self.eval_every, 1)
        check_range("train.save_top_k", self.save_top_k, 0)
        check_range("train.early_stop", self.early_stop, 0)
        check_range("train.ece_bins", self.ece_bins, 1)
        if self.select != "last" and not (self.select.startswith("best:") and self.select[len("best:") :]):
            choices = "last, best:<metric> (e.g. best:val/acc)"
            raise ConfigError(f"train.select={self.select!r} is not an option; choices: {choices}")
        if self.phases:
            self._check_phases()

    def _check_phases(self) -> None:
        for i, phase in enumerate(self.phases):
            check_range(f"train.phases.{i}.epochs", phase.epochs, 1)
            check_range(f"train.phases.{i}.image_size", phase.image_size, 0)
            check_range(f"train.phases.{i}.batch_size", phase.batch_size, 1)
            if len(phase.lr) != 2 or min(phase.lr) < 0:
                raise ConfigError(f"train.phases.{i}.lr={list(phase.lr)}: must be [start, end], both >= 0")
        covered = sum(phase.epochs for phase in self.phases)
        if covered < self.epochs:  # fewer epochs stop inside the phases (a smoke run, a benchmark)
            raise ConfigError(
                f"train.phases cover {covered} epochs but train.epochs={self.epochs}: make them agree"
            )
        for key, off in (("schedule", "none"), ("warmup_epochs", 0)):
            if getattr(self, key) != off:
                raise ConfigError(
                    f"train.{key}={getattr(self, key)!r} does not combine with train.phases (their lr ramps "
                    f"are the schedule); set train.{key}={off}"
                )


@dataclass
class DebugConfig:
    """`+debug=smoke`: bound a run to `epochs` epochs of `max_batches` batches (see `apply_debug`)."""

    name: str = "smoke"
    epochs: int = at_least(1, 1)
    max_batches: int = at_least(2, 1)
    # On the CPU, for images above CIFAR's 32 px: no batch above `cpu_batch` and no image side above
    # `cpu_side` (phases' too), so that a GPU preset's wiring runs in a minute (1024 images of 224 px ran
    # out of host memory); at any size no evaluation batch above `cpu_batch`
    cpu_batch: int = at_least(64, 1)
    cpu_side: int = at_least(96, 1)
    # Set by `validate` where the preset requires pretrained weights (model.pretrained=required): smoke
    # checks the wiring, which random weights share.
    random_weights: bool = False

    def __post_init__(self):
        check_lowest("debug", self)


@dataclass
class PaperValue:
    """One number of a preset's `paper:` block (metric name -> PaperValue), which runner-report prints
    beside the runs' means: the paper's value on the runner's scale and where the paper gives it."""

    value: float
    table: str


def paper_values(node) -> dict[str, PaperValue]:
    """The checked `paper:` block: a mapping metric name -> {value: float, table: str}."""
    if not isinstance(node, DictConfig):
        raise ConfigError(f"paper={node!r} must be a mapping: metric name -> {{value: float, table: str}}")
    return {str(metric): to_schema(entry, PaperValue, f"paper.{metric}") for metric, entry in node.items()}


# Dataset-specific schemas by dataset name; runner.data fills it as it registers each dataset.
DATASET_SCHEMAS: dict[str, type] = {}

TOP_LEVEL = {
    "dataset": DatasetConfig,
    "model": ModelConfig,
    "hardware": HardwareConfig,
    "logger": LoggerConfig,
    "train": TrainConfig,
}
# The groups whose options have schemas of their own (by option name; other options take the group's).
OPTION_SCHEMAS = {"dataset": DATASET_SCHEMAS, "model": MODEL_SCHEMAS}


def store_schemas() -> None:
    """Store each group's schema defaults in Hydra's ConfigStore, the base its YAML options extend and the
    one place a default is written: `schema/train`, `schema/hardware`, `schema/logger`, `schema/debug`, and
    per group with option schemas `schema/<group>/base` (the group's) and `schema/<group>/<option>` (an
    option's own)."""
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    store.store(group="schema", name="debug", node=dataclasses.asdict(DebugConfig()), provider="runner")
    for group, schema in TOP_LEVEL.items():
        options = OPTION_SCHEMAS.get(group)
        if options is None:
            store.store(group="schema", name=group, node=dataclasses.asdict(schema()), provider="runner")
            continue
        for name, option in {"base": schema, **options}.items():
            node = dataclasses.asdict(option())
            store.store(group=f"schema/{group}", name=name, node=node, provider="runner")
    # Hydra deep-copies its config repository at each compose (`CachingConfigRepository`), and the ConfigStore
    # it holds with it: with these nodes, a quarter of a compose. The store is read only through
    # `ConfigStore.load`, which copies what it returns, so each copy would hold what the one store holds.
    type(store).__deepcopy__ = lambda self, memo: self


# `field(metadata=ALLOW_INF)` marks a float key for which an infinity is meaningful; NaN never is.
ALLOW_INF = {"allow_inf": True}


def _check_finite(node: DictConfig, path: str) -> None:
    """Reject NaN in any float of `node` (nested groups and lists too), and infinities outside ALLOW_INF."""
    schema = OmegaConf.get_type(node)
    fields = dataclasses.fields(schema) if dataclasses.is_dataclass(schema) else ()
    allow_inf = {f.name for f in fields if f.metadata.get("allow_inf")}
    for key in node:
        value, where = node[key], f"{path}.{key}"
        if isinstance(value, DictConfig):
            _check_finite(value, where)
            continue
        for v in value if isinstance(value, ListConfig) else [value]:
            if isinstance(v, float) and not math.isfinite(v) and (math.isnan(v) or key not in allow_inf):
                raise ConfigError(f"{where}={value}: must be a finite number")


def to_schema(node: DictConfig, schema: type, path: str):
    """Merge `node` into `schema`, returning the dataclass instance; one-line errors."""
    if not isinstance(node, DictConfig):
        raise ConfigError(f"{path}={node!r} must be a mapping with keys: {', '.join(field_names(schema))}")
    _check_keys(node, schema, path)
    try:
        merged = OmegaConf.merge(OmegaConf.structured(omegaconf_type(schema)), node)
        _check_finite(merged, path)  # before __post_init__: range checks and derived values see no NaN
        if OmegaConf.get_type(merged) is schema:
            return OmegaConf.to_object(merged)
        return build(schema, OmegaConf.to_container(merged, throw_on_missing=True))
    except ConfigError:
        raise
    except OmegaConfBaseException as e:
        key = f"{path}.{e.full_key}" if e.full_key else path
        reason = str(e).splitlines()[0]
        raise ConfigError(f"bad value for {key}: {reason}") from None
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{path}: {e}") from None


def _check_keys(node: DictConfig, schema: type, path: str) -> None:
    """A one-line error for a key `schema` lacks, in `node` or a node of a nested schema (a phase of
    `train.phases`: `train.phases.0.bogus`), which OmegaConf's merge would name without its place."""
    names = field_names(schema)
    for key in node:
        if key not in names:
            raise ConfigError(f"unknown key {path}.{key}; valid keys: {', '.join(names)}")
        tp, value = field_types(schema)[key], node[key]
        if dataclasses.is_dataclass(tp) and isinstance(value, DictConfig):
            _check_keys(value, tp, f"{path}.{key}")
        elif typing.get_origin(tp) is list and isinstance(value, ListConfig):
            (item,) = typing.get_args(tp)
            for i, entry in enumerate(value):
                if dataclasses.is_dataclass(item) and isinstance(entry, DictConfig):
                    _check_keys(entry, item, f"{path}.{key}.{i}")


def field_names(schema: type) -> list[str]:
    return [f.name for f in dataclasses.fields(schema)]


def group_schema(group: str, name: str | None) -> type:
    """The schema of a top-level group whose node is named `name`: that name's own, else the group's."""
    return OPTION_SCHEMAS.get(group, {}).get(name, TOP_LEVEL[group])


def main_metric(config, task_metric: tuple[str, str]) -> tuple[str, str]:
    """A run's main metric `(key, "max" | "min")`: the config's top-level `metric` ("KEY" or
    "KEY:max|min", a preset's headline number, e.g. Co-Mixup's test/acc_median10), else `task_metric`
    (its task's metric, whose direction also stands where `metric` gives none)."""
    given = config.get("metric")
    if not given:
        return task_metric
    return parse_metric(given, default=task_metric[1])


def objective_key(metric: str) -> str:
    """The validation twin of a task's metric (`test/acc` -> `val/acc`), what a search optimises; an
    unsupervised score as is."""
    return "val/" + metric.removeprefix("test/") if metric.startswith("test/") else metric
