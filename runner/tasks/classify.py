"""Supervised classification: plain ERM, or ERM with a method's training hooks (e.g. a batch mixup).

Without `+method=`, this task trains the dataset's baseline. A method of this task declares its schema,
its hooks factory `(method_cfg, data, ctx) -> MethodHooks | None` and its presets in one place,
`runner.configs.register_method` in runner/configs/classify.py (docs/adding-a-method.md).
"""

from __future__ import annotations

from runner.canvas_metrics import canvas_metrics
from runner.checks import ConfigError
from runner.configs import hooks_factory
from runner.configs.classify import METHODS, MIXUP, CoMixupConfig, PuzzleMixConfig  # noqa: F401  (tests import them here)
from runner.data import load_data
from runner.data.imagenet_boxes import add_val_boxes
from runner.hooks import check_batch
from runner.models import build_model
from runner.task import Task
from runner.train import fit


def run(cfg, ctx) -> dict:
    data = load_data(cfg.dataset, cfg.seed)
    add_val_boxes(data, cfg.dataset.imagenet_boxes)  # read before training: a bad file fails at once
    model = build_model(cfg.model, data.input_shape, data.num_classes)
    method = cfg.get("method")
    if method is not None and method.name == "manifold_mixup" and cfg.hardware.compile != "false":
        # its forward hooks, added after the first compiled call, would be skipped by the compiled graph
        raise ConfigError(
            f"method=manifold_mixup does not run with hardware.compile={cfg.hardware.compile}; "
            "set it to false"
        )
    if method is not None and any(method.name == c.name for c in MIXUP):
        why = f"method={method.name} (it mixes inputs of a batch)"
        train = cfg.train
        check_batch("train.batch_size", train.batch_size, ctx, len(data.train), 2, why, train.accumulate)
    factory = hooks_factory(method.name) if method is not None else None
    hooks = factory(method, data, ctx) if factory is not None else None
    summary = fit(model, data, cfg.train, ctx, hooks, augment=cfg.dataset.augment)
    if "boxes" in data.meta:  # digits_canvas, ImageNet val: error, ECE, CAM localisation, corruptions
        summary.update(canvas_metrics(model, data, ctx))
    return summary


TASK = Task("classify", ("test/acc", "max"), run)
