"""The hashing task (`+method=hier_hash`), its dataset `synthetic_hier` and its config checks."""

import json
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from runner.checks import ConfigError
from runner.compose import compose
from runner.data import Data, Split, load_data
from runner.data.samplers import ClassBalancedSampler
from runner.device_tracking import STAND_IN, DeviceTracker
from runner.hooks import hier_hash as hash_training
from runner.methods import hier_hash as hh
from runner.schema import TrainConfig
from runner.tasks import hashing
from runner.track import Tracker
from runner.train import fit
from runner.validate import validate


def composed(*overrides):
    return validate(compose(list(overrides)))


def test_synthetic_hier_sizes_and_hierarchy():
    cfg = OmegaConf.structured(composed("dataset=synthetic_hier")["dataset"])
    data = load_data(cfg, seed=0)
    assert data.num_classes == 64 and data.input_shape == (32,)
    assert len(data.train) == 6400 and len(data.val) == 0 and len(data.test) == 1920
    np.testing.assert_array_equal(np.bincount(data.test.y.numpy()), np.full(64, 30))
    superclass = data.meta["superclass"]
    np.testing.assert_array_equal(superclass, np.repeat(np.arange(8), 8))
    means = np.stack([data.train.x[data.train.y == c].mean(0).numpy() for c in range(64)])
    dist = np.linalg.norm(means[:, None] - means[None], axis=-1)
    same = superclass[:, None] == superclass[None]
    off_diagonal = ~np.eye(64, dtype=bool)
    # siblings: E|d|^2 = 2 dim class_std^2 = 64; across super-classes: 2 dim (1 + 4) = 320
    assert np.mean(dist[same & off_diagonal] ** 2) == pytest.approx(64 + 2 * 32 * 2.25 / 100, rel=0.15)
    assert np.mean(dist[~same] ** 2) == pytest.approx(320, rel=0.3)
    again = load_data(cfg, seed=0)
    assert torch.equal(again.train.x, data.train.x)


def test_synthetic_hier_bad_value_is_one_line():
    with pytest.raises(ConfigError, match="dataset.n_super=0"):
        composed("dataset=synthetic_hier", "dataset.n_super=0")


@pytest.mark.parametrize(
    "override, match",
    [
        ("method.ks=[1,40]", "method.ks="),
        ("method.beta=[0.1,0.2]", "one per ks"),
        ("method.solver=lemon", "method.solver='lemon'"),
        ("method.per_class=3", "exactly 2 with the N-pairs loss"),
        ("method.tables=[val]", "method.tables="),
        ("method.baselines=[pq]", "method.baselines="),
        ("method.dch_bits=[0]", "method.dch_bits="),
        ("method.dch_gamma=0", "method.dch_gamma=0"),
        ("method.decay_at=[30000,20000]", "method.decay_at="),
        ("method.input_norm=zca", "method.input_norm='zca'"),
        ("method.level1_beta=[0.1,0.2]", "one per ks"),
        ("method.decay=0", "method.decay=0"),
    ],
)
def test_bad_method_values_raise_config_error(override, match):
    with pytest.raises(ConfigError, match=match):
        composed("+method=hier_hash", override)


def test_presets_compose():
    method = composed("+experiment=hier_hash_synthetic")["method"]
    assert (method.d, method.k, method.ks, method.base, method.iters) == (16, 2, [1, 2, 3], "raw", 1000)
    for preset in ("hier_hash_cifar100_npairs", "hier_hash_cifar100_triplet"):
        cfg = composed(f"+experiment={preset}")
        assert cfg["dataset"].name == "cifar100" and cfg["model"].name == "nin"
        assert (cfg["method"].iters, cfg["method"].decay_at, cfg["method"].eval_every) == (
            70000,
            [20000],
            1.0,
        )
        assert cfg["method"].input_norm == "pixel_mean" and cfg["dataset"].val_fraction == 0.1
    # the paper's ImageNet protocol: ImageNet32 features, FC only, batch 1024 / 512, 15k / 30k iterations
    for preset, d, batch, iters, decay_at in (
        ("hier_hash_imagenet32_npairs", 512, 1024, 15000, [6000, 12000]),
        ("hier_hash_imagenet32_triplet", 256, 512, 30000, [10000, 20000]),
        ("hier_hash_imagenet", 512, 1024, 15000, [6000, 12000]),
    ):
        cfg = composed(f"+experiment={preset}")
        method = cfg["method"]
        assert (method.d, method.classes_per_batch * method.per_class, method.iters) == (d, batch, iters)
        assert method.decay_at == decay_at and method.lr_backbone == 0 and method.tables == ["test"]
        assert cfg["dataset"].name == ("imagenet" if preset == "hier_hash_imagenet" else "imagenet32")
        assert cfg["model"].name == ("resnet50" if preset == "hier_hash_imagenet" else "nin")


def test_learning_rate_at_given_iterations():
    """Iteration i (1-based) runs at lr * decay^#{t in decay_at : t < i}: the paper's Cifar-100 rule (decay_at
    [20000] over 70k iterations) at a thousandth of its length, stepped as training steps it; the ImageNet32
    presets' milestones give two decays by their last iteration."""
    net = torch.nn.Linear(2, 2)
    optimizer = torch.optim.Adam([{"params": net.weight, "lr": 1e-3}, {"params": net.bias, "lr": 1e-4}])
    scheduler = hash_training.lr_schedule(optimizer, [20], 0.3)
    seen = {}
    for i in range(1, 71):  # the lr iteration i runs at, then the step
        if i in (1, 20, 21, 70):
            seen[i] = [g["lr"] for g in optimizer.param_groups]
        optimizer.step()
        scheduler.step()
    assert seen[1] == seen[20] == pytest.approx([1e-3, 1e-4])
    assert seen[21] == seen[70] == pytest.approx([3e-4, 3e-5])  # one decay only
    for preset, last in (("hier_hash_imagenet32_npairs", 15000), ("hier_hash_imagenet32_triplet", 30000)):
        method = composed(f"+experiment={preset}")["method"]
        assert method.iters == last and sum(t < last for t in method.decay_at) == 2 and method.decay == 0.3


def test_level1_baseline_trains_on_class_labels_with_its_own_settings(monkeypatch):
    method = composed("+experiment=hier_hash_cifar100_npairs")["method"]
    ours, level1 = hashing.hash_nets(method)
    assert ours == ("ours", 32, 2, True, [0.07, 0.1, 0.1, 0.1], [0.5], [0.03, 0.01, 0.003, 0.001])
    assert level1 == ("k1-d64", 64, 1, False, [0.3], [1.0], [0.003])
    seen = {}

    def spy(outputs, codes, labels, *args):
        assert codes.device == labels.device == outputs.device  # sent back to the device, in one copy
        seen["labels"], seen["codes"] = labels.numpy(), codes.numpy()
        return outputs.sum() * 0

    monkeypatch.setattr(hash_training.hh, "hash_loss", spy)
    nc, d = 6, 3
    net = torch.nn.Linear(4, d)
    step = dict(nc=nc, m=2, k=1, d=d, ks=1, beta=0.3, margin=1.0, l2_reg=0.003)
    method = SimpleNamespace(loss="npairs", alpha=100.0, solver="ortools", cost_scale=None)
    torch.manual_seed(0)
    x = torch.randn(nc * 2, 4)
    hash_training.hash_step(
        net, torch.optim.SGD(net.parameters(), 0.1), x, method=method, remap=False, **step
    )
    np.testing.assert_array_equal(seen["labels"], [np.arange(nc)])  # classes, although codes repeat
    assert len({tuple(c) for c in seen["codes"][0]}) < nc  # 6 classes in 3 buckets: shared codes
    hash_training.hash_step(net, torch.optim.SGD(net.parameters(), 0.1), x, method=method, remap=True, **step)
    np.testing.assert_array_equal(seen["labels"], [hh.remap_labels(seen["codes"][0])])


@pytest.mark.parametrize("loss", hh.LOSSES)
def test_hash_step_reads_the_device_once(loss):
    """The unaries are read for the flow on the host; the codes go back in one non-blocking copy."""
    nc, d, k = 8, 4, 2
    method = SimpleNamespace(loss=loss, alpha=100.0, solver="ortools", cost_scale=None)
    step = dict(nc=nc, m=2, k=k, d=d, ks=2, method=method, beta=0.1, margin=0.5, l2_reg=0.003, remap=True)
    with DeviceTracker() as tracker:
        net = torch.nn.Linear(4, d * k)  # parameters count as on the device
        x = torch.randn(nc * 2, 4).to(STAND_IN, non_blocking=True)
        with tracker.in_phase("train"):
            loss_value, _ = hash_training.hash_loss_and_codes(net, x, **step)
            loss_value.backward()
    assert tracker.counts["train"] == {"sync": 1}, tracker.report()["sites"]


def test_class_balanced_sampler():
    labels = np.repeat(np.arange(10), [5, 5, 5, 5, 5, 5, 5, 5, 1, 1])
    sampler = ClassBalancedSampler(labels, nc=6, m=3, seed=0)
    for i in range(20):
        batch = sampler.batch(i)
        assert batch.shape == (6, 3)
        assert len(np.unique(labels[batch[:, 0]])) == 6  # distinct classes
        assert all(len(set(row)) == 3 and len(set(labels[row])) == 1 for row in batch)
    assert np.array_equal(sampler.stream(3, 5)[1].numpy(), sampler.batch(4).ravel())  # resumable by index
    assert not np.array_equal(sampler.batch(0), sampler.batch(1))
    with pytest.raises(ConfigError, match=r"only 8 classes .* set method.classes_per_batch<=8"):
        ClassBalancedSampler(labels, nc=9, m=2, seed=0)


@pytest.mark.parametrize("loss", hh.LOSSES)
def test_hash_step_learns_and_reports_code_time(loss):
    torch.manual_seed(0)
    nc, m, k, d, ks = 8, 2, 2, 4, 2
    centres = torch.randn(nc, 1, 6) * 3
    x = (centres + torch.randn(nc, m, 6)).reshape(nc * m, 6)
    net = torch.nn.Linear(6, k * d)
    optimizer = torch.optim.Adam(net.parameters(), 1e-2)
    method = SimpleNamespace(loss=loss, alpha=10.0, solver="ortools", cost_scale=None)
    step = dict(nc=nc, m=m, k=k, d=d, ks=ks, method=method, beta=0.1, margin=0.3, l2_reg=0.003, remap=True)
    losses = [hash_training.hash_step(net, optimizer, x, **step) for _ in range(60)]
    assert all(seconds > 0 for _, seconds in losses)
    assert np.mean([v for v, _ in losses[-10:]]) < np.mean([v for v, _ in losses[:10]])


def hash_setup(tmp_path, eval_every=0.0, n=8):
    """A tiny run: n items of 4 classes, batches of 2 x 2 (n / 4 iterations per epoch), a real tracker."""
    from runner.hardware import RunContext
    from runner.track import Tracker

    x, y = torch.randn(n, 3), torch.arange(4).repeat(n // 4)
    data = Data(Split(x, y, y), Split(x[:0], y[:0], y[:0]), Split(x[:0], y[:0], y[:0]), 4, (3,))
    method = SimpleNamespace(classes_per_batch=2, per_class=2, decay_at=[], decay=1.0, eval_every=eval_every,
                             iters=8)  # fmt: skip
    train = OmegaConf.structured(TrainConfig(progress=True, checkpoint_every_minutes=0))
    cfg = SimpleNamespace(method=method, dataset=SimpleNamespace(augment="none"), seed=0, train=train)
    ctx = RunContext(torch.device("cpu"), tmp_path, Tracker(tmp_path))
    return cfg, ctx, data


def add_one(net, x):
    """A loss whose optimizer step (lr 0) changes nothing; each call adds 1 to the bias instead."""
    with torch.no_grad():
        net.bias += 1
    return net(x).sum() * 0, 0.0


def rows(run_dir, tag):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if any(key.startswith(f"{tag}/") for key in r)]


def test_a_net_trains_through_fit_by_iterations_and_logs_its_rows(tmp_path, caplog):
    cfg, ctx, data = hash_setup(tmp_path, n=12)  # 3 iterations per epoch: epochs of 3, 3, 2
    net = torch.nn.Linear(3, 1)
    torch.nn.init.zeros_(net.bias)
    seen = []
    net.register_forward_pre_hook(lambda module, args: seen.append(len(args[0])))
    with caplog.at_level("INFO", logger="runner.train"):
        timing = hashing.train_net(
            cfg, ctx, data, "t", net, [{"params": net.parameters(), "lr": 0.0}], add_one, 8
        )
    assert net.bias.item() == 8 and seen == [4] * 8  # 8 iterations of 2 classes x 2
    assert (tmp_path / "checkpoints" / "t.pt").exists() and timing["val_p@1"] is None
    assert [r["t/epoch"] for r in rows(tmp_path, "t")] == [1, 2, 3]
    assert "t: epoch 3/3" in caplog.text


def test_each_epoch_logs_its_own_code_seconds(tmp_path):
    cfg, ctx, data = hash_setup(tmp_path, n=12)  # 3 iterations per epoch: epochs of 3, 3, 2
    net = torch.nn.Linear(3, 1)
    groups = [{"params": net.parameters(), "lr": 0.0}]
    timing = hashing.train_net(cfg, ctx, data, "c", net, groups, lambda n, x: (n(x).sum(), 0.25), 8)
    assert [r["c/time/code_s"] for r in rows(tmp_path, "c")] == [0.75, 0.75, 0.5]  # not a running total
    assert timing["code_share"] == 2.0 / timing["seconds"]


def test_hash_lr_steps_per_iteration(tmp_path):
    cfg, ctx, data = hash_setup(tmp_path)  # epochs of 2 iterations
    cfg.method.decay_at, cfg.method.decay = [3], 0.5
    net = torch.nn.Linear(3, 1)
    lrs = []

    class Recording(hash_training.HashHooks):
        def optimizer(self, model):
            self.opt, scheduler, per_step = super().optimizer(model)
            return self.opt, scheduler, per_step

    def loss(net, x):
        lrs.append(hooks.opt.param_groups[0]["lr"])
        return net(x).sum() * 0, 0.0

    groups = [{"params": net.parameters(), "lr": 1.0}]
    hooks = Recording(cfg.method, data.train.y.numpy(), 0, groups, loss, ctx)
    fit(net, data, hash_training.train_config(cfg.train, hooks), ctx, hooks, tag="lr")
    assert lrs == [1.0] * 3 + [0.5] * 5  # iteration i runs at lr * 0.5^#{3 < i}, across epochs


def test_validation_each_epoch_restores_the_best_validation_net(tmp_path):
    cfg, ctx, data = hash_setup(tmp_path, eval_every=1.0, n=8)  # 8 items, batches of 4: 2 its per epoch
    net = torch.nn.Linear(3, 1)
    torch.nn.init.zeros_(net.bias)
    groups = [{"params": net.parameters(), "lr": 0.0}]
    scores = iter([0.2, 0.5, 0.9, 0.4, 0.6])  # before training, then after iterations 2, 4, 6, 8
    timing = hashing.train_net(cfg, ctx, data, "v", net, groups, add_one, 8, lambda: next(scores))
    assert net.bias.item() == 4 and timing["val_p@1"] == 0.9  # the net after iteration 4
    assert [(r["v/epoch"], r["v/val/p@1"]) for r in rows(tmp_path, "v")] == [
        (0, 0.2), (1, 0.5), (2, 0.9), (3, 0.4), (4, 0.6)
    ]  # fmt: skip
    never_better = iter([0.9, 0.1, 0.2, 0.3, 0.4])
    torch.nn.init.zeros_(net.bias)
    hashing.train_net(cfg, ctx, data, "w", net, groups, add_one, 8, lambda: next(never_better))
    assert net.bias.item() == 0  # the untrained net stays, as the authors' selection


class Killed(Exception):
    pass


def test_restart_resumes_exactly_and_writes_no_duplicate_rows(tmp_path):
    """A net killed during its 3rd epoch (after the 2nd's checkpoint), then restarted: each epoch's row
    once, another net's rows kept, every RNG restored (the draws of the uninterrupted run), the best kept."""
    scores = {0: 0.1, 2: 0.3, 4: 0.2, 6: 0.8, 8: 0.4}  # by the bias, the iterations done

    def run(run_dir, kill_at=None):
        cfg, ctx, data = hash_setup(run_dir, eval_every=1.0)  # epochs of 2 iterations
        torch.manual_seed(0), np.random.seed(0), random.seed(0)
        net = torch.nn.Linear(3, 1)
        torch.nn.init.zeros_(net.bias)
        draws = []

        def loss(net, x):
            draws.append((torch.rand(1).item(), np.random.rand(), random.random()))
            return add_one(net, x)

        def score():
            if net.bias.item() == kill_at:
                raise Killed
            return scores[round(net.bias.item())]

        groups = [{"params": net.parameters(), "lr": 0.0}]
        return net, hashing.train_net(cfg, ctx, data, "h", net, groups, loss, 8, score), draws

    straight_net, straight, straight_draws = run(tmp_path / "a")
    Tracker(tmp_path / "b").log({"other/epoch": 1, "other/val/p@1": 0.5})  # a net trained before
    with pytest.raises(Killed):
        run(tmp_path / "b", kill_at=6)
    assert [r["h/epoch"] for r in rows(tmp_path / "b", "h")] == [0, 1, 2]
    net, timing, draws = run(tmp_path / "b")
    assert [r["h/epoch"] for r in rows(tmp_path / "b", "h")] == [0, 1, 2, 3, 4]
    assert len(rows(tmp_path / "b", "other")) == 1
    assert draws == straight_draws[4:] and len(straight_draws) == 8
    assert (
        net.bias.item() == straight_net.bias.item() == 6 and timing["val_p@1"] == straight["val_p@1"] == 0.8
    )


def test_pixel_mean_input_is_x_over_255_minus_the_mean_image(tmp_path):
    from runner.hardware import RunContext

    raw = torch.randint(0, 256, (10, 3, 4, 4)).float()
    mean, std = torch.tensor([0.5, 0.4, 0.3]), torch.tensor([0.2, 0.25, 0.3])
    x = (raw / 255 - mean.view(1, 3, 1, 1)) / std.view(1, 3, 1, 1)
    y = torch.zeros(10, dtype=torch.long)
    data = SimpleNamespace(
        train=Split(x, y, y), meta={"normalize": (tuple(mean.tolist()), tuple(std.tolist()))}
    )
    norm = hash_training.pixel_mean_input(data, RunContext(torch.device("cpu"), tmp_path, None), batch_size=3)
    expected = raw / 255 - (raw / 255).mean(0)
    assert torch.allclose(norm(x), expected, atol=1e-6)
    with pytest.raises(ConfigError, match="input_norm=pixel_mean"):
        hash_training.pixel_mean_input(SimpleNamespace(train=Split(x, y, y), meta={}), None, 3)


@pytest.mark.slow
def test_cli_synthetic_reports_every_row(cli, tmp_path):
    run_dir = tmp_path / "run"
    cli("+experiment=hier_hash_synthetic", "method.iters=50", "method.ks=[1,2]", "method.level1_d=[32]",
        "method.vq_centroids=[16,256]", "method.baselines=[th,vq,level1,lsh,dch]", "logger=none",
        f"hydra.run.dir={run_dir}")  # fmt: skip
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = [(row, ks) for row in ("ours", "k1-d32", "Th", "VQ-16", "VQ-256") for ks in (1, 2)] + [
        ("LSH-5", 1),
        ("DCH-5", 1),
    ]
    for row, ks in rows:
        cell = {key: summary[f"hash/test/{row}/ks{ks}/{key}"] for key in ("p@1", "p@16", "suf@1", "nmi")}
        assert 0 <= cell["p@1"] <= 1 and 0 <= cell["nmi"] <= 1 and cell["suf@1"] >= 1
    assert summary["test/p@1"] == summary["hash/test/ours/ks1/p@1"]
    assert summary["test/suf@1"] == summary["hash/test/ours/ks1/suf@1"]
    assert 0 < summary["time/mcf_share"] < 1
    # a 256-bucket table cannot beat the exhaustive search's candidate count by more than 1919x
    assert summary["hash/test/VQ-256/ks1/suf@1"] > summary["hash/test/VQ-16/ks1/suf@1"]
    header = "| ks | ours | k1-d32 | DCH-5 | Th | VQ-16 | VQ-256 | LSH-5 |"
    assert header in (run_dir / "retrieval.md").read_text()
    assert "hash/test/LSH-5/ks2/p@1" not in summary  # LSH and DCH at ks=1 only, as the paper
    assert "hash/test/DCH-5/ks2/p@1" not in summary


@pytest.mark.slow
def test_cli_pretrained_base_train_table_and_resume(cli, tmp_path):
    run_dir = tmp_path / "run"
    args = ["+method=hier_hash", "dataset=digits", "model.hidden=[32]", "method.d=4", "method.ks=[1]",
            "method.beta=[0.1]", "method.npairs_l2=[0.01]", "method.classes_per_batch=8", "method.iters=20",
            "method.base_dim=8", "method.base_iters=20", "method.eval_every=0.1", "method.baselines=[]",
            "logger=none", "hardware.threads=1", f"hydra.run.dir={run_dir}"]  # fmt: skip
    cli(*args)
    first = json.loads((run_dir / "summary.json").read_text())
    assert {
        "hash/train/metric/p@1",
        "hash/train/ours/ks1/suf@16",
        "hash/test/ours/ks1/nmi",
        "val/p@1",
    } <= set(first)
    assert (run_dir / "checkpoints" / "hier_hash_base_final.pt").exists()
    proc = cli(*args)  # every net's checkpoint is complete: the rerun only evaluates
    assert (
        "resumed from" in proc.stderr + proc.stdout
        and "ours_ks1.pt (end of epoch" in proc.stderr + proc.stdout
    )
    second = json.loads((run_dir / "summary.json").read_text())
    assert {k: v for k, v in second.items() if not k.startswith("time/")} == {
        k: v for k, v in first.items() if not k.startswith("time/")
    }


def test_cli_bad_method_value_is_one_line(cli_here):
    proc = cli_here("+method=hier_hash", "dataset=synthetic_hier", "method.ks=[0]", "logger=none",
                    check=False)  # fmt: skip
    assert proc.returncode == 2 and "method.ks=[0]" in proc.stderr and "Traceback" not in proc.stderr


def test_a_batch_that_does_not_split_over_the_ranks_is_a_one_line_error(tmp_path):
    from runner.compose import typed
    from runner.hardware import RunContext

    cfg = compose(["+experiment=hier_hash_synthetic", "logger=none", "method.classes_per_batch=5"])
    cfg = typed(cfg, validate(cfg))
    ctx = RunContext(torch.device("cpu"), tmp_path, Tracker(tmp_path, enabled=False), rank=0, world_size=4)
    with pytest.raises(ConfigError, match=r"classes_per_batch x method.per_class = 10: .* over 4 ranks"):
        hashing.run(cfg, ctx)
