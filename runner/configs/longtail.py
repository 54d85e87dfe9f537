"""Method configs of runner/tasks/longtail.py: the DB-OT loss and inference rules, and the long-tail
baselines."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from runner.checks import ConfigError, check_range
from runner.configs._base import MethodConfig, TaskEntry, register_method, register_task, variant
from runner.methods.dbot import LOSS_MODES, SOLVERS

# baseline name -> its training loss (`method.loss`; each loss's function: runner.hooks.dbot.LOSS_FUNCTIONS)
BASELINE_LOSSES = {
    "lt_ce": "ce",  # softmax cross-entropy
    "balanced_softmax": "balanced_softmax",  # CE(l + log pi_train) (Ren et al. 2020)
    "logit_adjust": "logit_adjust",  # CE(l + la_tau log pi_train) (Menon et al. 2021)
    "focal": "focal",  # Lin et al. 2017
    "cb_ce": "cb_ce",  # class-balanced CE, weights (1 - beta) / (1 - beta^n_j) (Cui et al. 2019)
    "cb_focal": "cb_focal",  # class-balanced softmax focal loss (Cui et al. 2019)
    "ldam": "ldam",  # LDAM-DRW (Cao et al. 2019): margins ~ n_j^(-1/4), re-weighting from drw_start
}
LOSSES = (*BASELINE_LOSSES.values(), "dbot")
RULES = ("argmax", "cls_norm", "class_bias", "posthoc_la", "sinkhorn", "dbot")
TEST_SETS = ("lt", "uniform", "reversed")
PRIORS = ("oracle_test", "train", "uniform")

TASK = register_task(
    TaskEntry(
        "longtail",
        "runner.tasks.longtail",
        evaluable=True,
        bench_presets=("dbot_cifar100_lt", "dbot_imagenet_lt"),
        bench_baseline=("+method=lt_ce",),
        bench_target=("step", 1.2),
    )
)
# the paper's tables: DB-OT and each baseline on each
PRESETS = ("dbot_cifar100_lt", "dbot_cifar10_lt", "dbot_digits_lt", "dbot_imagenet_lt")
# a long-tail method's hooks factory: (method_cfg, train_counts, device, epochs, stats) (tasks/longtail.py)
HOOKS = "runner.hooks.dbot:LossHook"


@register_method(hooks=HOOKS, presets=PRESETS)
@dataclass
class LongTailConfig(MethodConfig):
    name: str = "dbot"
    task: str = "longtail"
    # training
    loss: Literal[LOSSES] = "dbot"
    # dbot loss: official (the authors' GammaSoftmax code, behind the paper's tables) | paper (-log of the
    # unrolled DB-OT plan; k_train 1 is Balanced Softmax for any train_delta, which needs k_train >= 2)
    loss_mode: Literal[LOSS_MODES] = "official"
    k_train: int = 1  # dbot loss: unrolled solver-I sweeps
    train_delta: float = 0.1  # dbot loss: bounds (1 -/+ train_delta) pi_train
    la_tau: float = 1.0  # logit_adjust
    focal_gamma: float = 2.0  # focal, cb_focal
    cb_beta: float = 0.9999  # cb_ce, cb_focal, ldam's DRW: class-balanced weights
    ldam_max_margin: float = 0.5  # ldam: the rarest class's margin (cosine units)
    ldam_scale: float = 30.0  # ldam: the cosine classifier's scale s
    drw_start: float = 0.8  # ldam: class-balanced re-weighting from this fraction of the epochs (1: never)
    # autoaugment_cutout: AutoAugment CIFAR-10 policy + Cutout 16, after dataset.augment (crop + flip)
    augment: Literal["none", "autoaugment_cutout"] = "none"
    # inference rules evaluated on every test set; test/acc is argmax on the uniform test set (the paper's
    # Table 1), test/acc_<predict> the rule `predict` there
    inference: list[Literal[RULES]] = field(default_factory=lambda: list(RULES))
    predict: Literal[RULES] = "dbot"  # the rule behind test/acc
    delta: float = 0.2  # dbot rule: bounds (1 -/+ delta) pi_test
    eps: float = 1.0
    prior: Literal[PRIORS] = "oracle_test"  # oracle_test: the true test label frequencies
    scope: Literal["all", "batch"] = "all"  # batch: one DB-OT problem per batch of batch_size
    batch_size: int = 128
    solver: Literal[SOLVERS] = "sinkhorn"
    max_iter: int = 1000
    tol: float = 1e-6
    cls_norm_tau: float = 1.0
    bias_tau: float = 1.0
    # evaluation
    test_sets: list[Literal[TEST_SETS]] = field(default_factory=lambda: list(TEST_SETS))
    test_imbalance: float = 0.0  # imbalance of the lt / reversed test sets; 0: dataset.imbalance
    many_min: int = 101  # many-shot: >= many_min training samples (paper: > 100)
    few_max: int = 19  # few-shot: <= few_max training samples (paper: < 20)

    def __post_init__(self):
        super().__post_init__()
        check_range("method.k_train", self.k_train, 1)
        check_range("method.train_delta", self.train_delta, 0.0, 1.0, hi_open=True)
        check_range("method.la_tau", self.la_tau, 0.0)
        check_range("method.focal_gamma", self.focal_gamma, 0.0)
        check_range("method.cb_beta", self.cb_beta, 0.0, 1.0, hi_open=True)
        check_range("method.ldam_max_margin", self.ldam_max_margin, 0.0)
        check_range("method.ldam_scale", self.ldam_scale, 0.0, lo_open=True)
        check_range("method.drw_start", self.drw_start, 0.0, 1.0)
        if self.loss == "dbot" and self.loss_mode == "paper" and self.k_train == 1 and self.train_delta > 0:
            raise ConfigError(
                f"method.train_delta={self.train_delta} has no effect with method.loss_mode=paper and "
                "method.k_train=1 (that loss is Balanced Softmax); set method.k_train >= 2 or train_delta=0"
            )
        if self.predict not in self.inference:
            raise ConfigError(
                f"method.predict={self.predict!r} must be one of method.inference={self.inference}"
            )
        check_range("method.delta", self.delta, 0.0, 1.0, hi_open=True)
        check_range("method.eps", self.eps, 0.0, lo_open=True)
        check_range("method.batch_size", self.batch_size, 1)
        check_range("method.max_iter", self.max_iter, 1)
        check_range("method.tol", self.tol, 0.0, lo_open=True)
        if not self.test_sets:
            raise ConfigError("method.test_sets is empty; choose from: " + ", ".join(TEST_SETS))
        if self.test_imbalance != 0:
            check_range("method.test_imbalance", self.test_imbalance, 1.0)
        if self.few_max >= self.many_min:
            raise ConfigError(f"method.few_max={self.few_max} must be < method.many_min={self.many_min}")


@dataclass
class LongTailBaselineConfig(LongTailConfig):
    """A long-tail baseline: its training loss, predictions by argmax for test/acc (every rule is still
    reported)."""

    predict: Literal[RULES] = "argmax"


def _baseline(name: str, loss: str) -> type:
    """The schema of the baseline `name`, registered: LongTailBaselineConfig with its name and loss as
    defaults."""
    doc = f"The long-tail baseline {name}: trains with loss={loss}, predicts by argmax."
    schema = variant(f"{name.title().replace('_', '')}Config", LongTailBaselineConfig, doc, __name__,
                     name=name, loss=loss)  # fmt: skip
    return register_method(hooks=HOOKS, presets=PRESETS)(schema)


BASELINES = {name: _baseline(name, loss) for name, loss in BASELINE_LOSSES.items()}
METHODS = TASK.methods  # its methods by name, a view of the registry
