"""The training loop: learning, checkpoints, resume after a kill, augmentation, evaluation."""

import json
import math

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from runner.checkpoint import CHECKPOINT
from runner.checks import ConfigError
from runner.compose import compose
from runner.data import Data, split_of
from runner.data.views import augment_crop_flip
from runner.evaluation import evaluate
from runner.faults import Diverged, OutOfMemory
from runner.hardware import RunContext
from runner.losses import soft_cross_entropy
from runner.method_hooks import MethodHooks
from runner.models import build_model
from runner.track import Tracker
from runner.train import fit
from runner.validate import validate


def blobs(n=300, seed=0) -> Data:
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 3, (n,), generator=g)
    x = torch.randn(n, 4, generator=g) + 6 * torch.nn.functional.one_hot(y, 4)[:, :4].float()
    split = [split_of(x[i::3], y[i::3]) for i in range(3)]
    return Data(*split, num_classes=3, input_shape=(4,))


def setup(tmp_path, *overrides):
    cfg = validate(compose(["model.hidden=[16]", "train.progress=false", *overrides]))
    ctx = RunContext(torch.device("cpu"), tmp_path, Tracker(tmp_path))
    return OmegaConf.structured(cfg["model"]), OmegaConf.structured(cfg["train"]), ctx


def train(tmp_path, epochs, hooks=None, seed=0):
    model_cfg, train_cfg, ctx = setup(tmp_path, f"train.epochs={epochs}", "model.dropout=0.2")
    torch.manual_seed(seed)
    model = build_model(model_cfg, (4,), 3)
    metrics = fit(model, blobs(), train_cfg, ctx, hooks)
    return model, metrics


def test_fit_learns_separable_blobs_and_writes_metrics(tmp_path):
    _, metrics = train(tmp_path, 5)
    assert metrics["test/acc"] > 0.9 and metrics["epoch"] == 5
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]
    assert (tmp_path / CHECKPOINT).exists()


@pytest.mark.parametrize("progress", [True, False])
def test_progress_false_quiets_the_epoch_lines_but_keeps_the_rows(tmp_path, caplog, progress):
    model_cfg, train_cfg, ctx = setup(tmp_path, "train.epochs=2", f"train.progress={progress}")
    with caplog.at_level("INFO", logger="runner.train"):
        fit(build_model(model_cfg, (4,), 3), blobs(), train_cfg, ctx)
    lines = [r.message for r in caplog.records if r.message.startswith("epoch ")]
    assert len(lines) == (2 if progress else 0)
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2


class KillAt(MethodHooks):
    """Raise at the start of `epoch`, as if the process were killed there."""

    def __init__(self, epoch):
        self.epoch = epoch

    def on_epoch_start(self, epoch, model, data):
        if epoch == self.epoch:
            raise KeyboardInterrupt


def test_resume_after_kill_matches_uninterrupted_run(tmp_path):
    straight, _ = train(tmp_path / "a", 5)
    with pytest.raises(KeyboardInterrupt):
        train(tmp_path / "b", 5, hooks=KillAt(3))
    assert torch.load(tmp_path / "b" / CHECKPOINT, weights_only=False)["epoch"] == 2  # lost < 1 epoch
    resumed, metrics = train(tmp_path / "b", 5, seed=123)  # a fresh init, overwritten by the checkpoint
    for p, q in zip(straight.parameters(), resumed.parameters()):
        torch.testing.assert_close(p, q)
    steps = [json.loads(line)["step"] for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2, 3, 4] and metrics["epoch"] == 5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_resume_on_cuda(tmp_path):
    # The checkpoint is loaded onto the run's device, but the CPU RNG state must be restored from the CPU.
    model_cfg, train_cfg, _ = setup(tmp_path, "train.epochs=2")
    ctx = RunContext(torch.device("cuda"), tmp_path, Tracker(tmp_path))
    fit(build_model(model_cfg, (4,), 3), blobs(), train_cfg, ctx)
    train_cfg.epochs = 3
    metrics = fit(build_model(model_cfg, (4,), 3), blobs(), train_cfg, ctx)
    assert metrics["epoch"] == 3


class Recorder(MethodHooks):
    """Counts hook calls and replaces the loss with a plain CE on hard labels."""

    def __init__(self):
        self.transforms = 0
        self.losses = 0

    def transform(self, x, y_soft, idx, model):
        self.transforms += 1
        assert len(idx) == len(x) and torch.allclose(y_soft.sum(1), torch.ones(len(x)))
        return x, y_soft

    def loss(self, model, x, y_soft, idx, epoch):
        self.losses += 1
        return soft_cross_entropy(model(x), y_soft)


def test_hooks_are_called_every_batch(tmp_path):
    hooks = Recorder()
    _, metrics = train(tmp_path, 2, hooks=hooks)
    per_epoch = 100 // 64
    assert hooks.transforms == hooks.losses == 2 * per_epoch and metrics["test/acc"] > 0.5


class SelectWorst(MethodHooks):
    """Keep the weights of the highest val/loss: the untrained net's, so the restore is visible."""

    select = ("val/loss", "max")


def test_select_restores_the_best_validation_weights_and_reports_them(tmp_path):
    model_cfg, train_cfg, ctx = setup(tmp_path, "train.epochs=3")
    torch.manual_seed(0)
    model = build_model(model_cfg, (4,), 3)
    initial = [p.detach().clone() for p in model.parameters()]
    data = blobs()
    metrics = fit(model, data, train_cfg, ctx, SelectWorst())
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [-1, 0, 1, 2]  # the initial evaluation, then each epoch
    best = max(records, key=lambda r: r["val/loss"])
    assert best["step"] == -1 and records[-1]["val/loss"] < best["val/loss"]
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), initial))
    assert metrics["val/loss"] == best["val/loss"] and metrics["test/acc"] == best["test/acc"]
    assert evaluate(model, data.val, ctx)["loss"] == pytest.approx(best["val/loss"], rel=1e-6)
    again = fit(build_model(model_cfg, (4,), 3), data, train_cfg, ctx, SelectWorst())  # finished: resumed
    assert again["val/loss"] == best["val/loss"] and len(records) == 4
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 4  # no row written twice


class LearnThenUnlearn(MethodHooks):
    """Cross-entropy in the first epoch, its negative after (the accuracy falls), recording the weights each
    epoch starts from: the best val/acc is epoch 1's, which the last epoch's weights are not."""

    def __init__(self):
        self.starts = {}

    def on_epoch_start(self, epoch, model, data):
        self.starts[epoch] = {key: value.clone() for key, value in model.state_dict().items()}

    def loss(self, model, x, y_soft, idx, epoch):
        return soft_cross_entropy(model(x), y_soft) * (1 if epoch == 0 else -1)


def test_train_select_best_restores_that_epochs_weights_and_reports_the_last_ones_too(tmp_path):
    model_cfg, train_cfg, ctx = setup(tmp_path, "train.epochs=3", "train.select=best:val/acc", "train.lr=0.5")
    torch.manual_seed(0)
    model, hooks = build_model(model_cfg, (4,), 3), LearnThenUnlearn()
    metrics = fit(model, blobs(), train_cfg, ctx, hooks)
    rows = {r["step"]: r for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())}
    assert max(rows, key=lambda step: rows[step]["val/acc"]) == 0  # epoch 1 (tracker step 0) is the best
    assert rows[2]["test/acc"] < rows[0]["test/acc"]
    after_epoch_1 = hooks.starts[1]
    assert all(torch.equal(value, after_epoch_1[key]) for key, value in model.state_dict().items())
    assert metrics["tested_model"] == "best:val/acc" and metrics["tested_epoch"] == 1
    assert metrics["test/acc"] == rows[0]["test/acc"] and metrics["test/acc_last"] == rows[2]["test/acc"]


def test_train_select_last_keeps_the_last_weights_and_a_metric_the_run_lacks_is_refused(tmp_path):
    _, metrics = train(tmp_path / "last", 2)
    assert metrics["tested_model"] == "last" and metrics["test/acc"] == metrics["test/acc_last"]
    model_cfg, train_cfg, ctx = setup(tmp_path, "train.select=best:val/top1")
    with pytest.raises(ConfigError, match=r"train.select=best:val/top1: .* choices: best:val/acc, "):
        fit(build_model(model_cfg, (4,), 3), blobs(), train_cfg, ctx)
    with pytest.raises(ConfigError, match=r"train.select='best' is not an option; choices: last, best:<m"):
        setup(tmp_path, "train.select=best")


def test_cosine_delay_is_the_csot_codes_scheduler_created_after_the_first_epoch_and_resumes():
    from runner.optim import follow_config, make_optimizer, make_scheduler
    from runner.schema import TrainConfig

    def lrs(optimizer, scheduler, epochs):
        out = []
        for _ in range(epochs):
            out.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            scheduler.step() if scheduler is not None else None
        return out

    cfg = TrainConfig(epochs=6, lr=0.02, cosine_delay=1)
    optimizer = make_optimizer(torch.nn.Linear(2, 2), cfg)
    ours = lrs(optimizer, make_scheduler(optimizer, cfg), 6)
    theirs, code = [], torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.02, momentum=0.9)
    scheduler = None  # main_cifar.py: CosineAnnealingLR(T_max=num_epochs) made at the end of epoch 0
    for _ in range(6):
        theirs += lrs(code, scheduler, 1)
        scheduler = scheduler or torch.optim.lr_scheduler.CosineAnnealingLR(code, T_max=6, eta_min=0)
    assert ours == pytest.approx(theirs, rel=1e-12) and ours[0] == ours[1] == 0.02 and ours[2] < 0.02
    scheduler = make_scheduler(optimizer := make_optimizer(torch.nn.Linear(2, 2), cfg), cfg)
    lrs(optimizer, scheduler, 3)
    before = repr((optimizer.state_dict(), scheduler.state_dict()))
    follow_config(optimizer, scheduler, cfg)  # an unchanged config: an exact resume
    assert repr((optimizer.state_dict(), scheduler.state_dict())) == before
    follow_config(optimizer, scheduler, TrainConfig(epochs=10, lr=0.02, cosine_delay=1))  # extended
    expected = [0.01 * (1 + math.cos(math.pi * (epoch - 1) / 10)) for epoch in range(3, 10)]
    assert lrs(optimizer, scheduler, 7) == pytest.approx(expected, rel=1e-9)
    with pytest.raises(ConfigError, match=r"train.cosine_delay=1 delays a cosine schedule; train.sched"):
        TrainConfig(schedule="step", cosine_delay=1)


def test_crop_flip_shifts_content_and_keeps_shape():
    torch.manual_seed(0)
    x = torch.arange(2 * 3 * 8 * 8, dtype=torch.float32).view(2, 3, 8, 8)
    out = augment_crop_flip(x, pad=0)
    for i in range(2):  # with no padding, only the flip can change an image
        assert torch.equal(out[i], x[i]) or torch.equal(out[i], x[i].flip(-1))
    out = augment_crop_flip(x, pad=2)
    assert out.shape == x.shape
    # Each output pixel is either padding (0) or a value of the same image and channel.
    for i in range(2):
        for c in range(3):
            assert set(out[i, c].unique().tolist()) <= set(x[i, c].unique().tolist()) | {0.0}


def test_evaluate_counts_correct_predictions(tmp_path):
    data = blobs()
    ctx = RunContext(torch.device("cpu"), tmp_path, Tracker(tmp_path, enabled=False))

    class AlwaysZero(torch.nn.Module):  # argmax of equal logits is class 0
        def forward(self, x):
            return torch.zeros(len(x), 3)

    acc = evaluate(AlwaysZero(), data.test, ctx)["acc"]
    assert acc == pytest.approx(float((data.test.y_clean == 0).float().mean()))


class InfiniteLoss(MethodHooks):
    """A loss whose gradients are never finite: the fp16 scaler skips every step and halves its scale."""

    def loss(self, model, x, y_soft, idx, epoch):
        return model(x).sum() * torch.tensor(float("inf"))


def test_fp16_logs_skipped_steps_and_the_scale_and_stops_when_it_underflows(tmp_path):
    model_cfg, train_cfg, ctx = setup(tmp_path, "train.epochs=1", "train.batch_size=2")
    ctx.precision = "fp16"
    model = build_model(model_cfg, (4,), 3)
    # The scale starts at 2**16 and halves per skipped step: under MIN_LOSS_SCALE (1e-4) after 30 steps,
    # seen at the next read (every 16 steps): step 32 of the epoch's 50.
    with pytest.raises(Diverged, match=r"the fp16 loss scale fell to 1.5\de-05 at epoch 1"):
        fit(model, blobs(), train_cfg, ctx, InfiniteLoss())
    model_cfg, train_cfg, ctx = setup(tmp_path / "short", "train.epochs=1", "train.batch_size=20")
    ctx.precision = "fp16"
    fit(build_model(model_cfg, (4,), 3), blobs(), train_cfg, ctx, InfiniteLoss())  # 5 steps: 2**16 / 2**5
    row = json.loads((tmp_path / "short" / "metrics.jsonl").read_text().splitlines()[-1])
    assert row["train/skipped_steps"] == 5 and row["train/loss_scale"] == 2.0**11


class OutOfMemoryAt(MethodHooks):
    """A loss that runs out of memory at one step of epoch 2: the device's error, as torch raises it on CUDA,
    or a real failure of the CPU allocator, torch's or numpy's (2^60 bytes, more than any address space)."""

    accumulate_ok = True

    def __init__(self, kind: str):
        self.kind, self.steps = kind, 0

    def loss(self, model, x, y_soft, idx, epoch):
        self.steps += 1
        if epoch == 1 and self.steps == 18:  # 16 steps per epoch: epoch 2, step 2
            if self.kind == "cuda":
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has ...")
            torch.empty(2**60, dtype=torch.uint8) if self.kind == "torch" else np.empty(2**60, np.uint8)
        return soft_cross_entropy(model(x), y_soft)


@pytest.mark.parametrize("kind", ["cuda", "torch", "numpy"])
def test_running_out_of_memory_names_the_batch_what_fits_and_keeps_the_checkpoint(tmp_path, kind):
    model_cfg, train_cfg, ctx = setup(tmp_path, "train.epochs=3", "train.batch_size=6")
    with pytest.raises(OutOfMemory) as stop:
        fit(build_model(model_cfg, (4,), 3), blobs(), train_cfg, ctx, OutOfMemoryAt(kind))
    memory = "CUDA memory (it tried to allocate 2.00 GiB)" if kind == "cuda" else "host memory (it tried to "
    assert str(stop.value).startswith(f"ran out of {memory}")
    assert str(stop.value).endswith(
        " in epoch 2 at train.batch_size=6; lower it, or keep the batch with train.accumulate=2 (half as "
        f"many per pass); last good checkpoint: {tmp_path / CHECKPOINT} (end of epoch 1)"
    )
    assert torch.load(tmp_path / CHECKPOINT, weights_only=False)["epoch"] == 0  # kept as it was


class OutOfMemoryInEvaluation(torch.nn.Module):
    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, x):
        if not self.training:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB. GPU 0 has ...")
        return self.net(x)


def test_running_out_of_memory_in_the_evaluation_names_its_batch(tmp_path):
    model_cfg, train_cfg, ctx = setup(tmp_path, "train.epochs=2", "train.eval_batch_size=50")
    with pytest.raises(OutOfMemory) as stop:
        fit(OutOfMemoryInEvaluation(build_model(model_cfg, (4,), 3)), blobs(), train_cfg, ctx)
    assert str(stop.value) == (
        "ran out of CUDA memory (it tried to allocate 1.00 GiB) in epoch 1, in the evaluation at "
        "train.eval_batch_size=50; lower it; last good checkpoint: none written yet"
    )
