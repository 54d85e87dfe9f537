"""Partial Wasserstein covering (PWC): pick K application samples that fill the gaps of a development set.

    runner +method=pwc dataset=digits                       digits: zeros are 0.5% of dev, ~10% of app
    runner +method=pwc method.selector=lof                  a baseline on the same sets
    runner +experiment=pwc_mixture2d                        2-D mixture, mode C under-represented in dev
    runner -m +method=pwc method.selector=ctrans,random,kcenter seed=0,1,2,3,4

Selectors (`method.selector`): the PWC algorithms greedy | sensitivity | ctrans | entropic | milp and
the baselines random | kcenter | lof | entropy of `runner.methods.pwc.cover`. `entropy` is the paper's
active-learning baseline: the K application samples on which a classifier (`model`, trained here as for
`features=net`) is least certain, by the entropy of its softmax. The entropic selector's eps is `reg` in
cost units (the paper: 0.01, with at most 50,000 sweeps), or `reg` x PW({}) with `reg_relative=true`.

Sets (`method.scenario`):
  dataset    `n_app` application samples with every class in equal shares (the paper's 10% each) and,
             disjoint from them, `n_dev` development samples of which round(dev_share * n_dev) belong to
             `missing_class` (0: absent), the other classes in equal shares. The pool is every split of
             the dataset for `features=raw`, and val + test (held out from training) for `features=net`.
  mixture2d  2-D Gaussians (sigma 0.5) at A (0, 0), B (4, 0), C (2, 3.5). App: C has `app_share`
             (default 0.2; the digest's E1 has 0.3), A:B = 4:3 share the rest, plus a share `outliers`
             drawn uniformly from [-6, 10]^2. Dev: C has `dev_share`, A:B = 12:7 share the rest, no
             outliers. The missing pattern is mode C. The dataset config is not used.
  normal2d   `n_app` and `n_dev` points drawn independently from the 2-D standard normal (the paper's
             section 5.1, its Figs. 2-3); no missing pattern (`cover/missing_share` 0).

With `method.optimum` the exact optimum S*_K (the MILP of Appendix A, HiGHS) is solved too and
`cover/approx_ratio` = phi(S_K) / phi(S*_K), phi(S) = PW({}) - PW(S), is reported (Fig. 3).

Features (`method.features`): `raw` flattened inputs; `net` the embeddings (`forward_features`) of
`model`, trained here (`train` settings) on the train split with the missing class cut to `dev_share`
of it, as the development data would be, or loaded from `method.checkpoint` (a run's
checkpoints/last.pt). Costs are squared Euclidean distances between features.

Reports the share of picks from the missing pattern (its metric; a random pick's expected share is
`cover/app_missing_share`), the outlier share (mixture2d), the PW curve (logged per pick and in
`cover/pw_curve`), exact LPs and runtime of the selection, and writes `covering.png`: the 2-D scatter
(PCA for other vectors) with the picks highlighted, or a grid of the picked images.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from runner.checks import ConfigError
from runner.configs.covering import METHODS, CoverConfig  # noqa: F401  (tests import them here)
from runner.hooks.pwc import cover_options, predictive_entropy, share_count, trained_model
from runner.methods.pwc import cover
from runner.plots import new_figure, project_2d, save_figure
from runner.task import Task

MODES = np.array([[0.0, 0.0], [4.0, 0.0], [2.0, 3.5]])  # mixture2d: A, B, C (C is the missing pattern)
MODE_SIGMA = 0.5
APP_AB_WEIGHTS = (0.4, 0.3)  # A:B in app, scaled to 1 - app_share
DEV_AB_WEIGHTS = (0.6, 0.35)  # A:B in dev, scaled to 1 - dev_share
OUTLIER_BOX = (-6.0, 10.0)
MISSING, OUTLIER = 2, 3  # mixture2d pattern labels: 0 A, 1 B, 2 C, 3 outlier


def smoke(cfg) -> None:
    """`+debug=smoke`: application and development sets of a quarter of an evaluation split each, so
    that every class's share fits in smoke's pool (held-out splits of `max_eval` samples each)."""
    m = cfg.method
    if m.scenario == "dataset":
        m.n_app = m.n_dev = max(1, min(m.n_app, m.n_dev, cfg.dataset.max_eval // 4))
        m.k = min(m.k, m.n_app)


def data_name(cfg) -> str:
    """What a run covers, for its log lines: the 2-D scenarios leave the dataset group unused."""
    return cfg.dataset.name if cfg.method.scenario == "dataset" else cfg.method.scenario


def largest_remainder(weights, n: int) -> np.ndarray:
    """Integer counts summing to n, proportional to `weights` (Hamilton's method)."""
    quota = np.asarray(weights, dtype=float) / np.sum(weights) * n
    counts = np.floor(quota).astype(int)
    counts[np.argsort(counts - quota, kind="stable")[: n - counts.sum()]] += 1
    return counts


def dataset_sets(
    y: np.ndarray, m, num_classes: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Disjoint (app, dev) index arrays into a pool with labels `y`: every class in equal shares in
    app; in dev the missing class has round(dev_share * n_dev) samples and the others equal shares."""
    n_missing = share_count(m.dev_share, m.n_dev)
    app_counts = largest_remainder(np.ones(num_classes), m.n_app)
    dev_counts = np.insert(
        largest_remainder(np.ones(num_classes - 1), m.n_dev - n_missing), m.missing_class, n_missing
    )
    app, dev = [], []
    for c in range(num_classes):
        pool = rng.permutation(np.flatnonzero(y == c))
        if len(pool) < app_counts[c] + dev_counts[c]:
            raise ConfigError(
                f"method.n_app={m.n_app}, method.n_dev={m.n_dev}: class {c} needs {app_counts[c]} + "
                f"{dev_counts[c]} samples, the pool has {len(pool)}; lower them"
            )
        app.append(pool[: app_counts[c]])
        dev.append(pool[app_counts[c] : app_counts[c] + dev_counts[c]])
    return rng.permutation(np.concatenate(app)), rng.permutation(np.concatenate(dev))


def _with_c_share(ab_weights, c_share):
    return [w / sum(ab_weights) * (1 - c_share) for w in ab_weights] + [c_share]


def mixture2d_sets(m, rng: np.random.Generator):
    """(X_app, labels_app, X_dev, labels_dev) of the 2-D mixture (labels: 0 A, 1 B, 2 C, 3 outlier)."""

    def draw(counts):
        labels = np.repeat(np.arange(len(counts)), counts)
        x = MODES[labels] + MODE_SIGMA * rng.normal(size=(len(labels), 2))
        return x, labels

    n_out = share_count(m.outliers, m.n_app)
    x_app, y_app = draw(largest_remainder(_with_c_share(APP_AB_WEIGHTS, m.app_share), m.n_app - n_out))
    x_app = np.vstack([x_app, rng.uniform(*OUTLIER_BOX, size=(n_out, 2))])
    y_app = np.r_[y_app, np.full(n_out, OUTLIER)]
    x_dev, y_dev = draw(largest_remainder(_with_c_share(DEV_AB_WEIGHTS, m.dev_share), m.n_dev))
    shuffle_app, shuffle_dev = rng.permutation(m.n_app), rng.permutation(m.n_dev)
    return x_app[shuffle_app], y_app[shuffle_app], x_dev[shuffle_dev], y_dev[shuffle_dev]


def build_sets(cfg, ctx):
    """X_app, labels_app, X_dev, labels_dev, the missing label, `app_images(picks)` (the decoded app images
    of the picks, or None), class names, and the entropy scores of the app samples (selector=entropy)."""
    m = cfg.method
    if m.scenario == "mixture2d":
        x_app, y_app, x_dev, y_dev = mixture2d_sets(m, np.random.default_rng(cfg.seed))
        return x_app, y_app, x_dev, y_dev, MISSING, lambda picks: None, ["A", "B", "C", "outlier"], None
    if m.scenario == "normal2d":
        rng = np.random.default_rng(cfg.seed)
        x_app, x_dev = rng.normal(size=(m.n_app, 2)), rng.normal(size=(m.n_dev, 2))
        labels_app, labels_dev = np.zeros(m.n_app, int), np.zeros(m.n_dev, int)  # one pattern, not missing
        return x_app, labels_app, x_dev, labels_dev, -1, lambda picks: None, ["normal"], None
    from runner.data import load_data
    from runner.distributed_passes import decoded_inputs, predict_all, rows_of

    data = load_data(cfg.dataset, cfg.seed)
    if m.missing_class >= data.num_classes:
        raise ConfigError(
            f"method.missing_class={m.missing_class}: {cfg.dataset.name} has {data.num_classes} classes"
        )
    trains = m.features == "net" or m.selector == "entropy"
    splits = [s for s in ([data.val, data.test] if trains else [data.train, data.val, data.test]) if len(s)]
    if m.features == "raw" and not all(hasattr(s, "x") for s in splits):
        raise ConfigError(
            f"method.features=raw: dataset={cfg.dataset.name} is read from files; cover with network "
            "features instead (method.features=net)"
        )
    y = torch.cat([s.y_clean for s in splits]).numpy()
    app, dev = dataset_sets(y, m, data.num_classes, np.random.default_rng(cfg.seed))
    chosen = np.r_[app, dev]
    model = trained_model(cfg, ctx, data) if trains else None
    if m.features == "net":
        feats = rows_of(splits, chosen, lambda split: predict_all(model, split, ctx, features=True))
    else:
        feats = rows_of(splits, chosen, lambda split: decoded_inputs(split, ctx))
    feats = feats.reshape(len(chosen), -1).double().numpy()
    scores = None
    if m.selector == "entropy":
        scores = predictive_entropy(rows_of(splits, app, lambda split: predict_all(model, split, ctx)))

    def app_images(picks):
        if len(data.input_shape) != 3:
            return None
        return rows_of(
            splits, app[np.asarray(picks, dtype=np.int64)], lambda split: decoded_inputs(split, ctx)
        )

    names = [str(c) for c in range(data.num_classes)]
    return feats[: len(app)], y[app], feats[len(app) :], y[dev], m.missing_class, app_images, names, scores


def plot_picks(path, title, x_app, x_dev, picks, labels_app, names, images=None) -> None:
    """The 2-D scatter (PCA for other vectors) with the picks circled, or with `images` (those of the
    picks, in pick order) a labelled grid of them."""
    if images is not None:
        cols = min(10, max(len(picks), 1))
        rows = max(1, -(-len(picks) // cols))
        fig, axes = new_figure((1.1 * cols, 1.25 * rows + 0.5), rows, cols, squeeze=False)
        for ax in axes.ravel():
            ax.axis("off")
        for ax, j, img in zip(axes.ravel(), picks, images):
            img = img.float()
            img = (img - img.min()) / max(float(img.max() - img.min()), 1e-12)
            ax.imshow(img.permute(1, 2, 0).squeeze(-1).numpy(), cmap="gray")
            ax.set_title(names[labels_app[j]], fontsize=8)
    else:
        (x_app, x_dev), title = project_2d(x_app, x_dev, title=title)
        fig, ax = new_figure((5.5, 5))
        ax.scatter(x_app[:, 0], x_app[:, 1], s=8, c="0.7", label="application")
        ax.scatter(x_dev[:, 0], x_dev[:, 1], s=8, c="tab:blue", marker="x", linewidths=0.8,
                   label="development")  # fmt: skip
        ax.scatter(x_app[picks, 0], x_app[picks, 1], s=60, facecolors="none", edgecolors="tab:red",
                   linewidths=1.5, label="picked")  # fmt: skip
        ax.legend(fontsize=8, loc="best")
    save_figure(fig, path, title)


def run(cfg, ctx) -> dict:
    m = cfg.method
    x_app, y_app, x_dev, y_dev, missing, app_images, names, scores = build_sets(cfg, ctx)
    if not ctx.is_main:  # under DDP the selection runs on rank 0, which writes the summary
        return {}
    start = time.perf_counter()
    result = cover(x_app, x_dev, m.k, m.selector, **cover_options(m), seed=cfg.seed, scores=scores)
    seconds = time.perf_counter() - start
    picked = y_app[result.indices]
    hits = np.cumsum(picked == missing)
    for t, pw in enumerate(result.pw):
        ctx.tracker.log({"cover/pw": float(pw), "cover/missing_picked": int(hits[t - 1]) if t else 0}, step=t)
    pw0, pwk = float(result.pw[0]), float(result.pw[-1])
    summary = {
        "cover/missing_share": float(np.mean(picked == missing)) if m.k else 0.0,
        "cover/app_missing_share": float(np.mean(y_app == missing)),
        "cover/dev_missing_share": float(np.mean(y_dev == missing)),
        "cover/pw_empty": pw0,
        "cover/pw_final": pwk,
        "cover/pw_reduction": 1 - pwk / pw0 if pw0 > 0 else 0.0,
        "cover/seconds": seconds,
        "cover/n_lp": result.n_lp,
        "cover/picked_per_pattern": np.bincount(picked, minlength=len(names)).tolist(),
        "cover/picked": result.indices.tolist(),
        "cover/pw_curve": result.pw.tolist(),
    }
    if m.scenario == "mixture2d":
        summary["cover/outlier_share"] = float(np.mean(picked == OUTLIER)) if m.k else 0.0
    if m.optimum:
        options = cover_options(m) | {"batch": 1}  # the MILP picks all K at once
        best = float(cover(x_app, x_dev, m.k, "milp", **options, seed=cfg.seed).pw[-1])
        summary["cover/pw_optimum"] = best
        summary["cover/approx_ratio"] = (pw0 - pwk) / (pw0 - best) if pw0 > best else 1.0
    if m.plot:
        path = ctx.dir / "covering.png"
        title = (f"{m.selector}: {summary['cover/missing_share']:.0%} of {m.k} picks from "
                 f"{names[missing]} (app {summary['cover/app_missing_share']:.0%}, dev "
                 f"{summary['cover/dev_missing_share']:.1%})\nPW {pw0:.4g} -> {pwk:.4g}")  # fmt: skip
        plot_picks(path, title, x_app, x_dev, result.indices, y_app, names, app_images(result.indices))
        ctx.tracker.image("covering", path)
    return summary


TASK = Task("covering", ("cover/missing_share", "max"), run, smoke=smoke, data_name=data_name)
