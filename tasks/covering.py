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

Features (`method.features`): `raw` flattened inputs; `net` the embeddings (`forward_features`) of
`model`, trained here (`train` settings) on the train split with the missing class cut to `dev_share`
of it, as the development data would be, or loaded from `method.checkpoint` (a run's
checkpoints/last.pt). Costs are squared Euclidean distances between features.

Reports the share of picks from the missing pattern (the METRIC; a random pick's expected share is
`cover/app_missing_share`), the outlier share (mixture2d), the PW curve (logged per pick and in
`cover/pw_curve`), exact LPs and runtime of the selection, and writes `covering.png`: the 2-D scatter
(PCA for other vectors) with the picks highlighted, or a grid of the picked images.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from runner.methods.pwc import BASELINES, BATCHED, PW_METHODS, cover
from runner.schema import ConfigError, check_choice, check_range

METRIC = ("cover/missing_share", "max")

MODES = np.array([[0.0, 0.0], [4.0, 0.0], [2.0, 3.5]])  # mixture2d: A, B, C (C is the missing pattern)
MODE_SIGMA = 0.5
APP_AB_WEIGHTS = (0.4, 0.3)  # A:B in app, scaled to 1 - app_share
DEV_AB_WEIGHTS = (0.6, 0.35)  # A:B in dev, scaled to 1 - dev_share
OUTLIER_BOX = (-6.0, 10.0)
MISSING, OUTLIER = 2, 3  # mixture2d pattern labels: 0 A, 1 B, 2 C, 3 outlier


@dataclass
class CoverConfig:
    name: str = "pwc"
    task: str = "covering"
    selector: str = "ctrans"
    scenario: str = "dataset"  # dataset | mixture2d
    k: int = 30
    n_app: int = 300
    n_dev: int = 300
    missing_class: int = 0  # dataset: the class made rare in dev
    dev_share: float = 0.005  # share of the missing pattern in dev (0: absent)
    app_share: float = 0.2  # mixture2d: share of mode C in app (before outliers; digest E1: 0.3)
    outliers: float = 0.02  # mixture2d: share of app drawn uniformly from the box
    features: str = "raw"  # raw | net
    checkpoint: str = ""  # features=net: embed with this runner checkpoint instead of training
    batch: int = 1  # picks per LP (> 1: an extension beyond the paper)
    eta: float = 1e-6  # sensitivity / entropic: relative mass of unselected candidates
    reg: float = 0.01  # entropic: eps in cost units (the paper's), or a fraction of PW({}) (reg_relative)
    reg_relative: bool = False
    max_iter: int = 50_000  # entropic sweeps (the paper's cap)
    tol: float = 1e-6  # entropic L1 row-marginal tolerance
    mip_gap: float = 1e-6  # milp: HiGHS relative gap
    plot: bool = True

    def __post_init__(self):
        check_choice("method.selector", self.selector, PW_METHODS + BASELINES)
        check_choice("method.scenario", self.scenario, ("dataset", "mixture2d"))
        check_range("method.n_app", self.n_app, 1)
        check_range("method.n_dev", self.n_dev, 1)
        check_range("method.k", self.k, 1, self.n_app)
        check_range("method.missing_class", self.missing_class, 0)
        check_range("method.dev_share", self.dev_share, 0.0, 1.0, hi_open=True)
        check_range("method.app_share", self.app_share, 0.0, 1.0, hi_open=True)
        check_range("method.outliers", self.outliers, 0.0, 1.0, hi_open=True)
        check_choice("method.features", self.features, ("raw", "net"))
        if self.selector == "entropy" and self.scenario == "mixture2d":
            raise ConfigError(
                "method.selector=entropy needs a dataset to train a classifier on; not mixture2d"
            )
        check_range("method.batch", self.batch, 1)
        if self.batch > 1 and self.selector not in BATCHED:
            raise ConfigError(f"method.batch={self.batch}: only {', '.join(BATCHED)} pick in batches")
        check_range("method.eta", self.eta, 0.0, 1.0, lo_open=True)
        check_range("method.reg", self.reg, 0.0, lo_open=True)
        check_range("method.max_iter", self.max_iter, 1)
        check_range("method.tol", self.tol, 0.0, lo_open=True)
        check_range("method.mip_gap", self.mip_gap, 0.0)


METHODS = {"pwc": CoverConfig}


def share_count(share: float, n: int) -> int:
    """round(share * n), halves up (Python's round(0.5) is 0)."""
    return int(np.floor(share * n + 0.5))


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


def _trained_model(cfg, ctx, data):
    """`cfg.model` loaded from method.checkpoint, or trained on the train split with the missing class cut
    to dev_share of it (as the development data would be)."""
    from runner.data import Data
    from runner.models import build_model
    from runner.train import fit

    m = cfg.method
    model = build_model(cfg.model, data.input_shape, data.num_classes)
    if m.checkpoint:
        try:
            state = torch.load(m.checkpoint, map_location="cpu", weights_only=False)
            model.load_state_dict(state["model"])
        except (OSError, KeyError, RuntimeError) as e:
            raise ConfigError(
                f"method.checkpoint={m.checkpoint!r}: not a runner checkpoint of this model ({e})"
            ) from None
    else:
        y = data.train.y_clean.numpy()
        rng = np.random.default_rng(cfg.seed + 1)
        others = np.flatnonzero(y != m.missing_class)
        n_missing = share_count(m.dev_share / (1 - m.dev_share), len(others))
        missing = rng.permutation(np.flatnonzero(y == m.missing_class))[:n_missing]
        train = data.train.subset(np.sort(np.r_[others, missing]))
        fit(model, Data(train, data.val, data.test, data.num_classes, data.input_shape, data.meta), cfg.train,
            ctx, augment=cfg.dataset.augment)  # fmt: skip
    return model.to(ctx.device)


def predictive_entropy(logits: torch.Tensor) -> np.ndarray:
    """-sum_j p_j log p_j of softmax(logits), per row (nats)."""
    log_p = torch.log_softmax(logits.double(), dim=1)
    return -(log_p.exp() * log_p).sum(1).numpy()


def build_sets(cfg, ctx):
    """X_app, labels_app, X_dev, labels_dev, the missing label, `app_images(picks)` (the decoded app images
    of the picks, or None), class names, and the entropy scores of the app samples (selector=entropy)."""
    m = cfg.method
    if m.scenario == "mixture2d":
        x_app, y_app, x_dev, y_dev = mixture2d_sets(m, np.random.default_rng(cfg.seed))
        return x_app, y_app, x_dev, y_dev, MISSING, lambda picks: None, ["A", "B", "C", "outlier"], None
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
    model = _trained_model(cfg, ctx, data) if trains else None
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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if images is not None:  # a grid of the picked images, labelled
        cols = min(10, max(len(picks), 1))
        rows = max(1, -(-len(picks) // cols))
        fig, axes = plt.subplots(rows, cols, figsize=(1.1 * cols, 1.25 * rows + 0.5), squeeze=False)
        for ax in axes.ravel():
            ax.axis("off")
        for ax, j, img in zip(axes.ravel(), picks, images):
            img = img.float()
            img = (img - img.min()) / max(float(img.max() - img.min()), 1e-12)
            ax.imshow(img.permute(1, 2, 0).squeeze(-1).numpy(), cmap="gray")
            ax.set_title(names[labels_app[j]], fontsize=8)
    else:
        if x_app.shape[1] != 2:
            from sklearn.decomposition import PCA

            pca = PCA(2).fit(np.vstack([x_app, x_dev]))
            x_app, x_dev = pca.transform(x_app), pca.transform(x_dev)
            title += " (PCA)"
        fig, ax = plt.subplots(figsize=(5.5, 5))
        ax.scatter(x_app[:, 0], x_app[:, 1], s=8, c="0.7", label="application")
        ax.scatter(
            x_dev[:, 0], x_dev[:, 1], s=8, c="tab:blue", marker="x", linewidths=0.8, label="development"
        )
        ax.scatter(x_app[picks, 0], x_app[picks, 1], s=60, facecolors="none", edgecolors="tab:red",
                   linewidths=1.5, label="picked")  # fmt: skip
        ax.legend(fontsize=8, loc="best")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(cfg, ctx) -> dict:
    m = cfg.method
    x_app, y_app, x_dev, y_dev, missing, app_images, names, scores = build_sets(cfg, ctx)
    if not ctx.is_main:  # under DDP the selection runs on rank 0, which writes the summary
        return {}
    start = time.perf_counter()
    result = cover(x_app, x_dev, m.k, m.selector, batch=m.batch, eta=m.eta, reg=m.reg,
                   reg_relative=m.reg_relative, max_iter=m.max_iter, tol=m.tol, mip_gap=m.mip_gap,
                   seed=cfg.seed, scores=scores)  # fmt: skip
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
    if m.plot:
        path = ctx.dir / "covering.png"
        title = (f"{m.selector}: {summary['cover/missing_share']:.0%} of {m.k} picks from "
                 f"{names[missing]} (app {summary['cover/app_missing_share']:.0%}, dev "
                 f"{summary['cover/dev_missing_share']:.1%})\nPW {pw0:.4g} -> {pwk:.4g}")  # fmt: skip
        plot_picks(path, title, x_app, x_dev, result.indices, y_app, names, app_images(result.indices))
        ctx.tracker.image("covering", path)
    return summary
