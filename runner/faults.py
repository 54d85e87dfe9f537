"""What stops a run before its end, other than a bad config (`runner.checks.ConfigError`), and the stop
signals the training loop turns into a checkpoint.

The CLI reports each in one line: `Interrupted` with the command that resumes the run, the others with
what went wrong and where (exit 1).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import threading

from hydra.errors import CompactHydraException

log = logging.getLogger(__name__)


class Interrupted(BaseException):
    """A stop signal (SIGINT, SIGTERM, SIGUSR1) ended the run after a checkpoint. A BaseException, like
    KeyboardInterrupt, so that a sweep stops too instead of launching its next job."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class JobFailed(CompactHydraException):
    """A sweep's job stopped by one of the runner's one-line errors (its `cause`): Hydra, which raises a
    sweep's first failure at its end, prints this one line instead of a traceback."""

    def __init__(self, cause: BaseException):
        super().__init__(f"runner: error: {type(cause).__name__}: {cause}")
        self.cause = cause


class Diverged(RuntimeError):
    """A non-finite loss, parameter or main metric."""


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read, or written (full disk, unwritable run dir)."""


class OutOfMemory(RuntimeError):
    """The device (or the host) had no memory left: what torch tried to allocate, and what to lower."""


# torch's out-of-memory errors: a GPU's (torch.OutOfMemoryError), Apple's MPS and the CPU allocator's (a
# RuntimeError each); numpy's and Python's are MemoryError. The kernel's OOM killer raises nothing: it ends
# the process (`runner.hardware.cap_host_memory` makes a CPU run meet one of these first).
_CPU_OUT_OF_MEMORY = "DefaultCPUAllocator: can't allocate memory"
_MPS_OUT_OF_MEMORY = "MPS backend out of memory"


def out_of_memory(error: BaseException) -> str | None:
    """For an out-of-memory error, which memory and how much was asked for ("CUDA memory (it tried to
    allocate 2.00 GiB)"); None for any other error."""
    import torch

    text = str(error)
    host = isinstance(error, MemoryError) or _CPU_OUT_OF_MEMORY in text
    if not host and not isinstance(error, torch.OutOfMemoryError) and _MPS_OUT_OF_MEMORY not in text:
        return None
    memory = "host memory" if host else f"{text.split()[0]} memory"  # CUDA, MPS, XPU
    size = re.search(r"allocate ([\d.]+) (\w+)", text)
    if size is None:
        return memory
    amount = f"{float(size[1]) / 2**30:.2f} GiB" if size[2] == "bytes" else f"{size[1]} {size[2]}"
    return f"{memory} (it tried to allocate {amount})"


@contextlib.contextmanager
def out_of_memory_stops(message):
    """Within it, an out-of-memory error (`out_of_memory`) becomes `OutOfMemory(message(memory))`, the
    one-line stop that says where and what to lower; every other error passes as it is."""
    try:
        yield
    except (RuntimeError, MemoryError) as e:
        memory = out_of_memory(e)
        if memory is None:
            raise
        raise OutOfMemory(message(memory)) from e


class StopSignals:
    """While active, SIGINT, SIGTERM and SIGUSR1 only record a request to stop, which the training loop
    honours after its current step: it writes a checkpoint, then calls `stop()`. SIGUSR2 too where a
    Python handler holds it already (submitit's, which requeues a Slurm job): `stop()` hands the signal
    on to it. A second Ctrl-C stops at once. Outside the main thread (no signals there) it does nothing.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)

    def __enter__(self) -> StopSignals:
        self.signum: int | None = None
        self._pid = os.getpid()
        self._previous: dict[int, object] = {}
        if threading.current_thread() is threading.main_thread():
            for signum in self.SIGNALS:
                previous = signal.getsignal(signum)
                if signum == signal.SIGUSR2 and not callable(previous):
                    continue
                self._previous[signum] = previous
                signal.signal(signum, self._request)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        # A SIGTERM sent to the whole process group (as by Slurm) also reaches the DataLoader workers, which
        # PyTorch ends at once (its error may come before the signal's own handler has run): the step
        # failed, and the run stops on its last checkpoint.
        if isinstance(exc, RuntimeError) and (self.signum or "killed by signal: Terminated" in str(exc)):
            self.signum = self.signum or signal.SIGTERM
            log.warning("%s also ended the data loader workers (%s)", signal.Signals(self.signum).name, exc)
            self.stop()

    def _request(self, signum: int, frame) -> None:
        if os.getpid() != self._pid:  # a forked DataLoader worker: it goes when the run does, not before
            return
        if signum == signal.SIGINT and self.signum == signal.SIGINT:
            raise KeyboardInterrupt
        if self.signum is None:
            self.signum = signum
            log.warning("%s: stopping after this step, with a checkpoint", signal.Signals(signum).name)

    def stop(self):
        """End the run for the recorded signal: the handler it replaced first (if a Python one other
        than Ctrl-C's), then `Interrupted`."""
        previous = self._previous.get(self.signum)
        if callable(previous) and previous is not signal.default_int_handler:
            previous(self.signum, None)
        raise Interrupted(self.signum)
