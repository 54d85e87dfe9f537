"""One training step: its parts (`Step`), the method's host draws, the eager step (`eager_step`: transform,
loss, backward, clip, optimizer step, EMA), the step captured as one CUDA graph (`GraphedStep`, where
`not_capturable` finds nothing against it), and the checks the host reads from the device once every
AGREE_EVERY steps (`DeferredChecks`)."""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from runner.data import Data
from runner.hardware import RunContext, Stopwatch, all_reduce_sum, to_device
from runner.instruments import around
from runner.losses import soft_cross_entropy
from runner.method_hooks import MethodHooks
from runner.optim import make_optimizer, make_scheduler

log = logging.getLogger(__name__)


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
    step_fn: object = None  # eager_step, or its torch.compile'd twin (set by `make_step`)
    draw: object = None  # the method's host draws before each step (`MethodHooks.draw`)
    graphed: GraphedStep | None = None  # the step captured as one CUDA graph (hardware.cuda_graph)


def train_step(s: Step, x: torch.Tensor, idx: torch.Tensor, epoch: int) -> torch.Tensor:
    """One training step: the method's host draws (`draw_step`), then the step replayed from its CUDA graph
    (`s.graphed`) or run by `s.step_fn` (`eager_step`, compiled where asked); the batch's mean loss, on the
    device."""
    with around("step", s, x, idx, epoch):
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
    """The step (`Step.step_fn`) captured as one CUDA graph and replayed each step: one launch for the
    network's forward, backward, loss and optimizer step, where the eager step launches hundreds from Python.

    The batch and the method's host draws (`MethodHooks.draw`) are copied into static buffers before each
    replay; the lr lives in a tensor on the device (`set_lr` and the schedulers write it in place), so the
    schedules hold. Each batch shape (with the hooks' `capture_key`) is first run `WARMUP` times eagerly
    on a side stream (cuDNN's autotuning, the optimizer's lazy state, a method's constants made at its
    first call), then captured: a new shape (a training phase's) or key is captured anew. Off CUDA nothing
    is captured: the warm-up steps and then the same region run eagerly on the same static buffers (the
    same copies in and the loss's copy out), which is how the CPU tests and `runner.device_tracking`
    follow it."""

    WARMUP = 3

    def __init__(self, s: Step, capture_key=lambda epoch: None):
        self.s, self.capture_key, self.cuda = s, capture_key, s.ctx.device.type == "cuda"
        # the batch transform runs inside the one graph: not timed apart (time/transform_s stays 0)
        s.transform_time = Stopwatch(self.cuda, timing=False)
        for group in s.optimizer.param_groups:
            if not isinstance(group["lr"], torch.Tensor):
                # filled on the device (no host copy to wait for); float32 as torch.tensor(float) made it
                group["lr"] = torch.full((), float(group["lr"]), device=s.ctx.device)
        self.graph = self.pool = self.key = None
        self.warm: dict[tuple, int] = {}

    def __call__(self, x: torch.Tensor, idx: torch.Tensor, epoch: int, drawn: list[tuple]) -> torch.Tensor:
        inputs = (x, idx, *(t for part in drawn for t in part))
        key = (*((t.shape, t.stride(), t.dtype) for t in inputs), self.capture_key(epoch))
        if self.warm.get(key, 0) < self.WARMUP:
            self.warm[key] = self.warm.get(key, 0) + 1
            with around("warm_up"):
                return self.warm_up(x, idx, epoch, drawn)
        if key != self.key:
            self.capture(inputs, epoch, drawn, key)
        else:
            for static, value in zip(self.inputs, inputs):
                static.copy_(value, non_blocking=True)
        if self.cuda:
            self.graph.replay()
        else:  # the captured region, run eagerly on the static buffers as a replay would
            with around("captured"):
                self.loss = self.s.step_fn(self.s, *self.static_step_inputs)
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
        """The static buffers of this key's inputs and, on CUDA, the step captured on them."""
        self.graph = None  # the last shape's graph: its memory back to the pool
        self.inputs, self.key = tuple(t.clone() for t in inputs), key
        x, idx, *flat = self.inputs
        parts = iter(flat)  # the static draws, grouped per micro-batch again
        static_drawn = [tuple(next(parts) for _ in part) for part in drawn]
        self.static_step_inputs = (x, idx, epoch, static_drawn)
        if not self.cuda:
            return
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: the DataLoader's pin-memory thread keeps calling CUDA while this thread captures
        capturing = torch.cuda.graph(self.graph, pool=self.pool, capture_error_mode="thread_local")
        with capturing, around("captured"):
            self.loss = self.s.step_fn(self.s, *self.static_step_inputs)
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


def make_step(model, data: Data, cfg, ctx: RunContext, hooks: MethodHooks) -> Step:
    """A fit's Step: the optimizer and its schedule (the config's `cfg.optimizer`, or the method's own
    `hooks.optimizer`), the network to train through (compiled alone, or with the whole step where the hooks
    are `capturable`) and the EMA; under `hardware.cuda_graph` the step captured as one CUDA graph where it
    can be (`not_capturable`), else one line why."""
    if hooks.optimizer is None:
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
    s = Step(
        net, model, optimizer, scheduler, per_step, ctx.grad_scaler(), ctx,
        to_device(data.train.y, ctx.device), data.num_classes,
        hooks.transform, hooks.loss, cfg.accumulate,
        cfg.clip_grad_norm, ema, ctx.stopwatch(), torch.zeros((), device=ctx.device),
        torch.zeros(2, device=ctx.device),
        # the transform's passes through the compiled network, but not through DDP (whose gradient
        # hooks expect one backward per forward): under DDP a compiled twin of the model
        net if not ctx.distributed else ctx.compiled(model),
        step_fn=ctx.compiled(eager_step) if whole_step else eager_step, draw=hooks.draw,
    )  # fmt: skip
    if ctx.cuda_graph:
        why = not_capturable(s, hooks)
        if why is None:
            s.graphed = GraphedStep(s, hooks.capture_key)
        elif ctx.is_main:
            log.info("hardware.cuda_graph: the training step runs eagerly: %s", why)
    return s


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
        host = to_device(flags, ctx.device, torch.float64)
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
