"""Writers of tiny datasets in the real on-disk layouts (a few generated images per class, the list files),
for tests/test_datasets.py. Each `write_<name>(root)` returns what the loader must find."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import torch

CLASSES = ["cat", "dog", "fox"]  # imagefolder class folders (labels 0, 1, 2)
WNIDS = ["n02085620", "n01443537", "n01629819"]  # deliberately unsorted, as in tiny-imagenet's wnids.txt


def write_image(path: Path, seed: int, size: int = 12) -> None:
    """A small random RGB image; JPEG or PNG by suffix. Sizes vary with the seed (resizing is tested)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    side = size + seed % 5
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(rng.integers(0, 256, (side, side + 2, 3), dtype=np.uint8)).save(path)


def write_lines(path: Path, lines) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f"{line}\n" for line in lines))


def write_class_folders(
    root: Path, sub: str, classes, per_class: int, suffix=".JPEG"
) -> list[tuple[str, int]]:
    """`per_class` images root/sub/<class>/<class>_<i><suffix>; returns the (relative path, label) pairs."""
    pairs = []
    for label, cls in enumerate(classes):
        for i in range(per_class):
            rel = f"{sub}/{cls}/{cls}_{i}{suffix}"
            write_image(root / rel, seed=7 * label + i)
            pairs.append((rel, label))
    return pairs


def write_imagefolder(root: Path, test: bool = False) -> dict:
    pairs = {"train": write_class_folders(root, "train", CLASSES, 3, ".jpg")}
    pairs["val"] = write_class_folders(root, "val", CLASSES, 2, ".png")
    (root / "train" / "cat" / "notes.txt").write_text("not an image")
    if test:
        pairs["test"] = write_class_folders(root, "test", CLASSES[:2], 1)
    return pairs


def write_tiny_imagenet(root: Path, per_class: int = 3) -> dict:
    """tiny-imagenet-200: wnids.txt, train/<wnid>/images/<wnid>_<i>.JPEG (+ the boxes file), val/images
    labelled by val/val_annotations.txt. Returns the val (file, wnid) rows."""
    write_lines(root / "wnids.txt", WNIDS)
    for w in WNIDS:
        for i in range(per_class):
            write_image(root / "train" / w / "images" / f"{w}_{i}.JPEG", seed=i)
        write_lines(
            root / "train" / w / f"{w}_boxes.txt", [f"{w}_{i}.JPEG\t0\t0\t8\t8" for i in range(per_class)]
        )
    rows = [(f"val_{i}.JPEG", WNIDS[(2 * i + 1) % 3]) for i in range(5)]
    for i, (name, _) in enumerate(rows):
        write_image(root / "val" / "images" / name, seed=20 + i)
    write_lines(root / "val" / "val_annotations.txt", [f"{f}\t{w}\t1\t2\t30\t31" for f, w in rows])
    return {"val": rows}


def write_imagenet(root: Path, per_class: int = 3) -> dict:
    return {
        "train": write_class_folders(root, "train", WNIDS, per_class),
        "val": write_class_folders(root, "val", WNIDS, 2),
    }


def write_imagenet_lt(root: Path) -> dict:
    """ImageNet-LT lists over an ImageNet fixture: class counts 5, 2, 1 in train (imbalance 5)."""
    folders = write_imagenet(root, per_class=6)
    by_class = [[p for p, y in folders["train"] if y == c] for c in range(3)]
    lists = {
        "train": [(p, c) for c, n in enumerate((5, 2, 1)) for p in by_class[c][:n]],
        "val": [(by_class[c][5], c) for c in range(3)],
        "test": folders["val"],
    }
    for part, pairs in lists.items():
        write_lines(root / f"ImageNet_LT_{part}.txt", [f"{p} {y}" for p, y in pairs])
    return lists


def write_webvision(root: Path) -> dict:
    """Google-subset training list with labels on both sides of 50, the val list + val_images_256/,
    info/synsets.txt (52 wnids) and an ILSVRC12-style val folder with the wnids of classes 0, 49, 50."""
    labels = [0, 0, 1, 49, 50, 51, 3, 999]
    train = [(f"google/q{y + 1:04d}/{i:06d}.jpg", y) for i, y in enumerate(labels)]
    val = [(f"{i:09d}.jpg", y) for i, y in enumerate([0, 1, 50, 49, 2])]
    for i, (p, _) in enumerate(train):
        write_image(root / p, seed=i)
    for i, (p, _) in enumerate(val):
        write_image(root / "val_images_256" / p, seed=i)
    write_lines(root / "info" / "train_filelist_google.txt", [f"{p} {y}" for p, y in train])
    write_lines(root / "info" / "val_filelist.txt", [f"{p} {y}" for p, y in val])
    synsets = [f"n{10_000_000 + c:08d}" for c in range(52)]
    write_lines(root / "info" / "synsets.txt", [f"{w} class {c}, a synonym" for c, w in enumerate(synsets)])
    imagenet_val = []
    for c in (0, 49, 50):
        for i in range(2):
            rel = f"{synsets[c]}/ILSVRC2012_val_{100 * c + i:08d}.JPEG"
            write_image(root / "imagenet_val" / rel, seed=c + i)
            imagenet_val.append((rel, c))
    return {"train": train, "val": val, "imagenet_val": [(p, c) for p, c in imagenet_val if c < 50]}


def write_clothing1m(root: Path) -> dict:
    """Clothing1M annotations: 6 noisy training keys (two also have a different clean label), 3 clean val
    and 4 clean test keys."""
    keys = [f"images/{i % 10}/{i:02d}/{1000 + i}.jpg" for i in range(13)]
    for i, k in enumerate(keys):
        write_image(root / k, seed=i)
    noisy = {k: (3 * i) % 14 for i, k in enumerate(keys[:6])}
    clean = {k: (5 * i + 1) % 14 for i, k in enumerate(keys[4:], start=4)}  # keys 4, 5 are in both
    ann = root / "annotations"
    write_lines(ann / "noisy_label_kv.txt", [f"{k} {y}" for k, y in noisy.items()])
    write_lines(ann / "clean_label_kv.txt", [f"{k} {y}" for k, y in clean.items()])
    write_lines(ann / "noisy_train_key_list.txt", keys[:6])
    write_lines(ann / "clean_val_key_list.txt", keys[6:9])
    write_lines(ann / "clean_test_key_list.txt", keys[9:])
    return {"noisy": noisy, "clean": clean, "train": keys[:6], "val": keys[6:9], "test": keys[9:]}


def write_imagenet32(root: Path, per_batch: int = 3, n_val: int = 4) -> dict:
    """The ten training pickles and the val pickle: `data` uint8 N x 3072 (channel-major), `labels`
    1..1000 (and the `mean` image the release also stores)."""
    rng = np.random.default_rng(0)
    out = {}
    files = [f"Imagenet32_train/train_data_batch_{i}" for i in range(1, 11)] + ["Imagenet32_val/val_data"]
    for f in files:
        n = n_val if "val" in f else per_batch
        batch = {
            "data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
            "labels": rng.integers(1, 1001, n).tolist(),
            "mean": rng.random(3072),
        }
        (root / f).parent.mkdir(parents=True, exist_ok=True)
        with open(root / f, "wb") as fh:
            pickle.dump(batch, fh)
        out[f] = batch
    return out


def write_cifar(root: Path, name: str, n_train: int = 20, n_test: int = 6) -> dict:
    """Fake torchvision CIFAR-10/100 python files (`cifar-10-batches-py` / `cifar-100-python`). Image i of
    the training set has every pixel equal to i (so a loaded split tells which images it holds)."""
    k = 10 if name == "cifar10" else 100
    rng = np.random.default_rng(1)
    x = np.repeat(np.arange(n_train, dtype=np.uint8)[:, None], 3072, axis=1)
    y = rng.integers(0, k, n_train)
    test = {"data": np.zeros((n_test, 3072), np.uint8), "labels": rng.integers(0, k, n_test).tolist()}
    if name == "cifar10":
        folder = root / "cifar-10-batches-py"
        parts = np.array_split(np.arange(n_train), 5)
        files = {f"data_batch_{i + 1}": {"data": x[p], "labels": y[p].tolist()} for i, p in enumerate(parts)}
        files |= {"test_batch": test, "batches.meta": {"label_names": [f"c{c}" for c in range(k)]}}
    else:
        folder = root / "cifar-100-python"
        files = {
            "train": {"data": x, "fine_labels": y.tolist()},
            "test": {"data": test["data"], "fine_labels": test["labels"]},
            "meta": {"fine_label_names": [f"c{c}" for c in range(k)]},
        }
    folder.mkdir(parents=True, exist_ok=True)
    for f, content in files.items():
        with open(folder / f, "wb") as fh:
            pickle.dump(content, fh)
    return {"y": y}


def write_human_labels(root: Path, name: str, y_clean: np.ndarray, **noisy) -> None:
    """CIFAR-N's file: numpy label arrays by variant, plus `clean_label`, saved with torch.save."""
    file = "CIFAR-10_human.pt" if name == "cifar10" else "CIFAR-100_human.pt"
    torch.save({"clean_label": np.asarray(y_clean), **noisy}, root / file)
