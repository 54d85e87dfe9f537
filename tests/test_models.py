"""The networks: the CIFAR nets against the authors' architectures (parameter counts, layouts), the
ImageNet backbones against torchvision / timm, and `model.pretrained` weights files."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from runner.checks import ConfigError
from runner.methods.mixup import default_mixup_layers, manifold_mixup
from runner.models import build_model
from runner.models.cifar import SameAvgPool2d, SameMaxPool2d
from runner.schema import model_config


def model(name, shape=(3, 32, 32), classes=100, **cfg):
    torch.manual_seed(0)
    return build_model(OmegaConf.create({"name": name, **cfg}), shape, classes).eval()


def n_params(net):
    return sum(p.numel() for p in net.parameters())


# Parameter counts of the authors' models for 100 classes, as printed by their definitions
# (snu-mllab/Co-Mixup models/{preresnet,wide_resnet,resnext}.py; PuzzleMix's preresnet and
# wide_resnet are the same): preactresnet18(100) 11,217,316; wrn16_8(100) 11,012,036;
# resnext29_4_24(100) 4,937,252. The helpers below re-derive them from the layer lists.
def bn(c):
    return 2 * c


def conv(c_in, c_out, k, groups=1, bias=False):
    return c_in // groups * c_out * k * k + (c_out if bias else 0)


def preact_resnet18_count(k):
    """conv3x3(3, 64); per block BN, conv3x3 (strided), BN, conv3x3 and a bias-free 1x1 projection when
    the shape changes; stages 64/128/256/512 x 2 blocks; no final BN; Linear(512, k)."""
    total, c = conv(3, 64, 3), 64
    for w in (64, 128, 256, 512):
        for i in range(2):
            c_in = c if i == 0 else w
            total += bn(c_in) + conv(c_in, w, 3) + bn(w) + conv(w, w, 3)
            total += conv(c_in, w, 1) if c_in != w else 0
        c = w
    return total + 512 * k + k


def wrn16_8_count(k):
    """conv3x3(3, 16) with bias; per block BN, conv3x3, BN, conv3x3 (all convs with bias) and a 1x1
    projection with bias when the shape changes; stages 128/256/512 x 2 blocks; BN; Linear(512, k)."""
    total, c = conv(3, 16, 3, bias=True), 16
    for w in (128, 256, 512):
        for i in range(2):
            c_in = c if i == 0 else w
            total += bn(c_in) + conv(c_in, w, 3, bias=True) + bn(w) + conv(w, w, 3, bias=True)
            total += conv(c_in, w, 1, bias=True) if c_in != w else 0
        c = w
    return total + bn(512) + 512 * k + k


def resnext29_4x24_count(k):
    """conv3x3(3, 64) + BN; stages of planes 64/128/256 x 3 bottlenecks: 1x1 to 4 * D (D = planes *
    24 / 64), grouped 3x3 (4 groups), 1x1 to 4 * planes, BN after each, 1x1 + BN projection on each
    stage's first block; Linear(1024, k)."""
    total, c = conv(3, 64, 3) + bn(64), 64
    for planes in (64, 128, 256):
        inner, out = 4 * (planes * 24 // 64), 4 * planes
        for i in range(3):
            c_in = c if i == 0 else out
            total += conv(c_in, inner, 1) + bn(inner) + conv(inner, inner, 3, groups=4) + bn(inner)
            total += conv(inner, out, 1) + bn(out) + (conv(c_in, out, 1) + bn(out) if i == 0 else 0)
        c = out
    return total + 1024 * k + k


@pytest.mark.parametrize(
    "name, authors, count",
    [
        ("preactresnet18", 11_217_316, preact_resnet18_count),
        ("wrn16_8", 11_012_036, wrn16_8_count),
        ("resnext29", 4_937_252, resnext29_4x24_count),
    ],
)
def test_cifar_nets_have_the_authors_parameter_counts(name, authors, count):
    assert count(100) == authors
    assert n_params(model(name)) == authors


@torch.no_grad()
def test_resnext29_is_4x24d_at_the_authors_width():
    net = model("resnext29")
    assert [net.blocks[i].c_out for i in (2, 5, 8)] == [256, 512, 1024]
    assert [net.blocks[i].body[2].out_channels for i in (0, 3, 6)] == [96, 192, 384]  # C * D
    assert net.feature_maps(torch.randn(1, 3, 32, 32)).shape == (1, 1024, 8, 8)


@torch.no_grad()
def test_preact_resnet18_pools_the_last_block_as_it_is():
    net = model("preactresnet18")
    x = torch.randn(1, 3, 32, 32)
    maps = net.stages(net.stem(x))
    assert (maps < 0).any()  # no BN-ReLU after the last block
    assert torch.allclose(net(x), net.classifier(maps.mean((2, 3))), atol=1e-6)


def test_wrn_block_strides_its_second_conv_and_shortcuts_the_raw_input():
    net = model("wrn16_8")
    block = net.stages[1][0]  # 128 -> 256, stride 2
    assert block.conv1.stride == (1, 1) and block.conv2.stride == (2, 2)
    assert block.shortcut.stride == (2, 2) and block.shortcut.bias is not None
    seen = {}  # the shortcut's input is the block's input
    block.shortcut.register_forward_hook(lambda m, inputs, out: seen.__setitem__("in", inputs[0]))
    block.register_forward_hook(lambda m, inputs, out: seen.__setitem__("block_in", inputs[0]))
    with torch.no_grad():
        net(torch.randn(1, 3, 32, 32))
    assert torch.equal(seen["in"], seen["block_in"])
    assert net.post[0].momentum == 0.9  # the authors' final BN


@pytest.mark.parametrize("name, maps", [("preactresnet18", (512, 4, 4)), ("wrn16_8", (512, 8, 8))])
@torch.no_grad()
def test_stride_two_stem_for_64px_inputs(name, maps):
    net = model(name, (3, 64, 64), 200, stem_stride=2)
    maps_ = net.feature_maps(torch.randn(1, 3, 64, 64))
    assert maps_.shape == (1, *maps)  # the 32 px maps of CIFAR after the stem
    assert net.classifier(maps_.mean((2, 3))).shape == (1, 200)
    with pytest.raises(ConfigError, match=r"model.stem_stride=3 .*1, 2"):
        model(name, stem_stride=3)


def test_same_pooling_pads_after_as_tensorflow():
    x = torch.arange(16.0).reshape(1, 1, 4, 4)
    # SAME with a 3x3/2 window on 4 cells: 2 outputs, the one padding cell after; windows rows/cols
    # {0, 1, 2} and {2, 3}
    assert SameMaxPool2d(3, 2)(x).flatten().tolist() == [10.0, 11.0, 14.0, 15.0]
    windows = [x[0, 0, r, :][:, c] for r in ([0, 1, 2], [2, 3]) for c in ([0, 1, 2], [2, 3])]
    assert torch.allclose(SameAvgPool2d(3, 2)(x).flatten(), torch.stack([w.mean() for w in windows]))
    assert SameMaxPool2d(3, 2)(-x).flatten().tolist() == [0.0, -2.0, -8.0, -10.0]  # padding never wins


@torch.no_grad()
def test_nin_embeds_relu_of_the_pooled_linear_maps():
    net = model("nin")
    assert isinstance(net.body[-1], torch.nn.Conv2d)  # the last 1x1 conv is linear
    x = torch.randn(2, 3, 32, 32)
    maps = net.feature_maps(x)
    assert maps.shape == (2, 192, 8, 8) and (maps < 0).any()
    feats = net.forward_features(x)
    assert torch.equal(feats, torch.relu(maps.mean((2, 3))))
    assert torch.allclose(net(x), net.classifier(feats))
    assert len(default_mixup_layers(net)) == 2  # manifold mixup after both poolings


def check_backbone(net, x, dim, side, classes):
    """One forward: its feature maps (the stages' output), features (the classifier's input) and
    logits have the interface's shapes and relations; the logits are returned."""
    seen = {}
    net.stages.register_forward_hook(lambda m, inputs, out: seen.__setitem__("maps", out))
    net.classifier.register_forward_hook(lambda m, inputs, out: seen.__setitem__("feats", inputs[0]))
    logits = net(x)
    assert seen["maps"].shape == (len(x), dim, side, side) and logits.shape == (len(x), classes)
    assert torch.allclose(seen["feats"], seen["maps"].mean((2, 3))) and net.feature_dim == dim
    assert net.feature_maps(x[:0]).shape == (0, dim, side, side)  # empty: no second real forward
    assert default_mixup_layers(net) == list(net.stages)[:2]  # manifold mixup as on the CIFAR ResNets
    return logits


# torchvision's counts for 1000 classes. ResNet-10 is ResNet-18 less one basic block per stage
# (2 * 9 c^2 + 4 c each): 11,689,512 - (73,984 + 295,424 + 1,180,672 + 4,720,640) = 5,418,792.
@pytest.mark.parametrize("name, dim, params", [("resnet10", 512, 5_418_792), ("resnet50", 2048, 25_557_032)])
@torch.no_grad()
def test_imagenet_resnets(name, dim, params):
    net = model(name, (3, 64, 64), 1000)
    assert n_params(net) == params
    check_backbone(net, torch.randn(1, 3, 64, 64), dim, 2, 1000)


def test_resnet18_is_torchvisions_and_loads_its_weights(tmp_path):
    import torchvision

    torch.manual_seed(1)
    reference = torchvision.models.resnet18().eval()
    assert n_params(reference) == 11_689_512
    torch.save(reference.state_dict(), tmp_path / "resnet18.pth")
    net = model("resnet18", (3, 64, 64), 1000, pretrained=str(tmp_path / "resnet18.pth"))
    assert n_params(net) == 11_689_512
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        assert torch.allclose(check_backbone(net, x, 512, 2, 1000), reference(x), atol=1e-5)
    net.train()  # manifold mixup hooks a stage of the new nets
    logits, y = manifold_mixup(net, x, torch.eye(1000)[:2], layers=[net.stages[1]], rng=0)
    assert logits.shape == (2, 1000) and torch.allclose(y.sum(1), torch.ones(2))


def test_inception_resnet_v2_is_timms_and_loads_its_weights(tmp_path):
    import timm

    torch.manual_seed(1)
    reference = timm.create_model("inception_resnet_v2", num_classes=50).eval()
    torch.save({"state_dict": reference.state_dict()}, tmp_path / "irv2.pth")
    net = model("inception_resnet_v2", (3, 75, 75), 50, pretrained=str(tmp_path / "irv2.pth"))
    x = torch.randn(1, 3, 75, 75)
    with torch.no_grad():
        assert torch.allclose(check_backbone(net, x, 1536, 1, 50), reference(x), atol=1e-4)
    with pytest.raises(ConfigError, match="at least 75x75 px"):
        model("inception_resnet_v2", (3, 64, 64), 50)


def test_pretrained_weights_file(tmp_path):
    source = model("cnn", (3, 8, 8), 10, channels=[4, 8])
    runner_ckpt = tmp_path / "last.pt"  # the runner's checkpoint layout
    rng = {"numpy": np.random.get_state()}  # as a checkpoint holds it: numpy arrays
    torch.save({"model": source.state_dict(), "epoch": 3, "rng": rng}, runner_ckpt)
    net = model("cnn", (3, 8, 8), 10, channels=[4, 8], pretrained=str(runner_ckpt))
    assert all(torch.equal(a, b) for a, b in zip(net.state_dict().values(), source.state_dict().values()))

    ddp = tmp_path / "ddp.pth"  # a 'state_dict' key and DDP's module. prefix
    torch.save({"state_dict": {f"module.{k}": v for k, v in source.state_dict().items()}}, ddp)
    net = model("cnn", (3, 8, 8), 5, channels=[4, 8], pretrained=str(ddp))  # 5 classes: a new head
    assert torch.equal(net.body[0].weight, source.body[0].weight)
    assert net.classifier.weight.shape == (5, 8)
    fresh = model("cnn", (3, 8, 8), 5, channels=[4, 8])
    assert torch.equal(net.classifier.weight, fresh.classifier.weight)

    with pytest.raises(ConfigError) as e:
        model("cnn", (3, 8, 8), 10, channels=[4, 4], pretrained=str(runner_ckpt))
    assert "mis-shaped: body.4.weight" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="does not fit the ResNet32: missing: .*unexpected: body"):
        model("resnet32", pretrained=str(runner_ckpt))
    missing = tmp_path / "nowhere" / "w.pth"
    with pytest.raises(ConfigError, match=f"model.pretrained='{missing}': no such file$"):
        model("resnet18", (3, 64, 64), pretrained=str(missing))
    with pytest.raises(ConfigError, match="must be false or the path"):
        model("resnet18", (3, 64, 64), pretrained=True)
    from safetensors.torch import save_file

    save_file(source.state_dict(), tmp_path / "w.safetensors")
    net = model("cnn", (3, 8, 8), 10, channels=[4, 8], pretrained=str(tmp_path / "w.safetensors"))
    assert torch.equal(net.classifier.weight, source.classifier.weight)
    (tmp_path / "text.pth").write_text("not weights")
    with pytest.raises(ConfigError, match="not a weights file .it starts with b'not '"):
        model("cnn", (3, 8, 8), 10, channels=[4, 8], pretrained=str(tmp_path / "text.pth"))
    pickled = tmp_path / "object.pth"
    torch.save({"model": source.state_dict(), "args": pickle.PickleError("x")}, pickled)
    with pytest.raises(ConfigError, match="not a readable weights file"):
        model("cnn", (3, 8, 8), 10, channels=[4, 8], pretrained=str(pickled))


def test_a_model_config_s_unknown_key_is_named():  # every option composes: tests/test_config.py
    with pytest.raises(ConfigError, match="unknown key model.stem_stride"):
        model_config(OmegaConf.create({"name": "resnet18", "stem_stride": 2}))
