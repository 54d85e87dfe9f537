"""The network of the noisy-label methods (`runner.tasks.noisy_labels`)."""

from __future__ import annotations

from torch import nn


class NoisyLabelNet(nn.Module):
    """The authors' `Net`: backbone features -> `head` (Linear(D, D), or identity) -> `classifier`.

    `forward(x)` gives logits; `forward(x, ssl=True)` gives (logits, z, p) with z the head output and
    p the SimSiam predictor's output (D -> hidden, BN, ReLU -> D; no projector, as the authors).
    `forward_features` is the head output, the feature of the structure terms.
    """

    def __init__(self, backbone: nn.Module, head: bool, predictor_hidden: int | None):
        super().__init__()
        dim = self.feature_dim = backbone.feature_dim
        self.classifier = backbone.classifier
        backbone.classifier = nn.Identity()  # the classifier reads the head's output
        self.backbone = backbone
        self.head = nn.Linear(dim, dim) if head else nn.Identity()
        self.predictor = None
        if predictor_hidden:
            self.predictor = nn.Sequential(
                nn.Linear(dim, predictor_hidden, bias=False),
                nn.BatchNorm1d(predictor_hidden),
                nn.ReLU(inplace=True),
                nn.Linear(predictor_hidden, dim),
            )

    def forward_features(self, x):
        return self.head(self.backbone.forward_features(x))

    def forward(self, x, ssl: bool = False):
        z = self.forward_features(x)
        logits = self.classifier(z)
        return (logits, z, self.predictor(z)) if ssl else logits
