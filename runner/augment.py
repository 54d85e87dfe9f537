"""Augmentations of a batch on its device, for methods that make their own views of a batch (CSOT's weak and
strong views, the CIFAR-LT recipe of the DB-OT presets). Each takes and returns a float (B, C, H, W) batch
normalised by the dataset's (mean, std); per-sample randomness unless stated."""

from __future__ import annotations

import torch
import torch.nn.functional as F

POLICIES = ("autoaugment_cifar10", "autoaugment_imagenet", "randaugment")


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


class PolicyAugment:
    """AutoAugment (CIFAR-10 or ImageNet policy) or RandAugment from torchvision's `transforms.v2`, applied to
    the de-normalised batch in `groups` groups: one random draw of the policy per group (a v2 transform
    draws once per call), so a batch mixes `groups` sub-policies."""

    def __init__(self, policy: str, mean, std, groups: int = 8):
        from torchvision.transforms import v2

        if policy not in POLICIES:
            raise ValueError(f"policy={policy!r}: must be one of {POLICIES}")
        self.transform = {
            "autoaugment_cifar10": lambda: v2.AutoAugment(v2.AutoAugmentPolicy.CIFAR10),
            "autoaugment_imagenet": lambda: v2.AutoAugment(v2.AutoAugmentPolicy.IMAGENET),
            "randaugment": v2.RandAugment,
        }[policy]()
        self.mean = torch.as_tensor(mean, dtype=torch.float32).view(1, -1, 1, 1)
        self.std = torch.as_tensor(std, dtype=torch.float32).view(1, -1, 1, 1)
        self.groups = groups

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        mean, std = self.mean.to(x.device), self.std.to(x.device)
        images = (x * std + mean).clamp(0, 1)
        parts = [self.transform(part) for part in images.chunk(self.groups)]
        return (torch.cat(parts) - mean) / std
