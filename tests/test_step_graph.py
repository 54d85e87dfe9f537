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
from conftest import quick_first
from test_device_budgets import PAIR_MIXUPS, assert_captured_whole
from test_train import blobs, setup

import runner.hooks
from runner import device_tracking
from runner.cli import run_in_process
from runner.configs.classify import MIXUP, InputMixupConfig
from runner.hardware import RunContext
from runner.hooks.csot import NoisyLabelHooks
from runner.hooks.dbot import LossHook
from runner.hooks.hier_hash import HashHooks
from runner.hooks.mixup import MixupHooks, TargetLoss
from runner.method_hooks import MethodHooks, PlainTraining
from runner.models import build_model
from runner.step import GraphedStep, not_capturable
from runner.train import _method_hooks, fit
from runner.validate import to_node

SCHEDULES = ["train.schedule=cosine", "train.warmup_epochs=1", "train.momentum=0.9", "train.nesterov=true",
             "train.weight_decay=5e-4", "train.clip_grad_norm=1.0"]  # fmt: skip
PHASES = "train.phases=[{epochs:2,batch_size:20,lr:[0.2,0.05]},{epochs:2,batch_size:40,lr:[0.05,0.0]}]"


def _fit(tmp_path, *overrides, graph=False, hooks=None, compile="false"):
    model_cfg, train_cfg, ctx = setup(tmp_path, "train.epochs=4", "train.batch_size=20", *overrides)
    ctx.cuda_graph, ctx.compile = graph, compile
    torch.manual_seed(0)
    model = build_model(model_cfg, (4,), 3)
    fit(model, blobs(), train_cfg, ctx, hooks)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    return model, rows


@pytest.mark.parametrize(
    "overrides",
    [
        SCHEDULES,
        [PHASES, "train.schedule=none"],
        ["train.optimizer=adam", "train.lr=0.01", "train.schedule=cosine"],
    ],
    ids=["schedules", "phases", "adam"],
)
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
        with caplog.at_level("INFO", logger="runner.step"):
            _fit(tmp_path / str(captured), "train.epochs=1", graph=True, hooks=hooks)
        assert ("the training step runs eagerly: the method's hooks (HostLoss)" in caplog.text) != captured
        caplog.clear()


class _GridDrawn(PlainTraining):
    """A split step whose solve's shape follows its draw, as Puzzle Mix's cuts follow the grid it draws:
    grids 1, 2 and 1 again, each step's (its cells' prior names the grid, hence the capture key), then a
    cut per cell of it that scales the inputs."""

    def __init__(self, grids):
        self.grids = iter(grids)

    def draw(self, x, y_soft, idx, model):
        return (torch.zeros(next(self.grids) ** 2, device=x.device),)

    def read(self, x, y_soft, idx, model, drawn):
        return (x.new_zeros(len(x), len(drawn[0])),)

    def solve(self, read):
        return (read.numpy() + 1.0,)

    def transform(self, x, y_soft, idx, model, drawn, solved):
        return x * solved[0].mean(1, keepdim=True), y_soft


def test_a_capture_takes_its_own_key_s_solved_shapes(tmp_path):
    """Puzzle Mix at 32 px: one grid's capture after another grid's warm-up step took that step's shapes."""
    grids = [1] * GraphedStep.WARMUP + [2] + [1] * 6  # grid 1's capture comes after grid 2's warm-up step
    _fit(tmp_path, "train.epochs=1", "train.batch_size=10", graph=True, hooks=_GridDrawn(grids))  # 10 steps


# Whether a method's step may be captured as one CUDA graph (or two around its host read) and, without such a
# read, compiled whole (`capturable`): plain training (fit's hooks=None), TargetLoss, the pair mixups (their
# draws made before the step), DB-OT's and CSOT's losses run device work alone; Co-Mixup (at a fixed grid) and
# Puzzle Mix (without its adversarial option) and hashing split the step around their host read.
CAPTURABLE = {PlainTraining: True, TargetLoss: True, NoisyLabelHooks: True, LossHook: True, HashHooks: True,
              MixupHooks: {"input_mixup": True, "cutmix": True, "manifold_mixup": True, "puzzle_mix": True,
                           "comixup": True}}  # fmt: skip


def _subclasses(cls) -> set:
    return {sub for direct in cls.__subclasses__() for sub in {direct} | _subclasses(direct)}


def _hooks_of_each_kind() -> dict:
    """(class, mixup method or None) -> an instance, as far as the flags read it (no __init__ run)."""
    kinds = {}
    for cls, capturable in CAPTURABLE.items():
        for name in capturable if isinstance(capturable, dict) else [None]:
            kinds[cls, name] = hooks = object.__new__(cls)
            hooks.cfg = SimpleNamespace(name=name, grid=4, adv_p=0.0)  # Co-Mixup's preset grid
    return kinds


def test_each_method_s_step_is_captured_and_compiled_whole_only_where_it_was():
    for module in pkgutil.iter_modules(runner.hooks.__path__):
        importlib.import_module(f"runner.hooks.{module.name}")
    # every hooks class of the runner is in the table, so a new one decides here
    # (the runner's own: a test's temporary method, its module gone from sys.modules, is not)
    ours = {c for c in _subclasses(MethodHooks) if c.__module__.startswith("runner.")}
    ours = {c for c in ours if c.__module__ in sys.modules}
    assert ours == set(CAPTURABLE)
    assert set(CAPTURABLE[MixupHooks]) == {c.name for c in MIXUP}  # and every method of the mixup family
    # a step that the rest of the fit would capture: one process, no loss scaling, no EMA, a fused optimizer
    ctx = SimpleNamespace(distributed=False, compile="false")
    s = SimpleNamespace(ctx=ctx, scaler=SimpleNamespace(is_enabled=lambda: False), ema=None,
                        optimizer=SimpleNamespace(param_groups=[{"fused": True}]))  # fmt: skip
    decided = {(None, None): _method_hooks(None)} | _hooks_of_each_kind()
    for (cls, name), hooks in decided.items():
        expected = True if cls is None else CAPTURABLE[cls] if name is None else CAPTURABLE[cls][name]
        assert hooks.capturable is expected, (cls, name)  # the whole-step compile reads this
        why = not_capturable(s, hooks)
        assert why is None if expected else why.endswith(hooks.why_not_capturable), (cls, name)
    # the mixups whose draws go before the step; Co-Mixup draws inside its solve, on the host
    assert [name for (cls, name), hooks in decided.items() if cls is MixupHooks and hooks.draw] == [
        "input_mixup", "cutmix", "manifold_mixup", "puzzle_mix"]  # fmt: skip
    # the saliency methods split their step around their host read
    assert [name for (cls, name), hooks in decided.items() if cls is MixupHooks and hooks.read] == [
        "puzzle_mix", "comixup"]  # fmt: skip
    # the reason names what varies from step to step
    puzzle_mix = decided[MixupHooks, "puzzle_mix"]
    puzzle_mix.cfg.adv_p = 0.5
    assert not puzzle_mix.capturable and "method.adv_p > 0" in not_capturable(s, puzzle_mix)
    comixup = decided[MixupHooks, "comixup"]
    comixup.cfg.grid = -1
    assert not comixup.capturable and "method.grid=-1" in not_capturable(s, comixup)
    assert MethodHooks.capturable is False  # a new method's hooks opt in, never by inheriting


def _track(tmp_path, *overrides) -> dict:
    """The tracking harness's report of a CPU-size run with the step captured (`hardware.cuda_graph`)."""
    out = tmp_path / "counts.json"
    run_dir = f"hydra.run.dir={tmp_path / 'run'}"
    device_tracking.main([*overrides, "logger=none", "hardware=gpu", "hardware.num_workers=0",
                          "hardware.cuda_graph=true", run_dir, "--json", str(out)])  # fmt: skip
    return json.loads(out.read_text())


# the comixup CIFAR preset at CPU size, as hardware=auto runs it on a recent GPU
CIFAR_AT_CPU_SIZE = ["+experiment=comixup_cifar100_preactresnet18", "dataset=fake", "dataset.like=cifar100",
                     "dataset.train_size=128", "dataset.test_size=16", "dataset.image_size=8",
                     "train.batch_size=16", "train.epochs=1", "train.phases=[]"]  # fmt: skip


# The newly capturable steps at CPU size: the pair mixups on the CIFAR preset's data (a small CNN, whose
# pooling layers manifold mixup mixes after); DB-OT's loss on CIFAR-10-LT with its AutoAugment + Cutout batch
# augmentation, and LDAM-DRW, whose re-weighting epoch recaptures; CSOT's paper loss on its digits preset
# past the warm-up (its selection epochs recapture).
LT_AT_CPU_SIZE = ["dataset=fake", "dataset.like=cifar10", "dataset.imbalance=10", "dataset.train_size=1000",
                  "dataset.test_size=64", "dataset.image_size=32", "train.batch_size=64", "train.epochs=2",
                  "model=mlp", "model.hidden=[16]"]  # fmt: skip
PAIRS_AT_CPU_SIZE = [*CIFAR_AT_CPU_SIZE, "train.epochs=2", "model=cnn"]  # a small conv net: the same hooks
# the synthetic hashing preset's one hash net (ours at ks 2, on the raw inputs: no base net), 24 iterations
HASHING_AT_CPU_SIZE = ["+experiment=hier_hash_synthetic", "method.iters=24", "method.ks=[2]",
                       "method.baselines=[]", "dataset.train_per_class=20",
                       "dataset.test_per_class=10"]  # fmt: skip
METHOD_RUNS = {
    "input_mixup": [*PAIRS_AT_CPU_SIZE, "+method=input_mixup", "method.clean_lam=1"],
    "cutmix": [*PAIRS_AT_CPU_SIZE, "+method=cutmix"],
    "manifold_mixup": [*PAIRS_AT_CPU_SIZE, "+method=manifold_mixup"],
    "dbot": ["+experiment=dbot_cifar10_lt", *LT_AT_CPU_SIZE, "method.augment=autoaugment_cutout"],
    "ldam_drw": ["+experiment=dbot_cifar10_lt", *LT_AT_CPU_SIZE, "+method=ldam", "method.drw_start=0.5"],
    "csot": ["+experiment=csot_digits", "method.loss=paper", "method.warmup=1", "train.epochs=3"],
    # split around their host read: Co-Mixup's clean pass, then its mix; with lag, through the worker pool;
    # across a phase's new batch size (a second capture)
    "comixup": [*PAIRS_AT_CPU_SIZE, "+method=comixup", "method.preview=false"],
    "comixup_lag": [*PAIRS_AT_CPU_SIZE, "+method=comixup", "method.preview=false", "method.lag=true"],
    "comixup_phases": [*PAIRS_AT_CPU_SIZE, "+method=comixup", "method.preview=false",
                       "train.schedule=none",
                       "train.phases=[{epochs:1,batch_size:16,lr:[0.1,0.05]},{epochs:1,batch_size:32,lr:[0.05,0.0]}]"],
    # Puzzle Mix: its grid drawn per batch, among 2, 4 and 8 at 8 px (a capture each)
    "puzzle_mix": [*PAIRS_AT_CPU_SIZE, "+method=puzzle_mix", "method.preview=false"],
    # the hash codes' forward to the unaries, then the loss with the codes the host's flow found
    **{f"hashing_{loss}": HASHING_AT_CPU_SIZE + [f"method.loss={loss}"] for loss in ("npairs", "triplet")},
}  # fmt: skip


SPLIT = ("comixup", "puzzle_mix", "hashing")  # the runs whose step is split around a host read
# The tracked runs beside tests/test_device_budgets.py's, which track every family's paper preset captured
# and check the same region: what recaptures (LDAM-DRW's re-weighting epoch, a phase's new batch size),
# Puzzle Mix's drawn grids, Co-Mixup's lag through the worker pool, the npairs codes loss and DB-OT's
# policy augmentation.
TRACKED_HERE = ["dbot", "ldam_drw", "comixup_lag", "comixup_phases", "puzzle_mix", "hashing_npairs"]
# the captures each run makes (1: one batch shape, one key): LDAM-DRW's second at its re-weighting epoch,
# a phase's new batch size, one per drawn grid
CAPTURES = {"ldam_drw": 2, "comixup_phases": 2, "puzzle_mix": 3}


@pytest.mark.parametrize("method", quick_first(TRACKED_HERE, lambda m: m.startswith(SPLIT)))
def test_each_method_s_captured_region_reads_nothing_from_the_host(tmp_path, method):
    report = _track(tmp_path, *METHOD_RUNS[method])
    assert report["warm_up_steps"] == CAPTURES.get(method, 1) * GraphedStep.WARMUP, report
    assert_captured_whole(report, 2 if method.startswith(SPLIT) else 1)


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


def _input_mixup(tmp_path) -> MixupHooks:
    """Input mixup's hooks for blobs, on the CPU RunContext the hooks keep (their preview off)."""
    cfg = to_node(InputMixupConfig(loss="ce", preview=False))
    return MixupHooks(cfg, 3, RunContext(torch.device("cpu"), tmp_path, tracker=None), seed=0)


@pytest.mark.slow
def test_a_pair_mixup_s_whole_step_compiled_follows_the_eager_trajectory(tmp_path):
    # drawn before the step, its ratio and partners enter the compiled step as tensors
    _, eager_rows = _fit(tmp_path / "eager", "train.epochs=2", hooks=_input_mixup(tmp_path))
    _, compiled_rows = _fit(tmp_path / "compiled", "train.epochs=2", hooks=_input_mixup(tmp_path),
                            compile="default")  # fmt: skip
    # the same draws; inductor's fusions reassociate float32 sums, as for ERM above
    for a, b in zip(eager_rows, compiled_rows):
        assert b["train/loss"] == pytest.approx(a["train/loss"], rel=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("method", ["erm", "input_mixup"])
def test_on_cuda_the_replayed_graph_trains_as_the_eager_step(tmp_path, method):
    def fit_on_cuda(name, graph):
        model_cfg, train_cfg, ctx = setup(
            tmp_path / name, "train.epochs=3", "train.batch_size=20", *SCHEDULES
        )
        ctx.device, ctx.cuda_graph = torch.device("cuda"), graph
        torch.manual_seed(0)
        model = build_model(model_cfg, (4,), 3)
        # input mixup: each replay must take the step's own ratio and partners from the static buffers
        fit(model, blobs(), train_cfg, ctx, _input_mixup(tmp_path) if method == "input_mixup" else None)
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


def _cli_rows(run_dir, *overrides) -> list[dict]:
    run_in_process([*overrides, "logger=none", "train.progress=false", f"hydra.run.dir={run_dir}"])
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _series(rows: list[dict], name: str) -> list[float]:
    """`name`'s values over the rows, under a fit's tag too (the long-tail task's `fit/...`)."""
    return [value for row in rows for key, value in row.items() if key == name or key.endswith(f"/{name}")]


# several epochs with a per-step warm-up and a cosine: the lr tensor is written in place between replays
WITH_SCHEDULES = ["train.schedule=cosine", "train.warmup_epochs=1"]


# the methods whose hooks draw before the step (`draw`); without it they draw inside the step
DRAWN_BEFORE = {"input_mixup": MixupHooks, "cutmix": MixupHooks, "manifold_mixup": MixupHooks,
                "csot": NoisyLabelHooks}  # fmt: skip


# one run of each family in `make test`: a pair mixup, a long-tail loss, CSOT, Co-Mixup, Puzzle Mix, hashing
FAMILY = {**dict.fromkeys(PAIR_MIXUPS, "pair"), "ldam_drw": "dbot", "comixup_lag": "comixup",
          "comixup_phases": "comixup", "hashing_triplet": "hashing_npairs"}  # fmt: skip


@pytest.mark.parametrize("method", quick_first(METHOD_RUNS, lambda m: FAMILY.get(m, m)))
def test_each_method_s_graph_ready_step_follows_its_eager_trajectory(tmp_path, method, monkeypatch):
    phases = any(o.startswith("train.phases=[{") for o in METHOD_RUNS[method])  # their lr ramps: the schedule
    runs = [*METHOD_RUNS[method], *([] if phases else WITH_SCHEDULES)]
    eager = _cli_rows(tmp_path / "eager", *runs)
    graphed = _cli_rows(tmp_path / "graph", *runs, "hardware.cuda_graph=true")
    assert _series(graphed, "lr") == pytest.approx(_series(eager, "lr"), rel=1e-6)
    # The same draws and the same device ops on the CPU (the draws are made before the step in both): only the
    # optimizer differs, the graph's fused kernel with its float32 lr tensor (0.2 rounds by 1.5e-8 relative)
    # against foreach's float lr, a few ulp per step, as in the ERM test above. The training map then carries
    # them on: here they stay at 0 to 2e-7 relative, but for input mixup on the PreAct ResNet (lr 0.2, batch
    # norm, random labels), 5e-5 by epoch 2, as its ERM step shows too; 5e-4 bounds that with room. A split
    # step adds the host's read and solve between its two regions, on the values the eager step reads (the
    # same summary, the same draws from the same stream): its cuts and codes change only where those few ulp
    # cross a tie of the discrete solve, which would show as a jump far past 5e-4 (here: Co-Mixup's runs
    # equal, hashing's within 3e-7, Adam's fused kernel against foreach's).
    assert _series(graphed, "train/loss") == pytest.approx(_series(eager, "train/loss"), rel=5e-4)
    if method in DRAWN_BEFORE:
        # without `draw` the loop hands nothing, and the hooks draw inside the step, as they did before: the
        # same random draws in the same order, and the same float arithmetic (a float64 ratio on the device
        # rounds as the host's number did; a masked paste and a where at each site select the same values)
        monkeypatch.setattr(DRAWN_BEFORE[method], "draw", None)
        inside = _cli_rows(tmp_path / "inside", *runs)
        assert _untimed(inside) == _untimed(eager)


def _untimed(rows: list[dict]) -> list[dict]:
    """The rows without their timings (`time/...`, CSOT's `select/solver_s`)."""
    return [{k: v for k, v in row.items() if not (k.startswith("time/") or k.endswith("_s"))} for row in rows]
