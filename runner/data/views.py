"""Augmentations on the batch's device: the crop + flip of training, and the weak and strong views of the
CSOT losses (`tasks.noisy_labels`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

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


class Views:
    """Weak and strong augmentations of a batch on its device.

    Images of side >= 16: weak = crop (zero padding `pad`) + flip; strong = weak + `policy`
    (`runner.augment.PolicyAugment`: AutoAugment's CIFAR-10 or ImageNet policy, or RandAugment, drawn per
    image). Smaller images (digits): weak = shift by up to one pixel; strong = weak + a 3x3 cutout +
    Gaussian noise (0.1). Flat inputs: weak = Gaussian noise (0.05), strong = noise (0.2) and 20% feature
    dropout.
    """

    def __init__(self, input_shape, mean=None, std=None, pad=4, policy="autoaugment_cifar10"):
        self.kind = "flat" if len(input_shape) != 3 else ("large" if input_shape[1] >= 16 else "small")
        self.pad = pad
        if self.kind == "large":
            c = input_shape[0]
            self.policy = PolicyAugment(policy, mean or [0.0] * c, std or [1.0] * c)

    def weak(self, x):
        if self.kind == "large":
            return augment_crop_flip(x, self.pad)
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
