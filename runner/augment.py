"""Augmentations of a batch on its device, for methods that make their own views of a batch (CSOT's weak and
strong views, the CIFAR-LT recipe of the DB-OT presets). Each takes and returns a float (B, C, H, W) batch
normalised by the dataset's (mean, std); per-sample randomness, drawn on the batch's device, and nothing read
back from it (no host-device synchronisation)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from runner.methods._common import to_device

POLICIES = ("autoaugment_cifar10", "autoaugment_imagenet", "randaugment")
WEAK_VIEWS = ("crop_flip", "rrc_flip")  # runner.data.views: the CSOT weak view of images
# torchvision's op names; an image's op is its index here (Identity: nothing drawn, or not applied)
_GEOMETRIC = ("ShearX", "ShearY", "TranslateX", "TranslateY", "Rotate")
OPS = ("Identity", *_GEOMETRIC, "Brightness", "Color", "Contrast", "Sharpness", "Posterize", "Solarize",
       "AutoContrast", "Equalize", "Invert")  # fmt: skip


def shift(x: torch.Tensor, pad: int) -> torch.Tensor:
    """Random translation by up to `pad` pixels (zero fill), per sample."""
    b, _, h, w = x.shape
    padded = F.pad(x, (pad, pad, pad, pad))
    dy = torch.randint(0, 2 * pad + 1, (b,), device=x.device)
    dx = torch.randint(0, 2 * pad + 1, (b,), device=x.device)
    rows = (torch.arange(h, device=x.device)[None, :] + dy[:, None])[:, None, :, None]
    cols = (torch.arange(w, device=x.device)[None, :] + dx[:, None])[:, None, None, :]
    batch = torch.arange(b, device=x.device)[:, None, None, None]
    chans = torch.arange(x.shape[1], device=x.device)[None, :, None, None]
    return padded[batch, chans, rows, cols]


def cutout(x: torch.Tensor, size: int) -> torch.Tensor:
    """Cutout (DeVries & Taylor 2017): zero a size x size square centred uniformly in each image, clipped at
    the border (rows cy - size // 2 .. cy + size - size // 2 - 1), as their code does after normalising."""
    b, _, h, w = x.shape
    cy = torch.randint(0, h, (b, 1, 1), device=x.device)
    cx = torch.randint(0, w, (b, 1, 1), device=x.device)
    ys = torch.arange(h, device=x.device).view(1, h, 1) - cy + size // 2
    xs = torch.arange(w, device=x.device).view(1, 1, w) - cx + size // 2
    hole = (ys >= 0) & (ys < size) & (xs >= 0) & (xs < size)
    return x * (~hole).unsqueeze(1)


def policy_table(policy: str, height: int, width: int) -> list[list[tuple[str, float, float, bool]]]:
    """The choices of `policy` as rows of stages (op, probability, magnitude, signed), with torchvision's
    policies and magnitudes: AutoAugment's 25 sub-policies of two stages (10 magnitude bins), RandAugment's 14
    ops, each a row of its two stages (probability 1, bin 9 of 31)."""
    from torchvision.transforms import v2

    if policy == "randaugment":
        augment = v2.RandAugment()
        bins = augment.num_magnitude_bins
        rows = [[(op, 1.0, augment.magnitude)] * augment.num_ops for op in augment._AUGMENTATION_SPACE]
    else:
        augment = v2.AutoAugment(v2.AutoAugmentPolicy(policy.removeprefix("autoaugment_")))
        bins, rows = 10, augment._policies
    table = []
    for row in rows:
        stages = []
        for op, p, level in row:
            magnitudes, signed = augment._AUGMENTATION_SPACE[op]
            magnitudes = magnitudes(bins, height, width)
            stages.append((op, p, 0.0 if magnitudes is None else float(magnitudes[level]), signed))
        table.append(stages)
    return table


class PolicyAugment:
    """AutoAugment (CIFAR-10 or ImageNet policy) or RandAugment on the de-normalised batch, each image with
    its own draw (AutoAugment: a sub-policy, then each stage's coin and sign; RandAugment: two ops and their
    signs), as the authors' per-image PIL transforms. Batched on the device: every op of a stage runs on the
    whole batch with per-image magnitudes (torchvision's float kernels, nearest-neighbour geometry with zero
    fill) and each image keeps its own op's result, so no draw is read back. The policy's tables, the
    dataset's mean and std and the sampling grid are made once per (device, dtype, image size)."""

    def __init__(self, policy: str, mean, std):
        if policy not in POLICIES:
            raise ValueError(f"policy={policy!r}: must be one of {POLICIES}")
        self.policy, self.mean, self.std = policy, list(mean), list(std)
        self.joint = policy != "randaugment"  # AutoAugment draws one sub-policy for both stages
        self._constants = {}

    def constants(self, x: torch.Tensor) -> dict:
        key = (x.device, x.dtype, *x.shape[-2:])
        if key not in self._constants:
            (h, w), device = x.shape[-2:], x.device
            table = policy_table(self.policy, h, w)
            ops, probs, mags, signed = ([[stage[i] for stage in row] for row in table] for i in range(4))
            xs = torch.linspace((1.0 - w) * 0.5, (w - 1.0) * 0.5, w, dtype=x.dtype)  # torchvision's grid
            ys = torch.linspace((1.0 - h) * 0.5, (h - 1.0) * 0.5, h, dtype=x.dtype)
            grid = torch.stack(torch.broadcast_tensors(xs[None, :], ys[:, None], torch.ones(())), 2)
            # copied without the host waiting (`to_device`), once per device, dtype and size
            self._constants[key] = {
                "op": to_device([[OPS.index(op) for op in row] for row in ops], device),
                "p": to_device(probs, device, torch.float64),
                "magnitude": to_device(mags, device, torch.float64),
                "signed": to_device(signed, device),
                "mean": to_device(self.mean, device, x.dtype).view(1, -1, 1, 1),
                "std": to_device(self.std, device, x.dtype).view(1, -1, 1, 1),
                "grid": to_device(grid.view(1, h * w, 3), device),
                "half_size": to_device([0.5 * w, 0.5 * h], device, x.dtype),
            }
        return self._constants[key]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        k = self.constants(x)
        images = (x * k["std"] + k["mean"]).clamp(0, 1)
        b, (n_choices, n_stages) = len(x), k["op"].shape
        draws = (b, 1 if self.joint else n_stages)
        draw = torch.randint(n_choices, draws, device=x.device).expand(b, n_stages)
        for stage in range(n_stages):
            choice = draw[:, stage]
            applied = torch.rand(b, device=x.device, dtype=torch.float64) <= k["p"][choice, stage]
            negative = k["signed"][choice, stage] & (torch.rand(b, device=x.device) <= 0.5)
            magnitude = k["magnitude"][choice, stage]
            op = torch.where(applied, k["op"][choice, stage], 0)
            images = apply_ops(images, op, torch.where(negative, -magnitude, magnitude), k)
        return (images - k["mean"]) / k["std"]


def apply_ops(images, op, magnitude, constants):
    """Image i of the batch (float, in [0, 1]) through op `OPS[op[i]]` with `magnitude[i]` (float64),
    torchvision's float kernels (`transforms.v2.AutoAugment`'s calls) per image; `constants` holds the
    sampling grid (`PolicyAugment.constants`)."""
    from torchvision.transforms.v2.functional import equalize

    b, c = images.shape[:2]
    per_image = magnitude.to(images.dtype).view(b, 1, 1, 1)
    factor = 1.0 + per_image
    if c == 1:
        gray = images
    else:  # torchvision's luma, in its order of operations
        red, green, blue = images.unbind(1)
        gray = red.mul(0.2989).add(green, alpha=0.587).add(blue, alpha=0.114).unsqueeze(1)
    levels = torch.exp2(per_image)  # posterize: 2^bits
    low, high = images.amin((2, 3), keepdim=True), images.amax((2, 3), keepdim=True)
    flat = high == low  # autocontrast leaves a flat channel as it is
    low, span = torch.where(flat, 0.0, low), torch.where(flat, 1.0, high - low)
    results = {  # the ops after the geometric ones, in the order of OPS
        "Brightness": (images * factor).clamp(0, 1),
        "Color": _blend(images, gray, factor) if c == 3 else images,
        "Contrast": _blend(images, gray.mean((1, 2, 3), keepdim=True), factor),
        "Sharpness": _sharpness(images, factor),
        "Posterize": torch.minimum((images * levels).floor(), levels - 1).clamp(min=0) / levels,
        "Solarize": torch.where(images >= per_image, 1.0 - images, images),
        "AutoContrast": ((images - low) / span).clamp(0, 1),
        "Equalize": equalize(images),
        "Invert": 1.0 - images,
    }
    # each image's result: one gather from [unchanged, geometric, *results] (Identity: 0, the five geometric
    # ops: 1, the others: 2...), cheaper than a select per op
    n_geometric = len(_GEOMETRIC)
    slot = torch.where(op <= n_geometric, (op > 0).long(), op - n_geometric + 1)
    candidates = torch.stack([images, _affine(images, op, magnitude, constants), *results.values()])
    return candidates[slot, torch.arange(b, device=op.device)]


def _blend(image, other, ratio):
    return (image * ratio + other * (1.0 - ratio)).clamp(0, 1)


def _sharpness(images, factor):
    """torchvision's adjust_sharpness: the interior blended with its smoothing by the 3x3 kernel
    (1 1 1; 1 5 1; 1 1 1) / 13, here a separable 3x3 box sum plus 4 x the centre (cheaper than a depthwise
    convolution off the GPU), the border kept."""
    if min(images.shape[-2:]) <= 2:
        return images
    view = images[..., 1:-1, 1:-1]
    rows = images[..., :-2, :] + images[..., 1:-1, :] + images[..., 2:, :]
    blurred = (rows[..., :-2] + rows[..., 1:-1] + rows[..., 2:] + view * 4.0) / 13.0
    out = images.clone()
    out[..., 1:-1, 1:-1] = view + (blurred - view) * (1.0 - factor)
    return out.clamp(0, 1)


def _affine(images, op, magnitude, constants):
    """The geometric ops as torchvision's inverse affine maps, one per image (identity for the others),
    sampled at the nearest pixel with zero fill: ShearX (1, m, m h/2; 0, 1, 0) about the corner, ShearY
    (1, 0, 0; m, 1, m w/2), TranslateX/Y by -trunc(m) pixels, Rotate by m degrees about the centre."""
    b, _, h, w = images.shape
    is_op = {name: op == OPS.index(name) for name in _GEOMETRIC}
    angle = torch.deg2rad(-torch.remainder(magnitude, 360.0))
    cos = torch.where(is_op["Rotate"], angle.cos(), 1.0)
    sin = torch.where(is_op["Rotate"], angle.sin(), 0.0)
    shift_x = torch.where(is_op["ShearX"], magnitude * h / 2, 0.0)
    shift_y = torch.where(is_op["ShearY"], magnitude * w / 2, 0.0)
    tx = torch.where(is_op["TranslateX"], -magnitude.trunc(), shift_x)
    ty = torch.where(is_op["TranslateY"], -magnitude.trunc(), shift_y)
    theta = torch.stack([cos, torch.where(is_op["ShearX"], magnitude, sin), tx,
                         torch.where(is_op["ShearY"], magnitude, -sin), cos, ty], 1)  # fmt: skip
    theta = theta.to(images.dtype).view(b, 2, 3).transpose(1, 2) / constants["half_size"]
    coords = (constants["grid"].expand(b, -1, -1) @ theta).view(b, h, w, 2)
    return F.grid_sample(images, coords, mode="nearest", padding_mode="zeros", align_corners=False)
