"""Reading pickles that may come from someone else (a shared run dir, a downloaded data file) without
running their code: only tensors, numbers, strings, containers and numpy arrays are built."""

from __future__ import annotations

import pickle

import numpy as np
import torch

# numpy's array, dtype and scalar reconstructors build data only (numpy 2 pickles a dtype by its class).
NUMPY_GLOBALS = [np.ndarray, np.dtype, np.arange(1).__reduce__()[0], np.float64(0).__reduce__()[0]] + [
    type(np.dtype(code)) for code in "?bBhHiIlLqQefdgFDGSU"
]
_NUMPY_NAMES = {(g.__module__, g.__name__) for g in NUMPY_GLOBALS} | {
    (module, name) for module in ("numpy.core.multiarray", "numpy._core.multiarray")
    for name in ("_reconstruct", "scalar")
}  # fmt: skip


class RefusedPickle(pickle.UnpicklingError):
    """The file holds an object whose unpickling could run code."""


def torch_load(path, map_location="cpu"):
    """`torch.load(path, weights_only=True)` admitting numpy arrays; RefusedPickle for anything else."""
    try:
        with torch.serialization.safe_globals(NUMPY_GLOBALS):
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        if "Unsupported global" in str(e):
            raise RefusedPickle(str(path)) from None
        if "Weights only load failed" in str(e):  # torch's wrapper of any error, a corrupt file's too
            detail = next(
                (line.strip() for line in str(e).splitlines() if line.startswith("Unsupported")), ""
            )
            raise pickle.UnpicklingError(f"corrupt, or not a file torch.save wrote ({detail})") from None
        raise


class _NumpyUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) not in _NUMPY_NAMES:
            raise RefusedPickle(f"{module}.{name}")
        return super().find_class(module, name)


def load_pickle(file, encoding: str = "ASCII"):
    """`pickle.load(file)` building only numpy arrays and plain Python data; RefusedPickle naming the
    first other global."""
    return _NumpyUnpickler(file, encoding=encoding).load()
