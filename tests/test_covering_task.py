"""The covering task (runner/tasks/covering.py): its sets, its config checks, `run` end to end, the CLI."""

import json

import numpy as np
import pytest
import torch
from conftest import summaries

from runner.checks import ConfigError
from runner.compose import compose, preflight, typed
from runner.hardware import RunContext, seed_everything
from runner.hooks.pwc import predictive_entropy
from runner.tasks.covering import (
    MISSING,
    OUTLIER,
    CoverConfig,
    build_sets,
    dataset_sets,
    largest_remainder,
    mixture2d_sets,
    run,
)
from runner.track import Tracker
from runner.validate import validate


def run_here(tmp_path, *overrides):
    """`run` in-process on the composed config (`+method=pwc` unless an experiment is given)."""
    preset = [] if any(o.startswith("+experiment=") for o in overrides) else ["+method=pwc"]
    cfg = compose([*preset, "logger=none", *overrides])
    cfg = typed(cfg, validate(cfg))
    seed_everything(cfg.seed)
    return run(cfg, RunContext(torch.device("cpu"), tmp_path, Tracker(tmp_path, None)))


def test_largest_remainder():
    np.testing.assert_array_equal(largest_remainder([1, 1, 1], 10), [4, 3, 3])
    np.testing.assert_array_equal(largest_remainder([0.6, 0.35, 0.05], 200), [120, 70, 10])
    assert largest_remainder(np.ones(9), 298).sum() == 298


def test_dataset_sets_are_disjoint_with_the_asked_class_counts():
    y = np.repeat(np.arange(10), 70)
    m = CoverConfig(n_app=300, n_dev=300, missing_class=3, dev_share=0.005)
    app, dev = dataset_sets(y, m, 10, np.random.default_rng(0))
    assert len(app) == 300 and len(dev) == 300 and not set(app) & set(dev)
    np.testing.assert_array_equal(np.bincount(y[app], minlength=10), np.full(10, 30))
    dev_counts = np.bincount(y[dev], minlength=10)
    assert dev_counts[3] == 2 and set(np.delete(dev_counts, 3)) == {33, 34} and dev_counts.sum() == 300
    _, absent = dataset_sets(
        y, CoverConfig(n_app=100, n_dev=100, dev_share=0.0), 10, np.random.default_rng(0)
    )
    assert (y[absent] != 0).all()
    with pytest.raises(ConfigError, match=r"class 0 needs 50 \+ 30 samples, the pool has 70"):
        dataset_sets(y, CoverConfig(n_app=500, n_dev=300, dev_share=0.1), 10, np.random.default_rng(0))


def test_mixture2d_sets():
    m = CoverConfig(scenario="mixture2d", n_app=400, n_dev=200, app_share=0.3, dev_share=0.05, outliers=0.02)
    x_app, y_app, x_dev, y_dev = mixture2d_sets(m, np.random.default_rng(0))
    assert x_app.shape == (400, 2) and x_dev.shape == (200, 2)
    np.testing.assert_array_equal(np.bincount(y_app, minlength=4), [157, 118, 117, 8])
    np.testing.assert_array_equal(np.bincount(y_dev, minlength=4), [120, 70, 10, 0])
    c = x_app[y_app == MISSING]
    assert np.abs(c.mean(0) - [2.0, 3.5]).max() < 0.15 and np.abs(c.std(0) - 0.5).max() < 0.1
    assert (np.abs(x_app[y_app == OUTLIER] - 2) <= 8).all()
    again = mixture2d_sets(m, np.random.default_rng(0))
    np.testing.assert_array_equal(again[0], x_app)


@pytest.mark.parametrize(
    "overrides,match",
    [
        (["method.selector=exact"], "method.selector='exact' is not a valid choice"),
        (["method.k=301"], "method.k=301 is out of range"),
        (["method.dev_share=1.0"], "method.dev_share=1.0"),
        (["method.selector=lof", "method.batch=2"], "method.batch=2: only greedy"),
        (["method.scenario=blobs"], "method.scenario='blobs'"),
        (["method.features=pixels"], "method.features='pixels'"),
        (["method.reg=0"], "method.reg=0"),
        (["method.scenario=mixture2d", "method.selector=entropy"], "method.selector=entropy needs a dataset"),
    ],
)
def test_bad_config_is_one_line(overrides, match):
    with pytest.raises(ConfigError, match=match):
        preflight(["+method=pwc", *overrides])


def test_run_on_digits_reports_and_plots(tmp_path):
    s = run_here(tmp_path, "method.n_app=100", "method.n_dev=100", "method.k=8", "method.dev_share=0.02")
    assert s["cover/app_missing_share"] == pytest.approx(0.1) and s[
        "cover/dev_missing_share"
    ] == pytest.approx(0.02)
    assert len(set(s["cover/picked"])) == 8 and sum(s["cover/picked_per_pattern"]) == 8
    assert s["cover/missing_share"] == s["cover/picked_per_pattern"][0] / 8
    curve = np.array(s["cover/pw_curve"])
    assert len(curve) == 9 and (np.diff(curve) <= 1e-12).all() and curve[0] == s["cover/pw_empty"]
    assert s["cover/n_lp"] == 9 and s["cover/seconds"] > 0
    assert (tmp_path / "covering.png").stat().st_size > 5000
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(9)) and records[-1]["cover/pw"] == curve[-1]


def test_run_on_the_mixture_finds_mode_c(tmp_path):
    s = run_here(tmp_path, "+experiment=pwc_mixture2d", "method.selector=sensitivity")
    assert s["cover/missing_share"] >= 0.6 and s["cover/missing_share"] + s["cover/outlier_share"] == 1.0
    rand = run_here(tmp_path, "+experiment=pwc_mixture2d", "method.selector=random", "method.plot=false")
    assert rand["cover/pw_empty"] == s["cover/pw_empty"]  # same sets for every selector of a seed
    assert rand["cover/pw_final"] > s["cover/pw_final"]


def test_the_optimality_preset_rates_a_selection_against_the_exact_optimum(tmp_path):
    """Fig. 3 on a brute-forceable instance (N = 8, K = 3): the task's MILP optimum is the best PW over all
    56 subsets (an independent reduced LP each); the ratio phi(S_K) / phi(S*_K) as defined, 1 for the MILP."""
    from test_pwc import brute_force

    small = ["+experiment=pwc_optimality", "method.n_app=8", "method.n_dev=8", "method.k=3", "seed=1"]
    s = run_here(tmp_path, *small, "method.selector=random")
    x_app, _, x_dev, *_ = build_sets(compose([*small, "logger=none"]), None)
    _, best = brute_force(x_app, x_dev, 3)
    # HiGHS stops within mip_gap (1e-6) of the optimum, relative; the LPs agree to ~1e-12
    assert s["cover/pw_optimum"] == pytest.approx(best, rel=1e-6)
    phi = s["cover/pw_empty"] - s["cover/pw_final"]
    assert s["cover/approx_ratio"] == pytest.approx(phi / (s["cover/pw_empty"] - best), rel=1e-5)
    assert s["cover/approx_ratio"] < 1 and s["cover/missing_share"] == 0
    milp = run_here(tmp_path, *small, "method.selector=milp")
    assert milp["cover/approx_ratio"] == pytest.approx(1, rel=1e-5)
    greedy = run_here(tmp_path, *small, "method.selector=greedy")["cover/approx_ratio"]
    assert 1 - 1 / np.e <= greedy <= 1 + 1e-5  # the greedy guarantee of a monotone submodular phi


def test_net_features_train_then_load_from_checkpoint(tmp_path):
    args = ["method.features=net", "method.n_app=60", "method.n_dev=60", "method.k=5", "train.epochs=1"]
    trained = run_here(tmp_path / "a", *args, "train.progress=false")
    ckpt = tmp_path / "a" / "checkpoints" / "last.pt"
    loaded = run_here(tmp_path / "b", *args, f"method.checkpoint={ckpt}")
    assert loaded["cover/picked"] == trained["cover/picked"]
    assert loaded["cover/pw_empty"] == pytest.approx(trained["cover/pw_empty"], rel=1e-9)
    with pytest.raises(ConfigError, match="method.checkpoint"):
        run_here(tmp_path / "c", *args, f"method.checkpoint={tmp_path / 'missing.pt'}")


def test_predictive_entropy():
    h = predictive_entropy(torch.tensor([[0.0, 0.0], [100.0, 0.0], [1.0, 1.0], [0.0, np.log(3.0)]]))
    np.testing.assert_allclose(h[:3], [np.log(2), 0.0, np.log(2)], atol=1e-12)
    assert h[3] == pytest.approx(-(0.25 * np.log(0.25) + 0.75 * np.log(0.75)))


def test_entropy_baseline_picks_the_least_certain_app_samples(tmp_path):
    args = ["method.selector=entropy", "method.n_app=60", "method.n_dev=60", "method.k=5", "train.epochs=1",
            "train.progress=false", "method.plot=false"]  # fmt: skip
    s = run_here(tmp_path / "a", *args)
    assert len(set(s["cover/picked"])) == 5 and (tmp_path / "a" / "checkpoints" / "last.pt").exists()
    # the same sets and the same (loaded) classifier give the scores: the picks are the top 5
    cfg = compose(
        [
            "+method=pwc",
            "logger=none",
            *args,
            f"method.checkpoint={tmp_path / 'a' / 'checkpoints' / 'last.pt'}",
        ]
    )
    cfg = typed(cfg, validate(cfg))
    scores = build_sets(cfg, RunContext(torch.device("cpu"), tmp_path / "b", Tracker(tmp_path / "b", None)))[
        -1
    ]
    assert sorted(s["cover/picked"]) == sorted(np.argsort(-scores, kind="stable")[:5].tolist())


@pytest.mark.slow
def test_cli_sweep_over_selectors(cli, tmp_path):
    cli("-m", "+method=pwc", "method.selector=ctrans,kcenter", "method.n_app=80", "method.n_dev=80",
        "method.k=6", "logger=none")  # fmt: skip
    found = summaries(tmp_path / "outputs" / "multirun")
    assert len(found) == 2
    for run_dir, s in found.items():
        assert 0 <= s["cover/missing_share"] <= 1 and (run_dir / "covering.png").exists()


@pytest.mark.slow
def test_issue_claims_on_cpu(tmp_path):
    """Mixture preset (5 seeds, mode C 20% of app): sensitivity and ctrans pick mode C more often than
    k-center and >= 3x random; the digest's E1 (C 30% of app) caps the ratio below 3.4 (random already
    picks 29% from C), so it asserts 2x there. Digits with zeros at 0.5% of dev: >= 4x random."""

    def share(*overrides):
        runs = [run_here(tmp_path, *overrides, f"seed={s}", "method.plot=false") for s in range(5)]
        return np.mean([r["cover/missing_share"] for r in runs])

    for app_share, factor in ((0.2, 3), (0.3, 2)):
        mix = ("+experiment=pwc_mixture2d", f"method.app_share={app_share}")
        rand, kcenter = share(*mix, "method.selector=random"), share(*mix, "method.selector=kcenter")
        for selector in ("sensitivity", "ctrans"):
            ours = share(*mix, f"method.selector={selector}")
            assert ours > kcenter and ours >= factor * rand
    rand = share("+experiment=pwc_digits", "method.selector=random")
    for selector in ("sensitivity", "ctrans"):
        assert share("+experiment=pwc_digits", f"method.selector={selector}") >= 4 * rand


def test_raw_features_of_a_file_backed_dataset_ask_for_network_features(tmp_path):
    from fixtures_data import write_imagefolder

    write_imagefolder(tmp_path / "data")
    with pytest.raises(
        ConfigError, match=r"method.features=raw: dataset=imagefolder is read from files.*=net"
    ):
        run_here(tmp_path, "dataset=imagefolder", f"dataset.root={tmp_path / 'data'}", "method.n_app=3",
                 "method.n_dev=3", "method.k=2")  # fmt: skip


@pytest.mark.parametrize(("preset", "name"), [("pwc_mixture2d", "mixture2d"), ("pwc_digits", "digits")])
def test_a_run_names_the_data_it_covers(preset, name):
    from runner.tasks import covering

    assert covering.data_name(compose([f"+experiment={preset}"])) == name
