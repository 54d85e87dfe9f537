"""The mixup baselines Co-Mixup is compared with, as batch transforms of the same call shape.

Every transform takes a batch x (B, C, H, W) with one-hot (or soft) targets y (B, K) and returns the
mixed batch and its targets, pairing each sample with a random partner x[perm] and a ratio
lambda ~ Beta(alpha, alpha) drawn once per batch:

    none            x, y unchanged (vanilla training)
    input_mixup     x~ = lambda x + (1 - lambda) x[perm]                            (Zhang et al. 2018)
    manifold_mixup  the same on the hidden state of a random layer (a model hook)   (Verma et al. 2019)
    cutmix          a box of area ~ (1 - lambda) HW pasted from x[perm]              (Yun et al. 2019)
    puzzle_mix      a saliency-guided {0, 1/2, 1} mask per g x g cell by graph cut, with each image's
                    blocks first moved by optimal transport towards where they stay visible
                                                                                     (Kim et al. 2020)

and y~ = w y + (1 - w) y[perm] with w the share of x in x~. Tensors or arrays in, the same out.
"""

from __future__ import annotations

import functools

import numpy as np
import scipy.stats
import torch
from scipy.optimize import linear_sum_assignment
from torch import nn

from runner.methods.comixup import RANDOM_GRIDS, SOLVERS, _as_numpy, _check_choice, _cut, pool_saliency


def _tensor_io(fn):
    """Let a torch transform take and return numpy arrays too."""

    @functools.wraps(fn)
    def wrapper(x, y, *args, **kwargs):
        if isinstance(x, torch.Tensor):
            return fn(x, y, *args, **kwargs)
        out = fn(torch.as_tensor(np.asarray(x)), torch.as_tensor(np.asarray(y)), *args, **kwargs)
        return tuple(o.numpy() if isinstance(o, torch.Tensor) else o for o in out)

    return wrapper


def _pairing(B: int, alpha: float, rng) -> tuple[float, np.ndarray]:
    if not alpha > 0:
        raise ValueError(f"alpha={alpha}: must be > 0")
    if B < 2:
        raise ValueError(f"x: batch of {B}; mixing needs at least 2 inputs")
    return float(rng.beta(alpha, alpha)), rng.permutation(B)


def _check_batch(x, y):
    if x.ndim < 2 or y.ndim != 2 or len(y) != len(x):
        raise ValueError(
            f"x {tuple(x.shape)}, y {tuple(y.shape)}: expected a batch x (B, ...) and targets y (B, K)"
        )


def _mix_targets(y, weight, perm):
    """w y + (1 - w) y[perm], with w a scalar or per sample (B,)."""
    weight = torch.as_tensor(weight, dtype=y.dtype, device=y.device).reshape(-1, 1)
    return weight * y + (1 - weight) * y[torch.as_tensor(perm, device=y.device)]


@_tensor_io
def none(x, y, rng=None):
    """Vanilla training: the batch unchanged."""
    _check_batch(x, y)
    return x, y


@_tensor_io
def input_mixup(x, y, alpha: float = 1.0, rng=None):
    """x~ = lambda x + (1 - lambda) x[perm], y~ likewise; lambda ~ Beta(alpha, alpha)."""
    _check_batch(x, y)
    lam, perm = _pairing(len(x), alpha, np.random.default_rng(rng))
    return lam * x + (1 - lam) * x[torch.as_tensor(perm, device=x.device)], _mix_targets(y, lam, perm)


@_tensor_io
def cutmix(x, y, alpha: float = 1.0, rng=None):
    """Paste the box [r0, r1) x [c0, c1) of x[perm] into x; y~ by the box's actual area.

    The box has sides H sqrt(1 - lambda), W sqrt(1 - lambda) around a uniform centre and is clipped
    to the image, so the label weight is 1 - area / HW after clipping.
    """
    _check_batch(x, y)
    rng = np.random.default_rng(rng)
    lam, perm = _pairing(len(x), alpha, rng)
    H, W = x.shape[-2:]
    cut = np.sqrt(1.0 - lam)
    cy, cx = rng.integers(H), rng.integers(W)
    r0, r1 = np.clip([cy - round(H * cut / 2), cy + round(H * cut / 2)], 0, H)
    c0, c1 = np.clip([cx - round(W * cut / 2), cx + round(W * cut / 2)], 0, W)
    mixed = x.clone()
    mixed[..., r0:r1, c0:c1] = x[torch.as_tensor(perm, device=x.device)][..., r0:r1, c0:c1]
    keep = 1.0 - (r1 - r0) * (c1 - c0) / (H * W)
    return mixed, _mix_targets(y, keep, perm)


def default_mixup_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Hidden layers after which manifold mixup may mix: the ends of the first two stages.

    That is layer1, layer2 of a staged ResNet (as Verma et al.); the last block of each of the first
    two stages of a ResNeXt's `blocks` (a block with a projection shortcut starts a stage); the first
    two pooling layers of a plain CNN or NIN; the first two hidden ReLUs of an MLP.
    """
    if isinstance(getattr(model, "stages", None), nn.Sequential):
        return list(model.stages)[:2]
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, nn.Sequential):
        starts = [i for i, block in enumerate(blocks) if i and not isinstance(block.shortcut, nn.Identity)]
        return [blocks[i - 1] for i in starts[:2]]
    body = getattr(model, "body", None)
    if isinstance(body, nn.Sequential):
        pools = [m for m in body if isinstance(m, nn.MaxPool2d | nn.AvgPool2d)]
        return (pools or [m for m in body if isinstance(m, nn.ReLU)])[:2]
    return []


def manifold_mixup(model: torch.nn.Module, x, y, alpha: float = 2.0, layers=None, rng=None):
    """Forward x through the model, mixing the hidden state h of a random eligible layer k (k = 0 is
    the input): h~ = lambda h + (1 - lambda) h[perm]. Returns (logits, y~).

    layers: modules whose output may be mixed (default `default_mixup_layers(model)`); k is uniform
    over the input and these layers.
    """
    _check_batch(x, y)
    rng = np.random.default_rng(rng)
    lam, perm = _pairing(len(x), alpha, rng)
    layers = default_mixup_layers(model) if layers is None else list(layers)
    k = int(rng.integers(len(layers) + 1))
    index = torch.as_tensor(perm, device=x.device)
    if k == 0:
        return model(lam * x + (1 - lam) * x[index]), _mix_targets(y, lam, perm)
    handle = layers[k - 1].register_forward_hook(lambda module, inputs, h: lam * h + (1 - lam) * h[index])
    try:
        logits = model(x)
    finally:
        handle.remove()
    return logits, _mix_targets(y, lam, perm)


def transport_blocks(saliency_grid: np.ndarray, visible: np.ndarray, t_eps: float = 0.8) -> np.ndarray:
    """Optimal block transport of Puzzle Mix: where each block of an image moves.

    saliency_grid (g, g), normalised to sum 1; visible (g, g) in [0, 1], how much of the image stays
    visible in each cell. Solves the assignment (a discrete optimal transport with uniform marginals)

        min_Pi sum_{src,dst} Pi[src,dst] (t_eps d(src,dst) / (2 (g - 1) n) - visible[dst] s[src])

    with d the L1 grid distance: salient blocks move to visible cells when the saliency they keep
    exceeds the distance cost. Returns source (g*g,) with cell dst taking block source[dst].
    """
    g = saliency_grid.shape[0]
    n = g * g
    pos = np.stack(np.unravel_index(np.arange(n), (g, g)), 1)
    dist = np.abs(pos[:, None, :] - pos[None, :, :]).sum(-1) / max(2 * (g - 1), 1)
    cost = t_eps * dist / n - saliency_grid.reshape(n, 1) * visible.reshape(1, n)
    src, dst = linear_sum_assignment(cost)
    source = np.empty(n, int)
    source[dst] = src
    return source


def _boundary_mismatch(x0: np.ndarray, x1: np.ndarray, g: int) -> np.ndarray:
    """Mean squared mismatch along each cell boundary when x0 meets x1 there (either side), per edge
    of the grid in `_grid_edges` order (vertical then horizontal), normalised to mean 1 per image."""
    B, C, H, W = x0.shape
    bh, bw = H // g, W // g
    rows0, rows1 = x0[:, :, bh - 1 : H - 1 : bh, :], x1[:, :, bh:H:bh, :]  # last row of cell r / first of r+1
    rows0b, rows1b = x1[:, :, bh - 1 : H - 1 : bh, :], x0[:, :, bh:H:bh, :]
    cols0, cols1 = x0[:, :, :, bw - 1 : W - 1 : bw], x1[:, :, :, bw:W:bw]
    cols0b, cols1b = x1[:, :, :, bw - 1 : W - 1 : bw], x0[:, :, :, bw:W:bw]

    vert = 0.5 * (np.square(rows0 - rows1) + np.square(rows0b - rows1b)).mean(1)  # (B, g-1, W)
    vert = vert.reshape(B, g - 1, g, bw).mean(-1)
    horz = 0.5 * (np.square(cols0 - cols1) + np.square(cols0b - cols1b)).mean(1)  # (B, H, g-1)
    horz = horz.reshape(B, g, bh, g - 1).mean(2)
    edges = np.concatenate([vert.reshape(B, -1), horz.reshape(B, -1)], axis=1)
    return edges / (edges.mean(1, keepdims=True) + 1e-12)


@_tensor_io
def puzzle_mix(
    x,
    y,
    saliency_maps,
    alpha: float = 1.0,
    beta: float = 1.2,
    gamma: float = 0.5,
    eta: float = 0.2,
    n_labels: int = 3,
    grid: int = -1,
    transport: bool = True,
    t_eps: float = 0.8,
    solver: str = "gco_expansion",
    rng=None,
):
    """Puzzle Mix of each x with x[perm]: a saliency-guided mask, then optimal block transport.

    On a g x g grid (n cells; grid=-1 draws g from {2, 4, 8} dividing H, W), cell k takes the
    partner weight z_k in {0, 1/(L-1), ..., 1} (L = n_labels) minimising, per pair,

        sum_k -((1 - z_k) s[k] + z_k s'[k]) - eta/n log Binom(z_k (L-1); L-1, 1 - lambda)
        + sum_{neighbours e = (k,k')} (beta + gamma d_e)/n |z_k - z_k'|

    with s, s' the pooled saliency of x and x[perm] (normalised to sum 1) and d_e the images'
    mismatch along boundary e (normalised to mean 1): seams go where the two images agree. Solved
    by alpha-expansion (the label distance is a metric). With `transport`, each image's blocks are
    then moved by `transport_blocks` towards the cells where it stays visible. y~ by mask area.
    saliency_maps: (B, H, W) per-pixel saliency of x.
    """
    _check_batch(x, y)
    _check_choice("solver", solver, SOLVERS)
    rng = np.random.default_rng(rng)
    B, C, H, W = x.shape
    lam, perm = _pairing(B, alpha, rng)
    if not (isinstance(n_labels, int) and n_labels >= 2):
        raise ValueError(f"n_labels={n_labels}: must be an integer >= 2")
    if grid == -1:  # 16 x 16 is left out: 256-block assignments per image cost seconds per batch
        grid = int(rng.choice([c for c in RANDOM_GRIDS[:-1] if H % c == 0 and W % c == 0] or [1]))
    if not (isinstance(grid, int) and grid >= 1 and H % grid == 0 and W % grid == 0):
        raise ValueError(f"grid={grid}: must be a positive divisor of the image size {H}x{W}, or -1")
    s = _as_numpy(saliency_maps).astype(np.float64)
    if s.shape != (B, H, W) or not np.isfinite(s).all():
        raise ValueError(f"saliency_maps: expected finite values of shape ({B}, {H}, {W}), got {s.shape}")
    n = grid * grid
    s_grid = pool_saliency(s, grid).reshape(B, n)
    levels = np.linspace(0.0, 1.0, n_labels)
    prior = scipy.stats.binom.pmf(np.arange(n_labels), n_labels - 1, 1 - lam)  # partner share ~ 1 - lambda
    log_prior = np.log(prior + 1e-8)
    unary = -((1 - levels) * s_grid[:, :, None] + levels * s_grid[perm][:, :, None]) - eta / n * log_prior
    images = _as_numpy(x).astype(np.float64)
    edge_weight = (beta + gamma * _boundary_mismatch(images, images[perm], grid)) / n if grid > 1 else 0.0
    pairwise = np.abs(levels[:, None] - levels[None, :])
    z = levels[_cut(unary, pairwise, edge_weight, grid, solver)]  # (B, n) partner weight per cell
    cells = x.reshape(B, C, grid, H // grid, grid, W // grid).permute(0, 2, 4, 1, 3, 5).reshape(B, n, -1)
    partner = cells[torch.as_tensor(perm, device=x.device)]
    if transport and grid > 1:
        rows = torch.arange(B, device=x.device)[:, None]
        own_src = np.stack(
            [transport_blocks(s_grid[b].reshape(grid, grid), 1 - z[b], t_eps) for b in range(B)]
        )
        partner_src = np.stack(
            [transport_blocks(s_grid[p].reshape(grid, grid), z[b], t_eps) for b, p in enumerate(perm)]
        )
        cells = cells[rows, torch.as_tensor(own_src, device=x.device)]
        partner = partner[rows, torch.as_tensor(partner_src, device=x.device)]
    zt = torch.as_tensor(z, dtype=x.dtype, device=x.device)[:, :, None]
    mixed = (1 - zt) * cells + zt * partner
    mixed = (
        mixed.reshape(B, grid, grid, C, H // grid, W // grid).permute(0, 3, 1, 4, 2, 5).reshape(B, C, H, W)
    )
    return mixed, _mix_targets(y, 1 - z.mean(1), perm)
