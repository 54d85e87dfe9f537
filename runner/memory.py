"""A fit's batches in memory: `train.accumulate=auto`, the micro-batches per step that fit the GPU, from a
probe of the model's forward and backward (`fits_in_memory`, `micro_batches`), and the batch settings
checked before anything is built (`check_batch_settings`)."""

from __future__ import annotations

import logging

import torch

from runner.checks import ConfigError
from runner.data import Data
from runner.hardware import RunContext, module_to_device
from runner.method_hooks import MethodHooks

log = logging.getLogger(__name__)


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
    module_to_device(model, ctx.device)  # one copy the host does not wait for
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


def check_batch_settings(model, data: Data, cfg, ctx: RunContext, hooks: MethodHooks) -> None:
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
