"""train.accumulate=auto: the fewest micro-batches whose share of the batch fits the GPU, probed once at
the start; followed on the CPU with the probe standing in for the GPU's memory."""

import pytest
import torch
from test_train import blobs, setup

import runner.hardware
import runner.memory
import runner.train
from runner.checks import ConfigError
from runner.hooks.mixup import TargetLoss
from runner.models import build_model
from runner.train import fit


class WholeBatch(TargetLoss):
    accumulate_ok = False  # a loss over the batch as one (N-pairs, DB-OT): it cannot split


@pytest.fixture
def gpu_of(monkeypatch):
    """A stand-in GPU on which a pass of at most `most` inputs fits; the probed sizes in order."""
    probed = []
    monkeypatch.setattr(runner.hardware, "is_accelerator", lambda device: True)

    def of(most):
        def fits(model, input_shape, batch, ctx):
            probed.append(batch)
            return batch <= most, 0.1 * batch

        monkeypatch.setattr(runner.memory, "fits_in_memory", fits)
        return probed

    return of


def _fit(tmp_path, hooks=None, *overrides):
    model_cfg, train_cfg, ctx = setup(tmp_path, "train.epochs=1", "train.batch_size=40",
                                      "train.accumulate=auto", *overrides)  # fmt: skip
    model = build_model(model_cfg, (4,), 3)
    fit(model, blobs(), train_cfg, ctx, hooks)
    return train_cfg


def test_auto_takes_the_fewest_micro_batches_that_fit_and_says_so(tmp_path, gpu_of, caplog):
    probed = gpu_of(10)
    with caplog.at_level("INFO", logger="runner.memory"):
        train_cfg = _fit(tmp_path)
    assert probed == [40, 20, 10] and train_cfg.accumulate == 4  # 40 / 4 = 10 fits; 3 does not divide 40
    assert "train.accumulate=auto: 4 micro-batches of 10 per step" in caplog.text


def test_auto_divides_every_phase_s_batch(tmp_path, gpu_of):
    probed = gpu_of(12)
    phases = "train.phases=[{epochs:1,batch_size:24,lr:[0.1,0.0]}]"
    assert _fit(tmp_path, None, phases, "train.schedule=none").accumulate == 4  # divides 40 and 24
    assert probed == [40, 20, 10]


def test_a_method_that_cannot_split_names_the_gpus_it_needs(tmp_path, gpu_of):
    gpu_of(10)
    with pytest.raises(ConfigError, match=r"needs each whole batch in one pass.*hardware=ddp over 4 GPUs"):
        _fit(tmp_path, WholeBatch("ce"))
    gpu_of(0)
    with pytest.raises(ConfigError, match="not even 1 input"):
        _fit(tmp_path / "none")


def test_auto_is_one_pass_on_the_cpu_and_a_bad_value_is_one_line(tmp_path):
    assert _fit(tmp_path).accumulate == 1
    with pytest.raises(ConfigError, match=r"train.accumulate='many': give a whole number >= 1, or auto"):
        setup(tmp_path, "train.accumulate=many")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_probe_leaves_the_weights_as_they_were(tmp_path):
    model_cfg, _, ctx = setup(tmp_path)
    ctx.device = torch.device("cuda")
    model = build_model(model_cfg, (4,), 3).cuda()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fits, peak = runner.memory.fits_in_memory(model, (4,), 64, ctx)
    assert fits and 0 < peak < 1
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
