r"""CSOT: curriculum and structure-aware optimal transport for learning with noisy labels.

Chang, Shi and Wang, "CSOT: Curriculum and Structure-Aware Optimal Transport for Learning with
Noisy Labels", NeurIPS 2023 (arXiv 2312.06221).

A chunk of ``B`` training samples with softmax outputs ``P`` (B, C), L2-normalised features
``f_i`` and given (possibly noisy) labels ``y`` is allocated to the ``C`` classes by solving

.. math::
    \min_Q \; \langle \hat C, Q\rangle + \kappa_P \Omega^P(Q) + \kappa_L \Omega^L(Q)
            + \varepsilon \sum_{ik} Q_{ik}\log Q_{ik}
    \quad\text{s.t.}\quad Q \ge 0,\; Q\mathbf 1_C \le \mathbf 1_B/B,\;
    Q^\top \mathbf 1_B = (m/C)\,\mathbf 1_C

with cost :math:`\hat C = -\log P` and the local-coherence (structure) terms

.. math::
    \Omega^W(Q) = -\sum_{ij} S_{ij} \sum_k W_{ik}W_{jk}Q_{ik}Q_{jk},
    \qquad S_{ij} = f_i^\top f_j,\; S_{ii} = 0,\qquad W \in \{P, L\}

(``L`` the one-hot given labels). The row caps let only the fraction ``m`` of the mass move
(the curriculum budget); the equal columns impose class balance. The plan gives pseudo-labels
(row argmax), confidences ``clip(B max_k Q_ik, 0, 1)`` and the ``floor(mB)`` selected rows.

Solvers (all take numpy arrays or torch tensors, CPU or CUDA, through POT's backend, and compute in
float64 where the input lives; the names follow :mod:`runner.methods._common`: ``reg`` is the paper's
entropic weight epsilon):

- :func:`curriculum_ot`: the entropic curriculum OT (the linear problem, paper Alg. 1), a capped
  Sinkhorn scaling iteration, stabilised in the log domain and Anderson-accelerated.
- :func:`csot_plan`: generalized conditional gradient on the full objective (paper Alg. 2).
- :func:`select`, :func:`allocate` (a whole epoch in random chunks), :func:`curriculum_budget`.

The similarity matrix is never formed: with ``F`` the (B, D) normalised features,
``S = F F^T - diag(|f_i|^2)``, so ``S X = F (F^T X) - diag(|f_i|^2) X`` costs ``2BDC`` instead
of ``B^2 C`` plus the ``B^2 D`` of building ``S``; the label term only needs the within-class
blocks of ``S`` (``B^2 / C`` entries, built once). The structure terms are quadratic, so one sketch
``F^T (W * Q)`` of each conditional-gradient target serves the objective along the whole
line search; with the gradient's ``F (F^T X)`` that is two ``B x D x C`` products per step.
"""

from __future__ import annotations

import math

import numpy as np
from ot.backend import get_backend

from runner.methods._common import convergence_log, renamed_kwargs

__all__ = [
    "allocate",
    "coherence_energy",
    "csot_plan",
    "curriculum_budget",
    "curriculum_ot",
    "select",
]

_TINY = 1e-300  # floor inside logs: -log(1e-300) ~ 690 stays finite in float64
_ABSORB = 50.0  # re-centre the kernel when a scaling leaves [e^-50, e^50]


# ----------------------------------------------------------------------------- input checks


def _float64(x, name):
    """numpy array or torch tensor -> float64 of the same kind, finite."""
    if isinstance(x, (list, tuple, float, int)):
        x = np.asarray(x, dtype=np.float64)
    if isinstance(x, np.ndarray):
        x = x.astype(np.float64, copy=False)
    else:  # torch
        x = x.double()
    if not _all_finite(get_backend(x), x):
        raise ValueError(f"{name} contains NaN or Inf")
    return x


def _all_finite(nx, x):
    return not bool(nx.any(~nx.isfinite(x)))


def _check_shape(x, shape, name):
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(x.shape)}, expected {tuple(shape)}")


def _check_budget(m):
    if not (isinstance(m, (int, float, np.floating, np.integer)) and 0 < m <= 1):
        raise ValueError(f"m={m}: the curriculum budget must lie in (0, 1]")
    return float(m)


def _check_positive(value, name):
    if not value > 0:
        raise ValueError(f"{name}={value}: must be > 0")


def _check_iters(value, name):
    if not (isinstance(value, (int, np.integer)) and value >= 1):
        raise ValueError(f"{name}={value}: must be an integer >= 1")


# ----------------------------------------------------------------------------- curriculum OT


@renamed_kwargs(eps="reg", n_iter="max_iter")
def curriculum_ot(cost, row_cap, col_mass, reg, max_iter=100, tol=1e-9, anderson=5, g_init=None, log=False):
    r"""Entropic curriculum optimal transport (CSOT paper, Eq. 4 and Alg. 1).

    .. math::
        Q = \arg\min_Q \langle G, Q\rangle + \varepsilon \sum_{ik} Q_{ik}\log Q_{ik}
        \quad(\varepsilon = \mathrm{reg})
        \quad\text{s.t.}\quad Q\ge 0,\; Q\mathbf 1 \le a,\; Q^\top \mathbf 1 = b

    The solution is :math:`Q_{ik} = \exp((f_i + g_k - G_{ik})/\varepsilon)` with dual potentials
    given by the capped Sinkhorn (scaling) iteration, in the log domain

    .. math::
        f_i \leftarrow \min\big(\varepsilon\log a_i - \varepsilon\,\mathrm{LSE}_k((g_k - G_{ik})/\varepsilon),
        \,0\big),\qquad
        g_k \leftarrow \varepsilon\log b_k - \varepsilon\,\mathrm{LSE}_i((f_i - G_{ik})/\varepsilon).

    Without the cap (``min(., 0)``) this is Sinkhorn; the cap is what the collapsed Dykstra
    projections onto ``{Q1 <= a}`` leave (paper Lemma 1). It is the problem that
    ``ot.partial.entropic_partial_wasserstein(a, b, G, reg, m=sum(b))`` solves, and for
    ``sum(b) == sum(a)`` the one of ``ot.sinkhorn(a, b, G, reg)``.

    Implementation: the kernel is kept centred on the current potentials,
    ``K = exp((f0 + g0 - G)/eps)``, and the iteration runs on matrix-vector products
    ``u = min(a / K v, exp(-f0/eps))``, ``v = b / K^T u``; the kernel is re-centred when a
    scaling leaves ``[e^-50, e^50]``, and an exact log-domain step replaces a product that
    under/overflows, which keeps it exact down to ``eps ~ 1e-3``. When ``sum(b) = sum(a)`` the
    rows are tight at the optimum and the potentials have a free shift, so the cap is dropped
    (plain Sinkhorn: same solution, much faster). The column potential ``g`` (C numbers) is the
    fixed point that Anderson acceleration extrapolates (``anderson`` past steps; a step that
    lowers the dual objective is rejected, see :class:`_Anderson`); ``anderson=0`` gives the
    plain iterates of the paper (equal to its vanilla Dykstra iterates when ``sum(b) < sum(a)``).

    Every iterate ends on the column step, so the columns are exact. The stopping test
    ``err = exp(max_k |log v_k - log v_k^prev|) - 1`` bounds the row (KKT) residual of the
    returned plan: ``|Q1_i / a_i - 1| <= err`` for rows below their potential cap (which must
    be tight) and ``Q1_i / a_i - 1 <= err`` for capped rows.

    Parameters
    ----------
    cost : array (B, C)
        Linear cost ``G``.
    row_cap : array (B,)
        Row capacities ``a > 0``.
    col_mass : array (C,)
        Column masses ``b > 0`` with ``sum(b) <= sum(a)`` (the transported mass).
    reg : float
        Entropic regularisation (the paper's epsilon), > 0. ``eps=`` is a deprecated alias.
    max_iter : int
        Maximum number of (row, column) scaling steps (``n_iter=`` is a deprecated alias).
    tol : float
        Stop when ``err <= tol`` (relative row error; 0 runs all ``max_iter`` steps). A
        ``UserWarning`` says when ``max_iter`` is reached first.
    anderson : int
        Anderson memory (0 = plain scaling iteration).
    g_init : array (C,), optional
        Warm start for the column potential (e.g. ``log["g"]`` of a nearby problem).
    log : bool
        Also return a dict: ``n_iter``, ``err`` (bound above), ``converged``, ``f`` (B,), ``g`` (C,)
        potentials, ``row_violation`` (max of ``Q1/a - 1``), ``col_error`` (max ``|Q^T 1 - b|``).

    Returns
    -------
    Q : array (B, C), float64 (a tensor on the cost's device for tensor input)

    Example: with full mass (``sum(b) = sum(a)``) it is Sinkhorn.

    >>> cost = np.array([[0.0, 1.0], [1.0, 0.0]])
    >>> plan = curriculum_ot(cost, [0.5, 0.5], [0.5, 0.5], reg=1.0)
    >>> import ot
    >>> np.allclose(plan, ot.sinkhorn(np.full(2, 0.5), np.full(2, 0.5), cost, 1.0))
    True
    """
    cost = _float64(cost, "cost")
    if cost.ndim != 2:
        raise ValueError(f"cost must be 2-D (B, C), got shape {tuple(cost.shape)}")
    n_rows, n_cols = cost.shape
    row_cap = _float64(row_cap, "row_cap")
    col_mass = _float64(col_mass, "col_mass")
    _check_shape(row_cap, (n_rows,), "row_cap")
    _check_shape(col_mass, (n_cols,), "col_mass")
    nx = get_backend(cost, row_cap, col_mass)
    if not (bool(nx.min(row_cap) > 0) and bool(nx.min(col_mass) > 0)):
        raise ValueError("row_cap and col_mass must be > 0")
    if float(nx.sum(col_mass)) > float(nx.sum(row_cap)) * (1 + 1e-12):
        raise ValueError(
            f"infeasible: sum(col_mass)={float(nx.sum(col_mass))} exceeds sum(row_cap)="
            f"{float(nx.sum(row_cap))}"
        )
    _check_positive(reg, "reg")
    _check_iters(max_iter, "max_iter")
    if not (isinstance(anderson, (int, np.integer)) and anderson >= 0):
        raise ValueError(f"anderson={anderson}: must be an integer >= 0")

    plan, info = _curriculum_ot(nx, cost, row_cap, col_mass, reg, max_iter, tol, anderson, g_init)
    info = convergence_log("curriculum_ot", tol=tol, **info)
    if not log:
        return plan
    info["row_violation"] = float(nx.max(nx.sum(plan, axis=1) / row_cap)) - 1.0
    info["col_error"] = float(nx.max(nx.abs(nx.sum(plan, axis=0) - col_mass)))
    return plan, info


def _curriculum_ot(nx, cost, row_cap, col_mass, eps, n_iter, tol, anderson, g_init):
    """:func:`curriculum_ot` on validated float64 inputs (eps = reg); returns
    (plan, {n_iter, err, converged, f, g}) and never warns (inner solves of :func:`csot_plan` stop early
    by design)."""
    n_rows, n_cols = cost.shape
    log_a, log_b = nx.log(row_cap), nx.log(col_mass)
    # with sum(b) = sum(a) the rows are tight at the optimum and the potentials have a free
    # shift, so the cap f <= 0 only slows the iteration: drop it (plain Sinkhorn)
    f_max = math.inf if float(nx.sum(col_mass)) >= float(nx.sum(row_cap)) * (1 - 1e-12) else 0.0
    neg_cost = -cost / eps

    def centre(g):
        """Exact row step f(g) and the kernel exp((f + g - G)/eps) (one exp pass), its row cap."""
        z = neg_cost + g[None, :] / eps
        shift = nx.max(z, axis=1)
        kernel = nx.exp(z - shift[:, None])
        f = nx.minimum(eps * (log_a - nx.log(nx.sum(kernel, axis=1)) - shift), f_max)
        return f, kernel * nx.exp(f / eps + shift)[:, None], nx.exp((f_max - f) / eps)

    def col_potential(f):  # exact log-domain column step
        return eps * (log_b - nx.logsumexp(f[:, None] / eps + neg_cost, axis=0))

    # iterate on lv = log v = (g - g0)/eps against the kernel centred on (f0, g0)
    g0 = nx.zeros(n_cols, type_as=cost) if g_init is None else _float64(g_init, "g_init")
    f0, kernel, u_cap = centre(g0)
    lv = nx.zeros(n_cols, type_as=cost)
    mixer = _Anderson(nx, anderson, n_cols, cost)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        for it in range(1, n_iter + 1):
            kv = nx.dot(kernel, nx.exp(lv))
            u = nx.minimum(row_cap / kv, u_cap)
            lv_new = log_b - nx.log(nx.dot(u, kernel))
            if not math.isfinite(float(nx.max(nx.abs(lv_new)))):  # under/overflow: exact step
                g0 = g0 + eps * mixer.last_good(lv)
                f0, kernel, u_cap = centre(g0)
                u = kv = nx.ones(n_rows, type_as=cost)
                lv = nx.zeros(n_cols, type_as=cost)
                lv_new = (col_potential(f0) - g0) / eps
            # the plan u K v_new has exact columns; v_new / v lies in [e^-delta, e^delta], so its
            # rows are within a factor e^delta of a (tight rows) or below a e^delta (capped rows)
            residual = lv_new - lv
            err = math.expm1(min(float(nx.max(nx.abs(residual))), 700.0))
            if err <= tol or it == n_iter:
                break
            if anderson:  # merit: the dual objective at g = g0 + eps lv, f = f0 + eps log u
                dual = nx.sum(row_cap * (f0 + eps * nx.log(u))) + nx.sum(col_mass * (g0 + eps * lv))
                lv = mixer.step(lv, residual, float(eps * nx.sum(u * kv) - dual))
            else:
                lv = lv_new
            if float(nx.max(nx.abs(lv))) > _ABSORB:  # re-centre on the last (u, v_new)
                g0 = g0 + eps * lv_new
                f0, kernel, u_cap = centre(g0)
                lv = lv - lv_new
                mixer.shift(lv_new)
    plan = u[:, None] * kernel * nx.exp(lv_new)[None, :]
    info = {
        "n_iter": it,
        "err": err,
        "converged": err <= tol,
        "f": f0 + eps * nx.log(u),
        "g": g0 + eps * lv_new,
    }
    return plan, info


class _Anderson:
    """Type-II Anderson mixing for a fixed point ``x = x + r(x)`` with ``memory`` past steps.

    ``step`` takes a merit (lower is better). An extrapolated point with a worse merit than the
    point it came from is rejected: the iteration returns to the plain step from that point,
    the memory restarts and the next extrapolation waits ``patience`` plain steps (the map is
    only piecewise smooth: rows enter and leave their caps); ``patience`` doubles on each
    rejection and halves on each accepted extrapolation. ``memory=0``: plain iteration."""

    def __init__(self, nx, memory, dim, like):
        self.nx, self.memory, self.patience = nx, memory, 1
        # rows j < count hold x_{j+1} - x_j and r_{j+1} - r_j, in ring order (order is irrelevant)
        self.dx = nx.zeros((max(memory, 1), dim), type_as=like)
        self.dr = nx.zeros((max(memory, 1), dim), type_as=like)
        self.reset()

    def reset(self):
        self.count, self.pos, self.prev, self.extrapolated, self.wait = 0, 0, None, False, 0

    def last_good(self, x):
        """The last accepted point (x if none), with a memory restart: after a failed evaluation."""
        good = self.prev[0] if self.extrapolated else x
        self.reset()
        return good

    def shift(self, delta):  # the origin of x moved by delta (differences are unchanged)
        if self.prev is not None:
            self.prev = (self.prev[0] - delta, self.prev[1], self.prev[2])

    def step(self, x, residual, merit):
        if self.extrapolated and merit > self.prev[2] + 1e-13 * abs(self.prev[2]):
            x_prev, r_prev, _ = self.prev
            self.reset()
            self.wait, self.patience = self.patience, 2 * self.patience
            return x_prev + r_prev
        if self.extrapolated:  # accepted: trust extrapolation again
            self.patience = max(1, self.patience // 2)
        if self.prev is not None:
            self.dx[self.pos] = x - self.prev[0]
            self.dr[self.pos] = residual - self.prev[1]
            self.pos = (self.pos + 1) % self.memory
            self.count = min(self.count + 1, self.memory)
        self.prev = (x, residual, merit)
        self.extrapolated = self.count > 0 and self.wait == 0
        if not self.extrapolated:
            self.wait = max(self.wait - 1, 0)
            return x + residual
        nx, d_x, d_r = self.nx, self.dx[: self.count], self.dr[: self.count]
        gram = nx.dot(d_r, d_r.T)
        gram = gram + (1e-10 * float(nx.max(nx.abs(gram))) + _TINY) * nx.eye(self.count, type_as=gram)
        gamma = nx.solve(gram, nx.dot(d_r, residual))
        return x + residual - nx.dot(gamma, d_x + d_r)


# ----------------------------------------------------------------------------- structure terms


class _Coherence:
    r"""The structure terms :math:`\kappa_P\Omega^P + \kappa_L\Omega^L` of one chunk.

    Each term is a quadratic form :math:`-\langle S X, X\rangle` in a linear function ``X`` of
    ``Q``, read off a linear sketch so that values along a segment need no new products:

    - prediction term: ``X = W * Q`` (B, C), sketch ``F^T X`` (D, C) with ``F`` the normalised
      features, :math:`-\langle SX, Y\rangle = -\langle F^\top X, F^\top Y\rangle + \sum_i n_i
      \langle X_i, Y_i\rangle` (``n_i = |f_i|^2``, the removed diagonal of ``S``);
    - label term: ``X = q``, ``q_i = Q[i, y_i]`` (B,), sketch ``S_L q`` with the within-class
      similarity ``S_L = S * [y_i = y_j]`` built once (sparse, ``B^2 / C`` entries on numpy).
    """

    def __init__(self, features, weights, labels, kappa_p, kappa_l):
        nx = get_backend(features)
        norms = nx.sqrt(nx.einsum("ij,ij->i", features, features))
        self.nx, self.weights, self.labels = nx, weights, labels
        self.kappa_p, self.kappa_l = kappa_p, kappa_l
        self.feats = features / nx.maximum(norms, _TINY)[:, None]
        self.sq_norms = nx.einsum("ij,ij->i", self.feats, self.feats)
        self.rows = _arange_like(labels)
        self.label_sim = _label_similarity(self.feats, labels) if kappa_l else None

    def parts(self, plan):
        """Linear parts [(kappa, X, sketch of X)] of the active terms."""
        out = []
        if self.kappa_p:
            x = self.weights * plan
            out.append((self.kappa_p, x, self.nx.dot(self.feats.T, x)))
        if self.kappa_l:
            q = plan[self.rows, self.labels]
            out.append((self.kappa_l, q, self.label_sim @ q))
        return out

    def energy(self, parts):
        return sum(kappa * self._form(x, sk, x, sk) for kappa, x, sk in parts)

    def energy_along(self, parts, dparts):
        """Coefficients (c0, c1, c2) of the energy at ``Q + t dQ`` = c0 + c1 t + c2 t^2."""
        c = [0.0, 0.0, 0.0]
        for (kappa, x, sk), (_, dx, dsk) in zip(parts, dparts):
            c[0] += kappa * self._form(x, sk, x, sk)
            c[1] += 2 * kappa * self._form(x, sk, dx, dsk)
            c[2] += kappa * self._form(dx, dsk, dx, dsk)
        return c

    def gradient(self, plan, parts):
        """-2 kappa W * (S X) for the prediction term, -2 kappa (S_L q)_i at (i, y_i) for labels."""
        nx = self.nx
        grad = nx.zeros(plan.shape, type_as=plan)
        for kappa, x, sk in parts:
            if x.ndim == 2:
                grad = grad - 2 * kappa * self.weights * (nx.dot(self.feats, sk) - self.sq_norms[:, None] * x)
            else:
                grad[self.rows, self.labels] = grad[self.rows, self.labels] - 2 * kappa * sk
        return grad

    def _form(self, x, sk, y, sk_y):
        """Bilinear form -<S x, y> from the sketches."""
        nx = self.nx
        if x.ndim == 1:
            return -float(nx.sum(sk * y))
        return float(nx.sum(self.sq_norms[:, None] * x * y) - nx.sum(sk * sk_y))


def _arange_like(labels):
    if isinstance(labels, np.ndarray):
        return np.arange(len(labels))
    import torch

    return torch.arange(len(labels), device=labels.device)


def _label_similarity(unit, labels):
    """``S_ij [y_i = y_j]`` with zero diagonal: scipy CSR from per-class blocks (numpy), dense (torch)."""
    n = unit.shape[0]
    if isinstance(unit, np.ndarray):
        from scipy.sparse import csr_matrix

        order = np.argsort(labels, kind="stable")
        bounds = np.flatnonzero(np.diff(labels[order], prepend=-1, append=-1))
        rows, cols, vals = [], [], []
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            idx = order[lo:hi]
            block = unit[idx] @ unit[idx].T
            np.fill_diagonal(block, 0.0)
            rows.append(np.repeat(idx, len(idx)))
            cols.append(np.tile(idx, len(idx)))
            vals.append(block.ravel())
        return csr_matrix((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))), shape=(n, n))
    sim = (unit @ unit.T) * (labels[:, None] == labels[None, :])
    return sim.fill_diagonal_(0.0)


def coherence_energy(plan, features, probs, labels, kappa_p=1.0, kappa_l=1.0, omega_p_input="softmax"):
    r"""Structure energy :math:`\kappa_P\Omega^P(Q) + \kappa_L\Omega^L(Q)` and its gradient.

    :math:`\Omega^W(Q) = -\sum_{ij} S_{ij}\sum_k W_{ik}W_{jk}Q_{ik}Q_{jk}`,
    :math:`\nabla\Omega^W = -2\,(S(W\odot Q))\odot W`, with ``S`` the cosine similarity of
    ``features`` (B, D) with zero diagonal, ``W = probs`` (or ``log(probs)`` for
    ``omega_p_input="log_softmax"``, the authors' code) and ``W = onehot(labels)``.

    Returns (value: float, gradient: array (B, C)).
    """
    plan, probs, features, labels = _check_chunk(plan, features, labels, probs_name="plan", probs=probs)
    weights = _omega_p_weights(probs, omega_p_input)
    terms = _Coherence(features, weights, labels, kappa_p, kappa_l)
    parts = terms.parts(plan)
    return terms.energy(parts), terms.gradient(plan, parts)


def _omega_p_weights(probs, omega_p_input):
    if omega_p_input == "softmax":
        return probs
    if omega_p_input == "log_softmax":
        nx = get_backend(probs)
        return nx.log(nx.maximum(probs, _TINY))
    raise ValueError(f"omega_p_input={omega_p_input!r}: must be 'softmax' or 'log_softmax'")


def _check_chunk(plan_or_probs, features, labels, probs_name="probs", probs=None):
    """Validate a chunk: (B, C) matrix, (B, D) features, (B,) labels in [0, C), optional probs."""
    x = _float64(plan_or_probs, probs_name)
    if x.ndim != 2:
        raise ValueError(f"{probs_name} must be 2-D (B, C), got shape {tuple(x.shape)}")
    n_rows, n_cols = x.shape
    if probs is not None:
        probs = _float64(probs, "probs")
        _check_shape(probs, (n_rows, n_cols), "probs")
    if features is not None:
        features = _float64(features, "features")
        if features.ndim != 2 or features.shape[0] != n_rows:
            raise ValueError(f"features has shape {tuple(features.shape)}, expected ({n_rows}, D)")
    if isinstance(labels, (list, tuple)):
        labels = np.asarray(labels)
    if isinstance(labels, np.ndarray):
        if not np.issubdtype(labels.dtype, np.integer):
            raise ValueError(f"labels must be integers, got dtype {labels.dtype}")
        labels = labels.astype(np.int64, copy=False)
    else:
        if labels.is_floating_point():
            raise ValueError(f"labels must be integers, got dtype {labels.dtype}")
        labels = labels.long()
    _check_shape(labels, (n_rows,), "labels")
    if n_rows and (int(labels.min()) < 0 or int(labels.max()) >= n_cols):
        raise ValueError(f"labels must lie in [0, {n_cols}), got [{int(labels.min())}, {int(labels.max())}]")
    return x, probs, features, labels


# ----------------------------------------------------------------------------- CSOT plan


_PLAN_RENAMES = dict(eps="reg", outer_iters="max_iter", inner_iters="inner_max_iter")


@renamed_kwargs(**_PLAN_RENAMES)
def csot_plan(
    probs,
    features,
    labels,
    m,
    reg=0.1,
    kappa_p=1.0,
    kappa_l=1.0,
    max_iter=10,
    inner_max_iter=100,
    omega_p_input="softmax",
    tol=1e-6,
    inner_tol=1e-6,
    anderson=5,
    log=False,
    warn=True,
):
    r"""CSOT plan of one chunk by generalized conditional gradient (paper Eq. 6 and Alg. 2).

    Minimises :math:`F(Q) = \langle \hat C, Q\rangle + \kappa_P\Omega^P(Q) + \kappa_L\Omega^L(Q)
    + \varepsilon\sum Q\log Q` (:math:`\varepsilon` = ``reg``) over
    :math:`\{Q\ge 0,\ Q\mathbf 1 \le \mathbf 1/B,\ Q^\top\mathbf 1 = (m/C)\mathbf 1\}` with
    :math:`\hat C = -\log P` (module docstring).
    From :math:`Q^0 = a b^\top`, each step linearises the structure terms only,

    .. math::
        \tilde Q = \mathrm{CurriculumOT}(\hat C + \kappa\nabla\Omega(Q^i)),\qquad
        Q^{i+1} = Q^i + \eta(\tilde Q - Q^i),

    with :math:`\eta\in[0,1]` from an Armijo search on ``F`` (c1 = 1e-4, first trial 0.99,
    quadratic then cubic interpolation). The structure part of ``F`` along the segment is an
    exact quadratic in :math:`\eta` (one feature sketch of :math:`\tilde Q` per step), so the
    search only re-evaluates the entropy. Stops when ``err = |F^{i+1} - F^i| / max(1, |F^{i+1}|)``
    is below ``tol`` (converged), after ``max_iter`` steps, or if the inner plan is not finite.
    Each inner solve is warm-started from the previous potentials. With
    ``kappa_p = kappa_l = 0`` this is :func:`curriculum_ot` on :math:`\hat C` (curriculum OT;
    entropic OT when ``m = 1``).

    Parameters
    ----------
    probs : array (B, C)
        Softmax outputs, rows summing to one.
    features : array (B, D) or None
        Sample embeddings (cosine similarity is taken); may be None when both kappas are 0.
    labels : int array (B,)
        Given (noisy) labels in [0, C).
    m : float in (0, 1]
        Curriculum budget: the transported mass.
    reg, kappa_p, kappa_l : float
        Entropy weight (the paper's epsilon, > 0) and structure weights (>= 0).
    max_iter, inner_max_iter : int
        Conditional-gradient steps and scaling steps per inner solve (a maximum: the inner
        solve stops at ``inner_tol``). Deprecated aliases: ``eps``, ``outer_iters``, ``inner_iters``.
    omega_p_input : {"softmax", "log_softmax"}
        ``W`` of :math:`\Omega^P`: the paper's softmax, or the authors' code default.
    tol, inner_tol : float
        Stopping tolerances of the outer objective change and of the inner row residual.
    anderson : int
        Anderson memory of the inner solver (0: the paper's plain iteration).
    log : bool
        Also return a dict: ``n_iter`` (steps taken), ``err``, ``converged``, ``objective`` (F per
        iterate), ``steps`` (eta), ``inner_iters`` (scaling steps per inner solve),
        ``row_violation`` (max ``Q1 B - 1``), ``col_error``.
    warn : bool
        Emit a ``UserWarning`` when ``max_iter`` steps end before convergence (as POT's ``warn``).

    Returns
    -------
    Q : array (B, C), float64 (a tensor on the input's device for tensor input)

    >>> rng = np.random.default_rng(0)
    >>> probs, features = rng.dirichlet(np.ones(3), size=6), rng.standard_normal((6, 4))
    >>> plan = csot_plan(probs, features, rng.integers(3, size=6), m=0.5, max_iter=50)
    >>> np.allclose(plan.sum(0), 0.5 / 3), bool(plan.sum(1).max() <= (1 + 1e-5) / 6)
    (True, True)
    """
    probs, _, features, labels = _check_chunk(probs, features if (kappa_p or kappa_l) else None, labels)
    nx = get_backend(probs)
    if bool(nx.any(probs < 0)) or float(nx.max(nx.abs(nx.sum(probs, axis=1) - 1))) > 1e-5:
        raise ValueError("probs must be non-negative with rows summing to one (softmax outputs)")
    m = _check_budget(m)
    _check_positive(reg, "reg")
    for name, kappa in (("kappa_p", kappa_p), ("kappa_l", kappa_l)):
        if not kappa >= 0:
            raise ValueError(f"{name}={kappa}: must be >= 0")
    _check_iters(max_iter, "max_iter")
    _check_iters(inner_max_iter, "inner_max_iter")
    if (kappa_p or kappa_l) and features is None:
        raise ValueError("features are required when kappa_p or kappa_l > 0")

    n_rows, n_cols = probs.shape
    cost = -nx.log(nx.maximum(probs, _TINY))
    row_cap = nx.full((n_rows,), 1.0 / n_rows, type_as=probs)
    col_mass = nx.full((n_cols,), m / n_cols, type_as=probs)

    def inner(lin_cost, g_init=None):  # inputs already checked
        return _curriculum_ot(
            nx, lin_cost, row_cap, col_mass, reg, inner_max_iter, inner_tol, anderson, g_init
        )

    def report(plan, history, steps, inner_counts, err, converged):
        info = convergence_log("csot_plan", len(steps), err, tol, converged=converged, warn=warn)
        return plan, info | {
            "objective": history,
            "steps": steps,
            "inner_iters": inner_counts,
            "row_violation": float(nx.max(nx.sum(plan, axis=1))) * n_rows - 1.0,
            "col_error": float(nx.max(nx.abs(nx.sum(plan, axis=0) - col_mass))),
        }

    if not (kappa_p or kappa_l):  # one inner solve: its convergence is the plan's
        plan, info = inner(cost)
        if not (log or warn):
            return plan
        objective = [float(nx.sum(cost * plan)) + reg * _neg_entropy(nx, plan)]
        out = report(plan, objective, [], [info["n_iter"]], info["err"], info["converged"])
        return out if log else plan

    terms = _Coherence(features, _omega_p_weights(probs, omega_p_input), labels, kappa_p, kappa_l)
    plan = row_cap[:, None] * col_mass[None, :]
    parts = terms.parts(plan)
    lin_value = float(nx.sum(cost * plan))
    objective = lin_value + terms.energy(parts) + reg * _neg_entropy(nx, plan)
    history, steps, inner_counts, g, err, converged = [objective], [], [], None, math.inf, False
    for _ in range(max_iter):
        lin_cost = cost + terms.gradient(plan, parts)
        target, info = inner(lin_cost, g)
        if not _all_finite(nx, target):
            break
        g = info["g"]
        inner_counts.append(info["n_iter"])
        direction = target - plan
        new_parts = terms.parts(target)
        dparts = [(k, x1 - x0, s1 - s0) for (k, x0, s0), (_, x1, s1) in zip(parts, new_parts)]
        c0, c1, c2 = terms.energy_along(parts, dparts)
        lin_slope = float(nx.sum(cost * direction))
        c0, c1 = c0 + lin_value, c1 + lin_slope
        slope = float(nx.sum(direction * (lin_cost + reg * (1 + nx.log(nx.maximum(plan, _TINY))))))

        def along(t, plan=plan, direction=direction, c0=c0, c1=c1, c2=c2):
            return c0 + c1 * t + c2 * t * t + reg * _neg_entropy(nx, plan + t * direction)

        step, new_objective = _armijo(along, objective, slope)
        steps.append(step)
        if step > 0:
            plan = plan + step * direction
            parts = [(k, x0 + step * dx, s0 + step * ds) for (k, x0, s0), (_, dx, ds) in zip(parts, dparts)]
            lin_value += step * lin_slope
        err = abs(new_objective - objective) / max(1.0, abs(new_objective))
        objective = new_objective
        history.append(objective)
        converged = err < tol
        if converged:
            break
    if not (log or warn):
        return plan
    out = report(plan, history, steps, inner_counts, err, converged)
    return out if log else plan


def _neg_entropy(nx, plan):
    """sum Q log Q (0 log 0 = 0)."""
    return float(nx.sum(plan * nx.log(nx.maximum(plan, _TINY))))


def _armijo(phi, phi0, slope, c1=1e-4, first=0.99, max_evals=30):
    """Armijo backtracking on [0, 1]: first trial ``first``, then the minimiser of the quadratic
    and afterwards cubic interpolant of phi, safeguarded to [0.1, 0.5] of the last trial
    (Nocedal & Wright, Sec. 3.5). Returns (step, phi(step)), or (0, phi0) if no step is found
    or ``slope >= 0`` (not a descent direction)."""
    if not slope < 0:
        return 0.0, phi0
    t_prev, phi_prev = None, None
    t, value = first, phi(first)
    for _ in range(max_evals):
        if value <= phi0 + c1 * t * slope:
            return t, value
        if t_prev is None:  # quadratic through phi0, slope, phi(t)
            t_new = -slope * t * t / (2 * (value - phi0 - slope * t))
        else:  # cubic through phi0, slope, phi(t_prev), phi(t)
            r1, r0 = value - phi0 - slope * t, phi_prev - phi0 - slope * t_prev
            denom = t * t * t_prev * t_prev * (t - t_prev)
            a = (t_prev * t_prev * r1 - t * t * r0) / denom
            b = (-(t_prev**3) * r1 + t**3 * r0) / denom
            disc = b * b - 3 * a * slope
            t_new = (-b + math.sqrt(disc)) / (3 * a) if a != 0 and disc >= 0 else t / 2
        t_new = min(max(t_new, 0.1 * t), 0.5 * t) if math.isfinite(t_new) else t / 2
        t_prev, phi_prev = t, value
        t, value = t_new, phi(t_new)
    return 0.0, phi0


# ----------------------------------------------------------------------------- selection


def select(plan, m):
    r"""Pseudo-labels, confidences and the curriculum selection of one chunk's plan (B, C).

    ``pseudo_labels = argmax_k Q_ik``; ``confidence = clip(B max_k Q_ik, 0, 1)`` (the authors'
    code; the paper's ``Q_iy / (m/C)`` ranks the same); ``selected`` marks the ``floor(m B)``
    most confident rows (ties broken by index).

    Returns (pseudo_labels int64 (B,), confidence float64 (B,), selected bool (B,)).
    """
    plan = _float64(plan, "plan")
    if plan.ndim != 2:
        raise ValueError(f"plan must be 2-D (B, C), got shape {tuple(plan.shape)}")
    m = _check_budget(m)
    nx = get_backend(plan)
    n_rows = plan.shape[0]
    pseudo_labels = nx.argmax(plan, axis=1)
    confidence = nx.clip(nx.max(plan, axis=1) * n_rows, 0.0, 1.0)
    n_selected = math.floor(m * n_rows + 1e-9)
    if isinstance(plan, np.ndarray):
        order = np.argsort(-confidence, kind="stable")
    else:
        order = (-confidence).argsort(stable=True)
    selected = nx.zeros((n_rows,), type_as=plan) > 0
    selected[order[:n_selected]] = True
    return pseudo_labels, confidence, selected


BUDGET_RULES = ("paper", "code")


def curriculum_budget(epoch, warmup, end, m0=0.3, rule="paper"):
    r"""Curriculum budget m of the 0-based training ``epoch`` (warm-up included), ``end`` = T_sup.

    ``rule="paper"`` (Sec. 6.1 and Alg. S3): with the 1-based epoch :math:`t = epoch + 1`,

    .. math:: m = \min\big(1,\; m_0 + (t - 1)/(T_{sup} - 1)\big),

    so m reaches 1 at :math:`t = 1 + (1 - m_0)(T_{sup} - 1)` (epoch 175 of T_sup = 250 at m0 = 0.3)
    and the first selection after ``warmup`` epochs already has :math:`m_0 + warmup/(T_{sup} - 1)`.

    ``rule="code"`` (the authors' code): :math:`m = m_0 + (1 - m_0)(epoch - warmup)/(T_{sup} - warmup)`,
    clipped to [m0, 1]: m0 at the first selection, 1 from epoch ``end`` on.
    """
    if not 0 < m0 <= 1:
        raise ValueError(f"m0={m0}: must lie in (0, 1]")
    if not end > max(warmup, 1):
        raise ValueError(f"end={end} must be > warmup={warmup} and > 1")
    if rule == "paper":
        return min(1.0, m0 + epoch / (end - 1))
    if rule == "code":
        return min(1.0, max(m0, m0 + (1 - m0) * (epoch - warmup) / (end - warmup)))
    raise ValueError(f"rule={rule!r}: must be one of {BUDGET_RULES}")


@renamed_kwargs(**_PLAN_RENAMES)
def allocate(probs, features, labels, m, solve_batch=1024, seed=0, log=False, warn=True, **plan_kwargs):
    """Run :func:`csot_plan` and :func:`select` over a whole training set in random chunks.

    ``probs`` (N, C), ``features`` (N, D), ``labels`` (N,) as in :func:`csot_plan` (numpy arrays, or
    tensors on one device: everything then stays there); the samples are shuffled with ``seed`` and
    cut into chunks of ``solve_batch`` (the last one smaller), each with its own class balance
    ``m / C`` and selection of ``floor(m B_chunk)`` rows. ``plan_kwargs`` go to :func:`csot_plan`
    (``reg``, ``max_iter``, ...; the deprecated ``eps``, ``outer_iters``, ``inner_iters`` too).
    One ``UserWarning`` (``warn``) if some chunk's plan did not converge.

    Returns (pseudo_labels (N,), confidence (N,), selected (N,)) in the original order [, log: a
    dict with ``n_iter`` and ``err`` (the largest over the chunks), ``converged`` (all chunks),
    ``chunks``].

    >>> rng = np.random.default_rng(0)
    >>> probs, labels = rng.dirichlet(np.ones(3), size=10), rng.integers(3, size=10)
    >>> pseudo, confidence, selected = allocate(probs, None, labels, 0.5, solve_batch=5, kappa_p=0, kappa_l=0)
    >>> int(selected.sum())  # floor(0.5 * 5) per chunk
    4
    """
    _check_iters(solve_batch, "solve_batch")
    n = probs.shape[0]
    perm = np.random.default_rng(seed).permutation(n)
    if not isinstance(probs, np.ndarray):
        import torch

        perm = torch.as_tensor(perm, device=probs.device)
    pseudo_labels, confidence, selected, logs = [], [], [], []
    for start in range(0, n, solve_batch):
        idx = perm[start : start + solve_batch]
        chunk_features = None if features is None else features[idx]
        plan, info = csot_plan(
            probs[idx], chunk_features, labels[idx], m, log=True, warn=False, **plan_kwargs
        )
        logs.append(info)
        out = select(plan, m)
        pseudo_labels.append(out[0])
        confidence.append(out[1])
        selected.append(out[2])
    nx = get_backend(out[1])
    inverse = np.argsort(perm) if isinstance(perm, np.ndarray) else perm.argsort()
    result = tuple(nx.concatenate(parts, axis=0)[inverse] for parts in (pseudo_labels, confidence, selected))
    info = convergence_log(
        f"allocate ({sum(not i['converged'] for i in logs)} of {len(logs)} chunks: csot_plan)",
        max(i["n_iter"] for i in logs),
        max(i["err"] for i in logs),
        plan_kwargs.get("tol", 1e-6),
        converged=all(i["converged"] for i in logs),
        warn=warn,
        chunks=len(logs),
    )
    return (*result, info) if log else result
