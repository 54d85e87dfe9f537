"""Evaluation: a model's logits or features over a split (`predict`), its accuracy, loss and calibration
(`evaluate`), over every evaluation split of the data (`evaluate_splits`), and the epoch's evaluation of a
fit (`evaluate_all`: the method's own, or the splits')."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from runner.batches import STREAMED_EVAL_BATCH, batches, in_order
from runner.data import Data, Split
from runner.hardware import RunContext, all_reduce_sum, to_device
from runner.instruments import around
from runner.method_hooks import MethodHooks
from runner.metrics import calibration_bins, expected_calibration_error

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
    y_clean = to_device(shard.y_clean, ctx.device)
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


def evaluate_splits(model, data: Data, ctx: RunContext, batch_size: int, bins: int = 15) -> tuple[dict, dict]:
    """(`<split>/<metric>` for every evaluation split, the calibration bins by split); ECE over `bins`."""
    metrics, calibration = {}, {}
    for name, split in data.eval_splits().items():
        result = evaluate(model, split, ctx, batch_size, top5=data.meta.get("top5", False), bins=bins)
        calibration[name] = result.pop("calibration")
        metrics.update({f"{name}/{key}": value for key, value in result.items()})
    return metrics, calibration


def evaluate_all(model, data: Data, ctx: RunContext, cfg, hooks: MethodHooks) -> tuple[dict, dict]:
    """The epoch's evaluation: the method's own (`hooks.evaluate`), or every evaluation split's metrics."""
    with around("evaluation"):
        if hooks.evaluate is not None:
            return hooks.evaluate(model), {}
        return evaluate_splits(model, data, ctx, cfg.eval_batch_size, cfg.ece_bins)
