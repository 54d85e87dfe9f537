"""Double-bounded optimal transport (DB-OT; Shi, Shen & Yan, AAAI 2024).

Entropic OT whose source marginal is fixed and whose target marginal only has to lie in a box::

    P* = argmin_P  <C, P> + reg * sum_ij P_ij (log P_ij - 1)
         s.t.      P >= 0,   P 1_n = a,   b_low <= P^T 1_m <= b_up

with C the (m, n) cost (m samples -> n classes or clusters), a in R^m_+ and 0 <= b_low <= b_up in R^n;
``reg`` is the paper's epsilon (the solver convention of :mod:`runner.methods._common`). It is feasible
iff sum(b_low) <= sum(a) <= sum(b_up); the solution is unique and reads

    P* = diag(u) K diag(q * v),   K = exp(-C / reg),   u > 0,  q >= 1,  0 < v <= 1,

where q_j > 1 only on columns at their lower bound and v_j < 1 only on columns at their upper bound.
The dual, maximised over f, g >= 0, h <= 0 with (f, g, h) = reg * log(u, q, v) and no duality gap, is

    D(f, g, h) = <f, a> + <g, b_low> + <h, b_up> - reg * sum_ij exp((f_i + g_j + h_j - C_ij) / reg).

Special cases: b_low = b_up is Sinkhorn; b_low = 0 is entropic partial OT of mass sum(a); b_low = 0 with
b_up >= sum(a) is the row softmax P_ij = a_i softmax(-C_i / reg)_j.

Applications (same module): :func:`dbot_cluster` (barycentric clustering with bounded cluster masses),
:func:`dbot_loss` (the DB-OT training loss for long-tailed classification; :class:`DBOTLoss` checks its
prior once, for a training loop) and :func:`dbot_predict` (transductive DB-OT inference on a set of
test logits).

:func:`dbot`, :func:`dbot_predict` and :func:`dbot_loss` take numpy arrays or torch tensors (CPU or
CUDA) and compute in float64 (the loss: in the logits' dtype) where their input lives.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from scipy.special import xlogy

from runner.methods._common import (
    convergence_log,
    get_backend,
    logsumexp,
    to_device,
    transport_constraints,
)

__all__ = [
    "LOSS_MODES",
    "SOLVERS",
    "CosineClassifier",
    "DBOTLoss",
    "PendingLabels",
    "check_problem",
    "class_balanced_weights",
    "dbot",
    "dbot_cluster",
    "dbot_dual",
    "dbot_loss",
    "dbot_lp",
    "dbot_objective",
    "dbot_predict",
    "ldam_loss",
    "ldam_margins",
    "marginal_violation",
    "read_pending",
    "round_plan",
    "weighted_focal_loss",
]

SOLVERS = ("sinkhorn", "dual", "bregman", "bregman_plain")
LOSS_MODES = ("paper", "official")


# ----------------------------------------------------------------------------------------------------
# Problem checks and diagnostics
# ----------------------------------------------------------------------------------------------------
def _float64(x, like=None):
    """float64 numpy array, or float64 torch tensor on ``like``'s device when ``like`` (or x) is one."""
    if isinstance(like, torch.Tensor) or isinstance(x, torch.Tensor):
        device = like.device if isinstance(like, torch.Tensor) else x.device
        return torch.as_tensor(x, dtype=torch.float64, device=device)
    return np.asarray(x, dtype=np.float64)


def _first(mask) -> int:
    """Index of the first True of a 1-d mask (error paths only: may copy to the host)."""
    return int(np.flatnonzero(mask.cpu().numpy() if isinstance(mask, torch.Tensor) else mask)[0])


def _vector(x, size: int, name: str, allow_inf: bool = False, like=None):
    x = _float64(x, like)
    if x.ndim == 0:
        x = x * (
            np.ones(size) if isinstance(x, np.ndarray) else torch.ones(size, dtype=x.dtype, device=x.device)
        )
    if tuple(x.shape) != (size,):
        raise ValueError(f"{name} has shape {tuple(x.shape)}: must be a scalar or have shape ({size},)")
    bad = x.isnan() if isinstance(x, torch.Tensor) else np.isnan(x)
    bad = bad | (x < 0) | ((x == math.inf) & (not allow_inf))
    if bool(bad.any()):
        j = _first(bad)
        raise ValueError(f"{name}[{j}]={float(x[j])}: must be finite and >= 0")
    return x


def _check_reg(reg):
    if not (
        isinstance(reg, (int, float, np.floating, np.integer))
        and not isinstance(reg, bool)
        and math.isfinite(reg)
        and reg > 0
    ):
        raise ValueError(f"reg={reg}: the entropic weight (eps in the paper) must be a finite number > 0")


def check_problem(cost, a, b_low, b_up, reg: float):
    """Validate a DB-OT problem; return float64 (cost, a, b_low, b_up) with b_up clipped at sum(a).

    The outputs are numpy arrays, or torch tensors on ``cost``'s device when ``cost`` is a tensor.
    Clipping is harmless (no column can carry more than the total mass) and lets b_up be ``inf``.
    Raises ValueError on bad shapes or values and on infeasible bounds.

    >>> cost, a, b_low, b_up = check_problem([[0.0, 1.0]], [1.0], 0.0, float("inf"), reg=0.1)
    >>> b_up.tolist()
    [1.0, 1.0]
    """
    cost = _float64(cost)
    if cost.ndim != 2 or 0 in cost.shape:
        raise ValueError(f"cost has shape {tuple(cost.shape)}: must be a non-empty (m, n) matrix")
    if not bool(get_backend(cost).isfinite(cost).all()):
        raise ValueError("cost has non-finite entries: all entries must be finite")
    m, n = cost.shape
    a = _vector(a, m, "a", like=cost)
    b_low = _vector(b_low, n, "b_low", like=cost)
    b_up = _vector(b_up, n, "b_up", allow_inf=True, like=cost)
    _check_reg(reg)
    below = b_low > b_up
    if bool(below.any()):
        j = _first(below)
        raise ValueError(f"b_low[{j}]={float(b_low[j])} > b_up[{j}]={float(b_up[j])}: need b_low <= b_up")
    mass, low, up = float(a.sum()), float(b_low.sum()), float(b_up.sum())
    if mass <= 0:
        raise ValueError("sum(a)=0: the source must carry some mass")
    slack = 1e-9 * mass
    if low > mass + slack:
        raise ValueError(f"infeasible bounds: sum(b_low)={low:.10g} > sum(a)={mass:.10g}")
    if up < mass - slack:
        raise ValueError(f"infeasible bounds: sum(b_up)={up:.10g} < sum(a)={mass:.10g}")
    return cost, a, b_low, b_up.clip(max=mass)


def _tensor_problem(cost, a, b_low, b_up):
    """:func:`check_problem` for a tensor cost, without reading its device: shapes, and the values of
    a, b_low, b_up given on the host, are checked here; the values on the cost's device are checked there
    into ``valid`` (a 0-dim bool), which the solver reads with its first convergence check
    (:class:`_Stopping`). Returns float64 (cost, a, b_low, b_up clipped at sum(a), sum(a), valid) there."""
    cost = cost.detach().to(torch.float64)
    if cost.ndim != 2 or 0 in cost.shape:
        raise ValueError(f"cost has shape {tuple(cost.shape)}: must be a non-empty (m, n) matrix")
    m, n = cost.shape
    checks = [cost.isfinite().all()]
    vectors = []
    for x, size, name, allow_inf in ((a, m, "a", False), (b_low, n, "b_low", False), (b_up, n, "b_up", True)):
        if isinstance(x, torch.Tensor) and x.device == cost.device:
            x = x.detach().to(torch.float64)
            x = x.expand(size) if x.ndim == 0 else x
            if tuple(x.shape) != (size,):
                raise ValueError(
                    f"{name} has shape {tuple(x.shape)}: must be a scalar or have shape ({size},)"
                )
            checks.append(~(x.isnan() | (x < 0) | ((x == math.inf) & (not allow_inf))).any())
        else:
            host = x.detach().cpu() if isinstance(x, torch.Tensor) else x
            x = to_device(_vector(host, size, name, allow_inf), cost.device)
        vectors.append(x)
    a, b_low, b_up = vectors
    mass = a.sum()
    slack = 1e-9 * mass
    checks += [(b_low <= b_up).all(), mass > 0, b_low.sum() <= mass + slack, b_up.sum() >= mass - slack]
    return cost, a, b_low, torch.minimum(b_up, mass), mass, torch.stack(checks).all()


def _violation(row_sums, col_sums, a, b_low, b_up):
    """:func:`marginal_violation` as a scalar of the inputs' backend (a tensor stays on its device)."""
    return (
        abs(row_sums - a).sum()
        + (b_low - col_sums).clip(min=0.0).sum()
        + (col_sums - b_up).clip(min=0.0).sum()
    )


def marginal_violation(row_sums, col_sums, a, b_low, b_up) -> float:
    """L1 violation of the constraints: ||P1 - a||_1 + ||(b_low - P^T 1)_+||_1 + ||(P^T 1 - b_up)_+||_1."""
    return float(_violation(row_sums, col_sums, a, b_low, b_up))


class _Stopping:
    """The solvers' stopping test: the L1 marginal violation (:func:`marginal_violation`) below
    tol * sum(a). A tensor problem is read from its device once per check, in one copy: the violation,
    sum(a) and the validity flag of :func:`_tensor_problem` (``invalid()`` runs when it is false, the
    host's check that raises the error naming the value)."""

    def __init__(self, a, b_low, b_up, tol: float, mass, valid=None, invalid=None):
        self.a, self.b_low, self.b_up, self.tol = a, b_low, b_up, tol
        self.mass, self.valid, self.invalid = mass, valid, invalid
        self.total = None if isinstance(mass, torch.Tensor) else float(mass)  # sum(a) on the host
        self.err = math.inf

    @property
    def stop(self) -> float:
        return self.tol * self.total

    def converged(self, n_iter: int, row_sums, col_sums, plan) -> bool:
        """Whether the plan of these sums, at sweep ``n_iter``, is within tol (``plan()`` makes it)."""
        err = _violation(row_sums, col_sums, self.a, self.b_low, self.b_up)
        if isinstance(err, torch.Tensor):
            values = torch.stack([err, self.mass, self.valid.to(err.dtype)]).cpu().numpy()  # the one read
            err, self.total = values[0], float(values[1])
            self._check_valid(values[2])
        self.err = float(err)
        return self.err < self.stop

    def _check_valid(self, valid) -> None:
        if not valid:
            self.invalid()
            self.valid = torch.ones((), dtype=torch.bool, device=self.a.device)  # the host's check won


class _Recorded(_Stopping):
    """The stopping test of a tensor problem kept on its device and read after the solve (for
    :func:`dbot_predict`, with other solves' in one copy: :func:`read_pending`). Each check records there,
    with no read, the outcome of the first check below tol (while none is, of the latest check): a float64
    vector (converged, violation, sweep, each row's argmax of the plan), and lets the solver go on, so that
    it runs its max_iter sweeps (the same cap as the per-check test, the same numbers up to the recorded
    check; what follows it is not used). The labels are those of the plan the per-check test stops on, or
    of the final plan where no check converged: what the per-check test gives, without a read per check.
    """

    outcome = None

    def converged(self, n_iter: int, row_sums, col_sums, plan) -> bool:
        err = _violation(row_sums, col_sums, self.a, self.b_low, self.b_up)
        # tol * sum(a) in float64 on the device: the same product and comparison as the host's `stop`
        head = torch.stack([(err < self.tol * self.mass).to(err.dtype), err, err.new_full((), n_iter)])
        now = torch.cat([head, plan().argmax(1).to(err.dtype)])
        self.outcome = now if self.outcome is None else torch.where(self.outcome[0] > 0, self.outcome, now)
        return False

    def values(self, plan) -> torch.Tensor:
        """What the read brings back, on the device: (valid, sum(a), converged, violation, sweep, labels)."""
        labels = torch.where(self.outcome[0] > 0, self.outcome[3:], plan.argmax(1).to(plan.dtype))
        head = torch.stack([self.valid.to(plan.dtype), self.mass])
        return torch.cat([head, self.outcome[:3], labels])

    def read(self, values: np.ndarray, method: str, reg: float) -> np.ndarray:
        """The labels from `values` (read from :meth:`values`), after the checks the per-check test makes:
        the inputs' (their error), the kernel's underflow, the convergence warning."""
        valid, self.total, _, err, n_iter = values[:5]
        self._check_valid(valid)
        self.err = float(err)
        _solve_log(method, reg, int(n_iter), self, {})
        return values[5:].astype(np.int64)


def dbot_objective(cost, plan, reg: float) -> float:
    """Primal value <C, P> + reg * sum_ij P_ij (log P_ij - 1), with 0 log 0 = 0 (numpy)."""
    plan = np.asarray(plan, dtype=np.float64)
    return float((np.asarray(cost) * plan).sum() + reg * (xlogy(plan, plan) - plan).sum())


def _weighted_sum(x, w) -> float:
    # 0 * inf terms (zero mass, unbounded column) contribute nothing to the dual.
    with np.errstate(invalid="ignore"):
        return float(np.where((x == 0) | (w == 0), 0.0, x * w).sum())


def dbot_dual(cost, a, b_low, b_up, reg: float, f, g, h) -> float:
    """Dual value <f,a> + <g,b_low> + <h,b_up> - reg * sum_ij exp((f_i + g_j + h_j - C_ij) / reg) (numpy)."""
    cost = np.asarray(cost, dtype=np.float64)
    f, g, h = (np.asarray(x, dtype=np.float64) for x in (f, g, h))
    gibbs = np.exp((f[:, None] + (g + h)[None, :] - cost) / reg).sum()
    return _weighted_sum(f, a) + _weighted_sum(g, b_low) + _weighted_sum(h, b_up) - reg * gibbs


# ----------------------------------------------------------------------------------------------------
# Solvers (numpy or torch: the same code through POT's backend `nx`)
# ----------------------------------------------------------------------------------------------------
def _fmax(x, bound: float):
    """max(x, bound) with NaN -> bound (np.fmax; a column with b_up = 0 gives 0/0)."""
    return np.fmax(x, bound) if isinstance(x, np.ndarray) else torch.fmax(x, x.new_tensor(bound))


def _fmin(x, bound: float):
    return np.fmin(x, bound) if isinstance(x, np.ndarray) else torch.fmin(x, x.new_tensor(bound))


def _checkpoint(n_iter: int, max_iter: int, check_every: int) -> bool:
    return n_iter % check_every == 0 or n_iter == max_iter


def _solve_sinkhorn(nx, cost, a, b_low, b_up, reg, max_iter, stopping, check_every):
    """Solver II (Sinkhorn-Knopp with three scalings), one sweep:
    u = a / K(q v);  kappa = K^T u;  q = max(b_low / (kappa v), 1);  v = min(b_up / (kappa q), 1).
    """
    offset = nx.min(cost, axis=1, keepdims=True)  # row shifts leave P unchanged, keep each row's max at 1
    kernel = nx.exp((offset - cost) / reg)
    n = cost.shape[1]
    q, v = nx.ones(n, type_as=cost), nx.ones(n, type_as=cost)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        u = a / nx.dot(kernel, q * v)
        kappa = nx.dot(u, kernel)
        for n_iter in range(1, max_iter + 1):
            q = _fmax(b_low / (kappa * v), 1.0)
            v = _fmin(b_up / (kappa * q), 1.0)
            kw = nx.dot(kernel, q * v)
            # The row sums of the current plan come for free here, so checking costs O(m + n).
            if _checkpoint(n_iter, max_iter, check_every) and stopping.converged(
                n_iter,
                u * kw,
                kappa * q * v,
                lambda: u[:, None] * kernel * (q * v)[None, :],  # noqa: B023 (called at once)
            ):
                break
            u = a / kw
            kappa = nx.dot(u, kernel)
        plan = u[:, None] * kernel * (q * v)[None, :]
        duals = dict(f=reg * nx.log(u) + offset[:, 0], g=reg * nx.log(q), h=reg * nx.log(v))
    return plan, n_iter, duals


def _solve_dual(nx, cost, a, b_low, b_up, reg, max_iter, stopping, check_every):
    """Solver III (dual block ascent in the log domain, potentials in units of reg), one sweep:
    f = log a - LSE_j(g_j + h_j - C_ij/reg);  lam = LSE_i(f_i - C_ij/reg);
    g = max(log b_low - lam - h, 0);  h = min(log b_up - lam - g, 0).
    """
    neg_cost = -cost / reg
    with np.errstate(divide="ignore"):
        log_a, log_low, log_up = nx.log(a), nx.log(b_low), nx.log(b_up)
    n = cost.shape[1]
    g, h = nx.zeros(n, type_as=cost), nx.zeros(n, type_as=cost)
    with np.errstate(invalid="ignore", over="ignore"):
        f = log_a - logsumexp(neg_cost, axis=1)
        lam = logsumexp(neg_cost + f[:, None], axis=0)
        for n_iter in range(1, max_iter + 1):
            g = _fmax(log_low - lam - h, 0.0)  # b_low_j = 0 gives -inf -> g_j = 0; fmax drops NaN
            h = _fmin(log_up - lam - g, 0.0)
            row_lse = logsumexp(neg_cost + (g + h)[None, :], axis=1)
            if _checkpoint(n_iter, max_iter, check_every) and stopping.converged(
                n_iter,
                nx.exp(f + row_lse),
                nx.exp(lam + g + h),
                lambda: nx.exp(neg_cost + f[:, None] + (g + h)[None, :]),  # noqa: B023 (called at once)
            ):
                break
            f = log_a - row_lse
            lam = logsumexp(neg_cost + f[:, None], axis=0)
    plan = nx.exp(neg_cost + f[:, None] + (g + h)[None, :])
    return plan, n_iter, dict(f=reg * f, g=reg * g, h=reg * h)


def _solve_bregman(nx, cost, a, b_low, b_up, reg, max_iter, stopping, check_every, dykstra):
    """Solver I (KL projections of the plan itself), one sweep starting from P = K:
    P <- diag(a / P1) P;  P <- P diag(max(b_low / P^T 1, 1));  P <- P diag(min(b_up / P^T 1, 1)).

    The plain cycle (the paper's) is exact only when b_low = b_up: projecting in turn onto inequality
    sets stalls at a feasible but suboptimal plan. Dykstra's correction fixes it: each bound keeps the
    scaling z it last applied and undoes it before re-projecting, P diag(z) -> P diag(s), z <- 1/s.
    The row set is affine and needs no correction.
    """
    plan = nx.exp((nx.min(cost, axis=1, keepdims=True) - cost) / reg)
    n = cost.shape[1]
    undo = {"low": nx.ones(n, type_as=cost), "up": nx.ones(n, type_as=cost)}
    row_sums = plan.sum(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        for n_iter in range(1, max_iter + 1):
            plan *= nx.where(a > 0, a / row_sums, 0.0)[:, None]  # a row of no mass stays 0 (not 0/0)
            col_sums = plan.sum(axis=0)
            # Both column projections only rescale columns: track the sums and scale P once.
            column_scale = nx.ones(n, type_as=cost)
            for key, bound, clip in (("low", b_low, _fmax), ("up", b_up, _fmin)):
                col_sums = col_sums * undo[key]
                step = clip(bound / col_sums, 1.0)
                column_scale *= undo[key] * step
                col_sums = col_sums * step
                if dykstra:  # a column forced to 0 (b_up = 0) stays 0 whatever it is scaled by
                    undo[key] = nx.where(step > 0, 1.0 / step, nx.ones(n, type_as=cost))
            plan *= column_scale[None, :]
            row_sums = plan.sum(axis=1)
            if _checkpoint(n_iter, max_iter, check_every) and stopping.converged(
                n_iter,
                row_sums,
                col_sums,
                lambda: plan,  # noqa: B023 (called at once)
            ):
                break
    return plan, n_iter, {}


def dbot(
    cost,
    a,
    b_low,
    b_up,
    reg: float,
    method: str = "sinkhorn",
    max_iter: int = 1000,
    tol: float = 1e-6,
    check_every: int = 10,
    log: bool = False,
):
    r"""Solve entropic double-bounded OT (see the module docstring for the problem).

    Parameters
    ----------
    cost : (m, n) array or tensor, the cost C (any units; only C / reg matters).
    a : (m,) source masses, >= 0.
    b_low, b_up : (n,) or scalar column bounds, 0 <= b_low <= b_up (b_up may be inf).
    reg : entropic regularisation (the paper's eps), > 0, in the units of C.
    method : "sinkhorn" (scalings u, q, v; fastest), "dual" (log-domain dual ascent; use for small
        reg), "bregman" (KL projections of the plan with Dykstra's correction; exact) or
        "bregman_plain" (the paper's cycle of projections; exact only when b_low = b_up).
    max_iter : maximum number of sweeps.
    tol : stop once the L1 marginal violation (:func:`marginal_violation`) is below tol * sum(a);
        it is checked every ``check_every`` sweeps and at the cap. A ``UserWarning`` says when
        ``max_iter`` is reached first. A tensor problem is checked where it lives: each check reads
        its device once, and the first brings the checks of the inputs (a bad value raises there).
    log : also return a dict with ``n_iter``, ``err`` (final violation), ``converged`` and, for
        "sinkhorn" and "dual", the dual potentials ``f`` (m,), ``g`` >= 0, ``h`` <= 0 (n,).

    Returns
    -------
    plan : (m, n) float64 array, or tensor on ``cost``'s device [, log dict].

    Example: with b_low = 0 and b_up >= sum(a) the plan is the row softmax of -C / reg.

    >>> plan = dbot([[0.0, 1.0], [1.0, 0.0]], [0.5, 0.5], 0.0, 1.0, reg=1.0)
    >>> np.round(plan, 4).tolist()
    [[0.3655, 0.1345], [0.1345, 0.3655]]
    """
    plan, info, _ = _solve(cost, a, b_low, b_up, reg, method, max_iter, tol, check_every)
    return (plan, info) if log else plan


def _solve(cost, a, b_low, b_up, reg, method, max_iter, tol, check_every, recorded: bool = False):
    """:func:`dbot`'s checks and solve: (plan, log, its :class:`_Stopping`). A tensor problem is checked
    where it lives, its flag read with the first convergence check; ``recorded`` (a tensor problem): the
    checks kept on the device, no read, the log None (see :class:`_Recorded`)."""
    if method not in SOLVERS:
        raise ValueError(f"method={method!r}: must be one of {SOLVERS}")
    if not (isinstance(max_iter, (int, np.integer)) and max_iter >= 1):
        raise ValueError(f"max_iter={max_iter}: must be an integer >= 1")
    if not (isinstance(check_every, (int, np.integer)) and check_every >= 1):
        raise ValueError(f"check_every={check_every}: must be an integer >= 1")
    if not tol > 0:
        raise ValueError(f"tol={tol}: must be > 0")
    _check_reg(reg)
    if isinstance(cost, torch.Tensor):
        given = (cost, a, b_low, b_up)
        cost, a, b_low, b_up, mass, valid = _tensor_problem(*given)

        def invalid():  # the error path: the host's check, on copies, names the bad value
            check_problem(*(x.detach().cpu() if isinstance(x, torch.Tensor) else x for x in given), reg)

        stopping = (_Recorded if recorded else _Stopping)(a, b_low, b_up, tol, mass, valid, invalid)
    else:
        cost, a, b_low, b_up = check_problem(cost, a, b_low, b_up, reg)
        stopping = _Stopping(a, b_low, b_up, tol, a.sum())
    nx = get_backend(cost)
    args = (nx, cost, a, b_low, b_up, reg, max_iter, stopping, check_every)
    if method == "sinkhorn":
        plan, n_iter, duals = _solve_sinkhorn(*args)
    elif method == "dual":
        plan, n_iter, duals = _solve_dual(*args)
    else:
        plan, n_iter, duals = _solve_bregman(*args, dykstra=method == "bregman")
    return plan, None if recorded else _solve_log(method, reg, n_iter, stopping, duals), stopping


def _solve_log(method: str, reg: float, n_iter: int, stopping: _Stopping, duals: dict) -> dict:
    """The solve's log (its warning when it stopped at max_iter); an error where the kernel underflowed."""
    if not math.isfinite(stopping.err):
        raise FloatingPointError(
            f"reg={reg} is too small for method={method!r} (the Gibbs kernel underflows): use method='dual'"
        )
    return convergence_log(f"dbot(method={method!r})", n_iter, stopping.err, stopping.stop, **duals)


# ----------------------------------------------------------------------------------------------------
# Barycentric clustering with bounded cluster masses (paper Eq. 15-17)
# ----------------------------------------------------------------------------------------------------
def _bounded_lp(cost, a, b_low, b_up, var_upper=None, method="highs-ds"):
    """HiGHS on min <C, P> s.t. P 1 = a, b_low <= P^T 1 <= b_up, 0 <= P <= var_upper (C (m, n))."""
    from scipy import sparse
    from scipy.optimize import linprog

    rows, cols = transport_constraints(*cost.shape)
    res = linprog(
        cost.ravel(),
        A_ub=sparse.vstack([-cols, cols]).tocsr(),
        b_ub=np.r_[-b_low, b_up],
        A_eq=rows,
        b_eq=a,
        bounds=(0, var_upper),
        method=method,
    )
    if res.status != 0:
        raise RuntimeError(f"HiGHS failed on the bounded transportation LP: {res.message}")
    return res


def dbot_lp(cost, a, b_low, b_up, log: bool = False):
    """Unregularised DB-OT, the ``reg -> 0`` limit of :func:`dbot`, solved exactly by HiGHS (numpy).

    min_P <C, P> s.t. P >= 0, P 1 = a, b_low <= P^T 1 <= b_up. Returns the (m, n) plan [, log with
    ``cost`` (the optimal value), ``n_iter`` (simplex iterations), ``err`` = 0, ``converged``].

    >>> dbot_lp(np.array([[0.0, 1.0], [0.0, 2.0]]), [0.5, 0.5], [0.0, 0.25], 1.0).tolist()
    [[0.25, 0.25], [0.5, 0.0]]
    """
    cost, a, b_low, b_up = check_problem(np.asarray(cost, dtype=np.float64), a, b_low, b_up, reg=1.0)
    res = _bounded_lp(cost, a, b_low, b_up, method="highs")
    plan = res.x.reshape(cost.shape)
    return (plan, dict(cost=float(res.fun), n_iter=int(res.nit), err=0.0, converged=True)) if log else plan


def round_plan(plan, low_counts, up_counts) -> np.ndarray:
    """Hard assignment z (m,) maximising sum_s log P_{s z_s} s.t. low_t <= #{s : z_s = t} <= up_t.

    The integer bounds make this a transportation LP with a totally unimodular constraint matrix, so
    the simplex vertex that HiGHS returns is integral.  ``plan`` is (m, n) >= 0; the counts are (n,).
    """
    plan = np.asarray(plan, dtype=np.float64)
    m, n = plan.shape
    low, up = np.asarray(low_counts, dtype=np.float64), np.asarray(up_counts, dtype=np.float64)
    if low.sum() > m or up.sum() < m or (low > up).any():
        raise ValueError(
            f"count bounds sum(low)={low.sum()}, sum(up)={up.sum()} admit no assignment of {m} rows"
        )
    res = _bounded_lp(-np.log(np.maximum(plan, 1e-300)), np.ones(m), low, up, var_upper=1)
    return res.x.reshape(m, n).argmax(axis=1)


def dbot_cluster(
    X,
    n_clusters: int,
    tau=0.1,
    reg: float = 0.05,
    n_outer: int = 5,
    seed: int = 0,
    weights=None,
    init: str = "kmeans++",
    hard_assign: bool = True,
    assign: str = "argmax",
    method: str = "dual",
    max_iter: int = 1000,
    tol: float = 1e-6,
    log: bool = False,
):
    r"""Barycentric clustering whose cluster masses stay within [(1 - tau) b, (1 + tau) b].

    Each of ``n_outer`` rounds: D_st = ||x_s - c_t||^2 / median(D) (N, K); P = DBOT(D, 1/N,
    (1 - tau) b, (1 + tau) b, reg); labels z_s = argmax_t P_st; W = P * onehot(z) (or W = P when
    ``hard_assign`` is False, the paper's "without reweighting" variant); c_t = sum_s W_st x_s / sum_s W_st
    (an empty cluster keeps its centroid).  The bounds hold on the *mass* sum_s P_st; with the paper's
    argmax the hard counts follow N * [b_low, b_up] only roughly.  ``assign="rounded"`` replaces the
    argmax by :func:`round_plan`, the most likely hard assignment whose counts lie in
    [ceil(N b_low), floor(N b_up)] (widened to [floor, ceil] when those integers admit none).

    Parameters
    ----------
    X : (N, d) samples.  n_clusters : K.  tau : scalar or (K,) bound rate, >= 0 (tau = 0 forces the
    masses to b exactly).  reg : entropic regularisation relative to the median squared distance.
    seed : the initialisation's random state.
    weights : (K,) target cluster proportions b (normalised; default uniform 1/K).
    init : "kmeans++" (sklearn's greedy k-means++) or "random" (K distinct samples).
    assign : "argmax" or "rounded" (see above).
    method, max_iter, tol : passed to :func:`dbot`.
    log : also return a dict with ``masses`` (n_outer, K), the column sums of P at every round, and the
    bounds ``b_low``, ``b_up``.

    Returns
    -------
    labels : (N,) int64,  centroids : (K, d) float64 [, log].

    >>> x = np.r_[np.zeros((3, 2)), np.ones((3, 2))] + np.arange(6)[:, None] * 1e-3
    >>> labels, centroids = dbot_cluster(x, 2, tau=0.0, seed=0)
    >>> np.bincount(labels).tolist()
    [3, 3]
    """
    X = np.asarray(X, dtype=np.float64)
    if X.ndim != 2 or len(X) == 0:
        raise ValueError(f"X has shape {X.shape}: must be a non-empty (N, d) matrix")
    n = len(X)
    if not (isinstance(n_clusters, (int, np.integer)) and 1 <= n_clusters <= n):
        raise ValueError(f"n_clusters={n_clusters}: must be an integer in [1, {n}]")
    if not (isinstance(n_outer, (int, np.integer)) and n_outer >= 1):
        raise ValueError(f"n_outer={n_outer}: must be an integer >= 1")
    if init not in ("kmeans++", "random"):
        raise ValueError(f"init={init!r}: must be 'kmeans++' or 'random'")
    if assign not in ("argmax", "rounded"):
        raise ValueError(f"assign={assign!r}: must be 'argmax' or 'rounded'")
    tau = _vector(tau, n_clusters, "tau")
    b = _vector(np.ones(n_clusters) if weights is None else weights, n_clusters, "weights")
    if b.sum() <= 0:
        raise ValueError("weights sum to 0: must have a positive entry")
    b = b / b.sum()
    b_low, b_up = np.maximum(1.0 - tau, 0.0) * b, (1.0 + tau) * b
    a = np.full(n, 1.0 / n)
    low_counts, up_counts = np.ceil(n * b_low - 1e-9), np.floor(n * b_up + 1e-9)
    if low_counts.sum() > n or up_counts.sum() < n:  # e.g. tau = 0 with K not dividing N
        low_counts, up_counts = np.floor(n * b_low + 1e-9), np.ceil(n * b_up - 1e-9)

    if init == "kmeans++":
        from sklearn.cluster import kmeans_plusplus

        centroids = kmeans_plusplus(X, n_clusters, random_state=seed)[0]
    else:
        centroids = X[np.random.default_rng(seed).choice(n, n_clusters, replace=False)].copy()
    import ot  # on first use, as `get_backend`

    masses = []
    for _ in range(n_outer):
        dists = ot.dist(X, centroids)  # squared Euclidean
        scale = np.median(dists)
        plan = dbot(dists / (scale if scale > 0 else 1.0), a, b_low, b_up, reg, method, max_iter, tol)
        masses.append(plan.sum(axis=0))
        labels = plan.argmax(axis=1) if assign == "argmax" else round_plan(plan, low_counts, up_counts)
        w = plan * (labels[:, None] == np.arange(n_clusters)) if hard_assign else plan
        w_sum = w.sum(axis=0)
        filled = w_sum > 0
        centroids[filled] = (w.T @ X)[filled] / w_sum[filled, None]
    if not log:
        return labels, centroids
    return labels, centroids, dict(masses=np.stack(masses), b_low=b_low, b_up=b_up)


# ----------------------------------------------------------------------------------------------------
# Long-tailed classification: training loss and transductive inference (C = -logits, reg = 1)
# ----------------------------------------------------------------------------------------------------
def _masked(x, present):
    """x where the column is `present`, 0 elsewhere (x unchanged when present is None)."""
    return x if present is None else x.where(present, 0.0)


def _log_bregman_sweeps(log_kernel, log_low, log_up, n_sweeps: int, end_on_rows: bool, present=None):
    """Unrolled solver-I sweeps in the log domain with a = 1/B (differentiable).

    ``present`` (K,) bool leaves the other columns, all -inf in ``log_kernel``, out of the problem
    with fixed shapes: their column steps are 0, and their sums are taken over zeros, since -inf there
    would put inf - inf into the values or the gradient."""
    log_a = -math.log(log_kernel.shape[0])
    log_p = log_kernel
    for sweep in range(n_sweeps):
        log_p = log_p - torch.logsumexp(log_p, dim=1, keepdim=True) + log_a
        if end_on_rows and sweep == n_sweeps - 1:
            break
        step = (log_low - torch.logsumexp(_masked(log_p, present), dim=0)).clamp(min=0.0)
        log_p = log_p + _masked(step, present)
        step = (log_up - torch.logsumexp(_masked(log_p, present), dim=0)).clamp(max=0.0)
        log_p = log_p + _masked(step, present)
    return log_p


class DBOTLoss:
    """The DB-OT training loss for long-tailed classification, its prior checked once (see
    :func:`dbot_loss` for the loss and the arguments).

    The prior is validated when the loss is built, on the host (one copy if it lives on a device);
    the calls then never read the device: classes absent from a batch are masked, not indexed out, so
    every shape is fixed. The prior's logarithms are made once per dtype and device of the logits,
    where the logits live (a tensor prior already there is not copied, host values are copied there without
    waiting).
    """

    def __init__(self, prior, delta: float = 0.0, n_sweeps: int = 1, mode: str = "paper"):
        if mode not in LOSS_MODES:
            raise ValueError(f"mode={mode!r}: must be one of {LOSS_MODES}")
        if not 0.0 <= delta < 1.0:
            raise ValueError(f"delta={delta}: must be in [0, 1)")
        if not (isinstance(n_sweeps, (int, np.integer)) and not isinstance(n_sweeps, bool) and n_sweeps >= 1):
            raise ValueError(f"n_sweeps={n_sweeps}: must be an integer >= 1")
        host = torch.as_tensor(prior).detach().to("cpu", torch.float64)
        if host.ndim != 1 or not bool((host.isfinite() & (host > 0)).all()):
            raise ValueError(f"prior has shape {tuple(host.shape)}: must be (K,), all entries finite and > 0")
        self.prior, self.delta, self.n_sweeps, self.mode = prior, delta, n_sweeps, mode
        self._logs: dict = {}

    def _log_prior_and_bounds(self, logits):
        """log r, log b_low, log b_up in the logits' dtype on their device (made at the first call)."""
        key = (logits.dtype, logits.device)
        if key not in self._logs:  # in float32 at least: a half-precision sum of counts overflows
            work = torch.promote_types(logits.dtype, torch.float32)
            prior = torch.as_tensor(self.prior)
            if prior.device.type == "cpu" and prior.device != logits.device:  # host values: copied unwaited
                prior = to_device(prior, logits.device)
            prior = prior.to(logits.device, work)
            prior = prior / prior.sum()
            low, up = (1.0 - self.delta) * prior, (1.0 + self.delta) * prior
            self._logs[key] = tuple(torch.log(v).to(logits.dtype) for v in (prior, low, up))
        return self._logs[key]

    def __call__(self, logits, target):
        if logits.ndim != 2:
            raise ValueError(f"logits has shape {tuple(logits.shape)}: must be (B, K)")
        batch, n_classes = logits.shape
        if len(self.prior) != n_classes:
            raise ValueError(f"prior has {len(self.prior)} entries: must have one per class ({n_classes})")
        if target.ndim == 1:
            target = torch.nn.functional.one_hot(target, n_classes)
        target = target.to(logits.dtype)  # soft labels may come in another float dtype
        log_prior, log_low, log_up = self._log_prior_and_bounds(logits)
        if self.mode == "paper":
            log_p = _log_bregman_sweeps(logits + log_prior, log_low, log_up, self.n_sweeps, end_on_rows=True)
            return -(target * (log_p + math.log(batch))).sum(dim=1).mean()

        counts = target.sum(dim=0)
        present = counts > 0
        # a class absent from the batch drops out as a column of -inf (log 0): no mass, no gradient
        shifted = logits + torch.log(counts)
        balanced_ce = -(target * _masked(torch.log_softmax(shifted, dim=1), present)).sum(dim=1).mean()
        log_p = _log_bregman_sweeps(shifted, log_low, log_up, self.n_sweeps, False, present)
        col_sums = _masked(torch.logsumexp(_masked(log_p, present), dim=0).exp(), present)
        clipped = torch.minimum(torch.maximum(col_sums, log_low.exp()), log_up.exp())
        return balanced_ce - (clipped * torch.log_softmax(col_sums, dim=0)).sum()


def dbot_loss(logits, target, prior, delta: float = 0.0, n_sweeps: int = 1, mode: str = "paper"):
    r"""DB-OT training loss for long-tailed classification (a torch scalar, differentiable).

    The batch is an OT problem with cost C = -logits (B, K), reg = 1, a = 1/B and column bounds
    (1 -/+ delta) r from the training prior r.  Softmax cross-entropy is inverse OT with the row
    constraint only; DB-OT adds the column bounds.

    mode="paper": P = ``n_sweeps`` (K_train) unrolled solver-I sweeps that start from the kernel
    exp(l) diag(r) and end on a row step, so each row of B * P is a distribution; the loss is
    -(1/B) sum_ij y_ij log(B P_ij).  With n_sweeps = 1 this is exactly Balanced Softmax,
    P_ij = (1/B) r_j e^{l_ij} / sum_k r_k e^{l_ik}, for any delta.

    mode="official" (the authors' GammaSoftmax code): Balanced Softmax with the *batch* label counts
    n (classes absent from the batch drop out), CE(l + log n, y), plus the soft cross-entropy
    -sum_j t_j log softmax(s)_j between the column sums s = P^T 1 and their clip t = clip(s, b_low, b_up),
    where P = ``n_sweeps`` plain sweeps (row, lower, upper) on exp(l + log n).

    Parameters
    ----------
    logits : (B, K) tensor.  target : (B,) int64 labels or (B, K) soft labels (rows summing to 1).
    prior : (K,) training class frequencies or counts, all > 0.  delta : bound rate in [0, 1).
    n_sweeps : K_train >= 1.  mode : "paper" or "official".

    Runs in the logits' dtype on their device. Each call checks the prior again (a read of the device
    when it lives there): a training loop builds :class:`DBOTLoss` once instead. With one sweep the paper
    loss is Balanced Softmax:

    >>> logits, y, prior = torch.tensor([[1.0, 0.0]]), torch.tensor([0]), torch.tensor([3.0, 1.0])
    >>> bool(torch.isclose(dbot_loss(logits, y, prior), torch.nn.functional.cross_entropy(
    ...     logits + torch.log(prior / 4), y)))
    True
    """
    return DBOTLoss(prior, delta, n_sweeps, mode)(logits, target)


# ----------------------------------------------------------------------------------------------------
# The baseline losses of the paper's Tables 1 and 3 (each a torch scalar of (B, K) logits, int labels)
# ----------------------------------------------------------------------------------------------------
def _counts(counts) -> np.ndarray:
    counts = np.asarray(counts, dtype=np.float64)
    if counts.ndim != 1 or not (counts > 0).all():
        raise ValueError(f"counts must be a 1-d array of per-class training counts > 0, got {counts}")
    return counts


def class_balanced_weights(counts, beta: float = 0.9999) -> np.ndarray:
    r"""Class-balanced weights (Cui et al., CVPR 2019): the inverse effective number of samples,

    .. math:: w_j = \frac{1 - \beta}{1 - \beta^{n_j}}, \quad \text{scaled so that } \sum_j w_j = K.

    ``beta = 0`` weighs every class 1; ``beta -> 1`` approaches inverse class frequency.
    """
    counts = _counts(counts)
    if not 0.0 <= beta < 1.0:
        raise ValueError(f"beta={beta}: must be in [0, 1)")
    weights = (1.0 - beta) / (1.0 - np.power(beta, counts))
    return weights / weights.sum() * len(counts)


def weighted_focal_loss(logits, target, gamma: float = 0.0, weight=None):
    r"""Softmax focal loss with class weights, averaged as PyTorch's ``cross_entropy(weight=...)``:

    .. math:: L = \frac{\sum_i w_{y_i} (1 - p_{i y_i})^\gamma (-\log p_{i y_i})}{\sum_i w_{y_i}}

    ``gamma = 0`` is (weighted) cross-entropy: class-balanced CE with ``weight = class_balanced_weights``;
    ``gamma > 0`` with those weights is class-balanced focal (Cui et al. apply it to sigmoid outputs;
    here, as the focal baseline of the long-tail task, to the softmax). ``target`` is (B,) class indices,
    or (B, K) soft labels y: then :math:`L = \frac{1}{B} \sum_i \sum_j y_{ij} (1 - p_{ij})^\gamma
    (-\log p_{ij})` (Lin et al.'s focal loss of a distribution), without class weights.
    """
    log_p = torch.log_softmax(logits, dim=1)
    soft = target.dim() == 2
    if not soft:
        log_p = log_p.gather(1, target[:, None])[:, 0]
    per_class = -log_p
    if gamma:  # 1 - p floored at the smallest normal: at p = 1, x^gamma's gradient is inf for gamma < 1
        per_class = -((1.0 - log_p.exp()).clamp(min=torch.finfo(log_p.dtype).tiny) ** gamma) * log_p
    if soft:
        if weight is not None:
            raise ValueError("weighted_focal_loss: class weights need class indices, not soft labels")
        return (target * per_class).sum(dim=1).mean()
    if weight is None:
        return per_class.mean()
    w = torch.as_tensor(weight, dtype=logits.dtype, device=logits.device)[target]
    return (w * per_class).sum() / w.sum()


def ldam_margins(counts, max_margin: float = 0.5) -> np.ndarray:
    r"""LDAM margins (Cao et al., NeurIPS 2019): :math:`\Delta_j \propto n_j^{-1/4}`, the largest
    (rarest class) equal to ``max_margin``."""
    margins = _counts(counts) ** -0.25
    return margins * (max_margin / margins.max())


def ldam_loss(logits, target, margins, weight=None):
    r"""Label-distribution-aware margin loss: cross-entropy after subtracting the true class's margin,

    .. math:: L_i = -\log \frac{e^{z_{i y_i} - \Delta_{y_i}}}
                             {e^{z_{i y_i} - \Delta_{y_i}} + \sum_{j \ne y_i} e^{z_{ij}}},

    averaged with class weights as :func:`weighted_focal_loss` (DRW: ``weight = class_balanced_weights``
    from the re-weighting epoch on). Cao et al. feed it ``s`` times cosine logits with margins in cosine
    units; give ``logits = s cos`` and ``margins = s * ldam_margins(...)`` (see :class:`CosineClassifier`).
    """
    shift = torch.as_tensor(margins, dtype=logits.dtype, device=logits.device)[target]
    adjusted = logits.scatter_add(1, target[:, None], -shift[:, None])
    return weighted_focal_loss(adjusted, target, 0.0, weight)


class CosineClassifier(torch.nn.Module):
    """``scale * cos(f(x), w_j)``: the normalised linear classifier LDAM trains (Cao et al.'s NormedLinear,
    with their scale s folded into the logits); ``weight`` is (K, D) like ``nn.Linear``'s."""

    def __init__(self, in_features: int, num_classes: int, scale: float = 30.0):
        super().__init__()
        self.scale = scale
        self.weight = torch.nn.Parameter(torch.empty(num_classes, in_features).uniform_(-1, 1))

    def forward(self, x):
        cos = torch.nn.functional.normalize(x, dim=1) @ torch.nn.functional.normalize(self.weight, dim=1).T
        return self.scale * cos


def dbot_predict(
    logits,
    prior,
    delta: float = 0.0,
    reg: float = 1.0,
    batch_size: int | None = None,
    method: str = "sinkhorn",
    max_iter: int = 1000,
    tol: float = 1e-6,
    read: bool = True,
):
    r"""Transductive DB-OT inference: argmax_j P_ij, P = DBOT(-logits, 1/B, (1 -/+ delta) r, reg).

    Parameters
    ----------
    logits : (N, K) array or tensor (a tensor is solved where it lives, CPU or CUDA, in float64).
    prior : (K,) expected label frequencies r of the test set (or counts; normalised here; zeros
    allowed).  delta : bound rate >= 0 (delta = 0 is Sinkhorn with column marginal r;
    delta >= max(1, 1/r_min - 1) makes both bounds inactive, i.e. argmax).
    reg : entropic regularisation in logit units.  batch_size : solve
    each consecutive batch of this many rows on its own (None: the whole set at once).
    method, max_iter, tol : passed to :func:`dbot`.
    read : for tensor logits, False returns a :class:`PendingLabels` instead, read with others in one
    copy by :func:`read_pending`.

    Returns
    -------
    (N,) int64 predicted classes: a numpy array, or for tensor logits a CPU tensor. A device other than
    the CPU is read once, after every solve (each solve's convergence checks are kept there, see
    :class:`_Recorded`: it runs its max_iter sweeps, the labels those of the check that stops the
    per-check test), and once for a prior that lives there.

    >>> logits = np.array([[2.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
    >>> dbot_predict(logits, [2, 1]).tolist(), dbot_predict(logits, [1, 2]).tolist()
    ([0, 0, 1], [0, 1, 1])
    """
    on_device = isinstance(logits, torch.Tensor)
    logits = logits.detach().to(torch.float64) if on_device else np.asarray(logits, dtype=np.float64)
    if logits.ndim != 2:
        raise ValueError(f"logits has shape {tuple(logits.shape)}: must be (N, K)")
    n, n_classes = logits.shape
    # checked on the host, once (a read where the prior lives on a device); the logits with each solve
    prior = _vector(prior.detach().cpu() if isinstance(prior, torch.Tensor) else prior, n_classes, "prior")
    if prior.sum() <= 0:
        raise ValueError("prior sums to 0: must have a positive entry")
    if not delta >= 0:
        raise ValueError(f"delta={delta}: must be >= 0")
    if batch_size is not None and not (isinstance(batch_size, (int, np.integer)) and batch_size >= 1):
        raise ValueError(f"batch_size={batch_size}: must be None or an integer >= 1")
    prior = prior / prior.sum()
    b_low, b_up = max(1.0 - delta, 0.0) * prior, (1.0 + delta) * prior
    if on_device:
        b_low, b_up = to_device(b_low, logits.device), to_device(b_up, logits.device)
    nx, step = get_backend(logits), n if batch_size is None else batch_size
    # the checks kept on the device where reading each would wait for it (not the host's CPU), or read later
    recorded = on_device and (logits.device != torch.device("cpu") or not read)
    solves = []
    for start in range(0, n, step):
        chunk = logits[start : start + step]
        a = nx.full((len(chunk),), 1.0 / len(chunk), type_as=chunk)
        plan, _, stopping = _solve(-chunk, a, b_low, b_up, reg, method, max_iter, tol, 10, recorded)
        solves.append((stopping, stopping.values(plan)) if recorded else plan.argmax(1))
    if not recorded:
        return torch.cat(solves) if on_device else np.concatenate(solves)
    pending = PendingLabels(solves, method, reg)
    return torch.from_numpy(pending.labels(read_pending([pending])[0])) if read else pending


class PendingLabels:
    """The labels of :func:`dbot_predict` on tensor logits, not read yet: each solve's outcome on the
    device (:meth:`_Recorded.values`), packed in ``values``; :func:`read_pending` reads them."""

    def __init__(self, solves: list, method: str, reg: float):
        self.stops = [stopping for stopping, _ in solves]
        self.values = torch.cat([values for _, values in solves])
        self.method, self.reg = method, reg

    def labels(self, values: np.ndarray) -> np.ndarray:
        """The labels from the host copy of ``values`` (each solve's errors and warnings raised here)."""
        out, offset = [], 0
        for stopping in self.stops:
            size = 5 + len(stopping.a)  # (valid, sum(a), converged, violation, sweep) and a label per row
            out.append(stopping.read(values[offset : offset + size], self.method, self.reg))
            offset += size
        return np.concatenate(out)


def read_pending(pending: list[PendingLabels]) -> list[np.ndarray]:
    """The ``values`` of each of `pending` (on one device) on the host, read in one copy; each one's
    ``labels(values)`` gives its labels."""
    if not pending:
        return []
    host = torch.cat([p.values for p in pending]).cpu().numpy()  # the one read
    return np.split(host, np.cumsum([len(p.values) for p in pending])[:-1])
