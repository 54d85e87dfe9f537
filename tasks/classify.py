"""Supervised classification: plain ERM, or ERM with a method's training hooks (e.g. a batch mixup).

Without `+method=`, this task trains the dataset's baseline. A method of this task registers its
schema in `METHODS` and a hooks factory in `HOOKS` (see `runner.train` for the hook protocol).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from runner.data import load_data
from runner.models import build_model
from runner.train import fit

METRIC = ("test/acc", "max")


@dataclass
class ERMConfig:
    name: str = "erm"
    task: str = "classify"


METHODS: dict[str, type] = {"erm": ERMConfig}
# method name -> factory(method_cfg, data, ctx) returning the hooks object given to `fit`
HOOKS: dict[str, Callable] = {}


def run(cfg, ctx) -> dict:
    data = load_data(cfg.dataset, cfg.seed)
    model = build_model(cfg.model, data.input_shape, data.num_classes)
    method = cfg.get("method")
    hooks = HOOKS[method.name](method, data, ctx) if method is not None and method.name in HOOKS else None
    return fit(model, data, cfg.train, ctx, hooks, augment=cfg.dataset.augment)
