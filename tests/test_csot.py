"""CSOT solver checks against oracles: POT (entropic partial OT, Sinkhorn, exact partial LP),
the paper's vanilla Dykstra iteration, a dense evaluation of the objective, finite differences."""

import numpy as np
import ot
import pytest
import torch
from omegaconf import OmegaConf

from runner.data import inject_label_noise, load_data
from runner.data.builtin import CIFAR10_ASYM
from runner.device_tracking import STAND_IN, DeviceTracker
from runner.methods.csot import (
    _armijo,
    _batched_armijo,
    allocate,
    batched_csot_plan,
    batched_curriculum_ot,
    coherence_energy,
    csot_plan,
    curriculum_budget,
    curriculum_ot,
    select,
)
from runner.schema import DatasetConfig, LabelNoiseConfig


def chunk(rng, n=40, c=5, d=8, conc=0.5):
    """Dirichlet probabilities, clustered features, labels."""
    labels = rng.integers(c, size=n)
    probs = rng.dirichlet(np.full(c, conc), size=n)
    centers = rng.standard_normal((c, d))
    features = centers[labels] + 0.7 * rng.standard_normal((n, d))
    return probs, features, labels


def marginals(n, c, m):
    return np.full(n, 1.0 / n), np.full(c, m / c)


def dense_objective(plan, probs, features, labels, eps, kappa_p, kappa_l):
    """F(Q) straight from the definition, with the B x B similarity built explicitly."""
    unit = features / np.linalg.norm(features, axis=1, keepdims=True)
    sim = unit @ unit.T
    np.fill_diagonal(sim, 0.0)
    onehot = np.eye(probs.shape[1])[labels]
    omega = 0.0
    for kappa, w in ((kappa_p, probs), (kappa_l, onehot)):
        x = w * plan
        omega -= kappa * np.einsum("ij,ik,jk->", sim, x, x)
    return np.sum(-np.log(probs) * plan) + omega + eps * np.sum(plan * np.log(plan))


def dykstra(cost, a, b, eps, n_iter):
    """Paper Alg. S6: vanilla Dykstra with two correction matrices (the oracle of Lemma 1)."""
    q = np.exp(-cost / eps)
    corr_rows, corr_cols = np.ones_like(q), np.ones_like(q)
    for _ in range(n_iter):
        m = q * corr_rows
        q_rows = np.minimum(a / m.sum(1), 1)[:, None] * m
        corr_rows = corr_rows * q / q_rows
        m = q_rows * corr_cols
        q = m * (b / m.sum(0))[None, :]
        corr_cols = corr_cols * q_rows / q
    return q


# ----------------------------------------------------------------------------- curriculum OT


@pytest.mark.parametrize("m", [0.3, 0.5, 1.0])
def test_curriculum_ot_constraints(m):
    probs, _, _ = chunk(np.random.default_rng(0))
    a, b = marginals(*probs.shape, m)
    for anderson, n_iter in ((0, 2000), (5, 100)):
        plan, info = curriculum_ot(-np.log(probs), a, b, 0.1, max_iter=n_iter, anderson=anderson, log=True)
        assert plan.min() >= 0
        np.testing.assert_allclose(plan.sum(0), b, rtol=0, atol=1e-12)
        assert abs(plan.sum() - m) < 1e-12
        assert plan.sum(1).max() <= a[0] * (1 + 1e-6)
        assert info["row_violation"] <= 1e-6 and info["col_error"] <= 1e-12


@pytest.mark.parametrize("m", [0.3, 0.6])
def test_scaling_iteration_equals_vanilla_dykstra(m):
    """Lemma 1: the scaling iteration and Dykstra's algorithm produce the same iterates."""
    probs, _, _ = chunk(np.random.default_rng(1))
    cost = -np.log(probs)
    a, b = marginals(*probs.shape, m)
    for n_iter in (1, 7, 60):
        plan = curriculum_ot(cost, a, b, 0.2, max_iter=n_iter, tol=0, anderson=0)
        np.testing.assert_allclose(plan, dykstra(cost, a, b, 0.2, n_iter), rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("m", [0.3, 0.5, 0.8])
def test_curriculum_ot_matches_pot_partial(m):
    """Same problem as POT's entropic partial OT (Dykstra), multiplicative and log-domain."""
    probs, _, _ = chunk(np.random.default_rng(2))
    cost = -np.log(probs)
    a, b = marginals(*probs.shape, m)
    # POT's multiplicative and log versions differ by ~5e-12 from each other; ours sits on the log one
    for method, rtol in (("sinkhorn", 1e-11), ("sinkhorn_log", 1e-13)):
        ref = ot.partial.entropic_partial_wasserstein(
            a, b, cost, 0.1, m=m, method=method, numItermax=5000, stopThr=1e-14
        )
        for anderson in (0, 5):
            ours = curriculum_ot(cost, a, b, 0.1, max_iter=5000, tol=1e-14, anderson=anderson)
            assert np.abs(ours - ref).max() / ref.max() < rtol


def test_curriculum_ot_full_mass_is_sinkhorn():
    probs, _, _ = chunk(np.random.default_rng(3))
    cost = -np.log(probs)
    a, b = marginals(*probs.shape, 1.0)
    ref = ot.sinkhorn(a, b, cost, 0.1, numItermax=100000, stopThr=1e-15)
    for anderson in (0, 5):
        ours = curriculum_ot(cost, a, b, 0.1, max_iter=5000, tol=1e-14, anderson=anderson)
        assert np.abs(ours - ref).max() / ref.max() < 1e-10


def test_small_eps_limit_matches_exact_partial_lp():
    """eps -> 0: the entropic plan's cost approaches the exact partial-OT LP (POT's solver)."""
    rng = np.random.default_rng(4)
    probs, _, _ = chunk(rng, n=30, c=4)
    cost = -np.log(probs)
    a, b = marginals(*probs.shape, 0.3)
    lp_plan = ot.partial.partial_wasserstein(a, b, cost, m=0.3)
    lp_cost = np.sum(cost * lp_plan)
    plan = curriculum_ot(cost, a, b, 0.002, max_iter=5000, tol=1e-13)
    assert np.all(np.isfinite(plan))
    np.testing.assert_allclose(plan.sum(0), b, atol=1e-12)
    assert plan.sum(1).max() <= a[0] * (1 + 1e-6)
    assert abs(np.sum(cost * plan) - lp_cost) < 1e-6
    # the whole budget goes to the cheapest feasible entries: same support as the LP
    assert np.abs(plan - lp_plan).sum() < 1e-4


def test_small_eps_balanced_matches_emd_and_stays_finite_at_1e_3():
    probs, _, _ = chunk(np.random.default_rng(5), n=30, c=4)
    cost = -np.log(probs)
    a, b = marginals(*probs.shape, 1.0)
    emd_cost = np.sum(cost * ot.emd(a, b, cost))
    plan = curriculum_ot(cost, a, b, 0.01, max_iter=5000, tol=1e-12)
    np.testing.assert_allclose(plan.sum(1), a, rtol=1e-8)
    assert abs(np.sum(cost * plan) - emd_cost) < 1e-3
    # eps = 1e-3: e^{-cost/eps} underflows to 0 everywhere, the centred kernel does not
    a, b = marginals(*probs.shape, 0.5)
    plan = curriculum_ot(cost, a, b, 1e-3, max_iter=3000)
    assert np.all(np.isfinite(plan))
    np.testing.assert_allclose(plan.sum(0), b, rtol=1e-9)
    assert plan.sum(1).max() <= a[0] * (1 + 1e-6)


def test_warm_start_reaches_the_same_plan_faster():
    probs, _, _ = chunk(np.random.default_rng(6))
    cost = -np.log(probs)
    a, b = marginals(*probs.shape, 0.5)
    cold, info = curriculum_ot(cost, a, b, 0.1, max_iter=2000, log=True)
    warm, info_warm = curriculum_ot(cost + 1e-3, a, b, 0.1, max_iter=2000, g_init=info["g"], log=True)
    np.testing.assert_allclose(warm, cold, atol=1e-12)  # a constant shift of the cost changes nothing
    assert info_warm["n_iter"] < info["n_iter"]


# ----------------------------------------------------------------------------- structure terms


def test_coherence_energy_matches_definition_and_finite_differences():
    rng = np.random.default_rng(7)
    probs, features, labels = chunk(rng, n=12, c=3)
    plan = rng.random(probs.shape) / 36
    for kp, kl in ((1.0, 0.0), (0.0, 1.0), (0.7, 1.3)):
        value, grad = coherence_energy(plan, features, probs, labels, kp, kl)
        ref = dense_objective(plan, probs, features, labels, 0.0, kp, kl) - np.sum(-np.log(probs) * plan)
        assert abs(value - ref) < 1e-12 * max(1.0, abs(ref))
        h = 1e-6
        fd = np.zeros_like(plan)
        for i in range(plan.shape[0]):
            for k in range(plan.shape[1]):
                e = np.zeros_like(plan)
                e[i, k] = h
                hi = coherence_energy(plan + e, features, probs, labels, kp, kl)[0]
                lo = coherence_energy(plan - e, features, probs, labels, kp, kl)[0]
                fd[i, k] = (hi - lo) / (2 * h)
        assert np.abs(fd - grad).max() / np.abs(grad).max() < 1e-7


def test_coherence_energy_nonpositive_for_nonnegative_similarity():
    rng = np.random.default_rng(8)
    probs, _, labels = chunk(rng, n=20, c=4)
    features = rng.random((20, 6))  # non-negative -> S >= 0
    for _ in range(5):
        plan = rng.random(probs.shape)
        assert coherence_energy(plan, features, probs, labels)[0] <= 0


# ----------------------------------------------------------------------------- CSOT plan


@pytest.mark.parametrize("m", [0.3, 1.0])
def test_csot_without_structure_is_curriculum_ot(m):
    probs, features, labels = chunk(np.random.default_rng(9))
    a, b = marginals(*probs.shape, m)
    ours = csot_plan(probs, features, labels, m, kappa_p=0, kappa_l=0, inner_max_iter=3000)
    ref = curriculum_ot(-np.log(probs), a, b, 0.1, max_iter=3000)
    assert np.abs(ours - ref).max() / ref.max() < 1e-6
    if m == 1.0:
        sink = ot.sinkhorn(a, b, -np.log(probs), 0.1, numItermax=100000, stopThr=1e-14)
        assert np.abs(ours - sink).max() / sink.max() < 1e-6


@pytest.mark.parametrize("kappa", [1.0, 5.0])
@pytest.mark.parametrize("m", [0.3, 0.6, 1.0])
def test_gcg_objective_is_monotone_and_exact(kappa, m):
    probs, features, labels = chunk(np.random.default_rng(10))
    plan, info = csot_plan(
        probs, features, labels, m, kappa_p=kappa, kappa_l=kappa, max_iter=6, tol=0, log=True
    )
    hist = np.array(info["objective"])
    assert len(hist) >= 4
    assert np.all(np.diff(hist) <= 1e-12)
    # the value tracked through the sketches is the objective of the returned plan
    ref = dense_objective(plan, probs, features, labels, 0.1, kappa, kappa)
    assert abs(hist[-1] - ref) < 1e-10
    np.testing.assert_allclose(plan.sum(0), m / probs.shape[1], atol=1e-12)
    assert plan.min() >= 0 and plan.sum(1).max() * len(plan) <= 1 + 1e-6  # inner_tol


def test_gcg_reaches_a_stationary_point():
    """At a solution Q = CurriculumOT(C + kappa grad Omega(Q)) (first-order optimality)."""
    probs, features, labels = chunk(np.random.default_rng(11))
    m = 0.5
    plan = csot_plan(probs, features, labels, m, max_iter=200, tol=1e-15)
    _, grad = coherence_energy(plan, features, probs, labels)
    a, b = marginals(*probs.shape, m)
    fixed = curriculum_ot(-np.log(probs) + grad, a, b, 0.1, max_iter=5000, tol=1e-13)
    assert np.abs(fixed - plan).max() / plan.max() < 1e-3


@pytest.mark.parametrize("kappa", [0.0, 1.0, 2.0])
def test_two_cluster_coherence_toy(kappa):
    """Structure terms pull the two outliers (4 and 9) to their cluster's class (digest 5.10)."""
    rng = np.random.default_rng(12)
    labels = np.repeat([0, 1], 5)
    features = np.eye(2)[labels] + 0.01 * rng.standard_normal((10, 2))
    probs = np.where(np.eye(2)[labels] > 0, 0.8, 0.2)
    probs[4], probs[9] = (0.3, 0.7), (0.7, 0.3)
    plan = csot_plan(probs, features, labels, 1.0, kappa_p=kappa, kappa_l=kappa, max_iter=50, tol=1e-12)
    pseudo, _, _ = select(plan, 1.0)
    share = plan[4, 0] / plan[4].sum()
    if kappa == 0:
        assert pseudo[4] == 1 and pseudo[9] == 0
    else:
        assert pseudo[4] == 0 and pseudo[9] == 1
        assert 0.7 < share < 0.9 if kappa == 1 else share > 0.99  # digest: 0.82 and 1.0


def test_csot_plan_rows_within_cap_at_default_iterations():
    """Realistic chunk (256 x 20, peaked predictions): the default solve keeps rows under the cap."""
    rng = np.random.default_rng(13)
    n, c = 256, 20
    truth = rng.integers(c, size=n)
    labels = np.where(rng.random(n) < 0.5, rng.integers(c, size=n), truth)
    logits = 3 * np.eye(c)[truth] + 1.5 * np.eye(c)[labels] + rng.standard_normal((n, c))
    probs = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    features = rng.standard_normal((c, 32))[truth] + rng.standard_normal((n, 32))
    for m in (0.3, 0.7, 1.0):
        plan, info = csot_plan(probs, features, labels, m, log=True)
        assert info["row_violation"] < 1e-3 and info["col_error"] < 1e-12


def test_omega_p_input_switch():
    probs, features, labels = chunk(np.random.default_rng(14))
    soft = csot_plan(probs, features, labels, 0.5, kappa_l=0)
    logp = csot_plan(probs, features, labels, 0.5, kappa_l=0, omega_p_input="log_softmax")
    assert np.abs(soft - logp).max() > 1e-8  # the switch changes W of Omega^P
    with pytest.raises(ValueError, match="omega_p_input"):
        csot_plan(probs, features, labels, 0.5, omega_p_input="logits")


def test_torch_path_matches_numpy():
    probs, features, labels = chunk(np.random.default_rng(15))
    ref = csot_plan(probs, features, labels, 0.5)
    out = csot_plan(
        torch.from_numpy(probs).float(), torch.from_numpy(features), torch.from_numpy(labels), 0.5
    )
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float64
    # float32 input probabilities: same plan up to the input rounding
    assert np.abs(out.numpy() - ref).max() / ref.max() < 1e-5
    out64 = csot_plan(torch.from_numpy(probs), torch.from_numpy(features), torch.from_numpy(labels), 0.5)
    assert np.abs(out64.numpy() - ref).max() / ref.max() < 1e-10
    pseudo, conf, sel = select(out64, 0.5)
    ref_sel = select(ref, 0.5)
    assert np.array_equal(pseudo.numpy(), ref_sel[0]) and np.array_equal(sel.numpy(), ref_sel[2])


# ----------------------------------------------------------------------------- selection, budget


@pytest.mark.parametrize("m", [0.3, 0.55, 1.0])
def test_selection_counts_and_partition(m):
    probs, features, labels = chunk(np.random.default_rng(16), n=50)
    plan = csot_plan(probs, features, labels, m)
    pseudo, confidence, selected = select(plan, m)
    assert selected.sum() == int(np.floor(m * 50))
    np.testing.assert_array_equal(pseudo, plan.argmax(1))
    np.testing.assert_allclose(confidence, np.clip(50 * plan.max(1), 0, 1))
    assert confidence[selected].min() >= confidence[~selected].max(initial=0)
    clean = selected & (pseudo == labels)
    corrected = selected & (pseudo != labels)
    assert np.array_equal(clean | corrected | ~selected, np.ones(50, bool))
    assert not np.any(clean & corrected)
    if m == 1.0:
        assert selected.all()


def test_allocate_matches_per_chunk_solves():
    rng = np.random.default_rng(17)
    probs, features, labels = chunk(rng, n=70)
    pseudo, confidence, selected = allocate(probs, features, labels, 0.4, solve_batch=32, seed=3)
    perm = np.random.default_rng(3).permutation(70)
    for start in range(0, 70, 32):
        idx = perm[start : start + 32]
        p, c, s = select(csot_plan(probs[idx], features[idx], labels[idx], 0.4), 0.4)
        np.testing.assert_array_equal(pseudo[idx], p)
        np.testing.assert_allclose(confidence[idx], c)
        np.testing.assert_array_equal(selected[idx], s)
    assert selected.sum() == 12 + 12 + 2  # floor(0.4 * 32) twice, floor(0.4 * 6)


# ----------------------------------------------------------------------------- batched (tensor) path
# The batched solvers take each chunk through csot_plan's steps (the same tests decide the same steps) and
# differ by rounding only: log-domain exponents of a few hundred at a few ulp each (~1e-13 relative),
# through <= 10 contracting steps; 1e-9 on confidences and plans leaves two orders of magnitude. Every
# inner solve here converges (no chunk stops at inner_max_iter, where the paths would agree only to the
# inner residual: see batched_csot_plan).


def noisy_epoch(seed, n, c=6, d=10):
    """Peaked softmax outputs with 40% label noise and clustered features (a network half-way through)."""
    rng = np.random.default_rng(seed)
    truth = rng.integers(c, size=n)
    labels = np.where(rng.random(n) < 0.4, rng.integers(c, size=n), truth)
    logits = 3.0 * np.eye(c)[truth] + 1.5 * np.eye(c)[labels] + rng.standard_normal((n, c))
    probs = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    features = rng.standard_normal((c, d))[truth] + 0.5 * rng.standard_normal((n, d))
    return probs, features, labels


@pytest.mark.parametrize(
    "m, kwargs",
    [(0.43, {}), (1.0, {}), (0.3, {"omega_p_input": "log_softmax"}), (0.6, {"kappa_p": 0, "kappa_l": 0}),
     (0.5, {"kappa_l": 0, "max_iter": 3})],
)  # fmt: skip
def test_batched_allocation_matches_the_per_chunk_numpy_path(m, kwargs):
    """allocate on tensors (one batched problem, the last chunk padded) against allocate on numpy arrays
    (csot_plan per chunk): the same selection, confidences to rounding, the same steps."""
    probs, features, labels = noisy_epoch(22, n=700)  # chunks of 128: five full, one of 60 rows
    ref = allocate(probs, features, labels, m, solve_batch=128, seed=5, log=True, warn=False, **kwargs)
    out = allocate(*map(torch.as_tensor, (probs, features, labels)), m, solve_batch=128, seed=5, log=True,
                   warn=False, **kwargs)  # fmt: skip
    assert out[0].dtype == torch.int64 and out[1].dtype == torch.float64 and out[2].dtype == torch.bool
    np.testing.assert_array_equal(out[0].numpy(), ref[0])
    np.testing.assert_allclose(out[1].numpy(), ref[1], rtol=0, atol=1e-9)
    np.testing.assert_array_equal(out[2].numpy(), ref[2])
    assert {k: out[3][k] for k in ("n_iter", "converged", "chunks")} == {
        k: ref[3][k] for k in ("n_iter", "converged", "chunks")
    }
    assert out[3]["err"] == pytest.approx(ref[3]["err"], rel=1e-6, abs=1e-12)
    assert out[2].sum() == 5 * np.floor(m * 128 + 1e-9) + np.floor(m * 60 + 1e-9)


def test_batched_csot_plan_takes_the_steps_of_csot_plan_per_chunk():
    """Chunks of different sizes (rows marked by `valid`, the rest padding without mass): each one's plan
    and step count are csot_plan's on its rows alone; padding rows get nothing."""
    probs, features, labels = noisy_epoch(23, n=3 * 48)
    sizes = (48, 37, 20)
    valid = torch.arange(48)[None, :] < torch.tensor(sizes)[:, None]
    t = [torch.as_tensor(a).view(3, 48, *a.shape[1:]) for a in (probs, features, labels)]
    plans, log = batched_csot_plan(*t, 0.5, valid=valid, max_iter=20)
    for p, size in enumerate(sizes):
        rows = slice(p * 48, p * 48 + size)
        ref, ref_log = csot_plan(probs[rows], features[rows], labels[rows], 0.5, max_iter=20, log=True)
        np.testing.assert_allclose(plans[p, :size].numpy(), ref, rtol=0, atol=1e-9 * ref.max())
        assert not plans[p, size:].any()
        assert log["n_iter"][p] == ref_log["n_iter"] and bool(log["converged"][p]) == ref_log["converged"]
        assert float(log["err"][p]) == pytest.approx(ref_log["err"], rel=1e-6, abs=1e-13)


def test_batched_curriculum_ot_solves_each_problem_and_leaves_the_frozen():
    """Each problem's plan is curriculum_ot's to its tolerance, also where the two take different steps:
    on problem 1 (full mass) an early Anderson extrapolation lands where curriculum_ot's centred kernel
    overflows, which it replaces at once by the last good point while the log domain rejects it a step
    later, so the step counts part (130 and 144) but not the fixed point."""
    probs, _, _ = noisy_epoch(24, n=3 * 40)
    cost = torch.as_tensor(-np.log(probs)).view(3, 40, 6)
    row_cap = torch.full((3, 40), 1 / 40, dtype=torch.float64)
    col_mass = torch.tensor([0.3, 1.0, 0.6], dtype=torch.float64)[:, None].expand(3, 6) / 6
    frozen = torch.tensor([False, False, True])
    plan, log = batched_curriculum_ot(cost, row_cap, col_mass, 0.1, max_iter=500, frozen=frozen)
    for p in range(2):
        ref, ref_log = curriculum_ot(cost[p].numpy(), row_cap[p].numpy(), col_mass[p].numpy(), 0.1,
                                     max_iter=500, log=True)  # fmt: skip
        np.testing.assert_allclose(plan[p].numpy(), ref, rtol=0, atol=1e-9 * ref.max())
        assert bool(log["converged"][p]) and (log["n_iter"][p] == ref_log["n_iter"]) == (p == 0)
        shift = log["g"][p].numpy() - ref_log["g"]  # potentials: up to a constant at full mass
        np.testing.assert_allclose(shift - shift.mean() * (p == 1), 0, atol=1e-9)
    assert plan[2].abs().max() == 0 and log["n_iter"][2] == 0 and not log["converged"][2]
    # a warm start from the potentials: the same plans in a few steps
    warm, warm_log = batched_curriculum_ot(cost, row_cap, col_mass, 0.1, max_iter=500, g_init=log["g"])
    assert torch.all(warm_log["n_iter"][:2] < log["n_iter"][:2])
    np.testing.assert_allclose(warm[:2].numpy(), plan[:2].numpy(), rtol=0, atol=1e-9)


def test_batched_line_search_takes_the_trials_of_armijo():
    """_batched_armijo on several 1-D functions at once against _armijo on each: the first trial accepted,
    quadratic then cubic backtracking, no descent (step 0), a chunk left out (not live)."""
    coeffs = torch.tensor([[1.0, -1.0, 0.6, 0.0], [0.0, -2.0, 50.0, 0.0], [0.0, -1.0, 0.0, 30.0],
                           [0.0, 0.5, 1.0, 0.0], [2.0, -1e-3, 1e3, -5e3], [0.0, -1.0, 9.0, 0.0]],
                          dtype=torch.float64)  # fmt: skip

    def phi(t):  # c0 + c1 t + c2 t^2 + c3 t^3, one polynomial per row
        return ((coeffs[:, 3] * t + coeffs[:, 2]) * t + coeffs[:, 1]) * t + coeffs[:, 0]

    live = torch.tensor([True] * 5 + [False])
    steps, values, going_on = _batched_armijo(phi, coeffs[:, 0], coeffs[:, 1], live, lambda v: v < -1e9)
    assert not going_on
    for p, (c0, c1, c2, c3) in enumerate(coeffs.tolist()):
        step, value = _armijo(lambda t, c=(c0, c1, c2, c3): ((c[3] * t + c[2]) * t + c[1]) * t + c[0], c0, c1)
        if p == 5:  # not live: left where it is
            step, value = 0.0, c0
        assert float(steps[p]) == pytest.approx(step, rel=1e-12, abs=0)
        assert float(values[p]) == pytest.approx(value, rel=1e-12, abs=1e-15)
    assert steps[0] == 0.99 and 0 < steps[1] < 0.5 and 0 < steps[2] < 0.5 and steps[3] == 0


@pytest.mark.parametrize("n_chunks", [4, 32])
def test_batched_allocation_reads_the_device_a_bounded_number_of_times(n_chunks):
    """On the stand-in device (runner.device_tracking), whatever the number of chunks: at most 100 reads,
    no host-device mix, nothing numpy'd on the device; the results stay on the device."""
    probs, features, labels = noisy_epoch(25, n=n_chunks * 64 - 10)
    with DeviceTracker() as tracker:
        inputs = [torch.as_tensor(a).to(STAND_IN, non_blocking=True) for a in (probs, features, labels)]
        out = allocate(*inputs, 0.43, solve_batch=64, seed=1, warn=False)
        assert all(o.device == STAND_IN for o in out)
    counts = tracker.counts["other"]
    assert counts.get("mix", 0) == 0 and counts.get("numpy", 0) == 0, tracker.report()["sites"]
    assert 5 <= counts["sync"] <= 100, tracker.report()["sites"]


def test_batched_input_checks():
    probs, features, labels = (torch.as_tensor(a) for a in noisy_epoch(26, n=50))
    bad = probs.clone()
    bad[3, 1] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        allocate(bad, features, labels, 0.5, solve_batch=16)
    with pytest.raises(ValueError, match="summing to one"):
        allocate(probs * 1.1, features, labels, 0.5, solve_batch=16)
    with pytest.raises(ValueError, match="labels must lie"):
        allocate(probs, features, labels + 6, 0.5, solve_batch=16)
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        allocate(probs, features, labels, 1.5, solve_batch=16)
    features[7, 2] = float("inf")
    with pytest.raises(ValueError, match="features contains NaN"):
        allocate(probs, features, labels, 0.5, solve_batch=16)


def test_curriculum_budget_paper_rule_hand_values():
    """m = min(1, m0 + (t - 1)/(T_sup - 1)) with t = epoch + 1 (Alg. S3), T_sup = 250, m0 = 0.3."""
    assert curriculum_budget(0, warmup=10, end=250) == pytest.approx(0.3)
    assert curriculum_budget(10, warmup=10, end=250) == pytest.approx(0.3 + 10 / 249)  # first selection
    assert curriculum_budget(30, warmup=30, end=250) == pytest.approx(0.3 + 30 / 249)  # CIFAR-100
    assert curriculum_budget(100, warmup=10, end=250) == pytest.approx(0.3 + 100 / 249)
    assert curriculum_budget(174, warmup=10, end=250) == pytest.approx(0.3 + 174 / 249)  # 0.99880
    assert curriculum_budget(175, warmup=10, end=250) == 1.0  # 0.3 + 175/249 > 1: capped at epoch 175
    assert curriculum_budget(20, warmup=10, end=80, m0=0.5) == pytest.approx(0.5 + 20 / 79)


def test_curriculum_budget_code_rule():
    ms = [curriculum_budget(e, warmup=10, end=250, rule="code") for e in range(0, 400)]
    assert ms[10] == pytest.approx(0.3) and ms[0] == pytest.approx(0.3)
    assert all(m == 1.0 for m in ms[250:]) and ms[249] < 1
    assert np.all(np.diff(ms) >= 0)
    assert curriculum_budget(130, 10, 250, rule="code") == pytest.approx(0.65)


# ----------------------------------------------------------------------------- bad input


def test_budget_takes_numpy_and_torch_scalars_and_empty_or_negative_input_is_named():
    probs, features, labels = chunk(np.random.default_rng(18))
    plan = csot_plan(probs, features, labels, 0.5)
    for m in (np.float32(0.5), np.array(0.5), torch.tensor(0.5, dtype=torch.float64)):
        np.testing.assert_array_equal(csot_plan(probs, features, labels, m), plan)
    for m in (True, "0.5", np.array([0.5])):
        with pytest.raises(ValueError, match="curriculum budget must be a number"):
            csot_plan(probs, features, labels, m)
    with pytest.raises(ValueError, match="epoch=-1"):
        curriculum_budget(-1, 10, 80)
    with pytest.raises(ValueError, match="no samples"):
        allocate(probs[:0], features[:0], labels[:0], 0.5)
    with pytest.raises(ValueError, match="reg=inf: must be a finite number"):  # a NaN plan before
        csot_plan(probs, features, labels, 0.5, reg=np.inf)
    with pytest.raises(ValueError, match="anderson=-1"):
        csot_plan(probs, features, labels, 0.5, anderson=-1)
    cost, rows, cols = (torch.from_numpy(v)[None] for v in (-np.log(probs), *marginals(*probs.shape, 0.5)))
    for kwargs, match in ((dict(reg=0.0), "reg=0.0"), (dict(reg=0.1, check_every=0), "check_every=0"),
                          (dict(reg=0.1, anderson=-1), "anderson=-1")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            batched_curriculum_ot(cost, rows, cols, **kwargs)
    with pytest.raises(ValueError, match=r"expected \(P, B, C\)"):
        batched_curriculum_ot(cost[0], rows, cols, 0.1)


def test_bad_input_raises_value_error():
    probs, features, labels = chunk(np.random.default_rng(18))
    with pytest.raises(ValueError, match="summing to one"):
        csot_plan(probs * 1.1, features, labels, 0.5)
    for m in (0.0, -0.2, 1.5):
        with pytest.raises(ValueError, match=r"\(0, 1\]"):
            csot_plan(probs, features, labels, m)
        with pytest.raises(ValueError, match=r"\(0, 1\]"):
            select(probs / 40, m)
    with pytest.raises(ValueError, match="features"):
        csot_plan(probs, features[:-1], labels, 0.5)
    with pytest.raises(ValueError, match="labels"):
        csot_plan(probs, features, labels[:-1], 0.5)
    with pytest.raises(ValueError, match="labels"):
        csot_plan(probs, features, labels + 5, 0.5)
    bad = probs.copy()
    bad[0, 0] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        csot_plan(bad, features, labels, 0.5)
    bad = features.copy()
    bad[3, 1] = np.inf
    with pytest.raises(ValueError, match="NaN"):
        csot_plan(probs, bad, labels, 0.5)
    a, b = marginals(*probs.shape, 0.5)
    with pytest.raises(ValueError, match="infeasible"):
        curriculum_ot(-np.log(probs), a, b * 3, 0.1)
    with pytest.raises(ValueError, match="reg"):
        curriculum_ot(-np.log(probs), a, b, 0.0)
    with pytest.raises(ValueError, match="row_cap"):
        curriculum_ot(-np.log(probs), a[:-1], b, 0.1)
    with pytest.raises(ValueError, match="kappa_p"):
        csot_plan(probs, features, labels, 0.5, kappa_p=-1)
    with pytest.raises(ValueError, match="end"):
        curriculum_budget(5, warmup=10, end=10)
    with pytest.raises(ValueError, match="rule"):
        curriculum_budget(5, warmup=1, end=10, rule="exp")


# ----------------------------------------------------------------------------- label noise


@pytest.mark.parametrize("kind", ["symmetric", "asymmetric"])
@pytest.mark.parametrize("rate", [0.2, 0.5, 0.8])
def test_noise_injection_is_exact(kind, rate):
    """DivideMix convention: floor(rate N) indices without replacement; symmetric redraws them
    uniformly over all classes (the true label may come back), asymmetric maps them (CIFAR-10:
    9->1, 2->0, 4->7, 3<->5); nothing else changes, and the same seed gives the same labels."""
    y = np.random.default_rng(0).integers(10, size=1000)
    noisy = inject_label_noise(y, 10, kind, rate, np.random.default_rng(7), mapping=CIFAR10_ASYM)
    replay = np.random.default_rng(7)
    idx = replay.choice(1000, size=int(np.floor(rate * 1000)), replace=False)
    expected = y.copy()
    expected[idx] = replay.integers(0, 10, size=len(idx)) if kind == "symmetric" else CIFAR10_ASYM[y[idx]]
    np.testing.assert_array_equal(noisy, expected)
    untouched = np.setdiff1d(np.arange(1000), idx)
    np.testing.assert_array_equal(noisy[untouched], y[untouched])
    if kind == "asymmetric":
        assert dict(zip(*np.unique(np.c_[y, noisy][noisy != y], axis=0).T)) == {2: 0, 3: 5, 4: 7, 5: 3, 9: 1}
    else:  # redrawn labels are uniform: about 1/10 of them keep their class
        assert abs((noisy[idx] == y[idx]).mean() - 0.1) < 0.05


def test_load_data_keeps_clean_labels():
    cfg = OmegaConf.structured(DatasetConfig(label_noise=LabelNoiseConfig(kind="symmetric", rate=0.5)))
    a, b = load_data(cfg, seed=3), load_data(cfg, seed=3)
    assert torch.equal(a.train.y, b.train.y)
    clean = load_data(OmegaConf.merge(cfg, {"label_noise": {"kind": "none"}}), seed=3)
    assert torch.equal(a.train.y_clean, clean.train.y)
    changed = (a.train.y != a.train.y_clean).float().mean().item()
    assert 0.35 < changed < 0.55  # 0.5 * (1 - 1/10) expected
    assert torch.equal(a.test.y, a.test.y_clean)


# ----------------------------------------------------------------------------- the solver convention


def test_log_keys_and_convergence_warnings():
    probs, features, labels = chunk(np.random.default_rng(21))
    a, b = marginals(*probs.shape, 0.5)
    _, log = curriculum_ot(-np.log(probs), a, b, 0.1, max_iter=2000, log=True)
    assert log["converged"] and log["err"] <= 1e-9 and log["n_iter"] < 2000
    with pytest.warns(UserWarning, match="curriculum_ot did not converge") as record:
        _, log = curriculum_ot(-np.log(probs), a, b, 0.1, max_iter=2, anderson=0, log=True)
    assert record[0].filename == __file__ and log["n_iter"] == 2 and not log["converged"]
    with pytest.warns(UserWarning, match="csot_plan did not converge"):
        _, log = csot_plan(probs, features, labels, 0.5, max_iter=1, tol=1e-15, log=True)
    assert log["n_iter"] == 1 and not log["converged"] and log["err"] > 1e-15
    _, log = csot_plan(probs, features, labels, 0.5, max_iter=200, tol=1e-9, log=True)
    assert log["converged"] and log["err"] < 1e-9 and log["n_iter"] == len(log["steps"])
    # allocate: one warning for the epoch, naming how many chunks missed
    with pytest.warns(UserWarning, match="3 of 3 chunks") as record:
        *_, log = allocate(probs, features, labels, 0.5, solve_batch=16, max_iter=1, tol=1e-15, log=True)
    assert len(record) == 1 and log["chunks"] == 3 and not log["converged"]
