"""The training loop every classification-style task shares, and the one data path every consumer uses.

Every walk over a dataset goes through `batches` (training: the epoch's index batches of this rank;
evaluation and per-epoch method passes: `predict`), so the same code serves in-memory splits (sliced on the
device) and file-backed ones (a DataLoader with `hardware.num_workers` decoding processes and pinned
memory). `fit` trains, evaluates val, test and any extra splits each epoch, logs to the tracker,
checkpoints (every epoch, every `train.checkpoint_every_minutes` and on a stop signal) and resumes from
the last checkpoint in the run dir at the same step (`Resumable`). Methods plug in through a `hooks`
object with any of:

    on_epoch_start(epoch, model, data)                  e.g. CSOT's sample selection
    transform(x, y_soft, idx, model) -> (x, y_soft)     a batch transform (mixup family)
    loss(model, x, y_soft, idx, epoch) -> scalar         replaces the soft cross-entropy
    state_dict() / load_state_dict(state)               kept in checkpoints
    mid_epoch_resume = True                             state_dict holds all on_epoch_start set up
    batch_sampler(default) -> sampler                   the index batches instead of `default` (an
                                                        EpochBatches): same protocol, its length read
                                                        after each set_epoch (e.g. CSOT's two pools)
    optimizer(model) -> (optimizer, scheduler, per_step)  instead of train.optimizer / schedule; per_step:
                                                        the scheduler steps after every batch
    evaluate(model) -> dict                             the per-epoch metrics instead of val/test accuracy
    select = (key, "max" | "min")                       keep and restore the best weights by that metric
    epoch_metrics() -> dict                             added to the epoch's row (e.g. CSOT's select/*)

Training by iterations: a hook's sampler cuts them into epochs (the unit of logging, evaluation and
epoch-end checkpoints) and its per-step scheduler follows the iteration count.
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from runner.data import Data, Split
from runner.data.views import augment_crop_flip
from runner.faults import CheckpointError, Diverged, StopSignals
from runner.hardware import RunContext, all_reduce_sum
from runner.metrics import calibration_bins, expected_calibration_error, history_summary, reliability_plot
from runner.schema import ConfigError

log = logging.getLogger(__name__)

CHECKPOINT = "checkpoints/last.pt"


def soft_cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean over the batch of -sum_k target_k log softmax(logits)_k."""
    return -(target * F.log_softmax(logits, dim=1)).sum(dim=1).mean()


def make_optimizer(model, cfg):
    params = model.parameters()
    if cfg.optimizer == "adam":
        return torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    return torch.optim.SGD(
        params, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov, weight_decay=cfg.weight_decay
    )


def make_scheduler(optimizer, cfg):
    if cfg.schedule == "cosine":
        return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(cfg.epochs, 1))
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


def _on_device(split: Split, device: torch.device) -> torch.Tensor:
    """`split.x` on `device`, copied once per split (and again only if `split.x` is replaced)."""
    cached = split.__dict__.get("_device_copy")
    if cached is None or cached[0] is not split.x or cached[1].device != device:
        cached = (split.x, split.x.to(device))
        split.__dict__["_device_copy"] = cached
    return cached[1]


def batches(split, ctx: RunContext, index_batches, augment: str = "none", crop_pad: int = 4):
    """An iterable of `(x, idx)` over `index_batches` (an iterable of index tensors, e.g. EpochBatches),
    `x` float network input on `ctx.device`, `idx` the batch's int64 sample indices on the CPU.

    In-memory splits are sliced on the device (augment="crop_flip": random crop + flip there); a
    FileSplit is read by a DataLoader whose workers decode and transform, with its training transform
    when `augment` is not "none". Re-iterate the returned object each epoch (DataLoader workers persist).
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
        return _ToDevice(loader, ctx)
    if augment not in ("none", "crop_flip"):
        raise ConfigError(
            f"dataset.augment={augment!r} needs a file-backed dataset; in-memory data take none or crop_flip"
        )
    return _SliceBatches(split, ctx, index_batches, augment, crop_pad)


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
    def __init__(self, loader, ctx: RunContext):
        self.loader, self.ctx = loader, ctx

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        for x, idx in self.loader:
            yield self.ctx.to_input(x), idx


class _SliceBatches:
    def __init__(self, split: Split, ctx: RunContext, index_batches, augment: str, crop_pad: int):
        self.split, self.ctx, self.index_batches = split, ctx, index_batches
        self.augment, self.crop_pad = augment, crop_pad

    def __len__(self) -> int:
        return len(self.index_batches)

    def __iter__(self):
        x_all = _on_device(self.split, self.ctx.device)
        for idx in self.index_batches:
            x = self.split.decode(x_all[idx.to(self.ctx.device)])
            if self.augment == "crop_flip":
                x = augment_crop_flip(x, self.crop_pad)
            yield self.ctx.to_input(x), idx


def in_order(n: int, batch_size: int) -> list[torch.Tensor]:
    """Index batches 0..n-1 in order (evaluation and per-epoch passes); none when n = 0."""
    return list(torch.arange(n).split(batch_size)) if n else []


# Decoded 224-px float batches are large (1024 of them: 617 MB, times the workers' prefetch): passes over
# file-backed splits read them in batches of at most this many.
STREAMED_EVAL_BATCH = 256


@torch.no_grad()
def predict(model, source, ctx: RunContext, batch_size: int = 1024, features: bool = False) -> torch.Tensor:
    """Logits (with features=True: `forward_features`) for every sample of `source` (a split, or a
    tensor of inputs) in index order, in eval mode without augmentation, returned on the CPU."""
    if isinstance(source, torch.Tensor):
        source = Split(
            source, torch.zeros(len(source), dtype=torch.long), torch.zeros(len(source), dtype=torch.long)
        )
    was_training = model.training
    model.eval()
    forward = model.forward_features if features else model
    if not isinstance(source, Split):
        batch_size = min(batch_size, STREAMED_EVAL_BATCH)
    out = []
    for x, _ in batches(source, ctx, in_order(len(source), batch_size)):
        with ctx.autocast():
            out.append(forward(x).float().cpu())
    model.train(was_training)
    return torch.cat(out) if out else torch.empty(0)


@torch.no_grad()
def evaluate(model, split, ctx: RunContext, batch_size: int = 1024, top5: bool = False) -> dict:
    """Accuracy (and top-5 accuracy), mean cross-entropy and ECE (15 bins) against the clean labels;
    each rank takes an interleaved shard and the sums are reduced over ranks. `calibration` holds the
    bins (for `reliability_plot`)."""
    shard = split.subset(torch.arange(ctx.rank, len(split), ctx.world_size)) if ctx.distributed else split
    logits, y = predict(model, shard, ctx, batch_size), shard.y_clean
    top = (
        logits.topk(min(5, logits.shape[1]), dim=1).indices if len(y) else torch.zeros(0, 5, dtype=torch.long)
    )
    sums = torch.tensor(
        [
            float((top[:, 0] == y).sum()),
            float((top == y[:, None]).any(1).sum()),
            float(F.cross_entropy(logits, y, reduction="sum")) if len(y) else 0.0,
            len(y),
        ],
        dtype=torch.float64,
    )
    bins = calibration_bins(logits.softmax(1), y) if len(y) else torch.zeros(3, 15, dtype=torch.float64)
    reduced = all_reduce_sum(torch.cat([sums, bins.flatten()]).to(ctx.device)).cpu()
    correct, correct5, loss, n = reduced[:4].tolist()
    bins = reduced[4:].view(3, -1)
    out = {"acc": correct / max(n, 1), "loss": loss / max(n, 1), "ece": expected_calibration_error(bins)}
    if top5:
        out["acc5"] = correct5 / max(n, 1)
    out["calibration"] = bins
    return out


def _evaluate_splits(model, data: Data, ctx: RunContext, batch_size: int) -> tuple[dict, dict]:
    """(`<split>/<metric>` for every evaluation split, the calibration bins by split)."""
    metrics, calibration = {}, {}
    for name, split in data.eval_splits().items():
        result = evaluate(model, split, ctx, batch_size, top5=data.meta.get("top5", False))
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
    """`torch.load` a checkpoint; CheckpointError naming the file (which is kept) if it cannot be read."""
    try:
        return torch.load(path, map_location=device, weights_only=False)
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

    def __init__(self, path, ctx: RunContext, model, optimizer, scheduler, scaler, hooks=None):
        self.path, self.ctx, self.model, self.hooks = Path(path), ctx, model, hooks
        self.parts = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "scaler": scaler}
        self.last = "none written yet"  # the last good checkpoint, for error messages

    def resume(self) -> tuple[int, int | None, dict] | None:
        """(epoch, step, extra) of the checkpoint just restored, or None without one."""
        if not self.path.exists():
            return None
        state = load_checkpoint(self.path, self.ctx.device)
        try:
            for key, part in self.parts.items():
                part.load_state_dict(state[key])
            if state.get("hooks") is not None and hasattr(self.hooks, "load_state_dict"):
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
        state["hooks"] = self.hooks.state_dict() if hasattr(self.hooks, "state_dict") else None
        save_checkpoint(self.path, state)
        self.last = f"{self.path} ({_position(epoch, step)})"


def _position(epoch: int, step: int | None) -> str:
    return f"end of epoch {epoch + 1}" if step is None else f"epoch {epoch + 1}, step {step}"


def _first_line(error: BaseException) -> str:
    """An exception's message on one line, cut to its first sentence (torch's run on for lines)."""
    text = " ".join(str(error).split())
    return text[: text.find(". ", 40) + 1 or None][:300]


def fit(
    model, data: Data, cfg, ctx: RunContext, hooks=None, augment: str = "none", tag: str | None = None
) -> dict:
    """Train `model` on `data.train` for `cfg.epochs` (a `TrainConfig`); return the final metrics, with
    the best, last and median-of-last-10 test accuracy, and write `reliability.png` of the test split.
    `augment` is the training augmentation (`dataset.augment`; in-memory crop padding from
    `data.meta["crop_pad"]`).

    Checkpoints (`checkpoints/last.pt`, `train.checkpoint`) at the end of every epoch and every
    `train.checkpoint_every_minutes` inside one, and on a stop signal after the current step (see
    `runner.faults.StopSignals`); a restart in the run dir continues from the same step with the same
    random streams, so on the CPU it ends exactly as an uninterrupted run. Hooks with an
    `on_epoch_start` are resumed inside an epoch only if they declare `mid_epoch_resume = True` (their
    `state_dict` holds all that `on_epoch_start` set up); otherwise only at epoch ends. A non-finite
    loss or parameter stops the run (Diverged) and is never saved.

    `tag` names one of several fits in a run: its checkpoint is `checkpoints/<tag>.pt`, its metrics rows
    carry `<tag>/<key>` (with `<tag>/epoch`, no tracker step), and a restart drops only its own rows
    past its checkpoint. With `hooks.select = (key, "max" | "min")` the model is evaluated before the
    first epoch too, the weights of the best value of `key` are kept (in the checkpoint as well) and
    restored at the end, and the returned metrics are those of the restored model."""
    # train.batch_size is the global batch; under DDP each rank takes its share of every batch, so the
    # averaged gradient steps are those of one process: hardware changes the speed, not the experiment.
    if cfg.batch_size % ctx.world_size:
        raise ConfigError(f"train.batch_size={cfg.batch_size}: must split evenly over {ctx.world_size} ranks")
    net = ctx.prepare(model)
    make_optimizers = getattr(hooks, "optimizer", None)
    if make_optimizers is None:
        optimizer, scheduler, per_step = make_optimizer(model, cfg), None, False
        scheduler = make_scheduler(optimizer, cfg)
    else:
        optimizer, scheduler, per_step = make_optimizers(model)
    scaler = ctx.grad_scaler()
    y_train, k = data.train.y.to(ctx.device), data.num_classes

    # The hooks a method provides (see the module docstring); None for those it leaves out.
    on_epoch_start = getattr(hooks, "on_epoch_start", None)
    transform = getattr(hooks, "transform", None)
    hook_loss = getattr(hooks, "loss", None)
    hook_evaluate = getattr(hooks, "evaluate", None)
    select = getattr(hooks, "select", None)
    epoch_metrics = getattr(hooks, "epoch_metrics", dict)
    mid_epoch = cfg.checkpoint and (on_epoch_start is None or getattr(hooks, "mid_epoch_resume", False))

    def evaluate_all() -> tuple[dict, dict]:
        if hook_evaluate is not None:
            return hook_evaluate(model), {}
        return _evaluate_splits(model, data, ctx, cfg.eval_batch_size)

    path = ctx.dir / CHECKPOINT if tag is None else ctx.dir / "checkpoints" / f"{tag}.pt"
    state = Resumable(path, ctx, model, optimizer, scheduler, scaler, hooks)
    resumed = state.resume() if cfg.checkpoint else None
    start, first, extra = (0, 0, {}) if resumed is None else resumed
    if first is None:  # an epoch-end checkpoint
        start, first = start + 1, 0
    # Epochs before `start` are logged; an interrupted one is when it completes. Without a checkpoint
    # this drops the records of an earlier attempt that died before its first one.
    _truncate(ctx, tag, start if resumed is not None else -1)
    if resumed is not None and make_optimizers is None:
        _follow_config(optimizer, scheduler, cfg)
    history = extra.get("history", [])
    # The best epoch by `select`: its value, weights (on the CPU), metrics and calibration bins.
    best = extra.get("best")
    if best is not None:
        best["state"] = {key: value.cpu() for key, value in best["state"].items()}
    if select is not None and resumed is None:  # the initial weights stay unless training beats them
        evaluated, calibration = evaluate_all()
        best = _snapshot(model, evaluated, calibration, select)
        _log(ctx, tag, {"epoch": 0, **evaluated}, -1)

    # After the resume: the data order is seeded by the run's seed, which the restored RNG state carries.
    sampler = EpochBatches(len(y_train), cfg.batch_size, ctx.rank, ctx.world_size, torch.initial_seed())
    if hasattr(hooks, "batch_sampler"):
        sampler = hooks.batch_sampler(sampler)
    train_batches = batches(data.train, ctx, sampler, augment, data.meta.get("crop_pad", 4))
    check_loss = not scaler.is_enabled()  # fp16 loss scaling skips non-finite steps by design
    last_save = time.monotonic()
    train_s = 0.0
    metrics: dict = {}
    calibration: dict = {}
    with StopSignals() as signals:
        for epoch in range(start, cfg.epochs):
            t0 = time.perf_counter()
            model.train()
            resuming = epoch == start and first > 0
            if on_epoch_start is not None and not resuming:
                on_epoch_start(epoch, model, data)
            t_pass, t_transform = time.perf_counter() - t0, 0.0
            sampler.set_epoch(epoch, start=first if resuming else 0)
            steps_per_epoch = len(sampler)  # after set_epoch: a hook's sampler may vary it by epoch
            warmup_steps = cfg.warmup_epochs * steps_per_epoch if make_optimizers is None else 0
            # The partial loss sum of a resumed epoch is the global one: rank 0 carries it.
            carried = extra.get("loss_sum", 0.0) if resuming and ctx.is_main else 0.0
            loss_sum = torch.full((), carried, device=ctx.device)
            bar = tqdm(
                train_batches,
                desc=f"{tag + ' ' if tag else ''}epoch {epoch + 1}/{cfg.epochs}",
                initial=first if resuming else 0,
                total=steps_per_epoch,
                leave=False,
                disable=None if cfg.progress and ctx.is_main else True,
            )
            pending = None  # (step, finite flag) of the last step, read one step late: no wait on the GPU
            for step, (x, idx) in enumerate(bar, start=first if resuming else 0):
                if epoch * steps_per_epoch + step < warmup_steps:  # linear warm-up of the scheduled lr
                    factor = (epoch * steps_per_epoch + step + 1) / (warmup_steps + 1)
                    for group, lr in zip(optimizer.param_groups, scheduler.get_last_lr()):
                        group["lr"] = lr * factor
                idx = idx.to(ctx.device)
                y_soft = F.one_hot(y_train[idx], k).float()
                if transform is not None:
                    t = time.perf_counter()
                    x, y_soft = transform(x, y_soft, idx, model)
                    t_transform += time.perf_counter() - t
                with ctx.autocast():
                    if hook_loss is not None:
                        loss = hook_loss(net, x, y_soft, idx, epoch)
                    else:
                        loss = soft_cross_entropy(net(x), y_soft)
                optimizer.zero_grad(set_to_none=True)
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
                if per_step:  # a schedule over iterations
                    scheduler.step()
                loss_sum += loss.detach()
                if check_loss:
                    _check_finite(pending, epoch, steps_per_epoch, state)
                    pending = (step, torch.isfinite(loss.detach()))
                stop = due = False
                if not ctx.distributed or (step + 1) % AGREE_EVERY == 0:  # a vote waits on the GPU
                    due = mid_epoch and 0 < cfg.checkpoint_every_minutes * 60 <= time.monotonic() - last_save
                    stop, due = _agree(ctx, signals.signum is not None, due)
                if stop or due:
                    _check_finite(pending, epoch, steps_per_epoch, state)
                    if mid_epoch:
                        partial = all_reduce_sum(loss_sum.clone().reshape(1)).item()
                        if ctx.is_main:
                            state.save(
                                epoch, step + 1, {"history": history, "best": best, "loss_sum": partial}
                            )
                        last_save = time.monotonic()
                    if stop:
                        if not mid_epoch:
                            log.warning("stopping inside epoch %d without a checkpoint of it", epoch + 1)
                        signals.stop()
            _check_finite(pending, epoch, steps_per_epoch, state)
            timings = _timings(
                ctx, t0 + t_pass, t_pass, t_transform, steps_per_epoch - (first if resuming else 0)
            )
            train_s += timings["time/train_s"]
            if not per_step:
                for group, lr in zip(optimizer.param_groups, scheduler.get_last_lr()):
                    group["lr"] = lr  # undo the warm-up factor: the schedulers compute from the current lr
                scheduler.step()
            train_loss = all_reduce_sum(loss_sum.reshape(1)).item() / (steps_per_epoch * ctx.world_size)
            metrics = {"epoch": epoch + 1, "train/loss": train_loss, "lr": optimizer.param_groups[0]["lr"]}
            evaluated, calibration = evaluate_all()
            metrics.update(evaluated)
            if "test/acc" in metrics:
                history.append(metrics["test/acc"])
            if select is not None and _better(evaluated[select[0]], best, select[1]):
                best = _snapshot(model, evaluated, calibration, select)
            metrics.update(epoch_metrics())
            metrics.update(timings)
            metrics["time/epoch_s"] = time.perf_counter() - t0
            _log(ctx, tag, metrics, epoch)
            if ctx.is_main:
                if cfg.progress:
                    log.info(
                        "%sepoch %d/%d  %s", f"{tag}: " if tag else "", epoch + 1, cfg.epochs, _brief(metrics)
                    )
                if cfg.checkpoint:
                    state.save(epoch, None, {"history": history, "best": best})
            last_save = time.monotonic()
            if _agree(ctx, signals.signum is not None)[0]:
                signals.stop()
    if best is not None:  # the best epoch's weights and evaluation
        model.load_state_dict(best["state"])
        metrics.update(best["metrics"])
        calibration = best["calibration"]
        log.info(
            "%skept the weights of the best %s, %.4f", f"{tag}: " if tag else "", select[0], best["value"]
        )
    elif not metrics:  # resumed a finished run: report the model as it is
        metrics, calibration = evaluate_all()
    metrics.update(history_summary(history))
    metrics["time/train_total_s"] = train_s  # the training steps of this process (not the resumed part)
    if ctx.is_main and "test" in calibration:
        reliability_plot(ctx.dir / "reliability.png", calibration["test"], "test")
    return metrics


def _better(value: float, best: dict | None, mode: str) -> bool:
    return best is None or (value > best["value"] if mode == "max" else value < best["value"])


def _snapshot(model, evaluated: dict, calibration: dict, select) -> dict:
    state = {key: value.detach().cpu().clone() for key, value in model.state_dict().items()}
    return {"value": evaluated[select[0]], "state": state, "metrics": evaluated, "calibration": calibration}


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
    keys = ("base_lrs", "T_max", "eta_min", "milestones", "gamma")
    wanted = {**stand_in.defaults, "initial_lr": cfg.lr}
    wanted.pop("lr")
    same = all(g.get(k) == v for g in optimizer.param_groups for k, v in wanted.items())
    if same and all(scheduler.state_dict().get(k) == reference.state_dict().get(k) for k in keys):
        return
    for group in optimizer.param_groups:
        group.update(wanted, lr=reference.get_last_lr()[0])
    scheduler.load_state_dict(reference.state_dict())
    log.info("resumed with the config's optimizer settings and schedule: lr %g at epoch %d",
             reference.get_last_lr()[0], epoch + 1)  # fmt: skip


def _check_finite(pending, epoch: int, steps: int, state: Resumable) -> None:
    """Stop (Diverged) if the step in `pending` had a non-finite loss."""
    if pending is not None and not bool(pending[1]):
        raise Diverged(
            f"non-finite loss at epoch {epoch + 1}, step {pending[0] + 1}/{steps}; last good checkpoint: "
            f"{state.last}; lower train.lr (or check the data)"
        )


# Under DDP the ranks vote on stopping / saving every AGREE_EVERY steps: each vote is an all-reduce read
# on the host, which stalls the GPU queue, and a stop signal may wait this many steps.
AGREE_EVERY = 16


def _agree(ctx: RunContext, *flags: bool) -> list[bool]:
    """Each flag, true if it is true on any rank (so that every rank stops or saves at the same step)."""
    if not ctx.distributed:
        return list(flags)
    votes = all_reduce_sum(torch.tensor([float(f) for f in flags], device=ctx.device))
    return [bool(v > 0) for v in votes.tolist()]


def _timings(ctx: RunContext, t_start: float, t_pass: float, t_transform: float, steps: int) -> dict:
    """The epoch's time split: the method's per-epoch pass, the training steps (ms per step) and the
    batch transforms within them (the mixup family's CPU work); peak GPU memory on CUDA."""
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)
    train_s = time.perf_counter() - t_start
    out = {"time/pass_s": t_pass, "time/train_s": train_s, "time/step_ms": 1000 * train_s / max(steps, 1)}
    out["time/transform_s"] = t_transform
    if ctx.device.type == "cuda":
        out["mem/peak_gb"] = torch.cuda.max_memory_allocated(ctx.device) / 2**30
    return out


def _brief(metrics: dict) -> str:
    keys = ("train/loss", "val/acc", "test/acc", "select/precision", "select/recall", "time/epoch_s")
    return "  ".join(f"{k} {metrics[k]:.4f}" for k in keys if k in metrics)
