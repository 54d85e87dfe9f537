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
metrics on the whole test split are `fit/test/*` (`fit/test/acc`, `fit/test/acc_best`, ...); `val/acc`
keeps its name (the objective of a search). Where `train.select` tests another epoch than the last, every
one of these rule metrics is reported for the last epoch's weights too, as `<key>_last` (e.g.
`uniform/argmax/few_last`, `test/acc_sinkhorn_last`), read back from the fit's checkpoint.
"""

from __future__ import annotations

import copy
import logging

import numpy as np
import torch

from runner.checkpoint import load_checkpoint
from runner.checks import ConfigError
from runner.configs import hooks_factory
from runner.configs.longtail import METHODS, LongTailConfig  # noqa: F401  (tests import them here)
from runner.data import load_data
from runner.distributed_passes import broadcast_from_main, predict_all
from runner.hardware import state_on_device
from runner.hooks.dbot import evaluate_rules, resampled_test_sets
from runner.methods.dbot import CosineClassifier
from runner.models import build_model
from runner.task import Task
from runner.train import fit

log = logging.getLogger(__name__)


def smoke(cfg) -> None:
    """`+debug=smoke`: the subsets keep a sample of every class (the loss needs every training count,
    the long-tailed evaluation every test class)."""
    cfg.dataset.min_per_class = max(cfg.dataset.min_per_class, 1)


def last_epoch_model(model, fitted: dict, cfg, ctx):
    """A copy of `model` with the last epoch's weights where fit tested another epoch's (`train.select`),
    read from the fit's checkpoint (it holds the last epoch's weights beside the kept best); None where the
    tested model is the last one, or no checkpoint was written (`train.checkpoint=false`)."""
    if fitted.get("tested_model", "last") == "last":
        return None
    path = ctx.dir / "checkpoints" / "fit.pt"
    # rank 0 wrote it before its fit returned: its answer is also the other ranks' wait for the file
    if not broadcast_from_main(cfg.train.checkpoint and path.exists()):
        log.warning("no last-epoch rule metrics (*_last): train.checkpoint=false wrote no %s", path)
        return None
    last = copy.deepcopy(model)
    # read on the host (a checkpoint of another device loads), then onto the model's device in one copy
    last.load_state_dict(state_on_device(load_checkpoint(path, torch.device("cpu"))["model"], ctx.device))
    return last


class _LogitsAndFeatures(torch.nn.Module):
    """`net`'s logits and features (`forward_features`) side by side, so that one pass over the test
    split reads both to the host in one copy."""

    def __init__(self, net):
        super().__init__()
        self.net = net
        self.train(net.training)  # the mode a prediction restores `net` to afterwards

    def forward(self, x):
        return torch.cat([self.net(x).float(), self.net.forward_features(x).float()], 1)


def outputs_on_test(net, data, ctx) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(logits, features, classifier weights) of `net` on the test split, float64 on the host."""
    both = predict_all(_LogitsAndFeatures(net), data.test, ctx).double()
    logits, feats = both[:, : data.num_classes].contiguous(), both[:, data.num_classes :].contiguous()
    return logits.numpy(), feats.numpy(), net.classifier.weight.detach().double().cpu().numpy()


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
    # the hooks its registration declares (runner.hooks.dbot.LossHook)
    hooks = hooks_factory(m.name)(m, train_counts, ctx.device, cfg.train.epochs, stats)
    # tag "fit": its rows and epoch lines (accuracy on the whole test split) are named apart from the
    # test/* of the inference rules on the resampled test sets below
    fitted = fit(model, data, cfg.train, ctx, hooks, augment=cfg.dataset.augment, tag="fit")

    tested = {"": model, "_last": last_epoch_model(model, fitted, cfg, ctx)}
    outputs = {suffix: outputs_on_test(net, data, ctx) for suffix, net in tested.items() if net is not None}
    if not ctx.is_main:  # the inference rules run on rank 0, which writes the summary
        return {}
    y_test = data.test.y_clean.numpy()
    rng = np.random.default_rng(cfg.seed + 1)
    imbalance = m.test_imbalance or data.meta.get("imbalance", cfg.dataset.imbalance)
    test_sets = resampled_test_sets(y_test, k, imbalance, m.test_sets, rng)

    summary = {f"fit/{key}" if key.startswith("test/") else key: value for key, value in fitted.items()}
    summary["train/counts"] = [int(c) for c in train_counts]
    # the DB-OT rules solve where the model ran: float64 on the accelerator, else numpy on the host
    for suffix, (logits, feats, weight) in outputs.items():
        rules = evaluate_rules(m, logits, feats, weight, y_test, train_counts, test_sets, ctx)
        summary |= {key + suffix: value for key, value in rules.items()}
    return summary


TASK = Task("longtail", ("test/acc", "max"), run, smoke=smoke)
