"""The noisy-label task: configs, views, the selection hook against the solver, the losses, the CLI."""

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from runner.data import Data, Split
from runner.methods.csot import allocate
from runner.models import MLP
from runner.schema import ConfigError
from tasks.noisy_labels import (
    METHODS,
    NoisyLabelHooks,
    Views,
    _cutout,
    _gmm_clean_probability,
    _shift,
    selection_stats,
)


class _Tracker:
    def __init__(self):
        self.records = []

    def log(self, metrics, step=None):
        self.records.append((step, metrics))


def _toy(n=120, k=4, noise=0.4, seed=0):
    rng = np.random.default_rng(seed)
    y_clean = rng.integers(k, size=n)
    x = rng.standard_normal((n, 6)) + 3 * np.eye(k, 6)[y_clean]
    y = np.where(rng.random(n) < noise, rng.integers(k, size=n), y_clean)
    split = Split(torch.tensor(x, dtype=torch.float32), torch.tensor(y), torch.tensor(y_clean))
    empty = Split(split.x[:0], split.y[:0], split.y_clean[:0])
    return Data(split, empty, empty, num_classes=k, input_shape=(6,))


def _hooks(name, data, **overrides):
    cfg = METHODS[name](**{"warmup": 1, "curriculum_end": 5, "solve_batch": 50, **overrides})
    model = MLP(data.input_shape, data.num_classes, hidden=(16,))
    model.csot_head = torch.nn.Linear(16, 16)
    model.csot_predictor = torch.nn.Sequential(
        torch.nn.Linear(16, 8), torch.nn.ReLU(), torch.nn.Linear(8, 16)
    )
    ctx = SimpleNamespace(device=torch.device("cpu"), tracker=_Tracker())
    return (
        NoisyLabelHooks(cfg, model, data, ctx, Views(data.input_shape), asymmetric=False, seed=0),
        model,
        ctx,
    )


def test_method_configs_and_errors():
    assert set(METHODS) == {"csot", "cot", "ot", "small_loss", "ce"}
    assert METHODS["cot"]().kappa_p == 0 and METHODS["ot"]().selection == "ot"
    for kwargs, match in (
        ({"selection": "gmm"}, "method.selection"),
        ({"m0": 0.0}, "method.m0"),
        ({"m0": 1.5}, "method.m0"),
        ({"warmup": 20, "curriculum_end": 10}, "method.curriculum_end"),
        ({"eps": 0.0}, "method.eps"),
        ({"loss": "mixup"}, "method.loss"),
    ):
        with pytest.raises(ConfigError, match=match):
            METHODS["csot"](**kwargs)


def test_selection_stats():
    y_clean = np.array([0, 1, 2, 3, 0, 1])
    y = np.array([0, 1, 0, 3, 2, 1])  # samples 2 and 4 are noisy
    clean = np.array([1, 1, 1, 0, 0, 0], bool)
    corrected = np.array([0, 0, 0, 0, 1, 0], bool)
    pseudo = np.array([0, 1, 0, 3, 0, 1])
    s = selection_stats(clean, corrected, pseudo, y, y_clean)
    assert s["select/precision"] == pytest.approx(2 / 3) and s["select/recall"] == pytest.approx(2 / 4)
    assert s["select/corrected_acc"] == 1.0 and s["select/n_unselected"] == 2


def test_views_keep_shapes_and_content():
    x = torch.rand(5, 1, 8, 8)
    shifted = _shift(x, 1)
    assert shifted.shape == x.shape
    # a shift by at most one pixel: every output pixel is an input pixel of the same image or zero fill
    for b in range(5):
        assert any(
            torch.equal(
                shifted[b, 0, max(dy, 0) : 8 + min(dy, 0), max(dx, 0) : 8 + min(dx, 0)],
                x[b, 0, max(-dy, 0) : 8 + min(-dy, 0), max(-dx, 0) : 8 + min(-dx, 0)],
            )  # fmt: skip
            for dy in (-1, 0, 1)
            for dx in (-1, 0, 1)
        )
    holes = (_cutout(torch.ones(4, 1, 8, 8), 3) == 0).sum(dim=(1, 2, 3))
    assert holes.min() >= 4 and holes.max() <= 9  # a 3x3 square, clipped at the border
    views = Views((3, 32, 32), groups=2, mean=[0.5] * 3, std=[0.25] * 3)
    assert views.strong(torch.randn(6, 3, 32, 32)).shape == (6, 3, 32, 32)
    assert Views((7,)).strong(torch.randn(3, 7)).shape == (3, 7)


def test_gmm_separates_small_losses():
    rng = np.random.default_rng(0)
    losses = np.r_[rng.normal(0.1, 0.05, 80), rng.normal(2.0, 0.3, 40)]
    p = _gmm_clean_probability(losses)
    assert (p[:80] > 0.5).mean() > 0.95 and (p[80:] < 0.5).mean() > 0.95


@pytest.mark.parametrize("name", ["csot", "cot", "ot", "small_loss"])
def test_selection_hook_matches_the_solver(name):
    data = _toy()
    hooks, model, ctx = _hooks(name, data)
    hooks.on_epoch_start(0, model, data)  # warm-up: nothing selected
    assert not hooks.selecting and not ctx.tracker.records
    hooks.on_epoch_start(1, model, data)
    ((step, stats),) = ctx.tracker.records
    assert step == 1 and hooks.selecting
    n = len(data.train)
    clean, corrected = hooks.clean.numpy(), hooks.corrected.numpy()
    assert not np.any(clean & corrected)
    y = data.train.y.numpy()
    if name == "small_loss":
        assert not corrected.any() and stats["select/n_clean"] == clean.sum()
        return
    m = 1.0 if name == "ot" else 0.3
    assert stats["select/m"] == pytest.approx(m)
    # the hook's sets are the solver's: same inputs, same chunking seed
    probs, feats = hooks._outputs(data.train.x)
    kappa = 0.0 if name in ("ot", "cot") else 1.0
    pseudo, _, selected = allocate(probs, feats, y, m, 50, seed=1, kappa_p=kappa, kappa_l=kappa)
    np.testing.assert_array_equal(clean, selected & (pseudo == y))
    np.testing.assert_array_equal(corrected, selected & (pseudo != y))
    assert (clean | corrected).sum() == sum(
        int(np.floor(m * len(c))) for c in np.array_split(np.arange(n), [50, 100])
    )


@pytest.mark.parametrize("loss", ["paper", "simple"])
def test_losses_train(loss):
    torch.manual_seed(0)
    data = _toy()
    hooks, model, _ = _hooks("csot", data, loss=loss)
    idx = torch.arange(32)
    x, y_soft = data.train.x[idx], torch.nn.functional.one_hot(data.train.y[idx], 4).float()
    warm = hooks.loss(model, x, y_soft, idx, 0)  # before any selection: CE
    assert torch.isclose(warm, torch.nn.functional.cross_entropy(model(x), data.train.y[idx]))
    hooks.on_epoch_start(1, model, data)
    hooks.stage2 = True
    value = hooks.loss(model, x, y_soft, idx, 1)
    assert torch.isfinite(value)
    value.backward()
    assert model.classifier.weight.grad.abs().sum() > 0
    if loss == "paper":
        assert model.csot_predictor[0].weight.grad is not None  # SimSiam reaches the predictor
    hooks.clean[:] = True
    hooks.clean[idx[0]] = False  # a single unlabeled sample in the batch (BatchNorm in SimSiam)
    assert torch.isfinite(hooks.loss(model, x, y_soft, idx, 1))


def _cli_selection_runs(cli, tmp_path, methods):
    cli("-m", f"+method={','.join(methods)}", "+experiment=csot_digits", "train.epochs=4",
        "method.warmup=2", "method.curriculum_end=4", "logger=none")  # fmt: skip
    runs = sorted(tmp_path.rglob("summary.json"))
    assert len(runs) == len(methods)
    for path in runs:
        summary = json.loads(path.read_text())
        assert 0 <= summary["test/acc"] <= 1
        assert summary["train/label_noise"] > 0.3  # 50% symmetric noise (some keep their label)
        if "name: ce" in path.parent.joinpath("config.yaml").read_text():
            assert "select/precision" not in summary
            continue
        records = [
            json.loads(line) for line in path.parent.joinpath("metrics.jsonl").read_text().splitlines()
        ]
        selections = [r for r in records if "select/precision" in r]
        assert [r["step"] for r in selections] == [2, 3]
        assert all(0 <= r["select/precision"] <= 1 for r in selections)


def test_cli_runs_and_logs_the_selection(cli, tmp_path):
    _cli_selection_runs(cli, tmp_path, ["ce", "csot"])


@pytest.mark.slow
def test_cli_runs_every_method(cli, tmp_path):
    _cli_selection_runs(cli, tmp_path, ["ce", "small_loss", "ot", "cot", "csot"])
