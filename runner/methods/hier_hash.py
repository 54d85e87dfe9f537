r"""Hierarchically quantized hash codes learned by cascaded min-cost flow.

Jeong, Kim & Song, "End-to-End Efficient Representation Learning via Cascading Combinatorial
Optimization", CVPR 2019 (single-level special case: Jeong & Song, ICML 2018).

A hash net outputs ``d*k`` activations, ``k`` levels of ``d``. An item's code is a path in a
``d``-ary tree of depth ``k``: argmax at levels ``1..k-1`` and the top-``ks`` at level ``k``, so it
lands in ``ks`` of ``d**k`` leaf buckets (Eq. 1). Training alternates per mini-batch between exact
class-level codes (``assign_codes``, one min-cost flow per level, cascaded by ``cascade_codes``)
and a metric-learning step measured on the code-active dimensions only (``hash_loss``).

Per level, with class unaries ``c_p`` (``nc x d``), binary codes ``z_p`` with ``|z_p|_1 = s``,
sibling groups ``r`` (classes whose codes agree at every earlier level), bucket loads
``y_q = sum_p z_p[q]`` and group loads ``y_{r,q} = sum_{p in r} z_p[q]``, the energy is

    E(z) = - sum_p c_p . z_p + alpha sum_r sum_q y_{r,q}(y_{r,q}-1)/2 + beta sum_q y_q(y_q-1)/2

(alpha per pair of siblings sharing a child, beta per pair of classes sharing a bucket; the paper
sums ordered pairs, ``alpha_paper = alpha / 2``). Theorem 1: E is minimized exactly by a min-cost
flow on ``s -> a_p -> [b_{r,q}] -> b_q -> t`` whose convex parallel arcs price the i-th unit of
load at ``i*alpha`` (group layer) and ``j*beta`` (bucket layer).

Arrays in, arrays out; no Hydra, no files. The numpy parts (flow, buckets, index, metrics) and the
torch parts (losses) share nothing but shapes. The code solvers follow the convention of
:mod:`runner.methods._common` (``method=`` picks the algorithm: a min-cost flow by a library or by this
module's own successive shortest paths in C, or at one bucket per class the assignment of classes to bucket
slots).
"""

from __future__ import annotations

import ctypes as ct
import functools
import math
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from scipy.sparse import coo_matrix, csr_matrix

from runner.methods._common import integral_solution
from runner.methods._native import load as load_native
from runner.methods._native import pointer

__all__ = [
    "ASSIGNMENT_MAX_CLASSES",
    "FLOW_SOLVERS",
    "LOSSES",
    "SOLVERS",
    "SSP_MAX_CLASSES",
    "FlowNetwork",
    "HashIndex",
    "assign_codes",
    "bucket_ids",
    "bundle_cap",
    "cascade_codes",
    "class_unaries",
    "code_energy",
    "decode_buckets",
    "encode_buckets",
    "exhaustive_search",
    "flow_network",
    "hash_loss",
    "level_labels",
    "lsh_activations",
    "masked_distance",
    "nmi",
    "npairs_loss",
    "precision_at_k",
    "probe_buckets",
    "remap_labels",
    "speedup_factor",
    "triplet_semihard_loss",
]

FLOW_SOLVERS = ("networkx", "ortools", "highs")  # min-cost flow on the network of Theorem 1 (`flow_network`)
SOLVERS = (*FLOW_SOLVERS, "assignment", "ssp")  # the values of `method=`
# `method="assignment"` hands a level to OR-tools' flow past this many classes: its dense matrix and
# augmenting paths grow with the classes squared
ASSIGNMENT_MAX_CLASSES = 256
# `method="ssp"` hands a level with s > 1 to OR-tools' flow past this many classes: its paths then grow long
# (a 512-class, d = 512 cascade at ks = 3, its second level on ssp: 108 / 148 ms against OR-tools'
# 112 / 119 ms on independent unaries of spread 0.05 / 0.5, 88 against 158 ms on a shared preference; at
# s = 1 it stays 3-4x faster than OR-tools)
SSP_MAX_CLASSES = 256
LOSSES = ("triplet", "npairs")


# Integer backends price arcs in units of 1/cost_scale. OR-tools' cost scaling needs
# max|cost| * (n_nodes + 1) well inside int64; 2**56 leaves a 64x margin.
_INT_COST_BUDGET = 2.0**56
_MAX_COST_SCALE = 1e12


# --------------------------------------------------------------------------------------------
# Min-cost flow code assignment
# --------------------------------------------------------------------------------------------


class FlowNetwork(NamedTuple):
    """Arc list of the network of Theorem 1.

    Nodes: 0 = s, 1 = t, 2..nc+1 = a_p, then d bucket nodes b_q, then d nodes b_{r,q} per sibling
    group of size >= 2. Arcs in order: nc source arcs, nc*d unary arcs (row-major over (p, q)),
    sibling arcs, sink arcs.
    """

    tail: np.ndarray  # (n_arcs,) int
    head: np.ndarray  # (n_arcs,) int
    capacity: np.ndarray  # (n_arcs,) int
    cost: np.ndarray  # (n_arcs,) float, in energy units
    supply: np.ndarray  # (n_nodes,) int, +nc*s at s, -nc*s at t

    @property
    def n_nodes(self) -> int:
        return len(self.supply)

    def incidence(self) -> csr_matrix:
        """Node-arc incidence (n_nodes, n_arcs): +1 at an arc's tail, -1 at its head, so that a flow x
        is feasible iff ``incidence() @ x == supply`` and 0 <= x <= capacity (the LP of Theorem 1)."""
        n_arcs = len(self.tail)
        arc = np.arange(n_arcs)
        return coo_matrix(
            (np.r_[np.ones(n_arcs), -np.ones(n_arcs)], (np.r_[self.tail, self.head], np.r_[arc, arc])),
            shape=(self.n_nodes, n_arcs),
        ).tocsr()


def _check_unary(unary) -> np.ndarray:
    unary = np.asarray(unary, dtype=np.float64)
    if unary.ndim != 2 or min(unary.shape) < 1:
        raise ValueError(f"unary has shape {unary.shape}: must be a non-empty 2-D array (nc classes x d)")
    if not np.isfinite(unary).all():
        bad = tuple(int(i) for i in np.argwhere(~np.isfinite(unary))[0])
        raise ValueError(f"unary[{bad}]={unary[bad]}: unary must be finite (no NaN or inf)")
    return unary


def _check_problem(unary, sparsity, alpha, beta, groups):
    unary = _check_unary(unary)
    nc, d = unary.shape
    if isinstance(sparsity, bool) or int(sparsity) != sparsity or not 1 <= sparsity <= d:
        raise ValueError(f"sparsity={sparsity}: must be an integer in [1, d={d}]")
    for name, value in (("alpha", alpha), ("beta", beta)):
        if not (np.isfinite(value) and value >= 0):
            raise ValueError(f"{name}={value}: must be finite and >= 0")
    if groups is not None:
        groups = np.asarray(groups)
        if groups.shape != (nc,) or not np.issubdtype(groups.dtype, np.integer):
            raise ValueError(
                f"groups has shape {groups.shape} and dtype {groups.dtype}: "
                f"must be one integer group id per class, shape ({nc},)"
            )
    return unary, int(sparsity), float(alpha), float(beta), groups


def bundle_cap(n, sparsity, d, load_factor):
    """Arcs kept in a bundle serving n classes: min(n, f * ceil(n * s / d) + 1); all if f is None."""
    n = np.asarray(n)
    if load_factor is None:
        return n
    return np.minimum(n, load_factor * -(-n * sparsity // d) + 1)


def bucket_load_bound(unary, sparsity, beta, largest_group=1) -> np.ndarray:
    r"""An upper bound on each bucket's load ``y_q`` at every minimizer of ``code_energy``, from the unaries.

    .. math::
        y_q \le 1 + L + \Big\lfloor \max_p \big(c_p[q] - \min_{q'} c_p[q']\big) / \beta \Big\rfloor,
        \quad L = \Big\lfloor \frac{n_c s}{d - g s} \Big\rfloor

    (``nc`` where ``beta = 0`` or ``d <= g s``; never above ``nc``), ``g`` the largest sibling group (1
    without groups). Why: moving class p's unit from bucket q to a bucket q' that p and its siblings leave
    empty (at least ``d - g s`` of them, so one holds at most L classes) changes the energy by
    ``c_p[q] - c_p[q'] + beta (y_q' - y_q + 1) - alpha (y_{r,q} - 1)``, which a minimizer keeps >= 0.
    Bundles of the flow network cut at these loads keep every minimizer: one solve, where uniform caps
    had to double (and re-solve) whenever the classes crowd into the buckets they all prefer.
    """
    unary = _check_unary(unary)
    nc, d = unary.shape
    free = d - largest_group * sparsity
    if beta <= 0 or free <= 0:
        return np.full(d, nc)
    gain = (unary - unary.min(1, keepdims=True)).max(0)  # (d,) the most any class gains by bucket q
    bound = 1 + nc * sparsity // free + np.floor(gain / beta + 1e-9)  # a tie rounded below still counts
    return np.minimum(bound, nc).astype(np.int64)


def siblings_never_share(unary, sparsity, alpha, beta, groups) -> np.ndarray:
    r"""Per sibling group (in ``np.unique(groups)`` order): True where no minimizer of ``code_energy``
    puts two of its classes in one bucket, as the sibling penalty outweighs any gain from sharing.

    .. math::
        \alpha > \max_{p \in r} \big(\max_q c_p[q] - \min_q c_p[q]\big) + \beta (L_r - 1),
        \quad L_r = \Big\lfloor \frac{n_c s - 2}{d - g_r s + 1} \Big\rfloor, \quad g_r s \le d

    (always True for a group of one). Why: if siblings share bucket q (``y_{r,q} >= 2``, so ``y_q >= 2``),
    the ``g_r`` classes of group r cover at most ``g_r s - 1`` buckets, so at least ``d - g_r s + 1`` hold
    none of them; those hold at most ``nc s - 2`` units, so one, q', holds at most L_r. Moving a sharing
    class p from q to q' changes the energy by
    ``c_p[q] - c_p[q'] + beta (y_q' - y_q + 1) - alpha (y_{r,q} - 1) <= range_p + beta (L_r - 1) - alpha``,
    below 0: no minimizer shares. Such a group's bundles ``b_{r,q} -> b_q`` need only their free first arc.
    """
    unary, sparsity, alpha, beta, groups = _check_problem(unary, sparsity, alpha, beta, groups)
    return _never_share(unary, sparsity, alpha, beta, *_sibling_groups(groups, len(unary)))


def _never_share(unary, sparsity, alpha, beta, group_of, group_size) -> np.ndarray:
    """``siblings_never_share`` of checked arguments, the groups given as ``_sibling_groups`` returns them."""
    nc, d = unary.shape
    largest = int(group_size.max())  # L_r grows with the group: the largest's, with the range of all unaries
    free = d - largest * sparsity + 1  # (which bounds each group's), passing says the same for every group
    if free >= 1 and alpha > float(unary.max() - unary.min()) + beta * ((nc * sparsity - 2) // free - 1):
        return np.ones(len(group_size), bool)
    free = d - group_size * sparsity + 1
    least_load = (nc * sparsity - 2) // np.maximum(free, 1)  # L_r, where free >= 1
    class_range = np.ptp(unary, axis=1)
    group_range = np.zeros(len(group_size))
    np.maximum.at(group_range, group_of, class_range)
    return (group_size < 2) | ((free >= 1) & (alpha > group_range + beta * (least_load - 1)))


def _sibling_groups(groups, nc):
    """Group index per class (0..n_groups-1, the order of ``np.unique``) and the groups' sizes."""
    if groups is None:
        return np.arange(nc), np.ones(nc, np.int64)
    if groups.dtype.kind == "i" and groups.min() >= 0:  # ids 0..n-1, none missing (a cascade's), stay
        group_size = np.bincount(groups)
        if group_size.all():
            return groups, group_size
    group_of = np.unique(groups, return_inverse=True)[1].reshape(nc)
    return group_of, np.bincount(group_of)


def _convex_arcs(tails, heads, counts, unit_cost):
    """``counts[i]`` parallel unit-capacity arcs ``tails[i] -> heads[i]`` costing 0, u, 2u, ..."""
    first = np.repeat(np.cumsum(counts) - counts, counts)
    index = np.arange(counts.sum()) - first
    return np.repeat(tails, counts), np.repeat(heads, counts), np.ones(len(index), int), unit_cost * index


def flow_network(
    unary, sparsity, alpha, beta, groups=None, load_factor=None, bucket_caps=None, sibling_caps=None
) -> FlowNetwork:
    """The min-cost-flow network whose optimum is the minimizer of ``code_energy``.

    Arcs (capacity, cost): ``s->a_p`` (s, 0); ``a_p->b_{r,q}`` if p has siblings else
    ``a_p->b_q`` (1, -c_p[q]); ``g_r`` parallel ``b_{r,q}->b_q`` (1, i*alpha), i < g_r;
    ``nc`` parallel ``b_q->t`` (1, j*beta), j < nc. Size: ``V = nc + d(1 + #groups) + 2``,
    ``E <= nc + 3*nc*d``. ``load_factor`` f keeps only the first ``bundle_cap(n, s, d, f)`` arcs
    of each bundle of n parallel arcs (higher loads become infeasible); None keeps all (Theorem 1).
    ``bucket_caps`` (d,) sets the bucket bundles' arc counts instead (``b_q->t``, each at most nc), and
    ``sibling_caps`` (n_groups,) those of the sibling bundles (``b_{r,q}->b_q``, groups in ``np.unique``
    order).
    """
    unary, sparsity, alpha, beta, groups = _check_problem(unary, sparsity, alpha, beta, groups)
    nc, d = unary.shape
    if bucket_caps is None:
        bucket_caps = np.full(d, bundle_cap(nc, sparsity, d, load_factor))
    group_of, group_size = _sibling_groups(groups, nc)
    if sibling_caps is None:
        sibling_caps = bundle_cap(group_size, sparsity, d, load_factor)
    sibling_groups = np.flatnonzero(group_size >= 2)
    layer = np.full(len(group_size), -1)
    layer[sibling_groups] = np.arange(len(sibling_groups))

    a = 2 + np.arange(nc)
    b = 2 + nc + np.arange(d)
    b_group = 2 + nc + d + layer[:, None] * d + np.arange(d)  # (n_groups, d), valid where layer >= 0
    unary_head = np.where((group_size[group_of] >= 2)[:, None], b_group[group_of], b[None, :])
    parts = [
        (np.zeros(nc, int), a, np.full(nc, sparsity), np.zeros(nc)),
        (np.repeat(a, d), unary_head.ravel(), np.ones(nc * d, int), -unary.ravel()),
        _convex_arcs(
            b_group[sibling_groups].ravel(),
            np.tile(b, len(sibling_groups)),
            np.repeat(sibling_caps[sibling_groups], d),
            alpha,
        ),
        _convex_arcs(b, np.ones(d, int), bucket_caps, beta),
    ]
    tail, head, capacity, cost = (np.concatenate(column) for column in zip(*parts))
    supply = np.zeros(2 + nc + d * (1 + len(sibling_groups)), dtype=np.int64)
    supply[0], supply[1] = nc * sparsity, -nc * sparsity
    return FlowNetwork(tail.astype(np.int64), head.astype(np.int64), capacity.astype(np.int64), cost, supply)


def _auto_cost_scale(net: FlowNetwork) -> float:
    max_cost = max(float(np.abs(net.cost).max()), 1.0)
    return min(
        _MAX_COST_SCALE, 2.0 ** math.floor(math.log2(_INT_COST_BUDGET / (max_cost * (net.n_nodes + 1))))
    )


def _flow_networkx(net: FlowNetwork, int_cost: np.ndarray) -> np.ndarray:
    import networkx as nx

    graph = nx.MultiDiGraph()
    # networkx's demand is the negated supply
    graph.add_nodes_from((node, {"demand": -int(s)}) for node, s in enumerate(net.supply))
    graph.add_edges_from(
        (int(u), int(v), i, {"capacity": int(c), "weight": int(w)})
        for i, (u, v, c, w) in enumerate(zip(net.tail, net.head, net.capacity, int_cost))
    )
    _, flow_dict = nx.network_simplex(graph)
    return np.array(
        [flow_dict[u][v][i] for i, (u, v) in enumerate(zip(net.tail.tolist(), net.head.tolist()))]
    )


def _flow_ortools(net: FlowNetwork, int_cost: np.ndarray) -> np.ndarray:
    from ortools.graph.python import min_cost_flow

    solver = min_cost_flow.SimpleMinCostFlow()
    arcs = solver.add_arcs_with_capacity_and_unit_cost(net.tail, net.head, net.capacity, int_cost)
    solver.set_nodes_supplies(np.arange(net.n_nodes), net.supply)
    status = solver.solve()
    if status != solver.OPTIMAL:
        raise RuntimeError(f"OR-tools min-cost flow returned {status}")
    return np.asarray(solver.flows(arcs))


def _flow_highs(net: FlowNetwork) -> np.ndarray:
    from scipy.optimize import linprog

    bounds = np.stack([np.zeros(len(net.tail)), net.capacity], axis=1)
    unit = max(float(np.abs(net.cost).max()), np.finfo(float).tiny)  # HiGHS's tolerances are absolute
    res = linprog(net.cost / unit, A_eq=net.incidence(), b_eq=net.supply, bounds=bounds, method="highs-ds")
    if res.status != 0:
        raise RuntimeError(f"HiGHS failed on the flow LP: {res.message}")
    return integral_solution(res.x, "flow")  # totally unimodular constraints: a vertex is integral


def _slot_assignment(unary, beta, group_of, load_bound):
    r"""Exact minimizer of ``code_energy`` at one bucket per class (s = 1) as a linear assignment of classes
    to bucket slots, for a level whose sibling groups never share a bucket (``siblings_never_share``).

    Rows are the classes p, columns the slots j = 0, 1, ... of each bucket q:

    .. math:: C[p, (q, j)] = -c_p[q] + \beta j

    Slot costs increase in j, so a minimum assignment fills each bucket's cheapest slots and prices a load
    y at :math:`\beta \binom{y}{2}`: without siblings in one bucket, E is this assignment's cost. Where
    siblings would meet, the pair (group r, bucket q) gets a node of throughput one, a row and a column,
    through which r's classes reach q's slots (row unused: the node's own column, cost 0). Pairs are
    constrained before the first solve where two siblings share a best bucket, then wherever a solve put
    two siblings in one bucket; with some pairs unconstrained the assignment is a relaxation, so the first
    solution without siblings in one bucket is optimal. Bucket q starts with a slot more than the classes
    that prefer it, or ``load_bound[q]`` (at most that), and doubles the slots when all are taken: an
    untaken slot of q costs no more than the ones left out, and no minimizer loads q beyond
    ``load_bound[q]`` (``bucket_load_bound``).

    Returns (z, assignment cost, solves, pair nodes), or None where the flow is the faster solver: a bucket
    starts with more slots than four times the mean load plus four, or as many classes share a best bucket
    at more than 64 classes (classes crowd it: augmenting paths then cross most rows), or more (group,
    bucket) pairs need a node than half the classes before the first solve, or than the classes after it.
    """
    from scipy.optimize import linear_sum_assignment

    nc, d = unary.shape
    best = unary.argmax(1)
    best_count, mean_load = np.bincount(best, minlength=d), -(-nc // d)
    # slots to start with: one above the larger of the loads of the classes' best buckets before and after
    # pricing each bucket's load at beta per class (or the mean load); the loads' bound where that is small
    # or the classes crowd a few best buckets (the guess then falls short and costs a second solve)
    priced_count = np.bincount((unary - beta * best_count).argmax(1), minlength=d)
    caps = np.minimum(load_bound, np.maximum(np.maximum(best_count, priced_count), mean_load) + 1)
    crowd = 4 * mean_load + 4
    crowded = best_count.max() > crowd
    if crowded and nc > 64:  # its augmenting paths cross most rows: 0.6-0.8x OR-tools' at 100-256 classes
        return None
    if load_bound.sum() <= 2 * nc or crowded or caps.sum() < nc:
        caps = load_bound  # (every minimizer's loads fit the bound, so its slots hold all classes)
    if caps.max() > crowd:
        return None
    constrained = np.zeros((group_of.max() + 1, d), dtype=bool)
    repeated = (np.bincount(group_of * d + best, minlength=constrained.size) > 1).reshape(constrained.shape)
    n_solves = 0
    while True:
        if repeated.any():
            constrained |= _crowded_pairs(unary, group_of, repeated)
            if constrained.sum() > (nc if n_solves else nc // 2):  # many before a solve: many after
                return None
        n_solves += 1
        slot_bucket, _, _, slot_cost = _convex_arcs(np.arange(d), np.arange(d), caps, beta)  # slot j: j beta
        cost = slot_cost - unary[:, slot_bucket]
        pair_group, pair_bucket = np.nonzero(constrained)
        if len(pair_group):
            cost = _with_pair_nodes(cost, unary, group_of, slot_bucket, slot_cost, constrained)
        try:
            rows, cols = linear_sum_assignment(cost)
        except ValueError:  # too few slots for the constrained pairs: take the bound's
            if (caps == load_bound).all():
                raise
            caps, repeated = load_bound, np.zeros_like(constrained)
            continue
        bucket = np.r_[slot_bucket, pair_bucket][cols[:nc]]
        repeated = (np.bincount(group_of * d + bucket, minlength=constrained.size) > 1).reshape(
            constrained.shape
        )
        filled = (np.bincount(bucket, minlength=d) >= caps) & (caps < load_bound)
        if not repeated.any() and not filled.any():
            z = np.zeros((nc, d), dtype=np.int64)
            z[np.arange(nc), bucket] = 1
            return z, float(cost[rows, cols].sum()), n_solves, len(pair_group)
        caps = np.where(filled, np.minimum(2 * caps, load_bound), caps)


def _with_pair_nodes(cost, unary, group_of, slot_bucket, slot_cost, constrained):
    """The classes x slots ``cost`` with a node of throughput one per constrained (group r, bucket q): r's
    classes reach q's slots only through its column (cost -c_p[q]) and row (q's slot costs; its own column
    at 0 when unused)."""
    pair_group, pair_bucket = np.nonzero(constrained)
    (nc, n_slots), n_pairs = cost.shape, len(pair_group)
    full = np.full((nc + n_pairs, n_slots + n_pairs), np.inf)
    full[:nc, :n_slots] = np.where(constrained[group_of][:, slot_bucket], np.inf, cost)
    full[:nc, n_slots:] = np.where(group_of[:, None] == pair_group, -unary[:, pair_bucket], np.inf)
    full[nc:, :n_slots] = np.where(slot_bucket == pair_bucket[:, None], slot_cost, np.inf)
    full[nc + np.arange(n_pairs), n_slots + np.arange(n_pairs)] = 0.0
    return full


def _crowded_pairs(unary, group_of, repeated):
    """(group, bucket) pairs to constrain where the ``repeated`` pairs hold (or would hold) two siblings:
    those, and for each such group of g_r classes the g_r best buckets of each member, which its classes
    crowd next (one solve instead of one per bucket)."""
    rank = np.argsort(np.argsort(-unary, axis=1), axis=1)  # 0: the class's best bucket
    best = rank < np.bincount(group_of)[group_of, None]
    crowded = np.zeros(repeated.shape, dtype=bool)
    np.logical_or.at(crowded, group_of, best)
    return repeated | (crowded & repeated.any(1, keepdims=True))


@functools.cache
def _native_hash_flow():
    """`hash_flow.c`'s solver of one level (its equation and algorithm are in the source)."""
    solve = load_native("hash_flow", instead="method.solver=assignment").hash_flow
    ptr, i32, f64 = ct.c_void_p, ct.c_int, ct.c_double
    solve.argtypes = [i32, i32, i32, ptr, ptr, i32, ptr, f64, f64, i32, ptr, ptr]
    solve.restype = ct.c_long
    return solve


def _successive_shortest_paths(unary, sparsity, alpha, beta, group_of, group_size, forward_sources=None):
    r"""Exact minimizer of ``code_energy`` by successive shortest paths on the network of Theorem 1, in C with
    float64 costs (``hash_flow.c``, whose header states the algorithm): one Dijkstra run per unit of class
    supply on the reduced costs, from the sink back to the nearest class with units left, or forward from
    those classes once at most ``forward_sources`` of them are left (default: under 1/12 of the classes, 1/16
    at one bucket a class); each convex bundle one residual arc each way at its marginal cost (``y alpha``,
    ``y beta``), a sibling group's node in bucket q only while one of its classes is there, and without its
    arcs priced alpha where its classes never share a bucket (``siblings_never_share``).

    Returns (z, flow cost = the sum of the augmenting paths' costs, nodes scanned by all Dijkstra runs).
    """
    nc, d = unary.shape
    if forward_sources is None:  # where forward runs were the faster, at the CIFAR presets' shapes
        forward_sources = (nc - 1) // (16 if sparsity == 1 else 12)
    has_siblings = group_size >= 2
    sibling_group = np.where(has_siblings, np.cumsum(has_siblings) - 1, -1)[group_of].astype(np.intc)
    unary = np.require(unary, np.float64, ["C", "W"])
    shares = np.empty(0, np.uint8)
    if has_siblings.any():
        never = _never_share(unary, sparsity, alpha, beta, group_of, group_size)
        shares = (~never[has_siblings]).astype(np.uint8)
    z, flow_cost = np.empty((nc, d), np.uint8), np.empty(1)
    solve = _native_hash_flow()
    scanned = solve(nc, d, sparsity, pointer(unary), pointer(sibling_group), len(shares), pointer(shares),
                    alpha, beta, forward_sources, pointer(z), pointer(flow_cost))  # fmt: skip
    if scanned == -1:
        raise MemoryError(f"hash_flow.c: out of memory for {nc} classes x {d} buckets")
    if scanned < 0:  # never met in tests or fuzzing: shares follows siblings_never_share
        raise RuntimeError(f"hash_flow.c: no augmenting path to follow ({nc} x {d}, s={sparsity})")
    return z.astype(np.int64), float(flow_cost[0]), scanned


def _solve_flow(net: FlowNetwork, method, cost_scale):
    """Per-arc optimal flow, its cost in energy units, and the integer cost scale used."""
    if method == "highs":
        flow = _flow_highs(net)
        return flow, float(flow @ net.cost), None
    scale = float(cost_scale) if cost_scale is not None else _auto_cost_scale(net)
    if cost_scale is not None and np.abs(net.cost).max() * scale * (net.n_nodes + 1) > _INT_COST_BUDGET:
        raise ValueError(
            f"cost_scale={cost_scale}: the integer costs times the node count would pass 2^56 (their "
            f"int64 headroom); at most {_auto_cost_scale(net):.3g} here, or None to choose it"
        )
    int_cost = np.rint(net.cost * scale).astype(np.int64)
    flow = _flow_ortools(net, int_cost) if method == "ortools" else _flow_networkx(net, int_cost)
    return flow, float(flow @ int_cost) / scale, scale


def assign_codes(
    unary, sparsity, alpha, beta, groups=None, method="networkx", cost_scale=None, log=False
) -> np.ndarray | tuple[np.ndarray, dict]:
    r"""Exact minimizer of the per-level code energy (see ``code_energy``) by min-cost flow.

    .. math::
        z^* = \arg\min_{z \in \{0,1\}^{nc \times d},\ |z_p|_1 = s} E(z)

    Parameters
    ----------
    unary : (nc, d) array
        Class unaries ``c_p`` (class means of one level of hash activations).
    sparsity : int
        Active bits per class ``s`` (1 below the last level, ``ks`` at the last), ``1 <= s <= d``.
    alpha, beta : float >= 0
        Sibling penalty per pair of classes in one group sharing a bucket; orthogonality penalty
        per pair of any classes sharing a bucket.
    groups : (nc,) int array, optional
        Sibling group id per class (equal ids = equal codes at all earlier levels); ``None`` means
        no siblings (level 1).
    method : {"networkx", "ortools", "highs", "assignment", "ssp"}
        The algorithm. ``networkx``: network simplex on a
        MultiDiGraph (the reference). ``ortools``: OR-tools' C++ cost-scaling min-cost flow.
        ``highs``: dual simplex on the arc LP with float costs (integral vertex by total
        unimodularity, asserted). ``assignment``: scipy's ``linear_sum_assignment`` of classes to
        bucket slots with float costs (``_slot_assignment``) at one bucket per class, up to
        ``ASSIGNMENT_MAX_CLASSES`` classes, where siblings never share a bucket and the classes do not
        crowd a few; OR-tools' flow elsewhere (the log's ``method`` says which ran). ``ssp``: successive
        shortest paths on the network of Theorem 1 in C with float costs (``_successive_shortest_paths``,
        ``hash_flow.c``), every level shape but s > 1 past ``SSP_MAX_CLASSES`` classes, which goes to
        OR-tools' flow; the fastest on the CIFAR presets' levels.
    cost_scale : float, optional
        Integer backends (networkx, ortools) solve with costs ``round(cost * cost_scale)``; the result is
        exactly optimal for those costs, i.e. within ``n_flow_arcs / cost_scale`` of the float optimum.
        Default: the largest power of two that keeps OR-tools' arithmetic in int64 (<= 1e12).
    log : bool
        Also return a dict: ``n_iter`` (flow problems solved: the bundle caps double until no bundle
        is full), ``err`` (|flow cost - E(z)|, the integer-cost rounding; 0 for ``highs``),
        ``converged`` (True: the solve is exact), ``energy``, ``flow_cost`` (in energy units),
        ``flow`` (per arc), ``network`` (the ``FlowNetwork`` last solved), ``load_factor`` (the caps of
        its sibling bundles that may share), ``bucket_caps`` (its bucket bundles' arcs, from
        ``bucket_load_bound``), ``cost_scale``, ``method`` (the solver that ran). From the assignment:
        ``n_iter`` (assignments solved), ``err``, ``converged``, ``energy``, ``flow_cost`` (the
        assignment's cost), ``method``, ``pair_nodes`` (its sibling (group, bucket) nodes). From ``ssp``:
        ``n_iter`` (augmenting paths, ``nc * sparsity``), ``err``, ``converged``, ``energy``, ``flow_cost``
        (the paths' summed costs), ``method``, ``nodes_scanned`` (by all its Dijkstra runs).

    Returns
    -------
    z : (nc, d) int64 array of 0/1, each row summing to ``sparsity``.

    Examples
    --------
    Two classes both prefer bucket 0; the orthogonality penalty beta sends the weaker one away:

    >>> unary = np.array([[1.0, 0.9], [1.0, 0.2]])
    >>> assign_codes(unary, 1, alpha=0.0, beta=0.5, method="highs").tolist()
    [[0, 1], [1, 0]]
    """
    if method not in SOLVERS:
        raise ValueError(f"method={method!r}: must be one of {SOLVERS}")
    if cost_scale is not None and not (np.isfinite(cost_scale) and cost_scale > 0):
        raise ValueError(f"cost_scale={cost_scale}: must be a positive finite number or None")
    unary, sparsity, alpha, beta, groups = _check_problem(unary, sparsity, alpha, beta, groups)
    nc, d = unary.shape
    if alpha == 0:
        groups = None  # without their penalty, siblings are classes like any other
    group_of, group_size = _sibling_groups(groups, nc)
    if method == "ssp" and sparsity > 1 and nc > SSP_MAX_CLASSES:
        method = "ortools"
    if method == "ssp":
        z, flow_cost, scanned = _successive_shortest_paths(unary, sparsity, alpha, beta, group_of, group_size)
        if not log:
            return z
        energy = code_energy(z, unary, alpha, beta, groups)
        info = {"n_iter": nc * sparsity, "err": abs(flow_cost - energy), "converged": True, "method": method}
        return z, {**info, "energy": energy, "flow_cost": flow_cost, "nodes_scanned": scanned}
    load_bound = bucket_load_bound(unary, sparsity, beta, group_size.max())  # the assignment's and the flow's
    # the groups found above (without siblings, at level 1, every class is a group of one, which never shares)
    never_share = _never_share(unary, sparsity, alpha, beta, group_of, group_size)
    if method == "assignment":
        solved = None
        if sparsity == 1 and never_share.all() and nc <= ASSIGNMENT_MAX_CLASSES:
            solved = _slot_assignment(unary, beta, group_of, load_bound)
        if solved is not None:
            z, cost, n_solves, pair_nodes = solved
            if not log:
                return z
            energy = code_energy(z, unary, alpha, beta, groups)
            info = {"n_iter": n_solves, "err": abs(cost - energy), "converged": True, "method": method}
            return z, {**info, "energy": energy, "flow_cost": cost, "pair_nodes": pair_nodes}
        method = "ortools"  # s > 1, siblings that may share, many classes, crowded buckets or many pairs
    # Solve with few parallel arcs per bundle first: if no bundle is filled, the flow is also
    # optimal for the full network (a negative residual cycle enters b_q, or t, by one arc only,
    # and an unused kept arc of the same bundle costs no more). Else double the filled bundles. The
    # buckets' bundles start one arc above their loads' bound, which no minimizer reaches. A sibling group
    # that never shares a bucket (`siblings_never_share`) keeps one free arc per bundle: every minimizer
    # is still a flow, and the arcs priced at alpha, which slow the solver most, are gone.
    bucket_caps = np.minimum(load_bound + 1, nc)
    load_factor, n_iter = 4, 0
    while True:
        n_iter += 1
        group_cap = np.where(never_share, 1, bundle_cap(group_size, sparsity, d, load_factor))
        net = flow_network(unary, sparsity, alpha, beta, groups, load_factor, bucket_caps, group_cap)
        flow, flow_cost, scale = _solve_flow(net, method, cost_scale)
        z = flow[nc : nc + nc * d].reshape(nc, d).astype(np.int64)
        group_load = np.zeros((len(group_size), d), dtype=np.int64)
        np.add.at(group_load, group_of, z)
        capped = ~never_share & (group_cap < group_size)
        group_filled = ((group_load >= group_cap[:, None]) & capped[:, None]).any()
        bucket_filled = (z.sum(0) >= bucket_caps) & (bucket_caps < nc)
        if not group_filled and not bucket_filled.any():
            break
        load_factor *= 1 + group_filled
        bucket_caps = np.where(bucket_filled, np.minimum(2 * bucket_caps, nc), bucket_caps)
    if not log:
        return z
    energy = code_energy(z, unary, alpha, beta, groups)
    diagnostics = {"flow": flow, "network": net, "load_factor": load_factor, "bucket_caps": bucket_caps,
                   "cost_scale": scale}  # fmt: skip
    info = {"n_iter": n_iter, "err": abs(flow_cost - energy), "converged": True, "method": method}
    return z, {**info, "energy": energy, "flow_cost": flow_cost, **diagnostics}


def code_energy(z, unary, alpha, beta, groups=None) -> float:
    r"""Per-level code energy.

    .. math::
        E(z) = -\sum_p c_p^\top z_p + \alpha \sum_r \sum_q \binom{y_{r,q}}{2}
               + \beta \sum_q \binom{y_q}{2},
        \quad y_q = \sum_p z_p[q],\ y_{r,q} = \sum_{p \in r} z_p[q]

    ``z`` and ``unary`` are (nc, d); ``groups`` (nc,) sibling ids or None (no sibling term).
    """
    unary = _check_unary(unary)
    z = np.asarray(z, dtype=np.float64)
    if z.shape != unary.shape:
        raise ValueError(f"z has shape {z.shape}: must match unary {unary.shape}")
    load = z.sum(0)
    energy = -float((unary * z).sum()) + beta * float((load * (load - 1)).sum()) / 2
    if groups is not None:
        _, group_of = np.unique(np.asarray(groups), return_inverse=True)
        group_load = np.zeros((group_of.max() + 1, z.shape[1]))
        np.add.at(group_load, group_of, z)
        energy += alpha * float((group_load * (group_load - 1)).sum()) / 2
    return energy


def cascade_codes(unary, ks, alpha, beta, method="networkx", cost_scale=None, log=False):
    """Class codes for all levels, solved level by level (Alg. 1).

    ``unary`` is (k, nc, d). Level v < k takes one bit, level k takes ``ks``; the sibling groups
    at level v are the classes whose codes agree at levels 1..v-1 (none at level 1). ``method``
    and ``cost_scale`` are those of ``assign_codes``.
    Returns (k, nc, d) int64 0/1 codes; with ``log=True`` also a dict with ``n_iter`` (flow
    problems solved, all levels), ``err`` (the largest level's), ``converged`` and ``levels``
    (each level's ``assign_codes`` log).

    Examples
    --------
    >>> codes = cascade_codes(np.random.default_rng(0).normal(size=(2, 4, 3)), ks=2, alpha=1.0, beta=0.1)
    >>> codes.shape, codes.sum(2).tolist()  # one bit at level 1, ks bits at the last level
    ((2, 4, 3), [[1, 1, 1, 1], [2, 2, 2, 2]])
    """
    unary = np.asarray(unary, dtype=np.float64)
    if unary.ndim != 3:
        raise ValueError(f"unary has shape {unary.shape}: must be (k levels, nc classes, d)")
    k, nc, d = unary.shape
    codes, levels, groups = [], [], None
    for level in range(k):
        sparsity = ks if level == k - 1 else 1
        solved = assign_codes(unary[level], sparsity, alpha, beta, groups, method, cost_scale, log=log)
        z = solved[0] if log else solved  # the level logs only when asked: each costs an energy evaluation
        if log:
            levels.append(solved[1])
        codes.append(z)
        if level < k - 1:
            path = z.argmax(1) if groups is None else groups * d + z.argmax(1)  # (group, child) id
            present = np.bincount(path) > 0
            groups = (np.cumsum(present) - 1)[path]  # np.unique's inverse, without its sort
    if not log:
        return np.stack(codes)
    n_iter, err = sum(info["n_iter"] for info in levels), max(info["err"] for info in levels)
    return np.stack(codes), {"n_iter": n_iter, "err": err, "converged": True, "levels": levels}


def remap_labels(codes) -> np.ndarray:
    """Label per row of a binary code matrix (N, d): equal codes <=> equal labels.

    A code is an unordered set of active bits, so labels depend only on which bits are on.
    """
    codes = np.asarray(codes)
    if codes.ndim != 2:
        raise ValueError(f"codes has shape {codes.shape}: must be (N, d)")
    rows = np.ascontiguousarray(np.packbits(codes != 0, axis=1))
    keys = rows.view(np.dtype((np.void, rows.shape[1]))).ravel()  # one opaque key per row
    return np.unique(keys, return_inverse=True)[1].reshape(len(codes))


# --------------------------------------------------------------------------------------------
# Buckets
# --------------------------------------------------------------------------------------------


def _levels(activations, d, k) -> np.ndarray:
    activations = np.asarray(activations)
    if activations.ndim != 2 or activations.shape[1] != d * k:
        raise ValueError(f"activations have shape {activations.shape}: must be (N, d*k) = (N, {d * k})")
    return activations.reshape(len(activations), k, d)


def _ranks(activations, d, k) -> np.ndarray:
    """(N, k, d): at each level, the activation indices from the largest down (ties to the lower index)."""
    return np.argsort(-_levels(activations, d, k), axis=2, kind="stable")


def encode_buckets(digits, d) -> np.ndarray:
    """Bucket id of a tree path: Horner in base d, level 1 most significant. digits (..., k)."""
    digits = np.asarray(digits, dtype=np.int64)
    ids = np.zeros(digits.shape[:-1], dtype=np.int64)
    for level in range(digits.shape[-1]):
        ids = ids * d + digits[..., level]
    return ids


def decode_buckets(ids, d, k) -> np.ndarray:
    """Inverse of ``encode_buckets``: ids (...) -> digits (..., k)."""
    ids = np.asarray(ids, dtype=np.int64)
    return np.stack([(ids // d ** (k - 1 - level)) % d for level in range(k)], axis=-1)


def probe_buckets(activations, d, k, start, stop) -> np.ndarray:
    """Buckets ``start..stop-1`` of each item in code order, (N, stop - start).

    Probe t, written in base d with k digits (level 1 most significant), picks at level v the
    activation ranked ``digit_v`` there (0 = largest; ties to the lower index). Probes 0..ks-1
    are the item's own ks buckets (Eq. 1); later probes are the expansion order of a query.
    """
    if d**k > np.iinfo(np.int64).max:
        raise ValueError(f"d={d}, k={k}: d**k = {d**k} buckets have no int64 ids; lower d or k")
    ranks = _ranks(activations, d, k)
    digits = decode_buckets(np.arange(start, stop), d, k)  # (P, k)
    path = np.stack([ranks[:, level, digits[:, level]] for level in range(k)], axis=-1)  # (N, P, k)
    return encode_buckets(path, d)


def bucket_ids(activations, d, k, ks) -> np.ndarray:
    """The ks buckets of each item (Eq. 1): argmax path at levels < k, top-ks at level k. (N, ks)."""
    if not 1 <= ks <= d:
        raise ValueError(f"ks={ks}: must be in [1, d={d}]")
    return probe_buckets(activations, d, k, 0, ks)


def lsh_activations(embedding, n_bits, seed=0) -> np.ndarray:
    """Random-hyperplane LSH codes of an embedding (N, e) as single-level activations (N, 2^n_bits).

    The paper's LSH baseline ([10], Jain, Kulis & Grauman 2008: Charikar's sign hashes on a learned
    metric): p = embedding @ R with R ~ N(0, 1)^(e x n) drawn from `seed`, and item i goes to the bucket
    of its sign pattern. act[i, b] = sum_j p_ij S_bj with S_b in {-1, +1}^n the pattern of bucket b
    (bit j of b set <=> +1), so the argmax is the sign bucket and lower ranks flip the bits of smallest
    |p_ij| first: with `HashIndex(act, emb, d=2^n, k=1, ks)` the extra probes are multi-probe LSH.
    """
    embedding = np.asarray(embedding, dtype=np.float64)
    if embedding.ndim != 2 or not 1 <= n_bits <= 20:
        raise ValueError(f"embedding {embedding.shape}, n_bits={n_bits}: need (N, e) and 1 <= n_bits <= 20")
    planes = np.random.default_rng(seed).standard_normal((embedding.shape[1], n_bits))
    return sign_activations(embedding @ planes)


def sign_activations(projections) -> np.ndarray:
    """n-bit sign codes of real projections (N, n) as single-level activations (N, 2^n): act[i, b] =
    sum_j p_ij S_bj with S_b in {-1, +1}^n the pattern of bucket b (bit j of b set <=> +1). The argmax is
    the bucket of sign(p_i) (LSH's hyperplanes, DCH's tanh codes); lower ranks flip the bits of smallest
    |p_ij| first (multi-probe)."""
    projections = np.asarray(projections, dtype=np.float64)
    if projections.ndim != 2 or not 1 <= projections.shape[1] <= 20:
        raise ValueError(f"projections {projections.shape}: need (N, n) with 1 <= n <= 20")
    n_bits = projections.shape[1]
    signs = 2.0 * ((np.arange(2**n_bits)[:, None] >> np.arange(n_bits)) & 1) - 1  # (2^n, n)
    return projections @ signs.T


# --------------------------------------------------------------------------------------------
# Hash index and retrieval metrics
# --------------------------------------------------------------------------------------------


class HashIndex:
    """Hash table of a database: bucket id -> item ids, each item in its ks buckets.

    ``activations`` (N, d*k) are hash-net outputs; ``embedding`` (N, e) is the base embedding
    used to rerank candidates by Euclidean distance.
    """

    def __init__(self, activations, embedding, d, k, ks):
        self.d, self.k, self.ks = d, k, ks
        self.embedding = np.asarray(embedding, dtype=np.float64)
        if len(self.embedding) == 0:
            raise ValueError("HashIndex needs a database of at least one item; got 0")
        if len(self.embedding) != len(activations):
            raise ValueError(
                f"embedding has {len(self.embedding)} rows: must match activations ({len(activations)})"
            )
        self.buckets = bucket_ids(activations, d, k, ks)
        flat = self.buckets.ravel()
        order = np.argsort(flat, kind="stable")
        self.items = order // ks  # item ids grouped by bucket, ascending within a bucket
        self.keys, self.starts = np.unique(flat[order], return_index=True)
        self.key_paths = decode_buckets(self.keys, d, k)  # (used buckets, k): ranked by `_used_from`
        self.ends = np.r_[self.starts[1:], len(flat)]
        # (used bucket, item) incidence: a query's candidates are one sparse product away
        rows = np.repeat(np.arange(len(self.keys)), self.ends - self.starts)
        shape = (len(self.keys), len(self.embedding))
        self.incidence = csr_matrix((np.ones(len(rows), dtype=np.int32), (rows, self.items)), shape=shape)

    @property
    def n_buckets(self) -> int:
        return self.d**self.k

    def _lookup(self, ids) -> list[np.ndarray]:
        """Item arrays (ascending ids) of the non-empty buckets among ``ids`` (1-D), in order."""
        pos = np.minimum(np.searchsorted(self.keys, ids), len(self.keys) - 1)
        return [self.items[self.starts[p] : self.ends[p]] for p in pos[self.keys[pos] == ids]]

    def candidates(self, query_activations, K=1, self_ids=None) -> list[np.ndarray]:
        """Candidate ids per query (ascending): the union of its ks buckets, minus the query itself.

        ``self_ids`` (Q,) is each query's own row in the database (-1 or None: not stored). If
        fewer than K candidates come back, probes ks, ks+1, ... (see ``probe_buckets``) are
        added one bucket at a time until there are K or every bucket was probed.
        """
        query_activations = np.asarray(query_activations)
        n_query = len(query_activations)
        self_ids = np.full(n_query, -1) if self_ids is None else np.asarray(self_ids)
        own = probe_buckets(query_activations, self.d, self.k, 0, self.ks)  # (Q, ks)
        pos = np.minimum(np.searchsorted(self.keys, own), len(self.keys) - 1)
        hit = (self.keys[pos] == own).ravel()
        rows = np.repeat(np.arange(n_query), self.ks)[hit]
        probes = csr_matrix(
            (np.ones(len(rows), dtype=np.int32), (rows, pos.ravel()[hit])), (n_query, len(self.keys))
        )
        union = probes @ self.incidence  # (Q, N_db), nonzero where some own bucket holds the item
        union.sort_indices()
        query = np.repeat(np.arange(n_query), np.diff(union.indptr))
        keep = union.indices != self_ids[query]
        bounds = np.searchsorted(query[keep], np.arange(n_query + 1))
        found = np.split(union.indices[keep].astype(np.int64), bounds[1:-1])
        for q in np.flatnonzero(np.diff(bounds) < K):
            found[q] = self._expand(query_activations[q : q + 1], found[q], K, self_ids[q])
        return found

    def _expand(self, activation, found, K, self_id) -> np.ndarray:
        seen = set(found.tolist())
        K = min(K, len(self.embedding) - int(0 <= self_id < len(self.embedding)))  # no more exist
        start, chunk = self.ks, 64
        while len(seen) < K and start < self.n_buckets:
            if chunk > len(self.keys):  # more probes to try than buckets in use: rank those instead
                buckets, start = self._used_from(activation, start), self.n_buckets
            else:
                stop = min(start + chunk, self.n_buckets)
                buckets = self._lookup(probe_buckets(activation, self.d, self.k, start, stop)[0])
                start, chunk = stop, 2 * chunk
            for items in buckets:
                seen.update(items.tolist())
                seen.discard(int(self_id))
                if len(seen) >= K:
                    break
        return np.array(sorted(seen), dtype=np.int64)

    def _used_from(self, activation, start) -> list[np.ndarray]:
        """Item arrays of the buckets in use whose probe index for this query is >= start, in probe order.
        A bucket's probe index is its path's rank at each level, in base d: the inverse of
        ``probe_buckets``, so that d**k probes need not be enumerated."""
        ranks = _ranks(activation, self.d, self.k)[0]  # (k, d)
        rank_of = np.empty_like(ranks)
        rank_of[np.arange(self.k)[:, None], ranks] = np.arange(self.d)
        probe = encode_buckets(rank_of[np.arange(self.k), self.key_paths], self.d)
        order = np.argsort(probe, kind="stable")
        return [self.items[self.starts[p] : self.ends[p]] for p in order[probe[order] >= start]]

    def search(self, query_activations, query_embedding, K, self_ids=None, max_pairs=2**16):
        """Top-K by Euclidean distance among the candidates (ties to the lower id).

        Returns ``neighbors`` (Q, K) database ids (-1 where fewer than K exist) and
        ``n_candidates`` (Q,), the distances computed per query (for SUF). Reranks blocks of
        queries padded to about ``max_pairs`` (query, candidate) pairs.
        """
        query_embedding = np.asarray(query_embedding, dtype=np.float64)
        found = self.candidates(query_activations, K, self_ids)
        n_candidates = np.array([len(f) for f in found], dtype=np.int64)
        neighbors = np.full((len(found), K), -1, dtype=np.int64)
        sq_norm = (self.embedding**2).sum(1)
        block = max(1, max_pairs // max(1, int(n_candidates.max(initial=0))))
        for lo in range(0, len(found), block):
            size = n_candidates[lo : lo + block]
            width = int(size.max())
            if width == 0:
                continue
            pad = np.arange(width) >= size[:, None]  # (b, width)
            item = np.zeros((len(size), width), dtype=np.int64)
            item[~pad] = np.concatenate(found[lo : lo + block])
            # ||q - x||^2 up to the per-query constant ||q||^2; padding sorts last
            dist = sq_norm[item] - 2 * np.einsum(
                "bwe,be->bw", self.embedding[item], query_embedding[lo : lo + block]
            )
            dist[pad] = np.inf
            top = np.argsort(dist, axis=1, kind="stable")[:, :K]  # candidates ascend: ties -> lower id
            chosen = np.take_along_axis(item, top, 1)
            chosen[np.take_along_axis(pad, top, 1)] = -1
            neighbors[lo : lo + block, : chosen.shape[1]] = chosen
        return neighbors, n_candidates


def exhaustive_search(query_embedding, db_embedding, K, self_ids=None, chunk=256) -> np.ndarray:
    """Exact top-K by Euclidean distance over the whole database (the ``Metric`` baseline)."""
    query_embedding = np.asarray(query_embedding, dtype=np.float64)
    db_embedding = np.asarray(db_embedding, dtype=np.float64)
    n_query = len(query_embedding)
    self_ids = np.full(n_query, -1) if self_ids is None else np.asarray(self_ids)
    db_sq = (db_embedding**2).sum(1)
    K_eff = min(K, len(db_embedding))
    neighbors = np.full((n_query, K), -1, dtype=np.int64)
    for lo in range(0, n_query if K_eff > 0 else 0, chunk):
        q = query_embedding[lo : lo + chunk]
        dist = db_sq[None] - 2 * q @ db_embedding.T  # ||q - x||^2 up to the per-query constant
        rows = np.flatnonzero(self_ids[lo : lo + chunk] >= 0)
        dist[rows, self_ids[lo : lo + chunk][rows]] = np.inf
        top = np.argpartition(dist, K_eff - 1, axis=1)[:, :K_eff]
        order = np.lexsort((top, np.take_along_axis(dist, top, 1)), axis=1)
        top = np.take_along_axis(top, order, 1)
        # a stored query's own row sorts last (distance inf): it is no neighbour
        neighbors[lo : lo + chunk, :K_eff] = np.where(np.isinf(np.take_along_axis(dist, top, 1)), -1, top)
    return neighbors


def precision_at_k(neighbors, query_labels, db_labels) -> float:
    """Pr@K: mean over queries of (#neighbors of the query's class) / K. neighbors (Q, K), -1 = miss."""
    neighbors = np.asarray(neighbors)
    db_labels = np.asarray(db_labels)
    hits = (neighbors >= 0) & (db_labels[neighbors] == np.asarray(query_labels)[:, None])
    return float(hits.mean())


def speedup_factor(n_candidates, n_db) -> float:
    """SUF = database size / mean number of candidates reranked per query (exhaustive = 1)."""
    return float(n_db / np.mean(n_candidates))


def nmi(clusters, labels) -> float:
    """Normalized mutual information, I(C; Y) / ((H(C) + H(Y)) / 2); 1 if both are constant.

    scikit-learn's ``normalized_mutual_info_score`` with its default arithmetic mean.
    """
    from sklearn.metrics import normalized_mutual_info_score  # scikit-learn: half a second to import

    return float(normalized_mutual_info_score(np.asarray(labels).ravel(), np.asarray(clusters).ravel()))


# --------------------------------------------------------------------------------------------
# Losses given codes (torch)
# --------------------------------------------------------------------------------------------


def masked_distance(f_a, f_b, h_a, h_b) -> torch.Tensor:
    r"""L1 distance on the dimensions active in either code.

    .. math:: D_{ij} = \sum_q (h_{a,i} \lor h_{b,j})[q]\, |f_{a,i}[q] - f_{b,j}[q]|

    f_a, h_a (Na, d); f_b, h_b (Nb, d); returns (Na, Nb).
    """
    mask = ((h_a[:, None, :] + h_b[None, :, :]) > 0).to(f_a.dtype)
    return (mask * (f_a[:, None, :] - f_b[None, :, :]).abs()).sum(-1)


def triplet_semihard_loss(dist, labels, margin) -> torch.Tensor:
    """FaceNet semi-hard triplet loss on a precomputed (N, N) distance matrix.

    For each positive pair (i, j), the negative is the nearest one farther than D_ij, else the
    farthest one; loss = mean over pairs of max(D_ij - D_in + margin, 0), over the pairs whose anchor
    has a negative (0 without any). Masks over all (i, j) and a search in each anchor's sorted negative
    distances keep every shape fixed, so nothing waits for the device.
    """
    n = len(labels)
    negative = labels[:, None] != labels[None, :]
    eye = torch.eye(n, dtype=torch.bool, device=dist.device)
    pair = ~negative & ~eye & negative.any(1, keepdim=True)  # (anchor i, positive j)
    # the anchor's negative distances ascending, then +inf: the first one > D_ij is the semi-hard one
    ascending = torch.where(negative, dist, math.inf).sort(dim=1).values
    first = torch.searchsorted(ascending, dist.contiguous(), right=True)
    semihard = ascending.gather(1, first.clamp(max=n - 1))
    farthest = torch.where(negative, dist, -math.inf).max(1, keepdim=True).values
    d_neg = torch.where(first < negative.sum(1, keepdim=True), semihard, farthest)
    losses = torch.where(pair, F.relu(dist - d_neg + margin), 0.0)
    return losses.sum() / pair.sum().clamp(min=1)


def npairs_loss(anchor, positive, labels, l2_reg, code_anchor=None, code_positive=None) -> torch.Tensor:
    r"""N-pairs loss, optionally on code-active dimensions.

    .. math::
        S_{ij} = \sum_q (z_i \lor z_j)[q]\, a_i[q]\, p_j[q], \quad
        L = \mathrm{CE}(\mathrm{softmax}_j S_{ij}, 1[y_i = y_j] / \#pos_i)
            + \frac{\lambda}{4}(\overline{|a|^2} + \overline{|p|^2})

    anchor, positive (n, d); labels (n,); codes (n, d) or None (plain dot products).
    """
    if code_anchor is None:
        logits = anchor @ positive.T
    else:
        mask = ((code_anchor[:, None, :] + code_positive[None, :, :]) > 0).to(anchor.dtype)
        logits = (mask * anchor[:, None, :] * positive[None, :, :]).sum(-1)
    target = (labels[:, None] == labels[None, :]).to(anchor.dtype)
    target = target / target.sum(1, keepdim=True)
    cross_entropy = -(target * F.log_softmax(logits, dim=1)).sum(1).mean()
    return cross_entropy + l2_reg / 4 * ((anchor**2).sum(1).mean() + (positive**2).sum(1).mean())


def class_unaries(outputs, loss) -> torch.Tensor:
    """Class-level unaries per level from a class-balanced batch, computed where the activations are.

    outputs (nc, m, k, d): level activations x[p, i, v]; triplet uses the per-level L2-normalized
    vectors u = x / max(|x|_2, 1e-12), N-pairs u = x. Returns c[v, p] = (1/m) sum_i u[p, i, v] as a
    (k, nc, d) float64 tensor on outputs' device (float64 from the start, whatever the autocast dtype
    of the activations); the min-cost flow takes it on the CPU.
    """
    if loss not in LOSSES:
        raise ValueError(f"loss={loss!r}: must be one of {LOSSES}")
    x = outputs.detach().double()
    if loss == "triplet":
        x = F.normalize(x, dim=-1)
    return x.mean(1).transpose(0, 1)


def level_labels(codes, remap) -> np.ndarray:
    """Labels per level (k, nc): the id of each class's level-v code (remap), else the class index."""
    k, nc, _ = codes.shape
    if not remap:
        return np.tile(np.arange(nc), (k, 1))
    return np.stack([remap_labels(level_codes) for level_codes in codes])


def hash_loss(outputs, codes, labels, loss, margin=0.5, l2_reg=0.003) -> torch.Tensor:
    """Metric loss summed over levels, measured on code-active dimensions (Eq. 7).

    outputs (nc, m, k, d) activations; codes (k, nc, d) 0/1 class codes; labels (k, nc) per-level
    class labels (arrays, or tensors on the outputs' device, which are not copied). Triplet: semi-hard
    on masked L1 of L2-normalized level vectors over all nc*m items. N-pairs (m = 2): example 0 of each
    class is the anchor, example 1 the positive.
    """
    nc, m, k, d = outputs.shape
    codes = torch.as_tensor(codes, device=outputs.device, dtype=outputs.dtype)
    labels = torch.as_tensor(labels, device=outputs.device)
    total = outputs.new_zeros(())
    for level in range(k):
        f = outputs[:, :, level]
        if loss == "triplet":
            f = F.normalize(f, dim=-1).reshape(nc * m, d)
            h = codes[level].repeat_interleave(m, dim=0)
            total = total + triplet_semihard_loss(
                masked_distance(f, f, h, h), labels[level].repeat_interleave(m), margin
            )
        elif loss == "npairs":
            if m != 2:
                raise ValueError(f"per_class={m}: the N-pairs loss needs exactly 2 examples per class")
            z = codes[level]
            total = total + npairs_loss(f[:, 0], f[:, 1], labels[level], l2_reg, z, z)
        else:
            raise ValueError(f"loss={loss!r}: must be one of {LOSSES}")
    return total


def dch_loss(codes, labels, gamma=20.0, quantization=0.1) -> torch.Tensor:
    """Deep Cauchy Hashing's loss (Cao, Long, Liu & Wang, CVPR 2018), the hashing paper's DCH baseline.

    codes (N, K) continuous codes (tanh outputs), labels (N,) classes; s_ij = [y_i = y_j]. With the
    normalized Hamming distance d_ij = K/2 (1 - cos(h_i, h_j)) and the Cauchy probability
    sigma(d) = gamma / (gamma + d) of a similar pair, each ordered pair i != j costs the cross-entropy

        l_ij = -s_ij log sigma(d_ij) - (1 - s_ij) log(1 - sigma(d_ij))
             = s_ij log(d_ij / gamma) + log(1 + gamma / d_ij),

    weighted w_ij = |S| / |S_s| (similar pairs) or |S| / |S_d| (dissimilar ones), |S| all pairs: the
    loss is (1/|S|) sum w_ij l_ij = the mean over similar pairs + the mean over dissimilar pairs. The
    quantization term adds quantization * mean_i log(1 + d(|h_i|, 1) / gamma), the Cauchy loss of each
    |code| against the all-ones vector. d is floored at 1e-6 (the authors' offset): a dissimilar pair
    at distance 0 costs log(1 + gamma / 1e-6), finite.
    """
    if codes.ndim != 2 or labels.shape != codes.shape[:1]:
        raise ValueError(f"codes {tuple(codes.shape)}, labels {tuple(labels.shape)}: need (N, K) and (N,)")
    n, bits = codes.shape
    similar = labels[:, None] == labels[None, :]
    off_diagonal = ~torch.eye(n, dtype=torch.bool, device=codes.device)
    pos, neg = similar & off_diagonal, ~similar
    if not (pos.any() and neg.any()):
        raise ValueError(
            "dch_loss: the batch needs a similar and a dissimilar pair (a class twice, two classes)"
        )
    unit = F.normalize(codes, dim=1)
    dist = (bits / 2 * (1 - unit @ unit.T)).clamp_min(1e-6)
    log_mixed = torch.log(gamma + dist)
    pair = torch.where(similar, log_mixed - math.log(gamma), log_mixed - torch.log(dist))
    ones = torch.ones(bits, dtype=codes.dtype, device=codes.device) / math.sqrt(bits)
    to_ones = (bits / 2 * (1 - F.normalize(codes.abs(), dim=1) @ ones)).clamp_min(0)
    return pair[pos].mean() + pair[neg].mean() + quantization * torch.log1p(to_ones / gamma).mean()
