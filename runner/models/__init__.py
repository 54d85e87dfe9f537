"""Networks. Each has `forward_features(x) -> (B, D)`, a linear `classifier`, and `feature_dim`;
conv nets also have `feature_maps(x) -> (B, C, h, w)` (the maps before global pooling, for CAM)."""

from __future__ import annotations

import math

from torch import nn

from runner.models.base import Classifier
from runner.models.cifar import NIN, PreActResNet18, ResNet32, ResNeXt29, WideResNet
from runner.schema import ConfigError


class MLP(Classifier):
    def __init__(self, input_shape, num_classes, hidden=(256, 128), dropout=0.0):
        super().__init__()
        layers, width = [nn.Flatten()], math.prod(input_shape)
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU(inplace=True), nn.Dropout(dropout)]
            width = h
        self.body = nn.Sequential(*layers)
        self.feature_dim = width
        self.classifier = nn.Linear(width, num_classes)

    def forward_features(self, x):
        return self.body(x)


class ConvNet(Classifier):
    """Small CNN: conv3x3-BN-ReLU blocks, 2x2 max-pool between blocks, global average pooling."""

    def __init__(self, input_shape, num_classes, channels=(32, 64, 128)):
        super().__init__()
        layers, c_in = [], input_shape[0]
        for i, c in enumerate(channels):
            layers += [nn.Conv2d(c_in, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU(inplace=True)]
            if i < len(channels) - 1:
                layers.append(nn.MaxPool2d(2))
            c_in = c
        self.body = nn.Sequential(*layers)
        self.feature_dim = c_in
        self.classifier = nn.Linear(c_in, num_classes)

    def feature_maps(self, x):
        return self.body(x)


CIFAR_MODELS = {
    "preactresnet18": PreActResNet18,
    "wrn16_8": lambda c_in, k: WideResNet(c_in, k, depth=16, widen=8),
    "resnext29": lambda c_in, k: ResNeXt29(c_in, k, cardinality=4, width=24),
    "resnet32": ResNet32,
    "nin": NIN,
}
MODELS = ("mlp", "cnn", *CIFAR_MODELS)


def build_model(cfg, input_shape, num_classes: int) -> nn.Module:
    """The network named `cfg.name` for inputs of `input_shape` (per sample) and `num_classes` outputs."""
    if cfg.name == "mlp":
        return MLP(input_shape, num_classes, tuple(cfg.hidden), cfg.dropout)
    if cfg.name not in MODELS:
        raise ConfigError(f"model.name={cfg.name!r} is unknown; choices: {', '.join(MODELS)}")
    if len(input_shape) != 3:
        raise ConfigError(
            f"model={cfg.name} needs image inputs (C, H, W); this dataset gives {tuple(input_shape)}"
        )
    if cfg.name == "cnn":
        return ConvNet(input_shape, num_classes, tuple(cfg.channels))
    return CIFAR_MODELS[cfg.name](input_shape[0], num_classes)
