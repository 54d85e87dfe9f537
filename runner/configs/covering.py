"""Method config of runner/tasks/covering.py: partial Wasserstein covering (PWC) and its baselines."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from runner.checks import ConfigError, check_range
from runner.configs._base import MethodConfig, TaskEntry, register_method, register_task
from runner.methods.pwc import BASELINES, BATCHED, PW_METHODS

# PWC trains the same network for every selector: its bench-gpu baseline picks at random.
TASK = register_task(TaskEntry("covering", "runner.tasks.covering", bench_presets=("pwc_cifar10",),
                               bench_baseline=("method.selector=random",)))  # fmt: skip


@register_method(presets=("pwc_cifar10", "pwc_digits", "pwc_mixture2d", "pwc_optimality"))
@dataclass
class CoverConfig(MethodConfig):
    name: str = "pwc"
    task: str = "covering"
    selector: Literal[PW_METHODS + BASELINES] = "ctrans"
    # mixture2d: 2-D Gaussians with a missing mode; normal2d: app and dev from N(0, I_2) (the paper's
    # section 5.1); both leave the dataset unused
    scenario: Literal["dataset", "mixture2d", "normal2d"] = "dataset"
    k: int = 30
    n_app: int = 300
    n_dev: int = 300
    missing_class: int = 0  # dataset: the class made rare in dev
    dev_share: float = 0.005  # share of the missing pattern in dev (0: absent)
    app_share: float = 0.2  # mixture2d: share of mode C in app (before outliers; digest E1: 0.3)
    outliers: float = 0.02  # mixture2d: share of app drawn uniformly from the box
    features: Literal["raw", "net"] = "raw"  # net: embeddings of `model`, trained here or loaded
    checkpoint: str = ""  # features=net: embed with this runner checkpoint instead of training
    batch: int = 1  # picks per LP (> 1: an extension beyond the paper)
    eta: float = 1e-6  # sensitivity / entropic: relative mass of unselected candidates
    reg: float = 0.01  # entropic: eps in cost units (the paper's), or a fraction of PW({}) (reg_relative)
    reg_relative: bool = False
    max_iter: int = 50_000  # entropic sweeps (the paper's cap)
    tol: float = 1e-6  # entropic L1 row-marginal tolerance
    mip_gap: float = 1e-6  # milp: HiGHS relative gap
    plot: bool = True
    # also solve the exact optimum (the MILP, HiGHS) and report cover/approx_ratio = phi(S_K) / phi(S*_K),
    # phi(S) = PW({}) - PW(S) (the paper's Fig. 3)
    optimum: bool = False

    def __post_init__(self):
        super().__post_init__()
        check_range("method.n_app", self.n_app, 1)
        check_range("method.n_dev", self.n_dev, 1)
        check_range("method.k", self.k, 1)
        if self.k > self.n_app:
            raise ConfigError(
                f"method.k={self.k} is out of range; must be in [1, {self.n_app}]: k picks are drawn from "
                f"the method.n_app={self.n_app} application candidates (or set method.n_app>={self.k})"
            )
        check_range("method.missing_class", self.missing_class, 0)
        check_range("method.dev_share", self.dev_share, 0.0, 1.0, hi_open=True)
        check_range("method.app_share", self.app_share, 0.0, 1.0, hi_open=True)
        check_range("method.outliers", self.outliers, 0.0, 1.0, hi_open=True)
        if self.selector == "entropy" and self.scenario != "dataset":
            raise ConfigError(
                f"method.selector=entropy needs a dataset to train a classifier on; not {self.scenario}"
            )
        check_range("method.batch", self.batch, 1)
        if self.batch > 1 and self.selector not in BATCHED:
            raise ConfigError(f"method.batch={self.batch}: only {', '.join(BATCHED)} pick in batches")
        check_range("method.eta", self.eta, 0.0, 1.0, lo_open=True)
        check_range("method.reg", self.reg, 0.0, lo_open=True)
        check_range("method.max_iter", self.max_iter, 1)
        check_range("method.tol", self.tol, 0.0, lo_open=True)
        check_range("method.mip_gap", self.mip_gap, 0.0)


METHODS = TASK.methods  # its methods by name, a view of the registry
