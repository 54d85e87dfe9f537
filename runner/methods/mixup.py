"""The mixup baselines Co-Mixup is compared with, as batch transforms of the same call shape.

Every transform takes a batch x (B, C, H, W) with one-hot (or soft) targets y (B, K) and returns the
mixed batch and its targets, pairing each sample with a random partner x[perm] and a ratio
lambda ~ Beta(alpha, alpha) drawn once per batch:

    none            x, y unchanged (vanilla training)
    input_mixup     x~ = lambda x + (1 - lambda) x[perm]                            (Zhang et al. 2018)
    manifold_mixup  the same on the hidden state of a random layer (a model hook)   (Verma et al. 2019)
    cutmix          a box of area ~ (1 - lambda) HW pasted from x[perm]              (Yun et al. 2019)
    puzzle_mix      a saliency-guided {0, 1/2, 1} mask per g x g cell by graph cut, then each image's
                    blocks moved by a masked transport towards where they stay visible
                                                                                     (Kim et al. 2020)

and y~ = w y + (1 - w) y[perm] with w the share of x in x~. Tensors or arrays in, the same out (but
`manifold_mixup`, whose x goes through a model: tensors).
Puzzle Mix's graph cut is chosen by `method=`, as in
`runner.methods.comixup.grid_cut`.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import scipy.stats
import torch
import torch.nn.functional as F
from torch import nn

from runner.methods._common import to_device
from runner.methods.comixup import (
    RANDOM_GRIDS,
    SOLVERS,
    _cells,
    _check_choice,
    _cut,
    _uncells,
    pool_saliency,
)

__all__ = [
    "cutmix",
    "cutmix_box",
    "default_mixup_layers",
    "input_mixup",
    "manifold_mixup",
    "mix_hidden",
    "mix_pairs",
    "none",
    "pairing",
    "paste_box",
    "puzzle_costs",
    "puzzle_mix",
    "seam_penalty",
    "transport_plan",
]


def _tensor_io(fn):
    """Let a torch transform take and return numpy arrays too."""

    @functools.wraps(fn)
    def wrapper(x, y, *args, **kwargs):
        if isinstance(x, torch.Tensor):
            return fn(x, y, *args, **kwargs)
        out = fn(torch.as_tensor(np.asarray(x)), torch.as_tensor(np.asarray(y)), *args, **kwargs)
        return tuple(o.numpy() if isinstance(o, torch.Tensor) else o for o in out)

    return wrapper


def pairing(B: int, alpha: float, rng) -> tuple[float, np.ndarray]:
    """A pair mixup's draws from `rng`: lambda ~ Beta(alpha, alpha), then a permutation of the B inputs."""
    if not 0 < alpha < math.inf:
        raise ValueError(f"alpha={alpha}: must be a finite number > 0")
    if B < 2:
        raise ValueError(f"x: batch of {B}; mixing needs at least 2 inputs")
    return float(rng.beta(alpha, alpha)), rng.permutation(B)


def _check_batch(x, y):
    if x.ndim < 2 or y.ndim != 2 or len(y) != len(x):
        raise ValueError(
            f"x {tuple(x.shape)}, y {tuple(y.shape)}: expected a batch x (B, ...) and targets y (B, K)"
        )


def _mix_targets(y, weight, partner):
    """w y + (1 - w) y[partner]; w a number or per sample (B,), partner (B,) indices, both on y's device.
    Integer targets (``F.one_hot``'s) mix as float32: in their dtype every weight would truncate to 0 or 1."""
    if not y.is_floating_point():
        y = y.float()
    if not isinstance(weight, torch.Tensor):  # filled there: a copy of the number would wait for the device
        weight = torch.full((), weight, dtype=y.dtype, device=y.device)
    weight = weight.to(y.dtype).reshape(-1, 1)
    return weight * y + (1 - weight) * y[partner]


@_tensor_io
def none(x, y, rng=None):
    """Vanilla training: the batch unchanged."""
    _check_batch(x, y)
    return x, y


@_tensor_io
def input_mixup(x, y, alpha: float = 1.0, rng=None):
    """x~ = lambda x + (1 - lambda) x[perm], y~ likewise; lambda ~ Beta(alpha, alpha)."""
    _check_batch(x, y)
    lam, perm = pairing(len(x), alpha, np.random.default_rng(rng))
    return mix_pairs(x, y, lam, to_device(perm, x.device))


def mix_pairs(x, y, lam, partner):
    """Input mixup with its draws given: `lam` a number or a 0-dim float64 tensor on x's device (its
    1 - lam then rounds as the number's), `partner` (B,) indices there."""
    return lam * x + (1 - lam) * x[partner], _mix_targets(y, lam, partner)


@_tensor_io
def cutmix(x, y, alpha: float = 1.0, rng=None):
    """Paste the box [r0, r1) x [c0, c1) of x[perm] into x; y~ by the box's actual area (`cutmix_box`)."""
    _check_batch(x, y)
    rng = np.random.default_rng(rng)
    lam, perm = pairing(len(x), alpha, rng)
    box, keep = cutmix_box(x.shape[-2:], lam, rng)
    return paste_box(x, y, to_device(box, x.device), keep, to_device(perm, x.device))


def cutmix_box(size, lam: float, rng) -> tuple[list[int], float]:
    """CutMix's box (r0, r1, c0, c1) in an image of `size` (H, W), and the share of x it keeps.

    The box has sides H sqrt(1 - lambda), W sqrt(1 - lambda) around a uniform (real) centre and is
    clipped to the image, edges truncated to ints (the authors' `mixup_box`), so the label weight is
    1 - area / HW after clipping.
    """
    H, W = size
    cy, cx = rng.uniform(0, H), rng.uniform(0, W)
    rh, rw = np.sqrt(1.0 - lam) * H, np.sqrt(1.0 - lam) * W
    r0, r1 = (int(np.clip(v, 0, H)) for v in (cy - rh / 2, cy + rh / 2))
    c0, c1 = (int(np.clip(v, 0, W)) for v in (cx - rw / 2, cx + rw / 2))
    return [r0, r1, c0, c1], 1.0 - (r1 - r0) * (c1 - c0) / (H * W)


def paste_box(x, y, box: torch.Tensor, keep, partner):
    """CutMix with its draws given: x[partner]'s pixels inside `box` (r0, r1, c0, c1), an int tensor on x's
    device, x's outside, chosen by a mask (the same work whatever the box, as a captured step needs);
    y~ with x's share `keep` (a number or a 0-dim tensor there)."""
    rows, cols = (torch.arange(n, device=x.device) for n in x.shape[-2:])
    inside = ((rows >= box[0]) & (rows < box[1]))[:, None] & ((cols >= box[2]) & (cols < box[3]))[None, :]
    return torch.where(inside, x[partner], x), _mix_targets(y, keep, partner)


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
    lam, perm = pairing(len(x), alpha, rng)
    layers = default_mixup_layers(model) if layers is None else list(layers)
    k = int(rng.integers(len(layers) + 1))
    return mix_hidden(model, x, y, lam, to_device(perm, x.device), to_device(k, x.device), layers)


def mix_hidden(model: torch.nn.Module, x, y, lam, partner, k: torch.Tensor, layers):
    """Manifold mixup with its draws given (`lam` and `partner` as `mix_pairs`'s, the site `k` a 0-dim
    int tensor on x's device): every site mixes, and `torch.where` keeps the mix at site k and h
    elsewhere, so the forward is the same work whatever k (as a captured step needs); the values and
    gradients are the single mix's (elsewhere the where passes h, and its gradient gets exact zeros)."""

    def mixed(h, site: int):
        return torch.where(k == site, lam * h + (1 - lam) * h[partner], h)

    handles = [layer.register_forward_hook(lambda module, inputs, h, site=site: mixed(h, site))
               for site, layer in enumerate(layers, start=1)]  # fmt: skip
    try:
        logits = model(mixed(x, 0))
    finally:
        for handle in handles:
            handle.remove()
    return logits, _mix_targets(y, lam, partner)


# ----------------------------------------------------------------------------------------------
# Puzzle Mix (Kim, Choo & Song, ICML 2020), term by term as the authors' `mixup.py`


def seam_penalty(upper: torch.Tensor, lower: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The data-smoothness cost of each cell boundary when `upper` meets `lower` there.

    upper, lower: (B, C, g k, g k) images average-pooled by the neighbourhood size (so a cell is k x k
    pooled pixels). A vertical boundary between cells (r, c) and (r + 1, c) costs the mean over
    channels and over the k pooled columns of the cell of |upper[last pooled row of r] - lower[first
    pooled row of r + 1]|; horizontal boundaries likewise with columns. Returns (vertical (B, g-1, g),
    horizontal (B, g, g-1)).
    """
    vert = (upper[:, :, :-1, :] - lower[:, :, 1:, :])[:, :, k - 1 :: k, :].abs().mean(1)
    horz = (upper[:, :, :, :-1] - lower[:, :, :, 1:])[:, :, :, k - 1 :: k].abs().mean(1)
    return F.avg_pool2d(vert, (1, k)), F.avg_pool2d(horz, (k, 1))


def puzzle_costs(
    s_own: torch.Tensor,
    s_partner: torch.Tensor,
    raw_own: torch.Tensor,
    raw_partner: torch.Tensor,
    lam: float,
    beta: float = 1.2,
    gamma: float = 0.5,
    eta: float = 0.2,
    n_labels: int = 3,
    neigh_size: int = 4,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The Puzzle Mix graph-cut problem of each pair (x, x') on a g x g grid (n cells), as the authors.

    Label l of a cell is the partner weight z_l = l / (L - 1) (L = n_labels; the cell is
    (1 - z) x + z x'). With beta' = beta / (16 g) and the pairwise data costs d_e(a, b) of boundary e
    (`seam_penalty` of the raw images pooled by `neigh_size`; a, b in {x, x'} the sources on each side)

        unary[k, l] = (1 - z_l) U_x[k] + z_l U_x'[k] - eta / n log(Binom(l; L - 1, 1 - lam) + 1e-8)
        U_x[k]  = s'[k] + beta' gamma sum_{e at k} mean_b d_e(x, b)      (cost of keeping x in cell k)
        U_x'[k] = s[k]  + beta' gamma sum_{e at k} mean_b d_e(x', b)
        w_e     = beta' (1 + gamma (d_e(x, x') + d_e(x', x) - d_e(x, x) - d_e(x', x')) / 2)
        E(l)    = sum_k unary[k, l_k] + sum_e w_e (z_{l_k} - z_{l_k'})^2

    (s, s': pooled saliency normalised to sum 1; "mean_b" over the source b on the other side, with
    a the source on this side in the order of e). For binary masks E is the saliency the mask drops
    + beta' per cut edge + beta' gamma d_e(source above, source below), up to a constant: the data
    term is the authors' linearisation, exact for {0, 1} and interpolated for blends.
    s_own, s_partner: (B, g, g); raw_*: (B, C, H, W) pixels in [0, 1]. Returns numpy float64
    (unary (B, n, L), edge weights (B, E) in `grid_cut` order (clipped at 0), pairwise (L, L)), the
    first two computed on the inputs' device and read in one copy.
    """
    z, log_prior = label_prior(lam, s_own.shape[1] ** 2, n_labels, eta)
    z_there, log_prior = to_device(torch.stack([z, log_prior]), s_own.device)
    costs = puzzle_cost_tensor(s_own, s_partner, raw_own, raw_partner, z_there, log_prior, beta, gamma,
                               neigh_size)  # fmt: skip
    n = s_own.shape[1] ** 2
    return (*split_costs(costs.cpu().numpy(), n, n_labels), pairwise_costs(n_labels))  # the step's one read


def label_prior(lam: float, n: int, n_labels: int, eta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """On the host: the label levels z (L,) and each label's prior cost -eta / n log(Binom(l; L - 1,
    1 - lam) + 1e-8) (L,), float64 (`puzzle_costs`)."""
    z = torch.linspace(0, 1, n_labels, dtype=torch.float64)
    prior = scipy.stats.binom.pmf(np.arange(n_labels), n_labels - 1, 1 - lam)
    return z, torch.as_tensor(-eta / n * np.log(prior + 1e-8))


def pairwise_costs(n_labels: int) -> np.ndarray:
    """The label cost (z_a - z_b)^2 of each pair of labels (L, L), on the host."""
    z = torch.linspace(0, 1, n_labels, dtype=torch.float64)
    return ((z[:, None] - z[None, :]) ** 2).numpy()


def split_costs(costs: np.ndarray, n: int, n_labels: int) -> tuple[np.ndarray, np.ndarray]:
    """`puzzle_cost_tensor`'s rows of n cells, read: (unary (B, n, L), edge weights (B, E)), float64."""
    return costs[:, : n * n_labels].reshape(len(costs), n, n_labels), costs[:, n * n_labels :]


def puzzle_cost_tensor(
    s_own, s_partner, raw_own, raw_partner, z, prior, beta, gamma, neigh_size
) -> torch.Tensor:
    """`puzzle_costs` on the inputs' device, before its read: each pair's unary (n L) and edge weights (E)
    in one float64 row (B, n L + E). z (L,) the label levels and prior ((L,), or (n, L): each cell's) the
    labels' prior costs, on the device (`label_prior`)."""
    B, g, _ = s_own.shape
    n = g * g
    block = raw_own.shape[-1] // g
    size = max(d for d in range(1, min(neigh_size, block) + 1) if block % d == 0)  # = the authors' on 2^j
    k = block // size
    beta_n = beta / g / 16
    pooled = {1: F.avg_pool2d(raw_own.float(), size), 0: F.avg_pool2d(raw_partner.float(), size)}
    vert, horz = {}, {}  # (a, b): cost of a above / left of b; 1 = x, 0 = x'
    for a in (0, 1):
        for b in (0, 1):
            v, h = seam_penalty(pooled[a], pooled[b], k)
            vert[a, b], horz[a, b] = beta_n * gamma * v, beta_n * gamma * h
    keep_x, keep_partner = s_partner.double().clone(), s_own.double().clone()
    for a, cost in ((1, keep_x), (0, keep_partner)):
        cost[:, :-1, :] += (vert[a, 0] + vert[a, 1]) / 2  # this cell above
        cost[:, 1:, :] += (vert[0, a] + vert[1, a]) / 2  # this cell below
        cost[:, :, :-1] += (horz[a, 0] + horz[a, 1]) / 2
        cost[:, :, 1:] += (horz[0, a] + horz[1, a]) / 2
    unary = (1 - z) * keep_x.reshape(B, n, 1) + z * keep_partner.reshape(B, n, 1) + prior
    residual = [(p[1, 0] + p[0, 1] - p[1, 1] - p[0, 0]).reshape(B, -1) / 2 for p in (vert, horz)]
    edge_weight = (beta_n + torch.cat(residual, 1).double()).clamp(min=0)
    return torch.cat([unary.reshape(B, -1), edge_weight], 1)


def transport_plan(mask: torch.Tensor, saliency: torch.Tensor, t_eps: float = 0.8) -> torch.Tensor:
    """Puzzle Mix's masked transport of one image's g x g blocks (the authors' Algorithm 2).

    Cost of moving block src to cell dst (squared grid distance, binary visibility):

        C[src, dst] = t_eps |p_src - p_dst|^2 / (g - 1)^2 - s[src] [mask[dst] > 0]

    g rounds of: every block picks its cheapest cell; per cell, the argmin over all blocks of
    plan * cost wins (a non-claimant counts as 0, so a claimant at cost >= 0 may lose); losers pay
    +1 for that cell in the next round. mask, saliency (normalised, sum 1): (B, g, g). Returns the
    last round's winners (B, n, n) in {0, 1}, plan[src, dst] = 1 when block src goes to cell dst:
    each cell receives at most one block, and a cell left empty stays zero (hidden cells mostly).

    The salient block 0 leaves the hidden cell 0 for the nearest visible one:

    >>> mask, saliency = torch.tensor([[[0.0, 1.0], [1.0, 1.0]]]), torch.tensor([[[1.0, 0.0], [0.0, 0.0]]])
    >>> transport_plan(mask, saliency)[0, 0].tolist()
    [0.0, 1.0, 0.0, 0.0]
    """
    B, g, _ = mask.shape
    n = g * g
    grid = torch.arange(g, device=mask.device)
    pos = torch.stack(torch.meshgrid(grid, grid, indexing="ij"), -1).reshape(n, 2).float()
    dist = ((pos[:, None] - pos[None]) ** 2).sum(-1) / max(g - 1, 1) ** 2
    cost = t_eps * dist - saliency.reshape(B, n, 1).float() * (mask > 0).reshape(B, 1, n).float()
    cells = torch.arange(n, device=mask.device)
    win = torch.zeros_like(cost, dtype=torch.bool)
    for _ in range(g):
        plan = cells == cost.argmin(-1, keepdim=True)  # (B, src, dst): each block's cheapest cell
        # per cell, the argmin over all blocks of plan * cost (non-claimants count as 0, as the authors)
        contest = torch.where(plan, cost, 0.0).argmin(-2, keepdim=True)
        win = plan & (cells[:, None] == contest)
        cost += (plan & ~win).float()
    return win.float()


def _transport(x: torch.Tensor, plan: torch.Tensor, g: int) -> torch.Tensor:
    """Cell dst of the result = sum_src plan[src, dst] * block src of x."""
    moved = torch.einsum("bsd,bsf->bdf", plan.to(x.dtype), _cells(x, g))
    return _uncells(moved, x.shape)


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
    neigh_size: int = 4,
    transport: bool = True,
    t_eps: float = 0.8,
    t_size: int = -1,
    mean=None,
    std=None,
    noise=None,
    adv_mask: tuple[bool, bool] = (False, False),
    method: str = "gco_swap",
    rng=None,
):
    """Puzzle Mix of each x with x[perm]: a saliency-guided mask by graph cut, then masked transport.

    lambda ~ Beta(alpha, alpha) and the pairing are drawn once per batch; grid=-1 draws g from
    {2, 4, 8, 16} (those dividing H and W) as the authors. The mask of each pair minimises
    `puzzle_costs` (alpha-beta swap: the squared label cost is not a metric); with `transport`, each
    image's blocks then move by `transport_plan` on the grid of `t_size`-pixel cells (-1, or a size
    >= the cut's cells: the cut's grid; 0: 4 px on images of at most 32 px, else the cut's grid, the
    authors' choice on CIFAR, Tiny-ImageNet and ImageNet) towards where it stays visible. With `noise`
    (B, C, H, W, raw pixel units), x (adv_mask[0]) and the partner (adv_mask[1]) get it before the
    transport, clipped to [0, 1] (the adversarial option).
    x~ = M x + (1 - M) x', y~ = mean(M) y + (1 - mean(M)) y'. x is the network input; raw pixels are
    x * std + mean (per channel; None: x is raw).
    saliency_maps: (B, H, W) per-pixel saliency of x. Everything runs on x's device but the cut, by
    `method` (a `grid_cut` method).

    >>> x, y = torch.rand(4, 3, 8, 8), torch.eye(4)
    >>> x_mix, y_mix = puzzle_mix(x, y, torch.rand(4, 8, 8), grid=2, rng=0)
    >>> tuple(x_mix.shape), bool(torch.allclose(y_mix.sum(1), torch.ones(4)))
    ((4, 3, 8, 8), True)
    """
    _check_batch(x, y)
    _check_choice("method", method, SOLVERS)
    rng = np.random.default_rng(rng)
    B, C, H, W = x.shape
    perm, z, prior, grid = puzzle_draw(x.shape, alpha, eta, n_labels, grid, method, rng)
    t_grid = transport_grid(t_size, grid, H, W, transport)
    s = torch.as_tensor(saliency_maps, device=x.device)
    if s.shape != (B, H, W):
        raise ValueError(f"saliency_maps: shape {tuple(s.shape)}, expected ({B}, {H}, {W})")
    index = to_device(perm, x.device)
    shift, scale = normalization(mean, std, x.device, x.dtype)
    z_there, prior = to_device(torch.stack([z, prior]), x.device)
    costs, raw, s_grid = puzzle_read(x, s, index, z_there, prior, shift, scale, grid, beta, gamma, neigh_size)
    labels = to_device(puzzle_cut(costs.cpu().numpy(), grid, n_labels, method), x.device)  # the one read
    return puzzle_apply(x, y, labels, raw, s, s_grid, index, shift, scale, n_labels, transport, t_eps, t_grid,
                        noise, adv_mask)  # fmt: skip


def puzzle_draw(shape, alpha, eta, n_labels, grid, method, rng):
    """Puzzle Mix's host draws for a batch of `shape` (B, C, H, W), the options checked: lambda ~
    Beta(alpha, alpha) and the pairing, then the grid (grid=-1: one of {2, 4, 8, 16} dividing the image).
    -> (partners, the label levels z (L,), their prior costs (L,) (`label_prior`), the grid)."""
    B, C, H, W = shape
    if H != W:
        raise ValueError(f"x: images of {H}x{W}; puzzle_mix needs square ones (g x g cells of square blocks)")
    lam, perm = pairing(B, alpha, rng)
    if not (isinstance(n_labels, int) and n_labels >= 2):
        raise ValueError(f"n_labels={n_labels}: must be an integer >= 2")
    if method == "gco_expansion" and n_labels > 2:
        raise ValueError(
            f"method='gco_expansion' needs n_labels=2 (got {n_labels}): the squared costs of more mask "
            "levels are not a metric, and gco aborts the process on a non-metric expansion"
        )
    if grid == -1:
        choices = [c for c in RANDOM_GRIDS if H % c == 0 and W % c == 0]
        if not choices:
            raise ValueError(f"grid=-1: none of {RANDOM_GRIDS} divides the image size {H}x{W}")
        grid = int(rng.choice(choices))
    if not (isinstance(grid, int) and grid >= 2 and H % grid == 0 and W % grid == 0):
        raise ValueError(f"grid={grid}: must be a divisor >= 2 of the image size {H}x{W}, or -1")
    return perm, *label_prior(lam, grid * grid, n_labels, eta), grid


def transport_grid(t_size: int, grid: int, H: int, W: int, transport: bool) -> int:
    """The side of the transport's grid: cells of `t_size` pixels where finer than the cut's, else the cut's
    (0: 4 px on images of at most 32 px)."""
    if t_size == 0:  # at 224 px, 4-px cells would make a 56 x 56 transport grid: 3136^2 costs per image
        t_size = 4 if W <= 32 else -1
    finer = t_size != -1 and t_size < W // grid  # transport cells of t_size pixels, finer than the cut's
    t_grid = W // t_size if finer and t_size > 0 else grid
    if transport and (t_size < -1 or (finer and (W % t_size or H % t_grid))):
        raise ValueError(f"t_size={t_size}: the transport cells must tile the {H}x{W} image (or -1, or 0)")
    return t_grid


def normalization(mean, std, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(shift, scale) (1, C, 1, 1) on `device`: raw pixels are x * scale + shift (None: 0 and 1)."""
    return tuple(to_device(default if v is None else v, device, dtype).reshape(1, -1, 1, 1)
                 for v, default in ((mean, 0.0), (std, 1.0)))  # fmt: skip


def puzzle_read(x, s, index, z, prior, shift, scale, grid, beta, gamma, neigh_size):
    """Puzzle Mix's device work before its host read: the raw pixels, the saliency pooled to the grid and the
    cut problems' costs (`puzzle_cost_tensor`) -> (costs, raw, pooled saliency)."""
    raw = x * scale + shift
    s_grid = pool_saliency(s, grid)
    costs = puzzle_cost_tensor(s_grid, s_grid[index], raw, raw[index], z, prior, beta, gamma, neigh_size)
    return costs, raw, s_grid


def puzzle_cut(costs: np.ndarray, grid: int, n_labels: int, method: str) -> np.ndarray:
    """On the host: each pair's mask labels (B, n) from the costs read (`grid_cut` by `method`)."""
    unary, edge_weight = split_costs(costs, grid * grid, n_labels)
    if not (np.isfinite(unary).all() and np.isfinite(edge_weight).all()):  # checked where read anyway
        raise ValueError("saliency_maps: contains NaN or inf (or x does)")
    return _cut(unary, pairwise_costs(n_labels), edge_weight, grid, method)


def puzzle_apply(x, y, labels, raw, s, s_grid, index, shift, scale, n_labels, transport, t_eps, t_grid, noise,
                 adv_mask):  # fmt: skip
    """Puzzle Mix's device work after its host read: the masks from the cut's labels (on the device), the
    adversarial noise, the transport and the mix -> (x_mix, y_mix)."""
    B, _, H, W = x.shape
    grid = s_grid.shape[-1]
    mask = 1 - labels.reshape(B, 1, grid, grid).to(x.dtype) / (n_labels - 1)  # weight of x
    own, partner = x, x[index]
    if noise is not None:
        noise = torch.as_tensor(noise, dtype=x.dtype, device=x.device)
        if adv_mask[0]:
            own = ((raw + noise).clamp(0, 1) - shift) / scale
        if adv_mask[1]:
            partner = ((raw[index] + noise[index]).clamp(0, 1) - shift) / scale
    if transport:
        t_mask, t_sal = mask[:, 0], s_grid
        if t_grid != grid:  # finer transport cells: the mask upsampled, the saliency pooled anew
            t_mask, t_sal = F.interpolate(mask, size=t_grid)[:, 0], pool_saliency(s, t_grid)
        own = _transport(own, transport_plan(t_mask, t_sal, t_eps), t_grid)
        partner = _transport(partner, transport_plan(1 - t_mask, t_sal[index], t_eps), t_grid)
    full = F.interpolate(mask, size=(H, W))
    return full * own + (1 - full) * partner, _mix_targets(y, full.reshape(B, -1).mean(1), index)
