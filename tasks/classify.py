"""Supervised classification: plain ERM, or ERM with a method's training hooks (e.g. a batch mixup).

Without `+method=`, this task trains the dataset's baseline. A method of this task registers its
schema in `METHODS` and a hooks factory in `HOOKS` (see `runner.train` for the hook protocol).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from runner.data import load_data
from runner.data.canvas import canvas_metrics
from runner.methods.comixup import SOLVERS, THRES_TYPES
from runner.methods.mixup_training import MixupHooks
from runner.models import build_model
from runner.schema import ConfigError, check_choice, check_range
from runner.train import fit

METRIC = ("test/acc", "max")


@dataclass
class ERMConfig:
    name: str = "erm"
    task: str = "classify"


# --- the mixup family (runner/methods/mixup.py, comixup.py; hooks in mixup_training.py) ---------------


@dataclass
class InputMixupConfig:
    name: str = "input_mixup"
    task: str = "classify"
    alpha: float = 1.0  # mixing ratio ~ Beta(alpha, alpha) (Co-Mixup: Dirichlet(alpha))
    clean_lam: float = 0.0  # weight of the clean-input loss added to the mixed loss
    loss: str = "ce"  # mixed-batch loss: ce (soft targets) | bce (BCE on softmax, as the Co-Mixup code)
    preview: bool = True  # write mixup_preview.png of the first mixed batch and log it

    def __post_init__(self):
        check_range("method.alpha", self.alpha, 0.0, lo_open=True)
        check_range("method.clean_lam", self.clean_lam, 0.0)
        check_choice("method.loss", self.loss, ("ce", "bce"))


@dataclass
class ManifoldMixupConfig(InputMixupConfig):
    name: str = "manifold_mixup"
    alpha: float = 2.0


@dataclass
class CutMixConfig(InputMixupConfig):
    name: str = "cutmix"


@dataclass
class PuzzleMixConfig(InputMixupConfig):
    name: str = "puzzle_mix"
    clean_lam: float = 1.0
    loss: str = "bce"
    beta: float = 1.2  # label smoothness
    gamma: float = 0.5  # data (seam) smoothness
    eta: float = 0.2  # prior weight
    n_labels: int = 3  # mask levels in [0, 1]
    grid: int = -1  # mask grid; -1 draws from {2, 4, 8}
    transport: bool = True
    t_eps: float = 0.8  # transport distance cost

    def __post_init__(self):
        super().__post_init__()
        for key in ("beta", "gamma", "eta", "t_eps"):
            check_range(f"method.{key}", getattr(self, key), 0.0)
        check_range("method.n_labels", self.n_labels, 2)
        if self.grid != -1:
            check_range("method.grid", self.grid, 1)


@dataclass
class CoMixupConfig(InputMixupConfig):
    name: str = "comixup"
    alpha: float = 2.0
    clean_lam: float = 1.0
    loss: str = "bce"
    beta: float = 0.32  # smoothness
    gamma: float = 1.0  # diversity (compatibility) penalty
    eta: float = 0.05  # Dirichlet prior weight
    tau: float = 0.83  # clipping threshold, in units of cells
    thres_type: str = "hard"
    omega: float = 0.001  # compatibility matrix A = (1 - omega) I + omega A_hat
    grid: int = 4  # g x g cells per output; -1 draws from {2, 4, 8, 16}
    part: int = 20  # inputs per partition
    n_iter: int = 4  # sweeps of the block-coordinate descent
    set_resolve: bool = True
    mixed_labels: bool = True  # half/half blends of two inputs from the second sweep
    solver: str = "gco_swap"
    workers: int = 0  # > 0: solve partitions in this many worker processes

    def __post_init__(self):
        super().__post_init__()
        for key in ("beta", "gamma", "eta", "tau"):
            check_range(f"method.{key}", getattr(self, key), 0.0)
        check_range("method.omega", self.omega, 0.0, 1.0)
        check_range("method.part", self.part, 2)
        check_range("method.n_iter", self.n_iter, 1)
        check_range("method.workers", self.workers, 0)
        check_choice("method.thres_type", self.thres_type, THRES_TYPES)
        check_choice("method.solver", self.solver, SOLVERS)
        if self.solver == "gco_expansion" and self.mixed_labels:  # else it fails at the first batch
            raise ConfigError(
                "method.solver='gco_expansion' needs method.mixed_labels=false: "
                "the costs of blended labels are not a metric"
            )
        if self.grid != -1:
            check_range("method.grid", self.grid, 1)


MIXUP = (InputMixupConfig, ManifoldMixupConfig, CutMixConfig, PuzzleMixConfig, CoMixupConfig)

METHODS: dict[str, type] = {"erm": ERMConfig, **{c.name: c for c in MIXUP}}
# method name -> factory(method_cfg, data, ctx) returning the hooks object given to `fit`
HOOKS: dict[str, Callable] = {
    c.name: lambda cfg, data, ctx: MixupHooks(cfg, data.num_classes, ctx, seed=torch.initial_seed())
    for c in MIXUP
}


def run(cfg, ctx) -> dict:
    data = load_data(cfg.dataset, cfg.seed)
    model = build_model(cfg.model, data.input_shape, data.num_classes)
    method = cfg.get("method")
    hooks = HOOKS[method.name](method, data, ctx) if method is not None and method.name in HOOKS else None
    summary = fit(model, data, cfg.train, ctx, hooks, augment=cfg.dataset.augment)
    if "boxes" in data.meta:  # digits_canvas: error, ECE, CAM localisation, background corruptions
        summary.update(canvas_metrics(model, data, ctx))
    return summary
