"""`imagenet32`: the 32x32 downsampled ImageNet (Chrabaszcz et al. 2017) of the hierarchical-hash paper's
ImageNet tables, in its released pickle format under `dataset.root`:

    Imagenet32_train/train_data_batch_1 ... train_data_batch_10
    Imagenet32_val/val_data

Each file is a dict with `data` (uint8, N x 3072, rows channel-major: 1024 R, 1024 G, 1024 B values) and
`labels` (1..1000). The images stay uint8 in memory (about 3.7 GB for train) and are normalised per batch
with the ImageNet statistics; the val file is the test split, the runner's `val` a random
`dataset.val_fraction` of train (0 by default: empty, and train is then not copied).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from runner.checks import ConfigError
from runner.data import Data, Split, register_dataset
from runner.data.builtin import carve
from runner.data.files import IMAGENET_STATS
from runner.untrusted import RefusedPickle, load_pickle

LAYOUT = "Imagenet32_train/train_data_batch_1..10 and Imagenet32_val/val_data (pickled dicts: data, labels)"
ROW = 3 * 32 * 32


def _load_batch(f: Path) -> dict:
    with open(f, "rb") as fh:
        try:
            return load_pickle(fh, encoding="latin1")
        except RefusedPickle as e:
            raise ConfigError(
                f"{f}: holds a pickled {e}, not an ImageNet32 batch (numpy arrays, lists, dicts, numbers); "
                "not loaded, as unpickling it could run code"
            ) from None


def read_batches(files: list[Path]) -> tuple[torch.Tensor, np.ndarray]:
    """uint8 images (N, 3, 32, 32) and 0-based labels of the pickles `files`, in order. They are filled
    into one buffer sized from the file sizes (a row takes 3072 bytes of its file), so the set is never
    held twice."""
    x = np.empty((sum(f.stat().st_size for f in files) // ROW, ROW), dtype=np.uint8)
    labels, n = [], 0
    for f in files:
        batch = _load_batch(f)
        rows, y = np.asarray(batch["data"], dtype=np.uint8), np.asarray(batch["labels"], dtype=np.int64)
        if rows.ndim != 2 or rows.shape[1] != ROW or len(y) != len(rows) or y.min() < 1 or y.max() > 1000:
            raise ConfigError(f"{f}: expected data uint8 N x {ROW} and N labels in 1..1000, got {rows.shape}")
        x[n : n + len(rows)] = rows
        labels.append(y - 1)
        n += len(rows)
    return torch.from_numpy(x[:n].reshape(n, 3, 32, 32)), np.concatenate(labels)


def uint8_split(x: torch.Tensor, y: np.ndarray) -> Split:
    y = torch.as_tensor(y)
    return Split(x, y, y.clone(), mean=IMAGENET_STATS[0], std=IMAGENET_STATS[1])


def pickle_files(cfg) -> tuple[list[Path], Path]:
    """The released pickles under `cfg.root` (the 10 training batches, the validation file), checked."""
    if cfg.image_size not in (0, 32):
        raise ConfigError(f"dataset.image_size={cfg.image_size}: {cfg.name} images are 32x32; use 0 or 32")
    root = Path(cfg.root).expanduser()
    train_files = [root / "Imagenet32_train" / f"train_data_batch_{i}" for i in range(1, 11)]
    test_file = root / "Imagenet32_val" / "val_data"
    for f in (*train_files, test_file):
        if not f.is_file():
            raise ConfigError(f"dataset.name={cfg.name}: {f.resolve()} not found; expected layout: {LAYOUT}")
    return train_files, test_file


@register_dataset("imagenet32")
def imagenet32(cfg, rng) -> Data:
    train_files, test_file = pickle_files(cfg)
    train, val = carve(uint8_split(*read_batches(train_files)), cfg.val_fraction, rng)
    test = uint8_split(*read_batches([test_file]))
    return Data(train, val, test, num_classes=1000, input_shape=(3, 32, 32))
