"""Method config of runner/tasks/hashing.py: hierarchically quantized hash codes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from runner.checks import ConfigError, check_range
from runner.configs._base import MethodConfig, TaskEntry, register_method, register_task
from runner.methods.hier_hash import LOSSES, SOLVERS

TABLES = ("test", "train")
BASELINES = ("th", "vq", "level1", "lsh", "dch")
INPUT_NORMS = ("dataset", "pixel_mean")
# list keys with one value, or one per entry of `ks`
PER_KS = ("beta", "margin", "npairs_l2", "level1_beta", "level1_margin", "level1_npairs_l2")

TASK = register_task(
    TaskEntry(
        "hashing",
        "runner.tasks.hashing",
        main_presets={  # the setting of hier_hash.yaml's defaults
            "cifar100": "hier_hash_cifar100_npairs",
            "imagenet32": "hier_hash_imagenet32_npairs",
            None: "hier_hash_synthetic",
        },
        bench_presets=("hier_hash_cifar100_npairs", "hier_hash_cifar100_triplet", "hier_hash_imagenet"),
        bench_target=("step", 1.2),  # over the preset's base embedding's step
    )
)
PRESETS = (
    "hier_hash_cifar100_npairs",
    "hier_hash_cifar100_triplet",
    "hier_hash_imagenet",
    "hier_hash_imagenet32_npairs",
    "hier_hash_imagenet32_triplet",
    "hier_hash_imagenetsplit",
    "hier_hash_synthetic",
)


@register_method(presets=PRESETS)
@dataclass
class HierHashConfig(MethodConfig):
    """Defaults: the paper's Cifar-100 N-pairs setting (70k iterations of 64 x 2, x0.3 after 20k)."""

    name: str = "hier_hash"
    task: str = "hashing"
    # codes: k levels of d, ks active buckets at the last level; energy weights (code units)
    d: int = 32
    k: int = 2
    ks: list[int] = field(default_factory=lambda: [1, 2, 3, 4])
    alpha: float = 100.0
    beta: list[float] = field(default_factory=lambda: [0.07, 0.1, 0.1, 0.1])  # one value or one per ks
    solver: Literal[SOLVERS] = "ssp"  # all exact; ssp: successive shortest paths in C, >= 3x OR-tools, ks 1-2
    cost_scale: float | None = None
    remap: bool = True
    # metric loss given codes
    loss: Literal[LOSSES] = "npairs"
    margin: list[float] = field(default_factory=lambda: [0.5])  # triplet; one value or one per ks
    npairs_l2: list[float] = field(default_factory=lambda: [0.03, 0.01, 0.003, 0.001])  # one or per ks
    # class-balanced batches and schedule
    classes_per_batch: int = 64
    per_class: int = 2
    iters: int = 70_000
    lr_head: float = 1e-3
    lr_backbone: float = 1e-4
    decay_at: list[int] = field(default_factory=lambda: [20_000])  # iterations after which lr *= decay
    decay: float = 0.3
    # base embedding (reranking, Th, VQ and LSH)
    base: Literal["pretrain", "raw"] = "pretrain"  # raw: the flattened inputs
    base_dim: int = 64
    base_loss: Literal[LOSSES] = "npairs"
    base_margin: float = 0.3
    base_l2: float = 0.003
    base_iters: int = 70_000
    base_lr: float = 1e-3
    base_checkpoint: str | None = None
    input_norm: Literal[INPUT_NORMS] = (
        "dataset"  # dataset: its normalisation | pixel_mean: x/255 - train mean image
    )
    # evaluation
    eval_k: list[int] = field(default_factory=lambda: [1, 4, 16])
    tables: list[Literal[TABLES]] = field(default_factory=lambda: ["test", "train"])
    baselines: list[Literal[BASELINES]] = field(default_factory=lambda: ["th", "vq"])  # level1: [11]
    vq_centroids: list[int] = field(default_factory=list)  # empty: [d, d^k]
    # the splits whose base embedding VQ's k-means runs on: train -> rows VQ-<n> (ImageNetSplit's
    # VQ-train), test -> rows VQ-test-<n> (its VQ-test: centroids of the unseen classes)
    vq_fit: list[Literal[TABLES]] = field(default_factory=lambda: ["train"])
    level1_d: list[int] = field(default_factory=list)  # [11]: empty: [d*k], equal output count
    level1_beta: list[float] = field(default_factory=lambda: [0.3])  # [11]'s own (ICML18 Cifar N-pairs)
    level1_margin: list[float] = field(default_factory=lambda: [1.0])
    level1_npairs_l2: list[float] = field(default_factory=lambda: [0.003])
    lsh_bits: list[int] = field(default_factory=list)  # empty: [log2(d*k)] (2^n = dk buckets, as the paper)
    # Deep Cauchy Hashing (Cao et al. 2018): n-bit nets trained as the hash nets; gamma and the quantization
    # weight are not in the hashing paper (DCH's own paper cross-validates them)
    dch_bits: list[int] = field(default_factory=list)  # empty: [log2(d*k)], as LSH
    dch_gamma: float = 20.0
    dch_quantization: float = 0.1
    eval_every: float = 0.0  # epochs between validation Pr@1 checks (best kept); 0: never
    log_every: int = 100
    checkpoint_every: int = 2000

    def __post_init__(self):
        super().__post_init__()

        def bad(key, value, allowed):  # list-valued keys; scalars go through check_range/check_choice
            raise ConfigError(f"method.{key}={value!r}: must be {allowed}")

        check_range("method.d", self.d, 2)
        check_range("method.k", self.k, 1)
        if not self.ks or not all(1 <= s <= self.d for s in self.ks):
            bad("ks", self.ks, f"a non-empty list of ints in [1, d={self.d}]")
        check_range("method.alpha", self.alpha, 0.0)
        for key in PER_KS:
            values = getattr(self, key)
            if len(values) not in (1, len(self.ks)) or min(values) < 0:
                bad(key, values, f"one value >= 0, or one per ks ({len(self.ks)})")
        if self.cost_scale is not None:  # null: automatic
            check_range("method.cost_scale", self.cost_scale, 0.0, lo_open=True)
        check_range("method.classes_per_batch", self.classes_per_batch, 2)
        if self.per_class < 2 or ("npairs" in (self.loss, self.base_loss) and self.per_class != 2):
            bad("per_class", self.per_class, ">= 2, and exactly 2 with the N-pairs loss")
        check_range("method.iters", self.iters, 1)
        check_range("method.lr_head", self.lr_head, 0.0, lo_open=True)
        for key in ("lr_backbone", "eval_every", "base_margin", "base_l2"):
            check_range(f"method.{key}", getattr(self, key), 0.0)
        if self.decay_at != sorted(self.decay_at) or min(self.decay_at, default=1) < 1:
            bad("decay_at", self.decay_at, "ascending iterations >= 1")
        check_range("method.decay", self.decay, 0.0, 1.0, lo_open=True)
        if self.base == "pretrain":
            check_range("method.base_dim", self.base_dim, 1)
            check_range("method.base_iters", self.base_iters, 1)
            check_range("method.base_lr", self.base_lr, 0.0, lo_open=True)
        if not self.eval_k or min(self.eval_k) < 1:
            bad("eval_k", self.eval_k, "a non-empty list of ints >= 1")
        if not self.tables:
            bad("tables", self.tables, f"a non-empty subset of {list(TABLES)}")
        if "vq" in self.baselines and not self.vq_fit:
            bad("vq_fit", self.vq_fit, f"a non-empty subset of {list(TABLES)}")
        if self.vq_centroids and min(self.vq_centroids) < max(self.ks):
            bad("vq_centroids", self.vq_centroids, f"ints >= max(ks)={max(self.ks)}")
        if self.level1_d and min(self.level1_d) < max(self.ks):
            bad("level1_d", self.level1_d, f"ints >= max(ks)={max(self.ks)}")
        for key in ("lsh_bits", "dch_bits"):
            if getattr(self, key) and not all(1 <= n <= 20 for n in getattr(self, key)):
                bad(key, getattr(self, key), "ints in [1, 20]")
        check_range("method.dch_gamma", self.dch_gamma, 0.0, lo_open=True)
        check_range("method.dch_quantization", self.dch_quantization, 0.0)
        check_range("method.log_every", self.log_every, 1)
        check_range("method.checkpoint_every", self.checkpoint_every, 1)


METHODS = TASK.methods  # its methods by name, a view of the registry
