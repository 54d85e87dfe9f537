"""`+debug=smoke`: a typed job config bounded to a quick run (`apply_debug`)."""

from __future__ import annotations

import math

from omegaconf import DictConfig

from runner.data import natural_side
from runner.task import task_of


def apply_debug(cfg: DictConfig) -> str | None:
    """Bound a typed job config in place to `cfg.debug`: epochs, random subsets of the data of
    `max_batches` batches per split, and on the CPU its batches and image sides; its task bounds its own
    method keys (`Task.smoke`). Returns the line that says what smoke changed past the subsets, if any."""
    debug = cfg.get("debug")
    if debug is None:
        return None
    notes = ["random weights in place of the preset's pretrained ones"] if debug.random_weights else []
    if cfg.hardware.device == "cpu":
        notes += _cap_for_the_cpu(cfg, debug.cpu_batch, debug.cpu_side)
    if cfg.dataset.name == "fake" and cfg.train.select.startswith("best:val/"):  # the same restore
        cfg.train.select = "best:test/" + cfg.train.select.removeprefix("best:val/")
        notes.append(f"train.select={cfg.train.select} (generated data have no validation split)")
    cfg.train.epochs = min(cfg.train.epochs, debug.epochs)
    for key, batch in (("max_train", cfg.train.batch_size), ("max_eval", cfg.train.eval_batch_size)):
        cfg.dataset[key] = min(cfg.dataset[key] or math.inf, debug.max_batches * batch)
    task_of(cfg).smoke(cfg)
    return f"+debug=smoke: {'; '.join(notes)}" if notes else None


def _cap_for_the_cpu(cfg: DictConfig, batch: int, side: int) -> list[str]:
    """Cap the evaluation batch at `batch` (its subsets are `max_batches` of them: 2 x 1024 CIFAR images
    took a ResNeXt-29 most of a smoke minute) and, where the images are larger than 32 px (smaller ones
    train cheaply), every batch size at `batch` and every image side at `side`, in place; what it capped."""
    batches, sides = {}, {}  # the capped keys (a phase's as train.phases.*) and their values
    large = max([natural_side(cfg.dataset)] + [phase.image_size for phase in cfg.train.phases]) > 32
    keys = [(cfg.train, "batch_size", "train.batch_size")] if large else []
    keys += [(cfg.train, "eval_batch_size", "train.eval_batch_size")]
    keys += [(phase, "batch_size", "train.phases.*.batch_size") for phase in cfg.train.phases if large]
    for node, key, where in keys:
        if node[key] > batch:
            batches.setdefault(where, node[key])
            node[key] = batch
    if large and natural_side(cfg.dataset) > side:
        sides["dataset.image_size"] = natural_side(cfg.dataset)
        cfg.dataset.image_size = side
    for phase in cfg.train.phases if large else []:
        if phase.image_size > side:
            sides.setdefault("train.phases.*.image_size", phase.image_size)
            phase.image_size = side
    capped = [f"{', '.join(batches)} at {batch}"] if batches else []
    capped += [f"{', '.join(sides)} at {side} px"] if sides else []
    return [f"on the CPU, {' and '.join(capped)} (debug.cpu_batch, debug.cpu_side)"] if capped else []
