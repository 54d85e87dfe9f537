"""The interface every network follows: features, then one linear classifier."""

import torch
from torch import nn


class Classifier(nn.Module):
    """`forward(x) = classifier(forward_features(x))`; conv nets define `feature_maps` and pool it.

    `checkpoint_aliases`: (foreign prefix, our prefix) pairs that rename the parameters of a weights
    file saved by the library a network comes from (see `runner.models.weights.load_weights`).
    """

    feature_dim: int
    checkpoint_aliases: tuple[tuple[str, str], ...] = ()

    def feature_maps(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} has no spatial feature maps")

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        return self.feature_maps(x).mean(dim=(2, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.forward_features(x))
