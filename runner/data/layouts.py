"""File-backed datasets, each read from its standard on-disk layout under `dataset.root`.

A builder only lists files and labels (paths relative to the split's root): images are decoded when a loop
walks the split (`runner.data.files.FileSplit`). Normalisation is ImageNet's, as in the papers. Where a
layout has no separate validation set, the runner's `val` split is a random `dataset.val_fraction` of the
training files (0 by default: empty) and the layout's validation set is the `test` split, as in the papers:

    imagefolder    train/<class>/*  val/<class>/*  [test/<class>/*]   val = val/, test = test/ or val/
    tiny_imagenet  wnids.txt  train/<wnid>/images/*.JPEG  val/images/*.JPEG + val/val_annotations.txt
    imagenet       train/<wnid>/*.JPEG  val/<wnid>/*.JPEG                 test = val/
    imagenet_lt    ImageNet_LT_{train,val,test}.txt over an ImageNet root   val, test = the list files
    webvision      info/train_filelist_google.txt  info/val_filelist.txt + val_images_256/   test = val
                   (+ dataset.imagenet_val: <wnid>/*.JPEG -> extra split `imagenet_val`)
    clothing1m     annotations/{noisy,clean}_label_kv.txt and the noisy_train/clean_val/clean_test key lists

Class labels of folder layouts are the indices of the sorted class folder names (wnids), as torchvision's
`ImageFolder` numbers them. A hidden folder (`.ipynb_checkpoints`) is never a class; in the folders scanned,
files without an image extension (any case) and hidden files (`.DS_Store`, macOS's `._x.jpg`) are ignored
and counted (`meta["ignored_files"]`, shown by the `data:` line). Symlinked files and folders are followed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from runner.checks import ConfigError
from runner.data import Data, register_dataset
from runner.data.builtin import carve
from runner.data.files import IMAGENET_STATS, FileSplit, image_transforms
from runner.schema import DatasetConfig, check_range

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
LAYOUTS = {
    "imagefolder": "train/<class>/*, val/<class>/*, optional test/<class>/*",
    "tiny_imagenet": "the extracted tiny-imagenet-200 folder: wnids.txt, train/<wnid>/images/*.JPEG, "
    "val/images/*.JPEG, val/val_annotations.txt (file<TAB>wnid<TAB>box)",
    "imagenet": "ILSVRC2012 train/<wnid>/*.JPEG and val/<wnid>/*.JPEG",
    "imagenet_lt": "ImageNet_LT_{train,val,test}.txt in dataset.lists (lines 'train/n01440764/x.JPEG 0') "
    "over an ImageNet root",
    "webvision": "info/train_filelist_google.txt ('google/q0001/000000.jpg 0'), info/val_filelist.txt "
    "('file 0') with images in val_images_256/, info/synsets.txt",
    "clothing1m": "annotations/noisy_label_kv.txt, clean_label_kv.txt ('images/0/00/x.jpg 4'), "
    "noisy_train_key_list.txt, clean_val_key_list.txt, clean_test_key_list.txt; images/",
}
DEFAULT_SIZE = {
    "imagefolder": 224,
    "tiny_imagenet": 64,
    "imagenet": 224,
    "imagenet_lt": 224,
    "webvision": 299,
    "clothing1m": 224,
}


@dataclass
class ImageNetLTConfig(DatasetConfig):
    lists: str = ""  # folder of the ImageNet_LT_*.txt files, relative to root ("": root itself)

    def __post_init__(self):
        super().__post_init__()
        if self.imbalance != 1:
            raise ConfigError(
                f"dataset.imbalance={self.imbalance}: imagenet_lt is already long-tailed by its list files; "
                "leave it at 1"
            )


@dataclass
class WebVisionConfig(DatasetConfig):
    num_classes: int = 50  # the first classes of the Google subset (mini-WebVision: 50); others dropped
    imagenet_val: str = ""  # ILSVRC12 val folder <wnid>/*.JPEG, relative to root ("": no imagenet_val split)

    def __post_init__(self):
        super().__post_init__()
        check_range("dataset.num_classes", self.num_classes, 1, 1000)


def need(path: Path, name: str) -> Path:
    """`path`, or a one-line ConfigError naming it and dataset `name`'s layout."""
    if not path.exists():
        raise ConfigError(f"dataset.name={name}: {path} not found; expected layout: {LAYOUTS[name]}")
    return path


def read_pairs(path: Path, name: str) -> tuple[list[str], np.ndarray]:
    """The `<path> <int label>` lines of list file `path` (blank lines skipped)."""
    rows = [line.rsplit(None, 1) for line in read_keys(path, name)]
    for row in rows:
        if len(row) != 2 or not row[1].isdigit():
            raise ConfigError(f"{path}: line {' '.join(row)!r} is not '<path> <label>'")
    return [r[0] for r in rows], np.array([int(r[1]) for r in rows], dtype=np.int64)


def read_keys(path: Path, name: str) -> list[str]:
    """The non-blank lines of list file `path`, stripped; an empty file is an error."""
    lines = [line.strip() for line in need(path, name).read_text().splitlines() if line.strip()]
    if not lines:
        raise ConfigError(f"dataset.name={name}: {path} is empty; expected layout: {LAYOUTS[name]}")
    return lines


def subfolders(folder: Path) -> list[str]:
    """The sorted names of the folders in `folder`, hidden ones left out."""
    return sorted(e.name for e in os.scandir(folder) if e.is_dir() and not e.name.startswith("."))


def image_files(folder: Path) -> tuple[list[str], int]:
    """(the sorted names of the image files in `folder`, how many other files it holds); folders in it
    are neither."""
    images, others = [], 0
    for entry in os.scandir(folder):
        if entry.is_dir():
            continue
        if entry.name.lower().endswith(IMAGE_EXTENSIONS) and not entry.name.startswith("."):
            images.append(entry.name)
        else:
            others += 1
    return sorted(images), others


def scan_classes(root: Path, sub: str, classes, name: str, inner="", required=False, others_ok=False):
    """Images `root/sub/<class>/<inner>/*` of each of `classes`, labelled by class index: (paths relative
    to root, labels, the count of other files in those folders and in `root/sub`). A class folder may be
    absent unless `required`; a folder of no class is an error unless `others_ok`."""
    folder = need(root / sub, name)
    ignored = image_files(folder)[1]
    if not others_ok:
        unknown = sorted(set(subfolders(folder)) - set(classes))
        if unknown:
            raise ConfigError(f"dataset.name={name}: {folder} has class folders not in train: {unknown[:5]}")
    paths, labels = [], []
    for label, cls in enumerate(classes):
        images = folder / cls / inner
        if not images.is_dir():
            if required:
                need(images, name)
            continue
        files, others = image_files(images)
        ignored += others
        paths += [str(Path(sub, cls, inner, f)) for f in files]
        labels += [label] * len(files)
    if not paths:
        raise ConfigError(f"dataset.name={name}: no images under {folder}; expected layout: {LAYOUTS[name]}")
    return paths, np.array(labels, dtype=np.int64), ignored


class Builder:
    """What every layout shares: its root, transforms at `dataset.image_size`, the val carve-out and the
    count of ignored files."""

    def __init__(self, cfg, rng, name: str):
        self.cfg, self.rng, self.name = cfg, rng, name
        self.root = Path(cfg.root).expanduser().resolve()
        need(self.root, name)
        self.size = cfg.image_size or DEFAULT_SIZE[name]
        self.transforms = image_transforms(
            cfg.augment, self.size, *IMAGENET_STATS, cfg.crop_pad, cfg.eval_resize
        )
        self.ignored = 0

    def split(self, paths, y, root: Path | None = None) -> FileSplit:
        return FileSplit(
            root or self.root, paths, y, transforms=self.transforms, bad_images=self.cfg.bad_images
        )

    def scan(self, sub: str, classes, root: Path | None = None, **options) -> FileSplit:
        """The split `scan_classes` finds (`options`: its own), its ignored files counted."""
        paths, y, ignored = scan_classes(root or self.root, sub, classes, self.name, **options)
        self.ignored += ignored
        return self.split(paths, y, root)

    def carve(self, train: FileSplit) -> tuple[FileSplit, FileSplit]:
        """(train, val): a random `dataset.val_fraction` of the training files held out as val."""
        return carve(train, self.cfg.val_fraction, self.rng)

    def data(self, train, val, test, num_classes: int, extra=None, **meta) -> Data:
        meta.setdefault("normalize", IMAGENET_STATS)  # (mean, std) per channel of the network input
        meta.setdefault("ignored_files", self.ignored)
        return Data(train, val, test, num_classes, (3, self.size, self.size), meta=meta, extra=extra or {})


@register_dataset("imagefolder")
def imagefolder(cfg, rng) -> Data:
    """Your own images: classes are the folders of train/; val/ is the val split, test/ (or val/) the test."""
    b = Builder(cfg, rng, "imagefolder")
    classes = subfolders(need(b.root / "train", b.name))
    if not classes:
        raise ConfigError(f"dataset.name=imagefolder: {b.root / 'train'} has no class folders")
    train, val = b.scan("train", classes), b.scan("val", classes)
    test = b.scan("test", classes) if (b.root / "test").is_dir() else val
    return b.data(train, val, test, len(classes), classes=classes)


@register_dataset("tiny_imagenet")
def tiny_imagenet(cfg, rng) -> Data:
    """Tiny-ImageNet (200 classes, 64 px): its val/ folder is the test split."""
    b = Builder(cfg, rng, "tiny_imagenet")
    wnids = sorted(read_keys(b.root / "wnids.txt", b.name))
    train = b.scan("train", wnids, inner="images", required=True)
    index = {w: i for i, w in enumerate(wnids)}
    need(b.root / "val" / "images", b.name)
    rows = [line.split("\t") for line in read_keys(b.root / "val" / "val_annotations.txt", b.name)]
    bad = next((r for r in rows if len(r) < 2 or r[1] not in index), None)
    if bad:
        raise ConfigError(f"{b.root / 'val' / 'val_annotations.txt'}: line {bad} names no wnid of wnids.txt")
    test = b.split([f"val/images/{r[0]}" for r in rows], [index[r[1]] for r in rows])
    return b.data(*b.carve(train), test, len(wnids), classes=wnids)


@register_dataset("imagenet")
def imagenet(cfg, rng) -> Data:
    """ILSVRC2012 (1000 classes): its val/ folder is the test split."""
    b = Builder(cfg, rng, "imagenet")
    wnids = subfolders(need(b.root / "train", b.name))
    train, test = b.scan("train", wnids), b.scan("val", wnids)
    return b.data(*b.carve(train), test, len(wnids), classes=wnids, top5=True)


@register_dataset("imagenet_lt", schema=ImageNetLTConfig)
def imagenet_lt(cfg, rng) -> Data:
    """ImageNet-LT (Liu et al. 2019): 1000 classes of 5..1280 training images listed by
    ImageNet_LT_train.txt; ImageNet_LT_val.txt (20 per class) and ImageNet_LT_test.txt (50 per class) are
    the val and test splits. `meta["imbalance"]` is the training set's n_max / n_min (256)."""
    b = Builder(cfg, rng, "imagenet_lt")
    lists = b.root / cfg.lists
    train, val, test = (
        read_pairs(lists / f"ImageNet_LT_{part}.txt", b.name) for part in ("train", "val", "test")
    )
    num_classes = int(train[1].max()) + 1
    for part, (_, y) in zip(("val", "test"), (val, test)):
        if y.max() >= num_classes:
            raise ConfigError(f"{lists / f'ImageNet_LT_{part}.txt'}: label {y.max()} has no training images")
    counts = np.bincount(train[1], minlength=num_classes)
    if counts.min() == 0:
        raise ConfigError(
            f"{lists / 'ImageNet_LT_train.txt'}: class {counts.argmin()} has no training images"
        )
    imbalance = float(counts.max() / counts.min())
    return b.data(*(b.split(*part) for part in (train, val, test)), num_classes, imbalance=imbalance)


@register_dataset("webvision", schema=WebVisionConfig)
def webvision(cfg, rng) -> Data:
    """Mini-WebVision (DivideMix, CSOT): the first `dataset.num_classes` classes of WebVision 1.0's Google
    subset, other labels dropped; the WebVision val set is the test split; `dataset.imagenet_val` adds the
    ILSVRC12 val images of those classes (wnids of info/synsets.txt) as the extra split `imagenet_val`.
    Its train labels are web labels with unknown noise: `meta["clean_train_labels"]` is False."""
    b = Builder(cfg, rng, "webvision")
    k = cfg.num_classes
    paths, y = read_pairs(b.root / "info" / "train_filelist_google.txt", b.name)
    keep = y < k
    train = b.split(np.asarray(paths)[keep], y[keep])
    paths, y = read_pairs(b.root / "info" / "val_filelist.txt", b.name)
    need(b.root / "val_images_256", b.name)
    keep = y < k
    test = b.split([f"val_images_256/{p}" for p in np.asarray(paths)[keep]], y[keep])
    extra = {}
    if cfg.imagenet_val:
        wnids = [line.split()[0] for line in read_keys(b.root / "info" / "synsets.txt", b.name)][:k]
        folder = need(b.root / cfg.imagenet_val, b.name)
        extra["imagenet_val"] = b.scan(".", wnids, root=folder, others_ok=True)
    return b.data(*b.carve(train), test, k, extra, top5=True, clean_train_labels=False)


@register_dataset("clothing1m")
def clothing1m(cfg, rng) -> Data:
    """Clothing1M (14 classes): trains on the noisy labels of the noisy training keys, validates and tests
    on the clean keys. Those training images have no clean label: `y_clean` repeats `y` and
    `meta["clean_train_labels"]` is False, so label-noise scores that need the truth are skipped."""
    b = Builder(cfg, rng, "clothing1m")
    ann = b.root / "annotations"
    need(b.root / "images", b.name)

    def labelled(keys_file: str, kv_file: str):
        paths, y = read_pairs(ann / kv_file, b.name)
        if y.max() >= 14:
            raise ConfigError(
                f"{ann / kv_file}: label {y.max()} is not one of Clothing1M's 14 classes (0..13)"
            )
        kv = dict(zip(paths, y))
        keys = read_keys(ann / keys_file, b.name)
        missing = next((key for key in keys if key not in kv), None)
        if missing is not None:
            raise ConfigError(f"{ann / keys_file}: key {missing} has no label in {ann / kv_file}")
        return b.split(keys, [kv[key] for key in keys])

    train = labelled("noisy_train_key_list.txt", "noisy_label_kv.txt")
    val, test = (labelled(f"clean_{part}_key_list.txt", "clean_label_kv.txt") for part in ("val", "test"))
    return b.data(train, val, test, 14, clean_train_labels=False)
