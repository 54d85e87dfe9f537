"""The methods' training glue: the `runner.train.fit` hooks (batch transforms, losses, per-epoch passes)
and feature passes that wire the pure solvers of `runner.methods` into the loop. The import graph reads
solvers (`runner.methods`) -> loop (`runner.train`) -> hooks (here) -> tasks (`runner/tasks/`). Every hooks
class subclasses `MethodHooks`, imported from `runner.method_hooks` (below the loop, which imports it)."""

from runner.checks import ConfigError

__all__ = ["check_batch"]


def check_batch(key: str, batch_size: int, ctx, n_train: int, need: int, why: str, accumulate=1) -> None:
    """ConfigError (with the fix) unless each training step of `batch_size` (the config's `key`) gives
    every rank and micro-batch at least `need` samples: what a method that mixes or normalises over the
    batch must have; `why` names it. A training set smaller than the batch is one step of all of it
    (`runner.batches.EpochBatches`)."""
    accumulate = 1 if accumulate == "auto" else accumulate  # auto splits only into shares that divide
    parts = ctx.world_size * accumulate
    if min(batch_size, n_train) // parts >= need:
        return
    shares = {f"{ctx.world_size} ranks": ctx.world_size, f"{accumulate} micro-batches": accumulate}
    spread = " x ".join(share for share, n in shares.items() if n > 1)
    fix = f"set {key}>={need * parts}"
    if n_train < need * parts:
        fix = f"the training set has {n_train} samples: give it at least {need * parts}"
    where = f"{key}={batch_size}" + (f" over {spread}" if spread else "")
    raise ConfigError(f"{where}: {why} needs at least {need} inputs per step; {fix}")
