"""runner: a Hydra-driven experiment runner for combinatorial-optimization and optimal-transport methods."""

import os

# POT loads every array library it finds when it is imported, and JAX then reserves 75% of the GPU's memory
# (seen on an H200: an ImageNet preset ran out of memory with ~105 GB held by JAX). The solvers here take
# numpy arrays and torch tensors only; a user's own setting of these variables wins.
for _library in ("JAX", "CUPY", "TENSORFLOW"):
    os.environ.setdefault(f"POT_BACKEND_DISABLE_{_library}", "1")

# PyTorch's CPU allocator gives a batch-sized buffer (a float batch of 64 images of 224 px: 38 MB) back to
# the OS when freed, and the next one is paged in afresh, 4 KB at a time: converting a uint8 batch to float
# took 4x as long as with transparent huge pages (2 MB pages). Read once, before torch's first allocation.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")


def main() -> None:
    """The `runner` command: `runner.cli.main`, its import included, so that Ctrl-C while the libraries
    load (a few seconds) stops with one line too."""
    import sys

    handle_dropped_exceptions()
    try:
        from runner.cli import main as cli_main
    except KeyboardInterrupt:
        print("runner: interrupted while starting; nothing was run", file=sys.stderr)
        sys.exit(130)
    cli_main()


def handle_dropped_exceptions() -> None:
    """Take the exceptions Python drops (raised in a callback the interpreter itself called: a weakref's,
    run by the garbage collector, or a `__del__`; it prints "Exception ignored ... Traceback" and goes on)
    where they come from a stop the user asked for.

    - KeyboardInterrupt: SIGINT raises it in whatever Python code runs at that moment; dropped, a sweep ran
      to its end. SIGINT is sent to the main thread again a moment later, from a timer thread, once the
      callback has returned (sent from the main thread, it would be raised inside this hook and dropped the
      same way; a real signal, unlike `_thread.interrupt_main`, also ends a blocking call such as a sleep).
    - A DataLoader worker killed by a signal, found as its iterator is freed: a SIGTERM to the process group
      (Slurm's) reaches the workers too; the run has already stopped on that signal and said so.
    Anything else goes to the previous hook."""
    import signal
    import sys
    import threading

    previous = sys.unraisablehook
    if getattr(previous, "handles_dropped_exceptions", False):
        return
    main_thread = threading.main_thread().ident

    def hook(unraisable) -> None:
        error, where = unraisable.exc_value, getattr(unraisable.object, "__qualname__", "")
        if isinstance(error, KeyboardInterrupt):
            threading.Timer(0.05, signal.pthread_kill, (main_thread, signal.SIGINT)).start()
        elif not (where.endswith("DataLoaderIter.__del__") and "is killed by signal" in str(error)):
            previous(unraisable)

    hook.handles_dropped_exceptions = True
    sys.unraisablehook = hook
