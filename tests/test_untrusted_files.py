"""No code runs from a data or weights file: resume checkpoints, PWC's `method.checkpoint` and the
ImageNet32 pickles refuse a pickle whose loading would run code, with one line naming the file."""

import pickle

import pytest
import torch

from runner.checks import ConfigError
from runner.data.imagenet32 import read_batches
from runner.faults import CheckpointError
from runner.train import load_checkpoint


class Payload:
    """Unpickling this calls `open(marker, "w")`: code run by loading the file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def _malicious(tmp_path, save) -> tuple:
    path, marker = tmp_path / "file.pt", tmp_path / "ran"
    save({"model": {}, "data": Payload(marker), "labels": [1]}, path)
    return path, marker


def test_a_checkpoint_that_would_run_code_is_refused(tmp_path):
    path, marker = _malicious(tmp_path, torch.save)
    with pytest.raises(CheckpointError, match=rf"{path} holds pickled objects .* could run code: not loaded"):
        load_checkpoint(path, "cpu")
    assert not marker.exists()


def test_runner_checkpoints_with_numpy_state_still_load(tmp_path):
    import numpy as np

    state = {"rng": np.random.get_state(), "hooks": {"rng": np.random.default_rng(0).bit_generator.state},
             "values": np.arange(3.0), "scalar": np.float64(0.5), "model": {"w": torch.ones(2)}}  # fmt: skip
    torch.save(state, tmp_path / "last.pt")
    loaded = load_checkpoint(tmp_path / "last.pt", "cpu")
    assert loaded["rng"][1].tolist() == state["rng"][1].tolist() and loaded["scalar"] == 0.5


def test_pwc_method_checkpoint_that_would_run_code_is_refused(cli_here, tmp_path):
    path, marker = _malicious(tmp_path, torch.save)
    proc = cli_here("logger=none", "+method=pwc", "method.features=net", "method.n_app=60", "method.n_dev=60",
                    "method.k=6", f"method.checkpoint={path}", check=False)  # fmt: skip
    assert proc.returncode != 0 and not marker.exists()
    assert f"method.checkpoint='{path}': not a runner checkpoint" in proc.stderr
    assert "could run code" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_an_imagenet32_batch_that_would_run_code_is_refused(tmp_path):
    path, marker = _malicious(tmp_path, lambda obj, p: p.write_bytes(pickle.dumps(obj)))
    with pytest.raises(ConfigError, match=rf"{path}: holds a pickled io.open, not an ImageNet32 batch"):
        read_batches([path])
    assert not marker.exists()
