"""DB-OT tasks: the long-tail task's pieces, the clustering task, the `blobs` dataset, the CLI end to end."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import summaries
from omegaconf import OmegaConf

from runner.checks import ConfigError
from runner.compose import preflight
from runner.data import load_data, longtail_counts
from runner.data.blobs import BlobsConfig
from runner.hooks.dbot import (
    LossHook,
    evaluate_rules,
    group_accuracies,
    infer,
    longtail_loss,
    resampled_test_sets,
)
from runner.methods.dbot import (
    CosineClassifier,
    class_balanced_weights,
    dbot_loss,
    ldam_loss,
    ldam_margins,
    weighted_focal_loss,
)
from runner.tasks.clustering import BalancedClusterConfig, DBOTClusterConfig, cluster_scores
from runner.tasks.longtail import LongTailConfig


# ----------------------------------------------------------------------------------------------------
# Long-tail task
def test_resampled_test_sets_follow_their_profiles():
    rng = np.random.default_rng(0)
    y = np.repeat(np.arange(5), [30, 25, 40, 35, 28])
    sets = resampled_test_sets(y, 5, 10.0, ("lt", "uniform", "reversed"), rng)
    lt = np.maximum(longtail_counts(25, 5, 10.0), 1)
    np.testing.assert_array_equal(np.bincount(y[sets["lt"]], minlength=5), lt)
    np.testing.assert_array_equal(np.bincount(y[sets["reversed"]], minlength=5), lt[::-1])
    np.testing.assert_array_equal(np.bincount(y[sets["uniform"]], minlength=5), np.full(5, 25))
    for idx in sets.values():
        assert len(np.unique(idx)) == len(idx)  # no sample twice
        assert (np.diff(y[idx]) < 0).any()  # shuffled, not grouped by class (batched DB-OT needs that)


def test_group_accuracies_split_classes_by_training_count():
    m = LongTailConfig(many_min=40, few_max=9)
    train_counts = np.array([100, 40, 39, 10, 9, 2])  # many: 0, 1; medium: 2, 3; few: 4, 5
    y = np.arange(6).repeat(2)
    correct = np.array([1, 1, 1, 0, 0, 0, 1, 1, 0, 0, 1, 0], dtype=bool)
    accs = group_accuracies(correct, y, train_counts, m)
    assert accs == {"all": 0.5, "many": 0.75, "medium": 0.5, "few": 0.25}
    assert "medium" not in group_accuracies(correct, y, np.array([200, 150, 101, 9, 5, 2]), m)


def test_baseline_losses_reduce_to_each_other():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(12, 4, generator=gen, dtype=torch.float64)
    y = torch.nn.functional.one_hot(torch.randint(0, 4, (12,), generator=gen), 4).double()
    prior = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)

    def loss(name, **kw):
        return longtail_loss(logits, y, LongTailConfig(loss=name, **kw), prior).item()

    balanced = loss("balanced_softmax")
    assert balanced == pytest.approx(dbot_loss(logits, y, prior).item(), abs=1e-12)
    assert loss("logit_adjust", la_tau=1.0) == pytest.approx(loss("balanced_softmax"), abs=1e-12)
    assert loss("logit_adjust", la_tau=0.0) == pytest.approx(loss("ce"), abs=1e-12)
    assert loss("focal", focal_gamma=0.0) == pytest.approx(loss("ce"), abs=1e-12)
    assert loss("focal", focal_gamma=2.0) < loss("ce")
    assert loss("dbot", loss_mode="paper", train_delta=0.0) == pytest.approx(balanced, abs=1e-12)
    with pytest.raises(ConfigError, match="method.train_delta=0.3 has no effect"):  # paper, K=1: = BS
        loss("dbot", loss_mode="paper", train_delta=0.3)
    assert loss("dbot", loss_mode="paper", train_delta=0.3, k_train=2) != pytest.approx(balanced, abs=1e-6)
    for mode in ("paper", "official"):
        assert loss("dbot", loss_mode=mode, k_train=3) != pytest.approx(balanced, abs=1e-6)


# Two samples, two classes with 100 and 10 training images; logits z, labels y.
Z = torch.tensor([[2.0, 0.0], [0.5, 1.0]], dtype=torch.float64)
Y = torch.tensor([0, 1])
CE = (math.log(1 + math.exp(-2.0)), math.log(1 + math.exp(-0.5)))  # per-sample cross-entropy


def test_class_balanced_weights_hand_values():
    raw = [(1 - 0.9) / (1 - 0.9**100), (1 - 0.9) / (1 - 0.9**10)]  # (1 - beta) / (1 - beta^n)
    np.testing.assert_allclose(
        class_balanced_weights([100, 10], 0.9), [0.7888615425968192, 1.2111384574031807]
    )
    np.testing.assert_allclose(class_balanced_weights([100, 10], 0.9), np.array(raw) * 2 / sum(raw))
    np.testing.assert_allclose(class_balanced_weights([100, 10, 3], 0.0), [1, 1, 1])
    with pytest.raises(ValueError, match="beta"):
        class_balanced_weights([5, 2], 1.0)


def test_class_balanced_ce_and_focal_hand_values():
    w = (0.7888615425968192, 1.2111384574031807)
    cb_ce = (w[0] * CE[0] + w[1] * CE[1]) / (w[0] + w[1])  # PyTorch's weighted mean
    assert weighted_focal_loss(Z, Y, 0.0, w).item() == pytest.approx(cb_ce, rel=1e-12)
    assert weighted_focal_loss(Z, Y).item() == pytest.approx((CE[0] + CE[1]) / 2, rel=1e-12)
    p = (1 / (1 + math.exp(-2.0)), 1 / (1 + math.exp(-0.5)))  # p of the true class
    focal = [(1 - p[i]) ** 2 * CE[i] for i in (0, 1)]
    cb_focal = (w[0] * focal[0] + w[1] * focal[1]) / (w[0] + w[1])
    assert weighted_focal_loss(Z, Y, 2.0, w).item() == pytest.approx(cb_focal, rel=1e-12)
    m = LongTailConfig(loss="cb_focal", cb_beta=0.9, focal_gamma=2.0)
    hook = LossHook(m, np.array([100.0, 10.0]), torch.device("cpu"), epochs=10)
    assert hook.loss(lambda x: x, Z, F.one_hot(Y, 2).double(), None, 0).item() == pytest.approx(
        cb_focal, rel=1e-6
    )


def test_ldam_hand_values_and_drw():
    margins = ldam_margins([100, 10], max_margin=0.5)  # 0.5 * (n_j / n_min)^(-1/4)
    np.testing.assert_allclose(margins, [0.5 * 10**-0.25, 0.5])
    # sample 0: z_0 - 0.5 * 10^(-1/4) against 0; sample 1: 0.5 against 1 - 0.5 (a tie: log 2)
    expected = (math.log(1 + math.exp(-(2.0 - 0.5 * 10**-0.25))) + math.log(2.0)) / 2
    assert ldam_loss(Z, Y, margins).item() == pytest.approx(expected, rel=1e-12)
    assert ldam_loss(Z, Y, [0.0, 0.0]).item() == pytest.approx((CE[0] + CE[1]) / 2, rel=1e-12)
    # the task: margins in logit units (scale s), class-balanced weights from drw_start * epochs on
    m = LongTailConfig(loss="ldam", cb_beta=0.9, ldam_scale=2.0, drw_start=0.5)
    hook = LossHook(m, np.array([100.0, 10.0]), torch.device("cpu"), epochs=10)
    y_soft = F.one_hot(Y, 2).double()
    plain = ldam_loss(Z, Y, 2.0 * margins).item()
    weighted = ldam_loss(Z, Y, 2.0 * margins, [0.7888615425968192, 1.2111384574031807]).item()
    assert hook.loss(lambda x: x, Z, y_soft, None, 4).item() == pytest.approx(plain, rel=1e-6)
    assert hook.loss(lambda x: x, Z, y_soft, None, 5).item() == pytest.approx(weighted, rel=1e-6)
    assert plain != pytest.approx(weighted, rel=1e-3)


def test_cosine_classifier():
    torch.manual_seed(0)
    head = CosineClassifier(3, 4, scale=30.0)
    x = torch.randn(5, 3)
    w = head.weight.detach()
    cos = (x @ w.T) / x.norm(dim=1, keepdim=True) / w.norm(dim=1)[None, :]
    torch.testing.assert_close(head(x), 30.0 * cos)
    torch.testing.assert_close(head(7.0 * x), head(x))  # scale-free in the features


def test_test_acc_is_argmax_on_the_uniform_set():
    """A model that calls everything class 0: argmax is right on half of a balanced test set; DB-OT with
    the oracle prior re-balances the predictions and gets all of them (reported as test/acc_dbot)."""
    y_test = np.array([0, 0, 0, 1, 1, 1, 1])  # the uniform set keeps 3 of each
    logits = np.array([[2.0, 0.0], [2.0, 0.5], [2.0, 0.2], [2.0, 1.9], [2.0, 1.8], [2.0, 1.7], [2.0, 1.6]])
    m = LongTailConfig(delta=0.0, eps=0.01, test_sets=["uniform"], inference=["argmax", "dbot"])
    test_sets = {"uniform": np.array([0, 1, 2, 3, 4, 5])}
    feats = np.zeros((7, 1))
    out = evaluate_rules(m, logits, feats, None, y_test, np.array([50.0, 5.0]), test_sets)
    assert out["test/acc"] == 0.5 and out["uniform/argmax/all"] == 0.5
    assert out["test/acc_dbot"] == 1.0 and out["uniform/dbot/all"] == 1.0


def test_inference_rules_reduce_to_argmax_where_they_should():
    rng = np.random.default_rng(1)
    logits, feats = rng.normal(size=(200, 5)), rng.normal(size=(200, 3))
    weight = rng.normal(size=(5, 3))
    m = LongTailConfig(cls_norm_tau=0.0)
    train = np.array([0.4, 0.3, 0.15, 0.1, 0.05])
    uniform = np.full(5, 0.2)
    argmax = logits.argmax(1)
    np.testing.assert_array_equal(infer("class_bias", m, logits, feats, weight, train, uniform), argmax)
    np.testing.assert_array_equal(infer("posthoc_la", m, logits, feats, weight, train, train), argmax)
    np.testing.assert_array_equal(
        infer("cls_norm", m, logits, feats, weight, train, uniform), (feats @ weight.T).argmax(1)
    )
    shifted = infer("posthoc_la", m, logits, feats, weight, train, uniform)
    np.testing.assert_array_equal(shifted, (logits - np.log(train)).argmax(1))
    m_big = LongTailConfig()
    m_big.delta = 1e3  # beyond the config's range: both bounds inactive (dbot_predict allows it)
    np.testing.assert_array_equal(infer("dbot", m_big, logits, feats, weight, train, uniform), argmax)
    assert not np.array_equal(infer("sinkhorn", m, 3 * logits, feats, weight, train, train), argmax)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(loss="hinge"), "method.loss"),
        (dict(train_delta=1.0), "method.train_delta"),
        (dict(inference=["argmax", "oracle"]), "method.inference"),
        (dict(inference=["argmax"], predict="dbot"), "method.predict"),
        (dict(scope="epoch"), "method.scope"),
        (dict(prior="file"), "method.prior"),
        (dict(few_max=50, many_min=40), "method.few_max"),
        (dict(test_imbalance=0.5), "method.test_imbalance"),
        (dict(cb_beta=1.0), "method.cb_beta"),
        (dict(drw_start=1.5), "method.drw_start"),
        (dict(augment="mixup"), "method.augment"),
    ],
)
def test_longtail_config_errors_name_the_key(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        LongTailConfig(**kwargs)


# ----------------------------------------------------------------------------------------------------
# Clustering task and the blobs dataset
def test_cluster_scores():
    y = np.array([0, 0, 0, 1, 1, 2, 2, 2])
    perfect = cluster_scores(y, (y + 1) % 3, 3)
    assert perfect["cluster/purity"] == perfect["cluster/nmi"] == perfect["cluster/ari"] == pytest.approx(1.0)
    merged = cluster_scores(y, np.array([0, 0, 0, 0, 0, 1, 1, 1]), 2, outlier_label=2)
    assert merged["cluster/purity"] == pytest.approx(6 / 8)
    assert merged["cluster/sizes"] == [3, 5] and merged["cluster/min_size"] == 3
    assert merged["cluster/ari_inliers"] == pytest.approx(0.0)


def test_cluster_configs_check_ranges():
    with pytest.raises(ConfigError, match="method.tau"):
        BalancedClusterConfig(tau=0.2)
    with pytest.raises(ConfigError, match="method.eps"):
        DBOTClusterConfig(eps=0.0)
    with pytest.raises(ConfigError, match="method.assign"):
        DBOTClusterConfig(assign="greedy")


def test_blobs_dataset():
    cfg = OmegaConf.structured(BlobsConfig(name="blobs", val_fraction=0.0, test_fraction=0.0))
    data = load_data(cfg, seed=3)
    assert data.meta["n_clusters"] == 5 and data.meta["outlier_label"] == 5 and data.num_classes == 6
    np.testing.assert_array_equal(data.train.y.bincount(), [40, 50, 60, 70, 80, 6])
    outliers = data.train.x[data.train.y == 5]
    assert (outliers - 25).abs().max() < 3 and data.train.x[data.train.y < 5].abs().max() < 12
    assert torch.equal(load_data(cfg, seed=3).train.x, data.train.x)
    split = load_data(OmegaConf.structured(BlobsConfig(name="blobs", test_fraction=0.2)), seed=0)
    assert len(split.test) > 0 and len(split.val) > 0
    with pytest.raises(ConfigError, match="val_fraction"):
        BlobsConfig(val_fraction=0.1, test_fraction=0.0)
    with pytest.raises(ConfigError, match="sizes"):
        BlobsConfig(sizes=[10])


# ----------------------------------------------------------------------------------------------------
# End to end
@pytest.mark.slow
def test_longtail_cli_reports_every_rule_on_every_test_set(cli, tmp_path):
    cli("+method=dbot", "dataset.imbalance=10", "train.epochs=3", "logger=none", "train.progress=false",
        "method.many_min=60", "method.few_max=20")  # fmt: skip
    ((run_dir, s),) = summaries(tmp_path / "outputs").items()
    for test_set in ("lt", "uniform", "reversed"):
        for rule in ("argmax", "cls_norm", "class_bias", "posthoc_la", "sinkhorn", "dbot"):
            for group in ("all", "many", "medium", "few"):
                assert 0.0 <= s[f"{test_set}/{rule}/{group}"] <= 1.0
    assert s["test/acc"] == s["uniform/argmax/all"] and s["test/acc_dbot"] == s["uniform/dbot/all"]
    assert s["lt/n"] < s["uniform/n"] and s["lt/n"] == s["reversed/n"]
    counts = s["train/counts"]
    assert counts == sorted(counts, reverse=True) and counts[-1] == int(counts[0] / 10)


@pytest.mark.slow
def test_longtail_reports_the_last_epochs_rules_beside_the_selected_models(cli_here, tmp_path):
    """With `train.select` testing another epoch (test/ece's best: the untrained net, epoch 0), every rule
    metric of the last epoch's weights is reported as `<key>_last`: equal to the same run tested at its last
    epoch (`train.select=last`; the CPU run is deterministic, so to the last bit)."""
    common = ("+method=dbot", "dataset.imbalance=10", "train.epochs=3", "logger=none", "train.progress=false",
              "method.many_min=60", "method.few_max=20", "method.predict=sinkhorn")  # fmt: skip
    cli_here(*common, "train.select=best:test/ece", f"hydra.run.dir={tmp_path}/best")
    cli_here(*common, "train.select=last", f"hydra.run.dir={tmp_path}/last")
    best, last = (summaries(tmp_path / name)[tmp_path / name] for name in ("best", "last"))
    assert best["tested_model"] == "best:test/ece" and best["tested_epoch"] != 3  # not the last epoch
    rules = [key for key in last if key.split("/")[0] in ("test", "lt", "uniform", "reversed")]
    assert {"uniform/argmax/few", "uniform/argmax/many", "test/acc_sinkhorn"} <= set(rules)
    assert {key: best[key + "_last"] for key in rules} == {key: last[key] for key in rules}
    assert best["test/acc"] != best["test/acc_last"]  # the two models differ: the check can fail
    assert not any(key.endswith("_last") for key in rules)  # no last-epoch copies where the last is tested


def test_cli_preflight_rejects_bad_method_keys():
    with pytest.raises(ConfigError, match="method.loss=.*balanced_softmax"):
        preflight(["+method=dbot", "method.loss=hinge"])
    with pytest.raises(ConfigError, match="method.tau"):
        preflight(["+method=balanced_cluster", "method.tau=0.3"])
    preflight(["+experiment=dbot_cifar100_lt"])  # the GPU presets compose and validate
    preflight(["+experiment=dbot_cifar10_lt", "method.loss=ce,focal,ldam,cb_ce,cb_focal"])
    preflight(["+experiment=dbot_imagenet_lt"])
    with pytest.raises(ConfigError, match="train_delta=0.1 has no effect"):
        preflight(["+method=dbot", "method.loss_mode=paper", "method.k_train=1", "method.train_delta=0.1"])


@pytest.mark.slow
def test_clustering_cli_writes_scores_and_plot(cli, tmp_path):
    cli("-m", "+method=dbot_cluster,kmeans", "dataset=blobs", "logger=none")
    found = summaries(tmp_path / "outputs" / "multirun")
    assert len(found) == 2
    for run_dir, s in found.items():
        assert (run_dir / "clusters.png").stat().st_size > 1000
        assert s["cluster/k"] == 5 and s["cluster/n"] == 306 and sum(s["cluster/sizes"]) == 306
        assert 0 < s["cluster/nmi"] <= 1
    dbot_run = next(s for s in found.values() if "cluster/mass_min" in s)
    assert dbot_run["cluster/mass_min"] >= dbot_run["cluster/bound_low"] - 1e-6


@pytest.mark.slow
def test_clustering_raw_features_of_a_file_backed_dataset_ask_for_network_features(cli, tmp_path):
    from fixtures_data import write_imagefolder

    write_imagefolder(tmp_path / "data")
    proc = cli("+method=kmeans", "dataset=imagefolder", f"dataset.root={tmp_path / 'data'}", "logger=none",
               check=False)  # fmt: skip
    assert (
        proc.returncode == 2 and "method.features=raw: dataset=imagefolder is read from files" in proc.stderr
    )


def test_clustering_cli_more_clusters_than_samples_is_one_line(cli_here):
    proc = cli_here("+method=dbot_cluster", "dataset=blobs", "method.per_class=2", "method.k=20",
                    "logger=none", check=False)  # fmt: skip
    assert proc.returncode == 2 and "method.k=20" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_issue_claims_on_cpu(cli, tmp_path):
    """DB-OT inference lifts the CE model's few-shot accuracy >= 20 points over argmax on long-tailed
    digits; on blobs with outliers rounded DB-OT clustering keeps every cluster above its lower bound,
    k-means does not."""
    cli("+experiment=dbot_digits_lt", "method.loss=ce", "logger=none", f"hydra.run.dir={tmp_path}/lt")
    ((_, s),) = summaries(tmp_path / "lt").items()
    assert s["uniform/dbot/few"] - s["uniform/argmax/few"] >= 0.2
    cli("+experiment=dbot_cluster_blobs", "logger=none", f"hydra.run.dir={tmp_path}/dbot")
    cli("+method=kmeans", "dataset=blobs", "logger=none", f"hydra.run.dir={tmp_path}/kmeans")
    ((_, dbot),) = summaries(tmp_path / "dbot").items()
    ((_, kmeans),) = summaries(tmp_path / "kmeans").items()
    assert dbot["cluster/min_size"] >= dbot["cluster/bound_low"] > kmeans["cluster/min_size"]
