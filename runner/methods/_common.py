"""Pieces shared by the solvers in :mod:`runner.methods` (private: import them only from there).

The solver convention (POT's), applied to every public solver in ``runner/methods``:

- ``reg``: the entropic weight (the paper's epsilon), as in ``ot.sinkhorn(a, b, M, reg)``. It is the
  one name project-wide; a regulariser of a different kind gets its own descriptive name, never ``reg``.
- ``max_iter``: the cap on outer iterations (sweeps); ``tol``: the stopping threshold on ``err``.
- ``method=``: the algorithm choice (never ``backend`` or ``solver``).
- ``log=True``: also return a dict with at least ``n_iter`` (iterations run), ``err`` (the stopping
  criterion's final value) and ``converged`` (bool); build it with :func:`convergence_log`, which also
  emits the one shared ``UserWarning`` when the solver stopped at ``max_iter`` without converging.

Also here: :func:`logsumexp` for numpy arrays (scipy's) and torch tensors, the transportation-LP
constraint matrices (:func:`transport_constraints`) with the integrality check of TU LPs
(:func:`integral_solution`), and :func:`usable_cores` (which :mod:`runner.hardware` counts too).
"""

from __future__ import annotations

import os
import sys
import warnings

import numpy as np
from scipy import sparse

__all__ = [
    "ConvergenceWarning",
    "convergence_log",
    "warn_not_converged",
    "logsumexp",
    "transport_constraints",
    "integral_solution",
    "usable_cores",
    "get_backend",
]


class ConvergenceWarning(UserWarning):
    """A solver stopped at ``max_iter`` before its stopping criterion fell below ``tol``."""


_HERE = os.path.dirname(os.path.abspath(__file__))


def get_backend(*arrays):
    """POT's array backend of `arrays` (``ot.backend.get_backend``: numpy, torch, ...). POT is imported on
    first use, not with the module: with scikit-learn it takes about a second, which every `runner` start
    paid (the method configs import their solvers' modules for their choices)."""
    from ot.backend import get_backend as backend

    return backend(*arrays)


def usable_cores() -> int:
    """The CPU cores this process may run on: its affinity (a Slurm or taskset share), not the machine's."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def to_device(host, device, dtype=None):
    """Host data (a tensor, array, list or number) on `device` without the host waiting for the device: a
    non-blocking copy, from page-locked memory on CUDA (the caching host allocator keeps the buffer until
    the copy is done)."""
    import torch

    t = torch.as_tensor(host, dtype=dtype)
    return (t.pin_memory() if device.type == "cuda" else t).to(device, non_blocking=True)


def _caller_level() -> int:
    """``stacklevel`` of the first frame outside ``runner/methods`` (the user's call of the solver)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(_HERE):
        frame, level = frame.f_back, level + 1
    return level


def warn_not_converged(solver: str, n_iter: int, err: float, tol: float) -> None:
    """Emit the shared :class:`ConvergenceWarning` (a ``UserWarning``) for ``solver``, attributed to
    the first caller outside ``runner/methods``."""
    warnings.warn(
        f"{solver} did not converge: err={err:.3g} > tol={tol:.3g} after max_iter={n_iter} iterations; "
        "raise max_iter or tol",
        ConvergenceWarning,
        stacklevel=_caller_level(),
    )


def convergence_log(
    solver: str, n_iter: int, err: float, tol: float, converged=None, warn: bool = True, **extra
) -> dict:
    """The ``log`` dict of the convention: ``n_iter``, ``err``, ``converged`` (+ ``extra``).

    ``converged`` defaults to ``err < tol``; when it is False and ``warn`` is set the shared warning is
    emitted (so callers build this dict whether or not ``log=True`` was asked, and return it only if it
    was; ``warn=False`` is POT's ``warn`` argument).
    """
    err = float(err)
    converged = bool(err < tol) if converged is None else bool(converged)
    if warn and not converged:
        warn_not_converged(solver, n_iter, err, tol)
    return dict(n_iter=int(n_iter), err=err, converged=converged, **extra)


def logsumexp(x, axis: int, keepdims: bool = False):
    """log sum_axis exp(x), stable; for numpy arrays scipy's `logsumexp` bit for bit, for tensors torch's
    (same device/dtype).

    A slice that is all ``-inf`` gives ``-inf`` (no NaN).
    """
    if not isinstance(x, np.ndarray):
        import torch

        return torch.logsumexp(x, dim=axis, keepdim=keepdims)
    # scipy's float operations in its order, without its array-API dispatch (0.25 ms a call here, most of a
    # DB-OT clustering solve): the maxima apart, as m copies of the largest term, the rest summed shifted
    if x.dtype.kind in "biu":
        x = x.astype(np.float64)
    if x.shape[axis] == 0:  # an empty sum
        out = np.full(x.shape[:axis] + (1,) + x.shape[axis:][1:], -np.inf, dtype=x.dtype)
        return out if keepdims else out.squeeze(axis)[()]
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        top = x.max(axis, keepdims=True)
        at_top = x == top
        m = at_top.sum(axis, keepdims=True, dtype=x.dtype)
        # scipy's where(sum == 0, sum, sum / m): the same, for m >= 1 wherever the sum is 0
        rest = np.exp(np.where(at_top, -np.inf, x) - top).sum(axis, keepdims=True) / m
        out = np.log1p(rest) + np.log(m) + top
        finite = np.isfinite(out)
        if not finite.all():  # an infinite or all -inf slice: the direct sum's log, as scipy's
            out = np.where(finite, out, np.log(np.exp(x).sum(axis, keepdims=True)))
    return out if keepdims else out.squeeze(axis)[()]


def transport_constraints(m: int, n: int):
    """Sparse row- and column-sum operators on a row-major flattened (m, n) plan ``P.ravel()``.

    Returns ``rows`` (m, m n) with ``rows @ P.ravel() = P 1_n`` and ``cols`` (n, m n) with
    ``cols @ P.ravel() = P^T 1_m`` (CSR), the constraint blocks of every transportation LP/MILP.
    """
    rows = sparse.kron(sparse.eye(m), np.ones((1, n)), format="csr")
    cols = sparse.kron(np.ones((1, m)), sparse.eye(n), format="csr")
    return rows, cols


def integral_solution(x, what: str, atol: float = 1e-6) -> np.ndarray:
    """Round the simplex vertex ``x`` of a totally unimodular LP to int64, or raise if it is fractional."""
    x = np.asarray(x, dtype=np.float64)
    rounded = np.rint(x)
    gap = np.abs(x - rounded).max(initial=0.0)
    if gap > atol:
        raise RuntimeError(f"HiGHS returned a fractional {what} (max deviation {gap:.2g})")
    return rounded.astype(np.int64)
