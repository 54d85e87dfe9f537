"""An epoch's progress where the progress bar is off: output that is not a terminal (a pipe, a log file,
Slurm), where tqdm prints nothing. A log line every `train.log_every_s` seconds names the step, the
step's loss, the images per second and the epoch's estimated end; and once per run, a first epoch that
would take over an hour on the CPU says that it is a GPU preset and how to try it quickly."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

SLOW_EPOCH_S = 3600.0  # a first epoch estimated longer than this on the CPU: a preset sized for a GPU


class EpochProgress:
    """Follows steps `first`.. of the `steps` of one epoch (`what`: "epoch 1/30", with a fit's tag).
    `lines`: log the periodic lines (off where the bar shows the same); `hint_slow`: say, once, that a
    slow first epoch on the CPU wants a GPU or `+debug=smoke` (`told` is the run's set of notes said)."""

    def __init__(self, what: str, first: int, steps: int, every_s: float, lines: bool, hint_slow: bool,
                 told: set, clock: Callable[[], float] = time.monotonic):  # fmt: skip
        self.what, self.first, self.steps, self.every_s = what, first, steps, every_s
        self.lines, self.hint_slow, self.told, self.clock = lines, hint_slow, told, clock
        self.start = self.last = clock()
        self.images = 0

    @property
    def active(self) -> bool:
        return self.lines or (self.hint_slow and "slow_cpu" not in self.told)

    def step(self, step: int, images: int, loss) -> None:
        """After `step` (0-based) trained on `images` (all ranks'); `loss`: the step's, read only when a
        line is due (a read waits for the device)."""
        self.images += images
        now = self.clock()
        if not self.active or now - self.last < self.every_s:
            return
        self.last = now
        elapsed, done = now - self.start, step + 1 - self.first
        left_s = elapsed / done * (self.steps - step - 1)
        if self.hint_slow and "slow_cpu" not in self.told and elapsed + left_s > SLOW_EPOCH_S:
            self.told.add("slow_cpu")
            log.warning(
                "%s is estimated at %s on the CPU: this is a GPU preset; try it with +debug=smoke (a few "
                "batches), or on a GPU", self.what, _duration(elapsed + left_s)
            )  # fmt: skip
        if self.lines:
            end = time.strftime("%H:%M:%S", time.localtime(time.time() + left_s))
            log.info("%s: step %d/%d  loss=%.4f  %.0f images/s  ends in %s (%s)", self.what, step + 1,
                     self.steps, float(loss), self.images / elapsed, _duration(left_s), end)  # fmt: skip


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.0f} s"
    if seconds < 3600:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"
