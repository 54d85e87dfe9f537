"""The hierarchical hash's networks (`runner.tasks.hashing`): an embedding head on a backbone's features, and
the authors' input normalisation."""

from __future__ import annotations

import torch
from torch import nn


class PixelMeanInput(nn.Module):
    """x -> std * (x - mean): from input normalised per channel, (x_raw / 255 - m_c) / s_c, the authors'
    input x_raw / 255 - M with M the training set's mean image (`mean` = M in normalised units)."""

    def __init__(self, mean: torch.Tensor, std):
        super().__init__()
        self.register_buffer("mean", mean.float())
        self.register_buffer("std", torch.as_tensor(std, dtype=torch.float32).reshape(-1, 1, 1))

    def forward(self, x):
        return (x - self.mean) * self.std


class EmbeddingNet(nn.Module):
    """[input_norm ->] backbone.forward_features -> a new linear layer (std `init_std` when given)."""

    def __init__(self, backbone, out_dim, init_std=None, input_norm=None):
        super().__init__()
        self.input_norm = input_norm if input_norm is not None else nn.Identity()
        # The embedding layer takes the class layer's place: a layer outside the graph gets no gradient,
        # which DDP's reduction would wait for.
        backbone.classifier = nn.Identity()
        self.backbone = backbone
        self.head = nn.Linear(backbone.feature_dim, out_dim)
        if init_std is not None:
            nn.init.normal_(self.head.weight, std=init_std)
            nn.init.zeros_(self.head.bias)

    def forward(self, x):
        return self.head(self.backbone.forward_features(self.input_norm(x)))
