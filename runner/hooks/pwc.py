"""PWC in training: the classifier of the covering task (`runner/tasks/covering.py`), beside its library
`runner.methods.pwc`.

`features=net` covers in the embedding (`forward_features`) of a classifier, and the `entropy`
baseline picks the application samples on which it is least certain. The classifier is trained as
the development data would have been collected: on the train split with the missing class cut to
`dev_share` of it, through the shared loop `runner.train.fit`, or loaded from a runner checkpoint.
"""

from __future__ import annotations

import numpy as np
import torch

from runner.checks import ConfigError

__all__ = ["COVER_KEYS", "cover_options", "predictive_entropy", "share_count", "trained_model"]

#: the keyword options of `runner.methods.pwc.cover` that a pwc method config sets, under the same names
COVER_KEYS = ("batch", "eta", "reg", "reg_relative", "max_iter", "tol", "mip_gap")


def cover_options(method_cfg) -> dict:
    """The `cover` options of a pwc method config (the task and the benchmark call `cover` alike)."""
    return {key: getattr(method_cfg, key) for key in COVER_KEYS}


def share_count(share: float, n: int) -> int:
    """round(share * n), halves up (Python's round(0.5) is 0)."""
    return int(np.floor(share * n + 0.5))


def trained_model(cfg, ctx, data):
    """`cfg.model` loaded from method.checkpoint, or trained on the train split with the missing class cut
    to dev_share of it (n_missing / (n_missing + n_others) = dev_share)."""
    from runner.checkpoint import load_checkpoint
    from runner.data import Data
    from runner.models import build_model
    from runner.train import fit

    m = cfg.method
    model = build_model(cfg.model, data.input_shape, data.num_classes)
    if m.checkpoint:
        try:
            model.load_state_dict(load_checkpoint(m.checkpoint, "cpu")["model"])
        except (OSError, KeyError, RuntimeError) as e:
            raise ConfigError(
                f"method.checkpoint={m.checkpoint!r}: not a runner checkpoint of this model ({e})"
            ) from None
    else:
        y = data.train.y_clean.numpy()
        rng = np.random.default_rng(cfg.seed + 1)
        others = np.flatnonzero(y != m.missing_class)
        n_missing = share_count(m.dev_share / (1 - m.dev_share), len(others))
        missing = rng.permutation(np.flatnonzero(y == m.missing_class))[:n_missing]
        train = data.train.subset(np.sort(np.r_[others, missing]))
        cut = Data(train, data.val, data.test, data.num_classes, data.input_shape, data.meta)
        fit(model, cut, cfg.train, ctx, augment=cfg.dataset.augment)
    return model.to(ctx.device)


def predictive_entropy(logits: torch.Tensor) -> np.ndarray:
    """-sum_j p_j log p_j of softmax(logits), per row (nats).

    >>> predictive_entropy(torch.tensor([[0.0, 0.0], [100.0, 0.0]])).round(4).tolist()  # ln 2, 0
    [0.6931, 0.0]
    """
    log_p = torch.log_softmax(logits.double(), dim=1)
    return -(log_p.exp() * log_p).sum(1).numpy()
