"""Clustering with bounded cluster masses (DB-OT) and its baselines, scored against the true labels.

    runner +method=dbot_cluster dataset=blobs method.tau=0.5        DB-OT barycentric clustering
    runner +method=balanced_cluster dataset=blobs                   the same with tau = 0 (equal masses)
    runner +method=kmeans dataset=blobs                             k-means (sklearn, k-means++, n_init)

Which samples: `method.split` (train | test | all) of the dataset, optionally the first
`method.per_class` of each class; `method.features=net` clusters the embeddings
(`forward_features`) of a `model` trained on the train split (`train` settings) instead of the raw
inputs. Reports purity, NMI, ARI (and ARI on the inliers when the dataset marks outliers, as `blobs`
does), the cluster sizes, and writes `clusters.png`: the samples (2-D, or their 2-D PCA projection)
coloured by cluster, centroids marked.
"""

from __future__ import annotations

import numpy as np
import torch

from runner.checks import ConfigError
from runner.configs.clustering import METHODS, BalancedClusterConfig, DBOTClusterConfig  # noqa: F401  (tests import them here)
from runner.data import load_data
from runner.methods.dbot import dbot_cluster
from runner.plots import category_colors, new_figure, project_2d, save_figure
from runner.task import Task


def _samples(cfg, ctx, data):
    """(x (N, d) float64, y (N,) int64) to cluster, per `method.split`, `per_class` and `features`."""
    from runner.distributed_passes import decoded_inputs, predict_all, rows_of

    m = cfg.method
    parts = {"train": [data.train], "test": [data.test], "all": [data.train, data.val, data.test]}[m.split]
    parts = [p for p in parts if len(p)]
    if m.features == "raw" and not all(hasattr(p, "x") for p in parts):
        raise ConfigError(
            f"method.features=raw: dataset={cfg.dataset.name} is read from files; cluster network features "
            "instead (method.features=net)"
        )
    y = torch.cat([p.y_clean for p in parts])
    keep = torch.arange(len(y))
    if m.per_class > 0:
        keep = (
            torch.cat([torch.nonzero(y == c)[: m.per_class, 0] for c in range(data.num_classes)])
            .sort()
            .values
        )
    if m.features == "net":
        from runner.models import build_model
        from runner.train import fit

        model = build_model(cfg.model, data.input_shape, data.num_classes)
        fit(model, data, cfg.train, ctx, augment=cfg.dataset.augment)
        x = rows_of(parts, keep, lambda split: predict_all(model, split, ctx, features=True))
    else:
        x = rows_of(parts, keep, lambda split: decoded_inputs(split, ctx))
    x = x.reshape(len(x), -1).double().numpy()
    if m.standardize:
        x = (x - x.mean(0)) / np.maximum(x.std(0), 1e-12)
    return x, y[keep].numpy()


def cluster_scores(y, labels, k: int, outlier_label=None) -> dict:
    """Purity, NMI, ARI (on the inliers too when `outlier_label` is given) and cluster sizes."""
    from sklearn.metrics import adjusted_rand_score, normalized_mutual_info_score

    table = np.zeros((k, int(y.max()) + 1), dtype=np.int64)
    np.add.at(table, (labels, y), 1)
    sizes = table.sum(1)
    out = {
        "cluster/purity": float(table.max(1).sum() / len(y)),
        "cluster/nmi": float(normalized_mutual_info_score(y, labels)),
        "cluster/ari": float(adjusted_rand_score(y, labels)),
        "cluster/min_size": int(sizes.min()),
        "cluster/max_size": int(sizes.max()),
        "cluster/sizes": sorted(int(s) for s in sizes),
    }
    if outlier_label is not None:
        inlier = y != outlier_label
        out["cluster/ari_inliers"] = float(adjusted_rand_score(y[inlier], labels[inlier]))
    return out


def plot_clusters(x, labels, centroids, title: str, path) -> None:
    """The samples (2-D or their PCA) coloured by cluster, the centroids marked."""
    (x, centroids), title = project_2d(x, centroids, fit=x, title=title)
    fig, ax = new_figure()
    ax.scatter(x[:, 0], x[:, 1], c=category_colors(labels), s=10)
    ax.scatter(centroids[:, 0], centroids[:, 1], c="black", marker="x", s=80, linewidths=2)
    save_figure(fig, path, title)


def run(cfg, ctx) -> dict:
    m = cfg.method
    data = load_data(cfg.dataset, cfg.seed)
    x, y = _samples(cfg, ctx, data)
    if not ctx.is_main:  # under DDP the clustering runs on rank 0, which writes the summary
        return {}
    k = m.k or data.meta.get("n_clusters", data.num_classes)
    if k > len(x):
        raise ConfigError(f"method.k={k}: more clusters than the {len(x)} samples to cluster")
    summary: dict = {"cluster/n": len(x), "cluster/k": k}
    if m.name == "kmeans":
        from sklearn.cluster import KMeans

        km = KMeans(k, n_init=m.n_init, random_state=cfg.seed).fit(x)
        labels, centroids = km.labels_, km.cluster_centers_
    else:
        labels, centroids, log = dbot_cluster(
            x, k, m.tau, m.eps, m.outer_iters, cfg.seed, init=m.init, hard_assign=m.hard_assign,
            assign=m.assign, method=m.solver, max_iter=m.max_iter, tol=m.tol, log=True,
        )  # fmt: skip
        masses = log["masses"] * len(x)  # in samples
        summary |= {
            "cluster/bound_low": float(log["b_low"].min() * len(x)),
            "cluster/bound_high": float(log["b_up"].max() * len(x)),
            "cluster/mass_min": float(masses[-1].min()),
            "cluster/mass_max": float(masses[-1].max()),
        }
        for t, row in enumerate(masses):
            ctx.tracker.log(
                {"cluster/mass_min": float(row.min()), "cluster/mass_max": float(row.max())}, step=t
            )
    summary |= cluster_scores(y, labels, k, data.meta.get("outlier_label"))
    if m.plot:
        path = ctx.dir / "clusters.png"
        sizes, nmi = summary["cluster/sizes"], summary["cluster/nmi"]
        title = f"{m.name} on {cfg.dataset.name}: NMI {nmi:.3f}\ncluster sizes {sizes}"
        plot_clusters(x, labels, centroids, title, path)
        ctx.tracker.image("clusters", path)
    return summary


TASK = Task("clustering", ("cluster/nmi", "max"), run)
