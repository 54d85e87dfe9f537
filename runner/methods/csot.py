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
- :func:`batched_curriculum_ot`, :func:`batched_csot_plan`: the same iterations for P chunks at once on
  torch tensors (P, B, C), each chunk deciding its steps and its stop on the device, the host reading
  the device once per ``check_every`` inner steps and once per line-search round: what :func:`allocate`
  runs on tensors (a CIFAR-100 epoch of 49 chunks: about 20 reads, against ~800 per chunk one by one).

The similarity matrix is never formed: with ``F`` the (B, D) normalised features,
``S = F F^T - diag(|f_i|^2)``, so ``S X = F (F^T X) - diag(|f_i|^2) X`` costs ``2BDC`` instead
of ``B^2 C`` plus the ``B^2 D`` of building ``S``; the label term only needs the within-class
blocks of ``S`` (``B^2 / C`` entries, built once). The structure terms are quadratic, so one sketch
``F^T (W * Q)`` of each conditional-gradient target serves the objective along the whole
line search; with the gradient's ``F (F^T X)`` that is two ``B x D x C`` products per step.
"""

from __future__ import annotations

import functools
import inspect
import math

import numpy as np
import torch
import torch.nn.functional as F

from runner.methods._common import convergence_log, get_backend

__all__ = [
    "allocate",
    "batched_csot_plan",
    "batched_curriculum_ot",
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
    """m as a float: a real number (a 0-d array or tensor too) in (0, 1]."""
    scalar = getattr(m, "ndim", 0) == 0 and not isinstance(m, (bool, str))
    if not (scalar and 0 < float(m) <= 1):
        raise ValueError(f"m={m!r}: the curriculum budget must be a number in (0, 1]")
    return float(m)


def _check_positive(value, name):
    if not 0 < value < math.inf:
        raise ValueError(f"{name}={value}: must be a finite number > 0")


def _check_memory(anderson):
    if not (isinstance(anderson, (int, np.integer)) and not isinstance(anderson, bool) and anderson >= 0):
        raise ValueError(f"anderson={anderson}: must be an integer >= 0")


def _check_iters(value, name):
    if not (isinstance(value, (int, np.integer)) and value >= 1):
        raise ValueError(f"{name}={value}: must be an integer >= 1")


# ----------------------------------------------------------------------------- curriculum OT


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
        Entropic regularisation (the paper's epsilon), > 0.
    max_iter : int
        Maximum number of (row, column) scaling steps.
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
    _check_memory(anderson)

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
        if isinstance(probs, torch.Tensor):  # a clamp: POT's maximum would copy the floor to the device
            return torch.log(probs.clamp(min=_TINY))
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
        solve stops at ``inner_tol``).
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
    _check_plan_settings(features, reg, kappa_p, kappa_l, max_iter, inner_max_iter, anderson)

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


def _cubic_coefficients(phi0, slope, t, value, t_prev, phi_prev):
    """(a, b) of the cubic phi0 + slope s + b s^2 + a s^3 through (t_prev, phi_prev) and (t, value), the
    interpolation of :func:`_armijo`'s backtracking (Nocedal & Wright, Sec. 3.5); floats or tensors."""
    r1, r0 = value - phi0 - slope * t, phi_prev - phi0 - slope * t_prev
    denom = t * t * t_prev * t_prev * (t - t_prev)
    return (t_prev * t_prev * r1 - t * t * r0) / denom, (-(t_prev**3) * r1 + t**3 * r0) / denom


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
            a, b = _cubic_coefficients(phi0, slope, t, value, t_prev, phi_prev)
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
    if not (math.isfinite(epoch) and epoch >= 0):
        raise ValueError(f"epoch={epoch}: must be a finite number >= 0")
    if not end > max(warmup, 1):
        raise ValueError(f"end={end} must be > warmup={warmup} and > 1")
    if rule == "paper":
        return min(1.0, m0 + epoch / (end - 1))
    if rule == "code":
        return min(1.0, max(m0, m0 + (1 - m0) * (epoch - warmup) / (end - warmup)))
    raise ValueError(f"rule={rule!r}: must be one of {BUDGET_RULES}")


def allocate(probs, features, labels, m, solve_batch=1024, seed=0, log=False, warn=True, **plan_kwargs):
    """Run :func:`csot_plan` and :func:`select` over a whole training set in random chunks.

    ``probs`` (N, C), ``features`` (N, D), ``labels`` (N,) as in :func:`csot_plan` (numpy arrays, or
    tensors on one device: everything then stays there); the samples are shuffled with ``seed`` and
    cut into chunks of ``solve_batch`` (the last one smaller), each with its own class balance
    ``m / C`` and selection of ``floor(m B_chunk)`` rows. ``plan_kwargs`` go to :func:`csot_plan`
    (``reg``, ``max_iter``, ...).
    One ``UserWarning`` (``warn``) if some chunk's plan did not converge.

    numpy arrays are solved chunk by chunk; tensors as one batched problem (:func:`batched_csot_plan`,
    the last chunk padded with rows of no mass), which takes each chunk through the same steps and
    reads the device a few dozen times for the whole epoch.

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
    if n == 0:
        raise ValueError("probs: no samples (shape (0, C)); allocate needs at least one")
    perm = np.random.default_rng(seed).permutation(n)
    if isinstance(probs, torch.Tensor):
        return _allocate_batched(probs, features, labels, m, solve_batch, perm, log, warn, plan_kwargs)
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
    inverse = np.argsort(perm)
    result = tuple(np.concatenate(parts, axis=0)[inverse] for parts in (pseudo_labels, confidence, selected))
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


# ----------------------------------------------------------------------------- batched (torch)


def _allocate_batched(probs, features, labels, m, solve_batch, perm, log, warn, plan_kwargs):
    """:func:`allocate` on tensors: the chunks of ``perm`` as one (P, B, C) problem."""
    n, device = probs.shape[0], probs.device
    size = min(solve_batch, n)
    n_chunks = -(-n // size)
    order = torch.as_tensor(perm, device=device)  # the one copy to the device
    # the last chunk padded with copies of sample perm[0]: rows without mass, never selected
    padded = torch.cat([order, order[:1].expand(n_chunks * size - n)])
    valid = (torch.arange(n_chunks * size, device=device) < n).view(n_chunks, size)

    def chunks(x):
        if x is None:
            return None
        x = torch.as_tensor(x, device=device)
        return x[padded].view(n_chunks, size, *x.shape[1:])

    plan, info = batched_csot_plan(
        chunks(probs), chunks(features), chunks(labels), m, valid=valid, **plan_kwargs
    )
    result = []
    for part in _batched_select(plan, m, valid):
        out = torch.empty(n, dtype=part.dtype, device=device)
        out[order] = part.reshape(-1)[:n]
        result.append(out)
    n_iter, err, missed = torch.stack(
        [info["n_iter"].max().double(), info["err"].max(), (~info["converged"]).sum().double()]
    ).tolist()
    info = convergence_log(
        f"allocate ({int(missed)} of {n_chunks} chunks: csot_plan)",
        int(n_iter),
        err,
        plan_kwargs.get("tol", 1e-6),
        converged=missed == 0,
        warn=warn,
        chunks=n_chunks,
    )
    return (*result, info) if log else tuple(result)


def _batched_select(plan, m, valid):
    """:func:`select` of each chunk of a (P, B, C) plan; ``valid`` (P, B) marks the chunks' rows."""
    n_rows = valid.sum(1, keepdim=True).to(plan.dtype)
    pseudo_labels = plan.argmax(2)
    confidence = (plan.amax(2) * n_rows).clamp(0.0, 1.0)
    n_selected = torch.floor(m * n_rows + 1e-9)
    order = torch.where(valid, -confidence, math.inf).argsort(dim=1, stable=True)
    positions = torch.arange(order.shape[1], device=order.device).expand_as(order)
    rank = torch.empty_like(order).scatter_(1, order, positions)
    return pseudo_labels, confidence, rank < n_selected


def batched_curriculum_ot(
    cost, row_cap, col_mass, reg, max_iter=100, tol=1e-9, anderson=5, g_init=None, frozen=None, check_every=20
):
    r""":func:`curriculum_ot` of P problems at once, on torch tensors, waiting for the device once per
    ``check_every`` steps.

    ``cost`` (P, B, C), ``row_cap`` (P, B) (a row of cap 0 is padding: it gets no mass),
    ``col_mass`` (P, C); float64. Each problem takes the scaling iteration of :func:`curriculum_ot`,
    written in the log domain (nothing to re-centre or to under/overflow between two reads):

    .. math::
        \hat f_i = \min\big(\log a_i - \mathrm{LSE}_k(\hat g_k - G_{ik}/\varepsilon),\ \hat f_{max}\big),
        \qquad \hat g_k \leftarrow \log b_k - \mathrm{LSE}_i(\hat f_i - G_{ik}/\varepsilon)

    (:math:`\hat f = f/\varepsilon`, :math:`\hat g = g/\varepsilon`, :math:`\hat f_{max} = 0` when
    ``sum(b) < sum(a)``, none otherwise), with the same Anderson mixing of ``g`` and its safeguard
    (:class:`_BatchedAnderson`: each problem's decisions are masks on the device) and the same stop:
    a problem keeps its potentials of the first step with ``err <= tol`` (or of step ``max_iter``) while
    the others go on, and the host learns at the next check that all have stopped. The steps are those
    of :func:`curriculum_ot` and only the rounding differs (log domain instead of a centred kernel), but
    for an extrapolation so far off that the centred kernel overflows: :func:`curriculum_ot` falls back
    to the last good point at once, the log domain evaluates the point and rejects it a step later (the
    two then take different steps to the same fixed point; seen on small chunks, early in a cold start).

    ``g_init`` (P, C) warm-starts; ``frozen`` (P,) bool: problems left alone (plan 0, ``n_iter`` 0).
    Returns (plan (P, B, C), {``n_iter``, ``err``, ``converged``: (P,) tensors, ``f`` (P, B), ``g`` (P, C)}).
    """
    if cost.ndim != 3 or row_cap.shape != cost.shape[:2] or col_mass.shape != (cost.shape[0], cost.shape[2]):
        raise ValueError(f"cost {tuple(cost.shape)}, row_cap {tuple(row_cap.shape)}, col_mass "
                         f"{tuple(col_mass.shape)}: expected (P, B, C), (P, B) and (P, C)")  # fmt: skip
    _check_positive(reg, "reg")
    _check_iters(max_iter, "max_iter")
    _check_iters(check_every, "check_every")
    _check_memory(anderson)
    n_problems, device = cost.shape[0], cost.device
    neg_cost = -cost / reg
    log_a, log_b, rows = torch.log(row_cap), torch.log(col_mass), row_cap > 0
    # a full budget leaves the rows tight and the potentials a free shift: no cap (see curriculum_ot)
    f_max = torch.where(col_mass.sum(1) >= row_cap.sum(1) * (1 - 1e-12), math.inf, 0.0)[:, None]
    g = torch.zeros_like(col_mass) if g_init is None else g_init / reg
    done = torch.zeros(n_problems, dtype=torch.bool, device=device) if frozen is None else frozen.clone()
    f_out, g_out = torch.full_like(row_cap, -math.inf), g.clone()
    err_out = torch.full((n_problems,), math.inf, dtype=cost.dtype, device=device)
    n_iter = torch.zeros(n_problems, dtype=torch.long, device=device)
    mixer = _BatchedAnderson(anderson, g) if anderson else None
    for it in range(1, max_iter + 1):
        lse_rows = torch.logsumexp(neg_cost + g[:, None, :], dim=2)
        f = torch.minimum(log_a - lse_rows, f_max)
        g_new = log_b - torch.logsumexp(f[:, :, None] + neg_cost, dim=1)
        residual = g_new - g
        err = torch.expm1(residual.abs().amax(1).clamp(max=700.0))
        stop = ~done & ((err <= tol) | (it == max_iter))
        f_out = torch.where(stop[:, None], f, f_out)
        g_out = torch.where(stop[:, None], g_new, g_out)
        err_out = torch.where(stop, err, err_out)
        n_iter = torch.where(stop, it, n_iter)
        done = done | stop
        if it == max_iter or it % check_every == 0 and bool(done.all()):
            break
        if mixer is None:
            g_next = g_new
        else:  # merit: minus the dual objective at (f, g), over eps (see curriculum_ot)
            dual = torch.where(rows, row_cap * f, 0.0).sum(1) + (col_mass * g).sum(1)
            g_next = mixer.step(g, residual, torch.exp(f + lse_rows).sum(1) - dual, ~done)
        g = torch.where(done[:, None], g, g_next)
    plan = torch.exp(f_out[:, :, None] + neg_cost + g_out[:, None, :])
    info = {"n_iter": n_iter, "err": err_out, "converged": err_out <= tol, "f": reg * f_out, "g": reg * g_out}
    return plan, info


class _BatchedAnderson:
    """:class:`_Anderson` for P fixed points at once (the rows of ``x``), each with its own memory,
    patience and rejections, taken by masks on the device: nothing is read back."""

    def __init__(self, memory, like):
        n, dim = like.shape
        self.memory = memory
        self.dx, self.dr = like.new_zeros((n, memory, dim)), like.new_zeros((n, memory, dim))
        self.prev_x, self.prev_r = like.new_zeros((n, dim)), like.new_zeros((n, dim))
        self.prev_merit = like.new_zeros(n)
        counter = functools.partial(torch.zeros, n, dtype=torch.long, device=like.device)
        self.count, self.pos, self.wait, self.patience = counter(), counter(), counter(), counter() + 1
        self.has_prev = torch.zeros(n, dtype=torch.bool, device=like.device)
        self.extrapolated = torch.zeros_like(self.has_prev)
        self.rows, self.slots = torch.arange(n, device=like.device), torch.arange(memory, device=like.device)

    def step(self, x, residual, merit, live):
        """The next point of each ``live`` problem, by :meth:`_Anderson.step`'s rule; the others keep
        their state (their returned rows are to be ignored)."""
        where = torch.where
        was = live & self.extrapolated
        rejected = was & (merit > self.prev_merit + 1e-13 * self.prev_merit.abs())
        retry = self.prev_x + self.prev_r  # a rejected extrapolation: the plain step from where it came
        self.wait = where(rejected, self.patience, self.wait)
        relaxed = where(was, (self.patience // 2).clamp(min=1), self.patience)  # an accepted extrapolation
        self.patience = where(rejected, 2 * self.patience, relaxed)
        keep = live & ~rejected
        push = keep & self.has_prev
        slot = (self.rows, self.pos)
        self.dx[slot] = where(push[:, None], x - self.prev_x, self.dx[slot])
        self.dr[slot] = where(push[:, None], residual - self.prev_r, self.dr[slot])
        self.pos = where(push, (self.pos + 1) % self.memory, where(rejected, 0, self.pos))
        self.count = where(push, (self.count + 1).clamp(max=self.memory), where(rejected, 0, self.count))
        self.prev_x = where(keep[:, None], x, self.prev_x)
        self.prev_r = where(keep[:, None], residual, self.prev_r)
        self.prev_merit = where(keep, merit, self.prev_merit)
        self.has_prev = keep | self.has_prev & ~rejected
        extrapolate = keep & (self.count > 0) & (self.wait == 0)
        self.wait = where(keep & ~extrapolate, (self.wait - 1).clamp(min=0), self.wait)
        self.extrapolated = where(live, extrapolate, self.extrapolated)
        # type-II Anderson on each problem's `count` slots (the others decouple: unit diagonal, zero rows)
        valid = self.slots[None, :] < self.count[:, None]
        d_x, d_r = self.dx * valid[:, :, None], self.dr * valid[:, :, None]
        gram = d_r @ d_r.transpose(1, 2)
        ridge = 1e-10 * gram.abs().amax(dim=(1, 2)) + _TINY
        gram = gram + torch.diag_embed(where(valid, ridge[:, None], 1.0))
        gamma = torch.linalg.solve_ex(gram, d_r @ residual[:, :, None])[0]  # solve_ex: no error check read
        mixed = x + residual - (gamma * (d_x + d_r)).sum(1)
        return where(rejected[:, None], retry, where(extrapolate[:, None], mixed, x + residual))


class _BatchedCoherence(_Coherence):
    r"""The structure terms of P chunks, (P, B, C) torch tensors. Both are the prediction term's form
    :math:`-\langle S X, X\rangle` with :math:`X = W \odot Q` read off the sketch :math:`F^\top X`
    (P, D, C): ``W`` the weights for :math:`\Omega^P`, the one-hot labels for :math:`\Omega^L` (its
    :math:`\sum_{ij} S_{ij}[y_i = y_j] q_i q_j`, no B x B similarity). Values are (P,) tensors."""

    def __init__(self, features, weights, labels, kappa_p, kappa_l):
        norms = features.square().sum(2).sqrt()
        self.feats = features / norms.clamp(min=_TINY)[:, :, None]
        self.sq_norms = self.feats.square().sum(2)[:, :, None]
        onehot = F.one_hot(labels, weights.shape[2]).to(weights.dtype)
        self.terms = [(kappa, w) for kappa, w in ((kappa_p, weights), (kappa_l, onehot)) if kappa]

    def parts(self, plan):
        return [(kappa, w * plan, self.feats.transpose(1, 2) @ (w * plan)) for kappa, w in self.terms]

    def gradient(self, plan, parts):
        grad = torch.zeros_like(plan)
        for (kappa, w), (_, x, sk) in zip(self.terms, parts):
            grad = grad - 2 * kappa * w * (self.feats @ sk - self.sq_norms * x)
        return grad

    def _form(self, x, sk, y, sk_y):
        return (self.sq_norms * x * y).sum((1, 2)) - (sk * sk_y).sum((1, 2))


def batched_csot_plan(probs, features, labels, m, valid=None, check_every=20, **settings):
    r""":func:`csot_plan` of P chunks at once, torch tensors on one device, without waiting for it but
    once per ``check_every`` inner scaling steps and once per line-search round.

    ``probs`` (P, B, C), ``features`` (P, B, D) (None when both kappas are 0), ``labels`` (P, B);
    ``valid`` (P, B) bool marks each chunk's rows (default: all): the others are padding, with row cap 0
    (no mass), so chunk p is the problem of its ``B_p`` rows, caps ``1 / B_p``. ``settings``: the solver
    keywords of :func:`csot_plan` (``reg``, ``kappa_p``, ..., ``anderson``), with its defaults. Each chunk
    takes the steps of :func:`csot_plan`, from :math:`Q^0 = a b^\top`,

    .. math::
        \tilde Q = \mathrm{CurriculumOT}(\hat C + \kappa\nabla\Omega(Q^i)),\qquad
        Q^{i+1} = Q^i + \eta(\tilde Q - Q^i),

    the inner solves by :func:`batched_curriculum_ot` (warm-started as there), its own Armijo step
    :math:`\eta` (:func:`_batched_armijo`: the trials of :func:`_armijo`, all chunks in lock-step) and
    its own stop (``err < tol``, a non-finite inner plan, or ``max_iter``); a chunk that stopped keeps
    its plan while the others go on. The host reads the device once for the input checks, then at most
    ``ceil(inner_max_iter / check_every)`` times per inner solve and once per line-search round (one
    round when the first trial is accepted, as usual): with the defaults at most 10 x (5 + 1) = 60 reads
    for any number of chunks, about 20 when the warm-started inner solves converge.

    Agreement with :func:`csot_plan`: the decisions (inner stops, Anderson rejections, Armijo trials, the
    outer stop) are the same tests on the same quantities, so a chunk takes the same steps and its plan
    differs by rounding only: plan entries :math:`e^{\phi}` with exponents :math:`|\phi| \lesssim
    \max G / \varepsilon` (a few hundred) computed with a relative error of a few ulp of :math:`\phi`,
    i.e. ~1e-13, carried through <= 10 contracting steps (<= 1e-11 measured on the confidences). A
    decision taken at a rounding-level margin can flip (the Anderson merit test has a 1e-13 margin), the
    inner solves part where an extrapolation overflows the centred kernel (:func:`batched_curriculum_ot`),
    and an inner solve stopped at ``inner_max_iter`` is no fixed point: then the chunk's two runs agree
    only to their stopping tolerances (``inner_tol`` on the inner rows, ``tol`` on the objective).

    Returns (plan (P, B, C) float64, {``n_iter``, ``err``, ``converged``: (P,) tensors}) as the log of
    :func:`csot_plan` per chunk.
    """
    reg, kappa_p, kappa_l, max_iter, inner_max_iter, omega_p_input, tol, inner_tol, anderson = _plan_settings(
        settings
    ).values()
    probs, features, labels = _check_batch(probs, features if (kappa_p or kappa_l) else None, labels)
    m = _check_budget(m)
    _check_plan_settings(features, reg, kappa_p, kappa_l, max_iter, inner_max_iter, anderson)
    _check_iters(check_every, "check_every")
    n_chunks, n_rows, n_cols = probs.shape
    if valid is None:
        valid = torch.ones(probs.shape[:2], dtype=torch.bool, device=probs.device)
    cost = -torch.log(probs.clamp(min=_TINY))
    row_cap = valid / valid.sum(1, keepdim=True).to(probs.dtype)
    col_mass = torch.full((n_chunks, n_cols), m / n_cols, dtype=probs.dtype, device=probs.device)

    def inner(lin_cost, g_init=None, frozen=None):
        return batched_curriculum_ot(
            lin_cost, row_cap, col_mass, reg, inner_max_iter, inner_tol, anderson, g_init, frozen, check_every
        )

    if not (kappa_p or kappa_l):  # one inner solve: its convergence is the plan's (as csot_plan)
        plan, info = inner(cost)
        return plan, info | {"n_iter": torch.zeros_like(info["n_iter"])}

    terms = _BatchedCoherence(features, _omega_p_weights(probs, omega_p_input), labels, kappa_p, kappa_l)
    plan = row_cap[:, :, None] * col_mass[:, None, :]
    parts = terms.parts(plan)
    lin_value = (cost * plan).sum((1, 2))
    objective = lin_value + terms.energy(parts) + reg * _batched_neg_entropy(plan)
    active = torch.ones(n_chunks, dtype=torch.bool, device=probs.device)
    n_iter = torch.zeros(n_chunks, dtype=torch.long, device=probs.device)
    err = torch.full_like(objective, math.inf)
    converged, g = torch.zeros_like(active), None
    for _ in range(max_iter):
        lin_cost = cost + terms.gradient(plan, parts)
        target, info = inner(lin_cost, g, ~active)
        live = active & torch.isfinite(target).all(2).all(1)  # a non-finite plan stops its chunk
        g = info["g"] if g is None else torch.where(live[:, None], info["g"], g)
        direction = target - plan
        new_parts = terms.parts(target)
        dparts = [(k, x1 - x0, s1 - s0) for (k, x0, s0), (_, x1, s1) in zip(parts, new_parts)]
        c0, c1, c2 = terms.energy_along(parts, dparts)
        lin_slope = (cost * direction).sum((1, 2))
        c0, c1 = c0 + lin_value, c1 + lin_slope
        slope = (direction * (lin_cost + reg * (1 + torch.log(plan.clamp(min=_TINY))))).sum((1, 2))

        def along(t, plan=plan, direction=direction, c0=c0, c1=c1, c2=c2):
            return c0 + c1 * t + c2 * t * t + reg * _batched_neg_entropy(plan + t[:, None, None] * direction)

        def after(new_objective, objective=objective, live=live):  # (err, converged, still active)
            change = (new_objective - objective).abs() / new_objective.abs().clamp(min=1.0)
            return change, live & (change < tol), live & ~(change < tol)

        step, new_objective, going_on = _batched_armijo(along, objective, slope, live, lambda v: after(v)[2])
        moved, eta = (live & (step > 0))[:, None, None], step[:, None, None]
        plan = torch.where(moved, plan + eta * direction, plan)
        parts = [
            (k, torch.where(moved, x0 + eta * dx, x0), torch.where(moved, s0 + eta * ds, s0))
            for (k, x0, s0), (_, dx, ds) in zip(parts, dparts)
        ]
        lin_value = torch.where(live, lin_value + step * lin_slope, lin_value)
        change, now_converged, active = after(new_objective)
        err = torch.where(live, change, err)
        converged = torch.where(live, now_converged, converged)
        objective = torch.where(live, new_objective, objective)
        n_iter = n_iter + live
        if not going_on:
            break
    return plan, {"n_iter": n_iter, "err": err, "converged": converged}


def _check_plan_settings(features, reg, kappa_p, kappa_l, max_iter, inner_max_iter, anderson):
    """The checks of :func:`csot_plan`'s solver keywords, shared with :func:`batched_csot_plan`."""
    _check_positive(reg, "reg")
    for name, kappa in (("kappa_p", kappa_p), ("kappa_l", kappa_l)):
        if not kappa >= 0:
            raise ValueError(f"{name}={kappa}: must be >= 0")
    _check_iters(max_iter, "max_iter")
    _check_iters(inner_max_iter, "inner_max_iter")
    _check_memory(anderson)
    if (kappa_p or kappa_l) and features is None:
        raise ValueError("features are required when kappa_p or kappa_l > 0")


def _plan_settings(settings: dict) -> dict:
    """`settings` over :func:`csot_plan`'s defaults of its solver keywords, in its order (the defaults'
    one place); a name it does not take is refused as Python refuses an unknown keyword."""
    defaults = {
        name: p.default
        for name, p in inspect.signature(csot_plan).parameters.items()
        if p.default is not inspect.Parameter.empty and name not in ("log", "warn")
    }
    if unknown := sorted(set(settings) - set(defaults)):
        takes = ", ".join(defaults)
        raise TypeError(f"batched_csot_plan() takes no keyword {unknown[0]!r} (only {takes})")
    return defaults | settings


def _batched_neg_entropy(plan):
    """sum Q log Q per chunk of a (P, B, C) plan (0 log 0 = 0)."""
    return (plan * torch.log(plan.clamp(min=_TINY))).sum((1, 2))


def _batched_armijo(phi, phi0, slope, live, going_on, c1=1e-4, first=0.99, max_evals=30):
    """:func:`_armijo` for P chunks in lock-step: ``phi`` maps steps (P,) to values (P,); the chunks
    not ``live`` or without descent (``slope >= 0``) take step 0. Each round reads the device once:
    whether a search goes on, and ``going_on(values)`` (P,) bool -- whether any chunk goes on after
    these steps. Returns (steps, values, any chunk going on)."""
    searching = live & (slope < 0)
    step, value_out = torch.zeros_like(phi0), phi0
    t = torch.full_like(phi0, first)
    value, t_prev, phi_prev = phi(t), None, None
    for _ in range(max_evals):
        accept = searching & (value <= phi0 + c1 * t * slope)
        step, value_out = torch.where(accept, t, step), torch.where(accept, value, value_out)
        searching = searching & ~accept
        pending, more = torch.stack([searching.any(), going_on(value_out).any()]).tolist()
        if not pending:
            break
        if t_prev is None:  # quadratic through phi0, slope, phi(t)
            t_new = -slope * t * t / (2 * (value - phi0 - slope * t))
        else:  # cubic through phi0, slope, phi(t_prev), phi(t)
            a, b = _cubic_coefficients(phi0, slope, t, value, t_prev, phi_prev)
            disc = b * b - 3 * a * slope
            t_new = torch.where((a != 0) & (disc >= 0), (-b + disc.sqrt()) / (3 * a), t / 2)
        t_new = torch.where(t_new.isfinite(), torch.minimum(torch.maximum(t_new, 0.1 * t), 0.5 * t), t / 2)
        t_prev, phi_prev = t, value
        t = torch.where(searching, t_new, t)
        value = phi(t)
    return step, value_out, bool(more)


def _check_batch(probs, features, labels):
    """:func:`_check_chunk` and :func:`csot_plan`'s check of the probabilities for (P, B, C) tensors, in
    one read of the device; returns float64 probs and features, int64 labels."""
    if probs.ndim != 3:
        raise ValueError(f"probs must be 3-D (P, B, C), got shape {tuple(probs.shape)}")
    if labels.is_floating_point():
        raise ValueError(f"labels must be integers, got dtype {labels.dtype}")
    _check_shape(labels, probs.shape[:2], "labels")
    probs, labels = probs.double(), labels.long()
    checks = {
        "probs contains NaN or Inf": ~torch.isfinite(probs).all(),
        f"labels must lie in [0, {probs.shape[2]})": ((labels < 0) | (labels >= probs.shape[2])).any(),
        "probs must be non-negative with rows summing to one (softmax outputs)": (probs < 0).any()
        | ((probs.sum(2) - 1).abs() > 1e-5).any(),
    }
    if features is not None:
        if features.ndim != 3 or features.shape[:2] != probs.shape[:2]:
            expected = (*probs.shape[:2], "D")
            raise ValueError(f"features has shape {tuple(features.shape)}, expected {expected}")
        features = features.double()
        checks["features contains NaN or Inf"] = ~torch.isfinite(features).all()
    for message, failed in zip(checks, torch.stack(list(checks.values())).tolist()):
        if failed:
            raise ValueError(message)
    return probs, features, labels
