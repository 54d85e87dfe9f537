"""Per-epoch and final passes of a method over its data, under DDP too: each rank predicts its shard and every
rank gets the whole; one rank decides and every rank gets its decision; the loss of a global batch. Without
a process group each is the plain single-process operation."""

from __future__ import annotations

import torch
import torch.distributed as dist

from runner.batches import batches, in_order
from runner.evaluation import predict
from runner.hardware import RunContext


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def predict_all(model, split, ctx: RunContext, batch_size: int = 1024, features: bool = False):
    """`runner.evaluation.predict` over every sample of `split`, in index order, on every rank: rank r
    predicts samples r, r + W, r + 2W, ... (W ranks) and the shards are all-gathered (on the device under
    NCCL)."""
    if not _distributed():
        return predict(model, split, ctx, batch_size, features)
    rank, world, n = dist.get_rank(), dist.get_world_size(), len(split)
    mine = predict(model, split.subset(torch.arange(rank, n, world)), ctx, batch_size, features)
    shapes = [None] * world
    dist.all_gather_object(shapes, tuple(mine.shape[1:]) if len(mine) else None)
    trailing = next(s for s in shapes if s is not None)  # a rank whose shard is empty learns the shape
    rows = -(-n // world)
    device = ctx.device if dist.get_backend() == "nccl" else torch.device("cpu")
    padded = torch.zeros((rows, *trailing), dtype=torch.float32, device=device)
    padded[: len(mine)] = mine.reshape(len(mine), *trailing).to(device)
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded)
    out = torch.empty((n, *trailing), dtype=torch.float32)
    for r, part in enumerate(parts):
        out[r::world] = part[: len(range(r, n, world))].cpu()
    return out


def decoded_inputs(split, ctx: RunContext, batch_size: int = 1024) -> torch.Tensor:
    """The network inputs of every sample of `split` (decoded, not augmented), on the CPU in index order."""
    parts = [x.cpu() for x, _ in batches(split, ctx, in_order(len(split), batch_size))]
    return torch.cat(parts) if parts else torch.empty(0)


def rows_of(splits, pool_idx, compute) -> torch.Tensor:
    """`compute(split)` (a (len(split), ...) tensor) for the samples `pool_idx` of the concatenation of
    `splits`, in the order of `pool_idx`: each split computes only its own samples, as one subset."""
    pool_idx = torch.as_tensor(pool_idx, dtype=torch.long)
    offsets = torch.tensor([0] + [len(s) for s in splits]).cumsum(0)
    which = torch.searchsorted(offsets, pool_idx, right=True) - 1
    out = None
    for s, split in enumerate(splits):
        pos = (which == s).nonzero()[:, 0]
        if len(pos):
            rows = compute(split.subset(pool_idx[pos] - offsets[s]))
            if out is None:
                out = torch.empty((len(pool_idx), *rows.shape[1:]), dtype=rows.dtype)
            out[pos] = rows
    return out


def broadcast_from_main(obj):
    """`obj` of rank 0 on every rank (pickled; for decisions such as a selection, not for bulk tensors)."""
    if not _distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class _GatherRows(torch.autograd.Function):
    """All-gather along dim 0 (equal shapes); backward: the summed gradient of this rank's rows."""

    @staticmethod
    def forward(ctx, t):
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, t.contiguous())
        ctx.rows, ctx.rank = len(t), dist.get_rank()
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad)  # every rank's loss reads every row
        return grad[ctx.rank * ctx.rows : (ctx.rank + 1) * ctx.rows]


def global_batch(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each tensor concatenated over the ranks (rank 0's shard first; shards of equal size, as fit's),
    differentiable: a loss computed on the global batch is the same on every rank, its gradient reaches
    each rank's shard summed over the ranks' losses, and DDP's average of the ranks' parameter gradients
    is then the one-process gradient, even for losses that couple the samples of a batch (batch priors,
    column sums)."""
    if not _distributed():
        return tensors
    return tuple(_GatherRows.apply(t) for t in tensors)
