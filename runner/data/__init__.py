"""Datasets as in-memory tensors, plus the two training-set corruptions the methods study.

`load_data(cfg, seed)` builds the dataset named `cfg.name` (clean labels), makes its training split
long-tailed when `cfg.imbalance > 1`, then injects label noise when `cfg.label_noise.kind != "none"`.
Everything is deterministic given the seed. What it built is announced in one log line (`describe`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from runner.checks import ConfigError
from runner.schema import DATASET_SCHEMAS, DatasetConfig

log = logging.getLogger(__name__)


@dataclass
class Split:
    """An in-memory split. `x` is float32, or uint8 with `mean`/`std` (then each batch is converted to
    `(x / 255 - mean) / std` on the fly, so a large uint8 set is never expanded to float whole)."""

    x: torch.Tensor  # [N, ...]
    y: torch.Tensor  # int64 [N], the labels a method trains on (noisy when label noise is on)
    y_clean: torch.Tensor  # int64 [N], the true labels
    mean: tuple | None = None
    std: tuple | None = None

    def __len__(self) -> int:
        return len(self.y)

    def subset(self, idx) -> Split:
        idx = torch.as_tensor(idx, dtype=torch.long)
        return Split(self.x[idx], self.y[idx], self.y_clean[idx], self.mean, self.std)

    def decode(self, x: torch.Tensor) -> torch.Tensor:
        """A batch of `x` (already on its device) as float32 network input (mean/std made once per device)."""
        if self.mean is None:
            return x
        from runner.data.files import normalized

        return normalized(x, self.mean, self.std)


@dataclass
class Data:
    train: Split
    val: Split
    test: Split
    num_classes: int
    input_shape: tuple[int, ...]
    meta: dict = field(default_factory=dict)  # e.g. "top5": also report top-5 accuracy
    extra: dict = field(default_factory=dict)  # more evaluation splits by name (WebVision: imagenet_val)

    def eval_splits(self) -> dict:
        """The non-empty evaluation splits by metric prefix: val, test, then the extra ones."""
        splits = {"val": self.val, "test": self.test, **self.extra}
        return {name: split for name, split in splits.items() if len(split)}


Builder = Callable[[DatasetConfig, np.random.Generator], Data]
DATASETS: dict[str, Builder] = {}
# name -> `check(cfg) -> str | None`: why a dataset's files are not where `cfg` reads them, told before
# a run dir is made (`missing_files`)
FILE_CHECKS: dict[str, Callable[[DatasetConfig], str | None]] = {}


def register_dataset(name: str, schema: type | None = None, files: Callable | None = None):
    """Register `fn(cfg, rng) -> Data` under `name`; `schema` validates dataset-specific keys, `files`
    says where the dataset's files are missing (see FILE_CHECKS)."""

    def wrap(fn: Builder) -> Builder:
        DATASETS[name] = fn
        if schema is not None:
            DATASET_SCHEMAS[name] = schema
        if files is not None:
            FILE_CHECKS[name] = files
        return fn

    return wrap


def missing_files(cfg: DatasetConfig) -> str | None:
    """Why the files of the dataset config `cfg` are not there, where its dataset checks them; None if
    they may be (or it downloads or generates them)."""
    check = FILE_CHECKS.get(cfg.name)
    return check(cfg) if check is not None else None


def split_of(x, y) -> Split:
    """A clean split from arrays or tensors."""
    y = torch.as_tensor(np.asarray(y), dtype=torch.long)
    return Split(torch.as_tensor(np.asarray(x), dtype=torch.float32), y, y.clone())


def three_way_split(x, y, val_fraction: float, test_fraction: float, rng: np.random.Generator):
    """Stratified train/val/test splits of arrays (fractions of the whole; a fraction of 0 leaves its
    split empty)."""
    from sklearn.model_selection import train_test_split

    if val_fraction + test_fraction >= 1:
        raise ConfigError(
            f"dataset.val_fraction={val_fraction} + dataset.test_fraction={test_fraction} leaves no "
            "training data; their sum must be < 1"
        )
    seed = int(rng.integers(2**31))

    def hold_out(idx, share):  # (kept, held out)
        if share == 0:
            return idx, idx[:0]
        return train_test_split(idx, test_size=share, stratify=y[idx], random_state=seed)

    rest, test = hold_out(np.arange(len(y)), test_fraction)
    train, val = hold_out(rest, val_fraction / (1.0 - test_fraction))
    return tuple(split_of(x[i], y[i]) for i in (train, val, test))


def longtail_counts(n_max: int, num_classes: int, imbalance: float) -> list[int]:
    """Per-class sizes n_c = floor(n_max * imbalance^(-c / (C - 1))), c = 0..C-1 (CIFAR-LT profile)."""
    if num_classes < 2:
        raise ValueError(f"num_classes={num_classes}: a long-tail profile needs at least 2 classes")
    if imbalance < 1:
        raise ValueError(f"imbalance={imbalance}: must be >= 1 (n_max / n_min)")
    return [int(n_max * imbalance ** (-c / (num_classes - 1))) for c in range(num_classes)]


def longtail_indices(y: np.ndarray, num_classes: int, imbalance: float, rng: np.random.Generator):
    """Indices of a long-tailed subset: the first n_c of a shuffled class c, n_max = smallest class."""
    per_class = [rng.permutation(np.flatnonzero(y == c)) for c in range(num_classes)]
    counts = longtail_counts(min(len(p) for p in per_class), num_classes, imbalance)
    return np.sort(np.concatenate([p[:n] for p, n in zip(per_class, counts)]))


def next_class_map(num_classes: int, groups=None) -> np.ndarray:
    """Asymmetric noise mapping: c -> c + 1 (mod C), used where no class-pair mapping is standard; with
    `groups` (class -> group id), c -> the next class of its own group in index order, circularly (the
    CIFAR-100 super-class map of Patrini et al. 2017)."""
    if groups is None:
        return (np.arange(num_classes) + 1) % num_classes
    groups = np.asarray(groups)
    mapping = np.empty(num_classes, dtype=np.int64)
    for g in np.unique(groups):
        members = np.flatnonzero(groups == g)
        mapping[members] = np.roll(members, -1)
    return mapping


def inject_label_noise(y, num_classes: int, kind: str, rate: float, rng: np.random.Generator, mapping=None):
    """Noisy copy of labels `y` (DivideMix convention).

    floor(rate * N) indices are drawn without replacement. `symmetric`: each gets a label drawn
    uniformly from all C classes (so it may keep its true label). `asymmetric`: each gets
    `mapping[y]` (default: the next class).
    """
    y = np.asarray(y).copy()
    if kind == "none" or rate == 0:
        return y
    if not 0 <= rate <= 1:
        raise ValueError(f"label noise rate={rate}: must be in [0, 1]")
    idx = rng.choice(len(y), size=int(np.floor(rate * len(y))), replace=False)
    if kind == "symmetric":
        y[idx] = rng.integers(0, num_classes, size=len(idx))
    elif kind == "asymmetric":
        mapping = next_class_map(num_classes) if mapping is None else np.asarray(mapping)
        y[idx] = mapping[y[idx]]
    else:
        raise ValueError(f"label noise kind={kind!r}: choose one of none, symmetric, asymmetric")
    return y


def natural_side(cfg) -> int:
    """The image side a dataset config's images come at: `image_size`, else the dataset's default (a
    generated dataset's real one); 0 for an in-memory dataset at its own."""
    from runner.data.fake import SHAPES
    from runner.data.layouts import DEFAULT_SIZE

    if cfg.image_size:
        return cfg.image_size
    return SHAPES[cfg.like][1] if cfg.name == "fake" else DEFAULT_SIZE.get(cfg.name, 0)


def load_data(cfg, seed: int) -> Data:
    """Build dataset `cfg.name`, then apply `cfg.imbalance` and `cfg.label_noise` to its train split."""
    if cfg.name not in DATASETS:
        raise ConfigError(f"dataset.name={cfg.name!r} is unknown; choices: {', '.join(sorted(DATASETS))}")
    rng = np.random.default_rng(seed)
    data = DATASETS[cfg.name](cfg, rng)
    if cfg.imbalance > 1:
        keep = longtail_indices(data.train.y_clean.numpy(), data.num_classes, cfg.imbalance, rng)
        data.train = data.train.subset(keep)
    noise = cfg.label_noise
    if noise.kind == "human":  # the builder has read the human labels into data.train.y
        if "human_noise" not in data.meta:
            raise ConfigError(
                f"dataset.label_noise.kind=human: dataset.name={cfg.name!r} has no human labels; "
                "choose cifar10 or cifar100 (CIFAR-10N / CIFAR-100N)"
            )
    elif noise.kind != "none":
        noisy = inject_label_noise(
            data.train.y_clean.numpy(),
            data.num_classes,
            noise.kind,
            noise.rate,
            rng,
            data.meta.get("asym_map"),
        )
        data.train.y = torch.as_tensor(noisy, dtype=torch.long)
    data.meta.setdefault("crop_pad", cfg.crop_pad)
    data = limit_splits(data, cfg.max_train, cfg.max_eval, rng, cfg.min_per_class)
    log.info("%s", describe(data, cfg.name))
    return data


def describe(data: Data, name: str) -> str:
    """The one line that announces a dataset's splits, the same for every dataset, e.g.
    `data: imagefolder, 3 classes, 136 train / 37 val / 37 test images (4 non-image files ignored)`
    (extra splits after test; "samples" for data that are not images; the parenthesis only when a
    file-backed layout ignored files)."""
    splits = {"train": data.train, "val": data.val, "test": data.test, **data.extra}
    sizes = " / ".join(f"{len(split)} {split_name}" for split_name, split in splits.items())
    noun = "images" if len(data.input_shape) == 3 else "samples"
    ignored = data.meta.get("ignored_files", 0)
    note = f" ({ignored} non-image file{'s' * (ignored != 1)} ignored)" if ignored else ""
    return f"data: {name}, {data.num_classes} classes, {sizes} {noun}{note}"


def limit_splits(
    data: Data, max_train: int, max_eval: int, rng: np.random.Generator, min_per_class: int = 0
) -> Data:
    """Random subsets of at most `max_train` training and `max_eval` samples per evaluation split
    (0: all), taken after noise and imbalance so a smoke run sees the real corruption. With
    `min_per_class` > 0 the training subset keeps that many samples of every class (all of a smaller
    class) and each evaluation subset one, beyond their bounds if need be: a task that needs every
    class, or pairs of a class, sets it for a smoke run."""

    def cut(name, split, most, per_class):
        if not most or len(split) <= most:
            return split
        # random samples of every class first (one of each of the lowest classes as far as `most`
        # allows, without `min_per_class`), so that no class goes missing
        order = rng.permutation(len(split))
        shuffled = split.y.numpy()[order]
        by_class = np.argsort(shuffled, kind="stable")
        rank = np.arange(len(order)) - np.searchsorted(shuffled[by_class], shuffled[by_class])
        firsts = order[by_class[rank < max(per_class, 1)]]
        firsts = firsts if per_class else firsts[:most]
        rest = np.setdiff1d(order, firsts, assume_unique=True)
        keep = np.sort(np.r_[firsts, rng.permutation(rest)[: max(most - len(firsts), 0)]])
        boxes = data.meta.get("boxes", {})
        if name in boxes:  # per-sample object boxes (digits_canvas) follow their images
            boxes[name] = boxes[name][keep]
        return split.subset(keep)

    per_eval = min(min_per_class, 1)
    data.train = cut("train", data.train, max_train, min_per_class)
    data.val, data.test = cut("val", data.val, max_eval, per_eval), cut("test", data.test, max_eval, per_eval)
    data.extra = {name: cut(name, split, max_eval, per_eval) for name, split in data.extra.items()}
    return data


import runner.data.blobs  # noqa: E402,F401  (registers `blobs`, DB-OT clustering)
import runner.data.canvas  # noqa: E402,F401  (registers `digits_canvas`, Co-Mixup)
import runner.data.fake  # noqa: E402,F401  (registers `fake`: generated images of a real shape)
import runner.data.imagenet32  # noqa: E402,F401  (registers `imagenet32`, hierarchical hashing)
import runner.data.imagenet_split  # noqa: E402,F401  (registers `imagenetsplit`, hierarchical hashing)
import runner.data.layouts  # noqa: E402,F401  (registers the file-backed datasets)
import runner.data.synthetic_hier  # noqa: E402,F401  (registers `synthetic_hier`, hierarchical hashing)
from runner.data import builtin  # noqa: E402,F401  (registers the datasets)
