"""Augmentations on the batch's device: the crop + flip of training, and the weak and strong views of the
CSOT losses (`runner.tasks.noisy_labels`)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torchvision.ops import roi_align

from runner.augment import PolicyAugment, cutout, shift


def augment_crop_flip(x: torch.Tensor, pad: int = 4) -> torch.Tensor:
    """Random crop with zero padding `pad` and random horizontal flip, per sample, on x's device."""
    b, _, h, w = x.shape
    padded = F.pad(x, (pad, pad, pad, pad))
    dy = torch.randint(0, 2 * pad + 1, (b, 1, 1), device=x.device)
    dx = torch.randint(0, 2 * pad + 1, (b, 1, 1), device=x.device)
    rows = (torch.arange(h, device=x.device).view(1, h, 1) + dy).expand(b, h, w)
    cols = (torch.arange(w, device=x.device).view(1, 1, w) + dx).expand(b, h, w)
    flip = torch.rand(b, 1, 1, device=x.device) < 0.5
    cols = torch.where(flip, cols.flip(-1), cols)
    batch = torch.arange(b, device=x.device).view(b, 1, 1)
    return padded.permute(0, 2, 3, 1)[batch, rows, cols].permute(0, 3, 1, 2)


def random_resized_crop_flip(
    x: torch.Tensor, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3), tries: int = 10
) -> torch.Tensor:
    """torchvision's RandomResizedCrop to x's own size, then a random horizontal flip, per sample on x's
    device: a box of area fraction U(scale) and log-uniform aspect `ratio` (the first of `tries` draws
    that fits; none: the whole image), at a uniform integer position, resampled bilinearly (every box is
    at most the image, so the resize only enlarges: no antialiasing needed)."""
    b, _, h, w = x.shape
    area = h * w * torch.empty(b, tries, device=x.device).uniform_(*scale)
    log_ratio = torch.empty(b, tries, device=x.device).uniform_(math.log(ratio[0]), math.log(ratio[1]))
    aspect = torch.exp(log_ratio)
    box_w, box_h = torch.sqrt(area * aspect).round(), torch.sqrt(area / aspect).round()
    fits = (box_w >= 1) & (box_w <= w) & (box_h >= 1) & (box_h <= h)
    first = fits.float().argmax(1, keepdim=True)  # the first draw that fits (0 if none does)
    ok = fits.any(1)
    box_w = torch.where(ok, box_w.gather(1, first)[:, 0], float(w))  # a scalar: no host-made tensor
    box_h = torch.where(ok, box_h.gather(1, first)[:, 0], float(h))
    top = torch.floor(torch.rand(b, device=x.device) * (h - box_h + 1))
    left = torch.floor(torch.rand(b, device=x.device) * (w - box_w + 1))
    index = torch.arange(b, device=x.device, dtype=left.dtype)
    boxes = torch.stack([index, left, top, left + box_w, top + box_h], 1).to(x.dtype)
    out = roi_align(x, boxes, output_size=(h, w), sampling_ratio=1, aligned=True)
    flip = torch.rand(b, 1, 1, 1, device=x.device) < 0.5
    return torch.where(flip, out.flip(-1), out)


class Views:
    """Weak and strong augmentations of a batch on its device.

    Images of side >= 16: weak = crop (zero padding `pad`) + flip, or with `weak="rrc_flip"` a
    RandomResizedCrop to the same side + flip (DivideMix's WebVision view); strong = weak + `policy`
    (`runner.augment.PolicyAugment`: AutoAugment's CIFAR-10 or ImageNet policy, or RandAugment, drawn per
    image). Smaller images (digits): weak = shift by up to one pixel; strong = weak + a 3x3 cutout +
    Gaussian noise (0.1). Flat inputs: weak = Gaussian noise (0.05), strong = noise (0.2) and 20% feature
    dropout.
    """

    def __init__(
        self, input_shape, mean=None, std=None, pad=4, policy="autoaugment_cifar10", weak="crop_flip"
    ):
        self.kind = "flat" if len(input_shape) != 3 else ("large" if input_shape[1] >= 16 else "small")
        self.pad, self.resized_crop = pad, weak == "rrc_flip"
        if self.kind == "large":
            c = input_shape[0]
            self.policy = PolicyAugment(policy, mean or [0.0] * c, std or [1.0] * c)

    def weak(self, x):
        if self.kind == "large":
            return random_resized_crop_flip(x) if self.resized_crop else augment_crop_flip(x, self.pad)
        if self.kind == "small":
            return shift(x, 1)
        return x + 0.05 * torch.randn_like(x)

    def strong(self, x):
        x = self.weak(x)
        if self.kind == "large":
            return self.policy(x)
        if self.kind == "small":
            return cutout(x, 3) + 0.1 * torch.randn_like(x)
        return (x + 0.2 * torch.randn_like(x)) * (torch.rand_like(x) > 0.2)
