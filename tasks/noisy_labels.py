"""Learning with noisy labels: CSOT (Chang et al., NeurIPS 2023) and its baselines.

    runner +method=csot dataset=digits dataset.label_noise.kind=symmetric dataset.label_noise.rate=0.5
    runner +method=csot +experiment=csot_cifar100 dataset.label_noise.rate=0.5     (GPU, paper scale)
    runner -m +method=ce,small_loss,ot,cot,csot +experiment=csot_digits seed=0,1,2

The training labels are the noisy ones the foundation's `load_data` injects (`dataset.label_noise`);
`y_clean` is used only to score the selection. The network is the authors' `Net`: the backbone, a
Linear(D, D) `head`, and the classifier on the head's output, so the features of the structure terms
and of SimSiam are the ones the classifier is trained on (`feature_head=false`: no head).

After `warmup` epochs of cross-entropy on the noisy labels (weakly augmented, as the authors' warm-up
loader), every epoch starts with a selection pass: the network (eval mode, no augmentation) gives
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
unlabeled batch of `train.batch_size` each per step, both shuffled and cycled (see `PoolBatches`).

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

Logged per epoch: `select/precision`, `select/recall` (clean set against the true clean labels),
`select/corrected_acc`, `select/m`, set sizes, `select/solver_s`; plus train/val/test accuracy.
Under DDP (`hardware=ddp`) the losses forward through the DDP-wrapped network, the selection pass is
sharded over the ranks and gathered, rank 0 selects and broadcasts its selection, and every rank takes
its shard of each global batch of the two loaders.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from runner.augment import POLICIES, PolicyAugment, cutout, shift
from runner.data import load_data
from runner.distributed_passes import broadcast_from_main, predict_all
from runner.methods.csot import BUDGET_RULES, allocate, curriculum_budget
from runner.models import build_model
from runner.schema import ConfigError, check_choice, check_range
from runner.train import augment_crop_flip, batches, fit, soft_cross_entropy

METRIC = ("test/acc", "max")
SELECTIONS = ("csot", "cot", "ot", "small_loss", "none")


@dataclass
class NoisyLabelConfig:
    name: str = "csot"
    task: str = "noisy_labels"
    selection: str = "csot"
    loss: str = "paper"  # paper | simple
    warmup: int = 10  # epochs of CE on the noisy labels before the first selection
    # CSOT solver (runner.methods.csot.csot_plan)
    eps: float = 0.1
    kappa_p: float = 1.0
    kappa_l: float = 1.0
    outer_iters: int = 10
    inner_iters: int = 100
    solve_batch: int = 1024
    omega_p_input: str = "softmax"  # softmax (paper text) | log_softmax (authors' code, behind the tables)
    feature_head: bool = True  # Linear(D, D) after the backbone, the classifier on top (the authors' Net)
    # curriculum: m from m0 to 1; curriculum_end = T_sup, the end of the supervised stage
    m0: float = 0.3
    curriculum_end: int = 250
    budget: str = "paper"  # paper: min(1, m0 + (t - 1)/(T_sup - 1)) | code: m0 at warm-up end, 1 at T_sup
    # losses
    pl_threshold: float = 0.95
    sharpen_t: float = 0.5
    mixup_alpha: float = 4.0
    simsiam: bool = True  # SimSiam on the unlabeled batch (false: Table 4 (j))
    simsiam_hidden: int = 128
    correction: str = "ot"  # stage-2 labels: ot (pseudo-labels of the plan) | threshold (Table 4 (i))
    stage_switch: str = "data"  # data | epoch | never (Table 4 (h))
    asym_penalty: bool = True  # warm-up: add mean sum p log p under asymmetric noise (DivideMix)
    gmm_threshold: float = 0.5  # small_loss selection
    strong_aug: str = (
        "autoaugment_cifar10"  # strong view: autoaugment_cifar10 | autoaugment_imagenet | randaugment
    )
    strong_groups: int = 8  # AutoAugment / RandAugment: one draw per group of samples in a batch
    standardize: bool = False  # inputs to zero mean, unit variance per element (train statistics)

    def __post_init__(self):
        check_choice("method.selection", self.selection, SELECTIONS)
        check_choice("method.loss", self.loss, ("paper", "simple"))
        check_choice("method.omega_p_input", self.omega_p_input, ("softmax", "log_softmax"))
        check_choice("method.budget", self.budget, BUDGET_RULES)
        check_choice("method.correction", self.correction, ("ot", "threshold"))
        check_choice("method.strong_aug", self.strong_aug, POLICIES)
        check_choice("method.stage_switch", self.stage_switch, ("data", "epoch", "never"))
        check_range("method.warmup", self.warmup, 0)
        check_range("method.eps", self.eps, 0.0, lo_open=True)
        check_range("method.kappa_p", self.kappa_p, 0.0)
        check_range("method.kappa_l", self.kappa_l, 0.0)
        for key in ("outer_iters", "inner_iters", "solve_batch", "simsiam_hidden", "strong_groups"):
            check_range(f"method.{key}", getattr(self, key), 1)
        check_range("method.m0", self.m0, 0.0, 1.0, lo_open=True)
        check_range("method.curriculum_end", self.curriculum_end, max(self.warmup, 1) + 1)
        check_range("method.pl_threshold", self.pl_threshold, 0.0, 1.0)
        check_range("method.sharpen_t", self.sharpen_t, 0.0, lo_open=True)
        check_range("method.mixup_alpha", self.mixup_alpha, 0.0, lo_open=True)
        check_range("method.gmm_threshold", self.gmm_threshold, 0.0, 1.0)


@dataclass
class CSOTConfig(NoisyLabelConfig):
    pass


@dataclass
class COTConfig(NoisyLabelConfig):
    name: str = "cot"
    selection: str = "cot"
    kappa_p: float = 0.0
    kappa_l: float = 0.0


@dataclass
class OTConfig(COTConfig):
    name: str = "ot"
    selection: str = "ot"


@dataclass
class SOTConfig(NoisyLabelConfig):
    name: str = "sot"
    selection: str = "ot"


@dataclass
class SmallLossConfig(NoisyLabelConfig):
    name: str = "small_loss"
    selection: str = "small_loss"


@dataclass
class CEConfig(NoisyLabelConfig):
    name: str = "ce"
    selection: str = "none"


METHODS = {c.name: c for c in (CSOTConfig, COTConfig, OTConfig, SOTConfig, SmallLossConfig, CEConfig)}


def smoke(cfg) -> None:
    """`+debug=smoke`: select from the first epoch on, so a smoke run exercises the selection and the
    two-loader losses."""
    cfg.method.warmup = 0


# ----------------------------------------------------------------------------- network


class NoisyLabelNet(nn.Module):
    """The authors' `Net`: backbone features -> `head` (Linear(D, D), or identity) -> `classifier`.

    `forward(x)` gives logits; `forward(x, ssl=True)` gives (logits, z, p) with z the head output and
    p the SimSiam predictor's output (D -> hidden, BN, ReLU -> D; no projector, as the authors).
    `forward_features` is the head output, the feature of the structure terms.
    """

    def __init__(self, backbone: nn.Module, head: bool, predictor_hidden: int | None):
        super().__init__()
        dim = self.feature_dim = backbone.feature_dim
        self.classifier = backbone.classifier
        backbone.classifier = nn.Identity()  # the classifier reads the head's output
        self.backbone = backbone
        self.head = nn.Linear(dim, dim) if head else nn.Identity()
        self.predictor = None
        if predictor_hidden:
            self.predictor = nn.Sequential(
                nn.Linear(dim, predictor_hidden, bias=False),
                nn.BatchNorm1d(predictor_hidden),
                nn.ReLU(inplace=True),
                nn.Linear(predictor_hidden, dim),
            )

    def forward_features(self, x):
        return self.head(self.backbone.forward_features(x))

    def forward(self, x, ssl: bool = False):
        z = self.forward_features(x)
        logits = self.classifier(z)
        return (logits, z, self.predictor(z)) if ssl else logits


# ----------------------------------------------------------------------------- views


class Views:
    """Weak and strong augmentations of a batch on its device.

    Images of side >= 16: weak = crop (zero padding `pad`) + flip; strong = weak + `policy`
    (`runner.augment.PolicyAugment`: AutoAugment's CIFAR-10 or ImageNet policy, or RandAugment, one draw
    per group of `groups`). Smaller images (digits): weak = shift by up to one pixel; strong = weak + a
    3x3 cutout + Gaussian noise (0.1). Flat inputs: weak = Gaussian noise (0.05), strong = noise (0.2)
    and 20% feature dropout.
    """

    def __init__(self, input_shape, groups=8, mean=None, std=None, pad=4, policy="autoaugment_cifar10"):
        self.kind = "flat" if len(input_shape) != 3 else ("large" if input_shape[1] >= 16 else "small")
        self.pad = pad
        if self.kind == "large":
            c = input_shape[0]
            self.policy = PolicyAugment(policy, mean or [0.0] * c, std or [1.0] * c, groups)

    def weak(self, x):
        if self.kind == "large":
            return augment_crop_flip(x, self.pad)
        if self.kind == "small":
            return shift(x, 1)
        return x + 0.05 * torch.randn_like(x)

    def strong(self, x):
        x = self.weak(x)
        if self.kind == "large":
            return self.policy(x)
        if self.kind == "small":
            return cutout(x, 3) + 0.1 * torch.randn_like(x)
        return (x + 0.2 * torch.randn_like(x)) * (torch.rand_like(x) > 0.2)


# ----------------------------------------------------------------------------- two loaders


def pool_batches(pool: torch.Tensor, steps: int, batch_size: int, generator: torch.Generator) -> torch.Tensor:
    """(steps, batch_size) global index batches drawn from `pool` as a shuffled loader that is re-shuffled
    and restarted whenever it runs out (the shorter loader of the paper cycles): consecutive fresh
    permutations of the pool, cut into batches. A pool smaller than a batch repeats within it."""
    need = steps * batch_size
    cycles = -(-need // len(pool))
    order = torch.cat([pool[torch.randperm(len(pool), generator=generator)] for _ in range(cycles)])
    return order[:need].view(steps, batch_size)


class PoolBatches:
    """This rank's stream of one loader's batches for an epoch: the rank's interleaved shard of every
    global batch of `pool_batches`, read through `runner.train.batches` without augmentation (the losses
    make their own views)."""

    def __init__(self, split, ctx, global_batches: torch.Tensor):
        shards = list(global_batches[:, ctx.rank :: ctx.world_size])
        self._it = iter(batches(split, ctx, shards))
        self.left = len(shards)

    def next(self):
        if not self.left:
            raise RuntimeError("the CSOT loaders ran out: fit took more steps than len(train) // batch_size")
        self.left -= 1
        x, idx = next(self._it)
        return x, idx.to(x.device)


# ----------------------------------------------------------------------------- selection and losses


class NoisyLabelHooks:
    """`runner.train.fit` hooks: the selection at each epoch start, the method's loss per batch."""

    def __init__(self, cfg, model, data, ctx, views, asymmetric, seed, batch_size):
        self.cfg, self.model, self.ctx, self.views = cfg, model, ctx, views
        self.num_classes = data.num_classes
        self.penalty = cfg.asym_penalty and asymmetric
        self.seed, self.batch_size = seed, batch_size
        self.train_split = data.train
        n, device = len(data.train), ctx.device
        self.labels = data.train.y.to(device)
        self.clean = torch.zeros(n, dtype=torch.bool, device=device)
        self.corrected = torch.zeros(n, dtype=torch.bool, device=device)
        self.pseudo = self.labels.clone()
        self.weight = torch.ones(n, device=device)
        self.selecting = False  # a selection has been made (warm-up over)
        self.stage2 = False
        self.loaders = None  # (labeled, unlabeled) PoolBatches of the epoch, None for an empty pool

    # --- per epoch -------------------------------------------------------------------------

    @torch.no_grad()
    def on_epoch_start(self, epoch, model, data):
        cfg = self.cfg
        if cfg.selection == "none" or epoch < cfg.warmup:
            return
        probs, feats = self._outputs(data.train)  # every rank: its shard, gathered
        y = data.train.y.numpy()
        # Rank 0 selects, every rank trains on its selection.
        selection = self._select(epoch, probs, feats, y) if self.ctx.is_main else None
        clean, corrected, pseudo, weight, m, solver_s = broadcast_from_main(selection)
        unselected = ~(clean | corrected)
        at_t_sup = epoch + 1 >= cfg.curriculum_end  # the paper's t = epoch + 1 reaches T_sup
        if cfg.stage_switch == "never":
            self.stage2 = False
        elif cfg.stage_switch == "epoch":
            self.stage2 = at_t_sup
        else:  # the code's latch
            self.stage2 = self.stage2 or corrected.sum() > unselected.sum() or at_t_sup
        device = self.ctx.device
        self.clean = torch.as_tensor(clean, device=device)
        self.corrected = torch.as_tensor(corrected, device=device)
        self.pseudo = torch.as_tensor(pseudo, dtype=torch.long, device=device)
        self.weight = torch.as_tensor(weight, dtype=torch.float32, device=device)
        self.selecting = True
        self.loaders = self._loaders(epoch)
        y_clean = data.train.y_clean.numpy() if data.meta.get("clean_train_labels", True) else None
        stats = selection_stats(clean, corrected, pseudo, y, y_clean)
        stats |= {"select/m": m, "select/solver_s": solver_s, "select/stage2": float(self.stage2)}
        self.last_stats = stats
        self.ctx.tracker.log(stats, step=epoch)

    @torch.no_grad()
    def _select(self, epoch, probs, feats, y):
        """(clean, corrected, pseudo-labels, confidences w, budget m, solver seconds), numpy arrays."""
        cfg = self.cfg
        start = time.perf_counter()
        if cfg.selection == "small_loss":
            m = float("nan")
            p_true = _numpy(probs)[np.arange(len(y)), y]
            p_clean = _gmm_clean_probability(-np.log(np.maximum(p_true, 1e-12)))
            clean, weight = p_clean > cfg.gmm_threshold, p_clean
            pseudo, corrected = y.copy(), np.zeros(len(y), dtype=bool)
        else:
            m = (
                1.0
                if cfg.selection == "ot"
                else curriculum_budget(epoch, cfg.warmup, cfg.curriculum_end, cfg.m0, cfg.budget)
            )
            labels = y if isinstance(probs, np.ndarray) else self.labels
            pseudo, weight, selected = map(_numpy, allocate(
                probs, feats, labels, m, solve_batch=cfg.solve_batch, seed=self.seed * 100_003 + epoch,
                eps=cfg.eps, kappa_p=cfg.kappa_p, kappa_l=cfg.kappa_l, outer_iters=cfg.outer_iters,
                inner_iters=cfg.inner_iters, omega_p_input=cfg.omega_p_input,
            ))  # fmt: skip
            clean, corrected = selected & (pseudo == y), selected & (pseudo != y)
        return clean, corrected, pseudo, weight, m, time.perf_counter() - start

    def _loaders(self, epoch):
        """The epoch's labeled (clean) and unlabeled (the rest) loaders: len(train) // batch_size steps
        (fit's epoch), the same global batches on every rank."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        steps = max(1, len(self.clean) // self.batch_size)
        pools = (self.clean.cpu().nonzero()[:, 0], (~self.clean.cpu()).nonzero()[:, 0])
        return tuple(
            PoolBatches(self.train_split, self.ctx, pool_batches(pool, steps, self.batch_size, g))
            if len(pool)
            else None
            for pool in pools
        )

    @torch.no_grad()
    def _outputs(self, split):
        """Softmax outputs and structure features (float64) of the training set, no augmentation:
        numpy on CPU, tensors on the device otherwise (the CSOT solver runs on either)."""
        feats = predict_all(self.model, split, self.ctx, features=True)
        classifier, device = self.model.classifier, self.ctx.device
        probs = torch.cat([
            F.softmax(classifier(part.to(device)).double(), dim=1) for part in feats.split(65_536)
        ])  # fmt: skip
        if device.type == "cpu":
            return probs.numpy(), feats.double().numpy()
        return probs, feats.to(device, torch.float64)

    # --- per batch -------------------------------------------------------------------------

    def loss(self, net, x, y_soft, idx, epoch):
        if not self.selecting:  # warm-up (or plain CE): CE on the noisy labels of fit's batch, weak view
            return self._warmup_loss(net, self.views.weak(x), y_soft)
        labeled, unlabeled = (loader.next() if loader else None for loader in self.loaders)
        if self.cfg.loss == "simple":
            return self._simple_loss(net, labeled, unlabeled)
        return self._paper_loss(net, labeled, unlabeled)

    def _warmup_loss(self, net, x, y_soft):
        if self.model.predictor is None:
            logits, anchor = net(x), 0.0
        else:
            logits, _, p = net(x, ssl=True)
            anchor = _ddp_anchor(p)
        loss = soft_cross_entropy(logits, y_soft)
        if self.penalty:
            loss = loss + (F.softmax(logits, dim=1) * F.log_softmax(logits, dim=1)).sum(1).mean()
        return loss + anchor

    def _simple_loss(self, net, labeled, unlabeled):
        loss = 0.0
        if labeled is not None:
            x, idx = labeled
            loss = F.cross_entropy(net(x), self.labels[idx])
        if unlabeled is not None:
            x, idx = unlabeled
            logits = net(x)
            pseudo = self.pseudo[idx]
            conf = F.softmax(logits.detach(), dim=1).gather(1, pseudo[:, None])[:, 0]
            use = self.corrected[idx] & (conf > self.cfg.pl_threshold)
            loss = loss + (F.cross_entropy(logits, pseudo, reduction="none") * use).mean()
        return loss

    def _paper_loss(self, net, labeled, unlabeled):
        cfg, k, views = self.cfg, self.num_classes, self.views
        loss = 0.0
        if labeled is not None:
            x, idx = labeled
            weak1, weak2, strong = views.weak(x), views.weak(x), views.strong(x)
            w = self.weight[idx][:, None]
            with torch.no_grad():
                p_weak = F.softmax(net(weak1), dim=1)
                p_mean = (p_weak + F.softmax(net(weak2), dim=1)) / 2
            target = w * F.one_hot(self.labels[idx], k) + (1 - w) * p_mean
            target = target ** (1 / cfg.sharpen_t)
            target = target / target.sum(1, keepdim=True)
            inputs, targets = torch.cat([weak1, weak2]), torch.cat([target, target])
            lam = float(np.random.beta(cfg.mixup_alpha, cfg.mixup_alpha))
            lam = max(lam, 1 - lam)
            perm = torch.randperm(len(inputs), device=x.device)
            mixed_logits = net(lam * inputs + (1 - lam) * inputs[perm])
            loss = soft_cross_entropy(mixed_logits, lam * targets + (1 - lam) * targets[perm])
            mean_pred = F.softmax(mixed_logits, dim=1).mean(0)  # penalty sum_k pi_k log(pi_k / mean_k)
            loss = loss - (math.log(k) + torch.log(mean_pred)).sum() / k
            logits_strong, _, p = net(strong, ssl=True)
            loss = loss + soft_cross_entropy(logits_strong, w * target + (1 - w) * p_weak) + _ddp_anchor(p)
        if unlabeled is not None:
            x, idx = unlabeled
            logits_weak, z_weak, p_weak = net(views.weak(x), ssl=True)
            logits_strong, z_strong, p_strong = net(views.strong(x), ssl=True)
            loss = loss + _ddp_anchor(logits_weak, p_weak, p_strong)
            if cfg.simsiam and len(idx) > 1:  # the predictor's BatchNorm needs two samples
                loss = loss - 0.5 * (
                    F.cosine_similarity(p_weak, z_strong.detach()).mean()
                    + F.cosine_similarity(p_strong, z_weak.detach()).mean()
                )
            if self.stage2:
                probs = F.softmax(logits_weak.detach(), dim=1)
                if cfg.correction == "threshold":  # confidence thresholding (FixMatch), Table 4 (i)
                    conf, target = probs.max(1)
                    mask = conf >= cfg.pl_threshold
                else:
                    target = self.pseudo[idx]
                    mask = self.corrected[idx] & (probs.gather(1, target[:, None])[:, 0] >= cfg.pl_threshold)
                loss = loss + (F.cross_entropy(logits_strong, target, reduction="none") * mask).mean()
        return loss

    def state_dict(self):
        keys = ("clean", "corrected", "pseudo", "weight", "selecting", "stage2")
        return {key: getattr(self, key) for key in keys}

    def load_state_dict(self, state):
        for key, value in state.items():
            setattr(self, key, value)


def _ddp_anchor(*outputs):
    """0 * the outputs' sum: DDP expects a gradient for every parameter each step, so the SimSiam
    predictor (and the classifier, on a step without a labeled batch) stays in the graph at zero weight."""
    return sum(0.0 * out.sum() for out in outputs)


def _numpy(a):
    return a if isinstance(a, np.ndarray) else a.cpu().numpy()


def _gmm_clean_probability(losses):
    """DivideMix: losses min-max normalised, 2-component GMM, posterior of the low-mean component."""
    from sklearn.mixture import GaussianMixture

    z = (losses - losses.min()) / max(losses.max() - losses.min(), 1e-12)
    gmm = GaussianMixture(2, max_iter=10, tol=1e-2, reg_covar=5e-4, random_state=0).fit(z[:, None])
    return gmm.predict_proba(z[:, None])[:, int(np.argmin(gmm.means_[:, 0]))]


def selection_stats(clean, corrected, pseudo, y, y_clean=None) -> dict:
    """Set sizes; with the true labels `y_clean`, also the clean-set precision / recall against the truly
    clean samples and the corrected-label accuracy."""
    stats = {
        "select/n_clean": int(clean.sum()),
        "select/n_corrected": int(corrected.sum()),
        "select/n_unselected": int((~(clean | corrected)).sum()),
    }
    if y_clean is None:
        return stats
    truly_clean = y == y_clean
    hits = (clean & truly_clean).sum()
    corrected_acc = (pseudo[corrected] == y_clean[corrected]).mean() if corrected.any() else float("nan")
    return stats | {
        "select/precision": float(hits / max(clean.sum(), 1)),
        "select/recall": float(hits / max(truly_clean.sum(), 1)),
        "select/corrected_acc": float(corrected_acc),
    }


def run(cfg, ctx) -> dict:
    method = cfg.method
    data = load_data(cfg.dataset, cfg.seed)
    if method.standardize:
        if not hasattr(data.train, "x"):
            raise ConfigError(
                f"method.standardize=true needs an in-memory dataset; {cfg.dataset.name} is file-backed"
            )
        mean, std = data.train.x.mean(0), data.train.x.std(0).clamp(min=1e-3)
        for split in (data.train, data.val, data.test):
            split.x = (split.x - mean) / std
    selecting = method.selection != "none"
    model = NoisyLabelNet(
        build_model(cfg.model, data.input_shape, data.num_classes),
        head=method.feature_head and selecting,
        predictor_hidden=method.simsiam_hidden if selecting and method.loss == "paper" else None,
    )
    from runner.data.builtin import CIFAR_STATS
    from runner.data.files import IMAGENET_STATS, FileSplit

    file_backed = isinstance(data.train, FileSplit)  # normalised with the ImageNet statistics
    mean, std = CIFAR_STATS.get(cfg.dataset.name, IMAGENET_STATS if file_backed else (None, None))
    pad = data.meta.get("crop_pad", 4)
    views = Views(data.input_shape, method.strong_groups, mean, std, pad, method.strong_aug)
    asymmetric = cfg.dataset.label_noise.kind == "asymmetric"
    hooks = NoisyLabelHooks(method, model, data, ctx, views, asymmetric, cfg.seed, cfg.train.batch_size)
    summary = fit(model, data, cfg.train, ctx, hooks, augment="none")  # the hooks make the views
    if data.meta.get("clean_train_labels", True):
        summary["train/label_noise"] = float((data.train.y != data.train.y_clean).float().mean())
    summary |= getattr(hooks, "last_stats", {})
    return summary
