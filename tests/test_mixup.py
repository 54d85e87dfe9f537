"""Mixup baselines: mixing identities recovered from the targets; Puzzle Mix's energy terms and
transport against hand-computed values, its cut against brute force."""

import itertools

import numpy as np
import pytest
import torch

from runner.methods.comixup import grid_cut
from runner.methods.mixup import (
    _mix_targets,
    cutmix,
    default_mixup_layers,
    input_mixup,
    manifold_mixup,
    mix_hidden,
    mix_pairs,
    none,
    paste_box,
    puzzle_costs,
    puzzle_mix,
    transport_plan,
)


def distinct_batch(seed, B=8, C=2, size=8):
    """Each sample its own class, so y~ reveals the partner and the mixing weight."""
    rng = np.random.default_rng(seed)
    x = torch.from_numpy(rng.random((B, C, size, size)))
    return x, torch.eye(B, dtype=torch.float64)


def partner_and_weight(y_mixed):
    """(perm, w) with y~_i = w_i e_i + (1 - w_i) e_perm(i); a self-pair has w = 1."""
    own = torch.diagonal(y_mixed)
    rest = y_mixed - torch.diag(own)
    perm = torch.where(rest.max(1).values > 0, rest.argmax(1), torch.arange(len(y_mixed)))
    return perm, own


def test_none_is_identity():
    x, y = distinct_batch(0)
    x2, y2 = none(x, y)
    assert x2 is x and y2 is y


@pytest.mark.parametrize("seed", range(3))
def test_input_mixup_is_a_convex_combination_with_the_label_weight(seed):
    x, y = distinct_batch(seed)
    x_mix, y_mix = input_mixup(x, y, alpha=1.0, rng=seed)
    perm, w = partner_and_weight(y_mix)
    assert torch.allclose(y_mix.sum(1), torch.ones(len(x), dtype=y.dtype))
    paired = perm != torch.arange(len(x))
    lam = w[paired][0]
    assert torch.allclose(w[paired], lam)  # one lambda for the batch
    assert torch.allclose(x_mix, lam * x + (1 - lam) * x[perm])


@pytest.mark.parametrize("seed", range(5))
def test_cutmix_pastes_one_box_whose_area_is_the_label_weight(seed):
    x, y = distinct_batch(seed, size=12)
    x_mix, y_mix = cutmix(x, y, alpha=1.0, rng=seed)
    perm, w = partner_and_weight(y_mix)
    changed = (x_mix != x).any(1)  # (B, H, W) pixels taken from the partner
    for i in range(len(x)):
        if perm[i] == i:
            continue
        rows, cols = np.nonzero(changed[i].numpy())
        area = 1 - w[i].item()
        assert len(rows) == pytest.approx(area * 144, abs=1e-9)
        if len(rows):  # a full rectangle, equal to the partner there
            r0, r1, c0, c1 = rows.min(), rows.max() + 1, cols.min(), cols.max() + 1
            assert (r1 - r0) * (c1 - c0) == len(rows)
            assert torch.equal(x_mix[i, :, r0:r1, c0:c1], x[perm[i], :, r0:r1, c0:c1])


def test_manifold_mixup_mixes_the_hidden_state_of_the_chosen_layer():
    torch.manual_seed(0)
    first, act, second = torch.nn.Linear(6, 5).double(), torch.nn.Tanh(), torch.nn.Linear(5, 4).double()
    model = torch.nn.Sequential(first, act, second)
    x = torch.rand(4, 6, dtype=torch.float64)
    y = torch.eye(4, dtype=torch.float64)
    seen = set()
    for seed in range(12):
        logits, y_mix = manifold_mixup(model, x, y, alpha=1.0, layers=[act], rng=seed)
        perm, w = partner_and_weight(y_mix)
        lam = w[perm != torch.arange(4)][0]
        at_input = model(lam * x + (1 - lam) * x[perm])
        h = torch.tanh(first(x))
        at_hidden = second(lam * h + (1 - lam) * h[perm])
        hit = [torch.allclose(logits, at_input), torch.allclose(logits, at_hidden)]
        assert sum(hit) == 1
        seen.add(hit.index(True))
    assert seen == {0, 1}  # both the input and the hidden layer get chosen
    assert torch.allclose(model(x), second(torch.tanh(first(x))))  # the hook is gone


@pytest.mark.parametrize("seed", range(5))
def test_the_draws_given_as_tensors_mix_to_the_bits_of_the_host_numbers(seed):
    # what a captured step runs (`MixupHooks.draw`: a float64 ratio and share, partners, a box and a site as
    # tensors; a masked paste; a where at every site) against the host-number code it replaced (slices,
    # one hook at the drawn site): float32 values and gradients equal to the bit, so the CPU studies stay
    rng = np.random.default_rng(seed)
    x = torch.randn(8, 3, 6, 6, generator=torch.Generator().manual_seed(seed))
    y = torch.eye(8)[rng.integers(0, 8, 8)]
    lam, perm = float(rng.beta(1, 1)), torch.from_numpy(rng.permutation(8))
    lam_t = torch.tensor(lam, dtype=torch.float64)
    mixed, y_mixed = mix_pairs(x, y, lam_t, perm)
    assert torch.equal(mixed, lam * x + (1 - lam) * x[perm])
    assert torch.equal(y_mixed, _mix_targets(y, lam, perm))
    r0, r1 = sorted(rng.integers(0, 7, 2))
    c0, c1 = sorted(rng.integers(0, 7, 2))
    keep = 1.0 - (r1 - r0) * (c1 - c0) / 36
    pasted = x.clone()
    pasted[..., r0:r1, c0:c1] = x[perm, ..., r0:r1, c0:c1]
    box, keep_t = torch.tensor([r0, r1, c0, c1]), torch.tensor(keep, dtype=torch.float64)
    assert torch.equal(paste_box(x, y, box, keep_t, perm)[0], pasted)
    assert torch.equal(paste_box(x, y, box, keep_t, perm)[1], _mix_targets(y, keep, perm))
    nn = torch.nn
    with torch.random.fork_rng():  # the later tests' draws from the global stream stay as they were
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Flatten(), nn.Linear(108, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                              nn.Linear(16, 8))  # fmt: skip
    layers = [model[2], model[4]]

    def logits_and_grads(forward, site):
        model.zero_grad()
        logits = forward(site)
        logits.square().sum().backward()
        return [logits] + [p.grad for p in model.parameters()]

    def one_hook_at(site):
        if site == 0:
            return model(lam * x + (1 - lam) * x[perm])
        handle = layers[site - 1].register_forward_hook(lambda m, i, h: lam * h + (1 - lam) * h[perm])
        try:
            return model(x)
        finally:
            handle.remove()

    def at_every_site(site):
        return mix_hidden(model, x, y, lam_t, perm, torch.tensor(site), layers)[0]

    for site in range(3):
        expected, got = logits_and_grads(one_hook_at, site), logits_and_grads(at_every_site, site)
        assert all(torch.equal(a, b) for a, b in zip(expected, got)), site


def test_default_mixup_layers_end_the_first_two_stages():
    from omegaconf import OmegaConf

    from runner.models import build_model

    def model(**cfg):
        return build_model(OmegaConf.create(cfg), (3, 32, 32), 10)

    cnn = model(name="cnn", channels=[4, 4, 4])
    pools = [m for m in cnn.body if isinstance(m, torch.nn.MaxPool2d)]
    assert len(pools) == 2 and default_mixup_layers(cnn) == pools  # after blocks 1 and 2
    nin = model(name="nin")
    nin_pools = [m for m in nin.body if isinstance(m, torch.nn.MaxPool2d | torch.nn.AvgPool2d)]
    assert default_mixup_layers(nin) == nin_pools
    resnet = model(name="preactresnet18")
    assert default_mixup_layers(resnet) == list(resnet.stages)[:2]
    resnext = model(name="resnext29")  # 3 stages x 3 blocks in one sequence
    assert default_mixup_layers(resnext) == [resnext.blocks[2], resnext.blocks[5]]
    mlp = model(name="mlp", hidden=[8, 8, 8], dropout=0.0)
    relus = [m for m in mlp.body if isinstance(m, torch.nn.ReLU)]
    assert default_mixup_layers(mlp) == relus[:2]


def edge_energy(labels, unary, pairwise, weights):
    g = unary.shape[0]
    lab = labels.reshape(g, g)
    edges = np.concatenate([pairwise[lab[:-1], lab[1:]].ravel(), pairwise[lab[:, :-1], lab[:, 1:]].ravel()])
    return unary.reshape(g * g, -1)[np.arange(g * g), lab.ravel()].sum() + (weights * edges).sum()


def test_per_edge_weighted_cut_matches_brute_force():
    rng = np.random.default_rng(0)
    levels = np.array([0.0, 0.5, 1.0])
    pairwise = np.abs(levels[:, None] - levels[None, :])
    exact = 0
    for trial in range(30):
        L = 2 if trial < 15 else 3
        unary = rng.normal(size=(3, 3, L))
        weights = rng.uniform(0, 2, size=12)
        pw = pairwise[:L, :L] * (2 if L == 2 else 1)
        e_bf = edge_energy(grid_cut(unary, pw, weights[None], "brute"), unary, pw, weights)
        e_gc = edge_energy(grid_cut(unary, pw, weights[None], "gco_expansion"), unary, pw, weights)
        if L == 2:
            assert e_gc == pytest.approx(e_bf, abs=1e-5)
        assert e_gc >= e_bf - 1e-5
        exact += abs(e_gc - e_bf) < 1e-5
    assert exact >= 25


def test_puzzle_costs_on_a_2x2_grid_by_hand():
    # 1-channel 2x2 images, one pixel per cell (so the seam pools nothing): x = O, partner = P
    O = torch.tensor([[0.0, 1.0], [1.0, 1.0]]).reshape(1, 1, 2, 2)
    P = torch.tensor([[1.0, 1.0], [0.0, 0.0]]).reshape(1, 1, 2, 2)
    s_own = torch.tensor([[[0.4, 0.3], [0.2, 0.1]]])
    s_partner = torch.tensor([[[0.1, 0.1], [0.1, 0.7]]])
    unary, weights, pairwise = puzzle_costs(s_own, s_partner, O, P, lam=0.3, beta=1.2, gamma=0.5, eta=0.2)
    # beta' = 1.2 / (16 * 2) = 0.0375, c = beta' gamma = 0.01875. Seams |upper - lower| (a above b):
    #   vertical, columns 0, 1:  d(O,O) = [1, 0]  d(O,P) = [0, 1]  d(P,O) = [0, 0]  d(P,P) = [1, 1]
    #   horizontal, rows 0, 1:   d(O,O) = [1, 0]  d(O,P) = [1, 1]  d(P,O) = [0, 1]  d(P,P) = [0, 0]
    # residual (d(O,P) + d(P,O) - d(O,O) - d(P,P)) / 2: vertical [-1, 0], horizontal [0, 1]
    assert weights == pytest.approx(np.array([[0.0375 - 0.01875, 0.0375, 0.0375, 0.0375 + 0.01875]]))
    # data terms (sum over the cell's edges of the mean over the other side), times c:
    #   keeping O: cells (0,0) .5 + 1, (0,1) .5 + .5, (1,0) .5 + .5, (1,1) 0 + .5
    #   keeping P: cells (0,0) .5 + 0, (0,1) .5 + .5, (1,0) .5 + .5, (1,1) 1 + .5
    keep_o = np.array([0.1, 0.1, 0.1, 0.7]) + 0.01875 * np.array([1.5, 1.0, 1.0, 0.5])
    keep_p = np.array([0.4, 0.3, 0.2, 0.1]) + 0.01875 * np.array([0.5, 1.0, 1.0, 1.5])
    # prior: partner weight z ~ Binom(2, 1 - lam) / 2: P = [.09, .42, .49], cost -eta / n log P
    prior = -0.2 / 4 * np.log(np.array([0.09, 0.42, 0.49]) + 1e-8)
    z = np.array([0.0, 0.5, 1.0])
    expected = (1 - z) * keep_o[:, None] + z * keep_p[:, None] + prior
    assert unary[0] == pytest.approx(expected)
    assert pairwise == pytest.approx(np.array([[0, 0.25, 1], [0.25, 0, 0.25], [1, 0.25, 0]]))


def test_puzzle_costs_of_binary_masks_are_the_seam_energy_up_to_a_constant():
    rng = np.random.default_rng(0)
    images = torch.Generator().manual_seed(1)  # its own: the global stream's state depends on earlier tests
    own, partner = (torch.rand(1, 3, 8, 8, generator=images) for _ in range(2))
    s_own, s_partner = (torch.from_numpy(rng.dirichlet(np.ones(4))).reshape(1, 2, 2) for _ in range(2))
    unary, weights, _ = puzzle_costs(s_own, s_partner, own, partner, lam=0.5, eta=0.0, neigh_size=2)
    c = 1.2 / 32 * 0.5
    pooled = {1: torch.nn.functional.avg_pool2d(own, 2)[0], 0: torch.nn.functional.avg_pool2d(partner, 2)[0]}
    edges = [((0, 0), (1, 0)), ((0, 1), (1, 1)), ((0, 0), (0, 1)), ((1, 0), (1, 1))]

    def seam(a, b, edge):  # |last pooled row / column of the upper cell - first of the lower cell|
        (r0, c0), (r1, c1) = edge
        if r1 > r0:
            return (
                (pooled[a][:, 2 * r0 + 1, 2 * c0 : 2 * c0 + 2] - pooled[b][:, 2 * r1, 2 * c1 : 2 * c1 + 2])
                .abs()
                .mean()
            )
        return (
            (pooled[a][:, 2 * r0 : 2 * r0 + 2, 2 * c0 + 1] - pooled[b][:, 2 * r1 : 2 * r1 + 2, 2 * c1])
            .abs()
            .mean()
        )

    energies, truth = [], []
    for keep in itertools.product((0, 1), repeat=4):  # 1: the cell keeps x
        labels = [0 if k else 2 for k in keep]
        e = sum(unary[0, i, lab] for i, lab in enumerate(labels))
        e += sum(w * (keep[2 * a[0] + a[1]] != keep[2 * b[0] + b[1]]) for w, (a, b) in zip(weights[0], edges))
        energies.append(e)
        dropped = sum((s_partner if k else s_own).reshape(-1)[i].item() for i, k in enumerate(keep))
        cuts = sum(1.2 / 32 * (keep[2 * a[0] + a[1]] != keep[2 * b[0] + b[1]]) for a, b in edges)
        seams = sum(c * seam(keep[2 * a[0] + a[1]], keep[2 * b[0] + b[1]], (a, b)).item() for a, b in edges)
        truth.append(dropped + cuts + seams)
    offset = np.array(energies) - np.array(truth)
    # puzzle_costs pools and takes the seams in float32 (the images' dtype, as the authors): each of the <= 16
    # seam terms in a mask's energy is <= beta' gamma = 0.019 with a relative error of a few float32 ulps
    # (6e-8 each), under 4e-9, so the offsets agree to 1e-7 (1e-9 held only for some images)
    assert offset == pytest.approx(np.full(16, offset[0]), abs=1e-7)


def test_transport_plan_by_hand_on_a_2x2_grid():
    # cells 1 and 3 (right column) visible; t_eps = 0.3, squared distances 1 (adjacent), 2 (diagonal)
    mask = torch.tensor([[[0.0, 1.0], [0.0, 1.0]]])
    s = torch.tensor([0.6, 0.2, 0.15, 0.05]).reshape(1, 2, 2)
    plan = transport_plan(mask, s, t_eps=0.3)
    # round 1: blocks 0, 1 -> cell 1 (-.3, -.2), 2 -> 2 (0), 3 -> 3 (-.05); 0 wins cell 1; cell 2's
    # claimant ties the non-claimants' 0 and loses (the authors' argmin over plan * cost), 1 and 2 pay +1;
    # round 2: 0 -> 1, 1 -> 3 (.1), 2 -> 3 (.15), 3 -> 3 (-.05): 3 wins. Cells 0 and 2 (hidden) stay empty.
    expected = torch.zeros(1, 4, 4)
    expected[0, 0, 1] = expected[0, 3, 3] = 1
    assert torch.equal(plan, expected)
    identity = transport_plan(torch.ones(1, 3, 3), torch.full((1, 3, 3), 1 / 9))
    assert torch.equal(identity[0], torch.eye(9))


def test_puzzle_mix_without_smoothing_takes_the_more_salient_image_per_cell():
    x, y = distinct_batch(2, B=6, size=8)
    rng = np.random.default_rng(3)
    s = rng.random((6, 8, 8)) ** 4
    x_mix, y_mix = puzzle_mix(x, y, s, beta=0.0, gamma=0.0, eta=0.0, grid=4, transport=False, rng=0)
    perm, w = partner_and_weight(y_mix)
    pooled = s.reshape(6, 4, 2, 4, 2).mean((2, 4))
    for i in range(6):
        take_partner = pooled[perm[i]] > pooled[i]
        expected = torch.where(torch.from_numpy(take_partner.repeat(2, 0).repeat(2, 1)), x[perm[i]], x[i])
        assert torch.allclose(x_mix[i], expected)
        assert w[i].item() == pytest.approx(1 - take_partner.mean()) or perm[i] == i


@pytest.mark.parametrize("transport", [False, True])
def test_puzzle_mix_cells_are_level_blends_of_blocks_and_labels_equal_area(transport):
    x, y = distinct_batch(4, B=8, size=8)
    rng = np.random.default_rng(5)
    yy, xx = np.mgrid[:8, :8]
    s = np.stack([np.exp(-((yy - a) ** 2 + (xx - b) ** 2) / 4.0) for a, b in rng.uniform(0, 8, (8, 2))])
    x_mix, y_mix = puzzle_mix(x, y, s, grid=4, transport=transport, rng=1)
    perm, w = partner_and_weight(y_mix)
    assert torch.allclose(y_mix.sum(1), torch.ones(8, dtype=y.dtype))
    blocks = x.reshape(8, 2, 4, 2, 4, 2).permute(0, 2, 4, 1, 3, 5).reshape(8, 16, -1)
    blocks = torch.cat([blocks, torch.zeros_like(blocks[:, :1])], 1)  # transport may leave a cell empty
    out = x_mix.reshape(8, 2, 4, 2, 4, 2).permute(0, 2, 4, 1, 3, 5).reshape(8, 16, -1)
    for i in range(8):
        j = perm[i].item()
        if j == i:
            continue
        levels = torch.tensor([0.0, 0.5, 1.0], dtype=x.dtype)[:, None, None, None]
        # every (z, block a of x_i, block b of x_j) blend; without transport only a = b = k is allowed
        blends = (1 - levels) * blocks[i][None, :, None] + levels * blocks[j][None, None, :]
        share = []
        for k in range(16):
            match = (blends - out[i, k]).abs().amax(-1) < 1e-9  # (3, 17, 17)
            if not transport:
                match = match[:, k, k]
            assert match.any()
            share.append(levels.ravel()[match.reshape(3, -1).any(1)][-1].item())
        assert 1 - np.mean(share) == pytest.approx(w[i].item())


def test_puzzle_mix_transport_grid_and_adversarial_noise():
    x, y = distinct_batch(6, B=6, size=8)
    s = np.random.default_rng(7).random((6, 8, 8))
    noise = torch.full_like(x, 0.25)
    mixed, y_mix = puzzle_mix(
        x, y, s, grid=2, n_labels=2, noise=noise, adv_mask=(True, False), transport=False, rng=2, eta=0.0
    )
    perm, w = partner_and_weight(y_mix)
    own = (x + 0.25).clamp(0, 1)  # x is raw here (no mean / std): its noise is added and clipped
    for i in range(6):
        keep = torch.isclose(mixed[i], own[i]).all(0)
        assert keep.float().mean().item() == pytest.approx(w[i].item())
    mixed, y_mix = puzzle_mix(x, y, s, grid=2, t_size=2, rng=3)  # transport on a 4x4 grid of 2-px cells
    assert mixed.shape == x.shape and torch.allclose(y_mix.sum(1), torch.ones(6, dtype=y.dtype))
    with pytest.raises(ValueError, match="t_size=3"):
        puzzle_mix(x, y, s, grid=2, t_size=3)


@pytest.mark.parametrize("size, as_authors", [(32, 4), (64, -1)])
def test_puzzle_mix_t_size_0_transports_as_the_authors_at_each_image_side(size, as_authors):
    """0: 4-px cells on CIFAR's 32 px (the README's CIFAR command), the cut's grid on 64 px (its
    Tiny-ImageNet command) and above, where 4-px cells would be a 16 x 16 or finer transport grid."""
    x, y = distinct_batch(5, B=4, size=size)
    s = np.random.default_rng(5).random((4, size, size)) ** 8  # peaked, and free moves: blocks travel
    mixes = {t: puzzle_mix(x, y, s, grid=4, t_size=t, t_eps=0.0, rng=1)[0] for t in (0, 4, -1)}
    assert torch.equal(mixes[0], mixes[as_authors])
    assert not torch.equal(mixes[4], mixes[-1])  # the two rules differ on these images


def test_numpy_in_numpy_out_and_bad_input():
    x, y = distinct_batch(0)
    x_mix, y_mix = input_mixup(x.numpy(), y.numpy(), rng=0)
    assert isinstance(x_mix, np.ndarray) and isinstance(y_mix, np.ndarray)
    with pytest.raises(ValueError, match="batch of 1"):
        cutmix(x[:1], y[:1])
    with pytest.raises(ValueError, match="alpha=0"):
        input_mixup(x, y, alpha=0)
    with pytest.raises(ValueError, match="grid=3"):
        puzzle_mix(x, y, np.ones((8, 8, 8)), grid=3)
    with pytest.raises(ValueError, match="saliency_maps"):
        puzzle_mix(x, y, np.full((8, 8, 8), np.nan), grid=2)
    with pytest.raises(ValueError, match="method='bf'"):
        puzzle_mix(x, y, np.ones((8, 8, 8)), grid=2, method="bf")
    with pytest.raises(ValueError, match="needs n_labels=2"):  # gco would abort the process
        puzzle_mix(x, y, np.ones((8, 8, 8)), grid=2, method="gco_expansion")
    with pytest.raises(ValueError, match="8x16; puzzle_mix needs square"):
        puzzle_mix(torch.rand(8, 3, 8, 16), y, np.ones((8, 8, 16)), grid=4)
    with pytest.raises(ValueError, match="alpha=inf: must be a finite number"):
        input_mixup(x, y, alpha=np.inf)


def test_integer_one_hot_targets_mix_as_floats():
    """F.one_hot gives int64: in that dtype every label weight truncated to 0 or 1."""
    x, y = distinct_batch(0)
    for mix in (input_mixup, cutmix):
        _, y_float = mix(x, y, rng=3)
        _, y_int = mix(x, y.long(), rng=3)
        assert y_int.dtype == torch.float32  # 1 - w in float32 may round once more than in float64:
        torch.testing.assert_close(y_int, y_float.float(), rtol=2**-23, atol=0)
    with pytest.raises(ValueError, match="method='bf'"):
        puzzle_mix(x, y, np.ones((8, 8, 8)), grid=2, method="bf")


def test_puzzle_mix_hooks_adversarial_option_perturbs_within_the_ball():
    from pathlib import Path

    from runner.configs.classify import PuzzleMixConfig
    from runner.hardware import RunContext
    from runner.hooks.mixup import MixupHooks
    from runner.validate import to_node

    cfg = to_node(PuzzleMixConfig(adv_p=1.0, adv_eps=10.0, grid=2, clean_lam=1.0, preview=False))
    mean, std = (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)
    ctx = RunContext(torch.device("cpu"), Path(__file__).parent, tracker=None)
    hooks = MixupHooks(cfg, 4, ctx, seed=0, normalize=(mean, std))
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten()
    )
    raw = torch.rand(6, 3, 8, 8)
    x = (raw - 0.5) / 0.25
    y = torch.eye(4)[[0, 1, 2, 3, 0, 1]]
    x_mix, y_mix = hooks.transform(x, y, None, model)
    noise, masks = hooks._adv
    assert masks == (True, True) and noise.abs().max() <= 10 / 255 + 1e-6 and noise.abs().max() > 0
    assert torch.allclose(y_mix.sum(1), torch.ones(6))
    assert hooks.loss(
        model, x_mix, y_mix, None, 0
    ).requires_grad  # the mixed loss plus the kept clean gradient


def test_docstring_examples_run():
    import doctest

    import runner.methods.mixup

    for module in (runner.methods.mixup,):
        result = doctest.testmod(module)
        assert result.attempted and not result.failed, module.__name__
