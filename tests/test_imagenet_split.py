"""ImageNetSplit (the hash paper's Table 4): the class split from the paper's names, the `imagenetsplit`
dataset on a fixture in the imagenet32 layout, the VQ-train / VQ-test rows and the preset."""

import pickle
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import summaries
from omegaconf import OmegaConf

from runner.checks import ConfigError
from runner.compose import compose
from runner.data import load_data
from runner.data.imagenet_split import TABLE5, imagenet_wnids, imagenetsplit_classes, wnid_of_name
from runner.hardware import RunContext
from runner.hooks.hier_hash import baseline_codes
from runner.models import build_model
from runner.validate import validate


def test_the_paper_names_give_119_disjoint_pairs_of_imagenet_classes():
    c_train, c_test = imagenetsplit_classes()
    in_1k = set(imagenet_wnids())
    assert len(in_1k) == 1000
    assert len(c_train) == len(c_test) == 119
    assert len(set(c_train)) == len(set(c_test)) == 119 and not set(c_train) & set(c_test)
    assert set(c_train) | set(c_test) <= in_1k
    # spot checks against the ILSVRC ids: tench / goldfish, cock / hen, Cardigan / Pembroke corgis
    pairs = dict(zip(c_train, c_test))
    assert pairs["n01440764"] == "n01443537" and pairs["n01514668"] == "n01514859"
    assert pairs["n02113186"] == "n02113023"
    # every name is read, none twice; ambiguous first lemmas (crane: bird and machine) are refused
    names = [name for row in TABLE5 for side in row for name in side.split(",")]
    assert len(names) == len(set(names)) == 238
    assert "crane" not in wnid_of_name() and wnid_of_name()["Cardigan"] != wnid_of_name()["cardigan"]


def write_fixture(root, order):
    """imagenet32 pickles whose labels (1-based, in `order`: the label -> wnid list of map_clsloc.txt)
    cover two C_train classes, two C_test classes and one class of neither; the first two pixels of a row
    hold its label (high and low byte)."""
    c_train, c_test = imagenetsplit_classes()
    label = {w: i + 1 for i, w in enumerate(order)}
    other = next(w for w in order if w not in set(c_train) | set(c_test))
    wnids = [c_train[0], c_train[5], c_test[0], c_test[5], other]
    rows = {"train": [], "val": []}
    for part, per_class in (("train", 3), ("val", 2)):
        rows[part] = [label[w] for w in wnids for _ in range(per_class)]
    files = {f"Imagenet32_train/train_data_batch_{i}": rows["train"][i - 1 :: 10] for i in range(1, 11)}
    files["Imagenet32_val/val_data"] = rows["val"]
    for f, labels in files.items():
        data = np.zeros((len(labels), 3072), np.uint8)
        data[:, 0], data[:, 1] = np.divmod(labels, 256)
        (root / f).parent.mkdir(parents=True, exist_ok=True)
        with open(root / f, "wb") as fh:
            pickle.dump({"data": data, "labels": labels}, fh)
    (root / "map_clsloc.txt").write_text("".join(f"{w} {i + 1} name_{i}\n" for i, w in enumerate(order)))
    return label


def load(root, *overrides):
    cfg = validate(compose(["dataset=imagenetsplit", f"dataset.root={root}", *overrides]))
    return load_data(OmegaConf.structured(cfg["dataset"]), seed=0)


def test_imagenetsplit_trains_on_c_train_and_tests_on_the_c_test_val_images(tmp_path):
    order = list(np.random.default_rng(0).permutation(imagenet_wnids()))  # not the sorted order
    label = write_fixture(tmp_path, order)
    c_train, c_test = imagenetsplit_classes()
    data = load(tmp_path)
    assert data.num_classes == 119 and data.input_shape == (3, 32, 32) and len(data.val) == 0
    for split, classes, per_class in ((data.train, c_train, 3), (data.test, c_test, 2)):
        assert split.x.dtype == torch.uint8
        y = split.y.numpy()
        assert sorted(y.tolist()) == [0] * per_class + [5] * per_class  # super-class i, own classes only
        # each image is a row of its class (its first two pixels hold its 1-based label)
        pixels = split.x[:, 0, 0, :2].numpy().astype(int)
        np.testing.assert_array_equal(pixels @ [256, 1], [label[classes[c]] for c in y])
    assert data.meta["classes"]["test"] == list(c_test)
    held = load(tmp_path, "dataset.val_fraction=0.5")
    assert len(held.train) + len(held.val) == 6 and len(held.val) == 3


def test_the_label_order_must_be_known(tmp_path):
    order = sorted(imagenet_wnids())
    write_fixture(tmp_path, order)
    (tmp_path / "map_clsloc.txt").unlink()
    with pytest.raises(
        ConfigError, match=r"dataset.class_map=map_clsloc.txt: .* not found.*class_map=sorted"
    ):
        load(tmp_path)
    data = load(tmp_path, "dataset.class_map=sorted")  # pickles labelled in sorted-wnid order
    assert len(data.train) == 6 and len(data.test) == 4
    (tmp_path / "map_clsloc.txt").write_text("n01440764 1 tench\n")
    with pytest.raises(ConfigError, match="expected lines '<wnid> <label 1..1000> <name>'"):
        load(tmp_path)


def test_vq_test_centroids_come_from_the_test_embedding():
    from sklearn.cluster import KMeans

    rng = np.random.default_rng(0)
    emb = {"test": rng.normal(5, 1, (40, 4))}
    train = rng.normal(-5, 1, (60, 4))
    method = OmegaConf.create(
        dict(baselines=["vq"], vq_fit=["train", "test"], vq_centroids=[3], ks=[1, 2], d=3, k=2)
    )
    codes = baseline_codes(method, 0, emb, lambda: train)
    assert set(codes) == {(row, ks) for row in ("VQ-3", "VQ-test-3") for ks in (1, 2)}
    for row, fit_on in (("VQ-3", train), ("VQ-test-3", emb["test"])):
        expected = -(KMeans(3, n_init=1, random_state=0).fit(fit_on).transform(emb["test"]) ** 2)
        np.testing.assert_allclose(codes[(row, 1)][2]["test"], expected)
    with pytest.raises(ConfigError, match=r"method.vq_fit=\[\]"):
        validate(compose(["+method=hier_hash", "method.vq_fit=[]"]))


def test_preset_is_the_paper_protocol():
    cfg = validate(compose(["+experiment=hier_hash_imagenetsplit"]))
    method = cfg["method"]
    assert cfg["dataset"].name == "imagenetsplit" and cfg["model"].name == "nin"
    assert (method.loss, method.d, method.k) == ("triplet", 64, 2)
    assert method.classes_per_batch * method.per_class == 200
    assert (method.iters, method.decay_at, method.decay, method.tables) == (50000, [40000], 0.3, ["test"])
    assert method.vq_fit == ["train", "test"]
    paper = OmegaConf.load("conf/experiment/hier_hash_imagenetsplit.yaml")["paper"]
    assert paper["test/p@1"]["value"] == 0.2146 and paper["hash/test/VQ-test-64/ks1/suf@1"]["value"] == 57.44


@pytest.mark.parametrize("lr_backbone", [None, 0.0])
def test_the_preset_fine_tunes_the_backbone_and_the_fc_only_ablation_freezes_it(monkeypatch, lr_backbone):
    """The paper fine-tunes the base model (backbone included) on ImageNetSplit; `method.lr_backbone=0`
    trains the new FC layer alone. One hash step's gradients and the optimizer groups show which."""
    from runner.tasks import hashing

    overrides = ["+experiment=hier_hash_imagenetsplit", "method.classes_per_batch=4", "method.ks=[1]",
                 "method.margin=[0.5]", "method.baselines=[]"]  # fmt: skip
    overrides += [] if lr_backbone is None else [f"method.lr_backbone={lr_backbone}"]
    cfg = compose(overrides)
    seen = {}

    def one_step(cfg, ctx, data, tag, net, groups, loss, iters, val_score=None):
        torch.manual_seed(0)
        loss(net, torch.randn(cfg.method.classes_per_batch * cfg.method.per_class, 3, 32, 32))[0].backward()
        seen[tag] = net, groups

    monkeypatch.setattr(hashing, "train_net", one_step)
    backbone = build_model(cfg.model, (3, 32, 32), 119)
    ctx = RunContext(torch.device("cpu"), Path("."), None)
    hashing.train_hash_nets(cfg, ctx, SimpleNamespace(val=[]), None, backbone, None, {})
    net, groups = seen["ours_ks1"]
    grads = [p.grad for p in net.backbone.parameters()]
    if lr_backbone is None:  # the preset: every backbone parameter in the optimizer at 1e-4, with a gradient
        assert cfg.method.lr_backbone == 1e-4 and [g["lr"] for g in groups] == [cfg.method.lr_head, 1e-4]
        assert all(g is not None for g in grads) and sum(g.abs().sum() for g in grads) > 0
    else:
        assert len(groups) == 1 and all(g is None for g in grads)
    assert all(p.grad is not None for p in net.head.parameters())


@pytest.mark.slow  # a subprocess importing torch and Hydra, then training NIN nets: 20 s
def test_preset_smoke_run_reports_every_row(tmp_path, cli):
    write_fixture(tmp_path, sorted(imagenet_wnids()))
    cli("+experiment=hier_hash_imagenetsplit", "+debug=smoke", "hardware=cpu", "logger=none",
        f"dataset.root={tmp_path}", "dataset.class_map=sorted", "dataset.val_fraction=0",
        "method.eval_every=0", "method.classes_per_batch=2", "method.ks=[1]", "method.margin=[0.5]",
        "method.vq_centroids=[4]")  # fmt: skip
    (summary,) = summaries(tmp_path).values()
    for row in ("ours", "Th", "VQ-4", "VQ-test-4", "k1-d128", "LSH-7"):
        assert 0 <= summary[f"hash/test/{row}/ks1/p@1"] <= 1, row
