"""One training step: its parts (`Step`), the method's host draws and host read, the eager step
(`eager_step`: transform, loss, backward, clip, optimizer step, EMA), the step captured as one CUDA graph
(`GraphedStep`, where `not_capturable` finds nothing against it; two graphs around a method's host read),
and the checks the host reads from the device once every AGREE_EVERY steps (`DeferredChecks`)."""

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
    and loss scaler, the training labels on the device, the method's `transform`, `loss`, `draw`, `read`
    and `solve` hooks, the micro-batches per step (`accumulate`), the gradient-norm bound (`clip`, 0:
    none) and the EMA of the weights (`ema`, an `AveragedModel`, or None). Kept on the device for the
    epoch's row: the steps the fp16 scaler skipped, and the sum and count of finite pre-clip gradient
    norms."""

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
    read: object = None  # the method's device work up to its one host read (`MethodHooks.read`)
    solve: object = None  # the method's host work on what `read` gave (`MethodHooks.solve`)


def train_step(s: Step, x: torch.Tensor, idx: torch.Tensor, epoch: int) -> torch.Tensor:
    """One training step: the method's host draws (`draw_step`), then the step replayed from its CUDA graph
    (`s.graphed`) or run eagerly (`run_step`); the batch's mean loss, on the device."""
    with around("step", s, x, idx, epoch):
        drawn = draw_step(s, x, idx)
        if s.graphed is not None:
            return s.graphed(x, idx, epoch, drawn)
        return run_step(s, x, idx, epoch, drawn)


def run_step(s: Step, x: torch.Tensor, idx: torch.Tensor, epoch: int, drawn: list[tuple]) -> torch.Tensor:
    """The step, eagerly: the method's host read and solve, if any (`read_and_solve`), then `s.step_fn`
    (`eager_step`, compiled where asked) with their results."""
    return s.step_fn(s, x, idx, epoch, drawn, read_and_solve(s, x, idx, drawn))


def draw_step(s: Step, x: torch.Tensor, idx: torch.Tensor) -> list[tuple]:
    """The method's host draws for each micro-batch of the step (`MethodHooks.draw`), in the order the step
    takes them, on the device; [] for a method that draws nothing on the host."""
    if s.draw is None:
        return []
    return [s.draw(x_part, _targets(s, idx_part), idx_part, s.hook_net)
            for x_part, idx_part in zip(x.chunk(s.accumulate), idx.chunk(s.accumulate))]  # fmt: skip


def read_and_solve(s: Step, x: torch.Tensor, idx: torch.Tensor, drawn: list[tuple]) -> list[tuple]:
    """For a method with a host read, per micro-batch: its device work up to the read (`read_step`), the
    read and the host's solve (`solve_step`), the results sent to the device; [] for the others."""
    if s.read is None:
        return []
    solved = solve_step(s, read_step(s, x, idx, drawn))
    return [tuple(to_device(t, s.ctx.device) for t in part) for part in solved]


def read_step(s: Step, x: torch.Tensor, idx: torch.Tensor, drawn: list[tuple]) -> list[tuple]:
    """The method's device work up to its host read (`MethodHooks.read`), per micro-batch: the tensors the
    host is to read (nothing here waits for the device)."""
    parts = enumerate(zip(x.chunk(s.accumulate), idx.chunk(s.accumulate)))
    return [s.read(x_part, _targets(s, idx_part), idx_part, s.hook_net, **_given(s, drawn, i))
            for i, (x_part, idx_part) in parts]  # fmt: skip


def solve_step(s: Step, values: list[tuple]) -> list[tuple]:
    """The step's one host read: `values` (`read_step`'s) copied to the host, then the method's host work
    on them (`MethodHooks.solve`), per micro-batch: host tensors for the device."""
    host = _to_host([t for part in values for t in part], s.ctx.device)
    parts = iter(host)
    return [tuple(torch.as_tensor(v) for v in s.solve(*(next(parts) for _ in part))) for part in values]


def _to_host(values: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """`values` on the host: on CUDA into page-locked memory, all copies queued before the one wait."""
    if device.type != "cuda":
        return [t.cpu() for t in values]
    host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in values]
    for h, t in zip(host, values):
        h.copy_(t, non_blocking=True)
    torch.cuda.current_stream(device).synchronize()
    return host


def eager_step(
    s: Step, x: torch.Tensor, idx: torch.Tensor, epoch: int, drawn: list[tuple], solved: list[tuple] = ()
) -> torch.Tensor:
    """batch -> transform -> loss -> backward (per micro-batch, each with its `drawn` values and, for a
    method with a host read, its `solved` ones) -> clip -> optimizer step -> EMA; returns the batch's mean
    loss, detached, on the device (nothing here waits for the device)."""
    s.optimizer.zero_grad(set_to_none=True)
    total = 0.0
    for i, (x_part, idx_part) in enumerate(zip(x.chunk(s.accumulate), idx.chunk(s.accumulate))):
        # Under DDP the gradients are all-reduced once, with the last micro-batch's backward.
        last = i == s.accumulate - 1
        with contextlib.nullcontext() if last or not hasattr(s.net, "no_sync") else s.net.no_sync():
            loss = _loss(s, x_part, idx_part, epoch, _given(s, drawn, i, solved))
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
    """Why the step of this fit cannot be captured as one CUDA graph (or two around the method's host read,
    `MethodHooks.read`), or None when it can: every step must run the same device work on the same memory,
    with no host read or host-made value inside either graph."""
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
    A method with one host read inside its step (`MethodHooks.read`) is captured as two graphs sharing one
    memory pool, always replayed in the order they were captured: its device work up to the read
    (`read_step`), then, after the host read and solve (`solve_step`) whose results are copied into static
    buffers, the rest of the step.

    The batch and the method's host draws (`MethodHooks.draw`) are copied into static buffers before each
    replay; the lr lives in a tensor on the device (`set_lr` and the schedulers write it in place), so the
    schedules hold. Each batch shape (with the drawn tensors' shapes and the hooks' `capture_key`) is first
    run `WARMUP` times eagerly on a side stream (cuDNN's autotuning, the optimizer's lazy state, a method's
    constants made at its first call), then captured: a new batch shape (a training phase's) or key is
    captured anew, in place of the last one; drawn shapes that vary from step to step within one (Puzzle
    Mix's grid drawn per batch) each keep their capture. Off CUDA nothing is captured: the warm-up steps and
    then the same regions run eagerly on the same static buffers (the same copies in and the loss's copy
    out), which is how the CPU tests and `runner.device_tracking` follow it."""

    WARMUP = 3

    def __init__(self, s: Step, capture_key=lambda epoch: None):
        self.s, self.capture_key, self.cuda = s, capture_key, s.ctx.device.type == "cuda"
        # the batch transform runs inside the graphs: not timed apart (time/transform_s stays 0)
        s.transform_time = Stopwatch(self.cuda, timing=False)
        for group in s.optimizer.param_groups:
            if not isinstance(group["lr"], torch.Tensor):
                # filled on the device (no host copy to wait for); float32 as torch.tensor(float) made it
                group["lr"] = torch.full((), float(group["lr"]), device=s.ctx.device)
        self.captures: dict[tuple, _Capture] = {}
        self.warm: dict[tuple, int] = {}
        # per key, its last warm-up step's solved values: the shapes of its capture's static buffers (a key's
        # solve, e.g. Puzzle Mix's cuts on the grid it drew, differs in shape from another key's)
        self.solved: dict[tuple, list[tuple]] = {}

    def __call__(self, x: torch.Tensor, idx: torch.Tensor, epoch: int, drawn: list[tuple]) -> torch.Tensor:
        inputs = (x, idx, *(t for part in drawn for t in part))
        key = (*((t.shape, t.stride(), t.dtype) for t in inputs), self.capture_key(epoch))
        if self.warm.get(key, 0) < self.WARMUP:
            self.warm[key] = self.warm.get(key, 0) + 1
            with around("warm_up"):
                return self.warm_up(x, idx, epoch, drawn, key)
        c = self.captures.get(key)
        if c is None:
            c = self.capture(inputs, epoch, drawn, key)
        else:
            for static, value in zip(c.inputs, inputs):
                static.copy_(value, non_blocking=True)
        s = self.s
        if s.read is not None:
            x_static, idx_static, _, drawn_static = c.step_inputs
            self._replay(c, 0, lambda: setattr(c, "read", read_step(s, x_static, idx_static, drawn_static)))
            solved = [t for part in solve_step(s, c.read) for t in part]
            if [t.shape for t in solved] != [t.shape for t in c.solved]:
                raise RuntimeError(
                    f"the method's solve gave shapes {[tuple(t.shape) for t in solved]}, its "
                    f"capture {[tuple(t.shape) for t in c.solved]}: they must follow the "
                    "capture key"
                )
            for static, value in zip(c.solved, solved):
                static.copy_(value.pin_memory() if self.cuda else value, non_blocking=True)
        self._replay(c, -1, lambda: setattr(c, "loss", s.step_fn(s, *c.step_inputs, c.static_solved)))
        return c.loss.clone()

    def _replay(self, c: _Capture, part: int, run) -> None:
        """Replay graph `part` of capture `c`; off CUDA, run its region eagerly on the static buffers."""
        if self.cuda:
            c.graphs[part].replay()
        else:
            with around("captured"):
                run()

    def warm_up(self, x, idx, epoch: int, drawn: list[tuple], key: tuple) -> torch.Tensor:
        """One eager step (on a side stream on CUDA), outside what is captured; its solved values kept."""
        if not self.cuda:
            return self._eager(x, idx, epoch, drawn, key)
        side = torch.cuda.Stream(self.s.ctx.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            loss = self._eager(x, idx, epoch, drawn, key)
        torch.cuda.current_stream().wait_stream(side)
        return loss

    def _eager(self, x, idx, epoch: int, drawn: list[tuple], key: tuple) -> torch.Tensor:
        self.solved[key] = read_and_solve(self.s, x, idx, drawn)
        return self.s.step_fn(self.s, x, idx, epoch, drawn, self.solved[key])

    def capture(self, inputs: tuple, epoch: int, drawn: list[tuple], key: tuple) -> _Capture:
        """The static buffers of this key's inputs and, on CUDA, the step captured on them; the captures of
        other batch shapes or capture keys dropped first (their memory back)."""
        base = (key[:2], key[-1])  # the batch's shapes and the hooks' key: what a phase or an epoch changes
        dropped = [c for k, c in self.captures.items() if (k[:2], k[-1]) != base]
        self.captures = {k: c for k, c in self.captures.items() if (k[:2], k[-1]) == base}
        # the last shape's graphs go, their memory back to their pool, which the new capture takes
        pool = dropped[0].graphs[0].pool() if dropped and dropped[0].graphs else None
        del dropped
        c = self.captures[key] = _Capture()
        c.inputs = tuple(t.clone() for t in inputs)
        x, idx, *flat = c.inputs
        parts = iter(flat)  # the static draws, grouped per micro-batch again
        static_drawn = [tuple(next(parts) for _ in part) for part in drawn]
        c.step_inputs = (x, idx, epoch, static_drawn)
        c.static_solved = [tuple(t.clone() for t in part) for part in self.solved[key]]
        c.solved = [t for part in c.static_solved for t in part]
        if not self.cuda:
            return c
        s = self.s
        regions = [lambda: setattr(c, "loss", s.step_fn(s, x, idx, epoch, static_drawn, c.static_solved))]
        if s.read is not None:  # the device work up to the read first, replayed first
            regions.insert(0, lambda: setattr(c, "read", read_step(s, x, idx, static_drawn)))
        for region in regions:
            graph = torch.cuda.CUDAGraph()
            # thread_local: the DataLoader's pin-memory thread keeps calling CUDA while this thread captures
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"), around("captured"):
                region()
            c.graphs.append(graph)
            pool = graph.pool()
        log.info("training step captured as %d CUDA graph(s) (batch %s)", len(c.graphs), tuple(x.shape))
        return c


class _Capture:
    """One key's captured step: its static inputs (`inputs`, as the step takes them: `step_inputs`), the
    static buffers of its solve's results (`static_solved`, flat: `solved`), its graphs, and the static
    outputs of its regions (`read`: what the host reads; `loss`)."""

    def __init__(self):
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.read: list[tuple] = []
        self.loss: torch.Tensor | None = None


def _targets(s: Step, idx: torch.Tensor) -> torch.Tensor:
    """The batch's one-hot targets, float, on the device."""
    return F.one_hot(s.y_train[idx], s.num_classes).float()


def _given(s: Step, drawn: list[tuple], i: int, solved: list[tuple] | None = None) -> dict:
    """What the host gave micro-batch i, as the keywords a method's hooks take: its draws (`drawn=`, with a
    `draw` hook) and its solve's results (`solved=`, with a `read` hook; none yet in `read_step`)."""
    given = {} if s.draw is None else {"drawn": drawn[i]}
    return given if s.read is None or solved is None else given | {"solved": solved[i]}


def _loss(s: Step, x: torch.Tensor, idx: torch.Tensor, epoch: int, given: dict) -> torch.Tensor:
    y_soft = _targets(s, idx)
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
    # torch.compile takes the whole step where the method's hooks run device work alone (no host read
    # inside: `read`); else the network
    whole_step = ctx.compile != "false" and hooks.capturable and hooks.read is None
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
        step_fn=ctx.compiled(eager_step) if whole_step else eager_step, draw=hooks.draw, read=hooks.read,
        solve=hooks.solve,
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
