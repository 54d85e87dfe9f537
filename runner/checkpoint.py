"""Checkpoints and resume: the run dir's checkpoint files (their names written once here), an atomic save
and a safe load, every random stream's state, `Resumable` (what one training loop's checkpoint holds),
and what a fit keeps by its validation metric (`selection`, `Monitor`: the top-k checkpoints, the early
stop; `snapshot`: the best epoch's weights, kept on the model's device, `on_host` for a checkpoint)."""

from __future__ import annotations

import contextlib
import logging
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch

from runner.checks import ConfigError
from runner.faults import CheckpointError, Diverged
from runner.hardware import RunContext, packed_bytes, unpacked_bytes
from runner.instruments import around
from runner.method_hooks import MethodHooks
from runner.metrics import parse_metric
from runner.rundir import CHECKPOINTS
from runner.untrusted import RefusedPickle, torch_load

log = logging.getLogger(__name__)

# A fit's checkpoint in the run dir's CHECKPOINTS folder: LAST for the run's (untagged) fit, `<tag>.pt` for
# a tagged one (`checkpoint_file`); beside it, under train.save_top_k, `best-<epoch>-<value>.pt` of its
# best epochs and BEST naming the best, prefixed `<tag>-` for a tagged fit (`best_file`).
LAST = "last.pt"
BEST = "best.pt"
CHECKPOINT = f"{CHECKPOINTS}/{LAST}"


def checkpoint_file(tag: str | None = None) -> str:
    """The run-dir path of a fit's checkpoint: `checkpoints/last.pt`, or `checkpoints/<tag>.pt`."""
    return CHECKPOINT if tag is None else f"{CHECKPOINTS}/{tag}.pt"


def best_file(tag: str | None = None) -> str:
    """The run-dir path of the link to a fit's best checkpoint (train.save_top_k)."""
    return f"{CHECKPOINTS}/{_prefix(tag)}{BEST}"


def _prefix(tag: str | None) -> str:
    return "" if tag is None else f"{tag}-"


def save_checkpoint(path, state) -> None:
    """torch.save `state` to `path` atomically (a temporary file, then a rename): a kill, a full disk or
    an unwritable run dir during the save leaves the previous checkpoint intact (CheckpointError)."""
    path = Path(path)
    tmp = path.with_suffix(".tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(state, tmp)
        tmp.replace(path)
    except (OSError, RuntimeError) as e:  # torch's writer raises RuntimeError on a full disk
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise CheckpointError(f"cannot write {path} ({_first_line(e)}); the previous one is intact") from None


def load_checkpoint(path, device, hint: str = "move it away to start the run over") -> dict:
    """`torch.load` a checkpoint with `weights_only=True` (a run dir can come from someone else: no
    unpickled object may run code); CheckpointError naming the file (which is kept) and `hint`, what to do
    about it, if it cannot be read."""
    try:
        return torch_load(path, device)
    except RefusedPickle:
        raise CheckpointError(
            f"{path} holds pickled objects other than tensors, numbers, containers and numpy arrays, "
            "which could run code: not loaded (only runner checkpoints load)"
        ) from None
    except Exception as e:  # truncated or corrupt: zip, pickle and EOF errors, among others
        raise CheckpointError(
            f"cannot read checkpoint {path} ({type(e).__name__}: {_first_line(e)}); the file is kept: {hint}"
        ) from None


def rng_state(device: torch.device) -> dict:
    """Every random stream a run draws from: torch's (CPU, and `device`'s if CUDA), numpy's, Python's."""
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"].cpu())  # map_location moved the tensors to the device
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)


class Resumable:
    """Everything a checkpoint holds, for one training loop: the model, its optimizer, scheduler and loss
    scaler, the method hooks' `state_dict`, every RNG, and the loop's position (`epoch`, and `step`: the
    batches done in that epoch, or None once the epoch is complete) with its `extra` bookkeeping.

    `resume()` restores the run dir's checkpoint into them (if any) and returns its position; `save()`
    writes one at a position, refusing non-finite weights. One object per loop, so another loop (e.g.
    iterations instead of epochs) reuses it whole."""

    def __init__(
        self, path, ctx: RunContext, model, optimizer, scheduler, scaler, hooks: MethodHooks, parts=None
    ):
        self.path, self.ctx, self.model, self.hooks = Path(path), ctx, model, hooks
        self.parts = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "scaler": scaler}
        self.parts.update({key: part for key, part in (parts or {}).items() if part is not None})
        self.last = "none written yet"  # the last good checkpoint, for error messages

    def resume(self) -> tuple[int, int | None, dict] | None:
        """(epoch, step, extra) of the checkpoint just restored, or None without one."""
        if not self.path.exists():
            return None
        state = load_checkpoint(self.path, self.ctx.device)
        try:
            for key, part in self.parts.items():
                part.load_state_dict(state[key])
            if state.get("hooks") is not None:
                self.hooks.load_state_dict(state["hooks"])
            set_rng_state(state["rng"], self.ctx.device)
        except (KeyError, RuntimeError, TypeError, ValueError) as e:  # another model, an older format
            raise CheckpointError(
                f"checkpoint {self.path} does not fit this run ({type(e).__name__}: {_first_line(e)}); "
                "the file is kept"
            ) from None
        self.last = f"{self.path} ({_position(state['epoch'], state.get('step'))})"
        log.info("resumed from %s", self.last)
        return state["epoch"], state.get("step"), state.get("extra", {})

    def save(self, epoch: int, step: int | None, extra: dict) -> None:
        with around("checkpoint"):
            self._save(epoch, step, extra)

    def _save(self, epoch: int, step: int | None, extra: dict) -> None:
        params = [p.detach() for p in self.model.parameters()]
        if params and not bool(torch.stack([torch.isfinite(p).all() for p in params]).all()):
            raise Diverged(
                f"non-finite parameters at {_position(epoch, step)}; last good checkpoint: {self.last}"
            )
        state = {key: part.state_dict() for key, part in self.parts.items()}
        state.update(epoch=epoch, step=step, extra=extra, rng=rng_state(self.ctx.device))
        state["hooks"] = self.hooks.state_dict()
        save_checkpoint(self.path, state)
        self.last = f"{self.path} ({_position(epoch, step)})"


def _position(epoch: int, step: int | None) -> str:
    return f"end of epoch {epoch + 1}" if step is None else f"epoch {epoch + 1}, step {step}"


def _first_line(error: BaseException) -> str:
    """An exception's message on one line, cut to its first sentence (torch's run on for lines)."""
    text = " ".join(str(error).split())
    return text[: text.find(". ", 40) + 1 or None][:300]


class Monitor:
    """The validation metric `key` (`mode` "max" or "min") over a fit's evaluations: keeps the
    `train.save_top_k` best epoch-end checkpoints as `best-<epoch>-<value>.pt` beside the fit's checkpoint
    (hard links of it, no copy) and `best.pt` naming the best; stops the fit after `train.early_stop`
    evaluations without improvement. Its state travels in the checkpoint, so both survive a resume."""

    def __init__(self, select, cfg, checkpoint: Path):
        self.key, self.mode = select
        self.top_k, self.patience = cfg.save_top_k, cfg.early_stop
        if self.top_k and not cfg.checkpoint:
            raise ConfigError(f"train.save_top_k={self.top_k} keeps checkpoints: needs train.checkpoint=true")
        self.folder = checkpoint.parent
        self.prefix = _prefix(None if checkpoint.name == LAST else checkpoint.stem)
        self.checkpoint = checkpoint
        self.kept: list[list] = []  # [value, epoch, file name], best first
        self.best_value, self.best_epoch, self.waited, self.stopped = None, None, 0, False

    def state_dict(self) -> dict:
        return {"kept": self.kept, "best_value": self.best_value, "best_epoch": self.best_epoch,
                "waited": self.waited}  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value)

    def after(self, epoch: int, evaluated: dict) -> dict:
        """Follow the epoch's evaluation (an epoch without one changes nothing); the state to save."""
        if not (self.top_k or self.patience) or not evaluated:
            return self.state_dict()
        if self.key not in evaluated:
            raise ConfigError(
                f"train.save_top_k / train.early_stop follow {self.key}, which this run does not report; "
                "give the dataset a validation split (dataset.val_fraction > 0)"
            )
        value = evaluated[self.key]
        if self.best_value is None or is_better(value, {"value": self.best_value}, self.mode):
            self.best_value, self.best_epoch, self.waited = value, epoch + 1, 0
        else:
            self.waited += 1
        if self.top_k:
            name = f"{self.prefix}best-{epoch + 1}-{value:.4f}.pt"
            self.kept.append([value, epoch + 1, name])
            self.kept.sort(key=lambda kept: -kept[0] if self.mode == "max" else kept[0])
        if self.patience and self.waited >= self.patience:
            self.stopped = True
            log.info("early stop: %s has not improved for %d evaluations; the best, %.4f, was at epoch %d",
                     self.key, self.waited, self.best_value, self.best_epoch)  # fmt: skip
        return self.state_dict()

    def keep_files(self) -> None:
        """After the epoch's checkpoint: link it if it made the top k, drop what fell out, point best.pt."""
        if not self.top_k:
            return
        for _, _, name in self.kept[self.top_k :]:
            (self.folder / name).unlink(missing_ok=True)
        del self.kept[self.top_k :]
        for _, _, name in self.kept:
            target = self.folder / name
            if not target.exists() and name == self._newest():
                try:
                    os.link(self.checkpoint, target)
                except OSError:  # a file system without hard links
                    shutil.copy2(self.checkpoint, target)
        link = self.folder / f"{self.prefix}{BEST}"
        link.unlink(missing_ok=True)
        if self.kept:
            link.symlink_to(self.kept[0][2])

    def _newest(self) -> str:
        return max(self.kept, key=lambda kept: kept[1])[2]

    def summary(self) -> dict:
        if self.best_epoch is None:
            return {}
        return {"best_epoch": self.best_epoch, f"best/{self.key}": self.best_value}


def is_better(value: float, best: dict | None, mode: str) -> bool:
    return best is None or (value > best["value"] if mode == "max" else value < best["value"])


def snapshot(model, evaluated: dict, calibration: dict, select, epoch: int) -> dict:
    """The best epoch so far: its `select` value, metrics, calibration bins and weights, copied where the
    model is (a model's worth of device memory, no host wait; `on_host` copies them for a checkpoint)."""
    state = {key: value.detach().clone() for key, value in model.state_dict().items()}
    return {"value": evaluated[select[0]], "state": state, "metrics": evaluated, "calibration": calibration,
            "epoch": epoch}  # fmt: skip


def on_host(best: dict | None) -> dict | None:
    """`best` (a `snapshot`) with its weights on the host, as a checkpoint holds them: the tensors packed
    into one byte buffer on their device and read in one copy (one host wait per save, not one per
    tensor), then cut back into tensors of the same shapes, dtypes and strides."""
    if best is None:
        return None
    return {**best, "state": unpacked_bytes(packed_bytes(best["state"]).cpu(), best["state"], strided=True)}


def selection(rule: str) -> tuple[str, str] | None:
    """`train.select` as `(metric, "max" | "min")` (a loss or an ECE is minimised); None for `last`."""
    return None if rule == "last" else parse_metric(rule.removeprefix("best:"), given_as="train.select=best:")
