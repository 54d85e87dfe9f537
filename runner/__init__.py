"""runner: a Hydra-driven experiment runner for combinatorial-optimization and optimal-transport methods."""

import os

# POT loads every array library it finds when it is imported, and JAX then reserves 75% of the GPU's memory
# (seen on an H200: an ImageNet preset ran out of memory with ~105 GB held by JAX). The solvers here take
# numpy arrays and torch tensors only; a user's own setting of these variables wins.
for _library in ("JAX", "CUPY", "TENSORFLOW"):
    os.environ.setdefault(f"POT_BACKEND_DISABLE_{_library}", "1")
