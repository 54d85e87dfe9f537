"""Progressive training phases (`train.phases`), weight decay groups (`train.bn_weight_decay`),
zero-initialised residual blocks (`model.zero_init_residual`), and the Co-Mixup headline numbers: the median
of the last 10 epochs (`*_median10`, a preset's `metric`) and the 10-bin ECE (`train.ece_bins`)."""

import json
import statistics

import pytest
import torch
from omegaconf import OmegaConf
from test_train import KillAt, blobs, setup

from runner.checkpoint import CHECKPOINT
from runner.checks import ConfigError
from runner.compose import compose
from runner.data import Data, split_of
from runner.hardware import RunContext
from runner.instruments import Instruments, watching
from runner.models import build_model
from runner.optim import make_optimizer
from runner.track import Tracker
from runner.train import fit
from runner.validate import validate

# Two phases: 1 epoch at 4 px in batches of 20 (lr 0.1 -> 0.2), then 2 epochs at the data's 8 px in
# batches of 10 (lr 0.05 -> 0.01).
PHASES = (
    "train.phases=[{epochs: 1, image_size: 4, batch_size: 20, lr: [0.1, 0.2]},"
    " {epochs: 2, image_size: 0, batch_size: 10, lr: [0.05, 0.01]}]"
)
PHASED = ["train.epochs=3", "train.schedule=none", PHASES]


def configs(tmp_path, *overrides):
    cfg = validate(compose(["model=cnn", "model.channels=[4]", "train.progress=false", *overrides]))
    ctx = RunContext(torch.device("cpu"), tmp_path, Tracker(tmp_path))
    return OmegaConf.structured(cfg["model"]), OmegaConf.structured(cfg["train"]), ctx


def model_config(*overrides):
    return OmegaConf.structured(validate(compose(list(overrides)))["model"])


def images(n=60, seed=0) -> Data:
    """3 classes of 1x8x8 images, each a bright row (the class) on noise."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 3, (3 * n,), generator=g)
    x = 0.3 * torch.rand(3 * n, 1, 8, 8, generator=g)
    x[torch.arange(3 * n), 0, 2 * y + 1] += 1.0
    return Data(*[split_of(x[i::3], y[i::3]) for i in range(3)], num_classes=3, input_shape=(1, 8, 8))


def train(tmp_path, *overrides, hooks=None, seed=0, augment="none"):
    model_cfg, train_cfg, ctx = configs(tmp_path, *overrides)
    torch.manual_seed(seed)
    model = build_model(model_cfg, (1, 8, 8), 3)
    return model, fit(model, images(), train_cfg, ctx, hooks, augment=augment)


def rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_each_step_takes_its_phase_s_batch_size_image_side_and_linear_lr(tmp_path):
    seen = []

    class Recording(Instruments):
        def step(self, s, x, idx, epoch):
            seen.append((epoch, tuple(x.shape), s.optimizer.param_groups[0]["lr"]))
            return super().step(s, x, idx, epoch)

    with watching(Recording()):
        train(tmp_path, *PHASED)
    # 60 training images: 3 steps of 20 in the first epoch, 6 of 10 in each of the two others
    expected = [(0, (20, 1, 4, 4), 0.1 + 0.1 * (i + 1) / 3) for i in range(3)]
    for epoch in (1, 2):
        done = [(epoch - 1) + (i + 1) / 6 for i in range(6)]  # epochs into the phase at each step's end
        expected += [(epoch, (10, 1, 8, 8), 0.05 - 0.04 * t / 2) for t in done]
    assert [(e, shape) for e, shape, _ in seen] == [(e, shape) for e, shape, _ in expected]
    assert [lr for *_, lr in seen] == pytest.approx([lr for *_, lr in expected], rel=1e-12)
    assert [r["lr"] for r in rows(tmp_path)] == pytest.approx([0.2, 0.03, 0.01])  # each epoch's last step


def test_a_run_stopped_at_a_phase_boundary_resumes_as_the_straight_run(tmp_path):
    run = [*PHASED, "train.bn_weight_decay=false", "train.weight_decay=0.01"]
    straight, _ = train(tmp_path / "a", *run, augment="crop_flip")
    with pytest.raises(KeyboardInterrupt):
        train(tmp_path / "b", *run, hooks=KillAt(1), augment="crop_flip")  # after the first phase
    resumed, _ = train(tmp_path / "b", *run, seed=1, augment="crop_flip")
    for p, q in zip(straight.state_dict().values(), resumed.state_dict().values()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    keep = ("lr", "train/loss", "test/acc")
    assert [{k: r[k] for k in keep} for r in rows(tmp_path / "a")] == [
        {k: r[k] for k in keep} for r in rows(tmp_path / "b")
    ]
    state = torch.load(tmp_path / "b" / CHECKPOINT, weights_only=False)
    assert [g["weight_decay"] for g in state["optimizer"]["param_groups"]] == [0.01, 0.0]


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["train.epochs=4", "train.schedule=none", PHASES], "train.phases cover 3 epochs but train.epochs=4"),
        (["train.epochs=3", PHASES], "train.schedule='cosine' does not combine with train.phases"),
        (
            ["train.epochs=3", "train.schedule=none", "train.warmup_epochs=1", PHASES],
            "train.warmup_epochs=1 does not combine with train.phases",
        ),
        (
            ["train.epochs=1", "train.schedule=none", "train.phases=[{epochs: 1, batch_size: 8, lr: [0.1]}]"],
            "train.phases.0.lr=[0.1]: must be [start, end]",
        ),
    ],
)
def test_bad_phases_are_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        validate(compose(overrides))


def test_bn_weight_decay_false_leaves_norms_and_biases_undecayed(tmp_path):
    model_cfg, train_cfg, _ = configs(tmp_path, "train.bn_weight_decay=false", "train.weight_decay=0.1")
    model = build_model(model_cfg, (1, 8, 8), 3)
    conv, norm, classifier = model.body[0], model.body[1], model.classifier
    optimizer = make_optimizer(model, train_cfg)
    decayed, free = optimizer.param_groups
    assert [id(p) for p in decayed["params"]] == [id(conv.weight), id(classifier.weight)]
    assert {id(p) for p in free["params"]} == {id(norm.weight), id(norm.bias), id(classifier.bias)}
    assert (decayed["weight_decay"], free["weight_decay"]) == (0.1, 0.0)
    # a step on zero gradients: only the decayed weights shrink, by lr * wd
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    for name, p in model.named_parameters():
        factor = 1 - 0.1 * 0.1 if name in ("body.0.weight", "classifier.weight") else 1.0
        torch.testing.assert_close(p.detach(), before[name] * factor)
    _, default_cfg, _ = configs(tmp_path)
    assert len(make_optimizer(model, default_cfg).param_groups) == 1  # the default: decay on everything


@pytest.mark.parametrize(
    "name,blocks,last_norm",
    [("resnet50", 16, "bn3"), ("resnet18", 8, "bn2"), ("resnet32", 15, "body.3"), ("resnext29", 9, "body.5")],
)
def test_zero_init_residual_zeroes_exactly_the_last_norm_of_each_block(name, blocks, last_norm):
    model = build_model(model_config(f"model={name}", "model.zero_init_residual=true"), (3, 32, 32), 10)
    zeroed = {
        n for n, m in model.named_modules() if isinstance(m, torch.nn.BatchNorm2d) and not m.weight.any()
    }
    assert len(zeroed) == blocks and all(n.endswith("." + last_norm) for n in zeroed)
    plain = build_model(model_config(f"model={name}"), (3, 32, 32), 10)
    assert not any(
        isinstance(m, torch.nn.BatchNorm2d) and not m.weight.any() for m in plain.modules()
    )  # the default keeps every scale at 1


def test_zero_init_residual_on_a_network_without_such_blocks_is_one_line():
    with pytest.raises(ConfigError, match="model=preactresnet18 has no post-activation residual blocks"):
        model_config("model=preactresnet18", "model.zero_init_residual=true")  # before any run starts


def test_median_of_the_last_10_epochs_and_the_10_bin_ece_match_a_hand_computation(tmp_path):
    model_cfg, train_cfg, ctx = setup(tmp_path, "train.epochs=12", "train.lr=0.02", "train.ece_bins=10")
    torch.manual_seed(0)
    model = build_model(model_cfg, (4,), 3)
    data = blobs()
    metrics = fit(model, data, train_cfg, ctx)
    history = rows(tmp_path)
    for key in ("test/acc", "val/acc"):
        values = [r[key] for r in history]
        last10 = sorted(values[-10:])
        assert metrics[f"{key}_median10"] == pytest.approx((last10[4] + last10[5]) / 2)
        assert (metrics[f"{key}_best"], metrics[f"{key}_last"]) == (max(values), values[-1])
    # ECE: 10 equal-width bins of the top-class confidence, |accuracy - confidence| weighted by bin size
    with torch.no_grad():
        probs = model(data.test.x).softmax(1)
    conf, pred = probs.max(1)
    ece = 0.0
    for b in range(10):
        inside = [i for i in range(len(conf)) if min(int(conf[i] * 10), 9) == b]
        if inside:
            acc = sum(int(pred[i] == data.test.y[i]) for i in inside) / len(inside)
            ece += len(inside) / len(conf) * abs(acc - statistics.fmean(float(conf[i]) for i in inside))
    assert metrics["test/ece"] == pytest.approx(ece, abs=1e-6)
    assert 0 < ece < 0.5  # the model is neither perfect nor random: the bins are not trivially equal


def test_a_preset_s_metric_is_what_the_report_ranks_and_a_search_selects_on():
    import runner.tasks.classify
    from runner.compose import objective
    from runner.report import task_metric

    assert task_metric({"metric": "test/acc_median10"}) == ("test/acc_median10", "max")
    assert task_metric({"metric": "test/ece:min"}) == ("test/ece", "min")
    assert task_metric({}) == runner.tasks.classify.TASK.metric
    cfg = compose(["+experiment=comixup_cifar100_wrn16_8", "dataset.val_fraction=0.1"])
    assert objective(runner.tasks.classify.TASK, cfg) == "val/acc_median10"
    with pytest.raises(ConfigError, match="metric=test/acc:best: the direction after ':' must be max or min"):
        validate(compose(["+metric=test/acc:best"]))


TABLE_ROWS = ["erm", "input_mixup", "manifold_mixup", "cutmix", "puzzle_mix", "comixup"]


def test_the_imagenet_preset_gives_every_row_the_authors_recipe_and_comixup_its_settings():
    trains, models = [], []
    for method in TABLE_ROWS:
        for order in ([f"+method={method}", "+experiment=comixup_imagenet"],
                      ["+experiment=comixup_imagenet", f"+method={method}"]):  # fmt: skip
            checked = validate(compose(order))
            trains.append(checked["train"])
            models.append(checked["model"])
            assert checked["metric"] == "test/acc"  # the ImageNet code tests the final checkpoint
            if method == "comixup":
                m = checked["method"]
                assert (m.part, m.n_iter, m.alpha) == (16, 3, 1.0)
    assert all(t == trains[0] for t in trains) and all(m == models[0] for m in models)
    train = trains[0]
    assert (train.bn_weight_decay, train.ece_bins, models[0].zero_init_residual) == (False, 10, True)
    phases = [(p.epochs, p.image_size, p.batch_size, *p.lr) for p in train.phases]
    assert phases == [
        (8, 128, 1024, 0.5, 1.0), (7, 128, 1024, 1.0, 0.125), (25, 224, 448, 0.2, 0.02),
        (25, 224, 448, 0.02, 0.002), (25, 224, 448, 0.002, 0.0002), (10, 224, 448, 0.0002, 0.00002),
    ]  # fmt: skip
    short = validate(compose(["+experiment=comixup_imagenet", "train.epochs=2"]))  # a smoke run, a benchmark
    assert short["train"].phases == train.phases  # stops inside the first phase
    given = validate(compose(["+method=comixup", "+experiment=comixup_imagenet", "method.part=8"]))
    assert given["method"].part == 8  # the command line wins over the preset's per_method
