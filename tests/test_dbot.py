"""DB-OT solver, clustering, loss and inference against oracles (POT, scipy HiGHS, closed forms)."""

import math
import warnings

import numpy as np
import ot
import pytest
import torch

from runner.device_tracking import STAND_IN, DeviceTracker
from runner.methods._common import ConvergenceWarning, logsumexp
from runner.methods.dbot import (
    SOLVERS,
    DBOTLoss,
    dbot,
    dbot_cluster,
    dbot_dual,
    dbot_loss,
    dbot_lp,
    dbot_objective,
    dbot_predict,
    marginal_violation,
    read_pending,
    round_plan,
    weighted_focal_loss,
)

EXACT = ("sinkhorn", "dual", "bregman")
TIGHT = dict(tol=1e-13, max_iter=100_000)


def random_problem(seed, m=30, n=5, delta=0.4, scale=1.0):
    rng = np.random.default_rng(seed)
    cost = scale * rng.random((m, n))
    a = rng.random(m) + 0.5
    a /= a.sum()
    r = rng.dirichlet(np.ones(n))
    return cost, a, (1 - delta) * r, (1 + delta) * r


def lp_value(cost, a, b_low, b_up):
    """Exact bounded-marginal LP min <C,P> s.t. P1 = a, b_low <= P^T 1 <= b_up, P >= 0 (HiGHS)."""
    return dbot_lp(cost, a, b_low, b_up, log=True)[1]["cost"]


# ----------------------------------------------------------------------------------------------------
# 1. Marginals
@pytest.mark.parametrize("method", SOLVERS)
@pytest.mark.parametrize("seed", range(3))
def test_marginals_within_bounds(method, seed):
    cost, a, b_low, b_up = random_problem(seed, delta=0.3 + 0.2 * seed)
    plan, log = dbot(cost, a, b_low, b_up, 0.2, method=method, log=True, **TIGHT)
    assert log["converged"] and log["err"] < 1e-12
    assert np.abs(plan.sum(1) - a).max() < 1e-8
    cols = plan.sum(0)
    assert (cols >= b_low - 1e-8).all() and (cols <= b_up + 1e-8).all()
    # the reported violation is the plan's own
    assert log["err"] == pytest.approx(marginal_violation(plan.sum(1), cols, a, b_low, b_up), abs=1e-14)


def test_stops_on_marginal_violation_not_plan_change():
    cost, a, b_low, b_up = random_problem(0, delta=0.5)
    for tol in (1e-3, 1e-6, 1e-9):
        plan, log = dbot(cost, a, b_low, b_up, 0.05, log=True, tol=tol)
        assert log["converged"]
        assert marginal_violation(plan.sum(1), plan.sum(0), a, b_low, b_up) < tol
    with pytest.warns(UserWarning, match="did not converge"):
        _, capped = dbot(cost, a, b_low, b_up, 0.05, log=True, tol=1e-15, max_iter=7)
    assert capped["n_iter"] == 7 and not capped["converged"]


# ----------------------------------------------------------------------------------------------------
# 2. Equal bounds: Sinkhorn
@pytest.mark.parametrize("method", SOLVERS)
def test_equal_bounds_match_pot_sinkhorn(method):
    cost, a, _, _ = random_problem(1, m=20, n=6)
    b = np.random.default_rng(2).dirichlet(np.ones(6))
    ref = ot.sinkhorn(a, b, cost, 0.1, method="sinkhorn_log", stopThr=1e-14, numItermax=100_000)
    plan = dbot(cost, a, b, b, 0.1, method=method, **TIGHT)
    np.testing.assert_allclose(plan, ref, atol=1e-8, rtol=0)


# ----------------------------------------------------------------------------------------------------
# 3. Loose bounds: row softmax
@pytest.mark.parametrize("method", SOLVERS)
def test_loose_bounds_give_row_softmax(method):
    cost, a, _, _ = random_problem(3, m=15, n=7, scale=3.0)
    plan = dbot(cost, a, 0.0, 1.0, 0.3, method=method, **TIGHT)
    softmax = np.exp(-cost / 0.3)
    softmax /= softmax.sum(1, keepdims=True)
    np.testing.assert_allclose(plan, a[:, None] * softmax, atol=1e-15, rtol=0)
    np.testing.assert_array_equal(plan.argmax(1), cost.argmin(1))


# ----------------------------------------------------------------------------------------------------
# 4. Solvers agree; the paper's plain cycle is feasible but not optimal
@pytest.mark.parametrize("seed", range(5))
def test_exact_solvers_agree(seed):
    rng = np.random.default_rng(seed)
    eps = float(rng.uniform(0.05, 1.0))
    cost, a, b_low, b_up = random_problem(seed, delta=float(rng.uniform(0.05, 0.8)))
    plans = {m: dbot(cost, a, b_low, b_up, eps, method=m, **TIGHT) for m in EXACT}
    for m in EXACT[1:]:
        np.testing.assert_allclose(plans[m], plans["sinkhorn"], atol=1e-8, rtol=0)


def test_plain_bregman_feasible_never_better_and_sometimes_worse():
    gaps = []
    for seed in range(20):
        rng = np.random.default_rng(seed)
        eps = float(rng.uniform(0.05, 1.0))
        cost, a, b_low, b_up = random_problem(seed, delta=float(rng.uniform(0.0, 0.8)))
        best = dbot_objective(cost, dbot(cost, a, b_low, b_up, eps, **TIGHT), eps)
        plain, log = dbot(cost, a, b_low, b_up, eps, method="bregman_plain", log=True, **TIGHT)
        assert log["converged"]
        gaps.append(dbot_objective(cost, plain, eps) - best)
    assert min(gaps) >= -1e-9
    assert max(gaps) > 1e-4  # the cycle of projections stalls at a suboptimal plan


# ----------------------------------------------------------------------------------------------------
# 5. Strong duality
@pytest.mark.parametrize("method", ("sinkhorn", "dual"))
@pytest.mark.parametrize("seed", range(3))
def test_strong_duality(method, seed):
    cost, a, b_low, b_up = random_problem(seed, delta=0.5)
    eps = 0.1
    plan, log = dbot(cost, a, b_low, b_up, eps, method=method, log=True, **TIGHT)
    assert (log["g"] >= 0).all() and (log["h"] <= 0).all()
    primal = dbot_objective(cost, plan, eps)
    dual = dbot_dual(cost, a, b_low, b_up, eps, log["f"], log["g"], log["h"])
    assert primal == pytest.approx(dual, abs=1e-8)
    # weak duality: any feasible dual point is below the primal value
    assert dbot_dual(cost, a, b_low, b_up, eps, log["f"] - 0.01, log["g"], log["h"]) < primal


# ----------------------------------------------------------------------------------------------------
# 6. LP limit
def test_gap_to_lp_shrinks_with_eps():
    cost, a, b_low, b_up = random_problem(4, m=12, n=4, delta=0.3)
    lp = lp_value(cost, a, b_low, b_up)
    gaps = []
    for eps in (0.1, 0.01, 0.001):
        plan = dbot(cost, a, b_low, b_up, eps, method="dual", tol=1e-12, max_iter=200_000)
        gaps.append((cost * plan).sum() - lp)
        assert -1e-9 <= gaps[-1] <= eps * np.log(12 * 4)
    assert gaps[0] > gaps[1] > gaps[2]
    assert gaps[2] < 1e-3


def test_lp_with_equal_bounds_is_emd():
    cost, a, b, _ = random_problem(5, m=10, n=4, delta=0.0)
    assert lp_value(cost, a, b, b) == pytest.approx(ot.emd2(a, b, cost), abs=1e-10)


# ----------------------------------------------------------------------------------------------------
# 7. Partial OT
@pytest.mark.parametrize("method", EXACT)
def test_zero_lower_bound_is_entropic_partial_ot(method):
    cost, a, _, b_up = random_problem(6, m=25, n=6, delta=0.6)
    ref = ot.partial.entropic_partial_wasserstein(a, b_up, cost, 0.2, m=a.sum(), numItermax=2_000)
    plan = dbot(cost, a, 0.0, b_up, 0.2, method=method, **TIGHT)
    np.testing.assert_allclose(plan, ref, atol=1e-10, rtol=0)


# ----------------------------------------------------------------------------------------------------
# 8. KKT conditions
@pytest.mark.parametrize("method", ("sinkhorn", "dual"))
def test_kkt(method):
    eps = 0.2
    cost, a, b_low, b_up = random_problem(7, m=40, n=8, delta=0.3)
    plan, log = dbot(cost, a, b_low, b_up, eps, method=method, log=True, **TIGHT)
    cols = plan.sum(0)
    at_low, at_up = log["g"] > 1e-9, log["h"] < -1e-9
    assert at_low.any() and at_up.any()
    assert not (at_low & at_up).any()
    np.testing.assert_allclose(cols[at_low], b_low[at_low], rtol=1e-10)
    np.testing.assert_allclose(cols[at_up], b_up[at_up], rtol=1e-10)
    free = np.flatnonzero(~at_low & ~at_up)
    inside = (cols[free] > b_low[free] + 1e-9) & (cols[free] < b_up[free] - 1e-9)
    assert inside.all()
    if len(free) >= 2:
        j, k = free[:2]
        np.testing.assert_allclose(
            np.log(plan[:, j] / plan[:, k]), (cost[:, k] - cost[:, j]) / eps, atol=1e-9
        )
    # columns strictly inside their bounds are also free (complementary slackness the other way)
    assert (at_low | at_up)[np.flatnonzero((cols > b_low + 1e-6) & (cols < b_up - 1e-6))].sum() == 0


# ----------------------------------------------------------------------------------------------------
# 9. Shift invariance
def test_row_shift_invariance_and_column_shift_only_with_equal_bounds():
    cost, a, b_low, b_up = random_problem(9, delta=0.4)
    plan, log = dbot(cost, a, b_low, b_up, 0.1, log=True, **TIGHT)
    # a column shift moves mass between free columns, so the test needs at least two of them
    assert ((log["g"] < 1e-9) & (log["h"] > -1e-9)).sum() >= 2
    row_shift = cost + np.arange(len(a))[:, None] * 0.7
    np.testing.assert_allclose(dbot(row_shift, a, b_low, b_up, 0.1, **TIGHT), plan, atol=1e-12)

    col_shift = cost + np.linspace(0, 1, cost.shape[1])[None, :]
    assert np.abs(dbot(col_shift, a, b_low, b_up, 0.1, **TIGHT) - plan).max() > 1e-4
    b = (b_low + b_up) / 2
    equal = dbot(cost, a, b, b, 0.1, **TIGHT)
    np.testing.assert_allclose(dbot(col_shift, a, b, b, 0.1, **TIGHT), equal, atol=1e-12)


# ----------------------------------------------------------------------------------------------------
# 10. Loss
def test_one_sweep_paper_loss_is_balanced_softmax():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 5, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, 5, (16,), generator=gen)
    counts = torch.tensor([50.0, 20, 9, 4, 1], dtype=torch.float64)
    balanced = torch.nn.functional.cross_entropy(logits + torch.log(counts / counts.sum()), labels)
    for delta in (0.0, 0.3):
        loss = dbot_loss(logits, labels, counts, delta=delta, n_sweeps=1, mode="paper")
        assert abs(loss.item() - balanced.item()) < 1e-12
    more = dbot_loss(logits, labels, counts, delta=0.3, n_sweeps=3, mode="paper")
    assert abs(more.item() - balanced.item()) > 1e-4


def test_paper_loss_without_column_bounds_is_cross_entropy_and_soft_targets_match_hard():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(8, 4, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, 4, (8,), generator=gen)
    uniform = torch.ones(4, dtype=torch.float64)
    ce = torch.nn.functional.cross_entropy(logits, labels)
    assert abs(dbot_loss(logits, labels, uniform).item() - ce.item()) < 1e-12
    soft = torch.nn.functional.one_hot(labels, 4).double()
    for mode in ("paper", "official"):
        hard_loss = dbot_loss(logits, labels, uniform, 0.2, 2, mode)
        assert abs(dbot_loss(logits, soft, uniform, 0.2, 2, mode).item() - hard_loss.item()) < 1e-12


def test_official_loss_matches_its_definition():
    """Balanced Softmax with batch counts plus soft CE between column sums and their clip."""
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(6, 4, generator=gen, dtype=torch.float64)
    labels = torch.tensor([0, 0, 1, 0, 1, 3])  # class 2 absent from the batch
    prior = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
    delta = 0.1
    counts = torch.bincount(labels, minlength=4).double()
    shifted = logits + counts.log()
    plan = shifted.exp()
    low, up = (1 - delta) * prior, (1 + delta) * prior
    plan = plan / plan.sum(1, keepdim=True) / 6
    plan = plan * torch.clamp(low / plan.sum(0), min=1).nan_to_num(1.0)
    plan = plan * torch.clamp(up / plan.sum(0), max=1).nan_to_num(1.0)
    cols = plan.sum(0)
    expected = (
        torch.nn.functional.cross_entropy(shifted, labels)
        - (torch.clamp(cols, low, up) * torch.log_softmax(cols, 0)).sum()
    )
    loss = dbot_loss(logits, labels, prior, delta, 1, "official")
    assert abs(loss.item() - expected.item()) < 1e-12


@pytest.mark.parametrize("mode", ("paper", "official"))
def test_loss_gradcheck(mode):
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([0, 1, 2, 0])
    prior = torch.tensor([0.6, 0.3, 0.1], dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda x: dbot_loss(x, labels, prior, 0.2, 2, mode), (logits,))


def indexed_official_loss(logits, target, prior, delta, n_sweeps):
    """The official loss as first written: the classes absent from the batch indexed out."""
    batch, n_classes = logits.shape
    prior = prior / prior.sum()
    log_low, log_up = torch.log((1.0 - delta) * prior), torch.log((1.0 + delta) * prior)
    counts = target.sum(dim=0)
    present = counts > 0
    shifted = logits[:, present] + torch.log(counts[present])
    balanced_ce = -(target[:, present] * torch.log_softmax(shifted, dim=1)).sum(dim=1).mean()
    log_p = shifted
    for _ in range(n_sweeps):
        log_p = log_p - torch.logsumexp(log_p, dim=1, keepdim=True) - math.log(batch)
        log_p = log_p + (log_low[present] - torch.logsumexp(log_p, dim=0)).clamp(min=0.0)
        log_p = log_p + (log_up[present] - torch.logsumexp(log_p, dim=0)).clamp(max=0.0)
    col_sums = torch.zeros(n_classes, dtype=logits.dtype)
    col_sums[present] = torch.logsumexp(log_p, dim=0).exp()
    clipped = torch.minimum(torch.maximum(col_sums, log_low.exp()), log_up.exp())
    return balanced_ce - (clipped * torch.log_softmax(col_sums, dim=0)).sum()


@pytest.mark.parametrize("n_sweeps", (1, 3))
@pytest.mark.parametrize("soft", (False, True))
def test_masked_official_loss_equals_the_indexed_one_with_its_gradient(n_sweeps, soft):
    gen = torch.Generator().manual_seed(7)
    for _ in range(5):
        logits = torch.randn(24, 8, generator=gen, dtype=torch.float64)
        labels = torch.randint(0, 5, (24,), generator=gen)  # classes 5-7 absent from the batch
        target = torch.nn.functional.one_hot(labels, 8).double()
        if soft:  # mixed labels: a class is present with any positive weight
            target = 0.7 * target + 0.3 * target.roll(1, dims=0)
        prior = torch.rand(8, generator=gen, dtype=torch.float64) + 0.05
        x, y = logits.clone().requires_grad_(), logits.clone().requires_grad_()
        masked = DBOTLoss(prior, 0.2, n_sweeps, "official")(x, target)
        indexed = indexed_official_loss(y, target, prior, 0.2, n_sweeps)
        masked.backward()
        indexed.backward()
        assert abs(masked.item() - indexed.item()) < 1e-12
        torch.testing.assert_close(x.grad, y.grad, rtol=0, atol=1e-12)
        assert x.grad[:, 5:].abs().max() == 0  # the absent classes get no gradient


@pytest.mark.parametrize("mode", ("paper", "official"))
def test_loss_checks_its_prior_once_and_never_waits_for_the_device(mode):
    with DeviceTracker() as tracker:
        prior = torch.rand(6, device=STAND_IN) + 0.1
        loss = DBOTLoss(prior, 0.1, 2, mode)  # the check: one read, here
        with tracker.in_phase("train"):
            for _ in range(3):
                logits = torch.randn(16, 6, device=STAND_IN, requires_grad=True)
                loss(logits, torch.randint(0, 4, (16,), device=STAND_IN)).backward()
    assert tracker.counts["other"] == {"sync": 1}
    assert tracker.counts["train"] == {}, tracker.report()["sites"]


def test_half_precision_loss_normalises_a_large_count_prior():
    """Counts summing to 1e5 overflow float16 (max 65504) if normalised in the logits' precision. The half
    loss runs a few dozen float16 operations of relative rounding 2^-11 each: within 1% of float32's."""
    torch.manual_seed(0)
    logits, labels, counts = torch.randn(8, 5), torch.arange(8) % 5, torch.full((5,), 20000.0)
    for mode in ("paper", "official"):
        full = dbot_loss(logits, labels, counts, mode=mode)
        half = dbot_loss(logits.half(), labels, counts, mode=mode)
        assert torch.isfinite(half) and half.item() == pytest.approx(full.item(), rel=1e-2)
    two = dbot_loss(logits, labels, counts, n_sweeps=2)
    assert dbot_loss(logits, labels, counts, n_sweeps=np.int64(2)) == two
    cost, a, b_low, b_up = random_problem(0)
    np.testing.assert_array_equal(dbot(cost, a, b_low, b_up, np.int64(1)), dbot(cost, a, b_low, b_up, 1.0))


def test_focal_loss_below_gamma_one_keeps_finite_gradients_at_a_large_margin():
    logits = torch.tensor([[20.0, 0.0, 0.0], [0.0, 1.0, 0.0]], requires_grad=True)  # p = 1 in float32
    weighted_focal_loss(logits, torch.tensor([0, 1]), gamma=0.5).backward()
    assert torch.isfinite(logits.grad).all() and logits.grad[1].abs().sum() > 0


def test_focal_loss_is_its_definition_and_its_gradient_the_finite_differences():
    """FL = -sum_j y_j (1 - p_j)^gamma log p_j (Lin et al.), for soft labels and for class indices, at a
    gamma below and above 1; its gradient against central differences (torch.autograd.gradcheck) in
    float64, where the floor of 1 - p (the smallest normal, 2e-308) is never reached (p <= 0.9 here).
    log_softmax and log(softmax) differ by a few float64 roundings (~1e-16 relative): rel 1e-14."""
    logits = torch.tensor([[2.0, 0.5, -1.0], [0.0, 1.0, 0.3], [-0.5, 0.2, 0.1]], dtype=torch.float64)
    soft = torch.tensor([[0.7, 0.2, 0.1], [0.0, 1.0, 0.0], [0.3, 0.3, 0.4]], dtype=torch.float64)
    labels = torch.tensor([0, 1, 2])
    p = torch.softmax(logits, 1)
    for gamma in (0.5, 2.0):
        by_hand = -(soft * (1 - p) ** gamma * p.log()).sum(1).mean()
        assert weighted_focal_loss(logits, soft, gamma).item() == pytest.approx(by_hand.item(), rel=1e-14)
        picked = p[torch.arange(3), labels]
        by_hand = -((1 - picked) ** gamma * picked.log()).mean()
        assert weighted_focal_loss(logits, labels, gamma).item() == pytest.approx(by_hand.item(), rel=1e-14)
        for target in (soft, labels):
            x = logits.clone().requires_grad_()
            assert torch.autograd.gradcheck(lambda z, y=target, g=gamma: weighted_focal_loss(z, y, g), x)
    with pytest.raises(ValueError, match="class indices"):
        weighted_focal_loss(logits, soft, 2.0, weight=[1.0, 2.0, 3.0])


def test_focal_loss_of_soft_labels_below_gamma_one_keeps_finite_gradients_where_a_class_has_p_one():
    """(1 - p)^gamma has an infinite slope at p = 1 for gamma < 1: unfloored, a class at p = 1 in float32
    (a large margin) gave a NaN gradient even with label 0 (0 x inf), as the long-tail hook's own copy did."""
    logits = torch.tensor([[20.0, 0.0, 0.0], [0.0, 1.0, 0.0]], requires_grad=True)
    soft = torch.tensor([[0.0, 0.5, 0.5], [0.1, 0.8, 0.1]])
    weighted_focal_loss(logits, soft, gamma=0.5).backward()
    assert torch.isfinite(logits.grad).all() and logits.grad[1].abs().sum() > 0


def test_loss_rejects_bad_arguments():
    logits, labels = torch.zeros(4, 3), torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match="delta"):
        dbot_loss(logits, labels, torch.ones(3), delta=1.0)
    with pytest.raises(ValueError, match="mode"):
        dbot_loss(logits, labels, torch.ones(3), mode="gamma")
    with pytest.raises(ValueError, match="prior"):
        dbot_loss(logits, labels, torch.tensor([1.0, 0.0, 1.0]))
    with pytest.raises(ValueError, match="n_sweeps"):
        dbot_loss(logits, labels, torch.ones(3), n_sweeps=0)


# ----------------------------------------------------------------------------------------------------
# 11. Input checks
def test_infeasible_and_malformed_input_raise_value_error():
    cost, a, _, _ = random_problem(0, m=6, n=3)
    with pytest.raises(ValueError, match="sum\\(b_low\\)"):
        dbot(cost, a, 0.5, 1.0, 0.1)
    with pytest.raises(ValueError, match="sum\\(b_up\\)"):
        dbot(cost, a, 0.0, 0.3, 0.1)
    with pytest.raises(ValueError, match="b_low\\[1\\]"):
        dbot(cost, a, [0.1, 0.5, 0.1], [1.0, 0.4, 1.0], 0.1)
    with pytest.raises(ValueError, match="reg"):
        dbot(cost, a, 0.0, 1.0, 0.0)
    with pytest.raises(ValueError, match="method"):
        dbot(cost, a, 0.0, 1.0, 0.1, method="lbfgs")
    with pytest.raises(ValueError, match="shape"):
        dbot(cost, a[:-1], 0.0, 1.0, 0.1)
    with pytest.raises(ValueError, match="a\\[0\\]"):
        dbot(cost, -a, 0.0, 1.0, 0.1)
    with pytest.raises(ValueError, match="non-finite"):
        dbot(np.full((2, 2), np.nan), [0.5, 0.5], 0.0, 1.0, 0.1)


@pytest.mark.parametrize("method", SOLVERS)
def test_zero_bounds_give_no_nan(method):
    cost, a, b_low, b_up = random_problem(9, n=5, delta=0.2)
    b_low[[0, 2, 3]] = 0.0
    b_up[2] = 0.0  # a column that must stay empty
    b_up[4] = 1.0
    plan, log = dbot(cost, a, b_low, b_up, 0.1, method=method, log=True, **TIGHT)
    assert np.isfinite(plan).all() and log["converged"]
    assert plan[:, 2].max() == 0.0


@pytest.mark.parametrize("method", SOLVERS)
def test_a_row_of_no_mass_stays_empty(method):
    """a >= 0: the Bregman sweeps scaled a zero row by 0/0 and stopped with a false "reg too small"."""
    cost, a, b_low, b_up = random_problem(11, n=4, delta=0.3)
    a[3] = 0.0
    plan, log = dbot(cost, a, b_low * a.sum(), b_up * a.sum(), 0.1, method=method, log=True, **TIGHT)
    assert log["converged"] and plan[3].max() == 0.0
    if method in EXACT:  # the plain cycle stalls at a feasible plan, by design
        exact = dbot(cost, a, b_low * a.sum(), b_up * a.sum(), 0.1, method="dual", **TIGHT)
        np.testing.assert_allclose(plan, exact, atol=1e-9)


def test_small_eps_needs_log_domain():
    cost, a, b_low, b_up = random_problem(10, delta=0.2)
    cost[:, 0] += 50.0  # column 0 is nowhere near a row minimum: exp(-50 / eps) underflows
    for method in ("sinkhorn", "bregman", "bregman_plain"):
        with pytest.raises(FloatingPointError, match="method='dual'"):
            dbot(cost, a, b_low, b_up, 1e-2, method=method)
    assert dbot(cost, a, b_low, b_up, 1e-2, method="dual", log=True)[1]["converged"]


# ----------------------------------------------------------------------------------------------------
# 12. Clustering
def blobs_with_outliers(seed):
    """5 Gaussians (std 1, centres on a circle of radius 5, sizes 40..80) and 6 outliers near (25, 25)."""
    rng = np.random.default_rng(seed)
    sizes = (40, 50, 60, 70, 80)
    angles = 2 * np.pi * np.arange(5) / 5
    centres = 5 * np.c_[np.cos(angles), np.sin(angles)]
    x = np.concatenate([rng.normal(c, 1.0, (s, 2)) for c, s in zip(centres, sizes)])
    x = np.concatenate([x, rng.normal(25.0, 0.5, (6, 2))])
    y = np.concatenate([np.full(s, k) for k, s in enumerate(sizes)] + [np.full(6, 5)])
    return x, y


def test_cluster_masses_respect_bounds_every_round():
    x, _ = blobs_with_outliers(0)
    tau = np.linspace(0.1, 0.6, 5)
    _, _, log = dbot_cluster(x, 5, tau=tau, reg=0.05, n_outer=6, seed=1, log=True)
    assert log["masses"].shape == (6, 5)
    assert (log["masses"] >= log["b_low"] - 1e-7).all() and (log["masses"] <= log["b_up"] + 1e-7).all()
    np.testing.assert_allclose(log["b_low"], (1 - tau) / 5)


def test_cluster_tau_zero_forces_equal_masses_and_seed_is_deterministic():
    x, _ = blobs_with_outliers(1)
    labels, centroids, log = dbot_cluster(x, 5, tau=0.0, n_outer=4, seed=3, tol=1e-10, log=True)
    np.testing.assert_allclose(log["masses"], 0.2, atol=1e-9)
    again, centroids_again = dbot_cluster(x, 5, tau=0.0, n_outer=4, seed=3, tol=1e-10)
    np.testing.assert_array_equal(labels, again)
    np.testing.assert_array_equal(centroids, centroids_again)


@pytest.mark.parametrize("seed", range(3))
def test_cluster_sizes_on_blobs_with_outliers(seed):
    x, _ = blobs_with_outliers(seed)
    tau, k = 0.5, 5
    labels, _ = dbot_cluster(x, k, tau=tau, reg=0.05, n_outer=20, seed=seed)
    sizes = np.bincount(labels, minlength=k)
    assert sizes.min() >= 0.5 * (1 - tau) * len(x) / k


def test_round_plan_is_the_best_assignment_within_count_bounds():
    """Brute force over all 3^7 assignments of 7 rows to 3 clusters."""
    import itertools

    rng = np.random.default_rng(0)
    plan = rng.dirichlet(np.ones(3), size=7) ** 3
    low, up = np.array([2, 1, 2]), np.array([3, 2, 4])
    best, best_z = -np.inf, None
    for z in itertools.product(range(3), repeat=7):
        counts = np.bincount(z, minlength=3)
        if (counts >= low).all() and (counts <= up).all():
            score = np.log(plan[np.arange(7), z]).sum()
            if score > best:
                best, best_z = score, np.array(z)
    z = round_plan(plan, low, up)
    assert np.log(plan[np.arange(7), z]).sum() == pytest.approx(best, abs=1e-12)
    np.testing.assert_array_equal(z, best_z)
    with pytest.raises(ValueError, match="no assignment"):
        round_plan(plan, [3, 3, 3], [4, 4, 4])


@pytest.mark.parametrize("seed", range(3))
def test_rounded_cluster_counts_respect_the_bounds(seed):
    x, _ = blobs_with_outliers(seed)
    tau, k, n = 0.5, 5, len(x)
    labels, _ = dbot_cluster(x, k, tau=tau, n_outer=10, seed=seed, assign="rounded")
    sizes = np.bincount(labels, minlength=k)
    assert sizes.min() >= np.ceil((1 - tau) * n / k) and sizes.max() <= np.floor((1 + tau) * n / k)


def test_cluster_rejects_bad_arguments():
    x = np.zeros((10, 2))
    with pytest.raises(ValueError, match="n_clusters"):
        dbot_cluster(x, 11)
    with pytest.raises(ValueError, match="tau"):
        dbot_cluster(x, 2, tau=-0.1)
    with pytest.raises(ValueError, match="init"):
        dbot_cluster(x, 2, init="farthest")
    with pytest.raises(ValueError, match="assign"):
        dbot_cluster(x, 2, assign="greedy")


# ----------------------------------------------------------------------------------------------------
# 13. Inference
def test_predict_histogram_follows_prior_at_delta_zero_and_argmax_at_large_delta():
    # Logits of a model trained for uniform labels, tested under a skewed prior.  The plan's column
    # sums are exactly N r; near the LP limit (small eps) a vertex has at most K - 1 split rows, so the
    # argmax histogram is within K of N r.
    rng = np.random.default_rng(0)
    k, n = 6, 600
    prior = np.array([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    logits = rng.normal(size=(n, k)) + 2.0 * np.eye(k)[rng.choice(k, n)]
    counts = np.bincount(dbot_predict(logits, prior, delta=0.0, reg=0.03, tol=1e-9), minlength=k)
    assert np.abs(counts - n * prior).max() <= k
    assert np.abs(np.bincount(logits.argmax(1), minlength=k) - n * prior).max() > 5 * k
    np.testing.assert_array_equal(dbot_predict(logits, prior, delta=1e3), logits.argmax(1))
    torch_logits = torch.from_numpy(logits).float()
    np.testing.assert_array_equal(
        dbot_predict(torch_logits, prior, delta=0.0), dbot_predict(logits.astype(np.float32), prior)
    )


def test_predict_per_batch_solves_each_batch_alone():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(100, 4))
    prior = np.ones(4)
    per_batch = dbot_predict(logits, prior, delta=0.1, batch_size=32)
    chunks = [dbot_predict(logits[s : s + 32], prior, delta=0.1) for s in range(0, 100, 32)]
    np.testing.assert_array_equal(per_batch, np.concatenate(chunks))
    assert not np.array_equal(per_batch, dbot_predict(logits, prior, delta=0.1))
    with pytest.raises(ValueError, match="batch_size"):
        dbot_predict(logits, prior, batch_size=0)


def test_predict_on_a_device_reads_it_once_for_all_its_solves():
    """Each solve's checks (the inputs', the convergence tests, each check's labels) stay on the device and
    come back in one read after every solve: the host's labels where the solver converges after more than
    one check, per batch, and where it stops at max_iter first (its warning raised at the read)."""
    rng = np.random.default_rng(4)
    logits, prior = 3 * rng.normal(size=(64, 5)), np.array([0.4, 0.3, 0.15, 0.1, 0.05])
    logs = []  # the per-check test's, on the host's CPU (the same torch ops)
    for delta in (0.0, 0.5):
        b_low, b_up = (1 - delta) * prior, (1 + delta) * prior
        _, log = dbot(-torch.tensor(logits), torch.full((64,), 1 / 64, dtype=torch.float64), b_low, b_up, 1.0,
                      log=True)  # fmt: skip
        assert log["converged"] and log["n_iter"] > 10  # more than one check
        logs.append(log)
    cases = [dict(delta=0.0), dict(delta=0.5), dict(delta=0.5, batch_size=24), dict(delta=0.5, max_iter=15)]
    cases += [dict(delta=0.5, method=method) for method in ("dual", "bregman")]
    with DeviceTracker() as tracker:
        on_device = torch.tensor(logits, device=STAND_IN)
        with tracker.in_phase("eval"):
            pending = [dbot_predict(on_device, prior, read=False, **case) for case in cases]
            with pytest.warns(ConvergenceWarning, match="max_iter=15 "):
                labels = [p.labels(values) for p, values in zip(pending, read_pending(pending))]
            alone = dbot_predict(on_device, prior, 0.5)  # read=True: its own one read
    assert tracker.counts["eval"] == {"sync": 2}, tracker.report()["sites"]
    np.testing.assert_array_equal(alone, labels[1])
    for log, recorded in zip(logs, pending):  # the check that stopped the per-check test was recorded
        assert recorded.stops[0].err == log["err"]
    for case, got in zip(cases, labels, strict=True):
        with warnings.catch_warnings(action="ignore", category=ConvergenceWarning):
            np.testing.assert_array_equal(got, dbot_predict(logits, prior, **case), err_msg=str(case))


def test_bad_input_on_a_device_is_named_as_on_the_host():
    """The device's checks are read late, with the first convergence check: the error is the host's."""
    cost, a, _, _ = random_problem(0, m=6, n=3)
    cost, a = torch.tensor(cost, device=STAND_IN), torch.tensor(a, device=STAND_IN)
    with pytest.raises(ValueError, match="^infeasible bounds: sum\\(b_low\\)"):
        dbot(cost, a, torch.full((3,), 0.5, dtype=torch.float64, device=STAND_IN), 1.0, 0.1)
    with pytest.raises(ValueError, match="^a\\[0\\]="):
        dbot(cost, -a, 0.0, 1.0, 0.1)
    with pytest.raises(ValueError, match="^b_low\\[1\\]=0.5 > b_up\\[1\\]=0.4"):
        dbot(cost, a, torch.tensor([0.1, 0.5, 0.1], device=STAND_IN), [1.0, 0.4, 1.0], 0.1)
    logits = torch.zeros(4, 3, device=STAND_IN)
    logits[2, 1] = math.nan
    with pytest.raises(ValueError, match="^cost has non-finite entries"):
        dbot_predict(logits, [1, 1, 1])
    with pytest.raises(ValueError, match="^prior\\[2\\]=-1.0"):
        dbot_predict(torch.zeros(4, 3, device=STAND_IN), torch.tensor([1.0, 1.0, -1.0], device=STAND_IN))


# ----------------------------------------------------------------------------------------------------
# 14. The solver convention (runner.methods._common): reg, log keys, warnings
@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.int64])
def test_the_solvers_logsumexp_is_scipy_s_bit_for_bit(dtype):
    """The solvers' `logsumexp` does scipy's float operations without its dispatch: the same bits on every
    shape and axis, with tied maxima, -inf and inf terms, all -inf and NaN slices, and empty sums."""
    from scipy.special import logsumexp as scipy_logsumexp

    rng = np.random.default_rng(0)
    for shape in [(7,), (5, 9), (3, 4, 6), (1, 1), (0, 3), (2, 0, 3)]:
        x = rng.normal(size=shape) * 30
        tied, some_inf, infinite, none, nan = (
            np.round(x / 10),
            x.copy(),
            x.copy(),
            np.full(shape, -np.inf),
            x.copy(),
        )
        some_inf[..., :1] = -np.inf
        if x.size:
            infinite.flat[0], nan.flat[x.size // 2] = np.inf, np.nan
        for values in (x, tied, some_inf, infinite, none, nan) if dtype != np.int64 else (np.round(x),):
            values = values.astype(dtype)
            for axis in range(len(shape)):
                for keepdims in (False, True):
                    with np.errstate(all="ignore"):
                        expected = scipy_logsumexp(values, axis=axis, keepdims=keepdims)
                    got = logsumexp(values, axis=axis, keepdims=keepdims)
                    assert type(got) is type(expected) and np.asarray(got).dtype == np.asarray(expected).dtype
                    np.testing.assert_array_equal(got, expected, strict=True)


def test_lp_oracle_is_feasible_and_below_the_entropic_objective():
    cost, a, b_low, b_up = random_problem(3, m=12, n=4)
    plan, log = dbot_lp(cost, a, b_low, b_up, log=True)
    assert marginal_violation(plan.sum(1), plan.sum(0), a, b_low, b_up) < 1e-9 and plan.min() >= -1e-12
    entropic = dbot(cost, a, b_low, b_up, 0.01, method="dual", tol=1e-12, max_iter=100_000)
    assert log["cost"] <= (cost * entropic).sum() + 1e-12 and log["converged"]


def test_log_keys_and_one_warning_when_not_converged():
    cost, a, b_low, b_up = random_problem(5, delta=0.3)
    for method in SOLVERS:
        with pytest.warns(UserWarning, match=f"dbot.method='{method}'.* did not converge") as record:
            _, log = dbot(cost, a, b_low, b_up, 0.05, method=method, max_iter=2, tol=1e-14, log=True)
        assert len(record) == 1 and record[0].filename == __file__  # attributed to the caller
        assert log["n_iter"] == 2 and not log["converged"] and log["err"] > 1e-14
