"""The CIFAR networks the papers use (32x32 inputs): PreAct ResNet-18, WRN-16-8, ResNeXt-29 (4x24d),
ResNet-32 and the NIN of the hierarchical-hash paper. Each exposes `feature_maps`, `forward_features`,
`classifier` and `feature_dim` (see `runner.models.base.Classifier`)."""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from runner.models.base import Classifier


def _bn_relu(c):
    return nn.Sequential(nn.BatchNorm2d(c), nn.ReLU(inplace=True))


class PreActBlock(nn.Module):
    """Pre-activation basic block (He et al. 2016), optional dropout between the convs (WRN)."""

    def __init__(self, c_in, c_out, stride=1, dropout=0.0):
        super().__init__()
        self.pre1, self.conv1 = _bn_relu(c_in), nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.pre2, self.conv2 = _bn_relu(c_out), nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.shortcut = None
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Conv2d(c_in, c_out, 1, stride, bias=False)

    def forward(self, x):
        out = self.pre1(x)
        skip = self.shortcut(out) if self.shortcut is not None else x
        out = self.conv2(self.dropout(self.pre2(self.conv1(out))))
        return out + skip


def _projection(c_in, c_out, stride):
    """A post-activation block's shortcut: identity, or a strided 1x1 conv + BN when the shape changes."""
    if stride == 1 and c_in == c_out:
        return nn.Identity()
    return nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))


def _stage(block, c_in, c_out, n, stride, **kw):
    layers = [block(c_in, c_out, stride, **kw)] + [block(c_out, c_out, 1, **kw) for _ in range(n - 1)]
    return nn.Sequential(*layers)


class PreActResNet18(Classifier):
    def __init__(self, in_channels, num_classes):
        super().__init__()
        self.stem = nn.Conv2d(in_channels, 64, 3, 1, 1, bias=False)
        widths, stages, c = (64, 128, 256, 512), [], 64
        for i, w in enumerate(widths):
            stages.append(_stage(PreActBlock, c, w, 2, 1 if i == 0 else 2))
            c = w
        self.stages = nn.Sequential(*stages)
        self.post = _bn_relu(512)
        self.feature_dim = 512
        self.classifier = nn.Linear(512, num_classes)

    def feature_maps(self, x):
        return self.post(self.stages(self.stem(x)))


class WideResNet(Classifier):
    """WRN-depth-widen (Zagoruyko & Komodakis 2016): (depth - 4) / 6 pre-act blocks per stage."""

    def __init__(self, in_channels, num_classes, depth=16, widen=8, dropout=0.0):
        super().__init__()
        n = (depth - 4) // 6
        widths = [16 * widen, 32 * widen, 64 * widen]
        self.stem = nn.Conv2d(in_channels, 16, 3, 1, 1, bias=False)
        stages, c = [], 16
        for i, w in enumerate(widths):
            stages.append(_stage(PreActBlock, c, w, n, 1 if i == 0 else 2, dropout=dropout))
            c = w
        self.stages = nn.Sequential(*stages)
        self.post = _bn_relu(c)
        self.feature_dim = c
        self.classifier = nn.Linear(c, num_classes)

    def feature_maps(self, x):
        return self.post(self.stages(self.stem(x)))


class ResNeXtBlock(nn.Module):
    """Bottleneck with grouped 3x3 conv: 1x1 -> grouped 3x3 (cardinality groups) -> 1x1, x4 expansion."""

    def __init__(self, c_in, stride, cardinality, group_width):
        super().__init__()
        inner = cardinality * group_width
        c_out = 4 * inner
        self.body = nn.Sequential(
            nn.Conv2d(c_in, inner, 1, bias=False),
            _bn_relu(inner),
            nn.Conv2d(inner, inner, 3, stride, 1, groups=cardinality, bias=False),
            _bn_relu(inner),
            nn.Conv2d(inner, c_out, 1, bias=False),
            nn.BatchNorm2d(c_out),
        )
        self.shortcut = _projection(c_in, c_out, stride)
        self.c_out = c_out

    def forward(self, x):
        return F.relu(self.body(x) + self.shortcut(x))


class ResNeXt29(Classifier):
    """ResNeXt-29 (Xie et al. 2017): 3 stages x 3 bottleneck blocks, group width doubling per stage."""

    def __init__(self, in_channels, num_classes, cardinality=4, width=24):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(in_channels, 64, 3, 1, 1, bias=False), _bn_relu(64))
        blocks, c = [], 64
        for stage in range(3):
            for i in range(3):
                block = ResNeXtBlock(c, 2 if (stage > 0 and i == 0) else 1, cardinality, width * 2**stage)
                blocks.append(block)
                c = block.c_out
        self.blocks = nn.Sequential(*blocks)
        self.feature_dim = c
        self.classifier = nn.Linear(c, num_classes)

    def feature_maps(self, x):
        return self.blocks(self.stem(x))


class BasicBlock(nn.Module):
    """Post-activation basic block with a 1x1 projection shortcut when the shape changes."""

    def __init__(self, c_in, c_out, stride=1):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False),
            _bn_relu(c_out),
            nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False),
            nn.BatchNorm2d(c_out),
        )
        self.shortcut = _projection(c_in, c_out, stride)

    def forward(self, x):
        return F.relu(self.body(x) + self.shortcut(x))


class ResNet32(Classifier):
    """CIFAR ResNet-32 (He et al. 2016): 3 stages x 5 basic blocks, widths 16/32/64."""

    def __init__(self, in_channels, num_classes):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(in_channels, 16, 3, 1, 1, bias=False), _bn_relu(16))
        stages, c = [], 16
        for i, w in enumerate((16, 32, 64)):
            stages.append(_stage(BasicBlock, c, w, 5, 1 if i == 0 else 2))
            c = w
        self.stages = nn.Sequential(*stages)
        self.feature_dim = 64
        self.classifier = nn.Linear(64, num_classes)

    def feature_maps(self, x):
        return self.stages(self.stem(x))


class NIN(Classifier):
    """Network in Network as in the hierarchical-hash paper's Cifar code: three mlpconv blocks with
    leaky ReLU (slope 1/5.5), 3x3/2 max then average pooling, dropout 0.5; 192-d features."""

    def __init__(self, in_channels, num_classes):
        super().__init__()

        def mlpconv(c_in, k, widths):
            layers = []
            for i, w in enumerate(widths):
                layers += [
                    nn.Conv2d(c_in, w, k if i == 0 else 1, padding=k // 2 if i == 0 else 0),
                    nn.LeakyReLU(1 / 5.5, inplace=True),
                ]
                c_in = w
            return layers

        self.body = nn.Sequential(
            *mlpconv(in_channels, 5, (192, 160, 96)),
            nn.MaxPool2d(3, 2, 1),
            nn.Dropout(0.5),
            *mlpconv(96, 5, (192, 192, 192)),
            nn.AvgPool2d(3, 2, 1),
            nn.Dropout(0.5),
            *mlpconv(192, 3, (192, 192)),
        )
        self.feature_dim = 192
        self.classifier = nn.Linear(192, num_classes)

    def feature_maps(self, x):
        return self.body(x)
