"""Bad input never answers with a traceback (issue 25): several unknown keys are named in one line, and
each method's preconditions on the data and the batch are checked before training, the fix in the line."""

import numpy as np
import pytest
from fixtures_data import write_class_folders

from runner.checks import ConfigError
from runner.compose import preflight
from runner.configs.longtail import METHODS as LONGTAIL_METHODS
from runner.hooks.dbot import infer

# 8 classes x 4 training images: fewer points than the VQ baseline's default centroids (d^k = 128)
SMALL_FOLDER = ["dataset=imagefolder", "dataset.image_size=16"]


@pytest.mark.parametrize(
    "args,expected",
    [
        (["train.foo=1", "train.bar=2"], "unknown keys train.foo, train.bar; valid keys under train: epochs"),
        (
            ["+method=comixup", "train.batch_size=1"],
            "train.batch_size=1: method=comixup (it mixes inputs of a batch) needs at least 2 inputs per "
            "step; set train.batch_size>=2",
        ),
        (
            ["+method=input_mixup", "train.batch_size=4", "train.accumulate=4"],
            "train.batch_size=4 over 4 micro-batches: method=input_mixup",
        ),
        (
            ["+method=csot", "method.loss=paper", "train.batch_size=1"],
            "train.batch_size=1: method=csot's SimSiam predictor (a BatchNorm over the batch) needs at least",
        ),
        (
            ["+method=hier_hash", "dataset=digits", "method.classes_per_batch=64"],
            "method.classes_per_batch=64: only 10 classes have >= 2 training examples (method.per_class); "
            "set method.classes_per_batch<=10",
        ),
        (
            ["+method=hier_hash", *SMALL_FOLDER, "+debug=smoke"],
            "the VQ baseline's k-means has only the 32 train points to place them; set method.vq_centroids=",
        ),
    ],
)
def test_bad_input_exits_nonzero_with_one_line(cli_here, tmp_path, args, expected):
    if SMALL_FOLDER[0] in args:
        write_class_folders(tmp_path / "small", "train", [f"c{i}" for i in range(8)], 4, ".jpg")
        write_class_folders(tmp_path / "small", "val", [f"c{i}" for i in range(8)], 2, ".png")
        args = [*args, f"dataset.root={tmp_path / 'small'}"]
    proc = cli_here(*args, "logger=none", "train.progress=false", check=False)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    (line,) = proc.stderr.splitlines()
    assert line.startswith("runner: error: ") and expected in line


def test_several_unknown_keys_are_named_in_one_error_with_the_valid_keys_of_each_group():
    with pytest.raises(ConfigError) as e:
        preflight(["train.foo=1", "model.bar=2", "+method=erm", "train.baz=3", "method.alpha=1"])
    train, model, method = str(e.value).split("; unknown key ")
    assert train.startswith("unknown keys train.foo, train.baz; valid keys under train: epochs, batch_size,")
    # the preset's model=cnn: every key its schema takes (runner/schema.py's CNNConfig)
    assert model == "model.bar; valid keys under model: name, pretrained, zero_init_residual, channels"
    assert method == "method.alpha; valid keys under method: name, task, loss"


def test_pwc_picks_at_most_its_candidates():
    with pytest.raises(ConfigError) as e:
        preflight(["+method=pwc", "method.k=400"])
    assert str(e.value) == (
        "method.k=400 is out of range; must be in [1, 300]: k picks are drawn from the method.n_app=300 "
        "application candidates (or set method.n_app>=400)"
    )


def test_dbot_inference_that_underflows_names_the_fix():
    """Logits far beyond exp(-cost / eps)'s range (a diverged or untrained net) stop DB-OT's Sinkhorn
    inference with one line naming the options, not the solver's traceback; its fix works."""
    method = LONGTAIL_METHODS["dbot"]()
    logits = np.zeros((6, 3))
    logits[:, 0] = 1e3
    prior = np.full(3, 1 / 3)
    with pytest.raises(ConfigError) as e:
        infer("dbot", method, logits, None, None, prior, prior)
    assert str(e.value) == (
        "method.eps=1.0 is too small for method.solver=sinkhorn at this run's logits (range 1e+03: the Gibbs "
        "kernel underflows); set method.solver=dual or a larger method.eps"
    )
    method.solver = "dual"
    assert infer("dbot", method, logits, None, None, prior, prior).tolist() == [0] * 6
