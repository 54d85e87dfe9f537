"""The CIFAR networks the papers use (32x32 inputs), built as in the authors' code: PreAct ResNet-18,
WRN-16-8 and ResNeXt-29 (4x24d) of the Co-Mixup / Puzzle Mix repositories (snu-mllab), ResNet-32, and
the NIN of the hierarchical-hash code (Deep-Hash-Table-CVPR19). Each exposes `feature_maps`,
`forward_features`, `classifier` and `feature_dim` (see `runner.models.base.Classifier`).

`stem_stride=2` strides the first conv, as the Co-Mixup code does for Tiny-ImageNet (64 px in, the
32 px maps of CIFAR after the stem). The authors pool the last maps with a fixed window (4 or 8) that
equals global average pooling at the sizes they train on; global pooling here keeps that and accepts
any input size.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from runner.models.base import Classifier


def _bn_relu(c):
    return nn.Sequential(nn.BatchNorm2d(c), nn.ReLU(inplace=True))


def _projection(c_in, c_out, stride):
    """A post-activation block's shortcut: identity, or a strided 1x1 conv + BN when the shape changes."""
    if stride == 1 and c_in == c_out:
        return nn.Identity()
    return nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))


def _stages(block, c: int, widths, n: int, **kw) -> nn.Sequential:
    """A `_stage` of `n` blocks per width in `widths` from `c` channels, the first at stride 1, the
    others halving the resolution."""
    stages = []
    for i, w in enumerate(widths):
        stages.append(_stage(block, c, w, n, 1 if i == 0 else 2, **kw))
        c = w
    return nn.Sequential(*stages)


def _stage(block, c_in, c_out, n, stride, **kw):
    layers = [block(c_in, c_out, stride, **kw)] + [block(c_out, c_out, 1, **kw) for _ in range(n - 1)]
    return nn.Sequential(*layers)


class PreActBlock(nn.Module):
    """Pre-activation basic block (He et al. 2016): BN-ReLU, conv3x3 (strided), BN-ReLU, conv3x3; the
    projection shortcut (1x1, no BN) reads the pre-activated input, as in the authors' code."""

    def __init__(self, c_in, c_out, stride=1):
        super().__init__()
        self.pre1, self.conv1 = _bn_relu(c_in), nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.pre2, self.conv2 = _bn_relu(c_out), nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.shortcut = None
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Conv2d(c_in, c_out, 1, stride, bias=False)

    def forward(self, x):
        out = self.pre1(x)
        skip = self.shortcut(out) if self.shortcut is not None else x
        return self.conv2(self.pre2(self.conv1(out))) + skip


class PreActResNet18(Classifier):
    """PreAct ResNet-18 of the Co-Mixup / Puzzle Mix code: conv3x3 stem (no BN), four stages of two
    pre-act blocks (64-128-256-512), and no BN-ReLU after the last block: it is pooled as it is."""

    def __init__(self, in_channels, num_classes, stem_stride=1):
        super().__init__()
        self.stem = nn.Conv2d(in_channels, 64, 3, stem_stride, 1, bias=False)
        self.stages = _stages(PreActBlock, 64, (64, 128, 256, 512), 2)
        self.feature_dim = 512
        self.classifier = nn.Linear(512, num_classes)

    def feature_maps(self, x):
        return self.stages(self.stem(x))


class WideBlock(nn.Module):
    """The authors' `wide_basic`: BN-ReLU, conv3x3, BN-ReLU, conv3x3 carrying the stride (the second
    conv, not the first); convs with bias; the shortcut (1x1 conv with bias when the shape changes)
    reads the block's raw input, not the pre-activated one."""

    def __init__(self, c_in, c_out, stride=1):
        super().__init__()
        self.pre1, self.conv1 = _bn_relu(c_in), nn.Conv2d(c_in, c_out, 3, 1, 1)
        self.pre2, self.conv2 = _bn_relu(c_out), nn.Conv2d(c_out, c_out, 3, stride, 1)
        self.shortcut = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Conv2d(c_in, c_out, 1, stride)

    def forward(self, x):
        return self.conv2(self.pre2(self.conv1(self.pre1(x)))) + self.shortcut(x)


class WideResNet(Classifier):
    """WRN-depth-widen of the Co-Mixup / Puzzle Mix code (dropout removed there too): conv3x3 stem
    (with bias) to 16 channels, three stages of (depth - 4) / 6 `WideBlock`s (16k, 32k, 64k), then
    BN-ReLU. That last BN has momentum 0.9 in the authors' code, i.e. its running statistics are
    mostly the last batch's; kept, since the test accuracy they report is evaluated with them."""

    def __init__(self, in_channels, num_classes, depth=16, widen=8, stem_stride=1):
        super().__init__()
        n = (depth - 4) // 6
        widths = [16 * widen, 32 * widen, 64 * widen]
        self.stem = nn.Conv2d(in_channels, 16, 3, stem_stride, 1)
        self.stages = _stages(WideBlock, 16, widths, n)
        c = widths[-1]
        self.post = nn.Sequential(nn.BatchNorm2d(c, momentum=0.9), nn.ReLU(inplace=True))
        self.feature_dim = c
        self.classifier = nn.Linear(c, num_classes)

    def feature_maps(self, x):
        return self.post(self.stages(self.stem(x)))


class ResNeXtBlock(nn.Module):
    """ResNeXt bottleneck (type C): 1x1 to C*D channels, grouped 3x3 (C groups, strided), 1x1 to
    4 * planes, each conv followed by BN (ReLU on the first two), ReLU after the sum; D =
    floor(planes * base_width / 64). Projection shortcut (1x1 conv + BN) when the shape changes."""

    def __init__(self, c_in, planes, stride, cardinality, base_width):
        super().__init__()
        inner = cardinality * (planes * base_width // 64)
        c_out = 4 * planes
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
    """ResNeXt-29 (Xie et al. 2017) as in the Co-Mixup code: conv3x3-BN-ReLU stem (64), three stages
    of three bottlenecks with planes 64/128/256, so 256/512/1024 output channels (4x24d: C*D =
    96/192/384 inside). One flat `blocks` sequence. Initialised as the authors: convs N(0, 2 / (k^2
    out_channels)), BN (1, 0), the classifier He-normal with zero bias."""

    def __init__(self, in_channels, num_classes, cardinality=4, base_width=24, stem_stride=1):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(in_channels, 64, 3, stem_stride, 1, bias=False), _bn_relu(64))
        blocks, c = [], 64
        for stage, planes in enumerate((64, 128, 256)):
            for i in range(3):
                stride = 2 if (stage > 0 and i == 0) else 1
                blocks.append(ResNeXtBlock(c, planes, stride, cardinality, base_width))
                c = blocks[-1].c_out
        self.blocks = nn.Sequential(*blocks)
        self.feature_dim = c
        self.classifier = nn.Linear(c, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                fan_out = m.kernel_size[0] * m.kernel_size[1] * m.out_channels
                nn.init.normal_(m.weight, 0.0, math.sqrt(2.0 / fan_out))
        nn.init.kaiming_normal_(self.classifier.weight)
        nn.init.zeros_(self.classifier.bias)

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
        self.stages = _stages(BasicBlock, 16, (16, 32, 64), 5)
        self.feature_dim = 64
        self.classifier = nn.Linear(64, num_classes)

    def feature_maps(self, x):
        return self.stages(self.stem(x))


def _same_padding(x, kernel, stride):
    """TensorFlow 'SAME' padding (left, right, top, bottom) of a pooling window: the output has
    ceil(n / stride) cells and the odd cell of the total padding goes after, not before."""
    pads = []
    for n in reversed(x.shape[-2:]):  # F.pad takes the last dimension first
        total = max((-(-n // stride) - 1) * stride + kernel - n, 0)
        pads += [total // 2, total - total // 2]
    return pads


class SameMaxPool2d(nn.MaxPool2d):
    """Max pooling with TensorFlow 'SAME' padding (padding never wins the max)."""

    def forward(self, x):
        return super().forward(F.pad(x, _same_padding(x, self.kernel_size, self.stride), value=-math.inf))


class SameAvgPool2d(nn.AvgPool2d):
    """Average pooling with TensorFlow 'SAME' padding: each window averages its in-image cells only."""

    def forward(self, x):
        pad = _same_padding(x, self.kernel_size, self.stride)
        count = super().forward(F.pad(x.new_ones((1, 1, *x.shape[-2:])), pad))
        return super().forward(F.pad(x, pad)) / count


class NIN(Classifier):
    """Network in Network of the hierarchical-hash authors' Cifar code (`conv1_32`): three mlpconv
    blocks (5x5 192-160-96, 5x5 192-192-192, 3x3 192-192) with leaky ReLU (slope 1/5.5) and 'SAME'
    convs, 3x3/2 max then average pooling with TensorFlow 'SAME' padding, each followed by dropout
    0.5. The last 1x1 conv is linear: `feature_maps` are its output. The embedding the authors' hash
    and metric heads read is ReLU(global mean of those maps), so that is `forward_features` and the
    linear classifier sits on it. Convs are initialised as TF-slim's variance scaling (truncated
    normal, std sqrt(1.3 * 2 / fan_in)) with zero biases."""

    def __init__(self, in_channels, num_classes):
        super().__init__()

        def mlpconv(c_in, k, widths, last_linear=False):
            layers = []
            for i, w in enumerate(widths):
                layers.append(nn.Conv2d(c_in, w, k if i == 0 else 1, padding=k // 2 if i == 0 else 0))
                if not (last_linear and i == len(widths) - 1):
                    layers.append(nn.LeakyReLU(1 / 5.5, inplace=True))
                c_in = w
            return layers

        self.body = nn.Sequential(
            *mlpconv(in_channels, 5, (192, 160, 96)),
            SameMaxPool2d(3, 2),
            nn.Dropout(0.5),
            *mlpconv(96, 5, (192, 192, 192)),
            SameAvgPool2d(3, 2),
            nn.Dropout(0.5),
            *mlpconv(192, 3, (192, 192), last_linear=True),
        )
        for m in self.body:
            if isinstance(m, nn.Conv2d):
                std = math.sqrt(1.3 * 2.0 / (m.in_channels * m.kernel_size[0] * m.kernel_size[1]))
                nn.init.trunc_normal_(m.weight, 0.0, std, -2 * std, 2 * std)
                nn.init.zeros_(m.bias)
        self.feature_dim = 192
        self.classifier = nn.Linear(192, num_classes)

    def feature_maps(self, x):
        return self.body(x)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.feature_maps(x).mean(dim=(2, 3)))
