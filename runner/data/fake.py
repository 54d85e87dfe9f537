"""`dataset=fake`: random images of a real dataset's shape (benchmarks, GPU smoke checks without files).
`dataset.like` names the shape: classes, image side and split sizes. They take a file-backed split's path,
uint8 images generated on the fly by DataLoader workers, or with `dataset.in_memory=true` CIFAR's: one
uint8 tensor sliced on the device (`make bench-gpu` takes the real dataset's path); either way
normalised on the device by `decode`.

    runner dataset=fake dataset.like=imagenet model=resnet50 hardware=gpu +debug=smoke
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from runner.checks import check_choice, check_range
from runner.data import Data, Split, register_dataset
from runner.data.files import IMAGENET_STATS, normalized
from runner.schema import DatasetConfig

# like -> (classes, image side, train size, test size) of the real dataset
IN_MEMORY = ("cifar10", "cifar100")  # the real datasets a run holds in memory
SHAPES = {
    "cifar10": (10, 32, 50_000, 10_000),
    "cifar100": (100, 32, 50_000, 10_000),
    "tiny_imagenet": (200, 64, 100_000, 10_000),
    "imagenet": (1000, 224, 1_281_167, 50_000),
}


# A dataset -> the shape that stands in for it, where `dataset=fake` replaces a preset's dataset (CI smoke,
# `runner +experiment=NAME +debug=smoke dataset=fake`); ImageNet32's 1000 classes as CIFAR-100's 100, which
# a smoke run's few batches can hold a sample of each of.
LIKE = {
    "cifar10": "cifar10",
    "cifar100": "cifar100",
    "imagenet32": "cifar100",
    "imagenetsplit": "cifar100",
    "tiny_imagenet": "tiny_imagenet",
    "imagenet": "imagenet",
    "imagenet_lt": "imagenet",
    "webvision": "imagenet",
    "clothing1m": "imagenet",
}


@dataclass
class FakeConfig(DatasetConfig):
    like: str = "cifar100"
    train_size: int = 0  # 0: the real dataset's
    test_size: int = 0
    in_memory: bool = False  # one uint8 tensor sliced on the device, as CIFAR's real splits

    def __post_init__(self):
        super().__post_init__()
        check_choice("dataset.like", self.like, tuple(SHAPES))
        check_range("dataset.train_size", self.train_size, 0)
        check_range("dataset.test_size", self.test_size, 0)


class FakeImages(torch.utils.data.Dataset):
    """Sample i: uniform uint8 pixels from a generator seeded by (seed, id i), so every read is the same."""

    def __init__(self, ids: np.ndarray, shape: tuple[int, ...], seed: int):
        self.ids, self.shape, self.seed = ids, shape, seed

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(self.seed * 10_000_019 + int(self.ids[i]))
        return torch.randint(0, 256, self.shape, generator=g, dtype=torch.uint8), i


class FakeSplit:
    """A split of `len(ids)` generated images with labels id mod classes (read through a DataLoader)."""

    def __init__(self, ids, num_classes: int, shape: tuple[int, ...], seed: int):
        self.ids, self.shape, self.seed = np.asarray(ids), shape, seed
        self.num_classes = num_classes
        self.y = torch.as_tensor(self.ids % num_classes, dtype=torch.long)
        self.y_clean = self.y.clone()

    def __len__(self) -> int:
        return len(self.ids)

    def decode(self, x: torch.Tensor) -> torch.Tensor:
        """A uint8 batch from the workers (already on its device) as normalised float32 network input."""
        return normalized(x, *IMAGENET_STATS)

    def subset(self, idx) -> FakeSplit:
        return FakeSplit(self.ids[np.asarray(idx, dtype=np.int64)], self.num_classes, self.shape, self.seed)

    def dataset(self, train: bool) -> FakeImages:
        return FakeImages(self.ids, self.shape, self.seed)


@register_dataset("fake", schema=FakeConfig)
def fake(cfg, rng) -> Data:
    classes, side, n_train, n_test = SHAPES[cfg.like]
    side = cfg.image_size or side
    n_train, n_test = cfg.train_size or n_train, cfg.test_size or n_test
    seed = int(rng.integers(2**31))
    shape = (3, side, side)
    train = FakeSplit(np.arange(n_train), classes, shape, seed)
    test = FakeSplit(np.arange(n_train, n_train + n_test), classes, shape, seed)
    if cfg.in_memory:
        train, test = _in_memory(train), _in_memory(test)
    return Data(train, test.subset([]), test, classes, shape, meta={"normalize": IMAGENET_STATS})


def _in_memory(split: FakeSplit) -> Split:
    """The split's images generated at once into one uint8 tensor (CIFAR's in-memory layout)."""
    g = torch.Generator().manual_seed(split.seed * 10_000_019 + int(split.ids[0]) if len(split) else 0)
    x = torch.randint(0, 256, (len(split), *split.shape), generator=g, dtype=torch.uint8)
    return Split(x, split.y, split.y_clean, *IMAGENET_STATS)
