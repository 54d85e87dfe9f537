"""Networks. Each has `forward_features(x) -> (B, D)`, a linear `classifier`, and `feature_dim`;
conv nets also have `feature_maps(x) -> (B, C, h, w)` (the maps before global pooling, for CAM).
CIFAR-size nets are in `runner.models.cifar`, ImageNet-size backbones in `runner.models.imagenet`."""

from __future__ import annotations

import math

from torch import nn

from runner.checks import ConfigError
from runner.models.base import Classifier
from runner.models.cifar import NIN, BasicBlock, PreActResNet18, ResNet32, ResNeXt29, ResNeXtBlock, WideResNet
from runner.models.imagenet import INCEPTION_MIN_SIDE, RESNETS, ImageNetResNet, InceptionResNetV2
from runner.models.weights import load_weights
from runner.schema import POST_ACTIVATION, model_config


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

    def __init__(self, in_channels, num_classes, channels=(32, 64, 128)):
        super().__init__()
        layers, c_in = [], in_channels
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


IMAGE_MODELS = {  # name -> builder(in_channels, num_classes, checked model config)
    "cnn": lambda c, k, m: ConvNet(c, k, tuple(m.channels)),
    "preactresnet18": lambda c, k, m: PreActResNet18(c, k, m.stem_stride),
    "wrn16_8": lambda c, k, m: WideResNet(c, k, depth=16, widen=8, stem_stride=m.stem_stride),
    "resnext29": lambda c, k, m: ResNeXt29(c, k, cardinality=4, base_width=24, stem_stride=m.stem_stride),
    "resnet32": lambda c, k, m: ResNet32(c, k),
    "nin": lambda c, k, m: NIN(c, k),
    **{name: (lambda c, k, m, name=name: ImageNetResNet(name, c, k)) for name in RESNETS},
    "inception_resnet_v2": lambda c, k, m: InceptionResNetV2(c, k),
}
MIN_SIDE = {"inception_resnet_v2": INCEPTION_MIN_SIDE}
MODELS = ("mlp", *IMAGE_MODELS)


def residual_branch_norms(model: nn.Module) -> list[nn.BatchNorm2d]:
    """The last batch norm of the residual branch of each post-activation block of `model` (torchvision's
    Bottleneck / BasicBlock, the CIFAR ResNet's and ResNeXt's blocks), in module order."""
    from torchvision.models import resnet

    norms = []
    for block in model.modules():
        if isinstance(block, resnet.Bottleneck):
            norms.append(block.bn3)
        elif isinstance(block, resnet.BasicBlock):
            norms.append(block.bn2)
        elif isinstance(block, (BasicBlock, ResNeXtBlock)):
            norms.append(block.body[-1])
    return norms


def zero_init_residual(model: nn.Module, name: str) -> None:
    """`model.zero_init_residual`: zero the scale of each residual branch's last batch norm, so every
    block starts as the identity (Goyal et al. 2017; Co-Mixup's ImageNet code zeroes bn3 / bn2)."""
    norms = residual_branch_norms(model)
    if not norms:
        raise ConfigError(
            f"model.zero_init_residual=true: model={name} has no post-activation residual blocks (no batch "
            f"norm ends a residual branch); use it with {', '.join(POST_ACTIVATION)}"
        )
    for norm in norms:
        nn.init.zeros_(norm.weight)


def build_model(cfg, input_shape, num_classes: int) -> nn.Module:
    """The network named `cfg.name` for inputs of `input_shape` (per sample) and `num_classes` outputs,
    started from the weights file `cfg.pretrained` when one is named."""
    if cfg.name not in MODELS:
        raise ConfigError(f"model.name={cfg.name!r} is unknown; choices: {', '.join(MODELS)}")
    spec = model_config(cfg)
    if cfg.name == "mlp":
        model = MLP(input_shape, num_classes, tuple(spec.hidden), spec.dropout)
    else:
        if len(input_shape) != 3:
            raise ConfigError(
                f"model={cfg.name} needs image inputs (C, H, W); this dataset gives {tuple(input_shape)}"
            )
        side = MIN_SIDE.get(cfg.name, 1)
        if min(input_shape[1:]) < side:
            raise ConfigError(
                f"model={cfg.name} needs images of at least {side}x{side} px; this dataset gives "
                f"{tuple(input_shape)} (set dataset.image_size)"
            )
        model = IMAGE_MODELS[cfg.name](input_shape[0], num_classes, spec)
    if spec.zero_init_residual:
        zero_init_residual(model, cfg.name)
    if spec.pretrained:
        load_weights(model, spec.pretrained)
    return model
