"""The one data path every consumer uses: `batches` walks a split in index batches (training: the epoch's
batches of this rank, `EpochBatches`; evaluation and per-epoch method passes: `in_order`), so the same code
serves in-memory splits (sliced on the device) and file-backed ones (a DataLoader with
`hardware.num_workers` decoding processes and pinned memory)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from runner.checks import ConfigError
from runner.data import Split
from runner.data.files import UNREADABLE
from runner.data.views import augment_crop_flip
from runner.hardware import RunContext, to_device


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
            x = resized(self.split.decode(to_device(x, self.ctx.device)), self.image_size)
            yield self.ctx.to_input(x), to_device(idx, self.ctx.device)


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
        order = to_device(torch.cat(host), self.ctx.device)
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
