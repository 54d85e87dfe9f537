"""Datasets, label noise and long-tail subsets."""

import numpy as np
import pytest
from omegaconf import OmegaConf

from runner.checks import ConfigError
from runner.compose import compose
from runner.data import inject_label_noise, load_data, longtail_counts
from runner.data.builtin import CIFAR10_ASYM
from runner.validate import validate


def dataset_cfg(*overrides):
    return OmegaConf.structured(validate(compose(list(overrides)))["dataset"])


def test_digits_splits_are_disjoint_stratified_and_scaled():
    data = load_data(dataset_cfg(), seed=0)
    sizes = [len(s) for s in (data.train, data.val, data.test)]
    assert sum(sizes) == 1797 and data.input_shape == (1, 8, 8)
    assert sizes[2] == pytest.approx(0.2 * 1797, abs=1) and sizes[1] == pytest.approx(0.1 * 1797, abs=1)
    # The three splits partition the dataset: together they hold every image exactly once.
    from sklearn.datasets import load_digits

    together = sorted(tuple(x.flatten().tolist()) for s in (data.train, data.val, data.test) for x in s.x)
    assert together == sorted(tuple((img / 16.0).flatten().tolist()) for img in load_digits().images)
    assert float(data.train.x.min()) >= 0 and float(data.train.x.max()) <= 1
    counts = np.bincount(data.test.y.numpy(), minlength=10)
    assert counts.min() >= 34 and counts.max() <= 38


def test_same_seed_same_data_other_seed_other_split():
    a, b, c = (load_data(dataset_cfg(), seed=s) for s in (0, 0, 1))
    assert (a.train.x == b.train.x).all()
    assert not (a.train.y.numpy()[:50] == c.train.y.numpy()[:50]).all()


@pytest.mark.parametrize("rate", [0.2, 0.5, 0.8])
def test_symmetric_noise_flips_the_expected_share(rate):
    y = np.repeat(np.arange(10), 10_000)
    noisy = inject_label_noise(y, 10, "symmetric", rate, np.random.default_rng(0))
    # floor(rate N) labels are redrawn uniformly over all 10 classes, so 9/10 of them change.
    assert np.mean(noisy != y) == pytest.approx(rate * 0.9, abs=0.005)
    wrong = noisy[noisy != y]
    assert np.bincount(wrong, minlength=10).min() > 0.8 * len(wrong) / 10


def test_asymmetric_noise_is_exact_and_deterministic():
    y = np.repeat(np.arange(10), 500)
    noisy = inject_label_noise(y, 10, "asymmetric", 0.4, np.random.default_rng(3), CIFAR10_ASYM)
    again = inject_label_noise(y, 10, "asymmetric", 0.4, np.random.default_rng(3), CIFAR10_ASYM)
    assert (noisy == again).all()
    changed = noisy != y
    # Exactly the drawn floor(0.4 N) indices move, along the CIFAR-10 map (truck->car, bird->plane,
    # deer->horse, cat<->dog); classes mapped to themselves stay.
    assert (noisy[changed] == CIFAR10_ASYM[y[changed]]).all()
    movable = CIFAR10_ASYM[y] != y
    assert changed.sum() == pytest.approx(0.4 * movable.sum(), rel=0.06)
    nxt = inject_label_noise(y, 10, "asymmetric", 0.4, np.random.default_rng(3))
    assert (nxt != y).sum() == int(0.4 * len(y)) and ((nxt[nxt != y] - y[nxt != y]) % 10 == 1).all()


def test_noise_only_touches_train_labels_and_keeps_clean_ones():
    clean = load_data(dataset_cfg(), seed=0)
    noisy = load_data(
        dataset_cfg("dataset.label_noise.kind=symmetric", "dataset.label_noise.rate=0.5"), seed=0
    )
    assert (noisy.train.y_clean == clean.train.y).all()
    assert (noisy.test.y == clean.test.y).all() and (noisy.val.y == clean.val.y).all()
    flipped = (noisy.train.y != noisy.train.y_clean).float().mean().item()
    assert flipped == pytest.approx(0.45, abs=0.05)


def test_longtail_profile_formula():
    # The DB-OT digest's digits profile: n_max 110, imbalance 50.
    assert longtail_counts(110, 10, 50) == [110, 71, 46, 29, 19, 12, 8, 5, 3, 2]
    assert longtail_counts(5000, 10, 100)[-1] == 50


def test_imbalanced_train_split_matches_the_profile():
    balanced = load_data(dataset_cfg(), seed=0)
    n_max = np.bincount(balanced.train.y.numpy()).min()
    data = load_data(dataset_cfg("dataset.imbalance=20"), seed=0)
    assert np.bincount(data.train.y.numpy(), minlength=10).tolist() == longtail_counts(n_max, 10, 20)
    assert len(data.test) == len(balanced.test)


def test_max_train_draws_a_subset_and_min_per_class_keeps_every_class_beyond_the_bounds():
    full = load_data(dataset_cfg("dataset.imbalance=20"), seed=0)
    n_c = np.bincount(full.train.y.numpy(), minlength=10)  # the tail class has 7 (< 8 asked below)
    small = load_data(
        dataset_cfg("dataset.imbalance=20", "dataset.max_train=6", "dataset.max_eval=8"), seed=0
    )
    assert len(small.train) == 6 and len(small.val) == len(small.test) == 8
    assert len(np.unique(small.train.y.numpy())) == 6  # one per class first, as far as 6 allows
    data = load_data(
        dataset_cfg(
            "dataset.imbalance=20", "dataset.max_train=6", "dataset.max_eval=4", "dataset.min_per_class=8"
        ),
        seed=0,
    )
    counts = np.bincount(data.train.y.numpy(), minlength=10)
    assert counts.tolist() == np.minimum(n_c, 8).tolist()  # every class, past max_train
    assert (
        np.bincount(data.test.y.numpy(), minlength=10).min() == 1 and len(data.test) == 10
    )  # eval: one each
    assert len(np.unique(data.train.x.reshape(len(data.train), -1), axis=0)) == len(data.train)
    more = load_data(
        dataset_cfg("dataset.imbalance=20", "dataset.max_train=100", "dataset.min_per_class=8"), seed=0
    )
    assert (
        len(more.train) == 100
        and (np.bincount(more.train.y.numpy(), minlength=10) >= np.minimum(n_c, 8)).all()
    )


def test_synthetic_mixture_has_requested_shape():
    data = load_data(dataset_cfg("dataset=synthetic", "dataset.num_classes=4", "dataset.dim=3"), seed=0)
    assert data.input_shape == (3,) and data.num_classes == 4 and set(data.train.y.tolist()) == {0, 1, 2, 3}


def test_missing_cifar_files_name_the_folder_and_the_fix(tmp_path):
    cfg = dataset_cfg("dataset=cifar10", f"dataset.root={tmp_path}")
    with pytest.raises(ConfigError) as err:
        load_data(cfg, seed=0)
    assert str(tmp_path) in str(err.value) and "dataset.download=true" in str(err.value)


def test_bad_noise_arguments_raise():
    with pytest.raises(ValueError, match="kind='weird'"):
        inject_label_noise(np.zeros(5, int), 2, "weird", 0.1, np.random.default_rng(0))
    with pytest.raises(ValueError, match="imbalance=0.5"):
        longtail_counts(10, 3, 0.5)


def test_zero_test_fraction_leaves_the_test_split_empty():
    # The schema allows dataset.test_fraction in [0, 1); 0 must mean "no test split", as val_fraction=0 does.
    data = load_data(dataset_cfg("dataset.test_fraction=0"), seed=0)
    assert len(data.test) == 0 and len(data.train) + len(data.val) == 1797
    assert len(data.val) == pytest.approx(0.1 * 1797, abs=1)


def test_fractions_leaving_no_train_split_are_one_line():
    with pytest.raises(ConfigError, match=r"dataset.val_fraction=0.5 \+ dataset.test_fraction=0.5"):
        load_data(dataset_cfg("dataset.val_fraction=0.5", "dataset.test_fraction=0.5"), seed=0)
