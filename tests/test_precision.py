"""hardware.precision / channels_last / compile: compose, train on the CPU where torch supports them, and
keep the method hooks (saliency gradients, manifold mixup) working."""

import pytest
import torch
from omegaconf import OmegaConf

from runner.checks import ConfigError
from runner.data import Data, split_of
from runner.hardware import RunContext
from runner.models import build_model
from runner.schema import CNNConfig, HardwareConfig, TrainConfig
from runner.train import fit

CPU = torch.device("cpu")


class NullTracker:
    def log(self, *args, **kwargs):
        pass

    def truncate(self, *args):
        pass


def digits_like(n=96):
    g = torch.Generator().manual_seed(0)
    y = torch.arange(n) % 4
    x = torch.rand(n, 1, 8, 8, generator=g) * 0.2 + y.view(-1, 1, 1, 1) * 0.25
    split = split_of(x, y)
    return Data(split, split.subset([]), split, 4, (1, 8, 8))


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_each_precision_trains_a_cnn_channels_last(tmp_path, precision):
    torch.manual_seed(0)
    model = build_model(OmegaConf.structured(CNNConfig(name="cnn", channels=[8, 16])), (1, 8, 8), 4)
    before = [p.detach().clone() for p in model.parameters()]
    ctx = RunContext(CPU, tmp_path, NullTracker(), precision=precision, channels_last=True)
    assert ctx.grad_scaler().is_enabled() == (precision == "fp16")
    cfg = OmegaConf.structured(TrainConfig(epochs=2, batch_size=32, checkpoint=False, progress=False))
    metrics = fit(model, digits_like(), cfg, ctx)
    assert torch.isfinite(torch.tensor(metrics["train/loss"]))
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert model.body[0].weight.is_contiguous(memory_format=torch.channels_last)


def test_bad_precision_is_one_line():
    with pytest.raises(ConfigError, match=r"hardware.precision='fp8'.*fp32, fp16, bf16"):
        HardwareConfig(precision="fp8")


@pytest.mark.parametrize("method", ["comixup", pytest.param("manifold_mixup", marks=pytest.mark.slow)])
def test_mixup_hooks_under_bf16(cli_here, method):
    # saliency gradients (Co-Mixup) and the manifold-mixup stage hooks under autocast
    extra = ["method.workers=0"] if method == "comixup" else []
    out = cli_here("logger=none", "model=cnn", "train.epochs=1", "hardware.precision=bf16",
                   f"+method={method}", "+debug=smoke", *extra)  # fmt: skip
    assert "test/acc=" in out.stdout


@pytest.mark.slow
def test_compile_trains_and_matches_eager(tmp_path):
    results = {}
    for compiled in ("false", "default"):
        torch.manual_seed(0)
        model = build_model(OmegaConf.structured(CNNConfig(name="cnn", channels=[8, 16])), (1, 8, 8), 4)
        ctx = RunContext(CPU, tmp_path, NullTracker(), compile=compiled)
        cfg = OmegaConf.structured(TrainConfig(epochs=1, batch_size=32, checkpoint=False, progress=False))
        results[compiled] = fit(model, digits_like(), cfg, ctx)["train/loss"]
    assert results["default"] == pytest.approx(results["false"], rel=1e-3)
