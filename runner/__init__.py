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

    from runner.interrupts import handle_dropped_exceptions

    handle_dropped_exceptions()
    try:
        from runner.cli import main as cli_main
    except KeyboardInterrupt:
        print("runner: interrupted while starting; nothing was run", file=sys.stderr)
        sys.exit(130)
    cli_main()
