"""The file-backed dataset layouts, ImageNet32, CIFAR-N human labels and the CIFAR-100 asymmetric map:
tiny fixtures in each real on-disk layout (tests/fixtures_data.py), loaded through `load_data`."""

from pathlib import Path

import numpy as np
import pytest
import torch
from fixtures_data import (
    CLASSES,
    WNIDS,
    write_cifar,
    write_clothing1m,
    write_human_labels,
    write_imagefolder,
    write_imagenet,
    write_imagenet32,
    write_imagenet_lt,
    write_tiny_imagenet,
    write_webvision,
)
from omegaconf import OmegaConf

from runner.checks import ConfigError
from runner.compose import compose
from runner.data import load_data
from runner.data.builtin import CIFAR100_ASYM, CIFAR100_CLASSES
from runner.data.files import IMAGENET_STATS
from runner.validate import validate

WRITERS = {
    "imagefolder": write_imagefolder,
    "tiny_imagenet": write_tiny_imagenet,
    "imagenet": write_imagenet,
    "imagenet_lt": write_imagenet_lt,
    "webvision": write_webvision,
    "clothing1m": write_clothing1m,
    "imagenet32": write_imagenet32,
}


def dataset_cfg(*overrides):
    return OmegaConf.structured(validate(compose(list(overrides)))["dataset"])


def load(name, root, *overrides, seed=0):
    return load_data(dataset_cfg(f"dataset={name}", f"dataset.root={root}", *overrides), seed=seed)


def pairs(split):
    return sorted(zip(split.paths, split.y.tolist()))


def test_imagefolder_labels_sorted_class_folders_and_test_falls_back_to_val(tmp_path):
    written = write_imagefolder(tmp_path)
    data = load("imagefolder", tmp_path, "dataset.image_size=16")
    assert data.num_classes == 3 and data.meta["classes"] == CLASSES and data.input_shape == (3, 16, 16)
    assert pairs(data.train) == sorted(written["train"])  # notes.txt is not an image
    assert pairs(data.val) == sorted(written["val"]) and data.test is data.val
    assert (data.train.y == data.train.y_clean).all()
    assert data.train.root == tmp_path.resolve()
    # Decoding goes through the ImageNet normalisation at the configured side (the images are 12-16 px).
    image, index = data.test.dataset(train=False)[1]  # workers send uint8; decode normalises (on the device)
    assert image.shape == (3, 16, 16) and index == 1 and image.dtype == torch.uint8
    image = data.test.decode(image[None])[0]
    assert float(image.min()) < -1.5 and float(image.max()) > 1.5  # (x - 0.485) / 0.229 spans [-2.1, 2.2]

    written = write_imagefolder(tmp_path / "with_test", test=True)
    data = load("imagefolder", tmp_path / "with_test")
    assert pairs(data.test) == sorted(written["test"]) and data.input_shape == (3, 224, 224)


def test_imagefolder_val_class_unknown_to_train_is_one_line(tmp_path):
    write_imagefolder(tmp_path)
    (tmp_path / "val" / "wolf").mkdir()
    with pytest.raises(ConfigError, match=r"val has class folders not in train: \['wolf'\]"):
        load("imagefolder", tmp_path)


def test_tiny_imagenet_val_annotations_label_the_test_split(tmp_path):
    written = write_tiny_imagenet(tmp_path)
    data = load("tiny_imagenet", tmp_path)
    wnids = sorted(WNIDS)
    assert data.num_classes == 3 and data.meta["classes"] == wnids and data.input_shape == (3, 64, 64)
    assert pairs(data.test) == sorted((f"val/images/{f}", wnids.index(w)) for f, w in written["val"])
    expected = sorted((f"train/{w}/images/{w}_{i}.JPEG", wnids.index(w)) for w in WNIDS for i in range(3))
    assert pairs(data.train) == expected and len(data.val) == 0  # the boxes files are not images
    # dataset.val_fraction holds out a random share of train as the runner's val split.
    data = load("tiny_imagenet", tmp_path, "dataset.val_fraction=0.34")
    assert len(data.val) == 3 and sorted(pairs(data.train) + pairs(data.val)) == expected


def test_imagenet_wnid_folders_and_val_as_test(tmp_path):
    written = write_imagenet(tmp_path)
    data = load("imagenet", tmp_path)
    wnids = sorted(WNIDS)
    relabel = {WNIDS.index(w): wnids.index(w) for w in WNIDS}  # labels are sorted-wnid indices
    assert pairs(data.train) == sorted((p, relabel[y]) for p, y in written["train"])
    assert pairs(data.test) == sorted((p, relabel[y]) for p, y in written["val"])
    assert data.meta["top5"] and len(data.val) == 0 and data.input_shape == (3, 224, 224)


def test_imagenet_lt_reads_its_list_files(tmp_path):
    lists = write_imagenet_lt(tmp_path)
    data = load("imagenet_lt", tmp_path)
    for part in ("train", "val", "test"):
        split = getattr(data, part)
        assert list(zip(split.paths, split.y.tolist())) == lists[part]  # file order kept
    assert np.bincount(data.train.y.numpy()).tolist() == [5, 2, 1] and data.meta["imbalance"] == 5.0
    assert data.num_classes == 3
    # The lists live elsewhere when dataset.lists names their folder.
    (tmp_path / "lists").mkdir()
    for part in ("train", "val", "test"):
        (tmp_path / f"ImageNet_LT_{part}.txt").rename(tmp_path / "lists" / f"ImageNet_LT_{part}.txt")
    assert len(load("imagenet_lt", tmp_path, "dataset.lists=lists").train) == 8


def test_imagenet_lt_is_not_made_long_tailed_twice(tmp_path):
    with pytest.raises(ConfigError, match="dataset.imbalance=10.0: imagenet_lt is already long-tailed"):
        load("imagenet_lt", tmp_path, "dataset.imbalance=10")


def test_webvision_keeps_the_first_50_classes_and_maps_imagenet_val_through_synsets(tmp_path):
    written = write_webvision(tmp_path)
    data = load("webvision", tmp_path, "dataset.imagenet_val=imagenet_val")
    assert data.num_classes == 50 and data.meta["top5"] and data.input_shape == (3, 299, 299)
    assert data.meta["clean_train_labels"] is False  # web labels: no truth to score selections against
    assert pairs(data.train) == sorted((p, y) for p, y in written["train"] if y < 50)
    assert pairs(data.test) == sorted((f"val_images_256/{p}", y) for p, y in written["val"] if y < 50)
    extra = data.extra["imagenet_val"]
    assert extra.root == (tmp_path / "imagenet_val").resolve() and pairs(extra) == sorted(
        written["imagenet_val"]
    )
    assert load("webvision", tmp_path).extra == {}  # no folder named: no extra split
    data = load("webvision", tmp_path, "dataset.num_classes=2")
    assert data.train.y.tolist() == [0, 0, 1] and data.test.y.tolist() == [0, 1]


def test_clothing1m_trains_on_noisy_keys_and_tests_on_clean_keys(tmp_path):
    w = write_clothing1m(tmp_path)
    data = load("clothing1m", tmp_path)
    assert data.num_classes == 14 and data.meta["clean_train_labels"] is False
    assert data.train.paths == w["train"] and data.train.y.tolist() == [w["noisy"][k] for k in w["train"]]
    assert data.train.y.tolist()[4:] != [w["clean"][k] for k in w["train"][4:]]  # the noisy label wins
    for part in ("val", "test"):
        split = getattr(data, part)
        assert split.paths == w[part] and split.y.tolist() == [w["clean"][k] for k in w[part]]
    (tmp_path / "annotations" / "clean_label_kv.txt").write_text(f"{w['val'][0]} 3\n")
    with pytest.raises(ConfigError, match=f"key {w['val'][1]} has no label in .*clean_label_kv.txt"):
        load("clothing1m", tmp_path)


def test_imagenet32_rows_become_chw_uint8_images_with_0_based_labels(tmp_path):
    files = write_imagenet32(tmp_path)
    data = load("imagenet32", tmp_path)
    train_files = [files[f"Imagenet32_train/train_data_batch_{i}"] for i in range(1, 11)]
    rows = np.concatenate([b["data"] for b in train_files])
    assert data.train.x.dtype == torch.uint8 and data.train.x.shape == (30, 3, 32, 32)
    assert data.train.y.tolist() == [y - 1 for b in train_files for y in b["labels"]]
    # Pixel (c, h, w) of image i is byte c * 1024 + h * 32 + w of row i (channel-major rows).
    i, c, h, w = 17, 2, 5, 30
    assert int(data.train.x[i, c, h, w]) == int(rows[i, c * 1024 + h * 32 + w])
    assert torch.equal(data.train.x.reshape(30, -1), torch.from_numpy(rows))
    val = files["Imagenet32_val/val_data"]
    assert torch.equal(data.test.x.reshape(4, -1), torch.from_numpy(val["data"]))
    assert (data.train.mean, data.train.std) == IMAGENET_STATS and data.num_classes == 1000
    assert len(data.val) == 0
    data = load("imagenet32", tmp_path, "dataset.val_fraction=0.2")
    assert len(data.val) == 6 and len(data.train) == 24 and data.val.x.dtype == torch.uint8
    with pytest.raises(ConfigError, match="dataset.image_size=64: imagenet32 images are 32x32"):
        load("imagenet32", tmp_path, "dataset.image_size=64")


MISSING = [  # (dataset, a path of its layout, which the error must name)
    ("imagefolder", "train"),
    ("imagefolder", "val"),
    ("tiny_imagenet", "wnids.txt"),
    ("tiny_imagenet", f"train/{WNIDS[1]}/images"),
    ("tiny_imagenet", "val/val_annotations.txt"),
    ("imagenet", "val"),
    ("imagenet_lt", "ImageNet_LT_test.txt"),
    ("webvision", "info/train_filelist_google.txt"),
    ("webvision", "val_images_256"),
    ("webvision", "info/synsets.txt"),
    ("clothing1m", "annotations/noisy_train_key_list.txt"),
    ("clothing1m", "images"),
    ("imagenet32", "Imagenet32_train/train_data_batch_7"),
    ("imagenet32", "Imagenet32_val/val_data"),
]


@pytest.mark.parametrize("name, missing", MISSING)
def test_a_missing_folder_or_list_file_is_named_in_one_line(tmp_path, name, missing):
    import shutil

    WRITERS[name](tmp_path)
    path = tmp_path / missing
    shutil.rmtree(path) if path.is_dir() else path.unlink()
    extra = ["dataset.imagenet_val=imagenet_val"] if name == "webvision" else []
    with pytest.raises(ConfigError) as err:
        load(name, tmp_path, *extra)
    message = str(err.value)
    assert "\n" not in message and str(path.resolve()) in message and "expected layout" in message


def test_a_missing_root_is_named(tmp_path):
    with pytest.raises(
        ConfigError, match=f"{tmp_path / 'nowhere'} not found; expected layout: train/<class>"
    ):
        load("imagefolder", tmp_path / "nowhere")


# The CIFAR-100 fine -> coarse labels as shipped in the dataset's `train` file (coarse_labels), written out
# independently of runner.data.builtin's super-class table.
CIFAR100_COARSE_LABELS = [
    4, 1, 14, 8, 0, 6, 7, 7, 18, 3, 3, 14, 9, 18, 7, 11, 3, 9, 7, 11, 6, 11, 5, 10, 7,
    6, 13, 15, 3, 15, 0, 11, 1, 10, 12, 14, 16, 9, 11, 5, 5, 19, 8, 8, 15, 13, 14, 17, 18, 10,
    16, 4, 17, 4, 2, 0, 17, 4, 18, 17, 10, 3, 2, 12, 12, 16, 12, 1, 9, 19, 2, 10, 0, 1, 16,
    12, 9, 13, 15, 13, 16, 19, 2, 4, 6, 19, 5, 5, 8, 19, 18, 1, 2, 15, 6, 0, 17, 8, 14, 13,
]  # fmt: skip


def test_cifar100_asymmetric_map_cycles_through_each_superclass():
    coarse = np.array(CIFAR100_COARSE_LABELS)
    mapping = CIFAR100_ASYM
    assert len(CIFAR100_CLASSES) == 100 and CIFAR100_CLASSES[:3] == ["apple", "aquarium_fish", "baby"]
    assert (coarse[mapping] == coarse).all() and (mapping != np.arange(100)).all()
    for g in range(20):  # one 5-cycle per super-class, through its classes in label order
        members = np.flatnonzero(coarse == g)
        assert mapping[members].tolist() == [*members[1:], members[0]]
    name = dict(enumerate(CIFAR100_CLASSES))
    known = {"beaver": "dolphin", "whale": "beaver", "apple": "mushroom", "sweet_pepper": "apple",
             "baby": "boy", "woman": "baby", "maple_tree": "oak_tree", "lawn_mower": "rocket"}  # fmt: skip
    assert {name[c]: name[int(mapping[c])] for c in range(100) if name[c] in known} == known


@pytest.fixture
def fake_cifar(monkeypatch):
    """torchvision's CIFAR loaders with the md5 check reduced to "the file exists", so the fixture pickles
    go through the real reading code."""
    import torchvision.datasets.cifar as tv_cifar

    monkeypatch.setattr(tv_cifar, "check_integrity", lambda path, md5=None: Path(path).is_file())


def test_cifar100_asymmetric_noise_uses_the_superclass_map(tmp_path, fake_cifar):
    y = write_cifar(tmp_path, "cifar100", n_train=40)["y"]
    data = load("cifar100", tmp_path, "dataset.label_noise.kind=asymmetric", "dataset.label_noise.rate=1.0")
    assert data.train.y_clean.tolist() == y.tolist() and data.train.y.tolist() == CIFAR100_ASYM[y].tolist()


def image_index(split) -> np.ndarray:
    """Which fixture training image each row of `split` is (write_cifar fills image i with the value i)."""
    mean, std = torch.tensor((0.4914, 0.4822, 0.4465)), torch.tensor((0.2470, 0.2435, 0.2616))
    pixel = split.x[:, :, 0, 0] * std + mean
    return (pixel[:, 0] * 255).round().long().numpy()


def test_cifar10n_labels_follow_the_train_order_through_the_val_carve(tmp_path, fake_cifar):
    y = write_cifar(tmp_path, "cifar10")["y"]
    rng = np.random.default_rng(5)
    variants = ("aggre_label", "worse_label", "random_label1", "random_label2", "random_label3")
    human = {v: rng.integers(0, 10, len(y)) for v in variants}
    write_human_labels(tmp_path, "cifar10", y, **human)
    kind = "dataset.label_noise.kind=human"
    for variant in ("worse_label", "random_label2"):
        data = load(
            "cifar10", tmp_path, kind, f"++dataset.label_noise.variant={variant}", "dataset.val_fraction=0.25"
        )
        idx = image_index(data.train)
        assert len(data.train) == 15 and len(set(idx)) == 15
        assert data.train.y.tolist() == human[variant][idx].tolist()
        assert data.train.y_clean.tolist() == y[idx].tolist() and data.meta["human_noise"] == variant
        val_idx = image_index(data.val)
        assert sorted([*idx, *val_idx]) == list(range(20)) and data.val.y.tolist() == y[val_idx].tolist()


def test_cifar100n_noisy_label(tmp_path, fake_cifar):
    y = write_cifar(tmp_path, "cifar100")["y"]
    noisy = (y + 3) % 100
    write_human_labels(tmp_path, "cifar100", y, noisy_label=noisy, noisy_coarse_label=noisy % 20)
    data = load(
        "cifar100", tmp_path, "dataset.label_noise.kind=human", "++dataset.label_noise.variant=noisy_label"
    )
    assert data.train.y.tolist() == noisy.tolist() and data.train.y_clean.tolist() == y.tolist()


def test_human_noise_errors_are_one_line(tmp_path, fake_cifar):
    y = write_cifar(tmp_path, "cifar10")["y"]
    human = ("dataset.label_noise.kind=human", "++dataset.label_noise.variant=aggre_label")
    with pytest.raises(ConfigError, match=r"CIFAR-10_human.pt not found; put CIFAR-N's CIFAR-10_human.pt"):
        load("cifar10", tmp_path, *human)
    write_human_labels(tmp_path, "cifar10", (y + 1) % 10, aggre_label=y)
    with pytest.raises(ConfigError, match="not one per cifar10 training image"):  # another order's file
        load("cifar10", tmp_path, *human)
    choices = "aggre_label, worse_label, random_label1, random_label2, random_label3"
    with pytest.raises(
        ConfigError, match=f"variant='noisy_label' is not a cifar10 human label set; .*: {choices}"
    ):
        load(
            "cifar10", tmp_path, "dataset.label_noise.kind=human", "++dataset.label_noise.variant=noisy_label"
        )
    with pytest.raises(ConfigError, match="variant='aggre' is not a valid choice"):
        dataset_cfg("dataset.label_noise.kind=human", "++dataset.label_noise.variant=aggre")
    with pytest.raises(ConfigError, match="rate=0.2 does not apply to kind=human"):
        dataset_cfg(*human, "dataset.label_noise.rate=0.2")
    with pytest.raises(ConfigError, match="dataset.name='digits' has no human labels"):
        load_data(dataset_cfg(*human), seed=0)


E2E = {  # dataset -> extra overrides of its smoke run
    "imagefolder": ["dataset.image_size=16"],
    "tiny_imagenet": ["dataset.image_size=16"],
    "imagenet": ["dataset.image_size=16"],
    "imagenet_lt": ["dataset.image_size=16"],
    "webvision": ["dataset.image_size=16", "dataset.imagenet_val=imagenet_val"],
    "clothing1m": ["dataset.image_size=16"],
    "imagenet32": [],
}


@pytest.mark.slow  # ~15-30 s per dataset here (a CLI start each)
@pytest.mark.parametrize("name", list(E2E))
def test_each_layout_runs_end_to_end_under_debug_smoke(tmp_path, cli, name):
    from conftest import summaries

    WRITERS[name](tmp_path / "data")
    cli(f"dataset={name}", f"dataset.root={tmp_path / 'data'}", *E2E[name], "model=cnn", "+debug=smoke",
        "logger=none", "train.progress=false")  # fmt: skip
    (summary,) = summaries(tmp_path / "outputs").values()
    assert summary["epoch"] == 1 and 0 <= summary["test/acc"] <= 1
    if name in ("webvision", "imagenet"):
        assert "test/acc5" in summary
    if name == "webvision":
        assert "imagenet_val/acc" in summary and "imagenet_val/acc5" in summary
