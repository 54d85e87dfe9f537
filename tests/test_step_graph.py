"""The training step that a CUDA graph replays (`hardware.cuda_graph`) and the whole-step compile
(`hardware.compile`), followed on the CPU: the same region runs eagerly there, with the captured step's
fused optimizer and lr tensor, so its trajectory and its host traffic can be checked without a GPU."""

import importlib
import json
import pkgutil
import sys
from types import SimpleNamespace

import pytest
import torch
from test_train import blobs, setup

import runner.hooks
from runner import device_tracking
from runner.hooks.csot import NoisyLabelHooks
from runner.hooks.dbot import LossHook
from runner.hooks.hier_hash import HashHooks
from runner.hooks.mixup import MixupHooks, TargetLoss
from runner.method_hooks import MethodHooks, PlainTraining
from runner.models import build_model
from runner.train import GraphedStep, _method_hooks, fit, not_capturable

SCHEDULES = ["train.schedule=cosine", "train.warmup_epochs=1", "train.momentum=0.9", "train.nesterov=true",
             "train.weight_decay=5e-4", "train.clip_grad_norm=1.0"]  # fmt: skip
PHASES = 'train.phases=[{epochs:2,batch_size:20,lr:[0.2,0.05]},{epochs:2,batch_size:40,lr:[0.05,0.0]}]'


def _fit(tmp_path, *overrides, graph=False, hooks=None, compile="false"):
    model_cfg, train_cfg, ctx = setup(tmp_path, "train.epochs=4", "train.batch_size=20", *overrides)
    ctx.cuda_graph, ctx.compile = graph, compile
    torch.manual_seed(0)
    model = build_model(model_cfg, (4,), 3)
    fit(model, blobs(), train_cfg, ctx, hooks)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    return model, rows


@pytest.mark.parametrize("overrides", [SCHEDULES, [PHASES, "train.schedule=none"],
                                       ["train.optimizer=adam", "train.lr=0.01", "train.schedule=cosine"]],
                         ids=["schedules", "phases", "adam"])
def test_the_graph_ready_step_follows_the_eager_trajectory(tmp_path, overrides):
    eager, eager_rows = _fit(tmp_path / "eager", *overrides)
    graphed, graphed_rows = _fit(tmp_path / "graph", *overrides, graph=True)
    # The lr schedules write the captured step's lr tensor in place: every epoch's lr is the eager one's.
    assert [r["lr"] for r in graphed_rows] == pytest.approx([r["lr"] for r in eager_rows], rel=1e-6)
    # The fused SGD / Adam kernel applies the same update as foreach's in another order of float32 operations
    # (weight decay, momentum, Nesterov, the lr product: each a rounding of ~6e-8 relative), so a step
    # differs by a few ulp; over 4 epochs of 5-15 steps on separable blobs the training map contracts
    # rather than amplifies such noise, which leaves the losses within 1e-5 relative.
    for a, b in zip(eager_rows, graphed_rows):
        assert b["train/loss"] == pytest.approx(a["train/loss"], rel=1e-5)
    for p, q in zip(eager.parameters(), graphed.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)


def test_a_method_s_loss_is_captured_only_where_it_says_so(tmp_path, caplog):
    class HostLoss(TargetLoss):
        capturable = False

    for hooks, captured in ((TargetLoss("ce"), True), (HostLoss("ce"), False)):
        with caplog.at_level("INFO", logger="runner.train"):
            _fit(tmp_path / str(captured), "train.epochs=1", graph=True, hooks=hooks)
        assert ("the training step runs eagerly: the method's hooks (HostLoss)" in caplog.text) != captured
        caplog.clear()


# Whether a method's step may be captured as one CUDA graph and compiled whole (`capturable`): plain training
# (fit's hooks=None) and TargetLoss run device work alone; the others read the host or draw host randomness.
CAPTURABLE = {PlainTraining: True, TargetLoss: True, MixupHooks: False, NoisyLabelHooks: False,
              LossHook: False, HashHooks: False}  # fmt: skip


def _subclasses(cls) -> set:
    return {sub for direct in cls.__subclasses__() for sub in {direct} | _subclasses(direct)}


def test_each_method_s_step_is_captured_and_compiled_whole_only_where_it_was():
    for module in pkgutil.iter_modules(runner.hooks.__path__):
        importlib.import_module(f"runner.hooks.{module.name}")
    # every hooks class of the runner is in the table, so a new one decides here
    # (the runner's own: a test's temporary method, its module gone from sys.modules, is not)
    ours = {c for c in _subclasses(MethodHooks) if c.__module__.startswith("runner.")}
    ours = {c for c in ours if c.__module__ in sys.modules}
    assert ours == set(CAPTURABLE)
    # a step that the rest of the fit would capture: one process, no loss scaling, no EMA, a fused optimizer
    ctx = SimpleNamespace(distributed=False, compile="false")
    s = SimpleNamespace(ctx=ctx, scaler=SimpleNamespace(is_enabled=lambda: False), ema=None,
                        optimizer=SimpleNamespace(param_groups=[{"fused": True}]))  # fmt: skip
    decided = {None: _method_hooks(None)} | {cls: object.__new__(cls) for cls in CAPTURABLE}
    for cls, hooks in decided.items():
        expected = CAPTURABLE.get(cls, True)  # None: plain training
        assert hooks.capturable is expected, cls  # the whole-step compile reads this
        assert (not_capturable(s, hooks) is None) is expected, cls
    assert MethodHooks.capturable is False  # a new method's hooks opt in, never by inheriting


def test_the_captured_region_reads_nothing_from_the_host_and_makes_no_host_tensor(tmp_path):
    # the comixup CIFAR preset's ERM step at CPU size, as hardware=auto runs it on a recent GPU
    out = tmp_path / "counts.json"
    device_tracking.main([
        "+experiment=comixup_cifar100_preactresnet18", "+method=erm", "logger=none", "dataset=fake",
        "dataset.like=cifar100", "dataset.train_size=128", "dataset.test_size=16", "dataset.image_size=8",
        "train.batch_size=16", "train.epochs=1", "hardware=gpu", "hardware.num_workers=0",
        "hardware.cuda_graph=true", "train.phases=[]", f"hydra.run.dir={tmp_path / 'run'}",
        "--json", str(out),
    ])  # fmt: skip
    report = json.loads(out.read_text())
    assert report["steps"] == report["entered"][device_tracking.CAPTURED] == 8, report  # every step in it
    assert report["counts"].get(device_tracking.CAPTURED, {}) == {}, report["sites"]


def test_the_tracker_counts_a_host_tensor_made_in_the_captured_region():
    with device_tracking.DeviceTracker() as tracker, tracker.in_phase(device_tracking.CAPTURED):
        x = torch.ones(3, device=device_tracking.STAND_IN)
        x * torch.tensor([1.0, 2.0, 3.0])  # a host-made value: the graph would replay it
        torch.zeros(3, device=x.device)  # made on the device: free
    assert tracker.counts[device_tracking.CAPTURED] == {"host": 1, "mix": 1}


def test_the_graph_step_keeps_the_lr_in_a_tensor(tmp_path):
    model_cfg, train_cfg, ctx = setup(tmp_path, "train.epochs=1")
    optimizer = torch.optim.SGD(build_model(model_cfg, (4,), 3).parameters(), lr=0.1, fused=True)

    class S:  # what GraphedStep reads of a Step
        pass

    s = S()
    s.ctx, s.optimizer = ctx, optimizer
    GraphedStep(s)
    assert isinstance(optimizer.param_groups[0]["lr"], torch.Tensor)
    assert float(optimizer.param_groups[0]["lr"]) == pytest.approx(0.1)


@pytest.mark.slow
def test_the_whole_step_compiled_follows_the_eager_trajectory(tmp_path):
    _, eager_rows = _fit(tmp_path / "eager", "train.epochs=2")
    _, compiled_rows = _fit(tmp_path / "compiled", "train.epochs=2", compile="default")
    # inductor fuses the MLP's forward and backward (other float32 association, ~1e-7 relative per op)
    for a, b in zip(eager_rows, compiled_rows):
        assert b["train/loss"] == pytest.approx(a["train/loss"], rel=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_replayed_graph_trains_as_the_eager_step(tmp_path):
    def fit_on_cuda(name, graph):
        model_cfg, train_cfg, ctx = setup(tmp_path / name, "train.epochs=3", "train.batch_size=20",
                                          *SCHEDULES)
        ctx.device, ctx.cuda_graph = torch.device("cuda"), graph
        torch.manual_seed(0)
        model = build_model(model_cfg, (4,), 3)
        fit(model, blobs(), train_cfg, ctx)
        rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        return model, rows

    eager, eager_rows = fit_on_cuda("eager", False)
    graphed, graphed_rows = fit_on_cuda("graph", True)
    # the same fused kernels on the same inputs, launched from a graph instead of Python: equal up to the
    # GPU's reduction order (cuBLAS may pick another split-K per launch; ~1e-7 relative per step)
    for a, b in zip(eager_rows, graphed_rows):
        assert b["train/loss"] == pytest.approx(a["train/loss"], rel=1e-4)
        assert b["lr"] == pytest.approx(a["lr"], rel=1e-6)
    for p, q in zip(eager.parameters(), graphed.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-5)
