"""DB-OT and the long-tail baselines in training and evaluation: the loss hook that `runner.train.fit`
calls every step (on the model's device), the re-balanced test sets and the inference rules of
`runner/tasks/longtail.py` (its docstring lists the losses and rules; the config is `method.*` of that task).
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from runner.augment import PolicyAugment, cutout
from runner.checks import ConfigError
from runner.configs.longtail import LOSSES
from runner.data import longtail_counts
from runner.distributed_passes import global_batch
from runner.hardware import to_device
from runner.losses import soft_cross_entropy
from runner.method_hooks import MethodHooks
from runner.methods.dbot import (
    DBOTLoss,
    PendingLabels,
    class_balanced_weights,
    dbot_predict,
    ldam_loss,
    ldam_margins,
    read_pending,
    weighted_focal_loss,
)

# the inference rules that solve DB-OT (on the device, on an accelerator)
DBOT_RULES = ("sinkhorn", "dbot")

__all__ = ["LossHook", "evaluate_rules", "group_accuracies", "infer", "longtail_loss", "resampled_test_sets"]


# ----------------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------------
def _adjusted_ce(tau_key: str | None):
    """CE(l + tau log pi_train), tau the config's `tau_key` (None: 1, Balanced Softmax)."""

    def loss(logits, y_soft, m, prior, class_weights, margins, dbot):
        tau = 1.0 if tau_key is None else getattr(m, tau_key)
        return soft_cross_entropy(logits + tau * torch.log(prior), y_soft)

    return loss


def _class_balanced(focal: bool):
    """Class-balanced CE (focal=False) or softmax focal loss, on the hard labels."""

    def loss(logits, y_soft, m, prior, class_weights, margins, dbot):
        return weighted_focal_loss(logits, y_soft.argmax(1), m.focal_gamma if focal else 0.0, class_weights)

    return loss


# `method.loss` -> its function (logits, y_soft, m, prior, class_weights, margins, dbot): each choice of
# runner.configs.longtail.LOSSES, checked below
LOSS_FUNCTIONS = {
    "ce": lambda logits, y_soft, *_: soft_cross_entropy(logits, y_soft),
    "balanced_softmax": _adjusted_ce(None),
    "logit_adjust": _adjusted_ce("la_tau"),
    "focal": lambda logits, y_soft, m, *_: weighted_focal_loss(logits, y_soft, m.focal_gamma),
    "cb_ce": _class_balanced(focal=False),
    "cb_focal": _class_balanced(focal=True),
    "ldam": lambda logits, y_soft, m, prior, class_weights, margins, dbot: ldam_loss(
        logits, y_soft.argmax(1), margins, class_weights
    ),
    "dbot": lambda logits, y_soft, m, prior, class_weights, margins, dbot: (
        dbot or DBOTLoss(prior, m.train_delta, m.k_train, m.loss_mode)
    )(logits, y_soft),
}
if set(LOSS_FUNCTIONS) != set(LOSSES):
    raise ImportError(f"long-tail losses without a function: {sorted(set(LOSSES) ^ set(LOSS_FUNCTIONS))}")


def longtail_loss(
    logits, y_soft, m, prior: torch.Tensor, class_weights=None, margins=None, dbot: DBOTLoss | None = None
) -> torch.Tensor:
    """The loss `m.loss` of (B, K) logits against soft labels, given the training prior (K,); the
    class-balanced weights (cb_ce, cb_focal, ldam under DRW), LDAM margins in logit units, and the DB-OT
    loss built once (None: built here from `prior`, which checks it again)."""
    return LOSS_FUNCTIONS[m.loss](logits, y_soft, m, prior, class_weights, margins, dbot)


class LossHook(MethodHooks):
    """`fit` hooks: the configured long-tail loss, and the CIFAR-LT batch augmentation."""

    # device work alone: the augmentation draws on the device, the DB-OT loss masks rather than indexes
    # (fixed shapes), and under DRW the re-weighting epoch recaptures (`capture_key`)
    capturable = True

    def __init__(self, method_cfg, train_counts: np.ndarray, device, epochs: int, stats=None):
        self.m = method_cfg
        # on the device once, copied without the host waiting: the loss then runs on the model's device with
        # no host copies per step
        prior = torch.as_tensor(train_counts / train_counts.sum(), dtype=torch.float32)
        self.prior = to_device(prior, device)
        weights = class_balanced_weights(train_counts, method_cfg.cb_beta)
        self.class_weights = to_device(weights, device, torch.float32)
        margins = method_cfg.ldam_scale * ldam_margins(train_counts, method_cfg.ldam_max_margin)
        self.margins = to_device(margins, device, torch.float32)
        self.drw_epoch = round(method_cfg.drw_start * epochs)
        self.dbot = None
        if method_cfg.loss == "dbot":  # its prior checked here on the host, once, not read back every step
            self.dbot = DBOTLoss(prior, method_cfg.train_delta, method_cfg.k_train, method_cfg.loss_mode)
        self.policy = PolicyAugment("autoaugment_cifar10", *stats) if method_cfg.augment != "none" else None

    def transform(self, x, y_soft, idx, model):
        if self.policy is None:
            return x, y_soft
        return cutout(self.policy(x), 16), y_soft

    def capture_key(self, epoch):
        return self._plain_ldam(epoch)

    def _plain_ldam(self, epoch) -> bool:
        """DRW: plain LDAM before the re-weighting epoch."""
        return self.m.loss == "ldam" and epoch < self.drw_epoch

    def loss(self, model, x, y_soft, idx, epoch):
        weights = None if self._plain_ldam(epoch) else self.class_weights
        # Under DDP on the global batch: the DB-OT losses and the weighted means couple the samples.
        logits, y_soft = global_batch(model(x).float(), y_soft)
        return longtail_loss(logits, y_soft, self.m, self.prior, weights, self.margins, self.dbot)


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


def infer(rule: str, m, logits, feats, weight, train_prior, test_prior, read: bool = True):
    """Predicted classes (N,) of `rule` from logits (N, K) (and features/classifier weights for cls_norm);
    the DB-OT rules solve where the logits live (a tensor on an accelerator; numpy on the host, there the
    faster path), the others take numpy. `read=False`: a DB-OT rule's on tensor logits come as a
    `PendingLabels` (`runner.methods.dbot.read_pending` reads them)."""
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
    with _underflow_named(m, logits):
        pred = dbot_predict(logits, test_prior, delta, m.eps, batch, m.solver, m.max_iter, m.tol, read)
    if isinstance(pred, PendingLabels):
        return pred
    return pred.numpy() if isinstance(pred, torch.Tensor) else pred  # a tensor's come back on the host


@contextlib.contextmanager
def _underflow_named(m, logits):
    """A DB-OT solve's kernel underflow (`FloatingPointError`, raised where its outcome is read) as the
    one line that names the fix."""
    try:
        yield
    except FloatingPointError:  # the Gibbs kernel exp(logit / eps) underflows at this run's logit range
        span = float(logits.max() - logits.min())
        raise ConfigError(
            f"method.eps={m.eps} is too small for method.solver={m.solver} at this run's logits (range "
            f"{span:.3g}: the Gibbs kernel underflows); set method.solver=dual or a larger method.eps"
        ) from None


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


def evaluate_rules(m, logits, feats, weight, y_test, train_counts, test_sets, ctx=None) -> dict:
    """Every rule of `m.inference` on every test set (index arrays into the test split), by class group,
    and the headline: `test/acc` (argmax on the uniform test set) and `test/acc_<m.predict>`; the DB-OT
    rules solve on the run's device where it is an accelerator, else on the host (see :func:`infer`)."""
    k = len(train_counts)
    train_prior = train_counts / train_counts.sum()
    on_device = None
    if ctx is not None and ctx.accelerator and any(rule in DBOT_RULES for rule in m.inference):
        # copied once without waiting (float64, as predicted); each test set's rows are gathered on the device
        on_device = to_device(torch.from_numpy(logits), ctx.device)
    preds = {}
    for name, idx in test_sets.items():
        test_prior = {
            "oracle_test": np.bincount(y_test[idx], minlength=k) / len(idx),
            "train": train_prior,
            "uniform": np.full(k, 1.0 / k),
        }[m.prior]
        if on_device is not None:
            rows = to_device(torch.from_numpy(idx), ctx.device)
        for rule in m.inference:
            there = rule in DBOT_RULES and on_device is not None  # solved on the device, read below
            given = on_device[rows] if there else logits[idx]
            preds[name, rule] = infer(rule, m, given, feats[idx], weight, train_prior, test_prior, not there)
    # every DB-OT rule of every test set read from the device in one copy
    pending = {key: pred for key, pred in preds.items() if isinstance(pred, PendingLabels)}
    for (name, rule), values in zip(pending, read_pending(list(pending.values()))):
        with _underflow_named(m, logits[test_sets[name]]):
            preds[name, rule] = pending[name, rule].labels(values)
    summary: dict = {}
    for name, idx in test_sets.items():
        y = y_test[idx]
        summary[f"{name}/n"] = len(idx)
        for rule in m.inference:
            accs = group_accuracies(preds[name, rule] == y, y, train_counts, m)
            summary |= {f"{name}/{rule}/{group}": acc for group, acc in accs.items()}
    main_set = "uniform" if "uniform" in test_sets else m.test_sets[0]
    idx = test_sets[main_set]
    return {
        "test/acc": float((logits[idx].argmax(1) == y_test[idx]).mean()),  # Table 1: plain argmax
        f"test/acc_{m.predict}": summary[f"{main_set}/{m.predict}/all"],
        **summary,
    }
