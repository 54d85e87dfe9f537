"""Long-tailed classification: a training loss, then every inference rule on re-balanced test sets.

    runner +method=dbot dataset=digits dataset.imbalance=50                 DB-OT loss + DB-OT inference
    runner -m +method=dbot method.loss=ce,balanced_softmax,dbot dataset.imbalance=50

The training split is long-tailed by `dataset.imbalance` (the foundation's `load_data`); the model
is trained through `runner.train.fit` with `method.loss` as the loss hook:

    ce                 softmax cross-entropy
    balanced_softmax   CE(l + log pi_train)                                   (Ren et al. 2020)
    logit_adjust       CE(l + la_tau log pi_train)    (Menon et al. 2021; = balanced_softmax at la_tau = 1)
    focal              -sum_j y_j (1 - p_j)^gamma log p_j                     (Lin et al. 2017)
    cb_ce, cb_focal    CE / focal, class-balanced weights (1 - beta)/(1 - beta^n_j)  (Cui et al. 2019)
    ldam               LDAM (Cao et al. 2019): margins ~ n_j^(-1/4) on a cosine classifier of scale
                       `ldam_scale`, deferred re-weighting (DRW, class-balanced weights) from the fraction
                       `drw_start` of the epochs on
    dbot               the DB-OT loss, `loss_mode` paper | official            (runner.methods.dbot.dbot_loss)

`augment=autoaugment_cutout` adds the CIFAR-LT recipe of the DB-OT code base (BALMS) on top of the
dataset's crop + flip: AutoAugment (CIFAR-10 policy) and Cutout (16 px), per batch on the device.

Three test sets are resampled from the test split: `lt` (the training profile, imbalance
`test_imbalance`), `uniform` (n_min per class) and `reversed` (the profile reversed), at least one
sample per class each, shuffled. On each, every rule in `method.inference` predicts from the test logits:

    argmax       argmax_j l_j
    cls_norm     argmax_j (W_j / ||W_j||^cls_norm_tau) . f(x)                 (Kang et al. 2020; bias dropped)
    class_bias   argmax_j l_j - bias_tau log n_j, n_j the test counts        (the paper's Appendix F, Eq. 56)
    posthoc_la   argmax_j l_j - bias_tau log pi_train_j + bias_tau log pi_test_j   (Menon et al., post-hoc)
    sinkhorn     DB-OT with delta = 0 (column marginal = the test prior)
    dbot         DB-OT with bounds (1 -/+ delta) pi_test

where pi_test is the `prior` (oracle_test: the test set's true label frequencies, as the official code;
train; uniform), and DB-OT runs on the whole test set (`scope=all`) or on each batch of `batch_size`.
Accuracies are reported per test set, rule and class group (by training count: many >= many_min,
few <= few_max, medium between) as `<test set>/<rule>/<all|many|medium|few>`. `test/acc` is the plain
argmax accuracy on the uniform (balanced) test set, what the paper's Table 1 reports; `test/acc_<predict>`
is the uniform-test accuracy of the rule `method.predict` (e.g. `test/acc_dbot`). The training run's own
metrics are kept (`val/acc`, the objective of a search; `test/acc_best`, `test/acc_last` over the whole
test split), its last-epoch accuracy on the whole test split as `fit/test/acc`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from runner.augment import PolicyAugment, cutout
from runner.data import load_data, longtail_counts
from runner.distributed_passes import global_batch, predict_all
from runner.methods.dbot import (
    LOSS_MODES,
    SOLVERS,
    CosineClassifier,
    class_balanced_weights,
    dbot_loss,
    dbot_predict,
    ldam_loss,
    ldam_margins,
    weighted_focal_loss,
)
from runner.models import build_model
from runner.schema import ConfigError, check_choice, check_range
from runner.train import fit, soft_cross_entropy

METRIC = ("test/acc", "max")
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


# ----------------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------------
def longtail_loss(logits, y_soft, m, prior: torch.Tensor, class_weights=None, margins=None) -> torch.Tensor:
    """The loss `m.loss` of (B, K) logits against soft labels, given the training prior (K,); the
    class-balanced weights (cb_ce, cb_focal, ldam under DRW) and LDAM margins in logit units."""
    if m.loss == "ce":
        return soft_cross_entropy(logits, y_soft)
    if m.loss in ("balanced_softmax", "logit_adjust"):
        tau = 1.0 if m.loss == "balanced_softmax" else m.la_tau
        return soft_cross_entropy(logits + tau * torch.log(prior), y_soft)
    if m.loss == "focal":
        log_p = F.log_softmax(logits, dim=1)
        return -(y_soft * (1 - log_p.exp()) ** m.focal_gamma * log_p).sum(dim=1).mean()
    labels = y_soft.argmax(1)
    if m.loss in ("cb_ce", "cb_focal"):
        return weighted_focal_loss(
            logits, labels, m.focal_gamma if m.loss == "cb_focal" else 0.0, class_weights
        )
    if m.loss == "ldam":
        return ldam_loss(logits, labels, margins, class_weights)
    return dbot_loss(logits, y_soft, prior, m.train_delta, m.k_train, m.loss_mode)


class LossHook:
    """`fit` hooks: the configured long-tail loss, and the CIFAR-LT batch augmentation."""

    def __init__(self, method_cfg, train_counts: np.ndarray, device, epochs: int, stats=None):
        self.m = method_cfg
        self.prior = torch.as_tensor(train_counts / train_counts.sum(), dtype=torch.float32, device=device)
        weights = torch.as_tensor(
            class_balanced_weights(train_counts, method_cfg.cb_beta), dtype=torch.float32
        )
        self.class_weights = weights.to(device)
        self.margins = method_cfg.ldam_scale * ldam_margins(train_counts, method_cfg.ldam_max_margin)
        self.drw_epoch = round(method_cfg.drw_start * epochs)
        self.policy = PolicyAugment("autoaugment_cifar10", *stats) if method_cfg.augment != "none" else None

    def transform(self, x, y_soft, idx, model):
        if self.policy is None:
            return x, y_soft
        return cutout(self.policy(x), 16), y_soft

    def loss(self, model, x, y_soft, idx, epoch):
        weights = self.class_weights
        if self.m.loss == "ldam" and epoch < self.drw_epoch:  # DRW: plain LDAM before the re-weighting
            weights = None
        # Under DDP on the global batch: the DB-OT losses and the weighted means couple the samples.
        logits, y_soft = global_batch(model(x).float(), y_soft)
        return longtail_loss(logits, y_soft, self.m, self.prior, weights, self.margins)


# ----------------------------------------------------------------------------------------------------
# Test sets and inference
# ----------------------------------------------------------------------------------------------------
def resampled_test_sets(y: np.ndarray, num_classes: int, imbalance: float, names, rng) -> dict:
    """Shuffled index sets into the test split: lt, uniform and reversed label profiles."""
    per_class = [rng.permutation(np.flatnonzero(y == c)) for c in range(num_classes)]
    n_min = min(len(p) for p in per_class)
    if n_min == 0:
        raise ConfigError("the test split lacks a class; a long-tailed evaluation needs every class")
    lt = np.maximum(longtail_counts(n_min, num_classes, imbalance), 1)
    counts = {"lt": lt, "uniform": np.full(num_classes, n_min), "reversed": lt[::-1]}
    return {
        name: rng.permutation(np.concatenate([p[:n] for p, n in zip(per_class, counts[name])]))
        for name in names
    }


def infer(rule: str, m, logits, feats, weight, train_prior, test_prior) -> np.ndarray:
    """Predicted classes (N,) of `rule` from logits (N, K) (and features/classifier weights for cls_norm)."""
    if rule == "argmax":
        return logits.argmax(1)
    if rule == "cls_norm":
        w = weight / np.linalg.norm(weight, axis=1, keepdims=True) ** m.cls_norm_tau
        return (feats @ w.T).argmax(1)
    if rule == "class_bias":
        counts = np.maximum(test_prior * len(logits), 1.0)
        return (logits - m.bias_tau * np.log(counts)).argmax(1)
    if rule == "posthoc_la":
        with np.errstate(divide="ignore"):
            shift = m.bias_tau * (np.log(test_prior) - np.log(train_prior))
        return (logits + shift).argmax(1)
    delta = 0.0 if rule == "sinkhorn" else m.delta
    batch = m.batch_size if m.scope == "batch" else None
    return dbot_predict(logits, test_prior, delta, m.eps, batch, m.solver, m.max_iter, m.tol)


def group_accuracies(correct: np.ndarray, y: np.ndarray, train_counts: np.ndarray, m) -> dict:
    """All / many / medium / few accuracy over samples, groups by their class's training count."""
    groups = {
        "many": train_counts >= m.many_min,
        "medium": (train_counts > m.few_max) & (train_counts < m.many_min),
        "few": train_counts <= m.few_max,
    }
    out = {"all": float(correct.mean())}
    for name, classes in groups.items():
        mask = classes[y]
        if mask.any():  # e.g. CIFAR-10-LT has no medium group
            out[name] = float(correct[mask].mean())
    return out


def run(cfg, ctx) -> dict:
    m = cfg.method
    data = load_data(cfg.dataset, cfg.seed)
    k = data.num_classes
    train_counts = np.bincount(data.train.y.numpy(), minlength=k).astype(np.float64)
    if (train_counts == 0).any():
        raise ConfigError(
            f"dataset.imbalance={cfg.dataset.imbalance} leaves a class without training samples"
        )
    model = build_model(cfg.model, data.input_shape, k)
    if m.loss == "ldam":  # Cao et al. train LDAM on a normalised classifier
        model.classifier = CosineClassifier(model.feature_dim, k, m.ldam_scale)
    stats = None
    if m.augment != "none":
        from runner.data.builtin import CIFAR_STATS
        from runner.data.files import IMAGENET_STATS

        if len(data.input_shape) != 3:
            raise ConfigError(f"method.augment={m.augment} needs images; {cfg.dataset.name} gives vectors")
        stats = CIFAR_STATS.get(cfg.dataset.name, IMAGENET_STATS)
    hooks = LossHook(m, train_counts, ctx.device, cfg.train.epochs, stats)
    fitted = fit(model, data, cfg.train, ctx, hooks, augment=cfg.dataset.augment)

    logits = predict_all(model, data.test, ctx).double().numpy()
    feats = predict_all(model, data.test, ctx, features=True).double().numpy()
    if not ctx.is_main:  # the inference rules run on rank 0, which writes the summary
        return {}
    weight = model.classifier.weight.detach().double().cpu().numpy()
    y_test = data.test.y_clean.numpy()
    rng = np.random.default_rng(cfg.seed + 1)
    imbalance = m.test_imbalance or data.meta.get("imbalance", cfg.dataset.imbalance)
    test_sets = resampled_test_sets(y_test, k, imbalance, m.test_sets, rng)

    summary = {**fitted, "fit/test/acc": fitted.get("test/acc")}
    summary["train/counts"] = [int(c) for c in train_counts]
    return {**summary, **evaluate_rules(m, logits, feats, weight, y_test, train_counts, test_sets)}


def evaluate_rules(m, logits, feats, weight, y_test, train_counts, test_sets) -> dict:
    """Every rule of `m.inference` on every test set (index arrays into the test split), by class group,
    and the headline: `test/acc` (argmax on the uniform test set) and `test/acc_<m.predict>`."""
    k = len(train_counts)
    train_prior = train_counts / train_counts.sum()
    summary: dict = {}
    for name, idx in test_sets.items():
        y = y_test[idx]
        test_prior = {
            "oracle_test": np.bincount(y, minlength=k) / len(y),
            "train": train_prior,
            "uniform": np.full(k, 1.0 / k),
        }[m.prior]
        summary[f"{name}/n"] = len(idx)
        for rule in m.inference:
            pred = infer(rule, m, logits[idx], feats[idx], weight, train_prior, test_prior)
            accs = group_accuracies(pred == y, y, train_counts, m)
            summary |= {f"{name}/{rule}/{group}": acc for group, acc in accs.items()}
    main_set = "uniform" if "uniform" in test_sets else m.test_sets[0]
    idx = test_sets[main_set]
    return {
        "test/acc": float((logits[idx].argmax(1) == y_test[idx]).mean()),  # Table 1: plain argmax
        f"test/acc_{m.predict}": summary[f"{main_set}/{m.predict}/all"],
        **summary,
    }
