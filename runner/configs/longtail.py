"""Method configs of tasks/longtail.py: the DB-OT loss and inference rules, and the long-tail baselines."""

from __future__ import annotations

from dataclasses import dataclass, field

from runner.methods.dbot import LOSS_MODES, SOLVERS
from runner.schema import ConfigError, check_choice, check_range

LOSSES = ("ce", "balanced_softmax", "logit_adjust", "focal", "cb_ce", "cb_focal", "ldam", "dbot")
RULES = ("argmax", "cls_norm", "class_bias", "posthoc_la", "sinkhorn", "dbot")
TEST_SETS = ("lt", "uniform", "reversed")
PRIORS = ("oracle_test", "train", "uniform")


@dataclass
class LongTailConfig:
    name: str = "dbot"
    task: str = "longtail"
    # training
    loss: str = "dbot"
    loss_mode: str = "official"  # dbot loss: official | paper
    k_train: int = 1  # dbot loss: unrolled solver-I sweeps
    train_delta: float = 0.1  # dbot loss: bounds (1 -/+ train_delta) pi_train
    la_tau: float = 1.0
    focal_gamma: float = 2.0  # focal, cb_focal
    cb_beta: float = 0.9999  # cb_ce, cb_focal, ldam's DRW: class-balanced weights
    ldam_max_margin: float = 0.5  # ldam: the rarest class's margin (cosine units)
    ldam_scale: float = 30.0  # ldam: the cosine classifier's scale s
    drw_start: float = 0.8  # ldam: class-balanced re-weighting from this fraction of the epochs (1: never)
    augment: str = "none"  # none | autoaugment_cutout (on top of dataset.augment)
    # inference
    inference: list[str] = field(default_factory=lambda: list(RULES))
    predict: str = "dbot"  # the rule behind test/acc
    delta: float = 0.2  # dbot rule: bounds (1 -/+ delta) pi_test
    eps: float = 1.0
    prior: str = "oracle_test"
    scope: str = "all"  # all | batch
    batch_size: int = 128
    solver: str = "sinkhorn"
    max_iter: int = 1000
    tol: float = 1e-6
    cls_norm_tau: float = 1.0
    bias_tau: float = 1.0
    # evaluation
    test_sets: list[str] = field(default_factory=lambda: list(TEST_SETS))
    test_imbalance: float = 0.0  # 0: dataset.imbalance
    many_min: int = 101
    few_max: int = 19

    def __post_init__(self):
        check_choice("method.loss", self.loss, LOSSES)
        check_choice("method.loss_mode", self.loss_mode, LOSS_MODES)
        check_range("method.k_train", self.k_train, 1)
        check_range("method.train_delta", self.train_delta, 0.0, 1.0, hi_open=True)
        check_range("method.la_tau", self.la_tau, 0.0)
        check_range("method.focal_gamma", self.focal_gamma, 0.0)
        check_range("method.cb_beta", self.cb_beta, 0.0, 1.0, hi_open=True)
        check_range("method.ldam_max_margin", self.ldam_max_margin, 0.0)
        check_range("method.ldam_scale", self.ldam_scale, 0.0, lo_open=True)
        check_range("method.drw_start", self.drw_start, 0.0, 1.0)
        check_choice("method.augment", self.augment, ("none", "autoaugment_cutout"))
        if self.loss == "dbot" and self.loss_mode == "paper" and self.k_train == 1 and self.train_delta > 0:
            raise ConfigError(
                f"method.train_delta={self.train_delta} has no effect with method.loss_mode=paper and "
                "method.k_train=1 (that loss is Balanced Softmax); set method.k_train >= 2 or train_delta=0"
            )
        for rule in self.inference:
            check_choice("method.inference", rule, RULES)
        if self.predict not in self.inference:
            raise ConfigError(
                f"method.predict={self.predict!r} must be one of method.inference={self.inference}"
            )
        check_range("method.delta", self.delta, 0.0, 1.0, hi_open=True)
        check_range("method.eps", self.eps, 0.0, lo_open=True)
        check_choice("method.prior", self.prior, PRIORS)
        check_choice("method.scope", self.scope, ("all", "batch"))
        check_range("method.batch_size", self.batch_size, 1)
        check_choice("method.solver", self.solver, SOLVERS)
        check_range("method.max_iter", self.max_iter, 1)
        check_range("method.tol", self.tol, 0.0, lo_open=True)
        if not self.test_sets:
            raise ConfigError("method.test_sets is empty; choose from: " + ", ".join(TEST_SETS))
        for name in self.test_sets:
            check_choice("method.test_sets", name, TEST_SETS)
        if self.test_imbalance != 0:
            check_range("method.test_imbalance", self.test_imbalance, 1.0)
        if self.few_max >= self.many_min:
            raise ConfigError(f"method.few_max={self.few_max} must be < method.many_min={self.many_min}")


METHODS = {
    name: LongTailConfig
    for name in ("dbot", "lt_ce", "balanced_softmax", "logit_adjust", "focal", "cb_ce", "cb_focal", "ldam")
}
