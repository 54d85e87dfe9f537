"""Partial Wasserstein covering: every property of section 4 of the digest, checked against oracles
(POT's exact partial OT, scipy HiGHS LP, brute force over subsets, finite differences)."""

import itertools
import math

import numpy as np
import ot
import pytest
from scipy.optimize import linprog

from runner.methods._common import ConvergenceWarning, transport_constraints
from runner.methods.pwc import (
    BASELINES,
    PW_METHODS,
    cover,
    entropic_partial_wasserstein_dual,
    partial_wasserstein_dual,
)

SEQUENTIAL = ("greedy", "sensitivity", "ctrans", "entropic")


def random_instance(rng, n, m, zero_cols=0, zero_rows=0, slack=True):
    cost = rng.random((n, m)) * 3
    a = rng.random(n)
    a[:zero_rows] = 0
    a /= a.sum()
    b = rng.random(m)
    b[:zero_cols] = 0
    b *= (rng.uniform(1.0, 2.0) if slack else 1.0) / b.sum()
    return cost, a, b


def highs_partial(cost, a, b):
    rows, cols = transport_constraints(*cost.shape)
    res = linprog(cost.ravel(), A_eq=rows, b_eq=a, A_ub=cols, b_ub=b, method="highs")
    assert res.status == 0
    return res.fun


def points(rng, n_app, n_dev, dim=2):
    return rng.normal(size=(n_app, dim)), rng.normal(0.5, 1.0, size=(n_dev, dim))


def pw_reduced(X_app, X_dev, added):
    """PW(X_app, X_dev + added) on the reduced LP, built independently of the library's [cand|dev]."""
    cols = np.vstack([X_dev, added]) if len(added) else X_dev
    a = np.full(len(X_app), 1 / len(X_app))
    return partial_wasserstein_dual(ot.dist(X_app, cols), a, np.full(len(cols), 1 / len(X_dev)))[0]


def brute_force(X_app, X_dev, k, cand=None):
    cand = X_app if cand is None else cand
    values = {s: pw_reduced(X_app, X_dev, cand[list(s)]) for s in itertools.combinations(range(len(cand)), k)}
    best = min(values, key=values.get)
    return best, values[best]


# --- 1-3: the LP solver ------------------------------------------------------------------------------


CASES = [(seed, seed % 3, int(seed % 4 == 0), seed % 5 > 0) for seed in range(20)]


@pytest.mark.parametrize("seed,zero_cols,zero_rows,slack", CASES)
def test_primal_matches_pot_and_highs(seed, zero_cols, zero_rows, slack):
    rng = np.random.default_rng(seed)
    n, m = rng.integers(2, 13, size=2)
    cost, a, b = random_instance(rng, n, m + zero_cols, zero_cols, zero_rows, slack)
    value, f, g, log = partial_wasserstein_dual(cost, a, b, log=True)
    reference = ot.partial.partial_wasserstein2(a, b, cost, m=min(a.sum(), b.sum()))
    assert value == pytest.approx(reference, abs=1e-9)
    assert value == pytest.approx(highs_partial(cost, a, b), abs=1e-9)
    plan = log["plan"]
    assert plan.min() >= 0
    np.testing.assert_allclose(plan.sum(1), a, atol=1e-12)
    assert (plan.sum(0) <= b + 1e-12).all()
    assert np.sum(plan * cost) == pytest.approx(value, abs=1e-12)
    assert log["converged"] and log["n_iter"] == 1 and log["err"] < 1e-9
    # 2: dual feasibility and strong duality, zero-mass entries included
    assert g.max() <= 1e-12
    assert (f[:, None] + g[None, :] - cost).max() <= 1e-9
    assert f @ a + g @ b == pytest.approx(value, abs=1e-9)


def test_empty_selection_is_the_wasserstein_distance():
    rng = np.random.default_rng(0)
    for n_app, n_dev in [(12, 12), (15, 9), (7, 11)]:
        X_app, X_dev = points(rng, n_app, n_dev)
        w2 = ot.emd2(np.full(n_app, 1 / n_app), np.full(n_dev, 1 / n_dev), ot.dist(X_app, X_dev))
        for method in PW_METHODS + BASELINES:
            pw = cover(X_app, X_dev, 2, method, seed=0, scores=np.zeros(n_app)).pw
            assert pw[0] == pytest.approx(w2, abs=1e-12)


def test_simplex_iteration_limit_is_an_error():
    cost, a, b = random_instance(np.random.default_rng(1), 30, 40)
    with pytest.raises(RuntimeError, match="ot.emd"):
        partial_wasserstein_dual(cost, a, b, max_iter=2)


# --- 4-6: monotone submodular objective, greedy guarantee, MILP -----------------------------------------


def test_monotone_and_submodular_on_random_triples():
    rng = np.random.default_rng(0)
    worst = np.inf
    for _ in range(200):
        X_app, X_dev = points(rng, 7, 4)
        order = rng.permutation(7)
        size_b = rng.integers(0, 6)
        B = order[:size_b]
        A = B[: rng.integers(0, size_b + 1)]
        x = order[size_b]
        pw = {name: pw_reduced(X_app, X_dev, X_app[list(s)]) for name, s in [("A", A), ("B", B)]}
        pw_x = {name: pw_reduced(X_app, X_dev, X_app[list(s) + [x]]) for name, s in [("A", A), ("B", B)]}
        assert pw_x["A"] <= pw["A"] + 1e-12 and pw_x["B"] <= pw["B"] + 1e-12 and pw["B"] <= pw["A"] + 1e-12
        worst = min(worst, (pw["A"] - pw_x["A"]) - (pw["B"] - pw_x["B"]))
    assert worst >= -1e-9


@pytest.mark.parametrize("method", PW_METHODS + BASELINES)
def test_every_pw_history_is_non_increasing(method):
    X_app, X_dev = points(np.random.default_rng(3), 25, 15)
    pw = cover(X_app, X_dev, 8, method, seed=0, scores=np.cos(np.arange(25.0))).pw
    assert len(pw) == 9 and (np.diff(pw) <= 1e-12).all()


def test_greedy_guarantee_and_milp_equal_brute_force():
    rng = np.random.default_rng(0)
    ratios = []
    for _ in range(20):
        n_app, n_dev, k = 9, int(rng.integers(3, 10)), int(rng.integers(1, 4))
        X_app, X_dev = points(rng, n_app, n_dev)
        _, opt = brute_force(X_app, X_dev, k)
        pw0 = pw_reduced(X_app, X_dev, [])
        greedy = cover(X_app, X_dev, k, "greedy")
        ratios.append((pw0 - greedy.pw[-1]) / (pw0 - opt))
        milp = cover(X_app, X_dev, k, "milp")
        assert milp.pw[-1] == pytest.approx(opt, abs=1e-9)
        assert milp.pw[-1] == pytest.approx(pw_reduced(X_app, X_dev, X_app[milp.indices]), abs=1e-12)
    assert min(ratios) >= 1 - 1 / math.e
    assert max(ratios) <= 1 + 1e-9


def test_milp_with_separate_candidates_equals_brute_force():
    rng = np.random.default_rng(5)
    X_app, X_dev = points(rng, 8, 5)
    cand = rng.normal(1.0, 1.5, size=(7, 2))
    _, opt = brute_force(X_app, X_dev, 3, cand)
    assert cover(X_app, X_dev, 3, "milp", candidates=cand).pw[-1] == pytest.approx(opt, abs=1e-9)


# --- 7-8: quasi-greedy scores ---------------------------------------------------------------------------


def test_ctransform_gain_is_an_upper_bound():
    rng = np.random.default_rng(0)
    for _ in range(30):
        n_app, n_dev = rng.integers(2, 10, size=2)
        X_app, X_dev = points(rng, n_app, n_dev)
        S = list(rng.choice(n_app, rng.integers(0, n_app), replace=False))
        cost = np.hstack([ot.dist(X_app, X_app), ot.dist(X_app, X_dev)])
        b = np.r_[np.zeros(n_app), np.full(n_dev, 1 / n_dev)]
        b[S] = 1 / n_dev
        value, f, g = partial_wasserstein_dual(cost, np.full(n_app, 1 / n_app), b)
        g_c = np.minimum(0, (cost[:, :n_app] - f[:, None]).min(0))
        for j in set(range(n_app)) - set(S):
            assert g[j] == pytest.approx(g_c[j], abs=1e-12)
            gain = value - pw_reduced(X_app, X_dev, X_app[S + [j]])
            assert gain <= -g_c[j] / n_dev + 1e-9


def test_ctransform_gain_is_exact_for_one_point():
    rng = np.random.default_rng(1)
    for _ in range(10):
        x, y, s = rng.normal(size=(3, 1, 2))
        cost = ot.dist(x, np.vstack([s, y]))
        value, f, g = partial_wasserstein_dual(cost, np.ones(1), np.array([0.0, 1.0]))
        gain = value - pw_reduced(x, y, s)
        assert gain == pytest.approx(max(0.0, ot.dist(x, y)[0, 0] - ot.dist(x, s)[0, 0]), abs=1e-12)
        assert gain == pytest.approx(-g[0], abs=1e-12)


@pytest.mark.parametrize("n_app,n_dev,k", [(8, 8, 3), (8, 4, 3), (12, 12, 4)])
def test_quasi_greedy_quality(n_app, n_dev, k):
    rng = np.random.default_rng(0)
    ratios = {"sensitivity": [], "ctrans": []}
    for _ in range(40):
        X_app, X_dev = points(rng, n_app, n_dev)
        pw0, opt = pw_reduced(X_app, X_dev, []), cover(X_app, X_dev, k, "milp").pw[-1]
        for method, r in ratios.items():
            r.append((pw0 - cover(X_app, X_dev, k, method).pw[-1]) / (pw0 - opt))
    means = {m: np.mean(r) for m, r in ratios.items()}
    assert min(means.values()) > 0.9
    assert means["sensitivity"] >= means["ctrans"]
    assert max(max(r) for r in ratios.values()) <= 1 + 1e-9


# --- 9-11: full covering, scale, contract ---------------------------------------------------------------


@pytest.mark.parametrize("n_app,n_dev", [(10, 10), (14, 6)])
def test_full_covering_gives_zero(n_app, n_dev):
    X_app, X_dev = points(np.random.default_rng(2), n_app, n_dev)
    assert pw_reduced(X_app, X_dev, X_app) == pytest.approx(0, abs=1e-12)
    for method in ("ctrans", "sensitivity", "random"):
        result = cover(X_app, X_dev, n_app, method, seed=0)
        assert sorted(result.indices) == list(range(n_app))
        assert result.pw[-1] == pytest.approx(0, abs=1e-12)


def test_scale_invariance():
    rng = np.random.default_rng(4)
    for _ in range(5):
        X_app, X_dev = points(rng, 20, 12)
        for method in ("greedy", "sensitivity", "ctrans"):
            base = cover(X_app, X_dev, 5, method)
            scaled = cover(7.3 * X_app, 7.3 * X_dev, 5, method)
            assert list(scaled.indices) == list(base.indices)
            np.testing.assert_allclose(scaled.pw, 7.3**2 * base.pw, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("method", PW_METHODS + BASELINES)
def test_contract_with_explicit_candidates(method):
    rng = np.random.default_rng(6)
    X_app, X_dev = points(rng, 18, 10)
    cand = rng.normal(size=(13, 2))
    result = cover(X_app, X_dev, 6, method, candidates=cand, seed=1, scores=np.cos(np.arange(13.0)))
    assert result.indices.dtype == np.int64 and len(set(result.indices.tolist())) == 6
    assert result.indices.min() >= 0 and result.indices.max() < 13
    np.testing.assert_allclose(
        result.pw, [pw_reduced(X_app, X_dev, cand[result.indices[:t]]) for t in range(7)], atol=1e-12
    )


@pytest.mark.parametrize("method", SEQUENTIAL)
def test_batch_selection(method):
    X_app, X_dev = points(np.random.default_rng(7), 20, 10)
    kw = {"reg": 0.3, "reg_relative": True} if method == "entropic" else {}  # batching, not eps, is tested
    one = cover(X_app, X_dev, 7, method, **kw)
    batched = cover(X_app, X_dev, 7, method, batch=3, **kw)
    assert len(set(batched.indices.tolist())) == 7 and (np.diff(batched.pw) <= 1e-12).all()
    assert list(batched.indices[:1]) == list(one.indices[:1])  # first pick: same scores, same argmin
    if method in ("greedy", "sensitivity"):  # fewer rounds, fewer selection LPs
        assert batched.n_lp < one.n_lp


def test_greedy_picks_best_single_point_and_counts_lps():
    X_app, X_dev = points(np.random.default_rng(8), 10, 6)
    result = cover(X_app, X_dev, 3, "greedy")
    best_first, value = brute_force(X_app, X_dev, 1)
    assert result.indices[0] == best_first[0] and result.pw[1] == pytest.approx(value, abs=1e-12)
    assert result.n_lp == 1 + 10 + 9 + 8  # PW({}), then one LP per remaining candidate per step
    assert cover(X_app, X_dev, 3, "ctrans").n_lp == 3 + 1  # one reduced LP per step, + PW(S_3)
    assert cover(X_app, X_dev, 3, "sensitivity").n_lp == 3 + 4  # full LPs + the reduced pw curve


def test_baselines():
    rng = np.random.default_rng(9)
    X_app, X_dev = points(rng, 30, 40)
    assert list(cover(X_app, X_dev, 5, "random", seed=3).indices) == list(
        np.random.default_rng(3).choice(30, 5, replace=False)
    )
    kc = cover(X_app, X_dev, 4, "kcenter").indices
    centers = X_dev
    for j in kc:  # each pick is the candidate farthest from the dev set and the earlier picks
        assert j == np.argmax(ot.dist(X_app, centers).min(1))
        centers = np.vstack([centers, X_app[j]])
    from sklearn.neighbors import LocalOutlierFactor

    scores = LocalOutlierFactor(novelty=True).fit(X_dev).score_samples(X_app)
    assert list(cover(X_app, X_dev, 5, "lof").indices) == list(np.argsort(scores)[:5])


# --- 12: entropic ----------------------------------------------------------------------------------------


def test_entropic_converges_to_the_lp():
    rng = np.random.default_rng(0)
    cost, a, b = random_instance(rng, 8, 10)
    cost /= cost.max()
    exact = partial_wasserstein_dual(cost, a, b)[0]
    errors = []
    for reg in (0.1, 0.03, 0.01):
        _, f, g, log = entropic_partial_wasserstein_dual(cost, a, b, reg, 100_000, 1e-10, log=True)
        plan = log["plan"]
        assert np.abs(plan.sum(1) - a).sum() < 1e-6 and (plan.sum(0) - b).max() < 1e-6
        assert g.max() <= 0
        errors.append(np.sum(plan * cost) - exact)
    assert errors[0] > errors[1] > errors[2] >= -1e-9
    assert errors[2] < 0.02


def test_entropic_gradient_matches_finite_differences():
    rng = np.random.default_rng(1)
    cost, a, b = random_instance(rng, 6, 7)
    cost /= cost.max()
    _, _, g = entropic_partial_wasserstein_dual(cost, a, b, 0.05, max_iter=200_000, tol=1e-14)
    h = 1e-6
    for j in range(7):
        step = np.eye(7)[j] * h
        plus = entropic_partial_wasserstein_dual(cost, a, b + step, 0.05, max_iter=200_000, tol=1e-14)[0]
        minus = entropic_partial_wasserstein_dual(cost, a, b - step, 0.05, max_iter=200_000, tol=1e-14)[0]
        assert (plus - minus) / (2 * h) == pytest.approx(g[j], abs=1e-6)


def test_entropic_ranking_is_the_soft_ctransform():
    rng = np.random.default_rng(2)
    X_app = np.vstack([rng.normal(size=(20, 2)), rng.normal((4, 0), 0.3, size=(6, 2))])
    X_dev = rng.normal(size=(15, 2))
    ent = cover(X_app, X_dev, 3, "entropic", reg=0.05)
    ctr = cover(X_app, X_dev, 3, "ctrans")
    assert ent.indices[0] == ctr.indices[0]
    assert set(ent.indices) <= set(range(20, 26)) and set(ctr.indices) <= set(range(20, 26))


def test_entropic_epsilon_is_absolute_by_default(monkeypatch):
    """The paper's eps = 0.01 in cost units; reg_relative=True scales reg by PW({}) instead."""
    import runner.methods.pwc as pwc

    used = []
    solve = pwc.entropic_partial_wasserstein_dual
    monkeypatch.setattr(
        pwc, "entropic_partial_wasserstein_dual", lambda *a, **kw: used.append(kw["reg"]) or solve(*a, **kw)
    )
    rng = np.random.default_rng(4)
    X_app, X_dev = rng.normal(size=(12, 2)), rng.normal(size=(6, 2))
    cover(X_app, X_dev, 2, "entropic", max_iter=200)
    assert used == [0.01, 0.01]
    used.clear()
    cover(10 * X_app, 10 * X_dev, 1, "entropic", max_iter=200)  # absolute: no rescaling with the data
    assert used == [0.01]
    used.clear()
    pw_empty = cover(X_app, X_dev, 0, "ctrans").pw[0]
    cover(X_app, X_dev, 1, "entropic", reg=0.5, reg_relative=True, max_iter=200)
    assert used == [pytest.approx(0.5 * pw_empty)]
    used.clear()
    same = np.ones((5, 2))  # every point the same: PW({}) = 0 and every cost 0, so reg = 0.5 x 1
    assert cover(same, same, 2, "entropic", reg=0.5, reg_relative=True).pw.tolist() == [0.0, 0.0, 0.0]
    assert used == [0.5, 0.5]


def test_entropy_baseline_takes_the_highest_scores():
    rng = np.random.default_rng(5)
    X_app, X_dev = rng.normal(size=(8, 2)), rng.normal(size=(4, 2))
    scores = np.array([0.1, 0.9, 0.3, 0.9, 0.0, 0.5, 0.2, 0.4])
    result = cover(X_app, X_dev, 3, "entropy", scores=scores)
    assert result.indices.tolist() == [1, 3, 5]  # the tie 1 / 3 goes to the lower index first
    assert result.pw[0] == pytest.approx(cover(X_app, X_dev, 0, "ctrans").pw[0])
    assert np.all(np.diff(result.pw) <= 1e-12)


def test_entropic_rejects_zero_mass_and_warns_when_not_converged():
    cost, a, b = random_instance(np.random.default_rng(3), 5, 6, zero_cols=1)
    with pytest.raises(ValueError, match="log domain"):
        entropic_partial_wasserstein_dual(cost, a, b, 0.1)
    b[0] = 0.1
    with pytest.warns(ConvergenceWarning, match="max_iter=3"):
        _, _, _, log = entropic_partial_wasserstein_dual(cost, a, b, 1e-3, max_iter=3, log=True)
    assert log["n_iter"] == 3 and not log["converged"] and log["err"] >= 1e-9


# --- bad input -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"k": 31}, r"k=31: must be an integer in \[0, 30\]"),
        ({"k": -1}, "k=-1"),
        ({"k": 2.5}, "k=2.5"),
        ({"X_dev": np.zeros((5, 3))}, "X_dev has 3 features but X_app has 2"),
        ({"candidates": np.zeros((5, 4))}, "candidates has 4 features"),
        ({"X_dev": np.zeros((0, 2))}, "X_dev is empty"),
        ({"X_app": np.zeros((0, 2))}, "X_app is empty"),
        ({"X_app": np.full((30, 2), np.nan)}, "X_app contains 60 NaN"),
        ({"X_dev": np.r_[np.zeros((4, 2)), [[np.inf, 0]]]}, "X_dev contains 1 NaN or inf"),
        ({"X_app": np.zeros(30)}, "X_app must be a 2-D array"),
        ({"method": "exact"}, "method='exact': must be one of"),
        ({"batch": 0}, "batch=0"),
        ({"method": "milp", "batch": 2}, "batch=2 applies to"),
        ({"eta": 0.0}, "eta=0.0"),
        ({"reg": -1.0}, "reg=-1.0"),
        ({"method": "entropy"}, "needs finite scores of shape"),
        ({"method": "entropy", "scores": np.zeros(29)}, r"shape \(30,\)"),
    ],
)
def test_bad_input_is_a_clear_value_error(kwargs, match):
    rng = np.random.default_rng(0)
    args = {"X_app": rng.normal(size=(30, 2)), "X_dev": rng.normal(size=(10, 2)), "k": 3}
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        cover(args.pop("X_app"), args.pop("X_dev"), args.pop("k"), **args)


@pytest.mark.parametrize(
    "a,b,match",
    [
        (np.full(3, 1 / 3), np.full(2, 0.4), "infeasible"),
        (np.full(3, 1 / 3), np.full(3, 1 / 3), "shapes"),
        (np.array([0.5, np.nan, 0.5]), np.full(2, 1.0), "a contains NaN"),
        (np.array([0.5, -0.1, 0.6]), np.full(2, 1.0), "masses must be >= 0"),
        (np.zeros(3), np.full(2, 1.0), "zero total mass"),
    ],
)
def test_partial_wasserstein_bad_input(a, b, match):
    with pytest.raises(ValueError, match=match):
        partial_wasserstein_dual(np.ones((3, 2)), a, b)


def test_float32_masses_of_equal_totals_are_feasible():
    """Six float32 sixths sum to 1.00000003 > eight eighths: equal up to float32 rounding (eps 1.2e-7)."""
    cost = np.random.default_rng(0).random((6, 8))
    value32 = partial_wasserstein_dual(cost, np.full(6, 1 / 6, np.float32), np.full(8, 1 / 8, np.float32))[0]
    value64 = partial_wasserstein_dual(cost, np.full(6, 1 / 6), np.full(8, 1 / 8))[0]
    assert value32 == pytest.approx(value64, rel=1e-6)
    with pytest.raises(ValueError, match="infeasible"):  # 0.96 is short by far more than rounding
        partial_wasserstein_dual(cost, np.full(6, 1 / 6, np.float32), np.full(8, 0.12, np.float32))


def test_docstring_examples_run():
    import doctest

    import runner.hooks.pwc
    import runner.methods.pwc

    for module in (
        runner.methods.pwc,
        runner.hooks.pwc,
    ):
        result = doctest.testmod(module)
        assert result.attempted and not result.failed, module.__name__
