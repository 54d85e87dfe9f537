"""The points where a harness or a benchmark observes a fit, without patching the loop.

Subclass `Instruments`, override the points wanted (each returns a context manager the loop enters around
that part of its work; the defaults do nothing), and register it for a block with `watching`; the loop
enters `around(point, ...)`. `runner.device_tracking` counts its phases this way and `benchmarks/` time
and profile the steps.
"""

from __future__ import annotations

import contextlib

NOTHING = contextlib.nullcontext()


class Instruments:
    """The loop's observation points, in the order a fit meets them; each a context manager."""

    def method_pass(self):
        """The method's per-epoch pass (`MethodHooks.on_epoch_start`), entered at every epoch started from
        its first step, whether the method has a pass or not."""
        return NOTHING

    def epoch(self, tag: str | None, epoch: int, steps: int):
        """The training steps of `epoch` (`train_one_epoch`): `steps` of them from here, in the fit `tag`."""
        return NOTHING

    def step(self, s, x, idx, epoch: int):
        """One training step (`runner.step.train_step`: the method's host draws and the step) of `Step`
        `s` on batch `x`, `idx`."""
        return NOTHING

    def captured(self):
        """What a CUDA graph captures and replays (`runner.step.GraphedStep`); off CUDA the same work,
        run eagerly after the warm-up steps."""
        return NOTHING

    def warm_up(self):
        """One of the eager steps a captured step runs before its capture (`GraphedStep.warm_up`), each
        batch shape (or capture key) `GraphedStep.WARMUP` times: not the step's steady cost."""
        return NOTHING

    def evaluation(self):
        """An evaluation of the model (`runner.evaluation.evaluate_all`)."""
        return NOTHING

    def checkpoint(self):
        """The write of a checkpoint (`runner.checkpoint.Resumable.save`)."""
        return NOTHING


_WATCHING: list[Instruments] = []


@contextlib.contextmanager
def watching(instruments: Instruments):
    """`instruments` observe every fit run inside the block (the first registered outermost)."""
    _WATCHING.append(instruments)
    try:
        yield instruments
    finally:
        _WATCHING.remove(instruments)


def around(point: str, *args):
    """The context manager of `point` (a method of `Instruments`) of every registered instruments;
    nothing to enter when none is (the loop's usual case, at no cost per step)."""
    if not _WATCHING:
        return NOTHING
    return _entered(point, args)


@contextlib.contextmanager
def _entered(point: str, args: tuple):
    with contextlib.ExitStack() as stack:
        for instruments in list(_WATCHING):
            stack.enter_context(getattr(instruments, point)(*args))
        yield
