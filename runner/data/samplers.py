"""Index-batch samplers beyond `runner.train.EpochBatches`, in its protocol (`set_epoch(epoch, start)`,
`__len__`, `__iter__` over this rank's index tensors), for `fit`'s `batch_sampler` hook.

- `ClassBalancedSampler` / `ClassBalancedEpochs`: batches of nc classes x m examples (the hierarchical
  hash), batch i a pure function of (seed, i), cut into epochs of a fixed number of iterations.
- `pool_batches` / `PoolBatches`: one batch from each of several index pools per step (CSOT's clean and
  unlabeled loaders), the epoch as long as the longer pool, the shorter one cycling.
- `EpochSample`: a fresh class-balanced sample of the training set each epoch (DivideMix's Clothing1M
  protocol, `dataset.epoch_samples`), a function of (seed, epoch); `SampleBatches`: an epoch's shuffled
  batches over such a sample, of a batch size that may change with the epoch (CSOT's warm-up batch).
"""

from __future__ import annotations

import numpy as np
import torch

from runner.checks import ConfigError


def _epoch_generator(seed: int, epoch: int) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + epoch) % 2**63)


class ClassBalancedSampler:
    """Batches of `nc` distinct classes x `m` distinct examples each, as an (nc, m) index array;
    batch i is a function of (seed, i) alone, so a resumed run draws the batches it would have."""

    def __init__(self, labels, nc, m, seed):
        labels = np.asarray(labels)
        self.by_class = [idx for c in np.unique(labels) if len(idx := np.flatnonzero(labels == c)) >= m]
        if len(self.by_class) < nc:
            raise ConfigError(
                f"method.classes_per_batch={nc}: only {len(self.by_class)} classes have >= {m} training "
                f"examples (method.per_class); set method.classes_per_batch<={len(self.by_class)}"
            )
        self.nc, self.m, self.seed = nc, m, list(np.atleast_1d(seed))

    def batch(self, i: int) -> np.ndarray:
        rng = np.random.default_rng([*self.seed, i])
        classes = rng.choice(len(self.by_class), self.nc, replace=False)
        return np.stack([rng.choice(self.by_class[c], self.m, replace=False) for c in classes])

    def stream(self, start: int, stop: int) -> list[torch.Tensor]:
        """Flat index batches start..stop-1 (class-major)."""
        return [torch.as_tensor(self.batch(i).ravel()) for i in range(start, stop)]


class ClassBalancedEpochs:
    """`sampler`'s batches as epochs of `epoch_iters` iterations, `iters` in all: epoch e yields batches
    e L .. min((e + 1) L, iters) - 1 (L = epoch_iters), skipping the first `start` (mid-epoch resume).
    Under DDP rank r takes the r-th contiguous slice of each class-major batch, so that the ranks' shards
    concatenated in rank order (`runner.distributed_passes.global_batch`) are the batch again."""

    def __init__(self, sampler: ClassBalancedSampler, epoch_iters: int, iters: int, rank=0, world_size=1):
        self.sampler, self.epoch_iters, self.iters = sampler, epoch_iters, iters
        self.rank, self.world_size = rank, world_size
        self.epoch, self.start = 0, 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.epoch, self.start = epoch, start

    def __len__(self) -> int:
        first = self.epoch * self.epoch_iters
        return max(0, min(first + self.epoch_iters, self.iters) - first)

    def __iter__(self):
        first = self.epoch * self.epoch_iters
        for batch in self.sampler.stream(first + self.start, first + len(self)):
            yield batch.tensor_split(self.world_size)[self.rank]


def pool_batches(pool: torch.Tensor, steps: int, batch_size: int, generator: torch.Generator) -> torch.Tensor:
    """(steps, batch_size) global index batches drawn from `pool` as a shuffled loader that is re-shuffled
    and restarted whenever it runs out (the shorter loader of the paper cycles): consecutive fresh
    permutations of the pool, cut into batches. A pool smaller than a batch repeats within it."""
    need = steps * batch_size
    cycles = -(-need // len(pool))
    order = torch.cat([pool[torch.randperm(len(pool), generator=generator)] for _ in range(cycles)])
    return order[:need].view(steps, batch_size)


def balanced_quotas(counts, size: int) -> np.ndarray:
    """How many of each class a sample of `size` takes: equal shares, a class smaller than its share giving
    all it has and the rest spread over the larger ones (the larger classes take the remainder)."""
    counts = np.asarray(counts)
    quotas, left = np.zeros(len(counts), dtype=np.int64), size
    for rank, c in enumerate(np.argsort(counts, kind="stable")):
        quotas[c] = min(counts[c], left // (len(counts) - rank))
        left -= quotas[c]
    return quotas


class EpochSample:
    """Each epoch a fresh sample of `size` training indices, balanced over the classes of `labels` (the
    noisy ones: what DivideMix balances on Clothing1M) as `balanced_quotas`, each class's share drawn
    without replacement. The sample is a function of (seed, epoch) alone, so every rank draws it and a
    resumed run draws the one it would have; `__call__(epoch)` returns its indices in increasing order."""

    def __init__(self, labels, size: int, seed: int):
        labels = np.asarray(labels)
        if size > len(labels):
            raise ConfigError(
                f"dataset.epoch_samples={size}: more than the {len(labels)} training samples; "
                f"set it to at most {len(labels)} (or 0: every sample every epoch)"
            )
        self.by_class = [np.flatnonzero(labels == c) for c in np.unique(labels)]
        self.quotas = balanced_quotas([len(idx) for idx in self.by_class], size)
        self.seed, self._cached = seed, (None, None)

    def __call__(self, epoch: int) -> torch.Tensor:
        if self._cached[0] != epoch:
            rng = np.random.default_rng([self.seed, epoch])
            picked = [rng.choice(idx, q, replace=False) for idx, q in zip(self.by_class, self.quotas)]
            self._cached = (epoch, torch.as_tensor(np.sort(np.concatenate(picked))))
        return self._cached[1]


class SampleBatches:
    """Each epoch, the shuffled global batches of `batch_size(epoch)` over the indices `sample(epoch)`
    (the last partial one dropped, at least one), this rank taking its interleaved shard of each:
    `EpochBatches` over a sample, a function of (seed, epoch) the same on every rank and after a resume."""

    def __init__(self, sample, batch_size, rank: int = 0, world_size: int = 1, seed: int = 0):
        self.sample, self.batch_size = sample, batch_size
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.epoch, self.start = 0, 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.epoch, self.start = epoch, start

    def __len__(self) -> int:
        return max(1, len(self.sample(self.epoch)) // self.batch_size(self.epoch))

    def __iter__(self):
        g = _epoch_generator(self.seed, self.epoch)
        batches = pool_batches(self.sample(self.epoch), len(self), self.batch_size(self.epoch), g)
        return iter(list(batches[:, self.rank :: self.world_size])[self.start :])


class PoolBatches:
    """Each step, a global batch of `batch_size` from every non-empty pool of `pools()` (a list of index
    tensors, or None: then `fallback`'s batches); this rank takes its interleaved shard of each and
    gets them concatenated, pool by pool. The epoch runs for the longer pool's `len(pool) //
    batch_size` steps (at least one), the shorter pool cycling (`pool_batches`), as the paper's two
    loaders with drop_last. The batches are a function of (seed, epoch, pools): the same on every rank
    and after a resume. `layout` (set by each iteration over pools) is how many of this rank's samples each
    pool gives every batch (0 for an empty pool): its first `layout[0]` come from the first pool, and so
    on, so a loss splits a batch by position."""

    def __init__(
        self, pools, batch_size: int, rank: int = 0, world_size: int = 1, seed: int = 0, fallback=None
    ):
        self.pools, self.fallback = pools, fallback
        self.batch_size, self.rank, self.world_size, self.seed = batch_size, rank, world_size, seed
        self.epoch, self.start, self.layout = 0, 0, None

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.epoch, self.start = epoch, start
        if self.fallback is not None:
            self.fallback.set_epoch(epoch, start)

    def _steps(self, pools) -> int:
        return max(1, max(len(pool) // self.batch_size for pool in pools))

    def __len__(self) -> int:
        pools = self.pools()
        return len(self.fallback) if pools is None else self._steps(pools)

    def __iter__(self):
        pools = self.pools()
        if pools is None:
            return iter(self.fallback)
        g, steps = _epoch_generator(self.seed, self.epoch), self._steps(pools)
        shard = len(range(self.rank, self.batch_size, self.world_size))
        self.layout = [shard if len(pool) else 0 for pool in pools]
        shards = [
            pool_batches(pool, steps, self.batch_size, g)[:, self.rank :: self.world_size]
            for pool in pools
            if len(pool)
        ]
        return iter(list(torch.cat(shards, dim=1))[self.start :])
