"""The training loop every classification-style task shares: `fit` trains, evaluates val, test and any extra
splits each epoch, logs to the tracker, checkpoints (every epoch, every `train.checkpoint_every_minutes`
and on a stop signal) and resumes from the last checkpoint in the run dir at the same step
(`runner.checkpoint.Resumable`). Methods plug in through a subclass of `runner.method_hooks.MethodHooks`
(`runner.method_hooks`), whose docstring lists every hook the loop calls (a per-epoch pass, a batch
transform, the loss, the optimizer, the evaluation, the batches, checkpointed state, and whether the step
may be captured or split) with the loop's default for each. Its rooms: the batches (`runner.batches`), the
step (`runner.step`), evaluation (`runner.evaluation`), checkpoints (`runner.checkpoint`), optimizers and
schedules (`runner.optim`), the memory probe (`runner.memory`); harnesses observe it through
`runner.instruments`.

Training by iterations: a hook's sampler cuts them into epochs (the unit of logging, evaluation and
epoch-end checkpoints) and its per-step scheduler follows the iteration count.

Progressive training (`train.phases`, `Phases`): each phase's epochs run at its batch size and image side
(the batches are made anew where those change) with its lr ramp, set before every step.
"""

from __future__ import annotations

import functools
import logging
import math
import time

import torch
from tqdm import tqdm

from runner.batches import EpochBatches, batches
from runner.checkpoint import Monitor, Resumable, checkpoint_file, is_better, on_host, selection, snapshot
from runner.checks import ConfigError
from runner.data import Data
from runner.data.files import UNREADABLE
from runner.evaluation import evaluate_all
from runner.faults import Diverged, StopSignals, out_of_memory_stops
from runner.hardware import RunContext, Stopwatch, all_reduce_sum, renew_host_memory_cap
from runner.instruments import around
from runner.memory import check_batch_settings
from runner.method_hooks import MethodHooks, PlainTraining
from runner.metrics import MONITORED, history_summary, parse_metric, reliability_plot
from runner.optim import Phases, final_image_size, follow_config
from runner.progress import EpochProgress
from runner.step import AGREE_EVERY, MIN_LOSS_SCALE, DeferredChecks, Step, make_step, train_step

log = logging.getLogger(__name__)

# Evaluated metrics whose per-epoch values a fit keeps: their best, last and median of the last 10
# (the Co-Mixup tables' headline; val/acc's is what a search on test/acc_median10 selects on).
HISTORY_KEYS = ("val/acc", "test/acc")


def train_one_epoch(
    s: Step, train_batches, epoch: int, first: int, steps: int, cfg, loop: Loop,
    phases: Phases | None = None, warmup_lr=None, carried_loss: float = 0.0, tag: str | None = None,
) -> tuple[torch.Tensor, DeferredChecks]:  # fmt: skip
    """Steps `first`.. of the `steps` of `epoch` over `train_batches` (`cfg`: the `TrainConfig`): each
    step's lr set by the `phases` before it and the per-step `warmup_lr` after it; returns (the summed
    training loss, on the device, with a resumed epoch's `carried_loss`; the checks, for the epoch end to
    read). Reads the checks every AGREE_EVERY steps (`loop.check`) and saves mid-epoch when due or stopped
    (`loop.save_due`, `loop.stop_asked`, `loop.save_partial`). `tag`: the fit's, in the progress bar."""
    ctx = s.ctx
    with around("epoch", tag, epoch, steps - first):
        # The partial loss sum of a resumed epoch is the global one: rank 0 carries it.
        loss_sum = torch.full((), carried_loss if first and ctx.is_main else 0.0, device=ctx.device)
        checks = DeferredChecks(s, check_loss=not s.scaler.is_enabled())
        what = f"{tag + ' ' if tag else ''}epoch {epoch + 1}/{cfg.epochs}"
        shown = cfg.progress and ctx.is_main
        bar = tqdm(train_batches, desc=what, initial=first, total=steps, leave=False,
                   disable=None if shown else True)  # fmt: skip
        # where the bar is off for want of a terminal: a line every train.log_every_s seconds
        on_cpu = ctx.is_main and ctx.device.type == "cpu"
        progress = EpochProgress(what, first, steps, cfg.log_every_s, lines=shown and bar.disable,
                                 hint_slow=on_cpu, told=ctx.told)  # fmt: skip
        for step, (x, idx) in enumerate(bar, start=first):
            if phases is not None:
                phases.set_lr(s.optimizer, epoch, step, steps)
            loss = train_step(s, x, idx, epoch)
            if warmup_lr is not None:
                warmup_lr.step()
            loss_sum += loss
            checks.record(step, loss)
            progress.step(step, len(idx) * ctx.world_size, loss)
            save, stop = loop.save_due(), loop.stop_asked()
            # Alone, a process acts on a signal or a due save at once; ranks only at the steps they all vote.
            due = (step + 1) % AGREE_EVERY == 0 or not ctx.distributed and (stop or save)
            if not due or step + 1 == steps:
                continue  # the epoch's last step is checked at the epoch end
            (stop, save), first_bad, scale = checks.read(stop, save)
            loop.check(epoch, first_bad, scale)
            if stop or save:
                loop.save_partial(epoch, step + 1, loss_sum, stop)
        return loss_sum, checks


def _method_hooks(hooks: MethodHooks | None) -> MethodHooks:
    """`fit`'s hooks: the method's, or plain training for None; a TypeError for an object that does not
    subclass MethodHooks (the loop reads every hook of that class, with its default)."""
    if hooks is None:
        return PlainTraining()
    if not isinstance(hooks, MethodHooks):
        raise TypeError(
            f"fit's hooks subclass runner.method_hooks.MethodHooks; {type(hooks).__name__} does not"
        )
    return hooks


def fit(
    model,
    data: Data,
    cfg,
    ctx: RunContext,
    hooks: MethodHooks | None = None,
    augment: str = "none",
    tag: str | None = None,
) -> dict:
    """Train `model` on `data.train` for `cfg.epochs` (a `TrainConfig`); return the final metrics, with
    the best, last and median-of-last-10 test accuracy, and write `reliability.png` of the test split.
    `hooks` is the method's (a `runner.method_hooks.MethodHooks`: its docstring lists each hook and the loop's
    default), None the plain baseline (`PlainTraining`). `augment` is the training augmentation
    (`dataset.augment`; in-memory crop padding from `data.meta["crop_pad"]`).

    Checkpoints (`checkpoints/last.pt`, `train.checkpoint`) at the end of every epoch and every
    `train.checkpoint_every_minutes` inside one, and on a stop signal after the current step (see
    `runner.faults.StopSignals`); a restart in the run dir continues from the same step with the same
    random streams, so on the CPU it ends exactly as an uninterrupted run. Hooks with an
    `on_epoch_start` are resumed inside an epoch only if they declare `mid_epoch_resume = True` (their
    `state_dict` holds all that `on_epoch_start` set up); otherwise only at epoch ends. A non-finite
    loss or parameter stops the run (Diverged) and is never saved.

    `tag` names one of several fits in a run: its checkpoint is `checkpoints/<tag>.pt`, its metrics rows
    carry `<tag>/<key>` (with `<tag>/epoch`, no tracker step), and a restart drops only its own rows
    past its checkpoint. With `train.select=best:<key>` (or, while it is `last`, `hooks.select = (key,
    "max" | "min")`) the model is evaluated before the first epoch too, the weights of the best value of
    `key` are kept (on the model's device, and in the checkpoint) and restored at the end, and the returned
    metrics are those of the restored model (`tested_model` says which; `<key>_last` are the last epoch's)."""
    hooks = _method_hooks(hooks)
    check_batch_settings(model, data, cfg, ctx, hooks)
    # Evaluated at the side it ends its training at: a network trained at 16 px sees 8-px digits blurred
    # past recognition (chance accuracy).
    ctx.eval_image_size = final_image_size(cfg)
    loop = Loop(model, data, cfg, ctx, hooks, tag)
    start, first, extra = loop.resume()
    if loop.select is not None and not loop.resumed:  # the initial weights stay unless training beats them
        loop.evaluate_before_training()
    metrics, calibration = loop.run_epochs(augment, start, first)
    metrics, calibration = loop.final_metrics(metrics, calibration, extra)
    if ctx.is_main and "test" in calibration:
        reliability_plot(ctx.dir / "reliability.png", calibration["test"], "test")
    return metrics


class Loop:
    """A fit's state across epochs: the step's parts, the checkpoint, the sampler and batches, the
    evaluation history and best epoch, and the stop signals. `fit` runs it in named steps: `resume`,
    `evaluate_before_training` (under `select`), `run_epochs` (each `epoch` end to end) and
    `final_metrics`."""

    def __init__(self, model, data: Data, cfg, ctx: RunContext, hooks: MethodHooks, tag: str | None):
        self.model, self.data, self.cfg, self.ctx, self.hooks, self.tag = model, data, cfg, ctx, hooks, tag
        self.warmup = hooks.optimizer is None  # the config's optimizer, schedule and warm-up
        self.step = make_step(model, data, cfg, ctx, hooks)
        self.warmup_lr = self._warmup_schedule()
        path = ctx.dir / checkpoint_file(tag)
        s, extra = self.step, {"ema": self.step.ema, "warmup_lr": self.warmup_lr}
        self.state = Resumable(path, ctx, model, s.optimizer, s.scheduler, s.scaler, hooks, extra)
        self.select = selection(cfg.select) or hooks.select
        self.monitor = Monitor(self.select or parse_metric(MONITORED), cfg, path)
        has_pass = hooks.on_epoch_start is not None
        self.mid_epoch = cfg.checkpoint and (not has_pass or hooks.mid_epoch_resume)
        self.last_save = time.monotonic()
        self.train_s, self.carried_loss, self.history, self.best, self.signals = 0.0, 0.0, {}, None, None
        self.resumed = False  # from a checkpoint of this fit (`resume`)
        self.phases = Phases(cfg.phases) if cfg.phases else None
        self.batch_shape = None  # (batch size, image side) of the current training batches
        self.stage = "training"  # of the current epoch: "pass" (the method's), "training" or "evaluation"

    def _warmup_schedule(self):
        """The linear warm-up, per step: lr x (t + 1) / (W + 1) for steps t < W, times the epoch schedule
        (both schedulers are multiplicative, so they compose); its state travels in the checkpoint. None
        without `train.warmup_epochs` or under the method's own optimizer."""
        cfg = self.cfg
        if not (self.warmup and cfg.warmup_epochs):
            return None
        w = cfg.warmup_epochs * len(EpochBatches(len(self.data.train.y), cfg.batch_size))
        return torch.optim.lr_scheduler.LinearLR(self.step.optimizer, 1 / (w + 1), 1.0, total_iters=w)

    # --- fit's steps -----------------------------------------------------------------------------------

    def resume(self) -> tuple[int, int, dict]:
        """Restore the run dir's checkpoint of this fit, if any (`train.checkpoint`; `resumed` says
        whether one was): (the epoch to go on from, the step inside it, the checkpoint's `extra`: {}
        without one), with the loop's bookkeeping restored and the tracker's rows past it dropped."""
        cfg = self.cfg
        resumed = self.state.resume() if cfg.checkpoint else None
        self.resumed = resumed is not None
        start, first, extra = (0, 0, {}) if resumed is None else resumed
        if first is None:  # an epoch-end checkpoint
            start, first = start + 1, 0
        # Epochs before `start` are logged; an interrupted one is when it completes. Without a checkpoint
        # this drops the records of an earlier attempt that died before its first one.
        _truncate(self.ctx, self.tag, start if self.resumed else -1)
        if self.resumed and self.warmup:
            follow_config(self.step.optimizer, self.step.scheduler, cfg)
        self.history, self.carried_loss = extra.get("history", {}), extra.get("loss_sum", 0.0)
        if isinstance(self.history, list):  # a checkpoint from before val/acc had a history: test/acc's
            self.history = {"test/acc": self.history}
        self.monitor.load_state_dict(extra.get("monitor", {}))
        # The best epoch by `select`: its value, weights (loaded onto the model's device), metrics and bins.
        self.best = extra.get("best")
        return start, first, extra

    def evaluate_before_training(self) -> None:
        """The untrained model's evaluation, logged as epoch 0 and kept as the `select` best until an
        epoch beats it; ConfigError where the run does not report the selected metric."""
        metric = self.select[0]
        evaluated, calibration = evaluate_all(self.model, self.data, self.ctx, self.cfg, self.hooks)
        if metric not in evaluated:
            choices = ", ".join(f"best:{key}" for key in evaluated)
            # a val split first: weights selected on the test set flatter its metric
            if metric.startswith("val/") and not len(self.data.val):
                raise ConfigError(
                    f"train.select=best:{metric}: this run has no validation split; give it one with "
                    f"dataset.val_fraction=0.1 (dataset.val_per_class=10 for per-class sized sets), "
                    f"or choose among {choices}"
                )
            raise ConfigError(
                f"train.select=best:{metric}: this run does not report {metric}; choices: {choices}"
            )
        self.best = snapshot(self.model, evaluated, calibration, self.select, 0)
        _log(self.ctx, self.tag, {"epoch": 0, **evaluated}, -1)

    def run_epochs(self, augment: str, start: int, first: int) -> tuple[dict, dict]:
        """Epochs `start`.. (the first from step `first`) until the last, an early stop or a stop signal;
        the last epoch's metrics and calibration bins ({} where none ran)."""
        metrics: dict = {}
        calibration: dict = {}
        with StopSignals() as self.signals:
            for epoch in range(start, self.cfg.epochs):
                # after the resume: the data order is seeded by the restored RNG state
                self.start_batches(augment, epoch)
                with out_of_memory_stops(functools.partial(self.out_of_memory, epoch)):
                    metrics, calibration = self.epoch(epoch, first if epoch == start else 0)
                if self.monitor.stopped:
                    break
        return metrics, calibration

    def final_metrics(self, metrics: dict, calibration: dict, extra: dict) -> tuple[dict, dict]:
        """What the fit returns, and the calibration bins of the model it ends with: the best epoch's
        (`select`, its weights restored), or the last epoch's (of a finished run resumed: its checkpoint's
        row, the model evaluated as it is); with which weights they are of, the history summaries, the
        monitor's best and the training time."""
        if self.best is not None:
            metrics, calibration = self._restore_best(metrics)
        elif not metrics:  # resumed a finished run: its last epoch's row, the model evaluated as it is
            evaluated, calibration = evaluate_all(self.model, self.data, self.ctx, self.cfg, self.hooks)
            metrics = {**extra.get("metrics", {}), **evaluated}
        # which weights the metrics are of (runner-report names them); <key>_last: the last epoch's
        metrics.setdefault("tested_model", "last")
        for key, values in self.history.items():
            metrics.update(history_summary(values, key))
        metrics.update(self.monitor.summary())
        metrics["time/train_total_s"] = self.train_s  # this process's training steps (not the resumed part)
        return metrics, calibration

    def _restore_best(self, metrics: dict) -> tuple[dict, dict]:
        """The best epoch's weights back in the model: `metrics` with its evaluation, and its bins."""
        best, key = self.best, self.select[0]
        self.model.load_state_dict(best["state"])
        metrics.update(best["metrics"])
        log.info("%skept the weights of the best %s, %.4f", f"{self.tag}: " if self.tag else "", key,
                 best["value"])  # fmt: skip
        metrics |= {"tested_model": f"best:{key}", "tested_epoch": best.get("epoch")}
        return metrics, best["calibration"]

    # --- one epoch -------------------------------------------------------------------------------------

    def start_batches(self, augment: str, epoch: int) -> None:
        """The training batches for `epoch`: at its phase's batch size and image side (`train.phases`),
        made anew only where those change."""
        ctx, n, phase = self.ctx, len(self.data.train.y), self.phases and self.phases.at(epoch)
        shape = (phase.batch_size, phase.image_size) if phase else (self.cfg.batch_size, 0)
        if shape == self.batch_shape:
            return
        self.batch_shape = shape
        self.sampler = EpochBatches(n, shape[0], ctx.rank, ctx.world_size, torch.initial_seed())
        self.sampler = self.hooks.batch_sampler(self.sampler)
        self.train_batches = batches(self.data.train, self.ctx, self.sampler, augment,
                                     self.data.meta.get("crop_pad", 4), shape[1])  # fmt: skip

    def epoch(self, epoch: int, first: int) -> tuple[dict, dict]:
        """Epoch `epoch` from step `first` (> 0: resumed inside it): the method's pass, the steps, the
        evaluation, the log row and the epoch-end checkpoint; its metrics and calibration bins."""
        t0 = time.perf_counter()
        renew_host_memory_cap()  # counts memory freed elsewhere since the last epoch
        self.model.train()
        self.stage = "pass"
        if not first:
            with around("method_pass"):
                if self.hooks.on_epoch_start is not None:  # e.g. CSOT's selection
                    self.hooks.on_epoch_start(epoch, self.model, self.data)
        self.stage = "training"
        t_pass = time.perf_counter() - t0
        metrics, timings, checks = self._train(epoch, first, t0 + t_pass, t_pass)
        self.stage = "evaluation"
        t_eval = time.perf_counter()
        evaluated, calibration = self._evaluate(epoch)
        metrics.update(evaluated)
        metrics["time/eval_s"] = time.perf_counter() - t_eval
        metrics.update(self._skipped_images())
        metrics.update(self.hooks.epoch_metrics())
        metrics.update(timings)
        metrics["time/epoch_s"] = time.perf_counter() - t0
        self._log_row(epoch, metrics)
        self._save_epoch_end(epoch, evaluated, metrics)
        self._stop_if_signalled(checks)
        return metrics, calibration

    def _train(
        self, epoch: int, first: int, t_start: float, t_pass: float
    ) -> tuple[dict, dict, DeferredChecks]:
        """The steps of `epoch` from `first`, then its checks and schedule step: (the row's loss, lr and
        step statistics; the epoch's time split, `_timings`; the checks, for the stop vote)."""
        s, ctx = self.step, self.ctx
        self.sampler.set_epoch(epoch, start=first)
        steps = len(self.sampler)  # after set_epoch: a hook's sampler may vary it by epoch
        loss_sum, checks = train_one_epoch(
            s,
            self.train_batches,
            epoch,
            first,
            steps,
            self.cfg,
            self,
            self.phases,
            self.warmup_lr,
            self.carried_loss,
            self.tag,
        )
        _, first_bad, scale = checks.read()
        self.check(epoch, first_bad, scale)
        timings = _timings(ctx, t_start, t_pass, s.transform_time, steps - first)
        self.train_s += timings["time/train_s"]
        if not s.per_step:
            s.scheduler.step()
        total, lr = all_reduce_sum(loss_sum.reshape(1)), s.optimizer.param_groups[0]["lr"]
        if isinstance(lr, torch.Tensor):  # a captured step's, on the device: read with the loss, one wait
            total, lr = torch.cat([total.double(), lr.double().reshape(1)]).tolist()
        else:
            total, lr = total.item(), float(lr)
        train_loss = total / (steps * ctx.world_size)
        metrics = {"epoch": epoch + 1, "train/loss": train_loss, "lr": lr}
        metrics.update(self._step_stats(scale))
        return metrics, timings, checks

    def _skipped_images(self) -> dict:
        """`data/bad_images`: the unreadable files the epoch's passes replaced (`dataset.bad_images=skip`)."""
        if getattr(self.data.train, "bad_images", None) != "skip":
            return {}
        skipped = torch.tensor([UNREADABLE.take()], device=self.ctx.device)
        return {"data/bad_images": int(all_reduce_sum(skipped).item())}

    def _log_row(self, epoch: int, metrics: dict) -> None:
        """The epoch's row to the tracker, and its line with `train.progress`."""
        _log(self.ctx, self.tag, metrics, epoch)
        if self.ctx.is_main and self.cfg.progress:
            log.info("%sepoch %d/%d  %s", f"{self.tag}: " if self.tag else "", epoch + 1, self.cfg.epochs,
                     _brief(metrics))  # fmt: skip

    def _save_epoch_end(self, epoch: int, evaluated: dict, metrics: dict) -> None:
        """The monitor follows the epoch's evaluation; the epoch-end checkpoint and its top-k links."""
        watched = self.monitor.after(epoch, evaluated)
        if self.ctx.is_main and self.cfg.checkpoint:
            best = on_host(self.best)  # the kept weights, read in one copy
            extra = {"history": self.history, "best": best, "monitor": watched, "metrics": metrics}
            self.state.save(epoch, None, extra)
            self.monitor.keep_files()
        self.last_save = time.monotonic()

    def _stop_if_signalled(self, checks: DeferredChecks) -> None:
        """Stop after the epoch on a signal (under DDP: on any rank's, as the ranks vote)."""
        stop = self.stop_asked()
        if stop if not self.ctx.distributed else checks.read(stop)[0][0]:
            self.signals.stop()

    def _step_stats(self, scale: float) -> dict:
        """The epoch's pre-clip gradient norm (mean of the finite ones) and fp16 skipped steps and scale."""
        s, out = self.step, {}
        if s.clip:
            total, count = s.grad_norm.tolist()
            out["train/grad_norm"] = total / count if count else math.nan
            s.grad_norm.zero_()
        if s.scaler.is_enabled():
            out.update({"train/loss_scale": scale, "train/skipped_steps": int(s.skipped)})
            s.skipped.zero_()
        return out

    def _evaluate(self, epoch: int) -> tuple[dict, dict]:
        """Every `train.eval_every` epochs and at the last: the splits' metrics (the EMA weights' too,
        as `<key>_ema`) and calibration bins; the test accuracy history and the `select` best."""
        cfg = self.cfg
        if (epoch + 1) % cfg.eval_every and epoch + 1 < cfg.epochs:
            return {}, {}
        evaluated, calibration = evaluate_all(self.model, self.data, self.ctx, cfg, self.hooks)
        if self.step.ema is not None:
            averaged, _ = evaluate_all(self.step.ema.module, self.data, self.ctx, cfg, self.hooks)
            evaluated |= {f"{key}_ema": value for key, value in averaged.items()}
        for key in HISTORY_KEYS:
            if key in evaluated:
                self.history.setdefault(key, []).append(evaluated[key])
        select = self.select
        if select is not None and is_better(evaluated[select[0]], self.best, select[1]):
            self.best = snapshot(self.model, evaluated, calibration, select, epoch + 1)
        return evaluated, calibration

    def check(self, epoch: int, first_bad: float, scale: float) -> None:
        """Stop (Diverged) on a non-finite loss (`first_bad` >= 0: its step) or an underflowed fp16 scale."""
        steps = len(self.sampler)
        if first_bad >= 0:
            where = f"step {int(first_bad) + 1}/{steps}" if first_bad < math.inf else "another rank"
            raise Diverged(
                f"non-finite loss at epoch {epoch + 1}, {where}; last good checkpoint: {self.state.last}; "
                "lower train.lr (or check the data)"
            )
        if scale < MIN_LOSS_SCALE:
            raise Diverged(
                f"the fp16 loss scale fell to {scale:.3g} at epoch {epoch + 1} (every step skipped: "
                f"non-finite gradients); last good checkpoint: {self.state.last}; use "
                "hardware.precision=bf16 or lower train.lr"
            )

    def out_of_memory(self, epoch: int, memory: str) -> str:
        """The one line for running out of `memory` in `epoch`: where, the setting that sized the batch (in
        training a method's own, `hooks.batch_setting(epoch)`), what would fit, the checkpoint kept."""
        cfg, ctx, batch = self.cfg, self.ctx, self.batch_shape[0]
        kept = f"last good checkpoint: {self.state.last}"
        if self.stage != "training":
            if self.stage == "evaluation" and self.hooks.evaluate is None:
                where = f"the evaluation at train.eval_batch_size={cfg.eval_batch_size}; lower it"
            else:  # the method's own pass or evaluation, at batches of its own
                where = "the method's evaluation" if self.stage == "evaluation" else "the method's pass"
            return f"ran out of {memory} in epoch {epoch + 1}, in {where}; {kept}"
        key = f"train.phases.{self.phases.index(epoch)}.batch_size" if self.phases else "train.batch_size"
        setting = self.hooks.batch_setting(epoch) or f"{key}={batch}"
        fixes = ["lower it"]
        if self.hooks.accumulate_ok and batch % (2 * ctx.world_size * cfg.accumulate) == 0:
            fixes.append(f"keep the batch with train.accumulate={2 * cfg.accumulate} (half as many per pass)")
        if ctx.accelerator and ctx.precision == "fp32":
            fixes.append("use hardware.precision=bf16 (half the bytes per activation)")
        advice = ", or ".join(fixes)
        return f"ran out of {memory} in epoch {epoch + 1} at {setting}; {advice}; {kept}"

    def save_due(self) -> bool:
        """Whether a mid-epoch checkpoint is due (`train.checkpoint_every_minutes` since the last save)."""
        every = self.cfg.checkpoint_every_minutes * 60
        return self.mid_epoch and 0 < every <= time.monotonic() - self.last_save

    def stop_asked(self) -> bool:
        """Whether a stop signal came (`runner.faults.StopSignals`)."""
        return self.signals.signum is not None

    def save_partial(self, epoch: int, steps_done: int, loss_sum: torch.Tensor, stop: bool) -> None:
        """A mid-epoch checkpoint (when due, or on a stop signal), then the stop if asked."""
        if self.mid_epoch:
            partial = all_reduce_sum(loss_sum.clone().reshape(1)).item()
            if self.ctx.is_main:
                extra = {"history": self.history, "best": on_host(self.best), "loss_sum": partial}
                self.state.save(epoch, steps_done, extra)
            self.last_save = time.monotonic()
        if stop:
            if not self.mid_epoch:
                log.warning("stopping inside epoch %d without a checkpoint of it", epoch + 1)
            self.signals.stop()


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


def _timings(ctx: RunContext, t_start: float, t_pass: float, transform: Stopwatch, steps: int) -> dict:
    """The epoch's time split: the method's per-epoch pass, the training steps (ms per step) and the
    batch transforms within them (device time on CUDA, read here once); peak and reserved GPU memory of
    the epoch on CUDA."""
    ctx.synchronize()
    train_s = time.perf_counter() - t_start
    out = {"time/pass_s": t_pass, "time/train_s": train_s, "time/step_ms": 1000 * train_s / max(steps, 1)}
    out["time/transform_s"] = transform.seconds()
    transform.total = 0.0
    return out | ctx.memory()


def _brief(metrics: dict) -> str:
    keys = ("train/loss", "val/acc", "test/acc", "select/precision", "select/recall", "time/epoch_s")
    return "  ".join(f"{k} {metrics[k]:.4f}" for k in keys if k in metrics)
