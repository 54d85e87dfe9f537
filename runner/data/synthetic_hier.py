"""`synthetic_hier`: a two-level Gaussian mixture, super-classes of sub-classes (the hierarchical-hash
CPU study).

Super-class means ~ N(0, super_std^2 I), class means = super mean + N(0, class_std^2 I), samples =
class mean + N(0, noise_std^2 I) in R^dim; class c belongs to super-class c // n_sub. Split sizes are
per class (`train_per_class`, `val_per_class`, `test_per_class`), so `val_fraction`/`test_fraction`
do not apply. `meta["superclass"]` maps each class to its super-class.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from runner.checks import at_least
from runner.data import Data, register_dataset, split_of
from runner.schema import DatasetConfig


@dataclass
class SyntheticHierConfig(DatasetConfig):
    n_super: int = at_least(8, 1)
    n_sub: int = at_least(8, 1)
    dim: int = at_least(32, 1)
    super_std: float = at_least(2.0, 0.0)
    class_std: float = at_least(1.0, 0.0)
    noise_std: float = at_least(1.5, 0.0)
    train_per_class: int = at_least(100, 1)
    val_per_class: int = at_least(0, 0)
    test_per_class: int = at_least(30, 1)


@register_dataset("synthetic_hier", schema=SyntheticHierConfig)
def synthetic_hier(cfg, rng) -> Data:
    num_classes = cfg.n_super * cfg.n_sub
    super_means = rng.normal(scale=cfg.super_std, size=(cfg.n_super, cfg.dim))
    superclass = np.arange(num_classes) // cfg.n_sub
    class_means = super_means[superclass] + rng.normal(scale=cfg.class_std, size=(num_classes, cfg.dim))

    def draw(per_class):
        y = np.repeat(np.arange(num_classes), per_class)
        x = class_means[y] + rng.normal(scale=cfg.noise_std, size=(len(y), cfg.dim))
        return split_of(x.astype(np.float32), y)

    train, val, test = (draw(n) for n in (cfg.train_per_class, cfg.val_per_class, cfg.test_per_class))
    return Data(train, val, test, num_classes, input_shape=(cfg.dim,), meta={"superclass": superclass})
