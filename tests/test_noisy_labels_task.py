"""The noisy-label task: configs, the network, views, the two loaders, the selection hook against the
solver, the losses and their Table 4 ablations, the CLI."""

import dataclasses
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import run_cli_here
from omegaconf import OmegaConf

from runner.augment import OPS, PolicyAugment, apply_ops, cutout, policy_table, shift
from runner.batches import EpochBatches
from runner.checks import ConfigError
from runner.data import Data, Split
from runner.data.samplers import EpochSample, PoolBatches, SampleBatches, balanced_quotas, pool_batches
from runner.data.views import Views, random_resized_crop_flip
from runner.device_tracking import STAND_IN, DeviceTracker
from runner.faults import Interrupted
from runner.hardware import RunContext
from runner.hooks.csot import (
    NoisyLabelHooks,
    gmm_clean_probability,
    probabilities_and_features,
    selection_stats,
)
from runner.methods.csot import allocate
from runner.models import MLP
from runner.models.noisy_labels import NoisyLabelNet
from runner.schema import TrainConfig
from runner.tasks.noisy_labels import METHODS
from runner.train import fit


class _Tracker:
    def __init__(self):
        self.records = []

    def log(self, metrics, step=None):
        self.records.append((step, metrics))

    def truncate(self, last_step):
        self.records = [(step, m) for step, m in self.records if step is None or step <= last_step]


def _toy(n=120, k=4, noise=0.4, seed=0):
    rng = np.random.default_rng(seed)
    y_clean = rng.integers(k, size=n)
    x = rng.standard_normal((n, 6)) + 3 * np.eye(k, 6)[y_clean]
    y = np.where(rng.random(n) < noise, rng.integers(k, size=n), y_clean)
    split = Split(torch.tensor(x, dtype=torch.float32), torch.tensor(y), torch.tensor(y_clean))
    empty = Split(split.x[:0], split.y[:0], split.y_clean[:0])
    return Data(split, empty, empty, num_classes=k, input_shape=(6,))


def _net(data, predictor=True):
    torch.manual_seed(0)
    backbone = MLP(data.input_shape, data.num_classes, hidden=(16,))
    return NoisyLabelNet(backbone, head=True, predictor_hidden=8 if predictor else None)


def _ctx(tmp_path, rank=0, world_size=1):
    return RunContext(torch.device("cpu"), tmp_path, _Tracker(), rank=rank, world_size=world_size)


def _hooks(name, data, tmp_path, batch_size=32, epoch_samples=0, **overrides):
    cfg = METHODS[name](**{"warmup": 1, "curriculum_end": 5, "solve_batch": 50, **overrides})
    model, ctx = _net(data, cfg.loss == "paper"), _ctx(tmp_path)
    views = Views(data.input_shape)
    hooks = NoisyLabelHooks(cfg, model, data, ctx, views, False, 0, batch_size, epoch_samples)
    return hooks, model, ctx


def test_method_configs_and_errors():
    assert set(METHODS) == {"csot", "cot", "ot", "sot", "small_loss", "ce"}
    assert METHODS["cot"]().kappa_p == 0 and METHODS["ot"]().selection == "ot"
    assert METHODS["sot"]().selection == "ot" and METHODS["sot"]().kappa_l == 1  # Table 4 (b)
    for kwargs, match in (
        ({"selection": "gmm"}, "method.selection"),
        ({"m0": 0.0}, "method.m0"),
        ({"m0": 1.5}, "method.m0"),
        ({"warmup": 20, "curriculum_end": 10}, "method.curriculum_end"),
        ({"eps": 0.0}, "method.eps"),
        ({"loss": "mixup"}, "method.loss"),
        ({"budget": "exp"}, "method.budget"),
        ({"correction": "gmm"}, "method.correction"),
        ({"stage_switch": "late"}, "method.stage_switch"),
    ):
        with pytest.raises(ConfigError, match=match):
            METHODS["csot"](**kwargs)


def test_classifier_reads_the_head_output():
    data = _toy()
    model = _net(data)
    x = data.train.x[:5]
    backbone_features = model.backbone.forward_features(x)
    z = model.head(backbone_features)
    torch.testing.assert_close(model.forward_features(x), z)
    torch.testing.assert_close(model(x), model.classifier(z))
    logits, z_ssl, p = model(x, ssl=True)
    torch.testing.assert_close(z_ssl, z)
    torch.testing.assert_close(p, model.predictor(z))
    with torch.no_grad():  # the head sits between the features and the classifier
        model.head.weight.mul_(2)
    assert not torch.allclose(model(x), logits)
    torch.testing.assert_close(model.backbone(x), backbone_features)  # its own classifier is gone
    plain = NoisyLabelNet(MLP(data.input_shape, data.num_classes, hidden=(16,)), False, None)
    torch.testing.assert_close(plain(x), plain.classifier(plain.backbone.forward_features(x)))


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
    shifted = shift(x, 1)
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
    holes = (cutout(torch.ones(4, 1, 8, 8), 3) == 0).sum(dim=(1, 2, 3))
    assert holes.min() >= 4 and holes.max() <= 9  # a 3x3 square, clipped at the border
    torch.manual_seed(0)
    holes = (cutout(torch.ones(64, 3, 32, 32), 16) == 0).sum(dim=(2, 3))  # Cutout 16 of the CIFAR-LT recipe
    assert holes.max() == 256 and holes.min() >= 64 and (holes[:, 0:1] == holes).all()
    views = Views((3, 32, 32), mean=[0.5] * 3, std=[0.25] * 3)
    assert views.strong(torch.randn(6, 3, 32, 32)).shape == (6, 3, 32, 32)
    assert Views((7,)).strong(torch.randn(3, 7)).shape == (3, 7)


def test_the_resized_crop_view_is_torchvisions_random_resized_crop_and_flip_on_the_device():
    """On an image of its own pixel coordinates (channel 0 the row, 1 the column) each output is a bilinear
    resample of one box: rows and columns constant in the other coordinate; the box's area fraction in
    [0.08, 1] and aspect in [3/4, 4/3] (up to the 1-px rounding), both ranges covered; half flipped."""
    side, n = 32, 400
    coordinates = torch.arange(side, dtype=torch.float32)
    rows, cols = torch.meshgrid(coordinates, coordinates, indexing="ij")
    torch.manual_seed(0)
    out = random_resized_crop_flip(torch.stack([rows, cols])[None].expand(n, 2, side, side).contiguous())
    assert torch.allclose(out[:, 0], out[:, 0, :, :1]) and torch.allclose(out[:, 1], out[:, 1, :1, :])
    # a box of b pixels sampled at side pixel centres spans b (side - 1) / side; 0.5 px lost at the border
    height = (out[:, 0].amax((1, 2)) - out[:, 0].amin((1, 2))) * side / (side - 1)
    width = (out[:, 1].amax((1, 2)) - out[:, 1].amin((1, 2))) * side / (side - 1)
    area, aspect = height * width / side**2, width / height
    assert area.min() >= 0.08 - 0.1 and area.max() <= 1 + 1e-6 and area.min() < 0.2 and area.max() > 0.8
    assert aspect.min() >= 3 / 4 - 0.15 and aspect.max() <= 4 / 3 + 0.2
    flipped = (out[:, 1, 0, 0] > out[:, 1, 0, -1]).sum().item()
    assert 140 <= flipped <= 260  # Binomial(400, 1/2): sd 10
    constant = random_resized_crop_flip(torch.full((8, 3, 16, 16), 0.3))
    assert torch.allclose(constant, torch.full_like(constant, 0.3))
    views = Views((3, 32, 32), weak="rrc_flip")
    assert views.strong(torch.randn(6, 3, 32, 32)).shape == (6, 3, 32, 32)


def test_the_webvision_preset_takes_dividemixs_views():
    from runner.compose import compose
    from runner.data.files import IMAGENET_STATS, image_transforms

    cfg = compose(["+experiment=csot_webvision"])
    assert cfg.method.weak_view == "rrc_flip"
    assert (cfg.dataset.eval_resize, cfg.dataset.image_size) == (320, 299)
    evaluate = image_transforms("rrc_flip", 299, *IMAGENET_STATS, eval_resize=320).eval
    image = torch.zeros(3, 400, 640, dtype=torch.uint8)
    image[:, 40:360, 160:480] = 255  # a 320-px white square: 256 px after the resize to 320 x 512
    out = evaluate(image)  # the 299-px center crop of that (the ImageNet convention's 342: 274 px)
    assert out.shape == (3, 299, 299)
    white_down, white_across = int((out[0, :, 149] > 127).sum()), int((out[0, 149] > 127).sum())
    assert abs(white_down - 256) <= 2 and abs(white_across - 256) <= 2  # antialiased edges: a pixel each


@pytest.mark.parametrize(
    "policy, shape", [("autoaugment_cifar10", (3, 32, 32)), ("autoaugment_imagenet", (1, 20, 20)),
                      ("randaugment", (3, 24, 40))],
)  # fmt: skip
def test_policy_ops_are_torchvisions(policy, shape):
    """Every (op, magnitude, sign) of the policy, one per image of a batch, against torchvision's own call
    on that image (`AutoAugment`'s dispatch; float kernels): the geometry to the pixel, the colour ops to
    float rounding (the sharpness smoothing is summed in another order)."""
    from torchvision.transforms import v2

    stages = [stage for row in policy_table(policy, *shape[1:]) for stage in row]
    entries = sorted(
        {(op, sign * mag) for op, _, mag, signed in stages for sign in ((1, -1) if signed else (1,))}
    )
    torch.manual_seed(0)
    images = torch.rand(len(entries), *shape)
    images[0] = 0.5  # a flat image: autocontrast and equalize leave it
    augment = PolicyAugment(policy, [0.5] * shape[0], [0.25] * shape[0])
    ops = torch.tensor([OPS.index(op) for op, _ in entries])
    out = apply_ops(images, ops, torch.tensor([mag for _, mag in entries], dtype=torch.float64),
                    augment.constants(images))  # fmt: skip
    torchvision = v2.AutoAugment()
    for image, result, (op, mag) in zip(images, out, entries):
        expected = torchvision._apply_image_or_video_transform(image, op, mag, "nearest", torchvision._fill)
        torch.testing.assert_close(result, expected, rtol=0, atol=1e-6, msg=f"{op} {mag}")


def test_policy_is_drawn_per_image_and_never_waits_for_the_device():
    image = torch.rand(1, 3, 32, 32)
    augment = PolicyAugment("autoaugment_cifar10", [0.5] * 3, [0.25] * 3)
    with DeviceTracker() as tracker:
        x = image.expand(256, -1, -1, -1).to(STAND_IN, non_blocking=True)
        augment(x)  # makes its constants on the device (a few copies, once)
        with tracker.in_phase("train"):
            out = augment(x)
    assert dict(tracker.counts["train"]) == {}, tracker.report()["sites"]
    distinct = torch.unique(out.flatten(1), dim=0)
    assert len(distinct) > 25  # 25 sub-policies, each stage applied or not, signs: many per batch
    assert torch.isclose(out, image, atol=1e-6).all((1, 2, 3)).any()  # some drew nothing that changes them
    with pytest.raises(ValueError, match="policy"):
        PolicyAugment("trivialaugment", [0.5], [0.25])


def test_gmm_separates_small_losses():
    rng = np.random.default_rng(0)
    losses = np.r_[rng.normal(0.1, 0.05, 80), rng.normal(2.0, 0.3, 40)]
    p = gmm_clean_probability(losses)
    assert (p[:80] > 0.5).mean() > 0.95 and (p[80:] < 0.5).mean() > 0.95


def test_pool_batches_cycle_fresh_permutations():
    pool = torch.tensor([3, 8, 11, 20, 21])
    out = pool_batches(pool, steps=3, batch_size=4, generator=torch.Generator().manual_seed(0))
    assert out.shape == (3, 4)
    flat = out.flatten()
    for start in (0, 5):  # two complete shuffled passes, then the start of a third
        assert sorted(flat[start : start + 5].tolist()) == pool.tolist()
    assert set(flat[10:].tolist()) <= set(pool.tolist()) and len(set(flat[10:].tolist())) == 2


@pytest.mark.parametrize("rank", [0, 1])
def test_pool_batches_take_the_rank_shard_of_each_pool_for_the_longer_pool(rank):
    pools = [torch.arange(10), torch.arange(10, 40)]  # 10 // 4 = 2 and 30 // 4 = 7 batches: 7 steps
    sampler = PoolBatches(lambda: pools, 4, rank, 2, seed=0)
    sampler.set_epoch(3)
    steps = list(sampler)
    assert len(sampler) == len(steps) == 7
    one_process = PoolBatches(lambda: pools, 4, seed=0)
    one_process.set_epoch(3)
    for mine, whole in zip(steps, one_process):
        assert mine.tolist() == whole[:4][rank::2].tolist() + whole[4:][rank::2].tolist()
        assert all(i < 10 for i in whole[:4]) and all(i >= 10 for i in whole[4:])
    assert len({i for step in one_process for i in step[4:].tolist()}) == 28  # 7 x 4 of 30, no repeats
    sampler.set_epoch(3, start=5)  # mid-epoch resume: the same batches from step 5 on
    assert [b.tolist() for b in sampler] == [b.tolist() for b in steps[5:]]
    pools = [torch.arange(0), torch.arange(10)]  # an empty pool: the other's batches alone
    assert sampler.layout == [2, 2]  # this rank's share of each pool in every batch, in pool order
    sampler.set_epoch(4)
    assert [len(b) for b in sampler] == [2, 2] and sampler.layout == [0, 2]
    assert [len(b) for b in PoolBatches(lambda: None, 4, fallback=EpochBatches(12, 4))] == [4, 4, 4]


def test_balanced_quotas_share_equally_and_small_classes_give_all_they_have():
    assert balanced_quotas([100, 100, 100], 10).tolist() == [3, 3, 4]
    assert balanced_quotas([50, 30, 200, 5], 60).tolist() == [18, 18, 19, 5]
    assert balanced_quotas([4, 4], 8).tolist() == [4, 4]


def test_epoch_sample_is_class_balanced_fresh_each_epoch_and_a_function_of_seed_and_epoch():
    labels = np.repeat([0, 1, 2, 3], [50, 30, 200, 5])
    sample = EpochSample(labels, 60, seed=7)
    drawn = [sample(epoch) for epoch in range(3)]
    for idx in drawn:
        assert len(idx) == len(set(idx.tolist())) == 60 and idx.tolist() == sorted(idx.tolist())
        assert np.bincount(labels[idx.numpy()]).tolist() == [18, 18, 19, 5]  # the rare class: all of it
    assert len({tuple(idx.tolist()) for idx in drawn}) == 3  # fresh every epoch
    assert EpochSample(labels, 60, seed=7)(1).tolist() == drawn[1].tolist()  # a restarted run's
    assert EpochSample(labels, 60, seed=8)(1).tolist() != drawn[1].tolist()
    with pytest.raises(ConfigError, match=r"dataset.epoch_samples=300: more than the 285 training samples"):
        EpochSample(labels, 300, seed=0)


@pytest.mark.parametrize("rank", [0, 1])
def test_sample_batches_shard_each_epochs_sample_disjointly_over_the_ranks(rank):
    sample = EpochSample(np.arange(100) % 4, 48, seed=0)
    size = lambda epoch: 16 if epoch == 0 else 8  # noqa: E731  (a warm-up batch of its own)
    ranks = ((0, 1), (rank, 2), (1 - rank, 2))  # one process; this rank and the other of two
    whole, mine, other = (SampleBatches(sample, size, r, w, seed=3) for r, w in ranks)
    for epoch, steps in ((0, 3), (1, 6)):
        for sampler in (whole, mine, other):
            sampler.set_epoch(epoch)
        assert len(whole) == len(mine) == steps
        for batch, a, b in zip(whole, mine, other):
            assert not set(a.tolist()) & set(b.tolist())
            assert sorted(a.tolist() + b.tolist()) == sorted(batch.tolist())
        flat = torch.cat(list(whole)).tolist()
        assert len(flat) == len(set(flat)) == 48 and set(flat) == set(sample(epoch).tolist())
    mine.set_epoch(1, start=4)  # mid-epoch resume: the same batches from step 4 on
    whole.set_epoch(1)
    assert [b.tolist() for b in mine] == [b[rank::2].tolist() for b in list(whole)[4:]]


def test_warmup_batch_and_epoch_sample_in_the_hooks(tmp_path):
    """The warm-up epochs take batches of warmup_batch_size from the epoch's sample; the selection pass
    and the two pools cover that epoch's sample and nothing else; `ce` trains at train.batch_size after
    the warm-up epochs."""
    data = _toy(n=200)
    hooks, model, _ = _hooks("csot", data, tmp_path, batch_size=16, epoch_samples=96, warmup_batch_size=32)
    sampler = hooks.batch_sampler(EpochBatches(200, 16))
    sampler.set_epoch(0)
    warmup = list(sampler)
    assert [len(b) for b in warmup] == [32] * 3
    assert set(torch.cat(warmup).tolist()) == set(hooks.epoch_sample(0).tolist())
    hooks.on_epoch_start(1, model, data)
    sampler.set_epoch(1)
    clean, rest = hooks.pools()
    assert sorted(clean.tolist() + rest.tolist()) == hooks.epoch_sample(1).tolist()
    stats = hooks.last_stats
    assert stats["select/n_clean"] + stats["select/n_corrected"] + stats["select/n_unselected"] == 96
    assert set(torch.cat(list(sampler)).tolist()) <= set(hooks.epoch_sample(1).tolist())
    ce, _, _ = _hooks("ce", data, tmp_path / "ce", batch_size=16, warmup_batch_size=32)
    sampler = ce.batch_sampler(EpochBatches(200, 16))
    for epoch, size in ((0, 32), (1, 16), (2, 16)):
        sampler.set_epoch(epoch)
        assert {len(b) for b in sampler} == {size} and len(sampler) == 200 // size


def test_warmup_batch_is_weakly_augmented(tmp_path):
    data = _toy()
    hooks, model, _ = _hooks("csot", data, tmp_path)
    hooks.views.weak = lambda x: x + 100.0  # a marker: the network must see the weak view
    seen = []
    model.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    x, y = data.train.x[:8], data.train.y[:8]
    loss = hooks.loss(model, x, F.one_hot(y, 4).float(), torch.arange(8), 0)
    assert len(seen) == 1 and torch.equal(seen[0], x + 100.0)
    with torch.no_grad():
        assert loss.item() == pytest.approx(F.cross_entropy(model(x + 100.0), y).item(), rel=1e-6)


@pytest.mark.parametrize("warmup_penalty", [False, True])
def test_the_warmup_confidence_penalty_is_added_under_method_warmup_penalty(tmp_path, warmup_penalty):
    """DivideMix's Clothing1M warm-up: CE + mean sum_k p_k log p_k (the negative entropy), any noise."""
    data = _toy()
    hooks, model, _ = _hooks("csot", data, tmp_path, warmup_penalty=warmup_penalty)
    hooks.views.weak = lambda x: x  # the loss of the batch itself
    x, y = data.train.x[:8], data.train.y[:8]
    loss = hooks.loss(model, x, F.one_hot(y, 4).float(), torch.arange(8), 0)
    with torch.no_grad():
        logits = model(x)
        p = F.softmax(logits, dim=1)
        negative_entropy = (p * p.log()).sum(1).mean().item()
        expected = F.cross_entropy(logits, y).item() + (negative_entropy if warmup_penalty else 0.0)
    assert negative_entropy < -0.1 and loss.item() == pytest.approx(expected, rel=1e-6)
    from runner.compose import compose

    assert compose(["+experiment=csot_clothing1m"]).method.warmup_penalty


@pytest.mark.parametrize("loss", ["paper", "simple"])
def test_each_step_takes_a_clean_batch_and_an_unlabeled_batch(tmp_path, loss):
    data = _toy(n=120)
    hooks, model, ctx = _hooks("csot", data, tmp_path, batch_size=16, loss=loss)
    default = EpochBatches(120, 16)
    sampler = hooks.batch_sampler(default)
    sampler.set_epoch(0)
    assert len(sampler) == 120 // 16 and not hooks.selecting  # warm-up: fit's own batches
    hooks.on_epoch_start(1, model, data)
    sampler.set_epoch(1)
    clean = set(hooks.clean.nonzero()[:, 0].tolist())
    assert 0 < len(clean) < 120
    steps = max(len(clean) // 16, (120 - len(clean)) // 16)  # the longer loader, drop_last
    batches = list(sampler)
    assert len(sampler) == len(batches) == steps
    seen = {"labeled": [], "unlabeled": []}
    calls = []
    hooks._paper_loss = hooks._simple_loss = lambda net, lab, unl, *lam: calls.append((lab, unl)) or 0.0
    for idx in batches:  # what the loss makes of fit's batch: its first 16 labeled, the rest unlabeled
        calls.clear()
        hooks.loss(model, data.train.x[idx], None, idx, 1)
        ((labeled, unlabeled),) = calls
        for name, (x, part) in (("labeled", labeled), ("unlabeled", unlabeled)):
            torch.testing.assert_close(x, data.train.x[part])
            seen[name].append(part.tolist())
        assert idx[:16].tolist() == labeled[1].tolist() and idx[16:].tolist() == unlabeled[1].tolist()
    for name, members in (("labeled", clean), ("unlabeled", set(range(120)) - clean)):
        assert len(seen[name]) == steps and all(len(b) == 16 for b in seen[name])
        flat = [i for b in seen[name] for i in b]
        assert set(flat) <= members
        if len(members) <= len(flat):  # the shorter loader cycles: every member is seen
            assert set(flat) == members


def test_fit_epochs_run_for_the_longer_loader(tmp_path):
    """Counted in fit: the warm-up epoch is len(train) // batch, each later one max over the two pools."""
    data = _toy(n=120)
    hooks, model, ctx = _hooks("csot", data, tmp_path, batch_size=16, loss="simple")
    steps = []
    loss = hooks.loss
    hooks.loss = lambda net, x, y, idx, epoch, **drawn: steps.append((epoch, len(idx))) or loss(
        net, x, y, idx, epoch, **drawn)  # fmt: skip
    train = OmegaConf.structured(TrainConfig(epochs=3, batch_size=16, progress=False, checkpoint=False))
    fit(model, data, train, ctx, hooks)
    per_epoch = [sum(1 for e, _ in steps if e == epoch) for epoch in range(3)]
    n_clean = [stats["select/n_clean"] for _, stats in ctx.tracker.records if "select/n_clean" in stats]
    assert per_epoch == [120 // 16] + [max(c // 16, (120 - c) // 16) for c in n_clean]
    assert {n for e, n in steps if e > 0} == {32} and per_epoch[1] != 120 // 16


@pytest.mark.parametrize("epoch_samples, warmup_batch", [(0, 0), (96, 32)])
def test_stop_mid_epoch_then_resume_matches_the_uninterrupted_run(tmp_path, epoch_samples, warmup_batch):
    """A stop signal inside a selection epoch: fit checkpoints the step (the selection in the hooks'
    state, every RNG), and a restart ends with the weights of a run never stopped; with an epoch sample
    and a warm-up batch of its own too (the epochs after the resume draw their samples again)."""
    import os
    import signal

    data = _toy(n=120)
    train = OmegaConf.structured(TrainConfig(epochs=3, batch_size=16, progress=False, lr=0.05))

    def run(run_dir, stop_at=None):
        torch.manual_seed(0), np.random.seed(0)
        hooks, model, ctx = _hooks("csot", data, run_dir, 16, epoch_samples, warmup_batch_size=warmup_batch)
        calls = []
        loss = hooks.loss

        def counted(net, x, y, idx, epoch, **drawn):
            calls.append(epoch)
            if len(calls) == stop_at:
                os.kill(os.getpid(), signal.SIGUSR1)
            return loss(net, x, y, idx, epoch, **drawn)

        hooks.loss = counted
        fit(model, data, train, ctx, hooks)
        return torch.cat([p.detach().flatten() for p in model.parameters()]), calls

    straight, _ = run(tmp_path / "a")
    warmup_steps = (epoch_samples or 120) // (warmup_batch or 16)
    with pytest.raises(Interrupted):
        run(tmp_path / "b", stop_at=warmup_steps + 3)  # the 3rd step of epoch 1, the first selection epoch
    resumed, calls = run(tmp_path / "b")
    assert calls[0] == 1 and len(calls) < 3 * 120 // 16  # it went on inside epoch 1
    torch.testing.assert_close(resumed, straight, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["csot", "cot", "ot", "small_loss"])
def test_selection_hook_matches_the_solver(tmp_path, name):
    data = _toy()
    hooks, model, ctx = _hooks(name, data, tmp_path)
    hooks.on_epoch_start(0, model, data)  # warm-up: nothing selected
    assert not hooks.selecting and not hooks.epoch_metrics()
    hooks.on_epoch_start(1, model, data)
    stats = hooks.epoch_metrics()  # the selection's statistics, in the epoch's metrics row
    assert hooks.selecting and stats["select/n_clean"] + stats["select/n_corrected"] > 0
    n = len(data.train)
    clean, corrected = hooks.clean.numpy(), hooks.corrected.numpy()
    assert not np.any(clean & corrected)
    y = data.train.y.numpy()
    if name == "small_loss":
        assert not corrected.any() and stats["select/n_clean"] == clean.sum()
        return
    m = 1.0 if name == "ot" else 0.3 + 1 / 4  # the paper's ramp: t = 2, T_sup = 5: 0.3 + (2 - 1)/(5 - 1)
    assert stats["select/m"] == pytest.approx(m)
    # the hook's sets are the solver's: same inputs, same chunking seed
    probs, feats = probabilities_and_features(model, data.train, ctx)
    with torch.no_grad():
        expected = F.softmax(model(data.train.x).double(), dim=1).numpy()
    np.testing.assert_allclose(probs, expected, atol=1e-6)
    kappa = 0.0 if name in ("ot", "cot") else 1.0
    pseudo, _, selected = allocate(probs, feats, y, m, 50, seed=1, kappa_p=kappa, kappa_l=kappa)
    np.testing.assert_array_equal(clean, selected & (pseudo == y))
    np.testing.assert_array_equal(corrected, selected & (pseudo != y))
    assert (clean | corrected).sum() == sum(
        int(np.floor(m * len(c))) for c in np.array_split(np.arange(n), [50, 100])
    )


def test_selection_pass_is_fp32_under_bf16(tmp_path):
    """The probabilities and features of the selection come from an fp32 pass whatever the run's precision."""
    data = _toy()
    hooks, model, ctx = _hooks("csot", data, tmp_path)
    fp32 = probabilities_and_features(model, data.train, ctx)
    bf16 = probabilities_and_features(model, data.train, dataclasses.replace(ctx, precision="bf16"))
    for a, b in zip(fp32, bf16):
        np.testing.assert_array_equal(a, b)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert model.forward_features(data.train.x).dtype == torch.bfloat16  # what the pass would have been


@pytest.mark.parametrize("epoch_samples", [0, 120])
def test_hooks_on_an_accelerator_select_as_on_the_cpu_without_waiting_per_step(
    tmp_path, monkeypatch, epoch_samples
):
    """On the tracker's stand-in device (an accelerator to `RunContext.accelerator`) the selection runs on
    tensors (the batched solver) and picks the CPU run's sets, on the whole training set or the epoch's
    sample; the losses then split fit's batch by position and read nothing back from the device."""
    import runner.hardware

    with DeviceTracker() as tracker:  # data and model made under the tracker: on the host, as in a run
        data = _toy(n=200)
        cpu_hooks, model, _ = _hooks("csot", data, tmp_path / "cpu", 16, epoch_samples)
        cpu_hooks.on_epoch_start(1, model, data)
        monkeypatch.setattr(runner.hardware, "is_accelerator", lambda device: device == STAND_IN)
        ctx = RunContext(STAND_IN, tmp_path / "device", _Tracker())
        assert ctx.accelerator
        model.to(STAND_IN)
        cfg = METHODS["csot"](warmup=1, curriculum_end=5, solve_batch=50)
        hooks = NoisyLabelHooks(cfg, model, data, ctx, Views(data.input_shape), False, 0, 16, epoch_samples)
        with tracker.in_phase("epoch_start"):
            hooks.on_epoch_start(1, model, data)
        sampler = hooks.batch_sampler(EpochBatches(len(data.train), 16))
        sampler.set_epoch(1)
        batches = [idx.to(STAND_IN, non_blocking=True) for idx in sampler]
        x = data.train.x.to(STAND_IN, non_blocking=True)
        with tracker.in_phase("train"):
            for idx in batches[:3]:
                hooks.loss(model, x[idx], None, idx, 1).backward()
    counts = tracker.counts
    assert counts["epoch_start"].get("numpy", 0) == 0 and counts["epoch_start"].get("mix", 0) == 0
    assert counts["epoch_start"]["sync"] <= 100 and dict(counts["train"]) == {}, tracker.report()["sites"]
    for key in ("clean", "corrected", "pseudo"):
        np.testing.assert_array_equal(getattr(hooks, key).numpy(), getattr(cpu_hooks, key).numpy())
    np.testing.assert_allclose(hooks.weight.numpy(), cpu_hooks.weight.numpy(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("switch, expected", [("data", True), ("epoch", True), ("never", False)])
def test_stage_switch(tmp_path, switch, expected):
    data = _toy()
    hooks, model, _ = _hooks("csot", data, tmp_path, stage_switch=switch)
    hooks.on_epoch_start(4, model, data)  # t = 5 = T_sup
    assert bool(hooks.stage2) == expected


def _paper_hooks(tmp_path, **overrides):
    """Paper-loss hooks in stage 2 with identity views and no labeled samples: the loss is the stage-2
    term (plus SimSiam when on)."""
    data = _toy()
    hooks, model, _ = _hooks("csot", data, tmp_path, batch_size=16, pl_threshold=0.0, **overrides)
    hooks.on_epoch_start(1, model, data)
    hooks.views.weak = hooks.views.strong = lambda x: x
    hooks.clean[:] = False
    hooks.stage2 = True
    return hooks, model, data


def _fit_batch(hooks, data, y_soft=None):
    """The first (x, y_soft, idx) fit would hand the loss in epoch 1: the shards of both pools' batches
    (`y_soft` unused after the warm-up)."""
    sampler = hooks.batch_sampler(EpochBatches(len(data.train), hooks.batch_size))
    sampler.set_epoch(1)
    idx = next(iter(sampler))
    return data.train.x[idx], y_soft, idx


@pytest.mark.parametrize("correction", ["ot", "threshold"])
def test_stage2_correction_targets(tmp_path, correction):
    hooks, model, data = _paper_hooks(tmp_path, correction=correction, simsiam=False)
    x, _, idx = _fit_batch(hooks, data)
    assert not hooks.clean[idx].any()  # no clean pool: an unlabeled batch only
    loss = hooks.loss(model, x, None, idx, 1)
    with torch.no_grad():
        logits = model(x)
        if correction == "threshold":  # FixMatch: the model's own argmax, every sample (threshold 0)
            target, mask = logits.argmax(1), torch.ones(len(idx), dtype=torch.bool)
        else:  # the plan's pseudo-labels, corrected samples only
            target, mask = hooks.pseudo[idx], hooks.corrected[idx]
        expected = (F.cross_entropy(logits, target, reduction="none") * mask).mean()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)


@pytest.mark.parametrize("simsiam", [True, False])
def test_simsiam_switch(tmp_path, simsiam):
    hooks, model, data = _paper_hooks(tmp_path, simsiam=simsiam)
    hooks.stage2 = False
    hooks.loss(model, *_fit_batch(hooks, data), 1).backward()
    grad = model.predictor[0].weight.grad
    assert grad is not None  # in the graph either way (DDP)
    assert (grad.abs().sum() > 0) == simsiam


@pytest.mark.parametrize("loss", ["paper", "simple"])
def test_every_parameter_gets_a_gradient_every_step(tmp_path, loss):
    """DDP reduces every parameter's gradient each step: warm-up, stage 1, stage 2 and empty pools."""
    torch.manual_seed(0)
    data = _toy()
    hooks, model, _ = _hooks("csot", data, tmp_path, batch_size=32, loss=loss)
    x, y_soft = data.train.x[:32], F.one_hot(data.train.y[:32], 4).float()

    def check(value):
        assert torch.isfinite(value)
        model.zero_grad(set_to_none=True)
        value.backward()
        assert all(p.grad is not None for p in model.parameters())

    check(hooks.loss(model, x, y_soft, torch.arange(32), 0))  # warm-up
    hooks.on_epoch_start(1, model, data)
    check(hooks.loss(model, *_fit_batch(hooks, data, y_soft), 1))
    assert model.classifier.weight.grad.abs().sum() > 0
    hooks.stage2 = True
    check(hooks.loss(model, *_fit_batch(hooks, data, y_soft), 1))
    for everything_clean in (True, False):  # one pool empty
        hooks.clean[:] = everything_clean
        check(hooks.loss(model, *_fit_batch(hooks, data, y_soft), 1))


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


def test_paper_presets_compose():
    from runner.compose import compose, preflight

    for preset in ("csot_cifar10", "csot_cifar100", "csot_webvision"):
        preflight(["+method=csot", f"+experiment={preset}"])
    preflight(["+method=csot", "+experiment=csot_clothing1m", "model.pretrained=none"])
    preflight(["+method=ot,sot,cot,small_loss,ce", "+experiment=csot_cifar10", "method.simsiam=false"])
    for preset in ("csot_cifar10", "csot_cifar100"):  # Table 1 came from the authors' code: its ramp, batch
        method = compose([f"+experiment={preset}"]).method
        assert (method.budget, method.warmup_batch_size) == ("code", 256)
    clothing = compose(["+experiment=csot_clothing1m"])
    assert (clothing.dataset.epoch_samples, clothing.dataset.max_train) == (64_000, 0)
    with pytest.raises(ConfigError, match="dataset.epoch_samples=100: only the noisy_labels task"):
        preflight(["dataset=digits", "dataset.epoch_samples=100"])  # classify: no sample per epoch


def test_clothing1m_refuses_to_start_without_imagenet_weights(tmp_path):
    proc = run_cli_here(["+experiment=csot_clothing1m", f"hydra.run.dir={tmp_path}"], tmp_path, check=False)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "model.pretrained" in lines[0] and "model.pretrained=none" in lines[0], lines


@pytest.mark.slow
def test_cli_runs_and_logs_the_selection(cli, tmp_path):
    _cli_selection_runs(cli, tmp_path, ["ce", "csot"])


@pytest.mark.slow
def test_cli_runs_every_method(cli, tmp_path):
    _cli_selection_runs(cli, tmp_path, ["ce", "small_loss", "ot", "sot", "cot", "csot"])
