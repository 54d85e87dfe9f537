"""The built-in datasets: sklearn digits (embedded), a Gaussian mixture, and CIFAR-10/100."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from runner.data import Data, register_dataset, split_of, three_way_split
from runner.schema import ConfigError, SyntheticConfig


@register_dataset("digits")
def digits(cfg, rng) -> Data:
    """sklearn's bundled 8x8 digits (1797 images, 10 classes), pixels scaled to [0, 1]."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = (bunch.images / 16.0).astype(np.float32)[:, None]  # (N, 1, 8, 8)
    train, val, test = three_way_split(x, bunch.target, cfg.val_fraction, cfg.test_fraction, rng)
    return Data(train, val, test, num_classes=10, input_shape=(1, 8, 8))


@register_dataset("synthetic", schema=SyntheticConfig)
def synthetic(cfg, rng) -> Data:
    """Gaussian mixture: one unit-variance Gaussian per class, centres ~ N(0, (separation^2 / dim) I)."""
    centres = rng.normal(scale=cfg.separation / np.sqrt(cfg.dim), size=(cfg.num_classes, cfg.dim))
    y = rng.integers(0, cfg.num_classes, size=cfg.n_samples)
    x = (centres[y] + rng.normal(size=(cfg.n_samples, cfg.dim))).astype(np.float32)
    train, val, test = three_way_split(x, y, cfg.val_fraction, cfg.test_fraction, rng)
    return Data(train, val, test, num_classes=cfg.num_classes, input_shape=(cfg.dim,))


# Standard asymmetric noise for CIFAR-10: truck->automobile, bird->airplane, deer->horse, cat<->dog.
CIFAR10_ASYM = np.array([0, 1, 0, 5, 7, 3, 6, 7, 8, 1])
CIFAR_STATS = {
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
}


def _cifar(cfg, rng, name: str) -> Data:
    """CIFAR-10/100 from torchvision files under `cfg.root`; val is carved from train."""
    from torchvision import datasets

    cls = datasets.CIFAR10 if name == "cifar10" else datasets.CIFAR100
    root = Path(cfg.root).expanduser()
    try:
        parts = [cls(str(root), train=train, download=cfg.download) for train in (True, False)]
    except (RuntimeError, OSError) as e:
        raise ConfigError(
            f"{name} not found under {root.resolve()} ({e}); put the extracted python version there "
            f"(e.g. {root}/{cls.base_folder}) or run with dataset.download=true"
        ) from None
    mean, std = (torch.tensor(s).view(1, 3, 1, 1) for s in CIFAR_STATS[name])

    def to_tensor(images):
        return (torch.as_tensor(images).permute(0, 3, 1, 2).float() / 255.0 - mean) / std

    (x_train, y_train), (x_test, y_test) = ((to_tensor(p.data), np.asarray(p.targets)) for p in parts)
    n_val = int(round(cfg.val_fraction * len(y_train)))
    order = rng.permutation(len(y_train))
    val_idx, train_idx = order[:n_val], np.sort(order[n_val:])
    train = split_of(x_train[train_idx], y_train[train_idx])
    val = split_of(x_train[val_idx], y_train[val_idx])
    test = split_of(x_test, y_test)
    num_classes = 10 if name == "cifar10" else 100
    meta = {"asym_map": CIFAR10_ASYM} if name == "cifar10" else {}
    return Data(train, val, test, num_classes=num_classes, input_shape=(3, 32, 32), meta=meta)


register_dataset("cifar10")(lambda cfg, rng: _cifar(cfg, rng, "cifar10"))
register_dataset("cifar100")(lambda cfg, rng: _cifar(cfg, rng, "cifar100"))
