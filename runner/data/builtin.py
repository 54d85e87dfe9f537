"""The built-in datasets: sklearn digits (embedded), a Gaussian mixture, and CIFAR-10/100."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from runner.checks import ConfigError
from runner.data import Data, Split, next_class_map, register_dataset, split_of, three_way_split
from runner.schema import HUMAN_NOISE_VARIANTS, SyntheticConfig
from runner.untrusted import RefusedPickle, torch_load


@register_dataset("digits")
def digits(cfg, rng) -> Data:
    """sklearn's bundled 8x8 digits (1797 images, 10 classes), pixels scaled to [0, 1]."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = (bunch.images / 16.0).astype(np.float32)[:, None]  # (N, 1, 8, 8)
    train, val, test = three_way_split(x, bunch.target, cfg.val_fraction, cfg.test_fraction, rng)
    return Data(train, val, test, num_classes=10, input_shape=(1, 8, 8))


@register_dataset("synthetic", schema=SyntheticConfig)
def synthetic(cfg, rng) -> Data:
    """Gaussian mixture: one unit-variance Gaussian per class, centres ~ N(0, (separation^2 / dim) I)."""
    centres = rng.normal(scale=cfg.separation / np.sqrt(cfg.dim), size=(cfg.num_classes, cfg.dim))
    y = rng.integers(0, cfg.num_classes, size=cfg.n_samples)
    x = (centres[y] + rng.normal(size=(cfg.n_samples, cfg.dim))).astype(np.float32)
    train, val, test = three_way_split(x, y, cfg.val_fraction, cfg.test_fraction, rng)
    return Data(train, val, test, num_classes=cfg.num_classes, input_shape=(cfg.dim,))


# Standard asymmetric noise for CIFAR-10: truck->automobile, bird->airplane, deer->horse, cat<->dog.
CIFAR10_ASYM = np.array([0, 1, 0, 5, 7, 3, 6, 7, 8, 1])
# The 20 CIFAR-100 super-classes and their 5 classes each, as listed by Krizhevsky (2009),
# https://www.cs.toronto.edu/~kriz/cifar.html. A class's label is its index in the sorted names.
CIFAR100_SUPERCLASSES = {
    "aquatic mammals": ("beaver", "dolphin", "otter", "seal", "whale"),
    "fish": ("aquarium_fish", "flatfish", "ray", "shark", "trout"),
    "flowers": ("orchid", "poppy", "rose", "sunflower", "tulip"),
    "food containers": ("bottle", "bowl", "can", "cup", "plate"),
    "fruit and vegetables": ("apple", "mushroom", "orange", "pear", "sweet_pepper"),
    "household electrical devices": ("clock", "keyboard", "lamp", "telephone", "television"),
    "household furniture": ("bed", "chair", "couch", "table", "wardrobe"),
    "insects": ("bee", "beetle", "butterfly", "caterpillar", "cockroach"),
    "large carnivores": ("bear", "leopard", "lion", "tiger", "wolf"),
    "large man-made outdoor things": ("bridge", "castle", "house", "road", "skyscraper"),
    "large natural outdoor scenes": ("cloud", "forest", "mountain", "plain", "sea"),
    "large omnivores and herbivores": ("camel", "cattle", "chimpanzee", "elephant", "kangaroo"),
    "medium-sized mammals": ("fox", "porcupine", "possum", "raccoon", "skunk"),
    "non-insect invertebrates": ("crab", "lobster", "snail", "spider", "worm"),
    "people": ("baby", "boy", "girl", "man", "woman"),
    "reptiles": ("crocodile", "dinosaur", "lizard", "snake", "turtle"),
    "small mammals": ("hamster", "mouse", "rabbit", "shrew", "squirrel"),
    "trees": ("maple_tree", "oak_tree", "palm_tree", "pine_tree", "willow_tree"),
    "vehicles 1": ("bicycle", "bus", "motorcycle", "pickup_truck", "train"),
    "vehicles 2": ("lawn_mower", "rocket", "streetcar", "tank", "tractor"),
}
CIFAR100_CLASSES = sorted(c for members in CIFAR100_SUPERCLASSES.values() for c in members)
CIFAR100_COARSE = np.array(
    [next(g for g, ms in enumerate(CIFAR100_SUPERCLASSES.values()) if c in ms) for c in CIFAR100_CLASSES]
)
# Standard asymmetric noise for CIFAR-100 (Patrini et al. 2017): each class flips to the next class of its
# super-class, circularly. (Several released codes use blocks of 5 consecutive labels instead, which are
# not super-classes.)
CIFAR100_ASYM = next_class_map(100, CIFAR100_COARSE)
CIFAR_STATS = {
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
}
HUMAN_NOISE_FILES = {"cifar10": "CIFAR-10_human.pt", "cifar100": "CIFAR-100_human.pt"}


def holdout(n: int, fraction: float, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(kept, held out) indices of n samples: a random round(fraction * n) held out, the rest kept in
    their original order."""
    order = rng.permutation(n)
    n_out = int(round(fraction * n))
    return np.sort(order[n_out:]), order[:n_out]


def carve(split, fraction: float, rng: np.random.Generator):
    """(train, val) of a training split: a random `fraction` held out as val (empty at 0, and then the
    training split is returned as it is, not copied)."""
    kept, held = holdout(len(split), fraction, rng)
    return (split.subset(kept) if len(held) else split), split.subset(held)


def human_labels(root: Path, name: str, variant: str, targets: np.ndarray) -> np.ndarray:
    """Label set `variant` of CIFAR-N's `CIFAR-10_human.pt` / `CIFAR-100_human.pt` under `root` (Wei et al.
    2022): one human label per training image, in the order of the CIFAR training files."""
    choices = HUMAN_NOISE_VARIANTS[name]
    if variant not in choices:
        raise ConfigError(
            f"dataset.label_noise.variant={variant!r} is not a {name} human label set; choose one of: "
            f"{', '.join(choices)}"
        )
    path = root / HUMAN_NOISE_FILES[name]
    if not path.is_file():
        raise ConfigError(
            f"dataset.label_noise.kind=human: {path.resolve()} not found; put CIFAR-N's {path.name} "
            "(github.com/UCSC-REAL/cifar-10-100n, data/) in dataset.root"
        )
    try:
        labels = torch_load(path)  # the released files pickle numpy arrays
    except RefusedPickle:
        raise ConfigError(f"{path}: holds pickled objects other than numpy arrays, which could run code; "
                          "not loaded") from None  # fmt: skip
    noisy = np.asarray(labels.get(variant, ()), dtype=np.int64)
    clean = np.asarray(labels.get("clean_label", targets))
    if len(noisy) != len(targets) or not np.array_equal(clean, targets):
        raise ConfigError(
            f"{path}: {variant} has {len(noisy)} labels (clean labels matching: "
            f"{np.array_equal(clean, targets)}), not one per {name} training image ({len(targets)}) in order"
        )
    return noisy


def _cifar(cfg, rng, name: str) -> Data:
    """CIFAR-10/100 from torchvision files under `cfg.root`; val is carved from train. With
    `label_noise.kind=human` the training labels are CIFAR-N's (read before the carve, which indexes
    both label sets alike); the val split keeps the true labels, as with synthetic noise."""
    from torchvision import datasets

    cls = datasets.CIFAR10 if name == "cifar10" else datasets.CIFAR100
    root = Path(cfg.root).expanduser()
    try:
        parts = [cls(str(root), train=train, download=cfg.download) for train in (True, False)]
    except (RuntimeError, OSError) as e:
        folder = root / cls.base_folder
        if cfg.download:  # the download itself failed: no network, a proxy, a full disk
            raise ConfigError(
                f"dataset.download=true: the download of {name} from {cls.url} failed ({e}); fetch that "
                f"file where there is a network and extract it in {root.resolve()} (it holds {folder.name}/)"
            ) from None
        raise ConfigError(
            f"{name} not found under {root.resolve()} ({e}); put the extracted python version there "
            f"(e.g. {folder}) or run with dataset.download=true"
        ) from None
    mean, std = (torch.tensor(s).view(1, 3, 1, 1) for s in CIFAR_STATS[name])

    def to_tensor(images):
        return (torch.as_tensor(images).permute(0, 3, 1, 2).float() / 255.0 - mean) / std

    (x_train, y_train), (x_test, y_test) = ((to_tensor(p.data), np.asarray(p.targets)) for p in parts)
    meta = {"asym_map": CIFAR10_ASYM if name == "cifar10" else CIFAR100_ASYM, "normalize": CIFAR_STATS[name]}
    y_noisy = y_train
    if cfg.label_noise.kind == "human":
        y_noisy = human_labels(root, name, cfg.label_noise.variant, y_train)
        meta["human_noise"] = cfg.label_noise.variant
    train_idx, val_idx = holdout(len(y_train), cfg.val_fraction, rng)
    train = Split(
        x_train[train_idx],
        torch.as_tensor(y_noisy[train_idx], dtype=torch.long),
        torch.as_tensor(y_train[train_idx], dtype=torch.long),
    )
    val = split_of(x_train[val_idx], y_train[val_idx])
    test = split_of(x_test, y_test)
    num_classes = 10 if name == "cifar10" else 100
    return Data(train, val, test, num_classes=num_classes, input_shape=(3, 32, 32), meta=meta)


# torchvision's folders of the extracted python versions (`datasets.CIFAR10.base_folder`)
CIFAR_FOLDERS = {"cifar10": "cifar-10-batches-py", "cifar100": "cifar-100-python"}


def _cifar_files(cfg) -> str | None:
    root = Path(cfg.root).expanduser()
    if cfg.download or (root / CIFAR_FOLDERS[cfg.name]).is_dir():
        return None
    return (
        f"{cfg.name} not found under dataset.root={root.resolve()}; put the extracted python version there "
        f"({root / CIFAR_FOLDERS[cfg.name]}) or run with dataset.download=true"
    )


register_dataset("cifar10", files=_cifar_files)(lambda cfg, rng: _cifar(cfg, rng, "cifar10"))
register_dataset("cifar100", files=_cifar_files)(lambda cfg, rng: _cifar(cfg, rng, "cifar100"))
