"""Method configs of runner/tasks/classify.py: ERM and the mixup family (Co-Mixup and its baselines)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from runner.checks import ConfigError, check_range
from runner.configs._base import MethodConfig, TaskEntry, register_method, register_task
from runner.methods.comixup import SOLVERS, THRES_TYPES

LOSSES = ("ce", "bce")

TASK = register_task(
    TaskEntry(
        "classify",
        "runner.tasks.classify",
        main_presets={"cifar100": "comixup_cifar100_preactresnet18", None: "comixup_digits_canvas"},
        evaluable=True,
        bench_presets=(
            "comixup_cifar100_preactresnet18",
            "comixup_cifar100_wrn16_8",
            "comixup_cifar100_resnext29",
            "comixup_tiny_imagenet",
            "comixup_imagenet",
        ),
        bench_baseline=("+method=erm",),
        bench_target=("step", 2.2),
    )
)
# the Co-Mixup study's presets, each serving ERM and every mixup (its rows)
STUDY = (
    "comixup_cifar100_preactresnet18",
    "comixup_cifar100_resnext29",
    "comixup_cifar100_wrn16_8",
    "comixup_digits_canvas",
    "comixup_imagenet",
    "comixup_tiny_imagenet",
)
# a classify method's hooks factory takes (method_cfg, data, ctx) (tasks/classify.py)
MIXUP_HOOKS = "runner.hooks.mixup:mixup_hooks"


@register_method(hooks="runner.hooks.mixup:target_loss_hooks", presets=STUDY)
@dataclass
class ERMConfig(MethodConfig):
    name: str = "erm"
    task: str = "classify"
    loss: Literal[LOSSES] = (
        "ce"  # ce (soft-target CE) | bce (BCE on the softmax, the Puzzle Mix / Co-Mixup code)
    )


# --- the mixup family (runner/methods/mixup.py, comixup.py; hooks in runner/hooks/mixup.py) ---------------


@register_method(hooks=MIXUP_HOOKS, presets=STUDY)
@dataclass
class InputMixupConfig(ERMConfig):
    name: str = "input_mixup"
    loss: Literal[LOSSES] = "bce"  # the authors' code trains every row of the Co-Mixup table with it
    alpha: float = 1.0  # mixing ratio ~ Beta(alpha, alpha) (Co-Mixup: Dirichlet(alpha))
    clean_lam: float = 0.0  # weight of the clean-input loss added to the mixed loss
    preview: bool = True  # write mixup_preview.png of the first mixed batch and log it

    def __post_init__(self):
        super().__post_init__()
        check_range("method.alpha", self.alpha, 0.0, lo_open=True)
        check_range("method.clean_lam", self.clean_lam, 0.0)


@register_method(hooks=MIXUP_HOOKS, presets=STUDY)
@dataclass
class ManifoldMixupConfig(InputMixupConfig):
    name: str = "manifold_mixup"
    alpha: float = 2.0


@register_method(hooks=MIXUP_HOOKS, presets=STUDY)
@dataclass
class CutMixConfig(InputMixupConfig):
    name: str = "cutmix"


@register_method(hooks=MIXUP_HOOKS, presets=STUDY)
@dataclass
class PuzzleMixConfig(InputMixupConfig):
    """Defaults: the PuzzleMix README's CIFAR-100 command (its Tiny-ImageNet one: clean_lam=1, t_size=-1,
    which `t_size=0` picks there by itself)."""

    name: str = "puzzle_mix"
    beta: float = 1.2  # label smoothness (x 1 / (16 g))
    gamma: float = 0.5  # data (seam) smoothness
    eta: float = 0.2  # prior weight
    n_labels: int = 3  # mask levels in [0, 1]
    grid: int = -1  # mask grid; -1 draws g from {2, 4, 8, 16} per batch
    neigh_size: int = 4  # pixels pooled per seam sample
    transport: bool = True
    t_eps: float = 0.8  # transport distance cost
    # transport cells of this many pixels where finer than the cut's; -1: the cut's grid; 0: by the image
    # side, as the authors (4 px on CIFAR's 32 px, the cut's grid on Tiny-ImageNet and ImageNet)
    t_size: int = 0
    adv_p: float = 0.0  # probability of adversarial noise on x and on its partner (each, per batch)
    adv_eps: float = 10.0  # its L-inf radius, in /255 pixel units

    def __post_init__(self):
        super().__post_init__()
        for key in ("beta", "gamma", "eta", "t_eps", "adv_eps"):
            check_range(f"method.{key}", getattr(self, key), 0.0)
        check_range("method.n_labels", self.n_labels, 2)
        check_range("method.neigh_size", self.neigh_size, 1)
        check_range("method.adv_p", self.adv_p, 0.0, 1.0)
        if self.grid != -1:
            check_range("method.grid", self.grid, 2)
        if self.t_size < -1:
            raise ConfigError(
                f"method.t_size={self.t_size}: a cell size in pixels >= 1, -1 (the cut's grid) or 0 (by the "
                "image side)"
            )


@register_method(hooks=MIXUP_HOOKS, presets=STUDY)
@dataclass
class CoMixupConfig(InputMixupConfig):
    name: str = "comixup"
    alpha: float = 2.0
    clean_lam: float = 1.0
    beta: float = 0.32  # smoothness
    gamma: float = 1.0  # diversity (compatibility) penalty
    eta: float = 0.05  # Dirichlet prior weight
    tau: float = 0.83  # clipping threshold, in units of cells
    thres_type: Literal[THRES_TYPES] = "hard"
    omega: float = 0.001  # compatibility matrix A = (1 - omega) I + omega A_hat
    grid: int = 4  # g x g cells per output; -1 draws from {2, 4, 8, 16}
    part: int = 20  # inputs per partition
    n_iter: int = 4  # sweeps of the block-coordinate descent
    set_resolve: bool = True
    mixed_labels: bool = True  # half/half blends of two inputs from the second sweep
    solver: Literal[SOLVERS] = "exact"  # each label step's exact minimum; gco_swap: the authors' local one
    workers: int = -1  # -1: auto (CUDA, or lag: a thread per partition up to the cores; CPU: in-process)
    # with workers: take the clean weight gradient while they solve (the activation gradients are computed
    # twice); false: one clean backward, then the solve (faster where the solve is shorter than that repeat).
    # The eager step's: a captured one (hardware.cuda_graph) takes the weight gradient in its clean pass
    overlap: bool = True
    # true: a batch's cuts are solved during the next step, which trains on that batch's mix (the masks from
    # saliency one weight update old; a deviation from the paper). The first step trains on its clean batch.
    lag: bool = False

    def __post_init__(self):
        super().__post_init__()
        for key in ("beta", "gamma", "eta", "tau"):
            check_range(f"method.{key}", getattr(self, key), 0.0)
        check_range("method.omega", self.omega, 0.0, 1.0)
        check_range("method.part", self.part, 2)
        check_range("method.n_iter", self.n_iter, 1)
        check_range("method.workers", self.workers, -1)
        if self.lag and self.workers == 0:
            raise ConfigError(
                "method.lag=true solves on the pool's threads: set method.workers to -1 (auto) or >= 1"
            )
        if self.solver == "gco_expansion" and self.mixed_labels:  # else it fails at the first batch
            raise ConfigError(
                "method.solver='gco_expansion' needs method.mixed_labels=false: "
                "the costs of blended labels are not a metric"
            )
        if self.grid != -1:
            check_range("method.grid", self.grid, 1)


MIXUP = (InputMixupConfig, ManifoldMixupConfig, CutMixConfig, PuzzleMixConfig, CoMixupConfig)
METHODS = TASK.methods  # its methods by name, a view of the registry
