"""Stops the user asked for that Python would otherwise drop: `handle_dropped_exceptions`, installed by the
`runner` command before anything else. This module imports nothing of the runner."""

from __future__ import annotations


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
