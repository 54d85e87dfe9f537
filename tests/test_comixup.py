"""Co-Mixup solver, saliency, compatibility and transform, against brute force and closed forms."""

import importlib.util
import itertools
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import quick_first

from runner.canvas_metrics import box_iou, cam_boxes, canvas_metrics
from runner.compose import CONF_DIR
from runner.data.canvas import box_masks
from runner.device_tracking import STAND_IN, DeviceTracker
from runner.hardware import RunContext
from runner.methods import comixup as cm
from runner.methods.comixup import (
    ComixupPool,
    comixup,
    comixup_masks,
    compatibility,
    grid_cut,
    objective,
    pool_saliency,
    saliency,
    salient_locations,
)

ROOT = Path(__file__).resolve().parents[1]


def host_path():
    """benchmarks/bench_comixup.py, whose `old_*` functions are the host path before the device one."""
    spec = importlib.util.spec_from_file_location("bench_comixup", ROOT / "benchmarks" / "bench_comixup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def blob_saliency(rng, m, size=16, sigma=2.0):
    """One Gaussian blob per map at a random position: saliency that really mixes."""
    yy, xx = np.mgrid[:size, :size]
    cy, cx = rng.uniform(0, size, (2, m))
    return np.exp(
        -((yy[None] - cy[:, None, None]) ** 2 + (xx[None] - cx[:, None, None]) ** 2) / (2 * sigma**2)
    )


def problem(seed, m, grid, size=16):
    rng = np.random.default_rng(seed)
    s = blob_saliency(rng, m, size)
    return pool_saliency(s, grid), compatibility(s), rng.dirichlet(2.0 * np.ones(m))


def batch(seed, B, size=12, K=5, channels=3):
    rng = np.random.default_rng(seed)
    x = torch.from_numpy(rng.random((B, channels, size, size)).astype(np.float32))
    y = torch.nn.functional.one_hot(torch.from_numpy(rng.integers(0, K, B)), K).float()
    return x, y, blob_saliency(rng, B, size)


def all_one_hot_masks(m_out, g, m):
    """Every one-hot labeling of m_out outputs on a g x g grid: (m^(m_out g^2), m_out, g, g, m)."""
    labels = np.array(list(itertools.product(range(m), repeat=m_out * g * g)))
    return np.eye(m)[labels].reshape(-1, m_out, g, g, m)


def input_counts(masks):
    return (masks.sum((1, 2)) > 0).sum(1)


def overlap(masks):
    """sum_{j != j'} o~_j^T o~_j' / m with o~ the normalised source histograms (1 - paper's diversity)."""
    o = masks.sum((1, 2))
    o = o / o.sum(1, keepdims=True)
    gram = o @ o.T
    return (gram.sum() - np.trace(gram)) / len(o)


# 1-2: shapes, partition, labels by area -------------------------------------------------------


@pytest.mark.parametrize("B", [2, 7, 23])
def test_masks_partition_each_cell_and_labels_equal_area(B):
    x, y, s = batch(B, B)
    grid = 4
    x_mix, y_mix, masks = comixup(x, y, s, grid=grid, part=10, rng=0)
    assert x_mix.shape == x.shape and y_mix.shape == y.shape and masks.shape == (B, grid, grid, B)
    M = masks.numpy()
    assert M.min() >= 0 and np.allclose(M.sum(-1), 1, atol=1e-6)
    assert np.isin(M, (0, 0.5, 1)).all()
    # sources stay inside each output's partition (near-equal chunks of <= 10)
    chunks = np.array_split(np.arange(B), -(-B // 10))
    block = np.zeros((B, B), bool)
    for c in chunks:
        block[np.ix_(c, c)] = True
    assert (M.sum((1, 2))[~block] == 0).all()
    # Z = nearest-neighbour upsampling of the masks: constant on blocks, x~ = sum_i Z_i x_i
    Z = M.repeat(3, axis=1).repeat(3, axis=2)  # (B, H, W, B)
    assert np.allclose(x_mix.numpy(), np.einsum("jhwi,ichw->jchw", Z, x.numpy()), atol=1e-6)
    # label weights = pixel fraction of each source, summing to 1
    assert np.allclose(y_mix.numpy(), Z.mean((1, 2)) @ y.numpy(), atol=1e-6)
    assert np.allclose(y_mix.sum(1).numpy(), 1, atol=1e-6)


def test_one_hot_masks_without_mixed_labels_and_identical_inputs_are_unchanged():
    x, y, s = batch(1, 8)
    _, _, masks = comixup(x, y, s, grid=4, mixed_labels=False, rng=0)
    assert np.isin(masks.numpy(), (0, 1)).all()
    x_same = x[:1].repeat(8, 1, 1, 1)
    x_mix, _, masks = comixup(x_same, y, s, grid=4, rng=0)
    assert torch.allclose(x_mix, x_same, atol=1e-6)
    assert (masks.sum((1, 2)) > 0).sum(1).float().mean() > 1  # the masks did mix, the images could not


def test_numpy_in_numpy_out_and_same_values_as_torch():
    x, y, s = batch(2, 10)
    out_t = comixup(x, y, s, grid=4, rng=3)
    out_n = comixup(x.numpy(), y.numpy(), s, grid=4, rng=3)
    for a, b in zip(out_t, out_n):
        assert isinstance(b, np.ndarray) and np.allclose(a.numpy(), b)


# 3: modular identity -------------------------------------------------------------------------


def random_labeling(rng, m_out, n, m):
    """Random valid z: each cell one input or a half/half blend of two."""
    z = np.zeros((m_out, n, m))
    for j, k in itertools.product(range(m_out), range(n)):
        a, b = rng.choice(m, 2, replace=False)
        if rng.random() < 0.5:
            z[j, k, a] = 1
        else:
            z[j, k, [a, b]] = 0.5
    return z


def output_energy(z_j, unary, beta_n, g):
    """E_j(z_j) = sum_k U_k^T z_j[k] + beta' sum_{neighbours} 1/2 |z_j[k] - z_j[k']|^2 (independent code)."""
    cells = z_j.reshape(g, g, -1)
    smooth = ((cells[1:] - cells[:-1]) ** 2).sum() + ((cells[:, 1:] - cells[:, :-1]) ** 2).sum()
    return (unary * z_j).sum() + 0.5 * beta_n * smooth


@pytest.mark.parametrize("seed", range(5))
def test_exact_modular_identity_unclipped(seed):
    rng = np.random.default_rng(seed)
    m, g = 5, 3
    n = g * g
    s_grid, A, lam = problem(seed, m, g, size=12)
    A = A + 0.05 * (np.ones((m, m)) - np.eye(m))  # a visibly non-identity A
    beta, gamma, eta = 0.5, 1.3, 0.2
    z = random_labeling(rng, m, n, m)
    j = int(rng.integers(m))
    z_new = z.copy()
    z_new[j] = random_labeling(rng, 1, n, m)[0]
    others = z.sum(1).sum(0) - z[j].sum(0)
    unary = -s_grid.reshape(m, n).T - eta / n * np.log(lam + 1e-8) + 2 * gamma / n * A @ others
    f = [
        objective(w.reshape(m, g, g, m), s_grid, lam, A, beta, gamma, eta, thres_type="none")
        for w in (z, z_new)
    ]
    e = [output_energy(w[j], unary, beta / n, g) for w in (z, z_new)]
    assert f[1] - f[0] == pytest.approx(e[1] - e[0], rel=1e-10, abs=1e-12)


# 4: monotone descent -------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(6))
def test_monotone_descent_with_exact_steps(seed):
    s_grid, A, lam = problem(seed, 4, 3, size=12)
    _, info = comixup_masks(
        s_grid,
        A,
        lam,
        thres_type="none",
        mixed_labels=False,
        set_resolve=False,
        method="brute",
        max_iter=4,
        gamma=2.0,
        rng=seed,
        log=True,
    )
    path = np.concatenate([info["energy"][:1], info["trace"]])
    assert len(info["trace"]) >= 8
    assert (np.diff(path) <= 1e-12).all()


# 5: gamma = 0 --------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(3))
def test_gamma_zero_gives_identical_outputs_at_the_single_output_optimum(seed):
    m, g = 3, 3
    s_grid, A, lam = problem(seed, m, g, size=12)
    masks = comixup_masks(s_grid, A, lam, gamma=0.0, mixed_labels=False, method="brute", rng=seed)
    assert (masks == masks[:1]).all()
    candidates = all_one_hot_masks(1, g, m)
    energies = objective(candidates, s_grid, lam, A, gamma=0.0)
    best = candidates[np.argmin(energies), 0]
    assert np.array_equal(masks[0], best)


def test_gamma_zero_special_cases_are_per_cell_argmins():
    m, g = 20, 4
    s_grid, A, lam = problem(0, m, g)
    flat = s_grid.reshape(m, -1)
    masks = comixup_masks(s_grid, A, lam, beta=0.0, gamma=0.0, eta=0.0, mixed_labels=False, rng=0)
    assert np.array_equal(masks.reshape(m, -1, m).argmax(-1), np.broadcast_to(flat.argmax(0), (m, g * g)))
    eta = 3.0
    masks = comixup_masks(s_grid, A, lam, beta=0.0, gamma=0.0, eta=eta, mixed_labels=False, rng=0)
    expected = (-flat - eta / g**2 * np.log(lam + 1e-8)[:, None]).argmin(0)
    assert np.array_equal(masks.reshape(m, -1, m).argmax(-1), np.broadcast_to(expected, (m, g * g)))


# 6: the graph cut on one output --------------------------------------------------------------


def labeling_energy(labels, unary, pairwise, w):
    g = unary.shape[0]
    lab = labels.reshape(g, g)
    flat = unary.reshape(g * g, -1)[np.arange(g * g), lab.ravel()].sum()
    return flat + w * (pairwise[lab[1:], lab[:-1]].sum() + pairwise[lab[:, 1:], lab[:, :-1]].sum())


@pytest.mark.parametrize("method", ["gco_swap", "gco_expansion"])
def test_two_label_cut_is_exact_and_more_labels_never_beat_brute_force(method):
    rng = np.random.default_rng(0)
    exact = 0
    for trial in range(60):
        L = 2 if trial < 30 else int(rng.integers(3, 5))
        unary = rng.normal(size=(3, 3, L))
        pairwise = 1.0 - np.eye(L)
        w = rng.uniform(0.1, 1.5)
        e_cut = labeling_energy(grid_cut(unary, pairwise, w, method), unary, pairwise, w)
        e_bf = labeling_energy(grid_cut(unary, pairwise, w, "brute"), unary, pairwise, w)
        if L == 2:
            assert e_cut == pytest.approx(e_bf, abs=1e-5)
        else:
            assert e_cut >= e_bf - 1e-5
            exact += abs(e_cut - e_bf) < 1e-5
    assert exact >= 15  # a local minimum, but mostly the optimum on 3x3 grids


# Float tolerance of the exact DP against brute force and gco: both sum the same <= 40 terms (16 unary, 24
# edges) of magnitude <= 10 in float64 in different orders, so they differ by <= 40 * 10 * 2^-52 ~ 1e-13; the
# swap's own energy is evaluated here in float64 too, so 1e-9 is slack that a wrong labeling (energy gaps of a
# cost difference, >= 1e-4 here) cannot hide in.
EXACT_TOL = 1e-9


def test_exact_cut_is_the_brute_force_optimum_on_tiny_grids():
    rng = np.random.default_rng(0)
    for trial in range(150):
        g, L = (2, int(rng.integers(2, 7))) if trial % 2 else (3, int(rng.integers(2, 5)))
        unary = rng.normal(size=(2, g, g, L)) * rng.choice([0.1, 1.0, 5.0])
        unary[rng.random(unary.shape) < 0.2] = np.inf
        unary[..., 0] = np.where(np.isinf(unary).all(-1), 0.0, unary[..., 0])  # a label left at every site
        pairwise = rng.random((L, L))
        pairwise = pairwise + pairwise.T
        np.fill_diagonal(pairwise, 0.0)
        w = rng.uniform(0.0, 1.5, (2, 2 * g * (g - 1))) if trial % 3 else rng.uniform(0.1, 1.5)
        labels, best = grid_cut(unary, pairwise, w, "exact"), grid_cut(unary, pairwise, w, "brute")
        for p in range(2):
            e = [labeling_energy_per_edge(lab[p], unary[p], pairwise, w if np.ndim(w) == 0 else w[p])
                 for lab in (labels, best)]  # fmt: skip
            assert e[0] == pytest.approx(e[1], abs=EXACT_TOL), (trial, p)


def labeling_energy_per_edge(labels, unary, pairwise, w):
    """`labeling_energy` with a weight per edge in `grid_cut`'s order (vertical edges, then horizontal)."""
    g = unary.shape[0]
    lab = labels.reshape(g, g)
    w = np.broadcast_to(w, (2 * g * (g - 1),))
    edges = np.concatenate([pairwise[lab[1:], lab[:-1]].ravel(), pairwise[lab[:, 1:], lab[:, :-1]].ravel()])
    return unary.reshape(g * g, -1)[np.arange(g * g), lab.ravel()].sum() + (w * edges).sum()


def comixup_cut(rng, m):
    """A label step's MRF as `_label_step` builds it at the presets' shape (4x4 grid, beta_n = 0.32 / 16): the
    negated pooled saliency of m inputs plus a modular diversity cost per input, and the three blends of the
    first inputs (their costs the mean of their parents', pairwise 1/4 and 3/4)."""
    s = blob_saliency(rng, m, size=16, sigma=rng.choice([1.5, 3.0]))
    cost = -pool_saliency(s, 4).reshape(m, 16).T + rng.uniform(0, 0.2, m) * rng.choice([0.0, 1.0])
    vectors, pairwise = cm._label_set(m, True)
    return (cost @ vectors.T).reshape(4, 4, -1), pairwise, 0.32 / 16


def test_exact_cut_never_costs_more_than_gco_swap_at_the_presets_shape():
    rng = np.random.default_rng(0)
    lower = 0
    for trial in range(200):
        unary, pairwise, w = comixup_cut(rng, int(rng.integers(2, 21)))
        e_exact, e_swap = (labeling_energy(grid_cut(unary, pairwise, w, m), unary, pairwise, w)
                           for m in ("exact", "gco_swap"))  # fmt: skip
        assert e_exact <= e_swap + EXACT_TOL, trial
        lower += e_exact < e_swap - EXACT_TOL
    assert lower > 0  # the swap's local minima are not always global here, so the test can tell them apart


def native_step_problem(rng):
    """A random `_label_step` input: a partitions of m inputs on a g x g grid, with padding inputs (+inf),
    exact ties between inputs (the dominance rule's tie-break) and counts with ties (the slot order's)."""
    a, m, g = int(rng.integers(1, 4)), int(rng.integers(2, 9)), int(rng.integers(1, 5))
    U = -rng.random((a, m, g * g)) * rng.choice([0.05, 0.3, 1.0]) + rng.random((a, m, 1)) * 0.1
    if rng.random() < 0.3:
        U[:, -1] = np.inf
    if rng.random() < 0.3:
        U[:, 1] = U[:, 0]
    counts = rng.integers(0, 3, (a, m)) * rng.choice([0.5, 1.0])
    return U, counts, g, 0.02 * rng.choice([1.0, 10.0]), bool(rng.random() < 0.6)


@pytest.mark.parametrize("bound, numpy_method", [(None, "exact"), (0, "gco_swap")])
def test_native_label_step_is_the_numpy_step(monkeypatch, bound, numpy_method):
    """With the exact cut; past its work bound (here every problem), with the swap."""
    if bound is not None:
        monkeypatch.setattr(cm, "_DP_MAX_WORK", bound)
    rng = np.random.default_rng(1)
    for trial in range(300 if bound is None else 50):
        U, counts, g, beta_n, mixed = native_step_problem(rng)
        stats = {"gc_seconds": 0.0, "gc_calls": 0}
        native = cm._native_label_step(U, counts, g, beta_n, "exact", mixed, stats)
        assert np.array_equal(native, cm._label_step(U, counts, g, beta_n, numpy_method, mixed, stats)), trial


# gco aborts the whole process (no exception) on a term past its limit or a forbidden label under
# expansion, so this runs in a child: a regression fails the test instead of killing the suite.
_CUT_LIMITS_CHILD = """
import numpy as np
from runner.methods.comixup import comixup, grid_cut
rng = np.random.default_rng(0)
for method in ("gco_swap", "gco_expansion"):
    for trial in range(40):
        L, size, w = (2, 3, 20.0) if trial < 20 else (3, 2, 1e3)  # edge terms 20 and 1e3: past 1e7 at 1e-6
        unary = rng.normal(size=(size, size, L)) * rng.choice([1.0, 1e3])
        forbid = rng.random((size, size, L)) < 0.3
        forbid[..., rng.integers(L)] = False  # one label left at every site
        unary[forbid] = np.inf
        pairwise = 1.0 - np.eye(L)
        labels, best = (grid_cut(unary, pairwise, w, m) for m in (method, "brute"))
        chosen = np.take_along_axis(unary, labels[..., None], 2)
        assert np.isfinite(chosen).all(), (method, trial)
        energy = [chosen.sum() + w * ((lab[1:] != lab[:-1]).sum() + (lab[:, 1:] != lab[:, :-1]).sum())
                  for lab in (labels, best)]
        # integers at a scale >= 1e7 / (2 max - min + 4 max edge): within half a unit per term, twice
        finite = unary[np.isfinite(unary)]
        unit = (2 * finite.max() - finite.min() + 4 * w) / 1e7
        tol = (unary[..., 0].size + 2 * size * (size - 1)) * unit
        assert energy[0] >= energy[1] - tol, (method, trial)
        if L == 2:  # both moves are exact on two labels
            assert energy[0] <= energy[1] + tol, (method, trial, energy)
metric = np.abs(np.subtract.outer(np.arange(3.0), np.arange(3.0)))  # 0.37 x: rint at 1e-6 broke its triangles
for w in (5e-7, 1e-6, 1e9):
    grid_cut(rng.normal(size=(3, 3, 3)), 0.37 * metric, w, "gco_expansion")
assert grid_cut(np.array([[[0.0, np.inf]]]), 1 - np.eye(2), 1.0).tolist() == [[0]]  # one cell: no edges
no_edges = np.zeros((1, 0))  # per-edge weights of a one-cell grid
assert grid_cut(np.array([[[0.5, 0.2, 0.9]]]), 1 - np.eye(3), no_edges).tolist() == [[1]]
x = np.random.default_rng(1).random((23, 3, 8, 8)).astype(np.float32)
y = np.eye(5, dtype=np.float32)[np.arange(23) % 5]
s = np.random.default_rng(2).random((23, 8, 8)) ** 8  # peaked: inputs dominated, partitions of 8 and 7
_, _, masks = comixup(x, y, s, grid=4, part=8, mixed_labels=False, method="gco_expansion", rng=0)
assert np.isin(masks, (0, 1)).all() and np.allclose(masks.sum(-1), 1)
print("ok")
"""


def test_cuts_with_forbidden_labels_and_large_terms_run_and_stay_near_brute_force():
    """Forbidden labels under expansion and edge terms past 1e7 at gco's 1e-6 resolution aborted the
    process; both methods now never choose a forbidden label and are exact on two labels."""
    done = subprocess.run([sys.executable, "-c", _CUT_LIMITS_CHILD], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


@pytest.mark.parametrize(
    "unary, pairwise, weight, method, message",
    [
        (np.full((2, 2, 2), np.nan), 1 - np.eye(2), 1.0, "gco_swap", "NaN or -inf"),
        (np.full((2, 2, 2), np.inf), 1 - np.eye(2), 1.0, "gco_swap", r"site \(0, 0\) .* forbids all 2"),
        (np.zeros((2, 2, 3)), np.ones((3, 3)), 1.0, "gco_swap", "zero diagonal"),
        (np.zeros((2, 2, 3)), np.subtract.outer(*[np.arange(3.0)] * 2) ** 2, 1.0, "gco_expansion", "metric"),
        (np.zeros((2, 2, 2)), 1 - np.eye(2), -0.5, "gco_swap", "got -0.5"),
        (np.zeros((1, 2, 2, 2)), 1 - np.eye(2), np.ones((1, 3)), "gco_swap", r"\(1, 4\)"),
        (np.zeros((2, 2)), 1 - np.eye(2), 1.0, "gco_swap", "expected"),
    ],
)
def test_grid_cut_names_bad_input(unary, pairwise, weight, method, message):
    with pytest.raises(ValueError, match=message):
        grid_cut(unary, pairwise, weight, method)


def test_label_pruning_keeps_the_exact_optimum():
    """Dropping dominated inputs from an output's label set keeps the brute-force optimum."""
    rng = np.random.default_rng(1)
    g, m = 3, 4
    for _ in range(10):
        peaks = rng.random((1, g * g, m)) ** 6  # peaked: most inputs dominated somewhere
        U = -peaks + rng.random(m) * 0.2
        pairwise = 1.0 - np.eye(m)
        stats = {"gc_seconds": 0.0, "gc_calls": 0}
        z = cm._label_step(U.transpose(0, 2, 1), np.ones((1, m)), g, 0.3, "brute", False, stats)[0]
        full = grid_cut(U[0].reshape(g, g, m), pairwise, 0.3, "brute").ravel()
        e_pruned = labeling_energy(z.argmax(1), U[0].reshape(g, g, m), pairwise, 0.3)
        assert e_pruned == pytest.approx(
            labeling_energy(full, U[0].reshape(g, g, m), pairwise, 0.3), abs=1e-12
        )


# 7: against joint brute force ----------------------------------------------------------------


def clip_rule(A, usage, threshold):
    """Hard clipping h(P) = A (P * [A P > threshold]) for usages (..., m)."""
    q = usage @ A
    return (usage * (q > threshold)) @ A


def joint_energies(s_grid, lam, A, m_out, beta, gamma, tau):
    """f of every one-hot joint labeling (eta = 0, hard clip), built from per-output parts:
    returns (energies of shape (S,) * m_out, the S single-output masks (S, g, g, m))."""
    m, g, _ = s_grid.shape
    n = g * g
    single = all_one_hot_masks(1, g, m)[:, 0]  # (S, g, g, m)
    smooth = np.square(np.diff(single, axis=1)).sum((1, 2, 3)) + np.square(np.diff(single, axis=2)).sum(
        (1, 2, 3)
    )
    local = -(single * s_grid.transpose(1, 2, 0)).sum((1, 2, 3)) + 0.5 * beta / n * smooth
    o = single.sum((1, 2))
    if m_out == 2:
        cross = o @ clip_rule(A, o, tau * n).T
        f = local[:, None] + local[None, :] + gamma / n * (cross + cross.T)
    else:
        pair = clip_rule(A, o[:, None, :] + o[None, :, :], tau * n)  # h(o_b + o_c)
        f = local[:, None, None] + local[None, :, None] + local[None, None, :]
        f = f + gamma / n * (
            np.einsum("am,bcm->abc", o, pair)
            + np.einsum("bm,acm->abc", o, pair)
            + np.einsum("cm,abm->abc", o, pair)
        )
    return f, single


@pytest.mark.parametrize("m,g", [(2, 2), (2, 3), (3, 2)])
def test_against_joint_brute_force(m, g):
    kwargs = dict(beta=0.32, gamma=1.0, eta=0.0, tau=0.83, thres_type="hard")
    errors = []
    for seed in range(10):
        rng = np.random.default_rng(seed)
        s_grid = rng.random((m, g, g)) ** 4  # peaked cell saliency
        s_grid /= s_grid.sum((1, 2), keepdims=True)
        A = compatibility(blob_saliency(rng, m, 12), omega=0.05)
        lam = rng.dirichlet(np.ones(m))
        f_all, single = joint_energies(s_grid, lam, A, m, 0.32, 1.0, 0.83)
        # the oracle and `objective` agree on random joint labelings
        for idx in rng.integers(0, len(single), size=(5, m)):
            assert objective(single[idx], s_grid, lam, A, **kwargs) == pytest.approx(
                f_all[tuple(idx)], abs=1e-10
            )
        masks = comixup_masks(s_grid, A, lam, mixed_labels=False, rng=seed, **kwargs)
        f_ours = objective(masks, s_grid, lam, A, **kwargs)
        assert f_ours >= f_all.min() - 1e-9
        errors.append((f_ours - f_all.min()) / (f_all.mean() - f_all.min()))  # 0: optimum, 1: random labeling
    assert np.mean(errors) <= 0.25


# 8-9: tau and gamma control mixing -----------------------------------------------------------


def test_tau_controls_how_many_inputs_each_output_mixes():
    m, g = 20, 4
    counts, overlaps = [], []
    for tau in (0.0, 0.5, 0.79, 0.83, 0.87, 1.0):
        runs = [comixup_masks(*problem(seed, m, g), tau=tau, max_iter=6, rng=seed) for seed in range(3)]
        counts.append(np.mean([input_counts(r).mean() for r in runs]))
        overlaps.append(np.mean([overlap(r) for r in runs]))
    # 6 sweeps: 4 do not always untangle the random start when every input is over-penalised (tau <= .5)
    assert counts[0] <= 1.1 and counts[1] <= 1.1  # over-penalisation: singletons
    assert all(a <= b + 1e-9 for a, b in zip(counts, counts[1:])), counts
    assert 2.0 <= counts[3] <= 3.5 and counts[-1] > 5
    assert overlaps[-1] > overlaps[3] > overlaps[0]  # diversity (1 - overlap) falls as tau rises


def test_large_gamma_at_zero_threshold_spreads_inputs_over_outputs():
    m, g = 20, 4
    high = [comixup_masks(*problem(s, m, g), gamma=5.0, tau=0.0, rng=s) for s in range(4)]
    zero = [comixup_masks(*problem(s, m, g), gamma=0.0, tau=0.0, rng=s) for s in range(4)]
    permutations = sum(((r.sum((1, 2)) > 0).sum(0) == 1).all() for r in high)
    assert permutations >= 3
    assert np.mean([overlap(r) for r in high]) < 0.1 * np.mean([overlap(r) for r in zero])


# 10: saliency and compatibility --------------------------------------------------------------


def test_saliency_of_a_linear_softmax_model_is_exact():
    torch.manual_seed(0)
    B, C, H, W, K = 6, 3, 4, 4, 5
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(C * H * W, K)).double()
    x = torch.rand(B, C, H, W, dtype=torch.float64)
    y = torch.randint(0, K, (B,))
    s, s_grid = saliency(model, x, y, grid=2)
    weight, bias = model[1].weight.detach(), model[1].bias.detach()
    probs = torch.softmax(x.flatten(1) @ weight.T + bias, 1)
    grad = ((probs - torch.nn.functional.one_hot(y, K)) @ weight).reshape(B, C, H, W)
    assert torch.allclose(s, grad.pow(2).mean(1).sqrt(), atol=1e-12)
    assert torch.allclose(s_grid.sum((1, 2)), torch.ones(B, dtype=torch.float64))
    assert all(p.grad is None for p in model.parameters())


def test_compatibility_is_symmetric_positive_definite():
    rng = np.random.default_rng(0)
    for m in (2, 5, 20):
        A = compatibility(blob_saliency(rng, m, 32), omega=0.001)
        assert np.allclose(A, A.T) and np.allclose(np.diag(A), 0.999)
        assert np.linalg.eigvalsh(A).min() > 0
        assert A.sum() == pytest.approx(0.999 * m + 0.001 * m)  # A_hat is scaled to sum m
        for _ in range(50):  # supermodularity (Lemma 1): x'Ax + x''Ax'' >= 2 x'Ax''
            u, v = rng.random((2, m)) * 16
            assert u @ A @ u + v @ A @ v >= 2 * u @ A @ v - 1e-9
    # objects far apart -> larger entry
    s = np.zeros((3, 32, 32))
    s[0, 0, 0] = s[1, 0, 12] = s[2, 31, 31] = 1
    A = compatibility(s, omega=0.01)
    assert A[0, 2] > A[0, 1] > 0


def test_degenerate_saliency_gives_finite_results():
    x, y, _ = batch(0, 10)
    for s in (np.zeros((10, 12, 12)), np.ones((10, 12, 12))):  # zero maps; identical salient locations
        A = compatibility(s)
        assert np.isfinite(A).all() and np.allclose(A, 0.999 * np.eye(10))
        assert np.isfinite(pool_saliency(s, 4)).all()
        x_mix, y_mix, masks = comixup(x, y, s, grid=4, rng=0)
        assert torch.isfinite(x_mix).all() and torch.isfinite(y_mix).all()
        assert np.allclose(masks.sum(-1).numpy(), 1)


# 11: determinism, pool, bad input ------------------------------------------------------------


def test_same_seed_same_masks():
    x, y, s = batch(4, 40, size=16)
    a = comixup(x, y, s, rng=7)[2]
    b = comixup(x, y, s, rng=7)[2]
    c = comixup(x, y, s, rng=8)[2]
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_worker_pool_gives_the_in_process_result():
    x, y, s = batch(5, 60, size=16)
    expected = comixup(x, y, s, part=20, rng=11)
    with ComixupPool(workers=2) as pool:
        pending = pool.submit(x, y, s, part=20, rng=11)
        got = pending.result()
    for a, b in zip(expected, got):
        assert torch.equal(a, b)


def test_threads_give_the_one_thread_masks_bit_for_bit():
    """Five partitions of 12 (a CIFAR batch's five partitions, smaller) on 2, 3 and 5 threads, over several
    batches: the exact DP solves every grid alone, so any split of the partitions gives the same masks."""
    for seed in range(4):
        x, y, s = batch(seed, 60, size=16)
        expected = comixup(x, y, s, part=12, grid=4, rng=seed)
        sources = (expected[2].sum((1, 2)) > 0).sum(1)
        assert (sources > 1).any()  # outputs really mix: a wrong split would show
        for threads in (2, 3, 5):
            with ComixupPool(workers=threads) as pool:
                got = pool.submit(x, y, s, part=12, grid=4, rng=seed).result()
            assert all(torch.equal(a, b) for a, b in zip(expected, got)), (seed, threads)


def test_gco_cuts_on_many_threads_give_their_one_thread_labels():
    """gco's cuts take turns on its one instance map (`_GCO_LOCK`): eight threads making 4000 small cuts at
    once give the labels of the same cuts one after another. Unsynchronised, the threads race on the map
    (seen here: about one run in three ended the process with "Invalid instance handle" or a heap abort)."""
    from concurrent.futures import ThreadPoolExecutor

    rng = np.random.default_rng(0)
    problems = [rng.normal(size=(1, 4, 2)) for _ in range(4000)]  # tiny: the map's operations dominate
    pairwise = np.array([[0.0, 1.0], [1.0, 0.0]])

    def cut(unary):
        return cm._gco_cut(unary, pairwise, 0.5, 2, swap=True)

    one_by_one = [cut(u) for u in problems]
    with ThreadPoolExecutor(8) as pool:
        at_once = list(pool.map(cut, problems))
    assert all(np.array_equal(a, b) for a, b in zip(one_by_one, at_once))


def hooks_step(workers, seed=3, overlap=True):
    """One Co-Mixup step of `MixupHooks` (clean pass, mix, loss, backward) on a fixed model and batch:
    (mixed x, mixed y, loss, weight gradients, the hooks)."""
    from runner.configs.classify import CoMixupConfig
    from runner.hooks.mixup import MixupHooks
    from runner.validate import to_node

    cfg = to_node(CoMixupConfig(grid=2, part=4, preview=False))
    cfg.workers = workers  # -1 (auto) is the hooks' to resolve, past the schema's range
    cfg.overlap = overlap
    hooks = MixupHooks(cfg, 5, RunContext(torch.device("cpu"), ROOT, tracker=None), seed=seed)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3, padding=1),
        torch.nn.BatchNorm2d(4),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(2),
        torch.nn.Flatten(),
        torch.nn.Linear(16, 5),
    )
    x, y, _ = batch(seed, 9, size=8)
    x_mix, y_mix = hooks.transform(x, y, None, model)
    loss = hooks.loss(model, x_mix, y_mix, None, 0)
    loss.backward()
    return x_mix, y_mix, loss.detach(), [p.grad for p in model.parameters()], hooks


@pytest.mark.parametrize("workers", [0, 2])
def test_a_diverged_network_stops_with_the_diverged_line_not_the_saliency_check(workers):
    """The mix's input check refused a NaN saliency map, a ValueError traceback: the clean pass's input
    gradient is NaN once the weights are, before the loop's deferred non-finite check reads the loss."""
    from runner.configs.classify import CoMixupConfig
    from runner.faults import Diverged
    from runner.hooks.mixup import MixupHooks
    from runner.validate import to_node

    cfg = to_node(CoMixupConfig(grid=2, part=4, preview=False))
    cfg.workers = workers
    hooks = MixupHooks(cfg, 5, RunContext(torch.device("cpu"), ROOT, tracker=None), seed=3)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten(), torch.nn.LazyLinear(5))
    x, y, _ = batch(3, 9, size=8)
    model(x)
    with torch.no_grad():
        model[0].weight[0, 0, 0, 0] = math.nan  # a diverged step's weights
    try:
        with pytest.raises(Diverged, match="^non-finite saliency maps .*lower train.lr"):
            hooks.transform(x, y, None, model)
    finally:
        if hooks.pool is not None:
            hooks.pool.close()


@pytest.mark.parametrize("overlap", [True, False])
def test_pool_step_gives_the_in_process_step_exactly(overlap):
    x0, y0, loss0, grads0, hooks0 = hooks_step(workers=0)
    x1, y1, loss1, grads1, hooks1 = hooks_step(workers=2, overlap=overlap)
    try:
        # any deferred weight backward ran: its clean loss value is in loss1 (consumed by `loss`)
        assert hooks0.pool is None and hooks1.pool is not None and hooks1._deferred is None
        assert not torch.equal(x0, batch(3, 9, size=8)[0])  # the batch was mixed
        assert torch.equal(x0, x1) and torch.equal(y0, y1) and torch.equal(loss0, loss1)
        assert all(torch.equal(a, b) for a, b in zip(grads0, grads1))
    finally:
        hooks1.pool.close()
    assert hooks_step(workers=-1)[4].workers == 0  # auto on the CPU: in-process


class Residual(torch.nn.Module):
    """A residual net with in-place ReLUs after its layers and a frozen layer; `twice`: one layer called
    twice."""

    def __init__(self, twice=False):
        super().__init__()
        self.stem, self.conv = torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.Conv2d(4, 4, 3, padding=1)
        self.norm, self.head, self.twice = torch.nn.BatchNorm2d(4), torch.nn.Linear(4, 5), twice
        self.frozen = torch.nn.Conv2d(4, 4, 1).requires_grad_(False)

    def forward(self, x):
        h = torch.relu_(self.norm(self.stem(x)))
        h = h + torch.relu_(self.conv(self.frozen(h)))
        return self.head((self.conv(h) if self.twice else h).mean((2, 3)))


@pytest.mark.parametrize("name", ["residual", "preactresnet18"])
def test_weight_gradients_from_the_activation_gradients_are_a_backward(name):
    from omegaconf import OmegaConf

    from runner.hooks.mixup import ActivationGradients
    from runner.models import build_model

    torch.manual_seed(0)
    model = Residual() if name == "residual" else build_model(OmegaConf.create({"name": name}), (3, 8, 8), 5)
    x = torch.rand(6, 3, 8, 8, requires_grad=True)
    params = [p for p in model.parameters() if p.requires_grad]
    with ActivationGradients(model) as taps:
        loss = torch.nn.functional.cross_entropy(model(x), torch.arange(6) % 5)
    (x_grad,) = torch.autograd.grad(loss, x, retain_graph=True)
    expected = torch.autograd.grad(loss, params, retain_graph=True)
    got = taps.weight_gradients(params)
    assert got is not None
    # The same float32 kernels on the same activation gradients, which the input-gradient backward formed
    # as the full one does: equal up to the summation order of a kernel, if any (a rounding of 2^-24 per
    # term, relative to the largest); 1e-5 relative also catches a missing or doubled path (O(1) changes).
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", ["outside a module call", "a module called twice", "unused by its call"])
def test_weight_gradients_need_each_trainable_parameter_in_one_recorded_call(case):
    from runner.hooks.mixup import ActivationGradients

    model = Residual(twice=case == "a module called twice")
    if case == "unused by its call":
        model.head.spare = torch.nn.Parameter(torch.ones(5))
    extra = torch.nn.Parameter(torch.ones(5))
    params = [p for p in model.parameters() if p.requires_grad] + [extra] * (case == "outside a module call")
    with ActivationGradients(model) as taps:
        loss = (model(torch.rand(2, 3, 8, 8, requires_grad=True)) * extra).sum()
    loss.backward(inputs=params, retain_graph=True)
    assert taps.weight_gradients(params) is None


def test_kept_gradients_enter_as_the_surrogate_did():
    from runner.hooks.mixup import _AddKept

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(3, 2)), torch.nn.Parameter(torch.randn(4))]
    kept = [torch.randn(3, 2), torch.randn(4)]
    grads = []
    for new in (True, False):
        loss = sum((p**2).sum() for p in params)
        if new:
            loss = _AddKept.apply(loss, kept, *params)
        else:  # the surrogate sum(p * g) of before
            surrogate = sum((p * g).sum() for p, g in zip(params, kept))
            loss = loss + (surrogate - surrogate.detach())
        grads.append(torch.autograd.grad(loss * 1024.0, params))  # as the fp16 scaler scales it
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_lag_trains_each_batch_on_its_mix_one_step_later():
    """With lag, step t trains on batch t-1's mix (from step t-1's saliency; the in-process one, which the
    pool's equals), solved while step t ran its clean pass; the first step trains on its clean batch. Auto
    workers start a pool for it on the CPU."""
    from runner.checks import ConfigError
    from runner.configs.classify import CoMixupConfig
    from runner.hooks.mixup import MixupHooks
    from runner.validate import to_node

    def hooks(lag, workers):
        cfg = to_node(CoMixupConfig(grid=2, part=4, preview=False, lag=lag))
        cfg.workers = workers
        return MixupHooks(cfg, 5, RunContext(torch.device("cpu"), ROOT, tracker=None), seed=3)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten(), torch.nn.LazyLinear(5))
    batches = [batch(seed, 9, size=8)[:2] for seed in (3, 4, 5)]
    plain, lagged = hooks(False, workers=0), hooks(True, workers=-1)
    expected = [plain.transform(x, y, None, model) for x, y in batches]
    try:
        got = [lagged.transform(x, y, None, model) for x, y in batches]
        assert lagged.workers >= 1 and lagged.pool is not None
    finally:
        lagged.pool.close()
    assert torch.equal(got[0][0], batches[0][0]) and torch.equal(got[0][1], batches[0][1])
    for t in (1, 2):
        assert not torch.equal(got[t][0], batches[t - 1][0])  # mixed
        assert torch.equal(got[t][0], expected[t - 1][0]) and torch.equal(got[t][1], expected[t - 1][1])
    with pytest.raises(ConfigError, match="method.lag=true solves on the pool.s threads"):
        CoMixupConfig(lag=True, workers=0)


def test_auto_workers_one_per_partition_up_to_the_cores(monkeypatch):
    monkeypatch.setattr(cm.os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert [cm.auto_workers(b, 20) for b in (1, 20, 21, 100, 1000)] == [1, 1, 2, 5, 16]
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # torchrun's ranks on this node share the cores
    assert [cm.auto_workers(b, 20) for b in (1, 20, 21, 100, 1000)] == [1, 1, 2, 4, 4]
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "32")
    assert cm.auto_workers(1000, 20) == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")  # the rank's DataLoader processes take their cores first
    assert [cm.auto_workers(1000, 20, loaders) for loaders in (0, 8, 15, 16, 40)] == [16, 8, 1, 1, 1]


def test_auto_workers_start_a_pool_on_an_accelerator(monkeypatch):
    import runner.hardware
    from runner.configs.classify import CoMixupConfig
    from runner.hooks import mixup as mixup_training
    from runner.validate import to_node

    monkeypatch.setattr(runner.hardware, "is_accelerator", lambda device: True)  # what the ctx is asked
    monkeypatch.setattr(mixup_training, "ComixupPool", lambda workers: ("pool", workers))
    monkeypatch.setattr(cm, "usable_cores", lambda: 4)
    cfg = to_node(CoMixupConfig(part=4, preview=False))
    ctx = RunContext(torch.device("cpu"), ROOT, tracker=None, num_workers=2)
    hooks = mixup_training.MixupHooks(cfg, 5, ctx, seed=0)
    assert hooks._comixup_pool(torch.zeros(9, 3, 8, 8)) == ("pool", 2)  # 3 partitions, 4 cores less 2 loaders


def test_defaults_match_the_paper():
    import inspect

    defaults = {k: p.default for k, p in inspect.signature(comixup).parameters.items()}
    paper = dict(
        beta=0.32,
        gamma=1.0,
        eta=0.05,
        tau=0.83,
        thres_type="hard",
        omega=0.001,
        alpha=2.0,
        grid=4,
        part=20,
        max_iter=4,
        set_resolve=True,
        method="exact",  # the one deviation: each label step's exact minimum, where the authors swap
    )
    assert {k: defaults[k] for k in paper} == paper


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(grid=5), "grid=5"),
        (dict(y="soft"), "one-hot"),
        (dict(B=1), "batch of 1"),
        (dict(s="nan"), "NaN"),
        (dict(part=1), "part=1"),
        (dict(tau=-0.1), "tau=-0.1"),
        (dict(thres_type="clip"), "thres_type"),
        (dict(method="gco_expansion"), "mixed_labels=False"),
        (dict(method="bf"), "method='bf'"),
        (dict(max_iter=0), "max_iter=0"),
        (dict(tol=-1.0), "tol=-1.0"),
        (dict(alpha=np.inf), "alpha=inf"),
    ],
)
def test_bad_input_raises_a_clear_value_error(change, message):
    change = dict(change)
    x, y, s = batch(0, change.pop("B", 6))
    if change.pop("y", None):
        y = y * 0.9 + 0.02
    if change.pop("s", None):
        s[0, 0, 0] = np.nan
    with pytest.raises(ValueError, match=message):
        comixup(x, y, s, **change)


def test_a_tiny_alpha_puts_each_prior_on_one_input():
    """Gamma(1e-4) draws underflow to 0 together; lambda was 0/0 and the cut got NaN costs."""
    x, y, s = batch(0, 12)
    x_mix, y_mix, masks = comixup(x, y, s, alpha=1e-4, part=4, rng=0)
    assert torch.isfinite(x_mix).all() and torch.allclose(y_mix.sum(1), torch.ones(12))


def test_log_reports_sweeps_and_tol_ends_them():
    s_grid, A, lam = problem(1, 6, 4)
    runs = {t: comixup_masks(s_grid, A, lam, max_iter=5, tol=t, rng=1, log=True) for t in (0, 1e-6, 1e9)}
    for tol, (_, info) in runs.items():
        change = np.abs(np.diff(info["energy"]))[-1] / abs(info["energy"][-1])
        assert info["n_iter"] == len(info["energy"]) - 1 and info["err"] == pytest.approx(change)
        assert info["converged"] == (info["err"] < tol)
    assert runs[0][1]["n_iter"] == 5 and not runs[0][1]["converged"]  # tol 0 never stops early
    assert runs[1e9][1]["n_iter"] == 1 and runs[1e9][1]["converged"]  # any change is small enough
    x, y, s = batch(0, 6)
    *_, info = comixup(x, y, s, part=3, rng=0, log=True)
    assert 1 <= info["n_iter"] <= 4 and info["converged"] == (info["err"] < 1e-6)


def test_expansion_and_brute_solvers_run_one_hot():
    x, y, s = batch(0, 6, size=6)
    for method, grid in (("gco_expansion", 3), ("brute", 2)):
        _, _, masks = comixup(x, y, s, grid=grid, part=3, mixed_labels=False, method=method, rng=0)
        assert np.isin(masks.numpy(), (0, 1)).all() and np.allclose(masks.sum(-1).numpy(), 1)


# digits_canvas, its metrics, the task wiring --------------------------------------------------


def canvas_data(**overrides):
    from omegaconf import OmegaConf

    from runner.compose import compose
    from runner.data import load_data
    from runner.data.canvas import CanvasConfig

    dataset = compose(["dataset=digits_canvas"]).dataset
    return load_data(OmegaConf.merge(OmegaConf.structured(CanvasConfig), dataset, overrides), 0)


def test_digits_canvas_places_each_digit_inside_its_box():
    data = canvas_data()
    assert (len(data.train), len(data.val), len(data.test)) == (1000, 0, 1594)
    assert data.input_shape == (1, 24, 24) and data.num_classes == 10
    for split in ("train", "test"):
        x, boxes = getattr(data, split).x[:, 0].numpy(), data.meta["boxes"][split]
        assert (boxes[:, 2:] - boxes[:, :2] == 8).all() and boxes.min() >= 0 and boxes.max() <= 24
        inside = box_masks(boxes, 24)[:, 0].numpy().astype(bool)
        assert x[~inside].max() <= 0.35  # background is U(0, 0.35) noise
        assert (np.where(inside, x, 0).max((1, 2)) > 0.5).all()  # every box holds digit strokes
    # the two test copies of a digit share the label, not the position
    y = data.test.y.numpy()
    assert (y[0::2] == y[1::2]).all() and (
        data.meta["boxes"]["test"][0::2] != data.meta["boxes"]["test"][1::2]
    ).any()


def test_a_subset_of_the_canvas_keeps_each_digit_with_its_box():
    data = canvas_data(max_train=100, max_eval=50)
    for split in ("train", "test"):
        x, boxes = getattr(data, split).x[:, 0].numpy(), data.meta["boxes"][split]
        assert len(boxes) == len(x) == {"train": 100, "test": 50}[split]
        assert (np.where(box_masks(boxes, 24)[:, 0].numpy().astype(bool), x, 0).max((1, 2)) > 0.5).all()


def test_calibration_and_localisation_metrics_against_hand_computation():
    from runner.metrics import calibration_bins, expected_calibration_error

    probs = torch.tensor([[0.95, 0.05], [0.6, 0.4], [0.3, 0.7], [0.45, 0.55]])
    labels = torch.tensor([0, 1, 1, 1])
    # bins: 0.95 -> [0.9, 1) acc 1; 0.6 -> [0.6, 0.7) acc 0; 0.7 -> [0.7, 0.8) acc 1; 0.55 -> [0.5, 0.6) acc 1
    expected = (abs(1 - 0.95) + abs(0 - 0.6) + abs(1 - 0.7) + abs(1 - 0.55)) / 4
    assert expected_calibration_error(calibration_bins(probs, labels, bins=10)) == pytest.approx(expected)
    cam = np.zeros((1, 24, 24))
    cam[0, 2:10, 5:13] = 1.0
    cam[0, 20, 20] = 1.0  # a smaller separate blob: not the largest region
    assert cam_boxes(cam, 0.5).tolist() == [[2, 5, 10, 13]]
    boxes = np.array([[0, 0, 8, 8], [0, 0, 2, 2], [1, 1, 3, 3]])
    others = np.array([[4, 0, 12, 8], [5, 5, 6, 6], [1, 1, 3, 3]])  # half overlap, apart, identical
    np.testing.assert_allclose(box_iou(boxes, others), [1 / 3, 0, 1])


def test_canvas_metrics_on_a_model_that_looks_at_the_box():
    """A model whose evidence is the box itself localises perfectly and ignores the background."""
    data = canvas_data(test_fraction=0.1)  # 360 test images: one batch for predict and the CAM
    boxes = torch.from_numpy(data.meta["boxes"]["test"])

    class BoxModel(torch.nn.Module):  # cheats: reads labels and boxes of the test split
        classifier = torch.nn.Linear(1, 10, bias=False)

        def feature_maps(self, x):
            return box_masks(boxes[: len(x)].numpy(), 24).to(x.dtype)

        def forward(self, x):
            return 10 * torch.nn.functional.one_hot(data.test.y_clean[: len(x)], 10).float()

    from runner.hardware import RunContext

    model = BoxModel()
    with torch.no_grad():
        model.classifier.weight.fill_(1.0)
    metrics = canvas_metrics(model, data, RunContext(torch.device("cpu"), Path("."), None))
    assert metrics["test/err"] == 0 and metrics["test/err_bg_replace"] == 0 and metrics["test/loc_acc"] == 1
    expected_ece = 1 - torch.softmax(torch.tensor([10.0] + [0.0] * 9), 0)[0].item()
    assert metrics["test/ece10"] == pytest.approx(expected_ece, rel=1e-3)


def test_canvas_metrics_do_not_depend_on_the_batching():
    from omegaconf import OmegaConf

    from runner.hardware import RunContext
    from runner.models import build_model

    data = canvas_data(test_fraction=0.1)
    torch.manual_seed(0)
    model = build_model(OmegaConf.create({"name": "cnn", "channels": [4, 8]}), (1, 24, 24), 10)
    ctx = RunContext(torch.device("cpu"), Path("."), None)
    whole, batched = canvas_metrics(model, data, ctx), canvas_metrics(model, data, ctx, batch_size=64)
    assert whole.keys() == batched.keys() and "test/loc_acc" in whole
    assert all(batched[k] == pytest.approx(v, abs=1e-9) for k, v in whole.items())
    # the corruptions, recomputed on the whole in-memory split: partners and noise as documented
    mlp = build_model(OmegaConf.create({"name": "mlp", "hidden": []}), (1, 24, 24), 10)
    x, y, n = data.test.x, data.test.y_clean, len(data.test)
    inside = box_masks(data.meta["boxes"]["test"], 24)
    other = (np.arange(n) + np.random.default_rng(0).integers(1, n, size=n)) % n
    noise = 0.3 * torch.randn(x.shape, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        replace = (mlp(x * inside + x[other] * (1 - inside)).argmax(1) != y).double().mean().item()
        noisy = (mlp((x + noise * (1 - inside)).clamp(0, 1)).argmax(1) != y).double().mean().item()
    metrics = canvas_metrics(mlp, data, ctx, batch_size=50)
    assert metrics["test/err_bg_replace"] == pytest.approx(replace) and metrics[
        "test/err_bg_noise"
    ] == pytest.approx(noisy)
    assert "test/loc_acc" not in metrics  # no feature maps, no CAM


def test_method_configs_match_the_paper_defaults():
    from omegaconf import OmegaConf

    from runner.compose import compose

    cfg = compose(["+method=comixup"])
    paper = dict(beta=0.32, gamma=1.0, eta=0.05, tau=0.83, thres_type="hard", alpha=2.0, omega=0.001)
    paper |= dict(grid=4, part=20, n_iter=4, set_resolve=True, clean_lam=1.0, solver="exact")  # see above
    assert {k: cfg.method[k] for k in paper} == paper
    from runner.tasks.classify import METHODS

    assert METHODS["comixup"]().loss == "bce"  # the authors' loss where no preset names one
    puzzle = compose(["+method=puzzle_mix"]).method  # the PuzzleMix README, CIFAR-100
    # t_size 0: the README's 4 px at CIFAR's 32 px (tests/test_mixup.py)
    readme = dict(alpha=1.0, beta=1.2, gamma=0.5, eta=0.2, n_labels=3, neigh_size=4, t_size=0, t_eps=0.8)
    assert {k: puzzle[k] for k in readme} == readme and puzzle.clean_lam == 0 and puzzle.grid == -1
    for name in ("erm", "comixup", "input_mixup", "manifold_mixup", "cutmix", "puzzle_mix"):
        method = compose([f"+method={name}"]).method
        METHODS[name](**method)  # every key known to the schema, in range
        # the presets own the schedule
        assert "train" not in OmegaConf.load(CONF_DIR / "method" / f"{name}.yaml")
    with pytest.raises(ValueError, match="method.tau"):
        METHODS["comixup"](tau=-1.0)
    with pytest.raises(ValueError, match="method.mixed_labels"):  # caught before the run, not mid-epoch
        METHODS["comixup"](solver="gco_expansion")
    METHODS["comixup"](solver="gco_expansion", mixed_labels=False)
    with pytest.raises(ValueError, match="method.grid"):
        METHODS["puzzle_mix"](grid=1)
    with pytest.raises(ValueError, match="method.loss"):
        METHODS["erm"](loss="mse")


TABLE_ROWS = ["erm", "input_mixup", "manifold_mixup", "cutmix", "puzzle_mix", "comixup"]
PAPER_TRAIN = dict(epochs=300, batch_size=100, optimizer="sgd", lr=0.2, momentum=0.9, nesterov=True)
PAPER_TRAIN |= dict(weight_decay=1e-4, schedule="step", milestones=[100, 200], gamma=0.1)


@pytest.mark.parametrize("net", quick_first(["preactresnet18", "wrn16_8", "resnext29"], lambda _: "Table 1"))
def test_table1_rows_compose_with_one_train_block_and_loss(net):
    from runner.compose import compose
    from runner.validate import validate

    trains = []
    for method in TABLE_ROWS:
        for order in (
            [f"+method={method}", f"+experiment=comixup_cifar100_{net}"],
            [f"+experiment=comixup_cifar100_{net}", f"+method={method}"],
        ):
            checked = validate(compose(order))
            assert checked["method"].loss == "bce" and checked["method"].name == method
            assert checked["dataset"].crop_pad == 2 and checked["dataset"].augment == "crop_flip"
            assert checked["model"].name == net and checked["dataset"].name == "cifar100"
            trains.append(checked["train"])
    assert all(t == trains[0] for t in trains)  # every row, either order: the same schedule
    assert {k: getattr(trains[0], k) for k in PAPER_TRAIN} == PAPER_TRAIN


def test_tiny_imagenet_and_imagenet_presets_compose_for_every_row():
    from runner.compose import compose
    from runner.validate import validate

    for method in TABLE_ROWS:
        tiny = validate(compose([f"+method={method}", "+experiment=comixup_tiny_imagenet"]))
        assert tiny["model"].name == "preactresnet18" and tiny["model"].stem_stride == 2
        assert (tiny["train"].epochs, tiny["train"].milestones, tiny["train"].lr) == (1200, [600, 900], 0.2)
        assert tiny["dataset"].name == "tiny_imagenet" and tiny["method"].loss == "bce"
        # the PuzzleMix README's Tiny-ImageNet commands: baselines at alpha 0.2, Puzzle Mix with clean_lam 1
        if method in ("input_mixup", "manifold_mixup", "cutmix"):
            assert tiny["method"].alpha == 0.2
        if method == "puzzle_mix":
            assert (tiny["method"].clean_lam, tiny["method"].alpha, tiny["method"].t_size) == (1.0, 1.0, 0)
        imagenet = validate(compose([f"+method={method}", "+experiment=comixup_imagenet"]))
        assert imagenet["model"].name == "resnet50" and imagenet["dataset"].name == "imagenet"
        assert imagenet["train"].epochs == 100 and imagenet["method"].loss == "ce"  # the ImageNet code's
        if method == "puzzle_mix":  # the ImageNet code's: transport on the cut's grid, not 56 x 56 cells
            assert (imagenet["method"].t_size, imagenet["method"].beta) == (-1, 1.5)


def test_a_command_line_value_wins_over_the_tiny_presets_baseline_setting():
    from runner.compose import compose
    from runner.validate import validate

    args = ["+method=cutmix", "+experiment=comixup_tiny_imagenet", "method.alpha=0.5"]
    assert validate(compose(args))["method"].alpha == 0.5


def test_erm_with_bce_trains_on_the_authors_loss():
    from runner.configs import hooks_factory
    from runner.hooks.mixup import mixed_loss
    from runner.tasks.classify import METHODS

    erm_hooks = hooks_factory("erm")  # the factory ERM's registration declares
    assert erm_hooks(METHODS["erm"](), None, None) is None  # plain soft CE: fit's own loss
    hooks = erm_hooks(METHODS["erm"](loss="bce"), None, None)
    model = torch.nn.Linear(3, 4)
    x, y = torch.randn(5, 3), torch.eye(4)[[0, 1, 2, 3, 0]]
    p = model(x).softmax(1)
    bce = torch.nn.functional.binary_cross_entropy(p, y)
    assert hooks.loss(model, x, y, None, 0).item() == pytest.approx(bce.item(), rel=1e-6)
    assert mixed_loss(model(x), y, "bce").item() == pytest.approx(bce.item(), rel=1e-6)


def mix_all(x, y, s):
    """Every mix step of the table on one batch, each with its own seeded rng."""
    from runner.methods.mixup import cutmix, input_mixup, puzzle_mix

    return {
        "comixup": comixup(x, y, s, rng=0)[:2],
        "puzzle_mix": puzzle_mix(x, y, s, grid=4, t_size=2, rng=0),
        "input_mixup": input_mixup(x, y, rng=0),
        "cutmix": cutmix(x, y, rng=0),
    }


def test_mix_steps_stay_on_the_data_device():
    rng = np.random.default_rng(0)
    x = torch.from_numpy(rng.random((8, 3, 16, 16))).float()
    y = torch.eye(8)
    s = torch.from_numpy(blob_saliency(rng, 8)).float()
    for name, (x_mix, y_mix) in mix_all(x, y, s).items():
        assert x_mix.device == x.device and y_mix.device == x.device, name
        assert x_mix.dtype == x.dtype and torch.allclose(y_mix.sum(1), torch.ones(8)), name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_mix_steps_on_cuda_match_the_cpu():
    rng = np.random.default_rng(0)
    x = torch.from_numpy(rng.random((8, 3, 16, 16))).float()
    y = torch.eye(8)
    s = torch.from_numpy(blob_saliency(rng, 8)).float()
    cpu = mix_all(x, y, s)
    cuda = mix_all(x.cuda(), y.cuda(), s.cuda())
    for name in cpu:
        assert cuda[name][0].device.type == "cuda" and cuda[name][1].device.type == "cuda", name
        assert torch.allclose(cuda[name][0].cpu(), cpu[name][0], atol=1e-5), name
        assert torch.allclose(cuda[name][1].cpu(), cpu[name][1], atol=1e-5), name


# the device path: what the host reads and sends, against the host path before it ----------------------


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("size, window", [(16, 8), (24, 8), (6, 8), (13, 4)])
def test_salient_boxes_found_on_the_device_are_the_host_path_ones(size, window, dtype):
    rng = np.random.default_rng(size)
    s = blob_saliency(rng, 12, size).astype(dtype) + 0.01 * rng.random((12, size, size)).astype(dtype)
    expected = host_path().old_salient_locations(s.astype(np.float64), window)
    assert np.array_equal(salient_locations(torch.from_numpy(s), window).numpy(), expected)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(
    "B, options",
    [(23, dict(grid=4, part=10)), (40, dict(grid=2, part=20)), (30, dict(grid=-1, part=8)),
     (12, dict(grid=3, part=5, mixed_labels=False)), (20, dict(omega=0.3, thres_type="soft"))],
)  # fmt: skip
def test_device_path_mixes_the_batch_the_host_path_did(B, options, dtype):
    x, y, s = batch(B, B)
    s = torch.from_numpy(s).to(dtype)
    old = host_path().old_comixup(x, y, s, rng=B, **options)
    new = comixup(x, y, s, rng=B, **options)
    for name, a, b in zip(("x_mixed", "y_mixed", "masks"), old, new):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    x_mix, y_mix = comixup(x, y, s, rng=B, with_masks=False, **options)
    assert torch.equal(x_mix, new[0]) and torch.equal(y_mix, new[1])


def test_every_mix_step_waits_for_the_device_at_most_once():
    """On a stand-in device (`runner.device_tracking`): Co-Mixup reads its batch summary, Puzzle Mix its
    costs, the pair mixups nothing; no step mixes device and host tensors or reads a device array."""
    from runner.methods.mixup import cutmix, input_mixup, manifold_mixup, puzzle_mix

    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten())
    with DeviceTracker() as tracker:
        x = torch.rand(8, 3, 16, 16, device=STAND_IN)
        y = torch.eye(8, device=STAND_IN)
        s = torch.rand(8, 16, 16, device=STAND_IN)
        steps = {
            "comixup": lambda: comixup(x, y, s, rng=0),
            "comixup without masks": lambda: comixup(x, y, s, rng=0, with_masks=False),
            "puzzle_mix": lambda: puzzle_mix(x, y, s, grid=4, t_size=2, mean=(0.5,) * 3, std=(0.2,) * 3),
            "input_mixup": lambda: input_mixup(x, y, rng=0),
            "cutmix": lambda: cutmix(x, y, rng=0),
            "manifold_mixup": lambda: manifold_mixup(model, x, y, layers=[model[0]], rng=1),
        }
        for name, step in steps.items():
            with tracker.in_phase(name):
                step()
    reads = {"comixup": 1, "comixup without masks": 1, "puzzle_mix": 1}
    for name in steps:
        counts = tracker.counts[name]
        assert counts["sync"] <= reads.get(name, 0), (name, tracker.report()["sites"])
        assert counts["mix"] == counts["numpy"] == 0, (name, tracker.report()["sites"])


@pytest.mark.slow  # a subprocess importing torch and Hydra: 15 s on a quiet machine, a minute on a busy one
def test_cli_one_epoch_of_comixup_on_digits_canvas(tmp_path):
    import json
    import subprocess
    import sys

    args = ["+method=comixup", "+experiment=comixup_digits_canvas", "train.epochs=1"]
    args += ["dataset.test_fraction=0.9", f"hydra.run.dir={tmp_path}"]
    command = [sys.executable, "-m", "runner.cli", *args]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    for key in (
        "test/err",
        "test/ece",
        "test/ece10",
        "test/loc_acc",
        "test/err_bg_replace",
        "test/err_bg_noise",
    ):
        assert 0 <= summary[key] <= 1
    assert (tmp_path / "mixup_preview.png").stat().st_size > 0


def test_search_selects_on_a_validation_metric_or_refuses_in_one_line():
    import runner.tasks.classify
    import runner.tasks.hashing
    from runner.checks import ConfigError
    from runner.compose import compose, launch_overrides, objective

    search = ["-m", "+method=comixup", "+experiment=comixup_digits_canvas", "+sweep=comixup"]
    with pytest.raises(ConfigError, match="selects on val/acc, never on test/acc.*dataset.val_fraction=0.1"):
        launch_overrides(search)
    assert "hydra.sweeper.direction=maximize" in launch_overrides([*search, "dataset.val_fraction=0.1"])
    cfg = compose(["+method=comixup", "+experiment=comixup_digits_canvas", "dataset.val_fraction=0.1"])
    assert objective(runner.tasks.classify.TASK, cfg) == "val/acc"
    hashing = ["-m", "+experiment=hier_hash_synthetic", "+sweep=hier_hash"]
    with pytest.raises(ConfigError, match="selects on val/p@1.*dataset.val_per_class=10"):
        launch_overrides(hashing)
    cfg = compose(["+experiment=hier_hash_synthetic", "dataset.val_per_class=10"])
    assert objective(runner.tasks.hashing.TASK, cfg) == "val/p@1"


def test_docstring_examples_run():
    import doctest

    import runner.methods.comixup

    for module in (runner.methods.comixup,):
        result = doctest.testmod(module)
        assert result.attempted and not result.failed, module.__name__
