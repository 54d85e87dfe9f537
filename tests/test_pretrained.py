"""`model.pretrained` takes an earlier run's `checkpoints/last.pt` (issue 25): fine-tuning keeps its
network, and starts a new classifier, said in one log line, where the class count differs."""

import logging

import pytest
import torch
from conftest import run_cli_here
from omegaconf import OmegaConf

from runner.models import build_model
from runner.untrusted import torch_load

SMALL = ["logger=none", "train.progress=false", "model=mlp", "model.hidden=[32]", "train.epochs=1"]
NEW_HEAD = "its classifier is for another class count; starting from a new one"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """checkpoints/last.pt of a one-epoch digits run (64 inputs, 10 classes)."""
    cwd = tmp_path_factory.mktemp("source")
    run_cli_here([*SMALL, f"hydra.run.dir={cwd / 'run'}"], cwd)
    return cwd / "run" / "checkpoints" / "last.pt"


def build(path, classes):
    cfg = OmegaConf.create({"name": "mlp", "hidden": [32], "pretrained": str(path)})
    return build_model(cfg, (64,), classes)


def test_a_runner_checkpoint_starts_the_network_and_a_new_head_where_the_classes_differ(checkpoint, caplog):
    trained = torch_load(checkpoint)["model"]  # read as the runner reads it: weights only
    caplog.set_level(logging.INFO, logger="runner.models.weights")
    same = build(checkpoint, 10)
    assert all(torch.equal(same.state_dict()[k], v) for k, v in trained.items())
    assert NEW_HEAD not in caplog.text

    other = build(checkpoint, 3)
    body = {k: v for k, v in trained.items() if not k.startswith("classifier.")}
    assert body and all(torch.equal(other.state_dict()[k], v) for k, v in body.items())
    assert other.classifier.weight.shape == (3, 32)
    assert not torch.equal(other.classifier.weight, trained["classifier.weight"][:3])
    assert caplog.text.count(NEW_HEAD) == 1


def test_fine_tune_from_an_earlier_run_on_another_class_count(checkpoint, tmp_path):
    data = ["dataset=synthetic", "dataset.dim=64", "dataset.num_classes=3"]
    proc = run_cli_here(
        [*SMALL, *data, f"model.pretrained={checkpoint}", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path
    )
    log = proc.stdout + proc.stderr
    assert log.count(NEW_HEAD) == 1 and "loaded 2 tensors" in log  # the hidden layer's weight and bias
    assert (tmp_path / "run" / "summary.json").exists()
