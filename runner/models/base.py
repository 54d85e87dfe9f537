"""The interface every network follows: features, then one linear classifier."""

import torch
from torch import nn


class Classifier(nn.Module):
    """`forward(x) = classifier(forward_features(x))`; conv nets define `feature_maps` and pool it."""

    feature_dim: int

    def feature_maps(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} has no spatial feature maps")

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        return self.feature_maps(x).mean(dim=(2, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.forward_features(x))
