"""Method configs of runner/tasks/clustering.py: k-means, DB-OT and balanced-OT clustering."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from runner.checks import check_range
from runner.configs._base import MethodConfig, TaskEntry, register_method, register_task
from runner.methods.dbot import SOLVERS

TASK = register_task(TaskEntry("clustering", "runner.tasks.clustering"))
# DB-OT clustering's settings (its mass bounds): k-means and balanced clustering have none of them
DBOT_PRESETS = ("dbot_cluster_blobs", "dbot_cluster_digits")


@dataclass
class ClusterConfig(MethodConfig):
    name: str = "kmeans"
    task: str = "clustering"
    k: int = 0  # number of clusters; 0: the dataset's (meta n_clusters, else num_classes)
    split: Literal["train", "test", "all"] = "all"
    per_class: int = 0  # > 0: only the first per_class samples of each class
    features: Literal["raw", "net"] = "raw"  # net: embeddings of `model` trained on the train split
    standardize: bool = False  # z-score each feature before clustering
    plot: bool = True

    def __post_init__(self):
        super().__post_init__()
        check_range("method.k", self.k, 0)
        check_range("method.per_class", self.per_class, 0)


@register_method()
@dataclass
class KMeansConfig(ClusterConfig):
    name: str = "kmeans"
    n_init: int = 10

    def __post_init__(self):
        super().__post_init__()
        check_range("method.n_init", self.n_init, 1)


@register_method(presets=DBOT_PRESETS)
@dataclass
class DBOTClusterConfig(ClusterConfig):
    name: str = "dbot_cluster"
    tau: float = 0.3  # cluster masses in [(1 - tau) / K, (1 + tau) / K]
    eps: float = 0.05  # entropic regularisation, relative to the median squared distance
    outer_iters: int = 20
    init: Literal["kmeans++", "random"] = "kmeans++"
    hard_assign: bool = True  # centroids from argmax-masked plans (false: the paper's "no reweighting")
    assign: Literal["argmax", "rounded"] = (
        "argmax"  # argmax (paper) | rounded (hard counts within the bounds)
    )
    solver: Literal[SOLVERS] = "dual"  # log domain: eps is small
    max_iter: int = 1000
    tol: float = 1e-6

    def __post_init__(self):
        super().__post_init__()
        check_range("method.tau", self.tau, 0.0, 1.0, hi_open=True)
        check_range("method.eps", self.eps, 0.0, lo_open=True)
        check_range("method.outer_iters", self.outer_iters, 1)
        check_range("method.max_iter", self.max_iter, 1)
        check_range("method.tol", self.tol, 0.0, lo_open=True)


@register_method()
@dataclass
class BalancedClusterConfig(DBOTClusterConfig):
    """Plain balanced-OT clustering: DB-OT with tau = 0 (every cluster mass exactly 1/K)."""

    name: str = "balanced_cluster"
    tau: float = 0.0

    def __post_init__(self):
        super().__post_init__()
        check_range("method.tau", self.tau, 0.0, 0.0)


METHODS = TASK.methods  # its methods by name, a view of the registry
