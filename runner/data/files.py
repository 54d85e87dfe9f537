"""File-backed splits: a list of (path, label) decoded on the fly by DataLoader workers.

A `FileSplit` holds paths and labels only, so memory does not grow with the dataset; images are decoded
with PIL and transformed with torchvision's `transforms.v2` in `hardware.num_workers` processes when a
loop walks the split (see `runner.train.batches`). It has the same interface as the in-memory `Split`
(`len`, `y`, `y_clean`, `subset`), so tasks and methods never ask which one they hold.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

IMAGENET_STATS = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
AUGMENTS = ("none", "crop_flip", "rrc_flip")


class ImageTransforms(NamedTuple):
    train: object  # PIL image -> float tensor (C, H, W), with random augmentation
    eval: object  # PIL image -> float tensor (C, H, W), deterministic


def image_transforms(augment: str, image_size: int, mean, std, crop_pad: int = 4) -> ImageTransforms:
    """The papers' pipelines at side `image_size`, normalised by `mean`/`std`.

    rrc_flip    train: RandomResizedCrop(size) + flip; eval: resize to size / 0.875, center crop (ImageNet)
    crop_flip   train: resize to size, random crop with `crop_pad` zero padding + flip; eval: resize
    none        train = eval: resize (+ center crop) only
    """
    from torchvision.transforms import v2

    to_tensor = [v2.ToImage(), v2.ToDtype(torch.float32, scale=True), v2.Normalize(mean, std)]
    if augment == "rrc_flip":
        evaluate = v2.Compose(
            [v2.Resize(int(round(image_size / 0.875))), v2.CenterCrop(image_size), *to_tensor]
        )
        train = v2.Compose([v2.RandomResizedCrop(image_size), v2.RandomHorizontalFlip(), *to_tensor])
        return ImageTransforms(train, evaluate)
    resize = [v2.Resize(image_size), v2.CenterCrop(image_size)]
    evaluate = v2.Compose([*resize, *to_tensor])
    if augment == "none":
        return ImageTransforms(evaluate, evaluate)
    train = v2.Compose(
        [*resize, v2.RandomCrop(image_size, padding=crop_pad), v2.RandomHorizontalFlip(), *to_tensor]
    )
    return ImageTransforms(train, evaluate)


def pil_rgb(path) -> object:
    from PIL import Image

    with Image.open(path) as image:
        return image.convert("RGB")


class ImageFiles(torch.utils.data.Dataset):
    """`dataset[i] -> (transform(image i), i)`: the index travels with the sample."""

    def __init__(self, root: Path, paths: np.ndarray, transform):
        self.root, self.paths, self.transform = root, paths, transform

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int):
        return self.transform(pil_rgb(self.root / self.paths[i].decode())), i


class FileSplit:
    """Images named by `paths` (relative to `root`) with labels `y` (noisy where label noise is on) and
    `y_clean` (the true labels; `y` where unknown)."""

    def __init__(self, root, paths, y, y_clean=None, *, transforms: ImageTransforms):
        self.root = Path(root)
        # A numpy bytes array, not a list of str: forked workers share it without copy-on-read, at one
        # byte per character (ImageNet's 1.28M paths: ~50 MB per process).
        encoded = isinstance(paths, np.ndarray) and paths.dtype.kind == "S"
        self.encoded_paths = paths if encoded else np.char.encode(np.asarray(paths, dtype=str), "utf-8")
        self.y = torch.as_tensor(np.asarray(y), dtype=torch.long)
        self.y_clean = (
            self.y.clone() if y_clean is None else torch.as_tensor(np.asarray(y_clean), dtype=torch.long)
        )
        self.transforms = transforms

    def __len__(self) -> int:
        return len(self.y)

    @property
    def paths(self) -> list[str]:
        return [p.decode() for p in self.encoded_paths]

    def subset(self, idx) -> FileSplit:
        idx = np.asarray(torch.as_tensor(idx, dtype=torch.long))
        return FileSplit(
            self.root, self.encoded_paths[idx], self.y[idx], self.y_clean[idx], transforms=self.transforms
        )

    def dataset(self, train: bool) -> ImageFiles:
        return ImageFiles(
            self.root, self.encoded_paths, self.transforms.train if train else self.transforms.eval
        )
