"""Mixup baselines: mixing identities recovered from the targets, Puzzle Mix's cut and transport
against brute force and POT."""

import numpy as np
import ot
import pytest
import torch

from runner.methods.comixup import grid_cut
from runner.methods.mixup import (
    cutmix,
    default_mixup_layers,
    input_mixup,
    manifold_mixup,
    none,
    puzzle_mix,
    transport_blocks,
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


def test_transport_is_an_optimal_assignment():
    rng = np.random.default_rng(1)
    g = 3
    n = g * g
    for _ in range(10):
        s = rng.random((g, g)) ** 3
        s /= s.sum()
        visible = rng.choice([0.0, 0.5, 1.0], size=(g, g))
        source = transport_blocks(s, visible, t_eps=0.8)
        assert sorted(source) == list(range(n))
        pos = np.stack(np.unravel_index(np.arange(n), (g, g)), 1)
        dist = np.abs(pos[:, None] - pos[None]).sum(-1) / (2 * (g - 1))
        cost = 0.8 * dist / n - s.reshape(n, 1) * visible.reshape(1, n)
        plan = ot.emd(np.ones(n) / n, np.ones(n) / n, cost)  # exact OT, uniform marginals
        assert cost[source, np.arange(n)].sum() / n == pytest.approx((plan * cost).sum(), abs=1e-12)


def test_transport_moves_salient_blocks_into_view_and_leaves_flat_images():
    s = np.zeros((4, 4))
    s[0, 0] = 1.0
    visible = np.zeros((4, 4))
    visible[3, 3] = 1.0
    source = transport_blocks(s, visible)
    assert source[15] == 0  # the salient corner block moves to the visible corner
    assert np.array_equal(transport_blocks(np.full((4, 4), 1 / 16), np.ones((4, 4))), np.arange(16))


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
            match = (blends - out[i, k]).abs().amax(-1) < 1e-9  # (3, 16, 16)
            if not transport:
                match = match[:, k, k]
            assert match.any()
            share.append(levels.ravel()[match.reshape(3, -1).any(1)][0].item())
        assert 1 - np.mean(share) == pytest.approx(w[i].item())


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
    with pytest.raises(ValueError, match="solver='bf'"):
        puzzle_mix(x, y, np.ones((8, 8, 8)), grid=2, solver="bf")
