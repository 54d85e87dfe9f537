"""The training loop every classification-style task shares.

`fit` trains on in-memory tensors (the whole split on the device, batches by index), evaluates on
val and test each epoch, logs to the tracker, checkpoints every epoch and resumes from the last
checkpoint in the run dir. Methods plug in through a `hooks` object with any of:

    on_epoch_start(epoch, model, data)                  e.g. CSOT's sample selection
    transform(x, y_soft, idx, model) -> (x, y_soft)     a batch transform (mixup family)
    loss(model, x, y_soft, idx, epoch) -> scalar         replaces the soft cross-entropy
    state_dict() / load_state_dict(state)               kept in checkpoints
"""

from __future__ import annotations

import logging
import time

import torch
import torch.nn.functional as F
from tqdm import tqdm

from runner.data import Data, Split
from runner.hardware import RunContext, all_reduce_sum
from runner.schema import ConfigError

log = logging.getLogger(__name__)

CHECKPOINT = "checkpoints/last.pt"


def soft_cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean over the batch of -sum_k target_k log softmax(logits)_k."""
    return -(target * F.log_softmax(logits, dim=1)).sum(dim=1).mean()


def augment_crop_flip(x: torch.Tensor, pad: int = 4) -> torch.Tensor:
    """Random crop with zero padding `pad` and random horizontal flip, per sample, on x's device."""
    b, _, h, w = x.shape
    padded = F.pad(x, (pad, pad, pad, pad))
    dy = torch.randint(0, 2 * pad + 1, (b, 1, 1), device=x.device)
    dx = torch.randint(0, 2 * pad + 1, (b, 1, 1), device=x.device)
    rows = (torch.arange(h, device=x.device).view(1, h, 1) + dy).expand(b, h, w)
    cols = (torch.arange(w, device=x.device).view(1, 1, w) + dx).expand(b, h, w)
    flip = torch.rand(b, 1, 1, device=x.device) < 0.5
    cols = torch.where(flip, cols.flip(-1), cols)
    batch = torch.arange(b, device=x.device).view(b, 1, 1)
    return padded.permute(0, 2, 3, 1)[batch, rows, cols].permute(0, 3, 1, 2)


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


@torch.no_grad()
def predict(
    model, x: torch.Tensor, ctx: RunContext, batch_size: int = 1024, features: bool = False
) -> torch.Tensor:
    """Logits (with features=True: `forward_features`) for all of `x` in eval mode, returned on the CPU."""
    was_training = model.training
    model.eval()
    forward = model.forward_features if features else model
    out = []
    for i in range(0, len(x), batch_size):
        with ctx.autocast():
            out.append(forward(x[i : i + batch_size].to(ctx.device)).float().cpu())
    model.train(was_training)
    return torch.cat(out) if out else torch.empty(0)


@torch.no_grad()
def evaluate(model, split: Split, ctx: RunContext, batch_size: int = 1024) -> dict:
    """Accuracy and mean cross-entropy against the clean labels; shards and sums over ranks."""
    shard = slice(ctx.rank, None, ctx.world_size)
    x, y = split.x[shard], split.y_clean[shard]
    logits = predict(model, x, ctx, batch_size)
    totals = torch.tensor(
        [float((logits.argmax(1) == y).sum()), float(F.cross_entropy(logits, y, reduction="sum")), len(y)]
        if len(y)
        else [0.0, 0.0, 0.0],
        dtype=torch.float64,
        device=ctx.device,
    )
    correct, loss, n = all_reduce_sum(totals).tolist()
    return {"acc": correct / max(n, 1), "loss": loss / max(n, 1)}


def _evaluate_splits(model, data: Data, ctx: RunContext, batch_size: int) -> dict:
    """`val/acc`, `val/loss`, `test/acc`, `test/loss` for the non-empty splits."""
    return {
        f"{name}/{key}": value
        for name in ("val", "test")
        if len(getattr(data, name))
        for key, value in evaluate(model, getattr(data, name), ctx, batch_size).items()
    }


def save_checkpoint(path, state) -> None:
    """torch.save `state` to `path` atomically (write a temporary file, then rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    tmp.replace(path)  # atomic: a kill during the save leaves the previous checkpoint intact


def fit(model, data: Data, cfg, ctx: RunContext, hooks=None, augment: str = "none") -> dict:
    """Train `model` on `data.train` for `cfg.epochs` (a `TrainConfig`); return the final metrics."""
    # train.batch_size is the global batch; under DDP each rank takes its share of every batch, so the
    # averaged gradient steps are those of one process: hardware changes the speed, not the experiment.
    if cfg.batch_size % ctx.world_size:
        raise ConfigError(f"train.batch_size={cfg.batch_size}: must split evenly over {ctx.world_size} ranks")
    model.to(ctx.device)
    net = model
    if ctx.distributed:
        net = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[ctx.device.index] if ctx.device.index is not None else None
        )
    optimizer = make_optimizer(model, cfg)
    scheduler = make_scheduler(optimizer, cfg)
    scaler = torch.amp.GradScaler(enabled=ctx.amp and ctx.device.type == "cuda")
    x_train, y_train = data.train.x.to(ctx.device), data.train.y.to(ctx.device)
    n, k = len(y_train), data.num_classes
    steps_per_epoch = max(1, n // cfg.batch_size)

    # The hooks a method provides (see the module docstring); None for those it leaves out.
    on_epoch_start = getattr(hooks, "on_epoch_start", None)
    transform = getattr(hooks, "transform", None)
    hook_loss = getattr(hooks, "loss", None)

    start, ckpt_path = 0, ctx.dir / CHECKPOINT
    if cfg.checkpoint and ckpt_path.exists():
        state = torch.load(ckpt_path, map_location=ctx.device, weights_only=False)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        scaler.load_state_dict(state["scaler"])
        if hasattr(hooks, "load_state_dict") and state.get("hooks") is not None:
            hooks.load_state_dict(state["hooks"])
        torch.set_rng_state(state["rng"].cpu())  # map_location moved it to the device too
        start = state["epoch"] + 1
        ctx.tracker.truncate(state["epoch"])
        log.info("resumed from %s at epoch %d", ckpt_path, start)

    metrics: dict = {}
    for epoch in range(start, cfg.epochs):
        t0 = time.perf_counter()
        model.train()
        if on_epoch_start is not None:
            on_epoch_start(epoch, model, data)
        # The same permutation on every rank; each rank takes an interleaved shard of each global batch.
        g = torch.Generator().manual_seed(torch.initial_seed() * 1_000_003 + epoch)
        order = torch.randperm(n, generator=g)[: steps_per_epoch * cfg.batch_size][ctx.rank :: ctx.world_size]
        loss_sum = torch.zeros((), device=ctx.device)
        bar = tqdm(
            order.split(cfg.batch_size // ctx.world_size),
            desc=f"epoch {epoch + 1}/{cfg.epochs}",
            leave=False,
            disable=None if cfg.progress and ctx.is_main else True,
        )
        for idx in bar:
            idx = idx.to(ctx.device)
            x, y_soft = x_train[idx], F.one_hot(y_train[idx], k).float()
            if augment == "crop_flip":
                x = augment_crop_flip(x)
            if transform is not None:
                x, y_soft = transform(x, y_soft, idx, model)
            with ctx.autocast():
                if hook_loss is not None:
                    loss = hook_loss(net, x, y_soft, idx, epoch)
                else:
                    loss = soft_cross_entropy(net(x), y_soft)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            loss_sum += loss.detach()
        scheduler.step()
        train_loss = all_reduce_sum(loss_sum.reshape(1)).item() / (steps_per_epoch * ctx.world_size)
        metrics = {"epoch": epoch + 1, "train/loss": train_loss, "lr": optimizer.param_groups[0]["lr"]}
        metrics.update(_evaluate_splits(model, data, ctx, cfg.eval_batch_size))
        metrics["time/epoch_s"] = time.perf_counter() - t0
        ctx.tracker.log(metrics, step=epoch)
        if ctx.is_main:
            log.info("epoch %d/%d  %s", epoch + 1, cfg.epochs, _brief(metrics))
            if cfg.checkpoint:
                save_checkpoint(
                    ckpt_path,
                    {
                        "epoch": epoch,
                        "model": model.state_dict(),
                        "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(),
                        "scaler": scaler.state_dict(),
                        "rng": torch.get_rng_state(),
                        "hooks": hooks.state_dict() if hasattr(hooks, "state_dict") else None,
                    },
                )
    if not metrics:  # resumed a finished run, or epochs=0: report the model as it is
        metrics = _evaluate_splits(model, data, ctx, cfg.eval_batch_size)
    return metrics


def _brief(metrics: dict) -> str:
    keys = ("train/loss", "val/acc", "test/acc", "time/epoch_s")
    return "  ".join(f"{k} {metrics[k]:.4f}" for k in keys if k in metrics)
