"""Optimizers and lr schedules: the config's optimizer (`train.optimizer`, weight-decay groups), its epoch
schedule, the progressive phases' per-step lr (`train.phases`, `Phases`), and a resumed run following its
config's settings (`follow_config`)."""

from __future__ import annotations

import logging

import numpy as np
import torch

log = logging.getLogger(__name__)


# Parameters kept free of weight decay under train.bn_weight_decay=false: those of normalisation layers.
NORM_LAYERS = (torch.nn.modules.batchnorm._NormBase, torch.nn.GroupNorm, torch.nn.LayerNorm)


def decay_groups(model) -> list[dict]:
    """`model`'s parameters as two optimizer groups: normalisation layers' and biases without weight decay
    (Goyal et al. 2017; Co-Mixup's ImageNet code), every other parameter with it."""
    decay, no_decay = [], []
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            (no_decay if isinstance(module, NORM_LAYERS) or name == "bias" else decay).append(param)
    return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]


def adam_kernel(fused: bool) -> dict:
    """Adam's keywords for `fused`: one kernel, its step count kept on the device (capturable), as a graph
    needs; none otherwise."""
    return {"fused": True, "capturable": True} if fused else {}


def make_optimizer(model, cfg, fused: bool = False):
    """`train.optimizer` over `model`'s parameters; `fused`: one kernel for all of them (CUDA's fast path,
    and a tensor lr without a host read, which a captured step needs)."""
    params = model.parameters() if cfg.bn_weight_decay else decay_groups(model)
    if cfg.optimizer == "adam":
        return torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay, **adam_kernel(fused))
    kernel = {"fused": True} if fused else {}
    return torch.optim.SGD(
        params,
        lr=cfg.lr,
        momentum=cfg.momentum,
        nesterov=cfg.nesterov,
        weight_decay=cfg.weight_decay,
        **kernel,
    )


def set_lr(group: dict, lr: float) -> None:
    """An optimizer group's lr, written in place where it is a tensor (a captured step reads it there)."""
    if isinstance(group["lr"], torch.Tensor):
        group["lr"].fill_(lr)
    else:
        group["lr"] = lr


def make_scheduler(optimizer, cfg):
    if cfg.schedule == "cosine":
        cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(cfg.epochs, 1))
        if not cfg.cosine_delay:
            return cosine
        # the initial lr for `cosine_delay` epochs, then the same cosine from its start (the CSOT code
        # creates its scheduler after the first epoch)
        hold = torch.optim.lr_scheduler.ConstantLR(optimizer, factor=1.0, total_iters=cfg.cosine_delay)
        return torch.optim.lr_scheduler.SequentialLR(optimizer, [hold, cosine], milestones=[cfg.cosine_delay])
    milestones = list(cfg.milestones) if cfg.schedule == "step" else []
    return torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=milestones, gamma=cfg.gamma)


class Phases:
    """`train.phases` as the loop reads them: the phase of an epoch, and the lr of a step, linear within
    its phase in the fractional epoch `epoch + (step + 1) / steps` (the Co-Mixup ImageNet code's
    `np.interp` of the lr at the end of each step). Stateless, so a resume anywhere continues exactly."""

    def __init__(self, phases):
        self.phases = list(phases)
        self.starts = np.cumsum([0] + [phase.epochs for phase in self.phases])

    def index(self, epoch: int) -> int:
        return int(np.searchsorted(self.starts, epoch, side="right")) - 1

    def at(self, epoch: int):
        return self.phases[self.index(epoch)]

    def lr(self, epoch: int, step: int, steps: int) -> float:
        i = self.index(epoch)
        (start, end), done = self.phases[i].lr, epoch - self.starts[i] + (step + 1) / steps
        return start + (end - start) * done / self.phases[i].epochs

    def set_lr(self, optimizer, epoch: int, step: int, steps: int) -> None:
        lr = self.lr(epoch, step, steps)
        for group in optimizer.param_groups:
            set_lr(group, lr)


def final_image_size(cfg) -> int:
    """The image side a `TrainConfig`'s training ends at (its last epoch's phase; 0: the data's own)."""
    return Phases(cfg.phases).at(cfg.epochs - 1).image_size if cfg.phases else 0


def follow_config(optimizer, scheduler, cfg) -> None:
    """After a resume, the optimizer settings and lr schedule of `cfg` rather than the checkpoint's,
    from the restored epoch on: a run extended by `train.epochs`, or resumed with a changed lr under
    `train.resume=force`, trains as its config.yaml says. Nothing changes when they agree (so a plain
    resume stays exact)."""
    epoch = scheduler.last_epoch
    # The config's settings and schedule, stepped to the restored epoch (a stand-in that draws no RNG).
    stand_in = make_optimizer(torch.nn.ParameterList([torch.zeros(1)]), cfg)
    reference = make_scheduler(stand_in, cfg)
    for _ in range(epoch):
        stand_in.step()
        reference.step()
    # _schedulers: those train.cosine_delay chains (SequentialLR)
    keys = ("base_lrs", "T_max", "eta_min", "milestones", "gamma", "_schedulers")
    # group by group: under train.bn_weight_decay=false the second group has no weight decay
    kernel_keys = ("lr", "fused", "foreach")  # the stand-in's kernels are not the config's to follow
    wanted = [{k: g[k] for k in stand_in.defaults if k not in kernel_keys} | {"initial_lr": cfg.lr}
              for g in stand_in.param_groups]  # fmt: skip
    pairs = list(zip(optimizer.param_groups, wanted))
    same = all(g.get(k) == v for g, w in pairs for k, v in w.items())
    if same and all(scheduler.state_dict().get(k) == reference.state_dict().get(k) for k in keys):
        return
    for group, w in pairs:
        group.update(w)
        set_lr(group, reference.get_last_lr()[0])
    scheduler.load_state_dict(reference.state_dict())
    log.info("resumed with the config's optimizer settings and schedule: lr %g at epoch %d",
             reference.get_last_lr()[0], epoch + 1)  # fmt: skip
