"""Partial Wasserstein covering (PWC; Kawano, Koide & Otaki, AAAI 2022, arXiv 2106.00886).

Given an application set ``X_app`` (N_app points), a development set ``X_dev`` (N_dev points) and
candidates ``S_cand`` (N_cand points, by default ``X_app``), pick K candidates ``S`` whose addition to
``X_dev`` best covers ``X_app`` under the one-sided partial Wasserstein divergence

    PW(S) = min_{P >= 0}  <P, C>   s.t.  P 1 = a,  P^T 1 <= b(S)                                (Eq. 1)

with C_ij = ||x_i - t_j||^2 over the columns [candidates | dev], a_i = 1 / N_app, and
b_j(S) = 1[j in S] / N_dev for a candidate column, 1 / N_dev for a dev column. All application mass
must move; dev mass may stay unused, so only regions where the application density exceeds the
development density cost anything. The objective phi(S) = PW({}) - PW(S) is monotone submodular
(Theorem 1), hence greedy is (1 - 1/e)-optimal. Its dual (Eq. 7) is

    max_{f, g}  <f, a> + <g, b>   s.t.  f_i + g_j <= C_ij,  g_j <= 0,

and the dual feasible set does not depend on b, so an optimal (f, g) for S bounds every addition:
PW(S + {j}) >= PW(S) + g_j / N_dev. The quasi-greedy methods add argmin_j g_j, with g_j taken from
one LP (sensitivity), from the C-transform of the reduced LP's f (ctrans), or from an entropic
dual (entropic).

Masses are probability weights and costs are in squared feature units; PW is in squared units.
Everything here is numpy + POT + scipy; no Hydra. The solvers follow the convention of
:mod:`runner.methods._common`; unlike POT's ``ot.partial.partial_wasserstein`` (the plan), they return
the value and the optimal dual potentials, hence the ``_dual`` in their names.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
from scipy import optimize, sparse

from runner.methods._common import convergence_log, logsumexp, transport_constraints

__all__ = [
    "BASELINES",
    "BATCHED",
    "PW_METHODS",
    "CoverResult",
    "cover",
    "entropic_partial_wasserstein_dual",
    "partial_wasserstein_dual",
]

#: Network-simplex pivot limit. POT's default (1e5) stops short from about 3k x 1.5k on and only warns.
NUM_ITER_MAX = 100_000_000

PW_METHODS = ("greedy", "sensitivity", "ctrans", "entropic", "milp")
BASELINES = ("random", "kcenter", "lof", "entropy")
BATCHED = ("greedy", "sensitivity", "ctrans", "entropic")  # sequential: one scoring round per pick


# --------------------------------------------------------------------------------------------------
# Partial Wasserstein: exact LP and entropic solvers
# --------------------------------------------------------------------------------------------------


def _check_masses(cost, a, b):
    # equal totals may differ by the rounding of the masses' own dtype (float32 sums of 1/n are not 1)
    rounding = max([1e-9] + [np.finfo(x.dtype).eps for x in map(np.asarray, (a, b)) if x.dtype.kind == "f"])
    cost = np.asarray(cost, dtype=np.float64)
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if cost.ndim != 2 or 0 in cost.shape:
        raise ValueError(f"cost must be a non-empty 2-D array (n, m), got shape {cost.shape}")
    if a.shape != (cost.shape[0],) or b.shape != (cost.shape[1],):
        raise ValueError(
            f"masses must have shapes a: ({cost.shape[0]},) and b: ({cost.shape[1]},) to match "
            f"cost {cost.shape}, got a: {a.shape}, b: {b.shape}"
        )
    for name, arr in (("cost", cost), ("a", a), ("b", b)):
        if not np.isfinite(arr).all():
            raise ValueError(f"{name} contains NaN or inf; all entries must be finite")
    if (a < 0).any() or (b < 0).any():
        raise ValueError(f"masses must be >= 0, got min(a)={a.min():.3g}, min(b)={b.min():.3g}")
    if a.sum() <= 0:
        raise ValueError("a has zero total mass; at least one row needs positive mass")
    if b.sum() < a.sum() * (1 - rounding):
        raise ValueError(
            f"infeasible: sum(b)={b.sum():.17g} < sum(a)={a.sum():.17g}; every row's mass must fit "
            "into the column capacities"
        )
    return cost, a, b


def _partial_lp(cost_ext, a, b, max_iter=NUM_ITER_MAX):
    """Solve Eq. 1 for positive a (n,) and b (m,) with ``cost_ext`` (n + 1, m) whose last row is 0.

    The zero-cost dummy row carries sigma = sum(b) - sum(a) so that ``ot.emd`` sees balanced
    masses; the dummy potential u_d := -max_j v_j then turns (u, v) into an optimal (f, g) of Eq. 7
    (g <= 0 and <f, a> + <g, b> = PW; when sigma > 0 this u_d is the solver's own, when sigma = 0 it
    is the tightest feasible one). Returns (value, f, g, plan (n, m)).
    """
    import ot  # on first use, as `runner.methods._common.get_backend`

    sigma = max(b.sum() - a.sum(), 0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # POT only warns when the simplex stops early
        try:
            plan, log = ot.emd(np.append(a, sigma), b, cost_ext, numItermax=max_iter, log=True)
        except UserWarning as warning:
            raise RuntimeError(f"ot.emd did not reach the optimum: {warning}") from None
    u_dummy = -log["v"].max()
    return float(log["cost"]), log["u"][:-1] - u_dummy, log["v"] + u_dummy, plan[:-1]


def partial_wasserstein_dual(cost, a, b, max_iter=NUM_ITER_MAX, log=False):
    r"""One-sided partial Wasserstein: rows exact, columns capped; its value and optimal dual potentials.

    .. math::
        PW = \min_{P \ge 0,\ P 1 = a,\ P^\top 1 \le b} \langle P, C\rangle
           = \max_{f_i + g_j \le C_{ij},\ g \le 0} \langle f, a\rangle + \langle g, b\rangle

    Solved exactly with ``ot.emd`` on the problem restricted to positive masses plus one zero-cost
    dummy row of mass sum(b) - sum(a). Potentials of zero-mass entries are not left to the solver's
    estimate but set to the best feasible value, the C-transform: g_j = min(0, min_i C_ij - f_i) for
    an empty column, f_i = min_j C_ij - g_j for an empty row. With b_j = 0 for unselected candidates
    this g_j is exactly the ctrans score of Algorithm 3.

    Parameters
    ----------
    cost : (n, m) array, ground costs (any unit; PW comes back in the same unit).
    a : (n,) array >= 0, row masses, transported exactly.
    b : (m,) array >= 0, column capacities; sum(b) >= sum(a).
    max_iter : network-simplex pivot limit (``num_iter_max`` before); reaching it raises RuntimeError,
        since the covering methods rely on an exact optimum.
    log : also return a dict with the optimal ``plan`` (n, m), ``n_iter`` (1: one exact LP; POT does
        not report its pivots), ``err`` (the duality gap <P, C> - <f, a> - <g, b>) and ``converged``.

    Returns
    -------
    value : float, PW.
    f : (n,) array, row potentials.
    g : (m,) array, column potentials, all <= 0.
    log : dict, only when ``log=True``.

    Examples
    --------
    Row 0 fits only 0.25 of its 0.5 into its free column, the rest pays 1:

    >>> value, f, g = partial_wasserstein_dual(
    ...     np.array([[0.0, 1.0], [2.0, 0.0]]), np.array([0.5, 0.5]), np.array([0.25, 1.0]))
    >>> float(value), g.tolist()
    (0.25, [-1.0, 0.0])
    """
    cost, a, b = _check_masses(cost, a, b)
    rows, cols = a > 0, b > 0
    sub = cost[np.ix_(rows, cols)]
    value, f_sub, g_sub, plan_sub = _partial_lp(
        np.vstack([sub, np.zeros(sub.shape[1])]), a[rows], b[cols], max_iter
    )
    f, g = np.empty(cost.shape[0]), np.empty(cost.shape[1])
    f[rows], g[cols] = f_sub, g_sub
    if not cols.all():
        g[~cols] = np.minimum(0.0, (cost[np.ix_(rows, ~cols)] - f_sub[:, None]).min(axis=0))
    if not rows.all():
        f[~rows] = (cost[~rows] - g).min(axis=1)
    if not log:
        return value, f, g
    plan = np.zeros(cost.shape)
    plan[np.ix_(rows, cols)] = plan_sub
    gap = abs(float(np.sum(plan * cost)) - float(f @ a + g @ b))
    return value, f, g, {"plan": plan, "n_iter": 1, "err": gap, "converged": True}


_ABSORB = 50.0  # |log| of a scaling beyond which it is absorbed into the log-domain potentials


def entropic_partial_wasserstein_dual(cost, a, b, reg, max_iter=10_000, tol=1e-9, log=False):
    r"""Entropic one-sided partial Wasserstein by log-domain (stabilized) block dual ascent.

    .. math::
        PW_\varepsilon = \min_{P \ge 0,\ P 1 = a,\ P^\top 1 \le b}
            \langle P, C\rangle + \varepsilon \sum_{ij} P_{ij} (\log P_{ij} - 1)
        = \max_{g \le 0} \langle f, a\rangle + \langle g, b\rangle
            - \varepsilon \sum_{ij} e^{(f_i + g_j - C_{ij})/\varepsilon}

    Each sweep maximizes the dual exactly in g, then in f:

        g_j <- min(0, eps log b_j - eps LSE_i((f_i - C_ij) / eps))
        f_i <- eps log a_i - eps LSE_j((g_j - C_ij) / eps)

    and stops when the plan P_ij = exp((f_i + g_j - C_ij) / eps) misses the row masses by less
    than ``tol`` in L1 (columns are feasible after every g-step). The potentials live in the log
    domain; a sweep updates bounded scalings u = e^(df/eps), v = e^(dg/eps) with two matrix-vector
    products against the kernel e^((f_i + g_j - C_ij)/eps), which are absorbed into (f, g) before
    they over- or underflow. By the envelope theorem dPW_eps / db_j = g_j, so the gradient needs no
    differentiation through the iterations.

    Parameters
    ----------
    cost : (n, m) array; a : (n,) > 0; b : (m,) > 0 (log domain: give empty columns a small mass).
    reg : eps > 0, in the unit of ``cost``.
    max_iter, tol : sweep limit and L1 row-marginal tolerance; stopping at max_iter first emits the
        shared ``ConvergenceWarning`` (a UserWarning) and returns the potentials reached.
    log : also return a dict with ``plan``, ``n_iter``, ``err`` (the final L1 row residual) and
        ``converged``.

    Returns
    -------
    value : float, PW_eps (the regularized optimum).
    f : (n,) array; g : (m,) array <= 0.
    log : dict, only when ``log=True``.

    Examples
    --------
    >>> cost, a, b = np.array([[0.0, 1.0], [2.0, 0.0]]), np.array([0.5, 0.5]), np.array([0.25, 1.0])
    >>> value, f, g, info = entropic_partial_wasserstein_dual(cost, a, b, reg=0.01, log=True)
    >>> info["converged"], round(float(np.sum(info["plan"] * cost)), 3)  # -> the LP's 0.25 as reg -> 0
    (True, 0.25)
    """
    cost, a, b = _check_masses(cost, a, b)
    if (a <= 0).any() or (b <= 0).any():
        raise ValueError("entropic solver works in the log domain: all masses must be > 0")
    if not reg > 0:
        raise ValueError(f"reg={reg}: must be > 0")
    # Potentials in units of eps: F = f / eps, G = g / eps. One exact sweep from G = 0 in the log
    # domain makes every kernel row sum to a_i, so the kernel cannot underflow row-wise.
    scaled = cost / reg
    F = np.log(a) - logsumexp(-scaled, axis=1)
    G = np.zeros(cost.shape[1])
    u, v = np.ones(cost.shape[0]), np.ones(cost.shape[1])
    kernel, residual, n_iter = None, np.inf, 0
    while residual >= tol and n_iter < max_iter:
        n_iter += 1
        if kernel is None or max(np.abs(np.log(u)).max(), np.abs(np.log(v)).max()) > _ABSORB:
            F, G = F + np.log(u), G + np.log(v)
            u, v = np.ones_like(u), np.ones_like(v)
            kernel = np.exp(F[:, None] + G[None, :] - scaled)
        # g-step: v_j = b_j / (K^T u)_j, capped so that G_j + log v_j <= 0 (an empty column -> 0)
        with np.errstate(divide="ignore"):
            v = np.minimum(b / (kernel.T @ u), np.exp(np.minimum(-G, _ABSORB)))
        rows = kernel @ v
        residual = float(np.abs(u * rows - a).sum())  # |P 1 - a|_1 before the f-step
        u = a / rows  # f-step
    info = convergence_log("entropic_partial_wasserstein_dual", n_iter, residual, tol)
    F, G = F + np.log(u), G + np.log(v)
    plan = np.exp(F[:, None] + G[None, :] - scaled)
    f, g = reg * F, reg * G
    value = float(f @ a + g @ b - reg * plan.sum())
    if not log:
        return value, f, g
    return value, f, g, {"plan": plan, **info}


# --------------------------------------------------------------------------------------------------
# Covering
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CoverResult:
    """Outcome of :func:`cover`.

    indices : (k,) int array, distinct indices into the candidates, in pick order.
    pw : (k + 1,) float array, pw[t] = PW(X_app, X_dev + first t picks); pw[0] = PW({}).
    n_lp : exact OT LPs solved in all, selection and pw curve (MILP relaxations not counted).
    """

    indices: np.ndarray
    pw: np.ndarray
    n_lp: int


class _Covering:
    """Cost over the columns [candidates | dev], the masses of Eq. 1, and a cache of PW(S)."""

    def __init__(self, X_app, X_dev, X_cand):
        import ot

        self.n_app, self.n_dev, self.n_cand = len(X_app), len(X_dev), len(X_cand)
        self.cost = np.hstack([ot.dist(X_app, X_cand), ot.dist(X_app, X_dev)])
        self.a = np.full(self.n_app, 1.0 / self.n_app)
        self.n_lp = 0
        self._pw = {}

    def masses(self, selected, eta=0.0):
        """b(S), with mass eta / N_dev on the unselected candidates."""
        b = np.full(self.n_cand + self.n_dev, 1.0 / self.n_dev)
        b[: self.n_cand] = eta / self.n_dev
        b[list(selected)] = 1.0 / self.n_dev
        return b

    def solve(self, selected, eta=0.0):
        """(value, f, g) of Eq. 1 on all columns; with eta = 0 this is the reduced LP on dev + S."""
        self.n_lp += 1
        value, f, g = partial_wasserstein_dual(self.cost, self.a, self.masses(selected, eta))
        if eta == 0:
            self._pw[frozenset(selected)] = value
        return value, f, g

    def pw(self, selected):
        key = frozenset(selected)
        return self._pw[key] if key in self._pw else self.solve(selected)[0]

    def greedy_step(self, selected):
        """PW(S + {j}) for every candidate j (inf for j in S): one reduced LP each (Algorithm 2)."""
        cols = np.r_[self.n_cand + np.arange(self.n_dev), np.asarray(selected, dtype=int), 0]
        cost_ext = np.zeros((self.n_app + 1, len(cols)))  # last row: the dummy row of _partial_lp
        cost_ext[:-1] = self.cost[:, cols]
        b = np.full(len(cols), 1.0 / self.n_dev)
        values = np.full(self.n_cand, np.inf)
        for j in np.setdiff1d(np.arange(self.n_cand), selected):
            cost_ext[:-1, -1] = self.cost[:, j]
            values[j] = _partial_lp(cost_ext, self.a, b)[0]
            self._pw[frozenset(selected) | {int(j)}] = values[j]
        self.n_lp += self.n_cand - len(selected)
        return values


def _sensitivity_scores(problem, selected, opts):
    """g_j of the full LP where unselected candidates carry mass eta / N_dev (Algorithm 1)."""
    return problem.solve(selected, eta=opts["eta"])[2][: problem.n_cand]


def _ctrans_scores(problem, selected, opts):
    """C-transform g_j = min(0, min_i C_ij - f_i) of the reduced LP's f (Algorithm 3)."""
    return problem.solve(selected)[2][: problem.n_cand]


def _entropic_scores(problem, selected, opts):
    """g_j = dPW_eps / db_j at b_j = eta / N_dev (Sec. 3.3), eps = reg (the paper: 0.01 in cost units) or,
    with reg_relative, reg * PW({}).

    Cold-started each step: warm starts from the previous (f, g) were measured to slow convergence
    down by up to 100x here.
    """
    eps = opts["reg"]
    if opts["reg_relative"]:  # PW({}) = 0: nothing to cover, any scale will do (all costs 0: 1)
        eps *= problem.pw([]) or problem.cost.mean() or 1.0
    g = entropic_partial_wasserstein_dual(
        problem.cost,
        problem.a,
        problem.masses(selected, eta=opts["eta"]),
        reg=eps,
        max_iter=opts["max_iter"],
        tol=opts["tol"],
    )[2]
    return g[: problem.n_cand]


_SCORES = {
    "greedy": lambda problem, selected, opts: problem.greedy_step(selected),
    "sensitivity": _sensitivity_scores,
    "ctrans": _ctrans_scores,
    "entropic": _entropic_scores,
}


def _select_sequential(problem, k, method, opts):
    """Add the ``batch`` lowest-scoring unselected candidates per round (ties: lowest index)."""
    selected = []
    while len(selected) < k:
        scores = _SCORES[method](problem, selected, opts).copy()
        scores[selected] = np.inf
        picks = np.argsort(scores, kind="stable")[: min(opts["batch"], k - len(selected))]
        selected.extend(int(j) for j in picks)
    return selected


def _select_milp(problem, k, opts):
    """Exact optimum of Eq. 2 by the MILP of Appendix A with scipy's HiGHS.

    Variables P' = N_app P (n_app x (n_cand + n_dev), row-major) and binary y (n_cand):
    rows of P' sum to 1, candidate column j to at most y_j N_app / N_dev, dev columns to at most
    N_app / N_dev, and sum(y) = k (= max over |S| <= k, since PW is monotone).
    """
    n, m, nc = problem.n_app, problem.n_cand + problem.n_dev, problem.n_cand
    pw_empty = problem.pw([])
    # Objective = 1000 PW(S) / PW({}): HiGHS' fixed absolute gap (1e-6) is then negligible too.
    scale = n * pw_empty / 1000 if pw_empty > 0 else 1.0
    cap = n / problem.n_dev
    row_sums, col_sums = transport_constraints(n, m)
    open_cols = sparse.vstack([-cap * sparse.eye(nc), sparse.csr_matrix((m - nc, nc))])
    A = sparse.vstack(
        [
            sparse.hstack([row_sums, sparse.csr_matrix((n, nc))]),
            sparse.hstack([col_sums, open_cols]),
            sparse.hstack([sparse.csr_matrix((1, n * m)), np.ones((1, nc))]),
        ]
    ).tocsr()
    lower = np.r_[np.ones(n), np.full(m, -np.inf), k]
    upper = np.r_[np.ones(n), np.zeros(nc), np.full(m - nc, cap), k]
    res = optimize.milp(
        np.r_[problem.cost.ravel() / scale, np.zeros(nc)],
        constraints=optimize.LinearConstraint(A, lower, upper),
        integrality=np.r_[np.zeros(n * m), np.ones(nc)],
        bounds=optimize.Bounds(0, np.r_[np.full(n * m, np.inf), np.ones(nc)]),
        options={"mip_rel_gap": opts["mip_gap"]},
    )
    if res.status != 0:
        raise RuntimeError(f"HiGHS MILP did not solve to optimality: {res.message}")
    return [int(j) for j in np.flatnonzero(res.x[n * m :] > 0.5)]


def _select_baseline(k, method, X_dev, X_cand, opts):
    if method == "entropy":  # uncertainty sampling: the k highest scores, ties to the lowest index
        return [int(j) for j in np.argsort(-opts["scores"], kind="stable")[:k]]
    if method == "random":
        return [int(j) for j in np.random.default_rng(opts["seed"]).choice(len(X_cand), k, replace=False)]
    if method == "kcenter":
        import ot

        # Greedy k-center from the dev set: repeatedly take the candidate farthest from all centers.
        dist = ot.dist(X_cand, X_dev).min(axis=1)
        selected = []
        for _ in range(k):
            dist[selected] = -np.inf
            j = int(np.argmax(dist))
            selected.append(j)
            dist = np.minimum(dist, ot.dist(X_cand, X_cand[j : j + 1])[:, 0])
        return selected
    # lof: novelty scores of a LocalOutlierFactor fit on dev; most anomalous first.
    from sklearn.neighbors import LocalOutlierFactor

    lof = LocalOutlierFactor(n_neighbors=min(20, len(X_dev) - 1), novelty=True).fit(X_dev)
    order = np.argsort(lof.score_samples(X_cand), kind="stable")
    return [int(j) for j in order[:k]]


def _as_points(name, X, n_features=None):
    try:
        X = np.asarray(X, dtype=np.float64)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{name} must be a numeric array (n_points, n_features): {err}") from None
    if X.ndim != 2:
        raise ValueError(f"{name} must be a 2-D array (n_points, n_features), got shape {X.shape}")
    if X.shape[0] == 0 or X.shape[1] == 0:
        raise ValueError(f"{name} is empty (shape {X.shape}); need at least one point and feature")
    if n_features is not None and X.shape[1] != n_features:
        raise ValueError(
            f"{name} has {X.shape[1]} features but X_app has {n_features}; feature dims must match"
        )
    if not np.isfinite(X).all():
        raise ValueError(f"{name} contains {int((~np.isfinite(X)).sum())} NaN or inf values")
    return X


def cover(
    X_app,
    X_dev,
    k,
    method="ctrans",
    candidates=None,
    *,
    batch=1,
    eta=1e-6,
    reg=0.01,
    reg_relative=False,
    max_iter=50_000,
    tol=1e-6,
    mip_gap=1e-6,
    seed=None,
    scores=None,
):
    """Select k candidates that fill the gaps of ``X_dev`` with respect to ``X_app`` (Eq. 2).

    Parameters
    ----------
    X_app : (N_app, d) application points; X_dev : (N_dev, d) development points.
    k : number of picks, 0 <= k <= N_cand.
    method : one of
        ``greedy``      exact greedy, one reduced LP per unselected candidate per step (Alg. 2);
        ``sensitivity`` one full LP per step, unselected candidates with mass eta / N_dev, add
                        argmin g_j (Alg. 1);
        ``ctrans``      one reduced LP per step, add argmin of the C-transform g_j (Alg. 3);
        ``entropic``    log-domain Sinkhorn on the full problem, add argmin dPW_eps/db_j = g_j;
        ``milp``        exact optimum by HiGHS (small problems only);
        ``random``, ``kcenter`` (greedy k-center from the dev set), ``lof`` (LocalOutlierFactor
                        novelty score fit on dev, most anomalous first), ``entropy`` (the k highest
                        ``scores``, e.g. a classifier's predictive entropy: uncertainty sampling): baselines.
    candidates : (N_cand, d) points to pick from; default X_app (then index j is X_app[j]).
    batch : picks per LP for greedy/sensitivity/ctrans/entropic (top-``batch`` scores). Values
        above 1 are an extension beyond the paper and may pick near-duplicates.
    eta : relative mass of unselected candidates for ``sensitivity`` and ``entropic``.
    reg : entropic eps in cost units (the paper: 0.01), or with ``reg_relative`` as a fraction of
        PW({}), the size of the costs that matter (scale-free).
    max_iter, tol : entropic sweep limit (the paper: 50,000) and L1 row-marginal tolerance; a run that
        stops at max_iter warns and uses the potentials it has, as the paper's capped runs.
    mip_gap : HiGHS relative MIP gap for ``milp``.
    seed : seed of ``random``.
    scores : (N_cand,) finite scores of ``entropy`` (required there, unused otherwise).

    Returns
    -------
    CoverResult with ``indices`` (k,), ``pw`` (k + 1,) and ``n_lp``.

    Examples
    --------
    The application set has a far cluster (indices 20..24) that the development set lacks:

    >>> rng = np.random.default_rng(0)
    >>> X_app = np.vstack([rng.normal(size=(20, 2)), rng.normal(5.0, 0.1, size=(5, 2))])
    >>> result = cover(X_app, rng.normal(size=(20, 2)), k=3, method="ctrans")
    >>> bool((result.indices >= 20).all()), bool(result.pw[-1] < result.pw[0])
    (True, True)
    """
    if method not in PW_METHODS + BASELINES:
        raise ValueError(f"method={method!r}: must be one of {', '.join(PW_METHODS + BASELINES)}")
    X_app = _as_points("X_app", X_app)
    X_dev = _as_points("X_dev", X_dev, X_app.shape[1])
    X_cand = X_app if candidates is None else _as_points("candidates", candidates, X_app.shape[1])
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 0 <= k <= len(X_cand):
        raise ValueError(f"k={k!r}: must be an integer in [0, {len(X_cand)}] (the number of candidates)")
    if isinstance(batch, bool) or not isinstance(batch, (int, np.integer)) or batch < 1:
        raise ValueError(f"batch={batch!r}: must be an integer >= 1")
    if batch > 1 and method not in BATCHED:
        raise ValueError(f"batch={batch} applies to {', '.join(BATCHED)} only, not {method!r}")
    if method == "entropy":
        scores = np.asarray(scores if scores is not None else [], dtype=np.float64)
        if scores.shape != (len(X_cand),) or not np.isfinite(scores).all():
            raise ValueError(
                f"method='entropy' needs finite scores of shape ({len(X_cand)},), got {scores.shape}"
            )
    if method == "lof" and len(X_dev) < 2:
        raise ValueError(f"method='lof' needs at least 2 dev points, got {len(X_dev)}")
    if not 0 < eta <= 1:
        raise ValueError(f"eta={eta}: must be in (0, 1]")
    if not (reg > 0 and tol > 0 and max_iter >= 1 and mip_gap >= 0):
        raise ValueError(
            f"need reg > 0, tol > 0, max_iter >= 1, mip_gap >= 0; got reg={reg}, tol={tol}, "
            f"max_iter={max_iter}, mip_gap={mip_gap}"
        )
    problem = _Covering(X_app, X_dev, X_cand)
    opts = {"batch": int(batch), "eta": eta, "reg": reg, "reg_relative": reg_relative, "max_iter": max_iter}
    opts.update(tol=tol, mip_gap=mip_gap, seed=seed, scores=scores)
    if method in BATCHED:
        selected = _select_sequential(problem, int(k), method, opts)
    elif method == "milp":
        selected = _select_milp(problem, int(k), opts)
    else:
        selected = _select_baseline(int(k), method, X_dev, X_cand, opts)
    pw = np.array([problem.pw(selected[:t]) for t in range(k + 1)])
    return CoverResult(indices=np.asarray(selected, dtype=np.int64), pw=pw, n_lp=problem.n_lp)
