"""Oracle tests for runner.methods.hier_hash (digest section 4)."""

import itertools
import math
from math import comb

import numpy as np
import pytest
import torch

from runner.device_tracking import STAND_IN, DeviceTracker
from runner.methods import hier_hash as hh

# --------------------------------------------------------------------------------------------
# Brute-force oracle: energy in pairwise form, sum over class pairs of the shared bits
# --------------------------------------------------------------------------------------------


def all_codes(d, s):
    rows = []
    for bits in itertools.combinations(range(d), s):
        row = np.zeros(d, int)
        row[list(bits)] = 1
        rows.append(row)
    return np.array(rows)


def every_assignment(unary, s, alpha, beta, groups):
    """Every code assignment z (A, nc, d) with s bits per class, and its energy (A,)."""
    nc, d = unary.shape
    options = all_codes(d, s)
    choice = np.array(list(itertools.product(range(len(options)), repeat=nc)))
    z = options[choice]  # (A, nc, d)
    groups = np.arange(nc) if groups is None else np.asarray(groups)
    energy = -(z * unary).sum((1, 2)).astype(float)
    for p, p2 in itertools.combinations(range(nc), 2):
        shared = (z[:, p] * z[:, p2]).sum(1)
        energy += (beta + alpha * (groups[p] == groups[p2])) * shared
    return z, energy


def brute_force_min(unary, s, alpha, beta, groups):
    return every_assignment(unary, s, alpha, beta, groups)[1].min()


def random_instance(rng, max_classes=4):
    nc, d = rng.integers(2, max_classes + 1), rng.integers(2, 5)
    s = int(rng.integers(1, min(2, d) + 1))
    groups = None if rng.random() < 0.5 else rng.integers(0, 2, nc)
    alpha, beta = rng.uniform(0, 2, size=2)
    return rng.normal(size=(nc, d)), s, alpha, beta, groups


@pytest.mark.parametrize("method", hh.SOLVERS)
def test_min_cost_flow_matches_brute_force(method):
    rng = np.random.default_rng(0)
    for _ in range(150):
        unary, s, alpha, beta, groups = random_instance(rng)
        z, log = hh.assign_codes(unary, s, alpha, beta, groups, method=method, log=True)
        energy = hh.code_energy(z, unary, alpha, beta, groups)
        assert energy == pytest.approx(brute_force_min(unary, s, alpha, beta, groups), abs=1e-6)
        assert log["flow_cost"] == pytest.approx(energy, abs=1e-6)
        assert log["converged"] and log["n_iter"] >= 1 and log["err"] == abs(log["flow_cost"] - energy)


def test_code_energy_matches_pairwise_form():
    rng = np.random.default_rng(1)
    for _ in range(20):
        unary, s, alpha, beta, groups = random_instance(rng)
        z = all_codes(unary.shape[1], s)[rng.integers(0, comb(unary.shape[1], s), len(unary))]
        g = np.arange(len(unary)) if groups is None else groups
        pairwise = -(z * unary).sum() + sum(
            (beta + alpha * (g[p] == g[q])) * z[p] @ z[q] for p, q in itertools.combinations(range(len(z)), 2)
        )
        assert hh.code_energy(z, unary, alpha, beta, groups) == pytest.approx(pairwise)


@pytest.mark.parametrize("method", hh.SOLVERS)
def test_hand_case(method):
    unary = np.array([[1.0, 0.9], [1.0, 0.2]])
    z = hh.assign_codes(unary, 1, 0.0, 0.0, method=method)
    np.testing.assert_array_equal(z, [[1, 0], [1, 0]])
    assert hh.code_energy(z, unary, 0, 0) == pytest.approx(-2.0)
    z = hh.assign_codes(unary, 1, 0.0, 0.5, method=method)
    np.testing.assert_array_equal(z, [[0, 1], [1, 0]])
    assert hh.code_energy(z, unary, 0, 0.5) == pytest.approx(-1.9)
    assert hh.code_energy([[1, 0], [1, 0]], unary, 0, 0.5) == pytest.approx(-1.5)
    assert hh.code_energy([[1, 0], [0, 1]], unary, 0, 0.5) == pytest.approx(-1.2)


@pytest.mark.parametrize("method", hh.FLOW_SOLVERS)
def test_flow_is_feasible_and_codes_binary(method):
    rng = np.random.default_rng(2)
    nc, d, s = 12, 9, 3
    groups = rng.integers(0, 4, nc)
    z, log = hh.assign_codes(rng.normal(size=(nc, d)), s, 1.0, 0.3, groups, method=method, log=True)
    assert set(np.unique(z)) <= {0, 1}
    np.testing.assert_array_equal(z.sum(1), np.full(nc, s))
    net, flow = log["network"], log["flow"]
    assert (flow >= 0).all() and (flow <= net.capacity).all()
    balance = np.zeros(net.n_nodes)
    np.add.at(balance, net.tail, flow)
    np.add.at(balance, net.head, -flow)
    np.testing.assert_array_equal(balance, net.supply)
    assert flow[net.tail == 0].sum() == nc * s
    assert flow[net.head == 1].sum() == nc * s


def test_network_size():
    nc, d = 10, 7
    groups = np.array([0, 0, 0, 1, 1, 2, 3, 4, 5, 6])  # two sibling groups, five singletons
    net = hh.flow_network(np.zeros((nc, d)), 2, 1.0, 1.0, groups)
    assert net.n_nodes == nc + d * (1 + 2) + 2
    assert len(net.tail) == nc + nc * d + (3 + 2) * d + nc * d
    # bundles keep min(n, f * ceil(n * s / d) + 1) arcs: groups 3 -> 2, 2 -> 2; buckets 10 -> 4
    capped = hh.flow_network(np.zeros((nc, d)), 2, 1.0, 1.0, groups, load_factor=1)
    assert capped.n_nodes == net.n_nodes
    assert len(capped.tail) == nc + nc * d + (2 + 2) * d + 4 * d


def full_network_optimum(unary, s, alpha, beta, groups):
    from scipy.optimize import linprog

    net = hh.flow_network(unary, s, alpha, beta, groups)
    bounds = np.c_[np.zeros(len(net.tail)), net.capacity]
    res = linprog(net.cost, A_eq=net.incidence(), b_eq=net.supply, bounds=bounds)
    assert res.status == 0
    return res.fun


def test_bucket_load_bound_holds_at_every_minimizer():
    rng = np.random.default_rng(5)
    below_nc = 0
    for _ in range(200):
        unary, s, alpha, beta, groups = random_instance(rng, max_classes=5)
        unary[:, 0] += rng.uniform(0, 3)  # every class prefers bucket 0 by as much
        z, energy = every_assignment(unary, s, alpha, beta, groups)
        largest_group = 1 if groups is None else np.bincount(groups).max()
        bound = hh.bucket_load_bound(unary, s, beta, largest_group)
        minimizers = z[energy <= energy.min() + 1e-9]
        assert (minimizers.sum(1) <= bound).all()
        below_nc += (bound < len(unary)).any()
    assert below_nc > 20  # the bound cuts bundles on many instances (31 of these 200)
    with pytest.raises(ValueError, match="must be finite"):
        hh.bucket_load_bound(np.array([[0.0, np.nan]]), 1, 0.1)


@pytest.mark.parametrize("method", hh.FLOW_SOLVERS)
def test_bundle_caps_keep_the_full_network_optimum(method):
    rng = np.random.default_rng(20)
    grew = 0
    for bonus, n_groups in ((0.0, 3), (1.0, 3), (3.0, 3), (6.0, 1)):
        nc, d, s = 20, 5, 1
        unary = rng.normal(size=(nc, d)) + bonus * np.eye(d)[np.zeros(nc, int)]  # crowd bucket 0
        groups = rng.integers(0, n_groups, nc)
        z, log = hh.assign_codes(unary, s, 0.05, 0.05, groups, method=method, log=True)
        grew += log["load_factor"] > 4
        # the buckets' bundles never double (their loads' bound holds): one solve per sibling-cap doubling
        assert log["n_iter"] == np.log2(log["load_factor"] // 4) + 1
        assert hh.code_energy(z, unary, 0.05, 0.05, groups) == pytest.approx(
            full_network_optimum(unary, s, 0.05, 0.05, groups), abs=1e-6
        )
    assert grew >= 1  # one sibling group of 20 crowding bucket 0 needed larger bundles


def test_siblings_never_share_holds_at_every_minimizer():
    rng = np.random.default_rng(22)
    separated = 0
    for _ in range(300):
        unary, s, _, beta, groups = random_instance(rng, max_classes=5)
        groups = rng.integers(0, 2, len(unary)) if groups is None else groups
        alpha = rng.uniform(0, 5)
        never = hh.siblings_never_share(unary, s, alpha, beta, groups)
        z, energy = every_assignment(unary, s, alpha, beta, groups)
        minimizers = z[energy <= energy.min() + 1e-9]
        for g in np.unique(groups)[never]:
            assert minimizers[:, groups == g].sum(1).max() <= 1
            separated += (groups == g).sum() >= 2
    assert separated > 50  # 85 of these 300
    # tight: two siblings preferring bucket 0 by 1 share it iff alpha < 1 - beta
    unary, groups = np.array([[1.0, 0.0], [1.0, 0.0]]), np.array([0, 0])
    for alpha, never in ((0.7 - 1e-9, False), (0.7 + 1e-9, True)):
        assert hh.siblings_never_share(unary, 1, alpha, 0.3, groups).tolist() == [never]
        z, energy = every_assignment(unary, 1, alpha, 0.3, groups)
        assert (z[energy.argmin()].sum(0).max() == 1) == never


@pytest.mark.parametrize("method", hh.SOLVERS)
def test_one_free_arc_for_siblings_that_never_share_keeps_the_full_network_optimum(method):
    """assign_codes cuts the sibling bundles of groups that never share a bucket to their free first arc."""
    rng = np.random.default_rng(23)
    cut = 0
    for _ in range(40):
        nc, d, s = 12, 10, int(rng.integers(1, 3))
        groups = rng.integers(0, 5, nc)
        unary = rng.normal(size=(5, d))[groups] + 0.3 * rng.normal(size=(nc, d))  # siblings alike
        alpha, beta = rng.choice([0.5, 5.0, 50.0]), rng.choice([0.1, 1.0])
        z, log = hh.assign_codes(unary, s, alpha, beta, groups, method=method, log=True)
        assert hh.code_energy(z, unary, alpha, beta, groups) == pytest.approx(
            full_network_optimum(unary, s, alpha, beta, groups), abs=1e-6
        )
        never = hh.siblings_never_share(unary, s, alpha, beta, groups)  # per group, np.unique's order
        cut += (never & (np.unique(groups, return_counts=True)[1] >= 2)).any()
    assert cut >= 10  # groups of two or more were cut in that many instances


def preset_levels(rng, n):
    """n levels of the CIFAR presets' cascades at ks = 1 (64 classes, alpha 100; d = 32 at beta 0.07 or 0.1,
    d = 64 at beta 1): the first level (no groups) or the second (groups from the first level's codes), with
    unaries independent across classes (spread 0.05, 0.5 or 2) or sharing a preference over the buckets."""
    for i in range(n):
        d, beta = [(32, 0.07), (32, 0.1), (64, 1.0)][i % 3]
        kind = i // 6 % 4
        unary = (0.05, 0.5, 2.0, 0.05)[kind] * rng.normal(size=(2, 64, d))
        unary += (kind == 3) * rng.normal(size=(2, 1, d))
        groups = None if i % 2 == 0 else hh.assign_codes(unary[0], 1, 100.0, beta, method="ortools").argmax(1)
        yield unary[i % 2], groups, beta


@pytest.mark.parametrize("n", [60, pytest.param(500, marks=pytest.mark.slow)])
def test_assignment_matches_the_flow_lp_at_the_presets_shapes(n):
    rng = np.random.default_rng(24)
    ran = with_pairs = 0
    for unary, groups, beta in preset_levels(rng, n):
        z, log = hh.assign_codes(unary, 1, 100.0, beta, groups, method="assignment", log=True)
        # E of 0/1 codes sums < 200 terms of size < 1e3 (rounding < 1e-10); HiGHS's vertex is integral and
        # its dual tolerance (1e-7 per reduced cost) leaves it within 1e-6 of the LP optimum
        assert hh.code_energy(z, unary, 100.0, beta, groups) == pytest.approx(
            full_network_optimum(unary, 1, 100.0, beta, groups), abs=1e-6
        )
        ran += log["method"] == "assignment"
        with_pairs += log.get("pair_nodes", 0) > 0
    # the assignment solved all but (some of) the crowded levels, a quarter of them (here 51 of 60, 395 of
    # 500); siblings that would meet needed nodes on 15 of 60, 99 of 500
    assert ran >= 3 * n // 4 and with_pairs >= n // 10


def edge_cases(rng, n, max_sparsity):
    """Small levels for brute force: ties (integer unaries), beta = 0, alpha = 0 with siblings, more classes
    than buckets; s up to max_sparsity (at most d)."""
    for i in range(n):
        nc, d = int(rng.integers(2, 7)), int(rng.integers(2, 5))
        unary = rng.integers(0, 3, size=(nc, d)).astype(float) if i % 2 else rng.normal(size=(nc, d))
        alpha = (0.0, 10.0)[i // 2 % 2]
        beta = (0.0, 0.5, 1.0)[i % 3]
        groups = rng.integers(0, 2, nc) if i % 4 < 3 else None
        s = int(rng.integers(1, min(max_sparsity, d) + 1)) if nc <= 4 else 1  # brute force: C(d, s)^nc codes
        yield unary, s, alpha, beta, groups


@pytest.mark.parametrize("method, max_sparsity", [("assignment", 1), ("ssp", 2)])
def test_matches_brute_force_at_the_edge_cases(method, max_sparsity):
    rng = np.random.default_rng(25)
    ran = siblings_share = 0
    for unary, s, alpha, beta, groups in edge_cases(rng, 120, max_sparsity):
        z, log = hh.assign_codes(unary, s, alpha, beta, groups, method=method, log=True)
        assert z.sum(1).tolist() == [s] * len(unary)
        # both sides add at most 12 terms of size < 100 exactly representable or normal draws: < 1e-12 apart
        assert hh.code_energy(z, unary, alpha, beta, groups) == pytest.approx(
            brute_force_min(unary, s, alpha, beta, groups), abs=1e-9
        )
        assert log["err"] < 1e-9
        ran += log["method"] == method
        paid = hh.code_energy(z, unary, 0.0, beta) != log["energy"]  # alpha's term, with siblings sharing
        siblings_share += alpha > 0 and groups is not None and paid
    # the assignment: 98 (the rest: siblings that may share (alpha = 10) or crowd a bucket, crowded buckets)
    assert ran >= (90 if method == "assignment" else 120)
    assert siblings_share >= 5  # the sibling penalty is paid at the optimum (10 of 120, ssp 12)


@pytest.mark.parametrize("n", [60, pytest.param(500, marks=pytest.mark.slow)])
def test_ssp_matches_the_flow_lp_at_the_presets_shapes(n):
    """First and second levels of the CIFAR presets' cascades, the second at ks = 1 or 2."""
    rng = np.random.default_rng(27)
    with_sibling_nodes = 0
    for i, (unary, groups, beta) in enumerate(preset_levels(rng, n)):
        s = 2 if groups is not None and i % 4 == 3 else 1
        z, log = hh.assign_codes(unary, s, 100.0, beta, groups, method="ssp", log=True)
        energy = hh.code_energy(z, unary, 100.0, beta, groups)
        # as for the assignment above: within 1e-6 of the LP optimum; the paths' costs sum < 400 such terms
        assert energy == pytest.approx(full_network_optimum(unary, s, 100.0, beta, groups), abs=1e-6)
        assert log["flow_cost"] == pytest.approx(energy, abs=1e-9)
        with_sibling_nodes += groups is not None and (np.bincount(groups) >= 2).any()
    assert with_sibling_nodes >= n // 3  # second levels with sibling groups: their nodes were in play


@pytest.mark.parametrize("direction", ["backward", "forward"])
def test_ssp_finds_the_optimum_searching_either_way(direction):
    """Every Dijkstra run from the sink back (forward_sources = 0), or every one forward from the classes
    with units left (forward_sources = nc; by default only the last few are): brute force on the edge cases
    (siblings that may share a bucket, so their arcs priced alpha are in the network, among them), the flow
    LP on levels of the presets' shapes (sibling groups that never share: their nodes scanned at once)."""
    rng = np.random.default_rng(29)

    def solve(unary, s, alpha, beta, groups):
        groups = None if alpha == 0 or groups is None else np.asarray(groups)  # as assign_codes does
        forward_sources = len(unary) if direction == "forward" else 0
        group_of, group_size = hh._sibling_groups(groups, len(unary))
        solved = hh._successive_shortest_paths(unary, s, alpha, beta, group_of, group_size, forward_sources)
        z, cost, _ = solved
        energy = hh.code_energy(z, unary, alpha, beta, groups)
        assert z.sum(1).tolist() == [s] * len(unary)
        assert cost == pytest.approx(energy, abs=1e-9)  # the paths' costs telescope to E(z)
        return energy

    for unary, s, alpha, beta, groups in edge_cases(rng, 120, 2):
        # as in test_matches_brute_force_at_the_edge_cases: sums of <= 12 such terms, < 1e-12 apart
        assert solve(unary, s, alpha, beta, groups) == pytest.approx(
            brute_force_min(unary, s, alpha, beta, groups), abs=1e-9
        )
    for i, (unary, groups, beta) in enumerate(preset_levels(rng, 24)):
        s = 2 if groups is not None and i % 4 == 3 else 1
        # as in test_ssp_matches_the_flow_lp_at_the_presets_shapes: within 1e-6 of the LP optimum
        assert solve(unary, s, 100.0, beta, groups) == pytest.approx(
            full_network_optimum(unary, s, 100.0, beta, groups), abs=1e-6
        )


def test_ssp_is_exact_on_levels_full_of_ties():
    """Unaries on a grid of 0.5 make many reduced costs 0, which float potentials round a little below or
    above: a run must still find a shortest path (before `relax` counted a negative rounding as 0, an eagerly
    scanned class labelled again could send the path's links round a cycle: seed 354, backward)."""
    for seed in range(400):
        rng = np.random.default_rng(seed)
        nc, d, s = int(rng.integers(8, 40)), int(rng.integers(4, 16)), int(rng.integers(1, 3))
        unary, beta = np.round(rng.normal(size=(nc, d)) * 2) / 2, float(rng.choice([0.07, 0.5, 1.0]))
        # energies are multiples of 0.01 up to float rounding (< 1e-12 here): two codes tie or differ by
        # >= 0.01, far above OR-tools' integer rounding, so its codes are optimal too
        optimum = hh.code_energy(hh.assign_codes(unary, s, 0.0, beta, method="ortools"), unary, 0.0, beta)
        group_of, group_size = hh._sibling_groups(None, nc)
        for forward_sources in (0, nc):
            solved = hh._successive_shortest_paths(unary, s, 0.0, beta, group_of, group_size, forward_sources)
            z, cost, _ = solved
            assert hh.code_energy(z, unary, 0.0, beta) == pytest.approx(optimum, abs=1e-9), seed
            assert cost == pytest.approx(optimum, abs=1e-9)


def test_ssp_cascade_costs_what_ortools_does():
    """Each level of the CIFAR presets' cascades (k = 2, ks 1 and 2) costs the same as OR-tools' codes, up to
    the first level where the codes differ (on ties; later levels then have other sibling groups)."""
    rng = np.random.default_rng(28)
    compared = 0
    for i in range(24):
        d, beta = [(32, 0.07), (32, 0.1), (64, 1.0)][i % 3]
        unary = (0.05, 0.5, 0.05)[i // 3 % 3] * rng.normal(size=(2, 64, d)) + (i // 3 % 3 == 2) * rng.normal(
            size=(2, 1, d)
        )
        ks = 1 + i // 12
        runs = [hh.cascade_codes(unary, ks, 100.0, beta, method=m, log=True) for m in ("ortools", "ssp")]
        for level, (ortools, ssp) in enumerate(zip(*(log["levels"] for _, log in runs))):
            # OR-tools rounds costs at 2^-30 or finer, each energy sums < 300 terms of size < 1e3: 1e-6 apart
            assert ssp["energy"] == pytest.approx(ortools["energy"], abs=1e-6)
            compared += 1
            if not np.array_equal(runs[0][0][level], runs[1][0][level]):
                break
    assert compared >= 40  # both levels of most cascades (here all 48: the codes were the same)


def test_assignment_hands_the_flow_what_it_does_not_solve():
    rng = np.random.default_rng(26)
    unary, groups = rng.normal(size=(12, 8)), np.repeat(np.arange(4), 3)
    crowded = rng.normal(size=(24, 8)) + 10 * np.eye(8)[np.zeros(24, int)]  # all prefer bucket 0
    two_buckets, siblings_may_share = (unary, 2, 100.0, 0.1, groups), (unary, 1, 0.5, 0.1, groups)
    for args in (two_buckets, siblings_may_share, (crowded, 1, 100.0, 0.1, None)):
        z, log = hh.assign_codes(*args, method="assignment", log=True)
        assert log["method"] == "ortools"
        np.testing.assert_array_equal(z, hh.assign_codes(*args, method="ortools"))
    pairs = np.repeat(np.arange(6), 2)  # siblings in pairs: few (group, bucket) nodes
    assert hh.assign_codes(unary, 1, 100.0, 0.1, pairs, method="assignment", log=True)[1]["method"] == (
        "assignment"
    )


def test_ssp_hands_the_flow_many_classes_at_more_than_one_bucket():
    rng = np.random.default_rng(27)
    many = rng.normal(size=(hh.SSP_MAX_CLASSES + 1, 16))
    z, log = hh.assign_codes(many, 2, 100.0, 0.1, method="ssp", log=True)
    assert log["method"] == "ortools"
    np.testing.assert_array_equal(z, hh.assign_codes(many, 2, 100.0, 0.1, method="ortools"))
    for unary, sparsity in ((many, 1), (many[: hh.SSP_MAX_CLASSES], 2)):  # its own solve
        assert hh.assign_codes(unary, sparsity, 100.0, 0.1, method="ssp", log=True)[1]["method"] == "ssp"


@pytest.mark.parametrize("method", hh.SOLVERS)
def test_no_penalty_gives_top_s(method):
    rng = np.random.default_rng(3)
    unary = rng.normal(size=(6, 8))
    z = hh.assign_codes(unary, 3, 0.0, 0.0, rng.integers(0, 2, 6), method=method)
    top = np.zeros_like(z)
    np.put_along_axis(top, np.argsort(-unary, axis=1)[:, :3], 1, axis=1)
    np.testing.assert_array_equal(z, top)


@pytest.mark.parametrize("method", hh.SOLVERS)
def test_huge_alpha_separates_siblings(method):
    rng = np.random.default_rng(4)
    groups = np.array([0, 0, 0, 0, 1, 1, 2])  # g_r * s = 4 * 2 <= d = 8
    unary = rng.normal(size=(7, 8)) + 3 * np.eye(8)[np.zeros(7, int)]  # everybody prefers bucket 0
    z = hh.assign_codes(unary, 2, 1e3, 0.0, groups, method=method)
    for g in np.unique(groups):
        assert z[groups == g].sum(0).max() <= 1


@pytest.mark.parametrize("method", hh.SOLVERS)
def test_huge_beta_balances_loads(method):
    rng = np.random.default_rng(5)
    unary = rng.normal(size=(11, 4)) + 3 * np.eye(4)[np.zeros(11, int)]
    load = hh.assign_codes(unary, 2, 0.0, 1e3, method=method).sum(0)
    assert load.max() - load.min() <= 1


@pytest.mark.parametrize("method", hh.SOLVERS)
def test_row_shift_leaves_optimum(method):
    rng = np.random.default_rng(6)
    unary, s, groups = rng.normal(size=(5, 6)), 2, np.array([0, 0, 1, 1, 2])
    z = hh.assign_codes(unary, s, 0.7, 0.4, groups, method=method)
    shifted = unary.copy()
    shifted[2] += 5.0
    z_shift = hh.assign_codes(shifted, s, 0.7, 0.4, groups, method=method)
    e = hh.code_energy(z, unary, 0.7, 0.4, groups)
    assert hh.code_energy(z_shift, shifted, 0.7, 0.4, groups) == pytest.approx(e - 5.0 * s)
    assert hh.code_energy(z_shift, unary, 0.7, 0.4, groups) == pytest.approx(e)  # same optimum up to ties


def test_backends_agree_on_larger_instance():
    rng = np.random.default_rng(7)
    unary, groups = rng.normal(size=(24, 16)), rng.integers(0, 6, 24)
    energies = [
        hh.code_energy(hh.assign_codes(unary, 2, 1.0, 0.2, groups, method=m), unary, 1.0, 0.2, groups)
        for m in hh.SOLVERS
    ]
    assert np.ptp(energies) < 1e-9


def test_coarse_cost_scale_is_within_rounding_bound():
    rng = np.random.default_rng(8)
    unary = rng.normal(size=(8, 6))
    exact = hh.code_energy(hh.assign_codes(unary, 2, 0.5, 0.3, method="highs"), unary, 0.5, 0.3)
    z = hh.assign_codes(unary, 2, 0.5, 0.3, method="ortools", cost_scale=1e2)
    # at most 3 flow-carrying arcs per unit of flow, each rounded by <= 0.5 / scale, on both sides
    assert exact <= hh.code_energy(z, unary, 0.5, 0.3) <= exact + 2 * 3 * 16 * 0.5e-2


def test_cascade_groups_and_levels():
    rng = np.random.default_rng(9)
    k, nc, d, ks = 3, 4, 3, 2
    unary = rng.normal(size=(k, nc, d))
    codes = hh.cascade_codes(unary, ks, alpha=0.8, beta=0.3, method="ortools")
    assert codes.shape == (k, nc, d)
    np.testing.assert_array_equal(codes.sum(2), [[1] * nc, [1] * nc, [ks] * nc])
    assert hh.code_energy(codes[0], unary[0], 0.8, 0.3) == pytest.approx(
        brute_force_min(unary[0], 1, 0.8, 0.3, None)
    )
    groups = None
    for level in range(1, k):
        path = codes[:level].argmax(2).T  # (nc, level)
        groups = np.unique(path, axis=0, return_inverse=True)[1].reshape(nc)
        s = ks if level == k - 1 else 1
        assert hh.code_energy(codes[level], unary[level], 0.8, 0.3, groups) == pytest.approx(
            brute_force_min(unary[level], s, 0.8, 0.3, groups)
        )
    assert groups is not None
    same, log = hh.cascade_codes(unary, ks, alpha=0.8, beta=0.3, method="ortools", log=True)
    np.testing.assert_array_equal(same, codes)
    assert log["converged"] and len(log["levels"]) == k
    assert log["n_iter"] == sum(level["n_iter"] for level in log["levels"]) >= k


# --------------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"sparsity": 5}, "sparsity=5"),
        ({"sparsity": 0}, "sparsity=0"),
        ({"unary": np.array([[0.1, np.nan, 0, 0]])}, "finite"),
        ({"unary": np.zeros(4)}, "2-D"),
        ({"groups": [0, 1, 2]}, r"groups has shape \(3,\)"),
        ({"groups": [0.5, 1.0]}, "integer group id"),
        ({"alpha": -1.0}, "alpha=-1.0"),
        ({"beta": np.inf}, "beta=inf"),
        ({"method": "lemon"}, "method='lemon'"),
        ({"cost_scale": 0.0}, "cost_scale=0.0"),
        ({"cost_scale": 1e20, "method": "ortools"}, "cost_scale=1e.20: the integer costs"),  # int64 overflow
        ({"cost_scale": 1e20, "method": "networkx"}, "cost_scale=1e.20: the integer costs"),
    ],
)
def test_bad_input_raises_value_error(kwargs, match):
    args = {"unary": np.zeros((2, 4)), "sparsity": 1, "alpha": 1.0, "beta": 1.0, "groups": None}
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        hh.assign_codes(**args)


def test_bad_bucket_input_raises_value_error():
    with pytest.raises(ValueError, match="ks=5"):
        hh.bucket_ids(np.zeros((3, 8)), 4, 2, 5)
    with pytest.raises(ValueError, match=r"must be \(N, d\*k\)"):
        hh.bucket_ids(np.zeros((3, 7)), 4, 2, 1)
    with pytest.raises(ValueError, match="no int64 ids"):  # 64^11 = 2^66: the ids wrapped to -1, a miss
        hh.bucket_ids(np.zeros((1, 64 * 11)), 64, 11, 1)


def test_highs_is_exact_at_any_cost_scale():
    """HiGHS's feasibility and optimality tolerances are absolute (1e-7): costs are scaled to 1 first."""
    rng = np.random.default_rng(21)
    for scale in (1e-9, 1.0, 1e6):
        unary, groups = rng.normal(size=(5, 4)) * scale, np.array([0, 0, 1, 1, 2])
        codes = [hh.assign_codes(unary, 2, scale, scale, groups, method=m) for m in ("highs", "networkx")]
        energies = [hh.code_energy(z, unary, scale, scale, groups) for z in codes]
        assert energies[0] == pytest.approx(energies[1], rel=1e-9, abs=0)


# --------------------------------------------------------------------------------------------
# Buckets and retrieval
# --------------------------------------------------------------------------------------------


def test_bucket_round_trip_and_structure():
    rng = np.random.default_rng(10)
    d, k, ks = 5, 3, 3
    digits = rng.integers(0, d, size=(50, k))
    np.testing.assert_array_equal(hh.decode_buckets(hh.encode_buckets(digits, d), d, k), digits)
    act = rng.normal(size=(40, d * k))
    ids = hh.bucket_ids(act, d, k, ks)
    assert ids.shape == (40, ks) and ids.min() >= 0 and ids.max() < d**k
    path = hh.decode_buckets(ids, d, k)
    levels = act.reshape(40, k, d)
    for i in range(40):
        assert len(set(ids[i])) == ks
        assert (path[i, :, : k - 1] == levels[i, : k - 1].argmax(1)).all()  # one prefix: argmax path
        assert set(path[i, :, -1]) == set(np.argsort(-levels[i, -1])[:ks])


def test_single_level_codes_are_top_ks():
    act = np.random.default_rng(11).normal(size=(30, 9))
    np.testing.assert_array_equal(hh.bucket_ids(act, 9, 1, 4), np.argsort(-act, axis=1, kind="stable")[:, :4])


def brute_candidates(db_buckets, query_buckets, self_ids):
    return [
        sorted(
            i
            for i in range(len(db_buckets))
            if i != self_ids[q] and set(db_buckets[i]) & set(query_buckets[q])
        )
        for q in range(len(query_buckets))
    ]


def test_retrieval_matches_brute_force():
    rng = np.random.default_rng(12)
    d, k, ks, n = 3, 2, 2, 60
    act = rng.normal(size=(n, d * k))
    index = hh.HashIndex(act, rng.normal(size=(n, 4)), d, k, ks)
    self_ids = np.arange(n)
    found = index.candidates(act, K=0, self_ids=self_ids)
    expected = brute_candidates(index.buckets, index.buckets, self_ids)
    assert [f.tolist() for f in found] == expected
    queries = rng.normal(size=(20, d * k))
    found = index.candidates(queries, K=0)
    assert [f.tolist() for f in found] == brute_candidates(
        index.buckets, hh.bucket_ids(queries, d, k, ks), [-1] * 20
    )


def test_search_reranks_candidates_by_distance():
    rng = np.random.default_rng(21)
    d, k, ks, n, K = 3, 2, 2, 80, 5
    act, emb = rng.normal(size=(n, d * k)), rng.normal(size=(n, 3))
    index = hh.HashIndex(act, emb, d, k, ks)
    found = index.candidates(act, K=K, self_ids=np.arange(n))
    for max_pairs in (7, 2**21):  # several query blocks, or one
        neighbors, n_cand = index.search(act, emb, K, self_ids=np.arange(n), max_pairs=max_pairs)
        assert n_cand.tolist() == [len(f) for f in found]
        for q in range(n):
            dist = ((emb[found[q]] - emb[q]) ** 2).sum(1)
            np.testing.assert_array_equal(neighbors[q], found[q][np.argsort(dist)[:K]])


@pytest.mark.parametrize("d, k, n", [(4, 2, 30), (8, 3, 400)])  # buckets in use < 64 probes (ranked), or more
def test_expansion_follows_probe_order(d, k, n):
    rng = np.random.default_rng(13)
    ks, K = 1, 12
    act = rng.normal(size=(n, d * k))
    index = hh.HashIndex(act, rng.normal(size=(n, 3)), d, k, ks)
    found = index.candidates(act, K=K, self_ids=np.arange(n))
    again = index.candidates(act, K=K, self_ids=np.arange(n))
    assert [f.tolist() for f in found] == [f.tolist() for f in again]  # deterministic
    all_probes = hh.probe_buckets(act[:30], d, k, 0, d**k)
    holds = {}
    for i, bucket in enumerate(index.buckets[:, 0]):
        holds.setdefault(bucket, set()).add(i)
    for q in range(30):
        assert len(found[q]) >= K and q not in found[q]
        union = set()
        for t in range(d**k):  # smallest probe prefix holding K items besides the query
            union |= holds.get(all_probes[q, t], set()) - {q}
            if t >= ks - 1 and len(union) >= K:
                break
        assert found[q].tolist() == sorted(union)


def test_search_for_more_neighbours_than_exist_ranks_the_used_buckets(monkeypatch):
    """d^k = 1e6 buckets, 10 items: probed one by one, 1e6 probes (at d^k = 1e9 minutes and all memory);
    the 10 buckets in use are ranked instead, after the first chunk of 64 probes at most."""
    rng = np.random.default_rng(16)
    act, emb = rng.random((10, 2000)), rng.random((10, 2))
    index = hh.HashIndex(act, emb, 1000, 2, 1)
    enumerated, probe = [], hh.probe_buckets

    def counted(a, d, k, lo, hi):
        enumerated.append(hi - lo)
        return probe(a, d, k, lo, hi)

    monkeypatch.setattr(hh, "probe_buckets", counted)
    neighbors, n_cand = index.search(act[:3], emb[:3], 20, self_ids=[0, 1, -1])
    np.testing.assert_array_equal(neighbors, hh.exhaustive_search(emb[:3], emb, 20, self_ids=[0, 1, -1]))
    assert n_cand.tolist() == [9, 9, 10]
    assert (neighbors[:2, 9:] == -1).all() and (neighbors[2, 10:] == -1).all()  # fewer than K exist
    assert sum(enumerated) <= 1 + 3 * 64, enumerated


def test_query_in_empty_bucket_expands():
    db = np.eye(4)[np.zeros(10, int)]  # every item in bucket 0
    index = hh.HashIndex(db, np.arange(10.0)[:, None], 4, 1, 1)
    query = np.array([[0.0, 1.0, 0.5, 0.2]])  # probes buckets 1, 2, 3, then 0
    assert index.candidates(query, K=0)[0].tolist() == []
    neighbors, n_cand = index.search(query, np.array([[2.2]]), 3)
    assert n_cand.tolist() == [10] and neighbors.tolist() == [[2, 3, 1]]


def test_search_with_everything_in_one_bucket_is_exhaustive():
    rng = np.random.default_rng(14)
    n, d = 80, 6
    act = rng.normal(size=(n, d))
    act[:, 2] = 100.0  # all items and queries hash to bucket 2
    emb = rng.normal(size=(n, 5))
    labels = rng.integers(0, 4, n)
    index = hh.HashIndex(act, emb, d, 1, 1)
    for K in (1, 4, 16):
        neighbors, n_cand = index.search(act, emb, K, self_ids=np.arange(n))
        exact = hh.exhaustive_search(emb, emb, K, self_ids=np.arange(n))
        np.testing.assert_array_equal(neighbors, exact)
        assert hh.precision_at_k(neighbors, labels, labels) == hh.precision_at_k(exact, labels, labels)
        assert hh.speedup_factor(n_cand, n - 1) == 1.0


def test_exhaustive_search_matches_sorting():
    rng = np.random.default_rng(15)
    q, db = rng.normal(size=(7, 3)), rng.normal(size=(20, 3))
    dist = ((q[:, None] - db[None]) ** 2).sum(-1)
    np.testing.assert_array_equal(hh.exhaustive_search(q, db, 5), np.argsort(dist, axis=1)[:, :5])
    # a stored query loses only its own row: one that is not stored keeps all K
    mixed = hh.exhaustive_search(np.array([[0.0], [5.0]]), np.array([[0.0], [1.0]]), 2, self_ids=[0, -1])
    assert mixed.tolist() == [[1, -1], [1, 0]]


def test_precision_at_k_counts_misses():
    neighbors = np.array([[0, 1, -1, -1], [2, 3, 1, 0]])
    labels = np.array([0, 0, 1, 1])
    assert hh.precision_at_k(neighbors, np.array([0, 1]), labels) == pytest.approx((2 / 4 + 2 / 4) / 2)


# --------------------------------------------------------------------------------------------
# Speedup factor
# --------------------------------------------------------------------------------------------


def one_hot_activations(bucket, d):
    return np.eye(d)[bucket]


def test_suf_even_spread_is_number_of_buckets():
    B, per = 8, 25
    db = one_hot_activations(np.repeat(np.arange(B), per), B)
    index = hh.HashIndex(db, np.zeros((len(db), 1)), B, 1, 1)
    _, n_cand = index.search(one_hot_activations(np.arange(B), B), np.zeros((B, 1)), 1)
    assert hh.speedup_factor(n_cand, len(db)) == pytest.approx(B)


def test_suf_occupancy_form():
    rng = np.random.default_rng(16)
    d = 10
    bucket = rng.integers(0, d, 500)
    index = hh.HashIndex(one_hot_activations(bucket, d), np.zeros((500, 1)), d, 1, 1)
    _, n_cand = index.search(one_hot_activations(bucket, d), np.zeros((500, 1)), 1)
    sizes = np.bincount(bucket)
    assert hh.speedup_factor(n_cand, 500) == pytest.approx(500**2 / (sizes**2).sum())


@pytest.mark.parametrize("d, k, ks", [(16, 1, 1), (16, 1, 2), (64, 1, 2), (16, 2, 1), (16, 2, 2)])
def test_suf_of_random_codes(d, k, ks):
    rng = np.random.default_rng(17)
    index = hh.HashIndex(rng.normal(size=(4000, d * k)), np.zeros((4000, 1)), d, k, ks)
    _, n_cand = index.search(rng.normal(size=(400, d * k)), np.zeros((400, 1)), 1)
    expected = d ** (k - 1) / (1 - comb(d - ks, ks) / comb(d, ks))
    assert hh.speedup_factor(n_cand, 4000) == pytest.approx(expected, rel=0.05)


def test_suf_formula_values():
    def suf(d, ks):
        return 1 / (1 - comb(d - ks, ks) / comb(d, ks))

    assert suf(16, 1) == pytest.approx(16)
    assert suf(16, 2) == pytest.approx(4.138, abs=1e-3)
    assert suf(64, 2) == pytest.approx(16.13, abs=1e-2)


# --------------------------------------------------------------------------------------------
# NMI
# --------------------------------------------------------------------------------------------


def test_nmi_extremes_and_hand_case():
    rng = np.random.default_rng(18)
    labels = rng.integers(0, 10, 5000)
    assert hh.nmi((labels * 7 + 3) % 10, labels) == pytest.approx(1.0)
    assert hh.nmi(rng.integers(0, 10, 5000), labels) < 0.01
    assert hh.nmi(np.zeros(9), np.ones(9)) == 1.0  # both constant
    # by hand: joint (1/2, 1/4, 1/4) over (c, y) = (0, 0), (1, 0), (1, 1)
    mutual = 0.5 * np.log(4 / 3) + 0.25 * np.log(2 / 3) + 0.25 * np.log(2)
    entropies = np.log(2) - (0.75 * np.log(0.75) + 0.25 * np.log(0.25))
    assert hh.nmi([0, 0, 1, 1], [0, 0, 0, 1]) == pytest.approx(mutual / (entropies / 2), abs=1e-12)


# --------------------------------------------------------------------------------------------
# Losses and label remapping
# --------------------------------------------------------------------------------------------


def test_masked_distance_properties():
    g = torch.Generator().manual_seed(0)
    fa, fb = torch.randn(5, 6, generator=g), torch.randn(4, 6, generator=g)
    ha, hb = (torch.rand(5, 6, generator=g) < 0.3).float(), (torch.rand(4, 6, generator=g) < 0.3).float()
    d_ab = hh.masked_distance(fa, fb, ha, hb)
    torch.testing.assert_close(d_ab, hh.masked_distance(fb, fa, hb, ha).T)
    assert torch.allclose(hh.masked_distance(fa, fa, ha, ha).diagonal(), torch.zeros(5))
    ones_a, ones_b = torch.ones(5, 6), torch.ones(4, 6)
    torch.testing.assert_close(hh.masked_distance(fa, fb, ones_a, ones_b), torch.cdist(fa, fb, p=1))
    ha[:, :3], hb[:, :3] = 0, 0  # dims 0..2 inactive in every code
    hb[:, 3:] = 1
    f = fa.clone().requires_grad_(True)
    hh.masked_distance(f, fb, ha, hb).sum().backward()
    assert (f.grad[:, :3] == 0).all()
    torch.testing.assert_close(f.grad[:, 3:], torch.sign(fa[:, None, 3:] - fb[None, :, 3:]).sum(1))


def test_triplet_semihard_matches_loop():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(12, 3, generator=g)
    labels = torch.randint(0, 3, (12,), generator=g)
    dist = torch.cdist(x, x)
    losses = []
    for i in range(12):
        for j in range(12):
            if i == j or labels[i] != labels[j]:
                continue
            neg = [dist[i, n] for n in range(12) if labels[n] != labels[i]]
            far = [v for v in neg if v > dist[i, j]]
            d_neg = min(far) if far else max(neg)
            losses.append(max(float(dist[i, j] - d_neg + 0.4), 0.0))
    assert float(hh.triplet_semihard_loss(dist, labels, 0.4)) == pytest.approx(np.mean(losses), rel=1e-6)


def indexed_triplet_semihard_loss(dist, labels, margin):
    """The semi-hard triplet loss as first written: the pairs and negatives indexed out."""
    same = labels[:, None] == labels[None, :]
    eye = torch.eye(len(labels), dtype=torch.bool)
    anchor, positive = torch.nonzero(same & ~eye, as_tuple=True)
    negative = ~same[anchor]
    keep = negative.any(1)
    anchor, positive, negative = anchor[keep], positive[keep], negative[keep]
    if len(anchor) == 0:
        return dist.sum() * 0
    d_ap, d_an = dist[anchor, positive], dist[anchor]
    semihard = negative & (d_an > d_ap[:, None])
    nearest_far = torch.where(semihard, d_an, torch.full_like(d_an, math.inf)).min(1).values
    farthest = torch.where(negative, d_an, torch.full_like(d_an, -math.inf)).max(1).values
    return torch.relu(d_ap - torch.where(semihard.any(1), nearest_far, farthest) + margin).mean()


@pytest.mark.parametrize("n_classes", [1, 2, 5, 12])  # 1: no negatives; 12: pairs rare or absent
def test_triplet_semihard_equals_the_indexed_one_with_its_gradient(n_classes):
    g = torch.Generator().manual_seed(n_classes)
    for _ in range(5):
        labels = torch.randint(0, n_classes, (12,), generator=g)
        x = torch.randn(12, 3, generator=g, dtype=torch.float64)
        dist = torch.cdist(x, x) ** 2
        a, b = dist.clone().requires_grad_(), dist.clone().requires_grad_()
        masked = hh.triplet_semihard_loss(a, labels, 0.3)
        indexed = indexed_triplet_semihard_loss(b, labels, 0.3)
        masked.backward()
        indexed.backward()
        assert abs(masked.item() - indexed.item()) < 1e-12
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-12)


@pytest.mark.parametrize("loss", hh.LOSSES)
def test_hash_loss_with_codes_on_the_device_never_waits_for_it(loss):
    g = torch.Generator().manual_seed(4)
    out = torch.randn(6, 2, 2, 5, generator=g, dtype=torch.float64)
    codes = hh.cascade_codes(hh.class_unaries(out, loss).numpy(), 2, 1.0, 0.5, method="ortools")
    labels = hh.level_labels(codes, remap=True)
    with DeviceTracker() as tracker:
        on_device = torch.from_numpy(codes).to(STAND_IN, non_blocking=True)
        labels_on_device = torch.from_numpy(labels).to(STAND_IN, non_blocking=True)
        with tracker.in_phase("train"):
            x = out.to(STAND_IN, non_blocking=True).requires_grad_()
            hh.hash_loss(x, on_device, labels_on_device, loss, 0.3, 0.01).backward()
    assert tracker.counts["train"] == {}, tracker.report()["sites"]
    assert x.grad.abs().sum() > 0


def test_npairs_matches_loop_and_all_ones_codes():
    g = torch.Generator().manual_seed(2)
    a, p = torch.randn(6, 4, generator=g), torch.randn(6, 4, generator=g)
    labels = torch.tensor([0, 1, 1, 2, 3, 3])
    z_a, z_p = (torch.rand(6, 4, generator=g) < 0.5).float(), (torch.rand(6, 4, generator=g) < 0.5).float()
    expected = 0.0
    for i in range(6):
        logits = torch.stack([((z_a[i] + z_p[j]) > 0).float() @ (a[i] * p[j]) for j in range(6)])
        pos = labels == labels[i]
        expected += -(torch.log_softmax(logits, 0)[pos]).mean() / 6
    expected += 0.01 / 4 * ((a**2).sum(1).mean() + (p**2).sum(1).mean())
    got = hh.npairs_loss(a, p, labels, 0.01, z_a, z_p)
    assert float(got) == pytest.approx(float(expected), rel=1e-6)
    ones = torch.ones(6, 4)
    torch.testing.assert_close(
        hh.npairs_loss(a, p, labels, 0.01, ones, ones), hh.npairs_loss(a, p, labels, 0.01)
    )


@pytest.mark.parametrize("loss", hh.LOSSES)
def test_hash_loss_gradient_matches_finite_differences(loss):
    g = torch.Generator().manual_seed(3)
    nc, m, k, d = 5, 2, 2, 4
    out = torch.randn(nc, m, k, d, generator=g, dtype=torch.float64, requires_grad=True)
    codes = hh.cascade_codes(hh.class_unaries(out, loss), 2, 1.0, 0.5, method="ortools")
    labels = hh.level_labels(codes, remap=True)
    assert torch.autograd.gradcheck(
        lambda o: hh.hash_loss(o, codes, labels, loss, 0.3, 0.01), (out,), fast_mode=True
    )


def numpy_unaries(out: np.ndarray, loss: str) -> np.ndarray:
    """The unaries written in numpy float64: per-level L2 normalization (triplet), mean over examples."""
    x = out.astype(np.float64)
    if loss == "triplet":
        x = x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12)
    return x.mean(1).transpose(1, 0, 2)


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("loss", hh.LOSSES)
def test_class_unaries_on_the_device_match_numpy(loss, dtype, device):
    out = torch.randn(6, 3, 2, 5, generator=torch.Generator().manual_seed(1)).to(dtype)
    out[0, 0, 1] = 0  # a zero level vector: normalized to zero, not NaN
    unary = hh.class_unaries(out.to(device), loss)
    assert unary.device.type == device and unary.dtype == torch.float64 and unary.shape == (2, 6, 5)
    expected = numpy_unaries(out.double().numpy(), loss)
    np.testing.assert_allclose(unary.cpu().numpy(), expected, rtol=0, atol=1e-6)
    codes = hh.cascade_codes(unary.cpu().numpy(), 2, 1.0, 0.5, method="ortools")
    np.testing.assert_array_equal(codes, hh.cascade_codes(expected, 2, 1.0, 0.5, method="ortools"))


def test_remap_labels():
    rng = np.random.default_rng(19)
    codes = rng.integers(0, 2, size=(40, 5))
    labels = hh.remap_labels(codes)
    same_code = (codes[:, None] == codes[None]).all(-1)
    np.testing.assert_array_equal(labels[:, None] == labels[None], same_code)
    permuted = hh.remap_labels(codes[:, rng.permutation(5)])
    np.testing.assert_array_equal(permuted[:, None] == permuted[None], same_code)
    codes3 = np.zeros((2, 3, 4), int)
    codes3[:, [0, 1, 2], [1, 1, 3]] = 1
    for row in hh.level_labels(codes3, remap=True):  # classes 0 and 1 share a code, class 2 differs
        assert row[0] == row[1] != row[2]
    np.testing.assert_array_equal(hh.level_labels(codes3, remap=False), [[0, 1, 2], [0, 1, 2]])


def test_lsh_activations_are_sign_buckets_with_multi_probe_order():
    rng = np.random.default_rng(0)
    emb = rng.normal(size=(50, 6))
    act = hh.lsh_activations(emb, 4, seed=3)
    planes = np.random.default_rng(3).standard_normal((6, 4))
    proj = emb @ planes
    bits = (proj > 0).astype(int)
    assert act.shape == (50, 16)
    np.testing.assert_array_equal(act.argmax(1), bits @ (1 << np.arange(4)))  # the sign pattern's bucket
    second = np.argsort(-act, axis=1)[:, 1]  # next probe: the sign pattern with its weakest bit flipped
    weakest = np.abs(proj).argmin(1)
    np.testing.assert_array_equal(second, (bits @ (1 << np.arange(4))) ^ (1 << weakest))
    np.testing.assert_array_equal(hh.lsh_activations(-emb, 4, seed=3).argmax(1), 15 - act.argmax(1))
    with pytest.raises(ValueError, match="n_bits=0"):
        hh.lsh_activations(emb, 0)


def test_sign_activations_rank_the_sign_bucket_first():
    proj = np.array([[0.5, -2.0, 0.1], [-1.0, 3.0, -0.2]])
    act = hh.sign_activations(proj)
    np.testing.assert_array_equal(act.argmax(1), [0b101, 0b010])  # bit j set <=> p_j > 0
    np.testing.assert_array_equal(np.argsort(-act, axis=1)[:, 1], [0b001, 0b110])  # weakest bit flipped
    with pytest.raises(ValueError, match=r"need \(N, n\)"):
        hh.sign_activations(np.zeros(3))


def dch_loss_by_definition(h, y, gamma, quantization):
    """DCH's loss written out pair by pair in float64 (Cao et al. 2018, with the balancing weights
    |S| / |S_s| and |S| / |S_d|), the oracle of `hh.dch_loss`."""
    n, bits = h.shape
    unit = h / np.linalg.norm(h, axis=1, keepdims=True)
    costs = {True: [], False: []}
    for i in range(n):
        for j in range(n):
            if i != j:
                d = bits / 2 * (1 - unit[i] @ unit[j])
                sigma = gamma / (gamma + d)
                costs[bool(y[i] == y[j])].append(-np.log(sigma) if y[i] == y[j] else -np.log(1 - sigma))
    to_ones = bits / 2 * (1 - np.abs(h).sum(1) / (np.linalg.norm(h, axis=1) * np.sqrt(bits)))
    return np.mean(costs[True]) + np.mean(costs[False]) + quantization * np.mean(np.log(1 + to_ones / gamma))


def test_dch_loss_is_its_definition_and_its_gradient_finite_differences():
    rng = np.random.default_rng(0)
    h = np.tanh(rng.normal(size=(8, 6)))
    y = np.array([0, 0, 1, 1, 1, 2, 3, 3])
    codes = torch.tensor(h, requires_grad=True)
    for gamma, quantization in ((20.0, 0.1), (2.0, 1.5)):
        loss = hh.dch_loss(codes, torch.from_numpy(y), gamma, quantization)
        # float64 sums of 56 pair terms and 8 quantization terms: rounding stays near 1e-15 relative
        assert loss.item() == pytest.approx(dch_loss_by_definition(h, y, gamma, quantization), rel=1e-12)
    # central differences at eps 1e-6: truncation ~eps^2 f''' ~ 1e-12, rounding ~1e-16 / eps = 1e-10
    assert torch.autograd.gradcheck(
        lambda c: hh.dch_loss(c, torch.from_numpy(y), 2.0, 1.5), (codes,), eps=1e-6, atol=1e-8, rtol=1e-6
    )
    # similar codes that agree and dissimilar ones that point apart cost less than the reverse
    aligned = torch.tensor([[1.0, 1, 1, 1], [1, 1, 1, 1], [-1, -1, -1, -1], [-1, -1, -1, -1]]) * 0.9
    crossed = aligned[[0, 2, 1, 3]]
    labels = torch.tensor([0, 0, 1, 1])
    assert hh.dch_loss(aligned, labels) < hh.dch_loss(crossed, labels)
    with pytest.raises(ValueError, match="a similar and a dissimilar pair"):
        hh.dch_loss(aligned, torch.tensor([0, 1, 2, 3]))


def test_docstring_examples_run():
    import doctest

    import runner.methods.hier_hash

    for module in (runner.methods.hier_hash,):
        result = doctest.testmod(module)
        assert result.attempted and not result.failed, module.__name__
