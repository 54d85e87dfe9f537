"""`blobs`: 2-D Gaussian blobs of unequal sizes plus a few far outliers (the DB-OT clustering data).

Blob c (c = 0..C-1) has `sizes[c]` points ~ N(centre_c, std^2 I) with the centres evenly spaced on a
circle of `radius`; `n_outliers` points ~ N(outlier_centre, outlier_std^2 I) get their own label C, so
`num_classes` = C + 1 when there are outliers. `meta` names the blob count and the outlier label:
{"n_clusters": C, "outlier_label": C or None}. Splits are stratified by label.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from runner.checks import ConfigError
from runner.data import Data, register_dataset, split_of, three_way_split
from runner.schema import DatasetConfig, check_range


@dataclass
class BlobsConfig(DatasetConfig):
    sizes: list[int] = field(default_factory=lambda: [40, 50, 60, 70, 80])
    radius: float = 5.0
    std: float = 1.0
    n_outliers: int = 6
    outlier_centre: list[float] = field(default_factory=lambda: [25.0, 25.0])
    outlier_std: float = 0.5

    def __post_init__(self):
        super().__post_init__()
        if len(self.sizes) < 2 or min(self.sizes) < 1:
            raise ConfigError(f"dataset.sizes={self.sizes}: need at least 2 blobs of size >= 1")
        if len(self.outlier_centre) != 2:
            raise ConfigError(f"dataset.outlier_centre={self.outlier_centre}: must be a 2-D point [x, y]")
        check_range("dataset.radius", self.radius, 0.0)
        check_range("dataset.std", self.std, 0.0, lo_open=True)
        check_range("dataset.n_outliers", self.n_outliers, 0)
        check_range("dataset.outlier_std", self.outlier_std, 0.0)
        if self.test_fraction == 0 and self.val_fraction > 0:
            raise ConfigError(
                "dataset.test_fraction=0 keeps every point in train: set dataset.val_fraction=0"
            )


def make_blobs(sizes, radius, std, n_outliers, outlier_centre, outlier_std, rng: np.random.Generator):
    """(x (N, 2) float32, y (N,) int64): blob points first, then the outliers (label len(sizes))."""
    angles = 2 * np.pi * np.arange(len(sizes)) / len(sizes)
    centres = radius * np.c_[np.cos(angles), np.sin(angles)]
    x = [rng.normal(c, std, size=(n, 2)) for c, n in zip(centres, sizes)]
    x.append(rng.normal(outlier_centre, outlier_std, size=(n_outliers, 2)))
    y = np.repeat(np.arange(len(sizes) + 1), list(sizes) + [n_outliers])
    return np.concatenate(x).astype(np.float32), y


@register_dataset("blobs", schema=BlobsConfig)
def blobs(cfg, rng) -> Data:
    x, y = make_blobs(
        cfg.sizes, cfg.radius, cfg.std, cfg.n_outliers, cfg.outlier_centre, cfg.outlier_std, rng
    )
    n_blobs = len(cfg.sizes)
    if cfg.test_fraction == 0:  # clustering uses every point: no split needed
        train, val, test = split_of(x, y), split_of(x[:0], y[:0]), split_of(x[:0], y[:0])
    else:
        train, val, test = three_way_split(x, y, cfg.val_fraction, cfg.test_fraction, rng)
    outliers = cfg.n_outliers > 0
    meta = {"n_clusters": n_blobs, "outlier_label": n_blobs if outliers else None}
    return Data(train, val, test, num_classes=n_blobs + int(outliers), input_shape=(2,), meta=meta)
