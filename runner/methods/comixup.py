"""Co-Mixup: saliency-guided joint mixup with supermodular diversity (Kim, Choo, Jeong, Song, ICLR 2021).

A batch is split into partitions of `part` inputs; each partition of m inputs is turned into m mixed
outputs at once. Every output j is a g x g grid of n = g^2 cells, and cell k of output j holds a
source vector z[j,k] in {0, 1/2, 1}^m summing to 1 (one input, or a half/half blend of two). With the
code's scaling beta' = beta/n, gamma' = gamma/n, eta' = eta/n and the threshold tau*n in cells, the
energy of a partition is

    f(z) = sum_j sum_k (c_k - eta' log lambda)^T z[j,k]                          (saliency, prior)
         + beta' sum_j sum_{(k,k') 4-neighbours} 1/2 |z[j,k] - z[j,k']|^2           (smoothness)
         + gamma' sum_j o_j^T h(P_-j)                                               (diversity)

with c_k[i] = -s_i[k] the negated saliency of input i in cell k (each map pooled to the grid and
normalised to sum 1), lambda ~ Dir(alpha 1_m) drawn once per partition, o_j = sum_k z[j,k] the
source histogram of output j (in cells), P_-j = sum_{j' != j} o_j' the other outputs' usage, and
A = (1 - omega) I + omega * A_hat the compatibility matrix (`compatibility`). The clipping rule h:

    "none":  h(P) = A P                      -> gamma' sum_{j != j'} o_j^T A o_j'  (paper Eq. 1, no clip)
    "soft":  h(P) = max(A P - tau n, 0)      (paper Eq. 2, per label)
    "hard":  h(P) = A (P * [A P > tau n])    (the authors' default: full penalty past the threshold)

Minimisation is block-coordinate descent over outputs (paper Algorithm 1): for output j the
diversity term is replaced by the modular cost u = 2 gamma' h(P_-j) (exact for "none", where it is
the conditional of f up to a constant), leaving a Potts-like MRF on the grid with unary
U[k,i] = c_k[i] - eta' log lambda_i + u_i + gamma' R[j,i], solved exactly (method "exact", the default: a
DP over the grid's raster frontier in C, `grid_dp.c`, the whole step in one call; gco's swap on the rare grid
where the DP would take longer) or by the authors' alpha-beta-swap graph cut (`gco_swap`, a local minimum).
From the second sweep the label set of output j also holds the blends 1/2(e_a + e_b) of its most used
inputs (the three-label extension); `set_resolve` adds the penalty R that separates outputs using the
same input set before the last sweep. Labels are mixed by mask area: y_j = sum_i (o_j[i] / n) y_i.

Deviations from the authors' code, all deliberate: the smoothness of blended labels uses the exact
squared distance above (the code charges 1 between a blend and any other label), partitions are
near-equal chunks (`np.array_split`) instead of fixed 20s plus a remainder. For speed, the
partitions of a batch are solved together, one graph cut per output index over the disjoint union of
their grids (the cuts separate, so this is the same algorithm with 1/P of the calls), and an
output's label set leaves out inputs that another input dominates in every cell (which keeps the
optimum and the swap local minima; see `_label_step`).

The solvers follow the convention of `runner.methods._common`: `method=` picks the graph-cut
algorithm, `max_iter` caps the sweeps and `tol` is the relative energy change that ends them early.
"""

from __future__ import annotations

import ctypes as ct
import inspect
import math
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from functools import lru_cache
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from gco import cgco

from runner.methods._common import to_device, usable_cores
from runner.methods._native import load as load_native
from runner.methods._native import pointer as _data

__all__ = [
    "OPTIONS",
    "CONFIG_KEYS",
    "RANDOM_GRIDS",
    "SOLVERS",
    "THRES_TYPES",
    "ComixupPool",
    "auto_workers",
    "comixup",
    "comixup_masks",
    "compatibility",
    "grid_cut",
    "objective",
    "pool_saliency",
    "salient_locations",
    "saliency",
]

THRES_TYPES = ("hard", "soft", "none")
SOLVERS = ("exact", "gco_swap", "gco_expansion", "brute")  # the values of `method=`
RANDOM_GRIDS = (2, 4, 8, 16)  # grid=-1 draws one of these at every call (the authors' `m_block_num -1`)
_BLEND_SLOTS = ((0, 1), (0, 2), (1, 2))  # blended labels: halves of the three most used inputs
_BLEND_FIRST, _BLEND_SECOND = np.array(_BLEND_SLOTS).T
_PROTECTED_SLOTS = np.array([0, 0, 2, 3])  # [min(inputs in use, 3)]: the leading slots that blends need
_MIX_BONUS = 5e-4  # favours a blend on ties, as the authors do
_BRUTE_MAX_STATES = 2_000_000
# The exact DP's largest grid, in state updates (`grid_dp.c`), where it costs about what gco's swap does: on
# this CPU 5e4 updates (4x4, 5 labels, none pruned) took 37 us, gco's swap of that grid 33 us. Larger: gco.
_DP_MAX_WORK = 30_000
_GCO_RESOLUTION = 1e6  # energies go to gco as integers in units of 1e-6 (coarser only to meet the limits)
_GCO_CHECKED_TERM = 10**7  # gco's GCO_MAX_ENERGYTERM: it aborts the process on a larger checked term
_GCO_DATA_TERM = 1e8  # largest finite data term under swap, which gco does not check (int32 headroom)
# The keyword options of `comixup` that a method config sets (`max_iter` and `method` under the config
# keys `n_iter` and `solver`: `method.method` would read badly on a command line).
OPTIONS = ("beta", "gamma", "eta", "tau", "thres_type", "omega", "alpha", "grid", "part", "max_iter",
           "set_resolve", "mixed_labels", "method")  # fmt: skip
CONFIG_KEYS = {"max_iter": "n_iter", "method": "solver"}


def _gco_api():
    """gco-wrapper's C functions, with raw pointers: pygco rebuilds the grid edges, re-checks the
    label matrix and validates every array on each call, which costs more than a 4x4 cut itself."""
    lib = ct.CDLL(cgco._cgco._name)  # the library pygco loaded (one instance map)
    ptr, i32 = ct.c_void_p, ct.c_int
    signatures = {
        "gcoCreateGeneralGraph": [i32, i32, ptr],
        "gcoDestroyGraph": [i32],
        "gcoSetDataCost": [i32, ptr],
        "gcoSetAllNeighbors": [i32, ptr, ptr, ptr, i32],
        "gcoSetSmoothCost": [i32, ptr],
        "gcoSwap": [i32, i32, ptr],
        "gcoExpansion": [i32, i32, ptr],
        "gcoGetLabels": [i32, ptr],
    }
    for name, args in signatures.items():
        getattr(lib, name).argtypes = args
        getattr(lib, name).restype = i32
    return lib


_GCO = _gco_api()
# gco-wrapper keeps every graph in one unsynchronised std::map (cgco.cpp's `_gcoInstanceMap`), read by each
# call and written by create and destroy: threads cutting at once race on it, so gco's cuts take turns
_GCO_LOCK = threading.Lock()


# ----------------------------------------------------------------------------------------------
# saliency and compatibility


def saliency(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, grid: int = 4):
    """Input-gradient saliency s(p) = sqrt(mean_c g[c,p]^2), g = d CE(f(x_b), y_b) / d x_b per sample.

    x: (B, C, H, W) inputs as fed to the model; y: (B,) class indices or (B, K) soft targets.
    Returns `(s, s_grid)`: the per-pixel map (B, H, W) and its `pool_saliency(s, grid)` (B, g, g).
    The model is used in whatever mode it is in; no weight gradient is accumulated.
    """
    x = x.detach().requires_grad_(True)
    with torch.enable_grad():
        logits = model(x)
        loss = F.cross_entropy(logits, y, reduction="sum")
        (grad,) = torch.autograd.grad(loss, x)
    s = grad.pow(2).mean(1).sqrt()
    return s, pool_saliency(s, grid)


def pool_saliency(s, grid: int):
    """Average-pool per-pixel saliency (B, H, W) to (B, g, g) cells and normalise each map to sum 1.

    An all-zero map stays zero (the normalisation has an eps where the authors divide by zero).
    A tensor is pooled where it is, in its dtype; an array in float64.
    """
    B, H, W = s.shape
    if H % grid or W % grid:
        raise ValueError(f"grid={grid}: must divide the image size {H}x{W}")
    if isinstance(s, torch.Tensor):
        pooled = s.reshape(B, grid, H // grid, grid, W // grid).mean((2, 4))
        return pooled / (pooled.sum((1, 2), keepdim=True) + 1e-12)
    pooled = np.asarray(s, dtype=np.float64).reshape(B, grid, H // grid, grid, W // grid).mean((2, 4))
    return pooled / (pooled.sum((1, 2), keepdims=True) + 1e-12)


def salient_locations(s, window: int = 8) -> torch.Tensor:
    """(row, col) of the most salient window x window box of each map (B, H, W) -> (B, 2) int64 on s's
    device, as the authors: the argmax (the first on ties) of avg_pool2d(s, window, stride=1).

    The window shrinks to the image size on small images.
    """
    s = torch.as_tensor(s)
    B, H, W = s.shape
    k = min(window, H, W)
    flat = F.avg_pool2d(s[:, None], k, stride=1).reshape(B, -1).argmax(1)
    cols = W - k + 1
    return torch.stack([flat // cols, flat % cols], 1)


def _compatibility_from_locations(loc: np.ndarray, valid: np.ndarray, omega: float) -> np.ndarray:
    """A = (1 - omega) I + omega * D m / sum(D), D[i,i'] = |loc_i - loc_i'|_1, per partition.

    loc: (P, m, 2); valid: (P, m) marks real inputs (padding gets a plain diagonal). -> (P, m, m)
    """
    P, m, _ = loc.shape
    dist = np.abs(loc[:, :, None, :] - loc[:, None, :, :]).sum(-1).astype(np.float64)
    dist *= valid[:, :, None] & valid[:, None, :]
    total = dist.sum((1, 2), keepdims=True)
    sizes = valid.sum(1)[:, None, None]
    a_hat = np.divide(dist * sizes, total, out=np.zeros_like(dist), where=total > 0)
    return (1.0 - omega) * np.eye(m) + omega * a_hat


def compatibility(saliency_maps, omega: float = 0.001) -> np.ndarray:
    """Compatibility matrix A (m, m) of one partition from per-pixel saliency maps (m, H, W).

    A = (1 - omega) I + omega * A_hat, A_hat = D m / sum(D) where D[i,i'] is the L1 distance between
    the most salient 8x8 boxes of inputs i and i' (zero when all coincide). A is symmetric with
    diagonal 1 - omega and, for omega < 1/(m+1), positive definite. Large A[i,i'] (objects far
    apart) makes outputs that share i and i' costly, so far-apart objects end up in one output.
    """
    _check_range("omega", omega, 0.0, 1.0)
    s = torch.as_tensor(saliency_maps)
    if s.ndim != 3:
        raise ValueError(f"saliency_maps: shape {tuple(s.shape)}, expected (m, H, W)")
    if not torch.isfinite(s).all():
        raise ValueError("saliency_maps: contains NaN or inf")
    loc = salient_locations(s).cpu().numpy()[None]
    return _compatibility_from_locations(loc, np.ones(loc.shape[:2], bool), omega)[0]


# ----------------------------------------------------------------------------------------------
# per-output graph cut


@lru_cache(maxsize=64)
def _label_set(m: int, mixed: bool):
    """Label vectors (L, m) in slot order, and their pairwise costs 1/2 |v - v'|^2 (L, L).

    Slots are inputs reordered so that the most used ones come first; the blends are of slots
    (0,1), (0,2), (1,2) (only (0,1) when m = 2).
    """
    vectors = [np.eye(m)]
    if mixed and m >= 2:
        pairs = _BLEND_SLOTS if m >= 3 else _BLEND_SLOTS[:1]
        blend = np.zeros((len(pairs), m))
        for row, (a, b) in enumerate(pairs):
            blend[row, [a, b]] = 0.5
        vectors.append(blend)
    vectors = np.concatenate(vectors)
    pairwise = 0.5 * ((vectors[:, None, :] - vectors[None, :, :]) ** 2).sum(-1)
    return vectors, pairwise


@lru_cache(maxsize=64)
def _grid_edges(components: int, grid: int):
    """4-neighbour edges (s1 < s2) of `components` disjoint grid x grid graphs, as int32 arrays."""
    idx = np.arange(components * grid * grid).reshape(components, grid, grid)
    s1 = np.concatenate([idx[:, :-1, :].ravel(), idx[:, :, :-1].ravel()]).astype(np.intc)
    s2 = np.concatenate([idx[:, 1:, :].ravel(), idx[:, :, 1:].ravel()]).astype(np.intc)
    return s1, s2, np.ones(s1.size, np.intc)


@lru_cache(maxsize=16)
def _all_labelings(n: int, labels: int) -> np.ndarray:
    return np.indices((labels,) * n).reshape(n, -1).T


def _gco_cut(unary: np.ndarray, pairwise: np.ndarray, edge_weight, grid: int, swap: bool):
    """gco on a batch of grids; unary (P, n, L) float (+inf = forbidden) -> labels (P, n).

    edge_weight: a scalar, or (P, E) per edge in `_grid_edges` order. Energies go to gco as int32
    at 1e-6 resolution (gco's own float path rounds edge weights to 1e-3), coarser where a term would
    pass gco's limit: it aborts the process on a smoothness term, and under expansion on a data term,
    above GCO_MAX_ENERGYTERM. A forbidden label costs more than any allowed label of its site plus
    all that its 4 edges can save, so no swap or expansion move keeps a site on it: the moves'
    minimisers are those of an infinite cost, and the cost stays within the limit.
    """
    P, n, L = unary.shape
    finite = np.isfinite(unary)
    uniform = np.ndim(edge_weight) == 0
    # gco charges weight_e * matrix[l, l']. A uniform weight is folded into the label matrix; otherwise the
    # matrix is pairwise * q, q the smallest integer making it integral (else 1000 / its largest entry), and
    # the rest of the scale goes on the edges.
    q = None
    if not uniform:
        q = next((q for q in range(1, 13) if np.allclose(pairwise * q, np.rint(pairwise * q))), None)
    lo, hi = unary.min(where=finite, initial=np.inf), unary.max(where=finite, initial=-np.inf)
    smooth = (edge_weight if uniform else np.max(edge_weight, initial=0)) * pairwise.max()  # largest edge
    bounds = {abs(lo): _GCO_DATA_TERM, abs(hi): _GCO_DATA_TERM, smooth: _GCO_CHECKED_TERM}
    if not swap:  # the forbidden cost below, with ample room for the rounding of its terms
        bounds[2 * hi - lo + 4 * smooth] = _GCO_CHECKED_TERM / 2
    scale = min([_GCO_RESOLUTION] + [limit / bound for bound, limit in bounds.items() if bound > 0])
    s1, s2, ones = _grid_edges(P, grid)
    # expansion needs the matrix to stay a metric, which rounding up keeps (ceil a + ceil b >= ceil(a + b))
    to_int = np.rint if swap or q else np.ceil
    if uniform:
        smooth_int, weights = to_int(pairwise * (edge_weight * scale)).astype(np.intc), ones
    else:
        q = q or 1000 / pairwise.max()
        smooth_int = to_int(pairwise * q).astype(np.intc)
        weights = np.rint(np.asarray(edge_weight, np.float64).reshape(-1) * (scale / q)).astype(np.intc)
    unary_int = np.rint(unary * scale)
    if not finite.all():  # rint is monotone: round(hi * scale) is the largest finite integer term
        top, bottom = round(hi * scale), round(lo * scale)
        forbidden = 2 * top - bottom + 4 * int(smooth_int.max()) * int(weights.max(initial=0)) + 1
        unary_int = np.where(finite, unary_int, forbidden)
    unary_int = unary_int.astype(np.intc, order="C").reshape(P * n, L)  # sites by labels, row-major
    handle, energy = ct.c_int(), ct.c_longlong()
    labels = np.empty(P * n, np.intc)
    with _GCO_LOCK:
        _GCO.gcoCreateGeneralGraph(P * n, L, ct.byref(handle))
        try:  # gco keeps pointers to these arrays until the graph is destroyed
            _GCO.gcoSetDataCost(handle, _data(unary_int))
            _GCO.gcoSetAllNeighbors(handle, _data(s1), _data(s2), _data(weights), s1.size)
            _GCO.gcoSetSmoothCost(handle, _data(smooth_int))
            (_GCO.gcoSwap if swap else _GCO.gcoExpansion)(handle, -1, ct.byref(energy))
            _GCO.gcoGetLabels(handle, _data(labels))
        finally:
            _GCO.gcoDestroyGraph(handle)
    return labels.reshape(P, n)


@lru_cache(maxsize=1)
def _native_dp():
    """`grid_dp.c`'s two entry points, `grid_dp` (any grid MRF) and `label_step` (`_label_step`'s)."""
    lib = load_native("grid_dp", instead="method.solver=gco_swap")
    ptr, i32, f64, i64 = ct.c_void_p, ct.c_int, ct.c_double, ct.c_long
    lib.grid_dp.argtypes = [i32, i32, i32, ptr, ptr, ptr, i32, i64, ptr, ptr]
    lib.label_step.argtypes = [i32, i32, i32, ptr, ptr, i32, f64, f64, i64, ptr, ptr]
    lib.grid_dp.restype = lib.label_step.restype = None
    return lib


def _exact_cut(unary: np.ndarray, pairwise: np.ndarray, edge_weight, grid: int):
    """The exact minimiser of each grid by `grid_dp.c`'s dynamic program over the raster-order frontier (its
    equation and pruning are in the source); grids whose DP would pass `_DP_MAX_WORK` go to `gco_swap`.
    unary (P, n, L) float (+inf = forbidden) -> labels (P, n)."""
    P, n, L = unary.shape
    per_edge = np.ndim(edge_weight) > 0
    arrays = (np.require(a, np.float64, ["C", "W"]) for a in (unary, pairwise, np.atleast_1d(edge_weight)))
    labels, status = np.empty((P, n), np.intc), np.empty(P, np.intc)
    out = (_data(labels), _data(status))
    _native_dp().grid_dp(P, grid, L, *map(_data, arrays), per_edge, _DP_MAX_WORK, *out)
    large = np.flatnonzero(status)
    if len(large):
        w = np.asarray(edge_weight)[large] if per_edge else edge_weight
        labels[large] = _gco_cut(unary[large], pairwise, w, grid, swap=True)
    return labels


def _brute_cut(unary: np.ndarray, pairwise: np.ndarray, edge_weight, grid: int):
    """Exact minimiser by enumeration of all L^n labelings (tiny grids only)."""
    P, n, L = unary.shape
    if L**n > _BRUTE_MAX_STATES:
        raise ValueError(f"method='brute': {L}^{n} labelings is too many; use grid <= 3 and few inputs")
    labelings = _all_labelings(n, L)
    s1, s2, _ = _grid_edges(1, grid)
    edge_costs = pairwise[labelings[:, s1], labelings[:, s2]]  # (S, E)
    weights = np.broadcast_to(np.asarray(edge_weight, np.float64), (P, s1.size))
    sites = np.arange(n)
    return np.stack(
        [
            labelings[np.argmin(u[sites, labelings].sum(1) + (edge_costs * w).sum(1))]
            for u, w in zip(unary, weights)
        ]
    ).astype(np.intc)


def grid_cut(unary, pairwise, smooth_weight, method: str = "gco_swap") -> np.ndarray:
    """Minimise sum_k unary[k, l_k] + sum_{4-neighbours e = (k,k')} w_e pairwise[l_k, l_k'] on a grid.

    unary: (g, g, L) or (P, g, g, L) for P independent grids (+inf forbids a label at a site);
    pairwise: (L, L) symmetric, zero diagonal (a metric for `gco_expansion`); smooth_weight: w >= 0,
    a scalar or (P, E) per edge (the g(g-1) vertical edges row by row, then the horizontal ones).
    method: `exact` (the global minimum by a DP over the grid's raster
    frontier, `grid_dp.c`, where that takes at most `_DP_MAX_WORK` state updates, else `gco_swap`), `gco_swap`
    (alpha-beta swap, a local minimum; exact for L = 2 up to the costs' integer resolution, 1e-6 or coarser
    near gco's limit), `gco_expansion`, `brute` (exact, L^(g^2) <= 2e6).
    Returns labels of shape unary.shape[:-1].
    One solve per grid (gco's runs to its own fixed point): no iteration options, no log.

    >>> unary = np.zeros((2, 2, 2))
    >>> unary[..., 1] = 1.0  # every cell prefers label 0 ...
    >>> unary[0, 0] = [5.0, 0.0]  # ... but the corner, strongly enough to pay for its two edges
    >>> grid_cut(unary, 1 - np.eye(2), smooth_weight=0.1).tolist()
    [[1, 0], [0, 0]]
    """
    _check_choice("method", method, SOLVERS)
    unary = np.asarray(unary, dtype=np.float64)
    single = unary.ndim == 3
    batch = unary[None] if single else unary
    if batch.ndim != 4 or batch.shape[1] != batch.shape[2]:
        raise ValueError(f"unary: shape {unary.shape}, expected (g, g, L) or (P, g, g, L)")
    P, g, _, L = batch.shape
    pairwise = np.asarray(pairwise, dtype=np.float64)
    _check_cut_problem(batch.reshape(P, g * g, L), pairwise, smooth_weight, 2 * g * (g - 1), method)
    labels = _cut(batch.reshape(P, g * g, L), pairwise, smooth_weight, g, method).reshape(P, g, g)
    return labels[0] if single else labels


def _check_cut_problem(unary: np.ndarray, pairwise: np.ndarray, smooth_weight, edges: int, method: str):
    """What `grid_cut` promises to solve, checked up front: gco aborts the whole process on some of the
    rest (a non-metric expansion, a negative smoothness term)."""
    P, n, L = unary.shape
    if np.isnan(unary).any() or (unary == -np.inf).any():
        raise ValueError("unary: contains NaN or -inf (+inf is the one non-finite value: a forbidden label)")
    stuck = np.argwhere(~np.isfinite(unary).any(2))
    if len(stuck):
        raise ValueError(f"unary: site {tuple(stuck[0].tolist())} (grid, cell) forbids all {L} labels")
    if pairwise.shape != (L, L) or not np.isfinite(pairwise).all():
        raise ValueError(f"pairwise: shape {pairwise.shape}, expected finite ({L}, {L}) costs")
    if (pairwise < 0).any() or np.diagonal(pairwise).any() or not np.array_equal(pairwise, pairwise.T):
        raise ValueError("pairwise: must be symmetric and >= 0 with a zero diagonal")
    via = pairwise[:, :, None] + pairwise[None, :, :]  # [a, b, c]: the cost a -> b plus b -> c
    if method == "gco_expansion" and (pairwise[:, None, :] > via + 1e-9 * pairwise.max()).any():
        raise ValueError("pairwise: method='gco_expansion' needs a metric (the triangle inequality fails)")
    w = np.asarray(smooth_weight, dtype=np.float64)
    if w.shape not in ((), (P, edges)):
        raise ValueError(f"smooth_weight: shape {w.shape}, expected a number or one per edge, ({P}, {edges})")
    if not (np.isfinite(w) & (w >= 0)).all():
        raise ValueError(f"smooth_weight: must be finite and >= 0, got {w.min() if w.size else w}")


def _cut(unary, pairwise, edge_weight, grid, method):
    if unary.shape[2] == 1:  # nothing to choose (and gco aborts on fewer than 2 labels)
        return np.zeros(unary.shape[:2], np.intc)
    if method == "brute":
        return _brute_cut(unary, pairwise, edge_weight, grid)
    if method == "exact":
        return _exact_cut(unary, pairwise, edge_weight, grid)
    return _gco_cut(unary, pairwise, edge_weight, grid, swap=method == "gco_swap")


# ----------------------------------------------------------------------------------------------
# objective and block-coordinate descent (batched over partitions, padded to m inputs)


def _diversity_cost(A: np.ndarray, others: np.ndarray, threshold: float, thres_type: str) -> np.ndarray:
    """h(P) of the module docstring for usage P = others (..., m), A broadcastable (..., m, m)."""
    q = (A @ others[..., None])[..., 0]
    if thres_type == "none":
        return q
    if thres_type == "soft":
        return np.maximum(q - threshold, 0.0)
    return (A @ (others * (q > threshold))[..., None])[..., 0]


def _energy(W, cost, A, grid, beta_n, gamma_n, threshold, thres_type, o=None):
    """f(z) per partition; W (P, m', n, m) source weights, cost (P, n, m) = c - eta' log lambda, and
    o = W.sum(2) where the caller keeps it."""
    P, m_out, n, m = W.shape
    unary = (W.sum(1) * cost).reshape(P, -1).sum(1)
    cells = W.reshape(P, m_out, grid, grid, m)
    smooth = np.square(cells[:, :, 1:] - cells[:, :, :-1]).reshape(P, -1).sum(1)
    smooth += np.square(cells[:, :, :, 1:] - cells[:, :, :, :-1]).reshape(P, -1).sum(1)
    o = W.sum(2) if o is None else o
    others = o.sum(1, keepdims=True) - o
    diversity = (o * _diversity_cost(A[:, None], others, threshold, thres_type)).reshape(P, -1).sum(1)
    return unary + 0.5 * beta_n * smooth + gamma_n * diversity


def _resolve(o: np.ndarray) -> np.ndarray:
    """R (P, m', m): for outputs a < b with one input set (>= 2 inputs), R[a, first] = R[b, second] = 1."""
    used = o > 0
    P, m_out, m = used.shape
    same = (used[:, :, None, :] == used[:, None, :, :]).all(-1) & (used.sum(-1) >= 2)[:, :, None]
    same &= np.triu(np.ones((m_out, m_out), bool), 1)
    order = np.argsort(~used, axis=-1, kind="stable")  # used inputs first, in index order
    R = np.zeros((P, m_out, m))
    p, a = np.nonzero(same.any(2))
    R[p, a, order[p, a, 0]] = 1.0
    p, b = np.nonzero(same.any(1))
    R[p, b, order[p, b, 1]] = 1.0
    return R


def _label_step(U, counts, grid, beta_n, method, mixed, stats):
    """Solve output j's MRF for each active partition; U (a, m, n) unary per input and cell, counts (a, m)
    its current o_j.

    Returns source weights (a, n, m). Inputs are reordered per partition into label slots shared by
    the whole batch of grids: with `mixed`, the three most used inputs first (the blends of slots
    0,1 / 0,2 / 1,2 follow the one-hot labels; a blend needs its inputs in use), then every other
    input that no single input dominates. Input i is dominated by i' when U[i] >= U[i'] at every
    cell (ties broken by index): replacing i by i' never raises unary nor smoothness cost, so a swap
    (or expansion) local minimum without i is one with i, and the global minimum is kept. On peaked
    saliency this leaves a handful of labels out of m and cuts the swap's O(L^2) pairs. Inputs lead
    the unary's axes so that every reordering is one gather of whole rows. `_native_label_step` is this
    step with method "exact", in C.
    """
    a, m, n = U.shape
    rows = np.arange(a)[:, None]
    if mixed:
        order = (-counts).argsort(axis=1, kind="stable")
        U = U[rows, order]
        n_used = (counts > 0).sum(1)
        protected = _PROTECTED_SLOTS[np.minimum(n_used, 3)][:, None]
    else:
        order, protected = np.arange(m)[None].repeat(a, 0), 0
    by_cell = U.transpose(0, 2, 1).copy()  # cells lead: the test below reduces a leading axis, 2x faster
    geq = (by_cell[:, :, :, None] >= by_cell[:, :, None, :]).all(1)  # [p, i, i']: U_i >= U_i' at every cell
    dominated = (geq & (~geq.transpose(0, 2, 1) | _tie_break(m))).any(2) & (np.arange(m) >= protected)
    keep_first = dominated.argsort(axis=1, kind="stable")
    kept = m - dominated.sum(1)
    k = max(int(kept.max()), 1)
    order = order[rows, keep_first[:, :k]]
    U = U[rows, keep_first[:, :k]]
    if kept.min() < k:
        U[np.arange(k) >= kept[:, None]] = np.inf  # padding slots of partitions with fewer labels
    vectors, pairwise = _label_set(k, mixed)
    if mixed and k > 1:
        n_blends = len(vectors) - k
        first, second = _BLEND_FIRST[:n_blends], _BLEND_SECOND[:n_blends]
        in_use = n_used[:, None, None] > second[:, None]  # a blend of slots (i, i') needs i' + 1 in use
        unary_blend = np.where(in_use, 0.5 * (U[:, first] + U[:, second]) - _MIX_BONUS, np.inf)
        U = np.concatenate([U, unary_blend], axis=1)
    tic = time.perf_counter()
    labels = _cut(U.transpose(0, 2, 1), pairwise, beta_n, grid, method)
    stats["gc_seconds"] += time.perf_counter() - tic
    stats["gc_calls"] += 1
    W = np.zeros((a, n, m))
    W[rows[:, :, None], np.arange(n)[:, None], order[:, None, :]] = vectors[labels]
    return W


def _native_label_step(U, counts, grid, beta_n, method, mixed, stats):
    """`_label_step` with method "exact" in one call of `grid_dp.c`'s `label_step`: the same label slots,
    dominance and costs, solved by its exact DP, with no numpy in between (a step's numpy work took longer
    than its cut). The partitions whose DP would pass `_DP_MAX_WORK` take the numpy step with gco_swap, as
    `_exact_cut` would give them."""
    a, m, n = U.shape
    # the callers' arrays are fresh or views of their own, so writable for `_data` (np.require costs more)
    U, counts = np.ascontiguousarray(U, np.float64), np.ascontiguousarray(counts, np.float64)
    W, status = np.empty((a, n, m)), np.empty(a, np.intc)
    tic = time.perf_counter()
    _native_dp().label_step(a, m, grid, _data(U), _data(counts), mixed, beta_n, _MIX_BONUS, _DP_MAX_WORK,
                            _data(W), _data(status))  # fmt: skip
    stats["gc_seconds"] += time.perf_counter() - tic
    stats["gc_calls"] += 1
    if status.any():
        large = np.flatnonzero(status)
        W[large] = _label_step(U[large], counts[large], grid, beta_n, "gco_swap", mixed, stats)
    return W


@lru_cache(maxsize=64)
def _tie_break(m: int) -> np.ndarray:
    """tie[i, i']: input slot i loses an exact tie to slot i' (i > i')."""
    return np.tril(np.ones((m, m), bool), -1)


class _Sweeps(NamedTuple):
    """The options of Algorithm 1 (`comixup_masks`), validated by `_checked`."""

    beta: float
    gamma: float
    eta: float
    tau: float
    thres_type: str
    max_iter: int
    tol: float
    set_resolve: bool
    mixed_labels: bool
    method: str

    def _checked(self):
        _check_choice("thres_type", self.thres_type, THRES_TYPES)
        _check_choice("method", self.method, SOLVERS)
        if self.method == "gco_expansion" and self.mixed_labels:
            raise ValueError(
                "method='gco_expansion' needs mixed_labels=False: the squared-distance costs of "
                "blended labels are not a metric, and gco aborts the process on a non-metric expansion"
            )
        if not (isinstance(self.max_iter, int | np.integer) and self.max_iter >= 1):
            raise ValueError(f"max_iter={self.max_iter}: must be an integer >= 1")
        for name in ("beta", "gamma", "eta", "tau"):
            _check_range(name, getattr(self, name), 0.0, math.inf)
        if not self.tol >= 0:
            raise ValueError(f"tol={self.tol}: must be >= 0")
        return self


def _solve_partitions(s_grid, A, lam, z0, sizes, sweeps: _Sweeps, log=False):
    """Algorithm 1 on P padded partitions at once.

    s_grid: (P, m, n) normalised saliency; A: (P, m, m); lam: (P, m); z0: (P, m, n) initial input
    index of each cell; sizes: (P,) real inputs per partition (slots >= size are padding).
    A partition stops once a sweep changes its energy by less than tol relative to it.
    Returns source weights W (P, m', n, m) with m' = m (padding outputs are zero) and the log.
    """
    beta, gamma, eta, tau, thres_type, max_iter, tol, set_resolve, mixed_labels, method = sweeps
    P, m, n = s_grid.shape
    grid = math.isqrt(n)
    beta_n, gamma_n, eta_n, threshold = beta / n, gamma / n, eta / n, tau * n
    real = np.arange(m)[None, :] < sizes[:, None]
    label_step = _native_label_step if method == "exact" else _label_step
    cost = np.where(
        real[:, None, :], -s_grid.transpose(0, 2, 1) - eta_n * np.log(lam + 1e-8)[:, None, :], 0.0
    )
    unary_base = np.where(real[:, :, None], cost.transpose(0, 2, 1), np.inf)  # (P, m, n), as `_label_step`
    W = np.eye(m)[z0] * real[:, :, None, None]
    o = W.sum(2)
    total = o.sum(1)
    R = None  # the set-resolve penalty, from the last sweep on
    done = np.zeros(P, bool)
    energies = [_energy(W, cost, A, grid, beta_n, gamma_n, threshold, "none")]
    trace, stats, n_iter, err = [], {"gc_seconds": 0.0, "gc_calls": 0}, 0, math.inf
    for t in range(max_iter):
        if done.all():
            break
        n_iter += 1
        mixed = mixed_labels and t > 0
        live = ~done
        for j in range(m):
            act = (live & (j < sizes)).nonzero()[0]
            if act.size == 0:
                continue
            if act.size == P:  # all partitions: a slice indexes them by views instead of copies
                act = slice(None)
            others = total[act] - o[act, j]
            u = 2.0 * gamma_n * _diversity_cost(A[act], others, threshold, thres_type)
            if R is not None:
                u += gamma_n * R[act, j]
            z_j = label_step(unary_base[act] + u[:, :, None], o[act, j], grid, beta_n, method, mixed, stats)
            W[act, j] = z_j
            o_j = z_j.sum(1)
            total[act] += o_j - o[act, j]
            o[act, j] = o_j
            if log:
                trace.append(_energy(W, cost, A, grid, beta_n, gamma_n, threshold, thres_type, o))
        if set_resolve and t == max_iter - 2:
            R = _resolve(o)
        energies.append(_energy(W, cost, A, grid, beta_n, gamma_n, threshold, "none", o))
        change, size = np.abs(energies[-1] - energies[-2]), np.abs(energies[-1])
        done |= change < tol * size
        err = float((change / np.maximum(size, np.finfo(float).tiny)).max())
    info = None
    if log:
        info = {"n_iter": n_iter, "err": err, "converged": bool(done.all()), "energy": np.stack(energies),
                "trace": np.stack(trace), **stats}  # fmt: skip
    return W, info


def objective(
    masks,
    saliency_grid,
    lam,
    A,
    beta: float | None = None,
    gamma: float | None = None,
    eta: float | None = None,
    tau: float | None = None,
    thres_type: str = "none",
):
    """Energy f(z) of one partition (module docstring), in the units of normalised saliency.

    masks: (..., m', g, g, m) source weights z (leading dims are independent labelings);
    saliency_grid: (m, g, g) pooled saliency, normalised; lam: (m,) prior; A: (m, m); beta, gamma,
    eta, tau: None takes the default of `comixup`; thres_type "none" is the paper's Eq. 1.
    Returns a float, or an array of the leading shape.
    """
    _check_choice("thres_type", thres_type, THRES_TYPES)
    given = {"beta": beta, "gamma": gamma, "eta": eta, "tau": tau}
    beta, gamma, eta, tau = (_option_defaults()[k] if v is None else v for k, v in given.items())
    W = np.asarray(masks, dtype=np.float64)
    m_out, g, _, m = W.shape[-4:]
    lead = W.shape[:-4]
    n = g * g
    cost = -np.asarray(saliency_grid, dtype=np.float64).reshape(m, n).T - eta / n * np.log(
        np.asarray(lam) + 1e-8
    )
    W = W.reshape(-1, m_out, n, m)
    f = _energy(
        W,
        np.broadcast_to(cost, (len(W), n, m)),
        np.broadcast_to(np.asarray(A, float), (len(W), m, m)),
        g,
        beta / n,
        gamma / n,
        tau * n,
        thres_type,
    )
    return float(f[0]) if not lead else f.reshape(lead)


def comixup_masks(saliency_grid, A, lam, rng=None, log: bool = False, **options):
    """Algorithm 1 on one partition: masks (m', g, g, m) minimising `objective` (approximately).

    saliency_grid: (m, g, g) pooled, normalised saliency; A: (m, m) compatibility; lam: (m,) the
    Dirichlet draw. The start is iid uniform one-hot (from rng). `options` are those of `comixup`
    that Algorithm 1 takes (beta, gamma, eta, tau, thres_type, max_iter, tol, set_resolve,
    mixed_labels, method), with its defaults (the paper's). At most `max_iter` sweeps (the
    paper's 4), fewer once a sweep changes f by less than `tol` relative to
    it; `method` is the graph cut of `grid_cut`. The sweep count is
    the algorithm's budget, as in the paper, so stopping at max_iter does not warn. With log=True
    also returns a dict: `n_iter` (sweeps run), `err` (the last sweep's relative change of f),
    `converged` (err < tol), `energy` (unclipped f before and after each sweep), `trace` (f with
    the clipping rule after each output update), `gc_calls` and `gc_seconds` (time in the cuts).

    >>> s = np.random.default_rng(0).random((3, 2, 2))
    >>> s /= s.sum((1, 2), keepdims=True)
    >>> masks, info = comixup_masks(s, np.eye(3), np.full(3, 1 / 3), rng=0, log=True)
    >>> masks.shape, bool(np.allclose(masks.sum(-1), 1)), 1 <= info["n_iter"] <= 4
    ((3, 2, 2, 3), True, True)
    """
    unknown = set(options) - set(_Sweeps._fields)
    if unknown:
        raise ValueError(f"unknown option(s) {sorted(unknown)}; allowed: {', '.join(_Sweeps._fields)}")
    defaults = _option_defaults()
    sweeps = _Sweeps(*(options.get(k, defaults[k]) for k in _Sweeps._fields))
    s = np.asarray(saliency_grid, dtype=np.float64)
    m, g, _ = s.shape
    rng = np.random.default_rng(rng)
    z0 = rng.integers(0, m, size=(1, m, g * g))
    A, lam = np.asarray(A, float)[None], np.asarray(lam, float)[None]
    W, info = _solve_partitions(s.reshape(1, m, g * g), A, lam, z0, np.array([m]), sweeps._checked(), log)
    masks = W[0].reshape(m, g, g, m)
    if not log:
        return masks
    info["energy"], info["trace"] = info["energy"][:, 0], info["trace"][:, 0]
    return masks, info


# ----------------------------------------------------------------------------------------------
# batch transform


def comixup(
    x,
    y_onehot,
    saliency_maps,
    beta: float = 0.32,
    gamma: float = 1.0,
    eta: float = 0.05,
    tau: float = 0.83,
    thres_type: str = "hard",
    omega: float = 0.001,
    alpha: float = 2.0,
    grid: int = 4,
    part: int = 20,
    max_iter: int = 4,
    tol: float = 1e-6,
    set_resolve: bool = True,
    mixed_labels: bool = True,
    method: str = "exact",
    rng=None,
    log: bool = False,
    with_masks: bool = True,
):
    """Co-Mixup of a batch: x (B, C, H, W), y_onehot (B, K), saliency_maps (B, H, W) per-pixel saliency.

    The batch is cut into ceil(B / part) near-equal partitions, each mixed into as many outputs by
    `comixup_masks` (whose options, `max_iter`, `tol` and `method` included, these are). Returns
    (x_mixed (B, C, H, W), y_mixed (B, K), masks (B, g, g, B)) where masks[j, :, :, i] is the
    weight of input i in the cells of output j (zero outside j's partition) and
    y_mixed[j] = sum_i mean(masks[j, :, :, i]) y_onehot[i]; with_masks=False leaves the masks out
    (and unbuilt). Outputs are torch tensors on x's device when x is a tensor, numpy arrays
    otherwise. Only the partitions are solved on the host: the saliency is pooled and its salient
    boxes found on x's device and read in one copy, and the mix is made there from the cells'
    sources, sent back in one non-blocking copy. grid=-1 draws g from {2, 4, 8, 16} (among those
    dividing H and W) at every call. With log=True the log of `comixup_masks` (over all partitions:
    the most sweeps, the largest err; energies per partition) is returned last.

    >>> x, y = torch.rand(4, 3, 8, 8), torch.eye(4)
    >>> x_mix, y_mix, masks, info = comixup(x, y, torch.rand(4, 8, 8), grid=2, rng=0, log=True)
    >>> tuple(x_mix.shape), bool(torch.allclose(y_mix.sum(1), torch.ones(4))), sorted(info)[:3]
    ((4, 3, 8, 8), True, ['converged', 'energy', 'err'])
    """
    sweeps = _Sweeps(beta, gamma, eta, tau, thres_type, max_iter, tol, set_resolve, mixed_labels, method)
    problem = _prepare(x, y_onehot, saliency_maps, sweeps, omega, alpha, grid, part, rng)
    W, info = _solve_partitions(*problem["arrays"], sweeps, log=log)
    out = _mix(problem, W, with_masks)
    return (*out, info) if log else out


def choose_grid(grid: int, H: int, W: int, rng: np.random.Generator) -> int:
    """The partition grid's side for an H x W image: `grid`, or with grid=-1 one of RANDOM_GRIDS that
    divides the image, drawn from `rng`."""
    if grid == -1:
        choices = [c for c in RANDOM_GRIDS if H % c == 0 and W % c == 0]
        if not choices:
            raise ValueError(f"grid=-1: none of {RANDOM_GRIDS} divides the image size {H}x{W}")
        grid = int(rng.choice(choices))
    if not (isinstance(grid, int | np.integer) and grid >= 1 and H % grid == 0 and W % grid == 0):
        raise ValueError(f"grid={grid}: must be a positive divisor of the image size {H}x{W}, or -1")
    return grid


def split_options(**kwargs) -> tuple[_Sweeps, tuple]:
    """`comixup`'s keyword options (its defaults for the others): those of the sweeps, and (omega, alpha,
    grid, part)."""
    options = _option_defaults()
    unknown = set(kwargs) - set(options)
    if unknown:
        raise ValueError(f"unknown comixup option(s) {sorted(unknown)}; allowed: {sorted(options)}")
    options.update(kwargs)
    return _Sweeps(*(options[k] for k in _Sweeps._fields)), tuple(
        options[k] for k in ("omega", "alpha", "grid", "part")
    )


def _option_defaults() -> dict:
    """The keyword options of `comixup` that shape the mix (all but rng, log, with_masks), with defaults."""
    parameters = inspect.signature(comixup).parameters.items()
    calls = ("rng", "log", "with_masks")
    return {k: p.default for k, p in parameters if p.default is not p.empty and k not in calls}


def _prepare(x, y_onehot, saliency_maps, sweeps: _Sweeps, omega, alpha, grid, part, rng) -> dict:
    """Validate, summarise the batch on its device (`summarise`), read the summary (the one wait for the
    device) and set up the partitions from it (`plan`). x, y and the saliency stay where they are (numpy:
    torch views on the CPU)."""
    rng = np.random.default_rng(rng)
    problem = summarise(x, y_onehot, saliency_maps, sweeps, omega, alpha, grid, part, rng)
    return plan(problem, problem["summary"].cpu().numpy(), rng)


def summarise(x, y_onehot, saliency_maps, sweeps: _Sweeps, omega, alpha, grid, part, rng) -> dict:
    """Co-Mixup's device work before its host read: the options and the batch checked, the grid chosen
    (drawn from `rng` where grid=-1) and the batch summarised on x's device (`_batch_summary`). -> the
    problem so far: {"summary", "x", "y", "grid", "numpy_out", "shape": (omega, alpha, part)}."""
    sweeps._checked()
    _check_range("omega", omega, 0.0, 1.0)
    if not 0 < alpha < math.inf:
        raise ValueError(f"alpha={alpha}: must be a finite number > 0")
    if not (isinstance(part, int | np.integer) and part >= 2):
        raise ValueError(f"part={part}: must be an integer >= 2")
    numpy_out = not isinstance(x, torch.Tensor)
    x = torch.as_tensor(x)
    if x.ndim != 4:
        raise ValueError(f"x: shape {tuple(x.shape)}, expected (B, C, H, W)")
    B, _, H, W = x.shape
    if B < 2:
        raise ValueError(f"x: batch of {B}; mixing needs at least 2 inputs")
    y = torch.as_tensor(y_onehot, device=x.device)
    if y.ndim != 2 or y.shape[0] != B:
        raise ValueError(f"y_onehot: shape {tuple(y.shape)}, expected one-hot rows of shape ({B}, K)")
    s = torch.as_tensor(saliency_maps, device=x.device)
    if s.shape != (B, H, W):
        raise ValueError(f"saliency_maps: shape {tuple(s.shape)}, expected ({B}, {H}, {W})")
    grid = choose_grid(grid, H, W, rng)
    summary = _batch_summary(y, s, grid)
    return {"summary": summary, "x": x, "y": y, "grid": grid, "numpy_out": numpy_out,
            "shape": (omega, alpha, part)}  # fmt: skip


def plan(problem: dict, summary: np.ndarray, rng) -> dict:
    """On the host, from the summary `summarise` made, read: the partitions set up (`_partitions`, which
    draws lambda and the start from `rng`) -> the problem with the "arrays" of `_solve_partitions`, and
    "index"."""
    return problem | _partitions(summary, *problem["shape"][:2], problem["grid"], problem["shape"][2], rng)


def _batch_summary(y: torch.Tensor, s: torch.Tensor, grid: int) -> torch.Tensor:
    """What the host needs of the batch, computed on its device as one (B, n + 3) tensor (one copy to
    read): each map's saliency pooled to the g x g cells and normalised (n), its salient box's (row, col)
    and whether y's row is one-hot (1 or 0). In s's float dtype (float32 at least)."""
    dtype = torch.promote_types(s.dtype, torch.float32)
    one_hot = ((y == 0) | (y == 1)).all(1) & (y.sum(1) == 1)
    columns = (pool_saliency(s, grid).reshape(len(s), -1), salient_locations(s), one_hot[:, None])
    return torch.cat([c.to(dtype) for c in columns], 1)


def partition_slots(B: int, part: int) -> tuple[np.ndarray, np.ndarray]:
    """A batch of B split into ceil(B / part) near-equal partitions: (P, m) the batch index of each
    partition's slot (-1: padding to the largest, m) and (P,) their sizes."""
    chunks = np.array_split(np.arange(B), math.ceil(B / part))
    sizes = np.array([len(c) for c in chunks])
    index = np.full((len(chunks), sizes.max()), -1)
    for p, chunk in enumerate(chunks):
        index[p, : len(chunk)] = chunk
    return index, sizes


def _partitions(summary: np.ndarray, omega, alpha, grid: int, part, rng) -> dict:
    """From the batch summary (host): validate, split the batch into near-equal padded partitions, and
    build their compatibility and draw lambda and the start. -> {"arrays" of `_solve_partitions`,
    "index" (P, m) batch index of each partition slot (-1: padding), "grid"}."""
    n = grid * grid
    pooled = summary[:, :n].astype(np.float64)
    loc = summary[:, n : n + 2].astype(np.int64)
    if not (summary[:, n + 2] > 0).all():
        raise ValueError("y_onehot: has rows that are not one-hot")
    if not np.isfinite(pooled).all():
        raise ValueError("saliency_maps: contains NaN or inf")
    index, sizes = partition_slots(len(summary), part)
    real = index >= 0
    s_grid = pooled[index] * real[:, :, None]
    A = _compatibility_from_locations(loc[index], real, omega)
    gammas = rng.gamma(alpha, size=real.shape) * real
    underflow = np.flatnonzero(gammas.sum(1) == 0)
    if len(underflow):  # every draw underflowed (tiny alpha): the Dirichlet's mass sits on one vertex
        gammas[underflow, rng.integers(0, sizes[underflow])] = 1.0
    lam = gammas / gammas.sum(1, keepdims=True)
    z0 = rng.integers(0, sizes[:, None, None], size=(*real.shape, n))
    return {"arrays": (s_grid, A, lam, z0, sizes), "index": index, "grid": grid}


def _cell_sources(W: np.ndarray, index: np.ndarray) -> np.ndarray:
    """The solved weights W (P, m', n, m) as the mix needs them: per output (in batch order) and cell,
    the two inputs it draws on and their weights, packed (B, n, 4) [a, b, w_a, w_b] in float32 for one
    copy (batch indices and the weights 0, 1/2, 1 are exact there). A single-source cell has w_a = 0
    and a = b, so that no index is padding."""
    n = W.shape[2]
    out_rows = index.ravel() >= 0
    top2 = np.argsort(W, axis=-1)[..., -2:]  # (P, m', n, 2) partition slots of the two largest weights
    weights = np.take_along_axis(W, top2, axis=-1).reshape(-1, n, 2)[out_rows]
    sources = index[np.arange(len(index))[:, None, None, None], top2].reshape(-1, n, 2)[out_rows]
    order = np.argsort(index.ravel()[out_rows])  # outputs back in batch order
    sources, weights = sources[order], weights[order]
    sources[..., 0] = np.where(weights[..., 0] > 0, sources[..., 0], sources[..., 1])
    return np.concatenate([sources, weights], -1).astype(np.float32)


def _mix(problem: dict, W: np.ndarray, with_masks: bool):
    """Cell-wise mixing on x's device from the solved weights W (`mix_cells` of `_cell_sources`, sent in
    one non-blocking copy), in the type of the input x."""
    x = problem["x"]
    packed = to_device(_cell_sources(W, problem["index"]), x.device)
    out = mix_cells(x, problem["y"], packed, with_masks)
    return tuple(o.numpy() for o in out) if problem["numpy_out"] else out


def mix_cells(x: torch.Tensor, y: torch.Tensor, packed: torch.Tensor, with_masks: bool = False):
    """Cell-wise mixing on x's device, x_j = sum_i Z[j,i] * x_i, from `_cell_sources` (`packed`, on x's
    device, (B, g^2, 4)): a cell draws on at most two inputs, so the mix is two gathers instead of a B x B
    product, and y_mixed = (mean over cells of Z) @ y. Returns (x_mixed, y_mixed[, masks (B, g, g, B)]),
    float32 labels and masks."""
    B, n = len(x), packed.shape[1]
    g = math.isqrt(n)
    sources, weights = packed[..., :2].long(), packed[..., 2:]
    cells, cell_idx, w = _cells(x, g), torch.arange(n, device=x.device), weights.to(x.dtype)
    mixed = w[..., :1] * cells[sources[..., 0], cell_idx] + w[..., 1:] * cells[sources[..., 1], cell_idx]
    share = torch.zeros(B, B, device=x.device).scatter_add_(1, sources.reshape(B, -1), weights.reshape(B, -1))
    out = (_uncells(mixed, x.shape), (share / n) @ y.float())
    if with_masks:
        masks = torch.zeros(B, n, B, device=x.device).scatter_add_(2, sources, weights)
        out += (masks.reshape(B, g, g, B),)
    return out


def identity_sources(B: int, g: int) -> np.ndarray:
    """`_cell_sources` of the mix that keeps each input as it is (every cell its own, weight 1)."""
    own = np.broadcast_to(np.arange(B, dtype=np.float32)[:, None, None], (B, g * g, 2))
    weights = np.broadcast_to(np.array([0.0, 1.0], dtype=np.float32), (B, g * g, 2))
    return np.concatenate([own, weights], -1)


def _cells(x: torch.Tensor, g: int) -> torch.Tensor:
    """(B, C, H, W) -> (B, g^2, C H W / g^2): the g x g cells of each image, row by row."""
    B, C, H, W = x.shape
    return x.reshape(B, C, g, H // g, g, W // g).permute(0, 2, 4, 1, 3, 5).reshape(B, g * g, -1)


def _uncells(cells: torch.Tensor, shape) -> torch.Tensor:
    """The inverse of `_cells` for images of `shape`."""
    B, C, H, W = shape
    g = math.isqrt(cells.shape[1])
    return cells.reshape(B, g, g, C, H // g, W // g).permute(0, 3, 1, 4, 2, 5).reshape(B, C, H, W)


def auto_workers(batch_size: int, part: int, loader_workers: int = 0) -> int:
    """Solver threads worth starting for batches of `batch_size`: one per partition
    (ceil(batch_size / part)), at most this rank's share of the CPU cores it may run on (the cores
    divided by the ranks on this node, torchrun's LOCAL_WORLD_SIZE) less the rank's `loader_workers`
    (DataLoader processes), which decode while the cuts run: 16 cores and 8 loader workers leave 8."""
    share = usable_cores() // int(os.environ.get("LOCAL_WORLD_SIZE", 1)) - loader_workers
    return max(1, min(share, math.ceil(batch_size / part)))


class ComixupPool:
    """Co-Mixup with the partitions solved on `workers` threads, off the training thread.

    `submit(x, y_onehot, saliency_maps, **comixup_kwargs)` validates, reads the batch summary and
    draws the randomness in the caller, gives each thread a share of the partitions (views, nothing
    pickled) and returns; `.result()` on the returned handle waits and mixes, giving what `comixup`
    gives. The caller can meanwhile run other work, e.g. the weight backward of the clean loss. Use as a
    context manager or call `close()`.
    The C kernels run without the GIL (ctypes releases it); the numpy between them holds it, and gco's
    cuts take turns (`_GCO_LOCK`). The exact solver's DP solves every grid alone, so its masks do not
    depend on `workers`; gco's swap (the solver, or the DP's fallback past `_DP_MAX_WORK`) cuts a share's
    union of grids, which may stop at another local minimum than the whole batch's.
    """

    def __init__(self, workers: int = 2):
        if not (isinstance(workers, int) and workers >= 1):
            raise ValueError(f"workers={workers}: must be an integer >= 1")
        self.workers = workers
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="comixup")

    def submit(self, x, y_onehot, saliency_maps, rng=None, with_masks: bool = True, **kwargs) -> _PendingMix:
        sweeps, shape = split_options(**kwargs)
        return self.start(_prepare(x, y_onehot, saliency_maps, sweeps, *shape, rng), sweeps, with_masks)

    def start(self, problem: dict, sweeps: _Sweeps, with_masks: bool = False) -> _PendingMix:
        """The partitions of a problem set up on the host (`plan`) sent to the workers, each a share."""
        arrays = problem["arrays"]
        shares = np.array_split(np.arange(len(arrays[-1])), min(self.workers, len(arrays[-1])))
        futures = [
            self._executor.submit(_solve_partitions, *(a[share] for a in arrays), sweeps) for share in shares
        ]
        return _PendingMix(problem, futures, with_masks)

    def close(self):
        self._executor.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class _PendingMix:
    def __init__(self, problem: dict, futures: list[Future], with_masks: bool):
        self._problem, self._futures, self._with_masks = problem, futures, with_masks

    def weights(self) -> np.ndarray:
        """The solved weights W (P, m', n, m) of every partition, once the workers are done."""
        return np.concatenate([f.result()[0] for f in self._futures])

    def sources(self) -> np.ndarray:
        """`_cell_sources` of the solved weights, for `mix_cells`."""
        return _cell_sources(self.weights(), self._problem["index"])

    def result(self):
        return _mix(self._problem, self.weights(), self._with_masks)


# ----------------------------------------------------------------------------------------------
# argument checks


def _check_range(name, value, lo, hi):
    if not (isinstance(value, int | float | np.floating | np.integer) and lo <= value <= hi):
        raise ValueError(f"{name}={value}: must be a number in [{lo}, {hi}]")


def _check_choice(name, value, allowed):
    if value not in allowed:
        raise ValueError(f"{name}={value!r}: must be one of {', '.join(allowed)}")
