"""ImageNet-scale backbones: torchvision's ResNet-18 and ResNet-50 (ImageNet stem: 7x7/2 conv, 3x3/2
max-pool), the ResNet-10 of the ImageNet-LT code (torchvision's ResNet with BasicBlock x [1, 1, 1, 1],
512-d features; DB-OT), and timm's Inception-ResNet-v2 (WebVision; DivideMix / CSOT).

Each keeps its library's modules and initialisation, regrouped to the `Classifier` interface: the
residual stages (or Inception's three resolution stages) are one `stages` sequence, so manifold mixup
mixes after the first two of them as on the CIFAR ResNets, and `checkpoint_aliases` map the library's
parameter names onto these, so its weights files load (`runner.models.weights.load_weights`).
"""

from __future__ import annotations

from collections import OrderedDict

from torch import nn

from runner.models.base import Classifier

RESNETS = {  # name -> (torchvision block, blocks per stage)
    "resnet10": ("BasicBlock", [1, 1, 1, 1]),
    "resnet18": ("BasicBlock", [2, 2, 2, 2]),
    "resnet50": ("Bottleneck", [3, 4, 6, 3]),
}


class ImageNetResNet(Classifier):
    """torchvision's ResNet (`name` in RESNETS) for `num_classes`; a first conv for `in_channels` other
    than 3. `feature_maps` are the last stage's (stride 32), pooled globally as torchvision does."""

    checkpoint_aliases = (("fc.", "classifier."), *((f"layer{i + 1}.", f"stages.{i}.") for i in range(4)))

    def __init__(self, name, in_channels, num_classes):
        super().__init__()
        from torchvision.models import resnet  # imported here: it costs seconds at every CLI start

        block, layers = RESNETS[name]
        net = resnet.ResNet(getattr(resnet, block), layers, num_classes=num_classes)
        self.conv1 = net.conv1
        if in_channels != 3:
            self.conv1 = nn.Conv2d(in_channels, 64, 7, 2, 3, bias=False)
            nn.init.kaiming_normal_(self.conv1.weight, mode="fan_out", nonlinearity="relu")  # as torchvision
        self.bn1, self.relu, self.maxpool = net.bn1, net.relu, net.maxpool
        self.stages = nn.Sequential(net.layer1, net.layer2, net.layer3, net.layer4)
        self.feature_dim = net.fc.in_features
        self.classifier = net.fc

    def feature_maps(self, x):
        return self.stages(self.maxpool(self.relu(self.bn1(self.conv1(x)))))


# timm's Inception-ResNet-v2 feature layers in forward order, cut into the stride-8, stride-16 and
# stride-32 stages (after the 35x35 `repeat` and the 17x17 `repeat_1` blocks).
INCEPTION_STAGES = (
    ("conv2d_1a", "conv2d_2a", "conv2d_2b", "maxpool_3a", "conv2d_3b", "conv2d_4a", "maxpool_5a", "mixed_5b",
     "repeat"),
    ("mixed_6a", "repeat_1"),
    ("mixed_7a", "repeat_2", "block8", "conv2d_7b"),
)  # fmt: skip
INCEPTION_MIN_SIDE = 75  # the unpadded stem and reductions need 75 px to leave a 1x1 map


class InceptionResNetV2(Classifier):
    """timm's `inception_resnet_v2` (1536-d features) for `num_classes`; inputs of at least 75 px."""

    def __init__(self, in_channels, num_classes):
        super().__init__()
        import timm  # imported here: it takes seconds, and only this network needs it

        net = timm.create_model("inception_resnet_v2", num_classes=num_classes, in_chans=in_channels)
        self.stages = nn.Sequential(
            *(nn.Sequential(OrderedDict((n, getattr(net, n)) for n in names)) for names in INCEPTION_STAGES)
        )
        self.feature_dim = net.num_features
        self.classifier = net.classif
        self.checkpoint_aliases = (
            *((f"{n}.", f"stages.{i}.{n}.") for i, names in enumerate(INCEPTION_STAGES) for n in names),
            ("classif.", "classifier."),
            ("last_linear.", "classifier."),  # the Cadene `pretrainedmodels` weights DivideMix starts from
        )

    def feature_maps(self, x):
        return self.stages(x)
