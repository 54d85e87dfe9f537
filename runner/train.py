"""The training loop every classification-style task shares, and the one data path every consumer uses.

Every walk over a dataset goes through `batches` (training: the epoch's index batches of this rank;
evaluation and per-epoch method passes: `predict`), so the same code serves in-memory splits (sliced on the
device) and file-backed ones (a DataLoader with `hardware.num_workers` decoding processes and pinned
memory). `fit` trains, evaluates val, test and any extra splits each epoch, logs to the tracker,
checkpoints (every epoch, every `train.checkpoint_every_minutes` and on a stop signal) and resumes from
the last checkpoint in the run dir at the same step (`Resumable`). Methods plug in through a subclass
of `runner.hooks.MethodHooks` (`runner.method_hooks`), whose docstring lists every hook the loop calls
(a per-epoch pass, a batch transform, the loss, the optimizer, the evaluation, the batches, checkpointed
state, and whether the step may be captured or split) with the loop's default for each.

Training by iterations: a hook's sampler cuts them into epochs (the unit of logging, evaluation and
epoch-end checkpoints) and its per-step scheduler follows the iteration count.

Progressive training (`train.phases`, `Phases`): each phase's epochs run at its batch size and image side
(the batches are made anew where those change) with its lr ramp, set before every step.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from runner.data import Data, Split
from runner.data.files import UNREADABLE
from runner.data.views import augment_crop_flip
from runner.faults import CheckpointError, Diverged, StopSignals, out_of_memory_stops
from runner.hardware import RunContext, Stopwatch, all_reduce_sum, renew_host_memory_cap
from runner.method_hooks import MethodHooks, PlainTraining
from runner.metrics import calibration_bins, expected_calibration_error, history_summary, reliability_plot
from runner.schema import ConfigError
from runner.untrusted import RefusedPickle, torch_load

log = logging.getLogger(__name__)

CHECKPOINT = "checkpoints/last.pt"
# Evaluated metrics whose per-epoch values a fit keeps: their best, last and median of the last 10
# (the Co-Mixup tables' headline; val/acc's is what a search on test/acc_median10 selects on).
HISTORY_KEYS = ("val/acc", "test/acc")


def soft_cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean over the batch of -sum_k target_k log softmax(logits)_k."""
    return -(target * F.log_softmax(logits, dim=1)).sum(dim=1).mean()


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


def make_optimizer(model, cfg, fused: bool = False):
    """`train.optimizer` over `model`'s parameters; `fused`: one kernel for all of them (CUDA's fast path,
    and a tensor lr without a host read, which a captured step needs)."""
    params = model.parameters() if cfg.bn_weight_decay else decay_groups(model)
    kernel = {"fused": True} if fused else {}
    if cfg.optimizer == "adam":  # capturable: its step count stays on the device, as a graph needs
        capturable = {"capturable": True} if fused else {}
        return torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay, **kernel, **capturable)
    return torch.optim.SGD(
        params, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov, weight_decay=cfg.weight_decay,
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


class EpochBatches:
    """This rank's index batches of one epoch: a permutation seeded by (seed, epoch), the same on every
    rank, cut into global batches of `batch_size` (the last partial one dropped); each rank takes an
    interleaved shard of every global batch, so ranks read disjoint samples and together see one
    process's batches. `set_epoch(epoch, start=s)` skips the first s batches (mid-epoch resume)."""

    def __init__(self, n: int, batch_size: int, rank: int = 0, world_size: int = 1, seed: int = 0):
        self.n, self.batch_size, self.rank, self.world_size, self.seed = n, batch_size, rank, world_size, seed
        self.epoch, self.start = 0, 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.epoch, self.start = epoch, start

    def __len__(self) -> int:
        return max(1, self.n // self.batch_size)

    def __iter__(self):
        g = torch.Generator().manual_seed((self.seed * 1_000_003 + self.epoch) % 2**63)
        order = torch.randperm(self.n, generator=g)[: len(self) * self.batch_size]
        shards = order[self.rank :: self.world_size].split(self.batch_size // self.world_size)
        return iter(shards[self.start :])


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


def _on_device(split: Split, device: torch.device) -> torch.Tensor:
    """`split.x` on `device`, copied once per split (and again only if `split.x` is replaced)."""
    cached = split.__dict__.get("_device_copy")
    if cached is None or cached[0] is not split.x or cached[1].device != device:
        cached = (split.x, split.x.to(device))
        split.__dict__["_device_copy"] = cached
    return cached[1]


def batches(
    split, ctx: RunContext, index_batches, augment: str = "none", crop_pad: int = 4, image_size: int = 0
):
    """An iterable of `(x, idx)` over `index_batches` (an iterable of index tensors, e.g. EpochBatches),
    `x` float network input and `idx` the batch's int64 sample indices, both on `ctx.device`; with
    `image_size` > 0, images resized on the device to that side (a training phase's, `train.phases`).

    In-memory splits are sliced on the device (augment="crop_flip": random crop + flip there), the
    epoch's indices copied there at once; a FileSplit is read by a DataLoader whose workers decode and
    transform (its training transform when `augment` is not "none") into pinned memory, and `decode`
    makes network input of the batch on the device. Re-iterate the returned object each epoch
    (DataLoader workers persist).
    """
    if not isinstance(split, Split):  # FileSplit, FakeSplit: a map-style dataset read by workers
        # Workers' seeds from a generator of this rank: ranks must not repeat each other's augmentations.
        seeds = torch.Generator().manual_seed((torch.initial_seed() + 7919 * ctx.rank) % 2**63)
        loader = torch.utils.data.DataLoader(
            split.dataset(train=augment != "none"),
            batch_sampler=_AsLists(index_batches),
            num_workers=ctx.num_workers,
            pin_memory=ctx.device.type == "cuda",
            persistent_workers=ctx.num_workers > 0,
            generator=seeds,
        )
        return _ToDevice(loader, ctx, split, image_size)
    if augment not in ("none", "crop_flip"):
        raise ConfigError(
            f"dataset.augment={augment!r} needs a file-backed dataset; in-memory data take none or crop_flip"
        )
    return _SliceBatches(split, ctx, index_batches, augment, crop_pad, image_size)


def resized(x: torch.Tensor, side: int) -> torch.Tensor:
    """A batch of images at `side` x `side` (antialiased bilinear, as PIL's resize); as it is when `side`
    is 0 or already its size."""
    if not side or x.shape[-2:] == (side, side):
        return x
    return F.interpolate(x, size=(side, side), mode="bilinear", antialias=True, align_corners=False)


class _AsLists:
    """Index tensors as lists, what a DataLoader's workers expect; each iteration re-reads `batches` (so
    an EpochBatches' set_epoch takes effect)."""

    def __init__(self, index_batches):
        self.index_batches = index_batches

    def __len__(self) -> int:
        return len(self.index_batches)

    def __iter__(self):
        return (idx.tolist() for idx in self.index_batches)


class _ToDevice:
    """The workers' (pinned) batches moved to the device without waiting, decoded there by `split.decode`."""

    def __init__(self, loader, ctx: RunContext, split, image_size: int = 0):
        self.loader, self.ctx, self.split, self.image_size = loader, ctx, split, image_size

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        for x, idx, *skipped in self.loader:  # ImageFiles' batches name the unreadable files they skipped
            if skipped:
                UNREADABLE.record(skipped[0])
            x = resized(self.split.decode(x.to(self.ctx.device, non_blocking=True)), self.image_size)
            yield self.ctx.to_input(x), idx.to(self.ctx.device, non_blocking=True)


class _SliceBatches:
    def __init__(
        self, split: Split, ctx: RunContext, index_batches, augment: str, crop_pad: int, image_size: int
    ):
        self.split, self.ctx, self.index_batches = split, ctx, index_batches
        self.augment, self.crop_pad, self.image_size = augment, crop_pad, image_size

    def __len__(self) -> int:
        return len(self.index_batches)

    def __iter__(self):
        x_all = _on_device(self.split, self.ctx.device)
        host = list(self.index_batches)
        if not host:
            return
        # One copy of the epoch's indices (a copy per batch would wait for the device each step).
        order = self.ctx.pin(torch.cat(host)).to(self.ctx.device, non_blocking=True)
        for idx in order.split([len(i) for i in host]):
            x = self.split.decode(x_all[idx])
            if self.augment == "crop_flip":
                x = augment_crop_flip(x, self.crop_pad)
            yield self.ctx.to_input(resized(x, self.image_size)), idx


def in_order(n: int, batch_size: int) -> list[torch.Tensor]:
    """Index batches 0..n-1 in order (evaluation and per-epoch passes); none when n = 0."""
    return list(torch.arange(n).split(batch_size)) if n else []


# Decoded 224-px float batches are large (1024 of them: 617 MB, times the workers' prefetch): passes over
# file-backed splits read them in batches of at most this many.
STREAMED_EVAL_BATCH = 256


# Outputs of a pass stay on the device up to this many bytes, then go to the host in one copy (a copy per
# batch would wait for the device each batch; holding ImageNet's features there would not fit).
HOST_COPY_BYTES = 256 * 2**20


def _eval_batches(model, source, ctx: RunContext, batch_size: int):
    """`(x, idx)` of `source` in index order without augmentation (file-backed splits in batches of at most
    STREAMED_EVAL_BATCH), at `ctx.eval_image_size`, with `model` in eval mode meanwhile."""
    if not isinstance(source, Split):
        batch_size = min(batch_size, STREAMED_EVAL_BATCH)
    was_training = model.training
    model.eval()
    try:
        yield from batches(source, ctx, in_order(len(source), batch_size), image_size=ctx.eval_image_size)
    finally:
        model.train(was_training)


@torch.no_grad()
def predict(model, source, ctx: RunContext, batch_size: int = 1024, features: bool = False) -> torch.Tensor:
    """Logits (with features=True: `forward_features`) for every sample of `source` (a split, or a
    tensor of inputs) in index order, in eval mode without augmentation, returned on the CPU."""
    if isinstance(source, torch.Tensor):
        source = Split(
            source, torch.zeros(len(source), dtype=torch.long), torch.zeros(len(source), dtype=torch.long)
        )
    forward = model.forward_features if features else model
    host, pending = [], []
    for x, _ in _eval_batches(model, source, ctx, batch_size):
        with ctx.autocast():
            pending.append(forward(x).float())
        if sum(p.nbytes for p in pending) >= HOST_COPY_BYTES:
            host.append(torch.cat(pending).cpu())
            pending = []
    if pending:
        host.append(torch.cat(pending).cpu())
    return torch.cat(host) if host else torch.empty(0)


@torch.no_grad()
def evaluate(
    model, split, ctx: RunContext, batch_size: int = 1024, top5: bool = False, bins: int = 15
) -> dict:
    """Accuracy (and top-5 accuracy), mean cross-entropy and ECE (`bins` bins) against the clean labels;
    each rank takes an interleaved shard, the sums are kept on the device, reduced over ranks and read
    once. `calibration` holds the bins (for `reliability_plot`)."""
    shard = split.subset(torch.arange(ctx.rank, len(split), ctx.world_size)) if ctx.distributed else split
    y_clean = ctx.pin(shard.y_clean).to(ctx.device, non_blocking=True)
    sums = torch.zeros(4 + 3 * bins, dtype=torch.float64, device=ctx.device)
    for x, idx in _eval_batches(model, shard, ctx, batch_size):
        with ctx.autocast():
            logits = model(x).float()
        y = y_clean[idx]
        top = logits.topk(min(5, logits.shape[1]), dim=1).indices
        sums[0] += (top[:, 0] == y).sum()
        sums[1] += (top == y[:, None]).any(1).sum()
        sums[2] += F.cross_entropy(logits, y, reduction="sum")
        sums[3] += len(y)
        sums[4:] += calibration_bins(logits.softmax(1), y, bins).flatten()
    reduced = all_reduce_sum(sums).cpu()
    correct, correct5, loss, n = reduced[:4].tolist()
    binned = reduced[4:].view(3, -1)
    out = {"acc": correct / max(n, 1), "loss": loss / max(n, 1), "ece": expected_calibration_error(binned)}
    if top5:
        out["acc5"] = correct5 / max(n, 1)
    out["calibration"] = binned
    return out


def _evaluate_splits(
    model, data: Data, ctx: RunContext, batch_size: int, bins: int = 15
) -> tuple[dict, dict]:
    """(`<split>/<metric>` for every evaluation split, the calibration bins by split); ECE over `bins`."""
    metrics, calibration = {}, {}
    for name, split in data.eval_splits().items():
        result = evaluate(model, split, ctx, batch_size, top5=data.meta.get("top5", False), bins=bins)
        calibration[name] = result.pop("calibration")
        metrics.update({f"{name}/{key}": value for key, value in result.items()})
    return metrics, calibration


def save_checkpoint(path, state) -> None:
    """torch.save `state` to `path` atomically (a temporary file, then a rename): a kill, a full disk or
    an unwritable run dir during the save leaves the previous checkpoint intact (CheckpointError)."""
    path = Path(path)
    tmp = path.with_suffix(".tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(state, tmp)
        tmp.replace(path)
    except (OSError, RuntimeError) as e:  # torch's writer raises RuntimeError on a full disk
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise CheckpointError(f"cannot write {path} ({_first_line(e)}); the previous one is intact") from None


def load_checkpoint(path, device) -> dict:
    """`torch.load` a checkpoint with `weights_only=True` (a run dir can come from someone else: no
    unpickled object may run code); CheckpointError naming the file (which is kept) if it cannot be read."""
    try:
        return torch_load(path, device)
    except RefusedPickle:
        raise CheckpointError(
            f"{path} holds pickled objects other than tensors, numbers, containers and numpy arrays, "
            "which could run code: not loaded (only runner checkpoints load)"
        ) from None
    except Exception as e:  # truncated or corrupt: zip, pickle and EOF errors, among others
        raise CheckpointError(
            f"cannot read checkpoint {path} ({type(e).__name__}: {_first_line(e)}); the file is kept: "
            "move it away to start the run over"
        ) from None


def rng_state(device: torch.device) -> dict:
    """Every random stream a run draws from: torch's (CPU, and `device`'s if CUDA), numpy's, Python's."""
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"].cpu())  # map_location moved the tensors to the device
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)


class Resumable:
    """Everything a checkpoint holds, for one training loop: the model, its optimizer, scheduler and loss
    scaler, the method hooks' `state_dict`, every RNG, and the loop's position (`epoch`, and `step`: the
    batches done in that epoch, or None once the epoch is complete) with its `extra` bookkeeping.

    `resume()` restores the run dir's checkpoint into them (if any) and returns its position; `save()`
    writes one at a position, refusing non-finite weights. One object per loop, so another loop (e.g.
    iterations instead of epochs) reuses it whole."""

    def __init__(
        self, path, ctx: RunContext, model, optimizer, scheduler, scaler, hooks: MethodHooks, parts=None
    ):
        self.path, self.ctx, self.model, self.hooks = Path(path), ctx, model, hooks
        self.parts = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "scaler": scaler}
        self.parts.update({key: part for key, part in (parts or {}).items() if part is not None})
        self.last = "none written yet"  # the last good checkpoint, for error messages

    def resume(self) -> tuple[int, int | None, dict] | None:
        """(epoch, step, extra) of the checkpoint just restored, or None without one."""
        if not self.path.exists():
            return None
        state = load_checkpoint(self.path, self.ctx.device)
        try:
            for key, part in self.parts.items():
                part.load_state_dict(state[key])
            if state.get("hooks") is not None:
                self.hooks.load_state_dict(state["hooks"])
            set_rng_state(state["rng"], self.ctx.device)
        except (KeyError, RuntimeError, TypeError, ValueError) as e:  # another model, an older format
            raise CheckpointError(
                f"checkpoint {self.path} does not fit this run ({type(e).__name__}: {_first_line(e)}); "
                "the file is kept"
            ) from None
        self.last = f"{self.path} ({_position(state['epoch'], state.get('step'))})"
        log.info("resumed from %s", self.last)
        return state["epoch"], state.get("step"), state.get("extra", {})

    def save(self, epoch: int, step: int | None, extra: dict) -> None:
        params = [p.detach() for p in self.model.parameters()]
        if params and not bool(torch.stack([torch.isfinite(p).all() for p in params]).all()):
            raise Diverged(
                f"non-finite parameters at {_position(epoch, step)}; last good checkpoint: {self.last}"
            )
        state = {key: part.state_dict() for key, part in self.parts.items()}
        state.update(epoch=epoch, step=step, extra=extra, rng=rng_state(self.ctx.device))
        state["hooks"] = self.hooks.state_dict()
        save_checkpoint(self.path, state)
        self.last = f"{self.path} ({_position(epoch, step)})"


def _position(epoch: int, step: int | None) -> str:
    return f"end of epoch {epoch + 1}" if step is None else f"epoch {epoch + 1}, step {step}"


def _first_line(error: BaseException) -> str:
    """An exception's message on one line, cut to its first sentence (torch's run on for lines)."""
    text = " ".join(str(error).split())
    return text[: text.find(". ", 40) + 1 or None][:300]


@dataclass
class Step:
    """What one training step uses (`train_step`): the network to train through (compiled, or wrapped
    in DDP) and the model the hooks see (`hook_net`: the same, compiled if asked, for the batch
    transform's own passes), the optimizer, its scheduler (stepped per batch if `per_step`)
    and loss scaler, the training labels on the device, the method's `transform`, `loss` and `draw`
    hooks, the micro-batches per step (`accumulate`), the gradient-norm bound (`clip`, 0: none) and the
    EMA of the weights (`ema`, an `AveragedModel`, or None). Kept on the device for the epoch's row: the
    steps the fp16 scaler skipped, and the sum and count of finite pre-clip gradient norms."""

    net: torch.nn.Module
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: object
    per_step: bool
    scaler: torch.amp.GradScaler
    ctx: RunContext
    y_train: torch.Tensor
    num_classes: int
    transform: object = None
    loss: object = None
    accumulate: int = 1
    clip: float = 0.0
    ema: torch.nn.Module | None = None
    transform_time: Stopwatch | None = None
    skipped: torch.Tensor | None = None
    grad_norm: torch.Tensor | None = None  # [sum, count]
    hook_net: torch.nn.Module | None = None  # what the transform runs its own passes (saliency) through
    step_fn: object = None  # eager_step, or its torch.compile'd twin (set by _Loop)
    draw: object = None  # the method's host draws before each step (`MethodHooks.draw`)
    graphed: GraphedStep | None = None  # the step captured as one CUDA graph (hardware.cuda_graph)


def train_step(s: Step, x: torch.Tensor, idx: torch.Tensor, epoch: int) -> torch.Tensor:
    """One training step: the method's host draws (`draw_step`), then the step replayed from its CUDA graph
    (`s.graphed`) or run by `s.step_fn` (`eager_step`, compiled where asked); the batch's mean loss, on the
    device."""
    drawn = draw_step(s, x, idx)
    if s.graphed is not None:
        return s.graphed(x, idx, epoch, drawn)
    return s.step_fn(s, x, idx, epoch, drawn)


def draw_step(s: Step, x: torch.Tensor, idx: torch.Tensor) -> list[tuple]:
    """The method's host draws for each micro-batch of the step (`MethodHooks.draw`), in the order the step
    takes them, on the device; [] for a method that draws nothing on the host."""
    if s.draw is None:
        return []
    return [s.draw(x_part, _targets(s, idx_part), idx_part, s.hook_net)
            for x_part, idx_part in zip(x.chunk(s.accumulate), idx.chunk(s.accumulate))]  # fmt: skip


def eager_step(s: Step, x: torch.Tensor, idx: torch.Tensor, epoch: int, drawn: list[tuple]) -> torch.Tensor:
    """batch -> transform -> loss -> backward (per micro-batch, each with its `drawn` values) -> clip ->
    optimizer step -> EMA; returns the batch's mean loss, detached, on the device (nothing here waits for
    the device)."""
    s.optimizer.zero_grad(set_to_none=True)
    total = 0.0
    for i, (x_part, idx_part) in enumerate(zip(x.chunk(s.accumulate), idx.chunk(s.accumulate))):
        # Under DDP the gradients are all-reduced once, with the last micro-batch's backward.
        last = i == s.accumulate - 1
        with contextlib.nullcontext() if last or not hasattr(s.net, "no_sync") else s.net.no_sync():
            loss = _loss(s, x_part, idx_part, epoch, drawn[i] if drawn else None)
            s.scaler.scale(loss / s.accumulate if s.accumulate > 1 else loss).backward()
        total = total + loss.detach()
    if s.clip:
        s.scaler.unscale_(s.optimizer)  # the bound is on the true gradient, not the fp16-scaled one
        norm = torch.nn.utils.clip_grad_norm_(s.model.parameters(), s.clip)
        finite = torch.isfinite(norm)
        s.grad_norm += torch.stack([torch.where(finite, norm, 0.0), finite.float()])
    s.scaler.step(s.optimizer)
    if s.scaler.is_enabled():  # a step with inf/NaN gradients was skipped; update() then lowers the scale
        s.skipped += sum(s.scaler._found_inf_per_device(s.optimizer).values())
    s.scaler.update()
    if s.per_step:
        s.scheduler.step()
    if s.ema is not None:
        s.ema.update_parameters(s.model)
    return total / s.accumulate


def captured_region(
    s: Step, x: torch.Tensor, idx: torch.Tensor, epoch: int, drawn: list[tuple]
) -> torch.Tensor:
    """What `GraphedStep` captures: the step on its static inputs (`runner.device_tracking` counts what
    runs here: no host read and no host-made tensor may, or the replays would repeat stale values)."""
    return s.step_fn(s, x, idx, epoch, drawn)


def not_capturable(s: Step, hooks: MethodHooks) -> str | None:
    """Why the step of this fit cannot be captured as one CUDA graph, or None when it can: every step
    must run the same device work on the same memory, with no host read or host-made value inside."""
    ctx = s.ctx
    if ctx.distributed:
        return "DDP's gradient buckets are not captured"
    if s.scaler.is_enabled():
        return "fp16 loss scaling skips steps on the host's word"
    if s.ema is not None:
        return "the weights' EMA reads its count on the host"
    if ctx.compile == "reduce-overhead":
        return "torch.compile's reduce-overhead mode captures graphs of its own"
    if not hooks.capturable:
        return f"the method's hooks ({type(hooks).__name__}): {hooks.why_not_capturable}"
    if not all(group.get("fused") for group in s.optimizer.param_groups):
        return "the method's optimizer is not fused (its lr would be read on the host)"
    return None


class GraphedStep:
    """`captured_region` captured as one CUDA graph and replayed each step: one launch for the network's
    forward, backward, loss and optimizer step, where the eager step launches hundreds from Python.

    The batch and the method's host draws (`MethodHooks.draw`) are copied into static buffers before each
    replay; the lr lives in a tensor on the device (`set_lr` and the schedulers write it in place), so the
    schedules hold. Each batch shape (with the hooks' `capture_key`) is first run `WARMUP` times eagerly
    on a side stream (cuDNN's autotuning, the optimizer's lazy state, a method's constants made at its
    first call), then captured: a new shape (a training phase's) or key is captured anew. Off CUDA nothing
    is captured: the warm-up steps and then the same region run eagerly, which is how the CPU tests
    follow it."""

    WARMUP = 3

    def __init__(self, s: Step, capture_key=lambda epoch: None):
        self.s, self.capture_key, self.cuda = s, capture_key, s.ctx.device.type == "cuda"
        # the batch transform runs inside the one graph: not timed apart (time/transform_s stays 0)
        s.transform_time = Stopwatch(self.cuda, timing=False)
        for group in s.optimizer.param_groups:
            if not isinstance(group["lr"], torch.Tensor):
                group["lr"] = torch.tensor(float(group["lr"]), device=s.ctx.device)
        self.graph = self.pool = self.key = None
        self.warm: dict[tuple, int] = {}

    def __call__(self, x: torch.Tensor, idx: torch.Tensor, epoch: int, drawn: list[tuple]) -> torch.Tensor:
        inputs = (x, idx, *(t for part in drawn for t in part))
        key = (*((t.shape, t.stride(), t.dtype) for t in inputs), self.capture_key(epoch))
        if self.warm.get(key, 0) < self.WARMUP:
            self.warm[key] = self.warm.get(key, 0) + 1
            return self.warm_up(x, idx, epoch, drawn)
        if not self.cuda:
            return captured_region(self.s, x, idx, epoch, drawn)
        if key != self.key:
            self.capture(inputs, epoch, drawn, key)
        else:
            for static, value in zip(self.inputs, inputs):
                static.copy_(value, non_blocking=True)
        self.graph.replay()
        return self.loss.clone()

    def warm_up(self, x, idx, epoch: int, drawn: list[tuple]) -> torch.Tensor:
        """One eager step (on a side stream on CUDA), outside what is captured."""
        if not self.cuda:
            return self.s.step_fn(self.s, x, idx, epoch, drawn)
        side = torch.cuda.Stream(self.s.ctx.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            loss = self.s.step_fn(self.s, x, idx, epoch, drawn)
        torch.cuda.current_stream().wait_stream(side)
        return loss

    def capture(self, inputs: tuple, epoch: int, drawn: list[tuple], key: tuple) -> None:
        self.graph = None  # the last shape's graph: its memory back to the pool
        self.inputs, self.key = tuple(t.clone() for t in inputs), key
        x, idx, *flat = self.inputs
        parts = iter(flat)  # the static draws, grouped per micro-batch again
        static_drawn = [tuple(next(parts) for _ in part) for part in drawn]
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: the DataLoader's pin-memory thread keeps calling CUDA while this thread captures
        with torch.cuda.graph(self.graph, pool=self.pool, capture_error_mode="thread_local"):
            self.loss = captured_region(self.s, x, idx, epoch, static_drawn)
        self.pool = self.graph.pool()
        log.info("training step captured as one CUDA graph (batch %s)", tuple(x.shape))


def _targets(s: Step, idx: torch.Tensor) -> torch.Tensor:
    """The batch's one-hot targets, float, on the device."""
    return F.one_hot(s.y_train[idx], s.num_classes).float()


def _loss(s: Step, x: torch.Tensor, idx: torch.Tensor, epoch: int, drawn: tuple | None) -> torch.Tensor:
    y_soft = _targets(s, idx)
    given = {} if s.draw is None else {"drawn": drawn}  # a method's transform and loss take its draws
    if s.transform is not None:
        with s.transform_time.span():
            x, y_soft = s.transform(x, y_soft, idx, s.hook_net, **given)
    with s.ctx.autocast():
        if s.loss is None:
            return soft_cross_entropy(s.net(x), y_soft)
        return s.loss(s.net, x, y_soft, idx, epoch, **given)


# The loop reads the device every AGREE_EVERY steps (the non-finite check, the fp16 loss scale and, under
# DDP, the ranks' votes to stop or save, in one transfer): each read waits for the queued steps, and a
# non-finite loss or a stop signal may wait this many steps.
AGREE_EVERY = 16
MIN_LOSS_SCALE = 1e-4  # an fp16 loss scale below this skips every step: the run has diverged


class DeferredChecks:
    """What the host must learn from the device during an epoch, kept there and read in one transfer
    (`read`): the first step whose loss was not finite and the fp16 loss scale, with, under DDP, the
    ranks' votes (a flag true on any rank is true on all, so that every rank stops or saves at the
    same step)."""

    def __init__(self, s: Step, check_loss: bool):
        self.s, self.check_loss = s, check_loss
        self.first_bad = torch.full((), -1, dtype=torch.long, device=s.ctx.device)

    def record(self, step: int, loss: torch.Tensor) -> None:
        if self.check_loss:
            bad = ~torch.isfinite(loss) & (self.first_bad < 0)
            self.first_bad = torch.where(bad, step, self.first_bad)

    def read(self, *flags: bool) -> tuple[list[bool], float, float]:
        """(each flag agreed over the ranks, the first non-finite step of any rank (-1: none; inf: another
        rank's), the fp16 loss scale (inf without one)): one wait for the device."""
        ctx, scaler = self.s.ctx, self.s.scaler
        host = ctx.pin(torch.tensor(flags, dtype=torch.float64)).to(ctx.device, non_blocking=True)
        votes = torch.cat([host, (self.first_bad >= 0).double().reshape(1)])
        if ctx.distributed:
            votes = all_reduce_sum(votes)
        scale = scaler._get_scale_async() if scaler.is_enabled() else None  # None before the first step
        scale = torch.full((1,), math.inf, device=ctx.device) if scale is None else scale.reshape(1)
        values = torch.cat([votes, self.first_bad.double().reshape(1), scale.double()]).tolist()
        *agreed, any_bad, first_bad, scale = values
        if any_bad and first_bad < 0:
            first_bad = math.inf
        return [v > 0 for v in agreed], first_bad, scale


def epoch_start(hooks: MethodHooks, epoch: int, model, data: Data) -> None:
    """The method's per-epoch pass (e.g. CSOT's selection), if it has one."""
    if hooks.on_epoch_start is not None:
        hooks.on_epoch_start(epoch, model, data)


def evaluate_all(model, data: Data, ctx: RunContext, cfg, hooks: MethodHooks) -> tuple[dict, dict]:
    """The epoch's evaluation: the method's own (`hooks.evaluate`), or every evaluation split's metrics."""
    if hooks.evaluate is not None:
        return hooks.evaluate(model), {}
    return _evaluate_splits(model, data, ctx, cfg.eval_batch_size, cfg.ece_bins)


def train_one_epoch(s: Step, loop: _Loop, epoch: int, first: int) -> tuple[torch.Tensor, DeferredChecks]:
    """Steps `first`.. of `epoch`: (the summed training loss, on the device; the checks, for the epoch
    end to read). Reads the checks every AGREE_EVERY steps and saves mid-epoch when due or stopped."""
    cfg, ctx = loop.cfg, s.ctx
    steps = len(loop.sampler)
    # The partial loss sum of a resumed epoch is the global one: rank 0 carries it.
    loss_sum = torch.full((), loop.carried_loss if first and ctx.is_main else 0.0, device=ctx.device)
    checks = DeferredChecks(s, check_loss=not s.scaler.is_enabled())
    bar = tqdm(
        loop.train_batches,
        desc=f"{loop.tag + ' ' if loop.tag else ''}epoch {epoch + 1}/{cfg.epochs}",
        initial=first,
        total=steps,
        leave=False,
        disable=None if cfg.progress and ctx.is_main else True,
    )
    for step, (x, idx) in enumerate(bar, start=first):
        if loop.phases is not None:
            loop.phases.set_lr(s.optimizer, epoch, step, steps)
        loss = train_step(s, x, idx, epoch)
        if loop.warmup_lr is not None:
            loop.warmup_lr.step()
        loss_sum += loss
        checks.record(step, loss)
        save = loop.mid_epoch and 0 < cfg.checkpoint_every_minutes * 60 <= time.monotonic() - loop.last_save
        stop = loop.signals.signum is not None
        # Alone, a process acts on a signal or a due save at once; ranks only at the steps they all vote.
        due = (step + 1) % AGREE_EVERY == 0 or not ctx.distributed and (stop or save)
        if not due or step + 1 == steps:
            continue  # the epoch's last step is checked at the epoch end
        (stop, save), first_bad, scale = checks.read(stop, save)
        loop.check(epoch, first_bad, scale)
        if stop or save:
            loop.save_partial(epoch, step + 1, loss_sum, stop)
    return loss_sum, checks


def _method_hooks(hooks: MethodHooks | None) -> MethodHooks:
    """`fit`'s hooks: the method's, or plain training for None; a TypeError for an object that does not
    subclass MethodHooks (the loop reads every hook of that class, with its default)."""
    if hooks is None:
        return PlainTraining()
    if not isinstance(hooks, MethodHooks):
        raise TypeError(f"fit's hooks subclass runner.hooks.MethodHooks; {type(hooks).__name__} does not")
    return hooks


def _check_batch_settings(model, data: Data, cfg, ctx: RunContext, hooks: MethodHooks) -> None:
    """Before anything is built: `train.accumulate` settled (auto: by a probe, `micro_batches`) and
    allowed by the method, every batch split evenly over the ranks and micro-batches, and `train.phases`
    only with the config's optimizer; ConfigError otherwise."""
    if cfg.accumulate == "auto":
        cfg.accumulate = micro_batches(model, data.input_shape, cfg, ctx, hooks)
    # first: a method that refuses micro-batches needs no advice on how to split them
    if cfg.accumulate > 1 and not hooks.accumulate_ok:
        raise ConfigError(
            f"train.accumulate={cfg.accumulate}: this method needs each whole batch in one pass (its "
            "batch transform, loss or sampler sees the batch as one); use train.accumulate=1"
        )
    # train.batch_size is the global batch; under DDP each rank takes its share of every batch, so the
    # averaged gradient steps are those of one process: hardware changes the speed, not the experiment.
    for key, size in [("train.batch_size", cfg.batch_size)] + [
        (f"train.phases.{i}.batch_size", phase.batch_size) for i, phase in enumerate(cfg.phases)
    ]:
        if size % (ctx.world_size * cfg.accumulate):
            raise ConfigError(
                f"{key}={size}: must split evenly over {ctx.world_size} ranks x "
                f"train.accumulate={cfg.accumulate} micro-batches"
            )
    if cfg.phases and hooks.optimizer is not None:
        raise ConfigError("train.phases set the lr of the config's optimizer; this method brings its own: "
                          "leave train.phases empty")  # fmt: skip


def fit(
    model,
    data: Data,
    cfg,
    ctx: RunContext,
    hooks: MethodHooks | None = None,
    augment: str = "none",
    tag: str | None = None,
) -> dict:
    """Train `model` on `data.train` for `cfg.epochs` (a `TrainConfig`); return the final metrics, with
    the best, last and median-of-last-10 test accuracy, and write `reliability.png` of the test split.
    `hooks` is the method's (a `runner.hooks.MethodHooks`: its docstring lists each hook and the loop's
    default), None the plain baseline (`PlainTraining`). `augment` is the training augmentation
    (`dataset.augment`; in-memory crop padding from `data.meta["crop_pad"]`).

    Checkpoints (`checkpoints/last.pt`, `train.checkpoint`) at the end of every epoch and every
    `train.checkpoint_every_minutes` inside one, and on a stop signal after the current step (see
    `runner.faults.StopSignals`); a restart in the run dir continues from the same step with the same
    random streams, so on the CPU it ends exactly as an uninterrupted run. Hooks with an
    `on_epoch_start` are resumed inside an epoch only if they declare `mid_epoch_resume = True` (their
    `state_dict` holds all that `on_epoch_start` set up); otherwise only at epoch ends. A non-finite
    loss or parameter stops the run (Diverged) and is never saved.

    `tag` names one of several fits in a run: its checkpoint is `checkpoints/<tag>.pt`, its metrics rows
    carry `<tag>/<key>` (with `<tag>/epoch`, no tracker step), and a restart drops only its own rows
    past its checkpoint. With `train.select=best:<key>` (or, while it is `last`, `hooks.select = (key,
    "max" | "min")`) the model is evaluated before the first epoch too, the weights of the best value of
    `key` are kept (in the checkpoint as well) and restored at the end, and the returned metrics are those
    of the restored model (`tested_model` says which; `<key>_last` are the last epoch's)."""
    hooks = _method_hooks(hooks)
    _check_batch_settings(model, data, cfg, ctx, hooks)
    # Evaluated at the side it ends its training at: a network trained at 16 px sees 8-px digits blurred
    # past recognition (chance accuracy).
    ctx.eval_image_size = final_image_size(cfg)
    loop = _Loop(model, data, cfg, ctx, hooks, tag)
    start, first, extra = loop.resume()
    if loop.select is not None and not loop.resumed:  # the initial weights stay unless training beats them
        loop.evaluate_before_training()
    metrics, calibration = loop.run_epochs(augment, start, first)
    metrics, calibration = loop.final_metrics(metrics, calibration, extra)
    if ctx.is_main and "test" in calibration:
        reliability_plot(ctx.dir / "reliability.png", calibration["test"], "test")
    return metrics


class Monitor:
    """The validation metric `key` (`mode` "max" or "min") over a fit's evaluations: keeps the
    `train.save_top_k` best epoch-end checkpoints as `best-<epoch>-<value>.pt` beside the fit's checkpoint
    (hard links of it, no copy) and `best.pt` naming the best; stops the fit after `train.early_stop`
    evaluations without improvement. Its state travels in the checkpoint, so both survive a resume."""

    def __init__(self, select, cfg, checkpoint: Path):
        self.key, self.mode = select
        self.top_k, self.patience = cfg.save_top_k, cfg.early_stop
        if self.top_k and not cfg.checkpoint:
            raise ConfigError(f"train.save_top_k={self.top_k} keeps checkpoints: needs train.checkpoint=true")
        self.folder = checkpoint.parent
        self.prefix = "" if checkpoint.name == Path(CHECKPOINT).name else f"{checkpoint.stem}-"
        self.checkpoint = checkpoint
        self.kept: list[list] = []  # [value, epoch, file name], best first
        self.best_value, self.best_epoch, self.waited, self.stopped = None, None, 0, False

    def state_dict(self) -> dict:
        return {"kept": self.kept, "best_value": self.best_value, "best_epoch": self.best_epoch,
                "waited": self.waited}  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value)

    def after(self, epoch: int, evaluated: dict) -> dict:
        """Follow the epoch's evaluation (an epoch without one changes nothing); the state to save."""
        if not (self.top_k or self.patience) or not evaluated:
            return self.state_dict()
        if self.key not in evaluated:
            raise ConfigError(
                f"train.save_top_k / train.early_stop follow {self.key}, which this run does not report; "
                "give the dataset a validation split (dataset.val_fraction > 0)"
            )
        value = evaluated[self.key]
        if self.best_value is None or _better(value, {"value": self.best_value}, self.mode):
            self.best_value, self.best_epoch, self.waited = value, epoch + 1, 0
        else:
            self.waited += 1
        if self.top_k:
            name = f"{self.prefix}best-{epoch + 1}-{value:.4f}.pt"
            self.kept.append([value, epoch + 1, name])
            self.kept.sort(key=lambda kept: -kept[0] if self.mode == "max" else kept[0])
        if self.patience and self.waited >= self.patience:
            self.stopped = True
            log.info("early stop: %s has not improved for %d evaluations; the best, %.4f, was at epoch %d",
                     self.key, self.waited, self.best_value, self.best_epoch)  # fmt: skip
        return self.state_dict()

    def keep_files(self) -> None:
        """After the epoch's checkpoint: link it if it made the top k, drop what fell out, point best.pt."""
        if not self.top_k:
            return
        for _, _, name in self.kept[self.top_k :]:
            (self.folder / name).unlink(missing_ok=True)
        del self.kept[self.top_k :]
        for _, _, name in self.kept:
            target = self.folder / name
            if not target.exists() and name == self._newest():
                try:
                    os.link(self.checkpoint, target)
                except OSError:  # a file system without hard links
                    shutil.copy2(self.checkpoint, target)
        link = self.folder / f"{self.prefix}best.pt"
        link.unlink(missing_ok=True)
        if self.kept:
            link.symlink_to(self.kept[0][2])

    def _newest(self) -> str:
        return max(self.kept, key=lambda kept: kept[1])[2]

    def summary(self) -> dict:
        if self.best_epoch is None:
            return {}
        return {"best_epoch": self.best_epoch, f"best/{self.key}": self.best_value}


# train.accumulate=auto: the share of the GPU's memory a probe's forward and backward may peak at, leaving the
# rest to what the probe lacks (the optimizer's state, a method's extra passes, the allocator's slack)
PROBE_HEADROOM = 0.8


def fits_in_memory(model, input_shape: tuple, batch: int, ctx: RunContext) -> tuple[bool, float]:
    """Whether a forward and backward of `model` on `batch` random inputs peaks within PROBE_HEADROOM of the
    GPU's memory, and that peak in GB; the model's weights and batch-norm statistics are left as they were.
    Off CUDA there is nothing to measure: (True, 0)."""
    if ctx.device.type != "cuda":
        return True, 0.0
    saved = {key: value.clone() for key, value in model.state_dict().items()}
    torch.cuda.reset_peak_memory_stats(ctx.device)
    try:
        with ctx.autocast():
            out = model(ctx.to_input(torch.randn(batch, *input_shape, device=ctx.device)))
        out.float().sum().backward()
        peak = torch.cuda.max_memory_allocated(ctx.device)
        fits = peak <= PROBE_HEADROOM * torch.cuda.get_device_properties(ctx.device).total_memory
    except torch.OutOfMemoryError:
        peak, fits = torch.cuda.max_memory_allocated(ctx.device), False
    finally:
        out = None
        model.zero_grad(set_to_none=True)
        model.load_state_dict(saved)
        torch.cuda.empty_cache()
    return fits, peak / 2**30


def micro_batches(model, input_shape: tuple, cfg, ctx: RunContext, hooks: MethodHooks) -> int:
    """train.accumulate=auto: the fewest micro-batches per step whose share of this rank's largest batch
    (train.batch_size, or a phase's) fits the GPU (`fits_in_memory`), among those that divide every
    batch; 1 off an accelerator. A method that needs its whole batch in one pass and does not fit stops
    with one line naming what would (a smaller batch, or DDP over enough GPUs)."""
    sizes = [cfg.batch_size] + [phase.batch_size for phase in cfg.phases]
    if not ctx.accelerator:
        return 1
    model.to(ctx.device)
    batch = max(sizes) // ctx.world_size
    dividing = [k for k in range(1, batch + 1) if all(size % (ctx.world_size * k) == 0 for size in sizes)]
    splits = hooks.accumulate_ok
    for k in dividing:
        fits, peak = fits_in_memory(model, input_shape, batch // k, ctx)
        if fits and (splits or k == 1):
            if ctx.is_main:
                log.info("train.accumulate=auto: %d micro-batch%s of %d per step (a probe peaked at %.1f GB)",
                         k, "es" if k > 1 else "", batch // k, peak)  # fmt: skip
            return k
        if fits:  # a method that cannot split: a share of k GPUs would fit
            raise ConfigError(
                f"train.accumulate=auto: a batch of {batch} does not fit this GPU and this method needs "
                f"each whole batch in one pass; lower train.batch_size, or spread it with hardware=ddp over "
                f"{k * ctx.world_size} GPUs (a share of {batch // k} fits)"
            )
    raise ConfigError(
        f"train.accumulate=auto: not even {batch // dividing[-1]} input(s) per pass fit this GPU; lower "
        "train.batch_size or the network's size, or use hardware.precision=bf16"
    )


class _Loop:
    """A fit's state across epochs: the step's parts, the checkpoint, the sampler and batches, the
    evaluation history and best epoch, and the stop signals. `fit` runs it in named steps: `resume`,
    `evaluate_before_training` (under `select`), `run_epochs` (each `epoch` end to end) and
    `final_metrics`."""

    def __init__(self, model, data: Data, cfg, ctx: RunContext, hooks: MethodHooks, tag: str | None):
        self.model, self.data, self.cfg, self.ctx, self.hooks, self.tag = model, data, cfg, ctx, hooks, tag
        self.warmup = hooks.optimizer is None  # the config's optimizer, schedule and warm-up
        self.step = self._make_step()
        if ctx.cuda_graph:
            self._capture_step()
        self.warmup_lr = self._warmup_schedule()
        path = ctx.dir / CHECKPOINT if tag is None else ctx.dir / "checkpoints" / f"{tag}.pt"
        s, extra = self.step, {"ema": self.step.ema, "warmup_lr": self.warmup_lr}
        self.state = Resumable(path, ctx, model, s.optimizer, s.scheduler, s.scaler, hooks, extra)
        self.select = selection(cfg.select) or hooks.select
        self.monitor = Monitor(self.select or ("val/acc", "max"), cfg, path)
        has_pass = hooks.on_epoch_start is not None
        self.mid_epoch = cfg.checkpoint and (not has_pass or hooks.mid_epoch_resume)
        self.last_save = time.monotonic()
        self.train_s, self.carried_loss, self.history, self.best, self.signals = 0.0, 0.0, {}, None, None
        self.resumed = False  # from a checkpoint of this fit (`resume`)
        self.phases = Phases(cfg.phases) if cfg.phases else None
        self.batch_shape = None  # (batch size, image side) of the current training batches
        self.stage = "training"  # of the current epoch: "pass" (the method's), "training" or "evaluation"

    # --- the step's parts ----------------------------------------------------------------------------

    def _make_step(self) -> Step:
        """The optimizer and its schedule (the config's, or the method's own), the network to train through
        (compiled alone, or with the whole step where the hooks are `capturable`) and the EMA, as a Step."""
        model, data, cfg, ctx, hooks = self.model, self.data, self.cfg, self.ctx, self.hooks
        if self.warmup:
            optimizer = make_optimizer(model, cfg, fused=ctx.fused_optimizer)
            scheduler, per_step = make_scheduler(optimizer, cfg), False
        else:
            optimizer, scheduler, per_step = hooks.optimizer(model)
        # torch.compile takes the whole step where the method's hooks run device work alone; else the network
        whole_step = ctx.compile != "false" and hooks.capturable
        net = ctx.prepare(model, compile_network=not whole_step)
        ema = None
        if cfg.ema:  # on the device beside the model, buffers (batch-norm statistics) averaged too
            multi_avg_fn = torch.optim.swa_utils.get_ema_multi_avg_fn(cfg.ema)
            ema = torch.optim.swa_utils.AveragedModel(model, multi_avg_fn=multi_avg_fn, use_buffers=True)
        return Step(
            net, model, optimizer, scheduler, per_step, ctx.grad_scaler(), ctx,
            ctx.pin(data.train.y).to(ctx.device, non_blocking=True), data.num_classes,
            hooks.transform, hooks.loss, cfg.accumulate,
            cfg.clip_grad_norm, ema, ctx.stopwatch(), torch.zeros((), device=ctx.device),
            torch.zeros(2, device=ctx.device),
            # the transform's passes through the compiled network, but not through DDP (whose gradient
            # hooks expect one backward per forward): under DDP a compiled twin of the model
            net if not ctx.distributed else ctx.compiled(model),
            step_fn=ctx.compiled(eager_step) if whole_step else eager_step, draw=hooks.draw,
        )  # fmt: skip

    def _capture_step(self) -> None:
        """`hardware.cuda_graph`: the step captured as one CUDA graph where it can be, else one line why."""
        why = not_capturable(self.step, self.hooks)
        if why is None:
            self.step.graphed = GraphedStep(self.step, self.hooks.capture_key)
        elif self.ctx.is_main:
            log.info("hardware.cuda_graph: the training step runs eagerly: %s", why)

    def _warmup_schedule(self):
        """The linear warm-up, per step: lr x (t + 1) / (W + 1) for steps t < W, times the epoch schedule
        (both schedulers are multiplicative, so they compose); its state travels in the checkpoint. None
        without `train.warmup_epochs` or under the method's own optimizer."""
        cfg = self.cfg
        if not (self.warmup and cfg.warmup_epochs):
            return None
        w = cfg.warmup_epochs * len(EpochBatches(len(self.data.train.y), cfg.batch_size))
        return torch.optim.lr_scheduler.LinearLR(self.step.optimizer, 1 / (w + 1), 1.0, total_iters=w)

    # --- fit's steps -----------------------------------------------------------------------------------

    def resume(self) -> tuple[int, int, dict]:
        """Restore the run dir's checkpoint of this fit, if any (`train.checkpoint`; `resumed` says
        whether one was): (the epoch to go on from, the step inside it, the checkpoint's `extra`: {}
        without one), with the loop's bookkeeping restored and the tracker's rows past it dropped."""
        cfg = self.cfg
        resumed = self.state.resume() if cfg.checkpoint else None
        self.resumed = resumed is not None
        start, first, extra = (0, 0, {}) if resumed is None else resumed
        if first is None:  # an epoch-end checkpoint
            start, first = start + 1, 0
        # Epochs before `start` are logged; an interrupted one is when it completes. Without a checkpoint
        # this drops the records of an earlier attempt that died before its first one.
        _truncate(self.ctx, self.tag, start if self.resumed else -1)
        if self.resumed and self.warmup:
            _follow_config(self.step.optimizer, self.step.scheduler, cfg)
        self.history, self.carried_loss = extra.get("history", {}), extra.get("loss_sum", 0.0)
        if isinstance(self.history, list):  # a checkpoint from before val/acc had a history: test/acc's
            self.history = {"test/acc": self.history}
        self.monitor.load_state_dict(extra.get("monitor", {}))
        # The best epoch by `select`: its value, weights (on the CPU), metrics and calibration bins.
        self.best = extra.get("best")
        if self.best is not None:
            self.best["state"] = {key: value.cpu() for key, value in self.best["state"].items()}
        return start, first, extra

    def evaluate_before_training(self) -> None:
        """The untrained model's evaluation, logged as epoch 0 and kept as the `select` best until an
        epoch beats it; ConfigError where the run does not report the selected metric."""
        metric = self.select[0]
        evaluated, calibration = evaluate_all(self.model, self.data, self.ctx, self.cfg, self.hooks)
        if metric not in evaluated:
            raise ConfigError(f"train.select=best:{metric}: this run does not report {metric}; "
                              f"choices: {', '.join(f'best:{key}' for key in evaluated)}")  # fmt: skip
        self.best = _snapshot(self.model, evaluated, calibration, self.select, 0)
        _log(self.ctx, self.tag, {"epoch": 0, **evaluated}, -1)

    def run_epochs(self, augment: str, start: int, first: int) -> tuple[dict, dict]:
        """Epochs `start`.. (the first from step `first`) until the last, an early stop or a stop signal;
        the last epoch's metrics and calibration bins ({} where none ran)."""
        metrics: dict = {}
        calibration: dict = {}
        with StopSignals() as self.signals:
            for epoch in range(start, self.cfg.epochs):
                # after the resume: the data order is seeded by the restored RNG state
                self.start_batches(augment, epoch)
                with out_of_memory_stops(functools.partial(self.out_of_memory, epoch)):
                    metrics, calibration = self.epoch(epoch, first if epoch == start else 0)
                if self.monitor.stopped:
                    break
        return metrics, calibration

    def final_metrics(self, metrics: dict, calibration: dict, extra: dict) -> tuple[dict, dict]:
        """What the fit returns, and the calibration bins of the model it ends with: the best epoch's
        (`select`, its weights restored), or the last epoch's (of a finished run resumed: its checkpoint's
        row, the model evaluated as it is); with which weights they are of, the history summaries, the
        monitor's best and the training time."""
        if self.best is not None:
            metrics, calibration = self._restore_best(metrics)
        elif not metrics:  # resumed a finished run: its last epoch's row, the model evaluated as it is
            evaluated, calibration = evaluate_all(self.model, self.data, self.ctx, self.cfg, self.hooks)
            metrics = {**extra.get("metrics", {}), **evaluated}
        # which weights the metrics are of (runner-report names them); <key>_last: the last epoch's
        metrics.setdefault("tested_model", "last")
        for key, values in self.history.items():
            metrics.update(history_summary(values, key))
        metrics.update(self.monitor.summary())
        metrics["time/train_total_s"] = self.train_s  # this process's training steps (not the resumed part)
        return metrics, calibration

    def _restore_best(self, metrics: dict) -> tuple[dict, dict]:
        """The best epoch's weights back in the model: `metrics` with its evaluation, and its bins."""
        best, key = self.best, self.select[0]
        self.model.load_state_dict(best["state"])
        metrics.update(best["metrics"])
        log.info("%skept the weights of the best %s, %.4f", f"{self.tag}: " if self.tag else "", key,
                 best["value"])  # fmt: skip
        metrics |= {"tested_model": f"best:{key}", "tested_epoch": best.get("epoch")}
        return metrics, best["calibration"]

    # --- one epoch -------------------------------------------------------------------------------------

    def start_batches(self, augment: str, epoch: int) -> None:
        """The training batches for `epoch`: at its phase's batch size and image side (`train.phases`),
        made anew only where those change."""
        ctx, n, phase = self.ctx, len(self.data.train.y), self.phases and self.phases.at(epoch)
        shape = (phase.batch_size, phase.image_size) if phase else (self.cfg.batch_size, 0)
        if shape == self.batch_shape:
            return
        self.batch_shape = shape
        self.sampler = EpochBatches(n, shape[0], ctx.rank, ctx.world_size, torch.initial_seed())
        self.sampler = self.hooks.batch_sampler(self.sampler)
        self.train_batches = batches(self.data.train, self.ctx, self.sampler, augment,
                                     self.data.meta.get("crop_pad", 4), shape[1])  # fmt: skip

    def epoch(self, epoch: int, first: int) -> tuple[dict, dict]:
        """Epoch `epoch` from step `first` (> 0: resumed inside it): the method's pass, the steps, the
        evaluation, the log row and the epoch-end checkpoint; its metrics and calibration bins."""
        t0 = time.perf_counter()
        renew_host_memory_cap()  # counts memory freed elsewhere since the last epoch
        self.model.train()
        self.stage = "pass"
        if not first:
            epoch_start(self.hooks, epoch, self.model, self.data)
        self.stage = "training"
        t_pass = time.perf_counter() - t0
        metrics, timings, checks = self._train(epoch, first, t0 + t_pass, t_pass)
        self.stage = "evaluation"
        t_eval = time.perf_counter()
        evaluated, calibration = self._evaluate(epoch)
        metrics.update(evaluated)
        metrics["time/eval_s"] = time.perf_counter() - t_eval
        metrics.update(self._skipped_images())
        metrics.update(self.hooks.epoch_metrics())
        metrics.update(timings)
        metrics["time/epoch_s"] = time.perf_counter() - t0
        self._log_row(epoch, metrics)
        self._save_epoch_end(epoch, evaluated, metrics)
        self._stop_if_signalled(checks)
        return metrics, calibration

    def _train(
        self, epoch: int, first: int, t_start: float, t_pass: float
    ) -> tuple[dict, dict, DeferredChecks]:
        """The steps of `epoch` from `first`, then its checks and schedule step: (the row's loss, lr and
        step statistics; the epoch's time split, `_timings`; the checks, for the stop vote)."""
        s, ctx = self.step, self.ctx
        self.sampler.set_epoch(epoch, start=first)
        steps = len(self.sampler)  # after set_epoch: a hook's sampler may vary it by epoch
        loss_sum, checks = train_one_epoch(s, self, epoch, first)
        _, first_bad, scale = checks.read()
        self.check(epoch, first_bad, scale)
        timings = _timings(ctx, t_start, t_pass, s.transform_time, steps - first)
        self.train_s += timings["time/train_s"]
        if not s.per_step:
            s.scheduler.step()
        train_loss = all_reduce_sum(loss_sum.reshape(1)).item() / (steps * ctx.world_size)
        lr = float(s.optimizer.param_groups[0]["lr"])  # a tensor for a captured step
        metrics = {"epoch": epoch + 1, "train/loss": train_loss, "lr": lr}
        metrics.update(self._step_stats(scale))
        return metrics, timings, checks

    def _skipped_images(self) -> dict:
        """`data/bad_images`: the unreadable files the epoch's passes replaced (`dataset.bad_images=skip`)."""
        if getattr(self.data.train, "bad_images", None) != "skip":
            return {}
        skipped = torch.tensor([UNREADABLE.take()], device=self.ctx.device)
        return {"data/bad_images": int(all_reduce_sum(skipped).item())}

    def _log_row(self, epoch: int, metrics: dict) -> None:
        """The epoch's row to the tracker, and its line with `train.progress`."""
        _log(self.ctx, self.tag, metrics, epoch)
        if self.ctx.is_main and self.cfg.progress:
            log.info("%sepoch %d/%d  %s", f"{self.tag}: " if self.tag else "", epoch + 1, self.cfg.epochs,
                     _brief(metrics))  # fmt: skip

    def _save_epoch_end(self, epoch: int, evaluated: dict, metrics: dict) -> None:
        """The monitor follows the epoch's evaluation; the epoch-end checkpoint and its top-k links."""
        watched = self.monitor.after(epoch, evaluated)
        if self.ctx.is_main and self.cfg.checkpoint:
            extra = {"history": self.history, "best": self.best, "monitor": watched, "metrics": metrics}
            self.state.save(epoch, None, extra)
            self.monitor.keep_files()
        self.last_save = time.monotonic()

    def _stop_if_signalled(self, checks: DeferredChecks) -> None:
        """Stop after the epoch on a signal (under DDP: on any rank's, as the ranks vote)."""
        stop = self.signals.signum is not None
        if stop if not self.ctx.distributed else checks.read(stop)[0][0]:
            self.signals.stop()

    def _step_stats(self, scale: float) -> dict:
        """The epoch's pre-clip gradient norm (mean of the finite ones) and fp16 skipped steps and scale."""
        s, out = self.step, {}
        if s.clip:
            total, count = s.grad_norm.tolist()
            out["train/grad_norm"] = total / count if count else math.nan
            s.grad_norm.zero_()
        if s.scaler.is_enabled():
            out.update({"train/loss_scale": scale, "train/skipped_steps": int(s.skipped)})
            s.skipped.zero_()
        return out

    def _evaluate(self, epoch: int) -> tuple[dict, dict]:
        """Every `train.eval_every` epochs and at the last: the splits' metrics (the EMA weights' too,
        as `<key>_ema`) and calibration bins; the test accuracy history and the `select` best."""
        cfg = self.cfg
        if (epoch + 1) % cfg.eval_every and epoch + 1 < cfg.epochs:
            return {}, {}
        evaluated, calibration = evaluate_all(self.model, self.data, self.ctx, cfg, self.hooks)
        if self.step.ema is not None:
            averaged, _ = evaluate_all(self.step.ema.module, self.data, self.ctx, cfg, self.hooks)
            evaluated |= {f"{key}_ema": value for key, value in averaged.items()}
        for key in HISTORY_KEYS:
            if key in evaluated:
                self.history.setdefault(key, []).append(evaluated[key])
        select = self.select
        if select is not None and _better(evaluated[select[0]], self.best, select[1]):
            self.best = _snapshot(self.model, evaluated, calibration, select, epoch + 1)
        return evaluated, calibration

    def check(self, epoch: int, first_bad: float, scale: float) -> None:
        """Stop (Diverged) on a non-finite loss (`first_bad` >= 0: its step) or an underflowed fp16 scale."""
        steps = len(self.sampler)
        if first_bad >= 0:
            where = f"step {int(first_bad) + 1}/{steps}" if first_bad < math.inf else "another rank"
            raise Diverged(
                f"non-finite loss at epoch {epoch + 1}, {where}; last good checkpoint: {self.state.last}; "
                "lower train.lr (or check the data)"
            )
        if scale < MIN_LOSS_SCALE:
            raise Diverged(
                f"the fp16 loss scale fell to {scale:.3g} at epoch {epoch + 1} (every step skipped: "
                f"non-finite gradients); last good checkpoint: {self.state.last}; use "
                "hardware.precision=bf16 or lower train.lr"
            )

    def out_of_memory(self, epoch: int, memory: str) -> str:
        """The one line for running out of `memory` in `epoch`: where, the setting that sized the batch (in
        training a method's own, `hooks.batch_setting(epoch)`), what would fit, the checkpoint kept."""
        cfg, ctx, batch = self.cfg, self.ctx, self.batch_shape[0]
        kept = f"last good checkpoint: {self.state.last}"
        if self.stage != "training":
            if self.stage == "evaluation" and self.hooks.evaluate is None:
                where = f"the evaluation at train.eval_batch_size={cfg.eval_batch_size}; lower it"
            else:  # the method's own pass or evaluation, at batches of its own
                where = "the method's evaluation" if self.stage == "evaluation" else "the method's pass"
            return f"ran out of {memory} in epoch {epoch + 1}, in {where}; {kept}"
        key = f"train.phases.{self.phases.index(epoch)}.batch_size" if self.phases else "train.batch_size"
        setting = self.hooks.batch_setting(epoch) or f"{key}={batch}"
        fixes = ["lower it"]
        if self.hooks.accumulate_ok and batch % (2 * ctx.world_size * cfg.accumulate) == 0:
            fixes.append(f"keep the batch with train.accumulate={2 * cfg.accumulate} (half as many per pass)")
        if ctx.accelerator and ctx.precision == "fp32":
            fixes.append("use hardware.precision=bf16 (half the bytes per activation)")
        advice = ", or ".join(fixes)
        return f"ran out of {memory} in epoch {epoch + 1} at {setting}; {advice}; {kept}"

    def save_partial(self, epoch: int, steps_done: int, loss_sum: torch.Tensor, stop: bool) -> None:
        """A mid-epoch checkpoint (when due, or on a stop signal), then the stop if asked."""
        if self.mid_epoch:
            partial = all_reduce_sum(loss_sum.clone().reshape(1)).item()
            if self.ctx.is_main:
                extra = {"history": self.history, "best": self.best, "loss_sum": partial}
                self.state.save(epoch, steps_done, extra)
            self.last_save = time.monotonic()
        if stop:
            if not self.mid_epoch:
                log.warning("stopping inside epoch %d without a checkpoint of it", epoch + 1)
            self.signals.stop()


def _better(value: float, best: dict | None, mode: str) -> bool:
    return best is None or (value > best["value"] if mode == "max" else value < best["value"])


def _snapshot(model, evaluated: dict, calibration: dict, select, epoch: int) -> dict:
    state = {key: value.detach().cpu().clone() for key, value in model.state_dict().items()}
    return {"value": evaluated[select[0]], "state": state, "metrics": evaluated, "calibration": calibration,
            "epoch": epoch}  # fmt: skip


def selection(rule: str) -> tuple[str, str] | None:
    """`train.select` as `(metric, "max" | "min")` (a loss or an ECE is minimised); None for `last`."""
    if rule == "last":
        return None
    key = rule.removeprefix("best:")
    return key, "min" if key.rsplit("/", 1)[-1] in ("loss", "ece") else "max"


def _log(ctx: RunContext, tag: str | None, metrics: dict, epoch: int) -> None:
    """One metrics row: at tracker step `epoch`, or (a tagged fit) keys `<tag>/...` and no step."""
    if tag is None:
        ctx.tracker.log(metrics, step=epoch)
    else:
        ctx.tracker.log({f"{tag}/{key}": value for key, value in metrics.items()})


def _truncate(ctx: RunContext, tag: str | None, done: int) -> None:
    """Drop the rows a restart would write again: those of epochs after the `done` complete ones
    (done = -1: every row of this fit, the initial evaluation's included). Untagged: by tracker step;
    tagged: only rows of this tag, by `<tag>/epoch` (1-based, 0 the initial evaluation)."""
    if tag is None:
        ctx.tracker.truncate(done - 1 if done >= 0 else -2)
    else:  # other fits' rows (without this tag's epoch) stay
        ctx.tracker.truncate(done, key=f"{tag}/epoch", missing=-math.inf)


def _follow_config(optimizer, scheduler, cfg) -> None:
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


def _timings(ctx: RunContext, t_start: float, t_pass: float, transform: Stopwatch, steps: int) -> dict:
    """The epoch's time split: the method's per-epoch pass, the training steps (ms per step) and the
    batch transforms within them (device time on CUDA, read here once); peak and reserved GPU memory of
    the epoch on CUDA."""
    ctx.synchronize()
    train_s = time.perf_counter() - t_start
    out = {"time/pass_s": t_pass, "time/train_s": train_s, "time/step_ms": 1000 * train_s / max(steps, 1)}
    out["time/transform_s"] = transform.seconds()
    transform.total = 0.0
    return out | ctx.memory()


def _brief(metrics: dict) -> str:
    keys = ("train/loss", "val/acc", "test/acc", "select/precision", "select/recall", "time/epoch_s")
    return "  ".join(f"{k} {metrics[k]:.4f}" for k in keys if k in metrics)
