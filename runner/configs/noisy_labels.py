"""Method configs of runner/tasks/noisy_labels.py: CSOT and its Table 4 ablations."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from runner.augment import POLICIES, WEAK_VIEWS
from runner.checks import check_range
from runner.configs._base import MethodConfig, TaskEntry, register_method, register_task, variant
from runner.methods.csot import BUDGET_RULES

SELECTIONS = ("csot", "cot", "ot", "small_loss", "none")

TASK = register_task(
    TaskEntry(
        "noisy_labels",
        "runner.tasks.noisy_labels",
        evaluable=True,
        bench_presets=("csot_cifar100", "csot_webvision", "csot_clothing1m"),
        bench_baseline=("+method=ce",),
        bench_target=("allocation", 0.1),  # the solver's seconds as a share of the epoch's training
    )
)
# CSOT and its Table 4 ablations, each on each
PRESETS = ("csot_cifar10", "csot_cifar100", "csot_clothing1m", "csot_digits", "csot_webvision")
# a noisy-label method's hooks factory: runner.hooks.csot.NoisyLabelHooks's arguments (tasks/noisy_labels.py)
HOOKS = "runner.hooks.csot:NoisyLabelHooks"


@dataclass
class NoisyLabelConfig(MethodConfig):
    name: str = "csot"
    task: str = "noisy_labels"
    selection: Literal[SELECTIONS] = "csot"
    loss: Literal["paper", "simple"] = "paper"  # simple: CE on the selected and corrected samples
    warmup: int = 10  # epochs of CE on the noisy labels before the first selection
    warmup_batch_size: int = 0  # the warm-up epochs' batch (0: train.batch_size); the authors': 2 x 128
    # CSOT solver (runner.methods.csot.csot_plan)
    eps: float = 0.1
    kappa_p: float = 1.0
    kappa_l: float = 1.0
    outer_iters: int = 10
    inner_iters: int = 100
    solve_batch: int = 1024
    omega_p_input: Literal["softmax", "log_softmax"] = (
        "softmax"  # softmax (paper text) | log_softmax (authors' code, behind the tables)
    )
    feature_head: bool = True  # Linear(D, D) after the backbone, the classifier on top (the authors' Net)
    # curriculum: m from m0 to 1; curriculum_end = T_sup, the end of the supervised stage
    m0: float = 0.3
    curriculum_end: int = 250
    budget: Literal[BUDGET_RULES] = (
        "paper"  # paper: min(1, m0 + (t - 1)/(T_sup - 1)) | code: m0 at warm-up end, 1 at T_sup
    )
    # losses
    pl_threshold: float = 0.95
    sharpen_t: float = 0.5
    mixup_alpha: float = 4.0
    simsiam: bool = True  # SimSiam on the unlabeled batch (false: Table 4 (j))
    simsiam_hidden: int = 128
    correction: Literal["ot", "threshold"] = (
        "ot"  # stage-2 labels: ot (pseudo-labels of the plan) | threshold (Table 4 (i))
    )
    stage_switch: Literal["data", "epoch", "never"] = "data"  # never: Table 4 (h)
    asym_penalty: bool = True  # warm-up: add mean sum p log p under asymmetric noise (DivideMix)
    warmup_penalty: bool = False  # warm-up: add it whatever the noise (DivideMix's Clothing1M warm-up)
    gmm_threshold: float = 0.5  # small_loss selection
    strong_aug: Literal[POLICIES] = "autoaugment_cifar10"  # the strong view
    # the weak view of images: padded random crop + flip, or RandomResizedCrop + flip (DivideMix's WebVision)
    weak_view: Literal[WEAK_VIEWS] = "crop_flip"
    standardize: bool = False  # inputs to zero mean, unit variance per element (train statistics)

    def __post_init__(self):
        super().__post_init__()
        check_range("method.warmup", self.warmup, 0)
        check_range("method.warmup_batch_size", self.warmup_batch_size, 0)
        check_range("method.eps", self.eps, 0.0, lo_open=True)
        check_range("method.kappa_p", self.kappa_p, 0.0)
        check_range("method.kappa_l", self.kappa_l, 0.0)
        for key in ("outer_iters", "inner_iters", "solve_batch", "simsiam_hidden"):
            check_range(f"method.{key}", getattr(self, key), 1)
        check_range("method.m0", self.m0, 0.0, 1.0, lo_open=True)
        check_range("method.curriculum_end", self.curriculum_end, max(self.warmup, 1) + 1)
        check_range("method.pl_threshold", self.pl_threshold, 0.0, 1.0)
        check_range("method.sharpen_t", self.sharpen_t, 0.0, lo_open=True)
        check_range("method.mixup_alpha", self.mixup_alpha, 0.0, lo_open=True)
        check_range("method.gmm_threshold", self.gmm_threshold, 0.0, 1.0)


def _ablation(cls_name: str, doc: str, base: type = NoisyLabelConfig, **defaults) -> type:
    """A row of the paper's Table 4, registered: `base` with other defaults."""
    return register_method(hooks=HOOKS, presets=PRESETS)(variant(cls_name, base, doc, __name__, **defaults))


# fmt: off
CSOTConfig = _ablation("CSOTConfig", "CSOT: the curriculum and the structure terms.")
COTConfig = _ablation("COTConfig", "Curriculum OT without the structure terms (kappa = 0).",
                      name="cot", selection="cot", kappa_p=0.0, kappa_l=0.0)
OTConfig = _ablation("OTConfig", "Plain OT: neither curriculum (m = 1) nor structure terms.", COTConfig,
                     name="ot", selection="ot")
SOTConfig = _ablation("SOTConfig", "Structure-aware OT without the curriculum (m = 1; Table 4 (b)).",
                      name="sot", selection="ot")
SmallLossConfig = _ablation("SmallLossConfig", "DivideMix's selection: a 2-component GMM on sample losses.",
                            name="small_loss", selection="small_loss")
CEConfig = _ablation("CEConfig", "Cross-entropy on the noisy labels, no selection (the paper's CE row).",
                     name="ce", selection="none")
# fmt: on


METHODS = TASK.methods  # its methods by name, a view of the registry
