"""Learning with noisy labels: CSOT (Chang et al., NeurIPS 2023) and its baselines.

    runner +method=csot dataset=digits dataset.label_noise.kind=symmetric dataset.label_noise.rate=0.5
    runner +method=csot +experiment=csot_cifar100 dataset.label_noise.rate=0.5     (GPU, paper scale)
    runner -m +method=ce,small_loss,ot,cot,csot +experiment=csot_digits seed=0,1,2

The training labels are the noisy ones the foundation's `load_data` injects (`dataset.label_noise`);
`y_clean` is used only to score the selection. The network is the authors' `Net`: the backbone, a
Linear(D, D) `head`, and the classifier on the head's output, so the features of the structure terms
and of SimSiam are the ones the classifier is trained on (`feature_head=false`: no head).

After `warmup` epochs of cross-entropy on the noisy labels (weakly augmented, in batches of
`warmup_batch_size`, as the authors' warm-up loader: 2 x 128 on CIFAR), every epoch starts with a
selection pass: the network (eval mode, no augmentation) gives
softmax outputs and features for the whole training set, and a method splits it into

    clean       selected and the given label agrees: keep the label, with confidence w
    corrected   selected and the pseudo-label differs: relabelled (used confidently, see below)
    unlabeled   everything not clean

Selections (`method.selection`):

    csot        CSOT plan per random chunk of `solve_batch` (runner.methods.csot.allocate): budget
                m(epoch) from m0 to 1 (`budget`: the paper's or the code's ramp, T_sup =
                `curriculum_end`), structure weights kappa_p, kappa_l
    cot         the same without structure terms (kappa = 0): curriculum OT
    ot          m = 1: plain OT relabelling (kappa = 0), or structure-aware OT (method `sot`, kappa = 1)
    small_loss  DivideMix: a 2-component GMM on the per-sample losses, clean = p(clean) > gmm_threshold,
                w = p(clean); nothing corrected
    none        (method `ce`) cross-entropy on the noisy labels throughout

Training after the warm-up, as the paper and DivideMix: two loaders, a clean (labeled) batch and an
unlabeled batch of `train.batch_size` each per step, both shuffled; the epoch runs for the longer loader
(drop_last) and the shorter one restarts (`runner.data.samplers.PoolBatches`). The hooks, losses and
GMM baseline are in `runner.hooks.csot`, the network in `runner.models.noisy_labels`.

Losses (`method.loss`):

    paper   the CSOT code's. Labeled batch: two weak views and one strong view; L_mix (mixup of the
            weak views, lambda ~ Beta(alpha, alpha) folded to >= 1/2, targets sharpen(w onehot(y) +
            (1 - w) mean softmax(weak views), T)) plus the uniform-prior penalty, and L_lab (CE of the
            strong view against w t + (1 - w) softmax(weak)). Unlabeled batch (a weak and a strong
            view): SimSiam (`simsiam`), and from stage 2 on the pseudo-label loss: CE of the strong view
            against the pseudo-label of corrected samples with softmax(weak)[pseudo] >= pl_threshold
            (`correction=threshold`: FixMatch's argmax of softmax(weak) >= pl_threshold instead).
            Stage 2 starts at t = T_sup (`stage_switch=epoch`), on the first epoch with more corrected
            than unselected samples or at T_sup (`data`, the code's latch), or never (`never`).
    simple  CE on the labeled batch with its labels plus CE on the corrected samples of the unlabeled
            batch whose prediction of the pseudo-label exceeds pl_threshold (the digest's CPU study).

Table 4 ablations: (a) `+method=ot`, (b) `+method=sot`, (c) `+method=cot`, (d)/(e) `method.kappa_p=0` /
`method.kappa_l=0`, (f) `+method=small_loss`, (g) `method.loss=simple`, (h) `method.stage_switch=never`,
(i) `method.correction=threshold`, (j) `method.simsiam=false`.

With `dataset.epoch_samples` (the Clothing1M preset: 64,000) each epoch draws a fresh class-balanced
sample of the noisy training set (`runner.data.samplers.EpochSample`, a function of the seed and the
epoch), as DivideMix: the warm-up trains on it, the selection pass and the pools are its samples.

Logged per epoch: `select/precision`, `select/recall` (clean set against the true clean labels),
`select/corrected_acc`, `select/m`, set sizes, `select/solver_s`; plus train/val/test accuracy.
Under DDP (`hardware=ddp`) the losses forward through the DDP-wrapped network, the selection pass is
sharded over the ranks and gathered, rank 0 selects and broadcasts its selection, and every rank takes
its shard of each global batch of the two loaders.
"""

from __future__ import annotations

from runner.checks import ConfigError
from runner.configs import hooks_factory
from runner.configs.noisy_labels import METHODS  # noqa: F401  (runner.schema and tests read it here)
from runner.data import load_data
from runner.data.builtin import CIFAR_STATS
from runner.data.files import IMAGENET_STATS, FileSplit
from runner.data.views import Views
from runner.hooks import check_batch
from runner.models import build_model
from runner.models.noisy_labels import NoisyLabelNet
from runner.task import Task
from runner.train import fit


def smoke(cfg) -> None:
    """`+debug=smoke`: select from the first epoch on, so a smoke run exercises the selection and the
    two-loader losses; an epoch sample at most the smoke run's training subset."""
    cfg.method.warmup = 0
    cfg.dataset.epoch_samples = min(cfg.dataset.epoch_samples, cfg.dataset.max_train)


def network(cfg, data):
    """The run's network for `data`, which `method.standardize` standardises in place first (by the
    training split's statistics): what `run` trains and `runner-eval` loads a checkpoint into."""
    method = cfg.method
    if method.standardize:
        if not hasattr(data.train, "x"):
            raise ConfigError(
                f"method.standardize=true needs an in-memory dataset; {cfg.dataset.name} is file-backed"
            )
        mean, std = data.train.x.mean(0), data.train.x.std(0).clamp(min=1e-3)
        for split in (data.train, data.val, data.test):
            split.x = (split.x - mean) / std
    selecting = method.selection != "none"
    return NoisyLabelNet(
        build_model(cfg.model, data.input_shape, data.num_classes),
        head=method.feature_head and selecting,
        predictor_hidden=method.simsiam_hidden if selecting and method.loss == "paper" else None,
    )


def run(cfg, ctx) -> dict:
    method = cfg.method
    data = load_data(cfg.dataset, cfg.seed)
    model = network(cfg, data)
    if model.predictor is not None:  # a BatchNorm over each step's batch, in the warm-up too
        why = f"method={method.name}'s SimSiam predictor (a BatchNorm over the batch)"
        sizes = {"train.batch_size": cfg.train.batch_size}
        sizes["method.warmup_batch_size"] = method.warmup_batch_size
        for key, size in sizes.items():
            if size:  # warmup_batch_size 0: train.batch_size
                check_batch(key, size, ctx, len(data.train), 2, why, cfg.train.accumulate)
    file_backed = isinstance(data.train, FileSplit)  # normalised with the ImageNet statistics
    mean, std = CIFAR_STATS.get(cfg.dataset.name, IMAGENET_STATS if file_backed else (None, None))
    pad = data.meta.get("crop_pad", 4)
    views = Views(data.input_shape, mean, std, pad, method.strong_aug, method.weak_view)
    asymmetric = cfg.dataset.label_noise.kind == "asymmetric"
    hooks = hooks_factory(method.name)(  # runner.hooks.csot.NoisyLabelHooks
        method, model, data, ctx, views, asymmetric, cfg.seed, cfg.train.batch_size, cfg.dataset.epoch_samples
    )
    summary = fit(model, data, cfg.train, ctx, hooks, augment="none")  # the hooks make the views
    if data.meta.get("clean_train_labels", True):
        summary["train/label_noise"] = float((data.train.y != data.train.y_clean).float().mean())
    return summary | hooks.last_stats


TASK = Task("noisy_labels", ("test/acc", "max"), run, smoke=smoke, network=network)
