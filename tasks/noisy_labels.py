"""Learning with noisy labels: CSOT (Chang et al., NeurIPS 2023) and its baselines.

    runner +method=csot dataset=digits dataset.label_noise.kind=symmetric dataset.label_noise.rate=0.5
    runner +experiment=csot_cifar100 dataset.label_noise.rate=0.5                 (GPU, paper scale)
    runner -m +method=ce,small_loss,ot,cot,csot +experiment=csot_digits seed=0,1,2

The training labels are the noisy ones the foundation's `load_data` injects (`dataset.label_noise`);
`y_clean` is used only to score the selection. After `warmup` epochs of cross-entropy on the noisy
labels, every epoch starts with a selection pass: the network (eval mode, no augmentation) gives
softmax outputs and features for the whole training set, and a method splits it into

    clean       selected and the given label agrees: keep the label, with confidence w
    corrected   selected and the pseudo-label differs: relabelled (used confidently, see below)
    unlabeled   everything not clean

Selections (`method.selection`):

    csot        CSOT plan per random chunk of `solve_batch` (runner.methods.csot.allocate): budget
                m(epoch) from m0 to 1 at `curriculum_end`, structure weights kappa_p, kappa_l
    cot         the same without structure terms (kappa = 0): curriculum OT
    ot          m = 1, kappa = 0: plain OT relabelling, everything selected
    small_loss  DivideMix: a 2-component GMM on the per-sample losses, clean = p(clean) > gmm_threshold,
                w = p(clean); nothing corrected
    none        (method `ce`) cross-entropy on the noisy labels throughout

Losses (`method.loss`), per batch of training indices:

    paper   the CSOT code's: two weak views and one strong view per sample; on clean samples
            L_mix (mixup of the weak views, lambda ~ Beta(alpha, alpha) folded to >= 1/2, targets
            sharpen(w onehot(y) + (1 - w) mean softmax(weak views), T) plus the uniform-prior
            penalty) + L_lab (CE of the strong view against w t + (1 - w) softmax(weak)); on
            unlabeled samples SimSiam on (weak, strong); from stage 2 on, CE of the strong view
            against the pseudo-label on corrected samples with softmax(weak)[pseudo] >= pl_threshold.
            Stage 2 starts at `curriculum_end` (`stage_switch=epoch`) or on the first epoch with
            more corrected than unselected samples (`data`, the code's latch).
    simple  CE on the clean samples with their labels plus CE on the corrected samples whose
            prediction of the pseudo-label exceeds pl_threshold (the digest's CPU study).

Deviations from the paper, by design: one shuffled batch per step split by membership (instead of
a labeled and an unlabeled loader); the strong view is torchvision's AutoAugment (CIFAR-10 policy)
drawn per group of `strong_groups` samples, or for small images a shift + cutout + noise.
Logged per epoch: `select/precision`, `select/recall` (clean set against the true clean labels),
`select/corrected_acc`, `select/m`, set sizes, `select/solver_s`; plus train/val/test accuracy.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from runner.data import load_data
from runner.methods.csot import allocate, curriculum_budget
from runner.models import build_model
from runner.schema import check_choice, check_range
from runner.train import augment_crop_flip, fit, soft_cross_entropy

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
    omega_p_input: str = "softmax"  # softmax (paper) | log_softmax (authors' code default)
    feature_head: bool = True  # Linear(D, D) after the backbone: features for S and SimSiam
    # curriculum: m = m0 at the end of warm-up, 1 from curriculum_end on
    m0: float = 0.3
    curriculum_end: int = 250
    # losses
    pl_threshold: float = 0.95
    sharpen_t: float = 0.5
    mixup_alpha: float = 4.0
    simsiam_hidden: int = 128
    stage_switch: str = "data"  # data | epoch
    asym_penalty: bool = True  # warm-up: add mean sum p log p under asymmetric noise (DivideMix)
    gmm_threshold: float = 0.5  # small_loss selection
    strong_groups: int = 8  # AutoAugment: one sub-policy per group of samples in a batch
    standardize: bool = False  # inputs to zero mean, unit variance per element (train statistics)

    def __post_init__(self):
        check_choice("method.selection", self.selection, SELECTIONS)
        check_choice("method.loss", self.loss, ("paper", "simple"))
        check_choice("method.omega_p_input", self.omega_p_input, ("softmax", "log_softmax"))
        check_choice("method.stage_switch", self.stage_switch, ("data", "epoch"))
        check_range("method.warmup", self.warmup, 0)
        check_range("method.eps", self.eps, 0.0, lo_open=True)
        check_range("method.kappa_p", self.kappa_p, 0.0)
        check_range("method.kappa_l", self.kappa_l, 0.0)
        for key in ("outer_iters", "inner_iters", "solve_batch", "simsiam_hidden", "strong_groups"):
            check_range(f"method.{key}", getattr(self, key), 1)
        check_range("method.m0", self.m0, 0.0, 1.0, lo_open=True)
        check_range("method.curriculum_end", self.curriculum_end, self.warmup + 1)
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
class SmallLossConfig(NoisyLabelConfig):
    name: str = "small_loss"
    selection: str = "small_loss"


@dataclass
class CEConfig(NoisyLabelConfig):
    name: str = "ce"
    selection: str = "none"


METHODS = {c.name: c for c in (CSOTConfig, COTConfig, OTConfig, SmallLossConfig, CEConfig)}


# ----------------------------------------------------------------------------- views


class Views:
    """Weak and strong augmentations of a batch on its device.

    Images of side >= 16: weak = crop (pad 4) + flip; strong = weak + AutoAugment (CIFAR-10
    policy) applied in `groups` groups on the de-normalised image. Smaller images (digits):
    weak = shift by up to one pixel; strong = weak + a 3x3 cutout + Gaussian noise (0.1).
    Flat inputs: weak = Gaussian noise (0.05), strong = noise (0.2) and 20% feature dropout.
    """

    def __init__(self, input_shape, groups=8, mean=None, std=None):
        self.kind = "flat" if len(input_shape) != 3 else ("large" if input_shape[1] >= 16 else "small")
        self.groups = groups
        if self.kind == "large":
            from torchvision.transforms import v2

            self.autoaugment = v2.AutoAugment(v2.AutoAugmentPolicy.CIFAR10)
            c = input_shape[0]
            self.mean = torch.tensor(mean if mean is not None else [0.0] * c).view(1, c, 1, 1)
            self.std = torch.tensor(std if std is not None else [1.0] * c).view(1, c, 1, 1)

    def weak(self, x):
        if self.kind == "large":
            return augment_crop_flip(x)
        if self.kind == "small":
            return _shift(x, 1)
        return x + 0.05 * torch.randn_like(x)

    def strong(self, x):
        x = self.weak(x)
        if self.kind == "large":
            mean, std = self.mean.to(x.device), self.std.to(x.device)
            images = (x * std + mean).clamp(0, 1)
            parts = [self.autoaugment(part) for part in images.chunk(self.groups)]
            return (torch.cat(parts) - mean) / std
        if self.kind == "small":
            return _cutout(x, 3) + 0.1 * torch.randn_like(x)
        return (x + 0.2 * torch.randn_like(x)) * (torch.rand_like(x) > 0.2)


def _shift(x, pad):
    """Random translation by up to `pad` pixels (zero fill), per sample."""
    b, _, h, w = x.shape
    padded = F.pad(x, (pad, pad, pad, pad))
    dy = torch.randint(0, 2 * pad + 1, (b,), device=x.device)
    dx = torch.randint(0, 2 * pad + 1, (b,), device=x.device)
    rows = (torch.arange(h, device=x.device)[None, :] + dy[:, None])[:, None, :, None]
    cols = (torch.arange(w, device=x.device)[None, :] + dx[:, None])[:, None, None, :]
    batch = torch.arange(b, device=x.device)[:, None, None, None]
    chans = torch.arange(x.shape[1], device=x.device)[None, :, None, None]
    return padded[batch, chans, rows, cols]


def _cutout(x, size):
    """Zero a random size x size square per sample."""
    b, _, h, w = x.shape
    cy = torch.randint(0, h, (b, 1, 1), device=x.device)
    cx = torch.randint(0, w, (b, 1, 1), device=x.device)
    ys = torch.arange(h, device=x.device).view(1, h, 1)
    xs = torch.arange(w, device=x.device).view(1, 1, w)
    hole = ((ys - cy).abs() <= size // 2) & ((xs - cx).abs() <= size // 2)
    return x * (~hole).unsqueeze(1)


# ----------------------------------------------------------------------------- selection and losses


class NoisyLabelHooks:
    """`runner.train.fit` hooks: the selection at each epoch start, the method's loss per batch."""

    def __init__(self, cfg, model, data, ctx, views, asymmetric, seed):
        self.cfg, self.model, self.ctx, self.views = cfg, model, ctx, views
        self.num_classes = data.num_classes
        self.penalty = cfg.asym_penalty and asymmetric
        self.seed = seed
        n, device = len(data.train), ctx.device
        self.labels = data.train.y.to(device)
        self.clean = torch.zeros(n, dtype=torch.bool, device=device)
        self.corrected = torch.zeros(n, dtype=torch.bool, device=device)
        self.pseudo = self.labels.clone()
        self.weight = torch.ones(n, device=device)
        self.selecting = False  # a selection has been made (warm-up over)
        self.stage2 = False

    # --- per epoch -------------------------------------------------------------------------

    @torch.no_grad()
    def on_epoch_start(self, epoch, model, data):
        cfg = self.cfg
        if cfg.selection == "none" or epoch < cfg.warmup:
            return
        probs, feats = self._outputs(data.train.x)
        y = data.train.y.numpy()
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
                else curriculum_budget(epoch, cfg.warmup, cfg.curriculum_end, cfg.m0)
            )
            labels = y if isinstance(probs, np.ndarray) else self.labels
            pseudo, weight, selected = map(_numpy, allocate(
                probs, feats, labels, m, solve_batch=cfg.solve_batch, seed=self.seed * 100_003 + epoch,
                eps=cfg.eps, kappa_p=cfg.kappa_p, kappa_l=cfg.kappa_l, outer_iters=cfg.outer_iters,
                inner_iters=cfg.inner_iters, omega_p_input=cfg.omega_p_input,
            ))  # fmt: skip
            clean, corrected = selected & (pseudo == y), selected & (pseudo != y)
        solver_s = time.perf_counter() - start
        unselected = ~(clean | corrected)
        if cfg.stage_switch == "epoch":
            self.stage2 = epoch >= cfg.curriculum_end
        else:  # the code's latch
            self.stage2 = self.stage2 or corrected.sum() > unselected.sum() or epoch >= cfg.curriculum_end
        device = self.ctx.device
        self.clean = torch.as_tensor(clean, device=device)
        self.corrected = torch.as_tensor(corrected, device=device)
        self.pseudo = torch.as_tensor(pseudo, dtype=torch.long, device=device)
        self.weight = torch.as_tensor(weight, dtype=torch.float32, device=device)
        self.selecting = True
        stats = selection_stats(clean, corrected, pseudo, y, data.train.y_clean.numpy())
        stats |= {"select/m": m, "select/solver_s": solver_s, "select/stage2": float(self.stage2)}
        self.last_stats = stats
        self.ctx.tracker.log(stats, step=epoch)

    @torch.no_grad()
    def _outputs(self, x):
        """Softmax outputs and structure features (float64) of the training set, no augmentation:
        numpy on CPU, tensors on the device otherwise (the CSOT solver runs on either)."""
        model, was_training = self.model, self.model.training
        model.eval()
        probs, feats = [], []
        for i in range(0, len(x), 1024):
            h = model.forward_features(x[i : i + 1024].to(self.ctx.device))
            probs.append(F.softmax(model.classifier(h).double(), dim=1))
            feats.append(_project(model, h).double())
        model.train(was_training)
        probs, feats = torch.cat(probs), torch.cat(feats)
        if self.ctx.device.type == "cpu":
            return probs.numpy(), feats.numpy()
        return probs, feats

    # --- per batch -------------------------------------------------------------------------

    def loss(self, net, x, y_soft, idx, epoch):
        if not self.selecting:  # warm-up (or plain CE): cross-entropy on the noisy labels
            logits = net(x)
            loss = soft_cross_entropy(logits, y_soft)
            if self.penalty:
                p = F.softmax(logits, dim=1)
                loss = loss + (p * F.log_softmax(logits, dim=1)).sum(1).mean()
            return loss
        if self.cfg.loss == "simple":
            return self._simple_loss(net, x, idx)
        return self._paper_loss(x, idx)

    def _simple_loss(self, net, x, idx):
        logits = net(x)
        clean, corrected = self.clean[idx], self.corrected[idx]
        conf = F.softmax(logits.detach(), dim=1).gather(1, self.pseudo[idx, None])[:, 0]
        use = clean | (corrected & (conf > self.cfg.pl_threshold))
        target = torch.where(clean, self.labels[idx], self.pseudo[idx])
        ce = F.cross_entropy(logits, target, reduction="none")
        return (ce * use).sum() / use.sum().clamp(min=1)

    def _paper_loss(self, x, idx):
        cfg, model, k = self.cfg, self.model, self.num_classes
        clean, weight = self.clean[idx], self.weight[idx][:, None]
        weak1, weak2, strong = self.views.weak(x), self.views.weak(x), self.views.strong(x)
        h = model.forward_features(torch.cat([weak1, strong]))
        logits_weak, logits_strong = model.classifier(h).chunk(2)
        z_weak, z_strong = _project(model, h).chunk(2)
        with torch.no_grad():
            p_weak = F.softmax(logits_weak.detach(), dim=1)
            p_mean = (p_weak + F.softmax(model(weak2), dim=1)) / 2
        loss = x.new_zeros(())
        if clean.any():
            w = weight[clean]
            target = w * F.one_hot(self.labels[idx][clean], k) + (1 - w) * p_mean[clean]
            target = target ** (1 / cfg.sharpen_t)
            target = target / target.sum(1, keepdim=True)
            inputs = torch.cat([weak1[clean], weak2[clean]])
            targets = torch.cat([target, target])
            lam = float(np.random.beta(cfg.mixup_alpha, cfg.mixup_alpha))
            lam = max(lam, 1 - lam)
            perm = torch.randperm(len(inputs), device=x.device)
            mixed_logits = model(lam * inputs + (1 - lam) * inputs[perm])
            loss = loss + soft_cross_entropy(mixed_logits, lam * targets + (1 - lam) * targets[perm])
            mean_pred = F.softmax(mixed_logits, dim=1).mean(0)
            loss = loss - (math.log(k) + torch.log(mean_pred)).sum() / k
            loss = loss + soft_cross_entropy(logits_strong[clean], w * target + (1 - w) * p_weak[clean])
        unlabeled = ~clean
        if unlabeled.sum() > 1:  # the predictor's BatchNorm needs two samples
            predictor = model.csot_predictor
            za, zb = z_weak[unlabeled], z_strong[unlabeled]
            loss = loss - 0.5 * (
                F.cosine_similarity(predictor(za), zb.detach()).mean()
                + F.cosine_similarity(predictor(zb), za.detach()).mean()
            )
        if self.stage2 and unlabeled.any():
            pseudo = self.pseudo[idx]
            confident = p_weak.gather(1, pseudo[:, None])[:, 0] >= cfg.pl_threshold
            mask = (self.corrected[idx] & confident)[unlabeled]
            ce = F.cross_entropy(logits_strong[unlabeled], pseudo[unlabeled], reduction="none")
            loss = loss + (ce * mask).mean()
        return loss

    def state_dict(self):
        keys = ("clean", "corrected", "pseudo", "weight", "selecting", "stage2")
        return {key: getattr(self, key) for key in keys}

    def load_state_dict(self, state):
        for key, value in state.items():
            setattr(self, key, value)


def _numpy(a):
    return a if isinstance(a, np.ndarray) else a.cpu().numpy()


def _project(model, h):
    """The structure / SimSiam feature: the optional head after the backbone."""
    head = getattr(model, "csot_head", None)
    return h if head is None else head(h)


def _gmm_clean_probability(losses):
    """DivideMix: losses min-max normalised, 2-component GMM, posterior of the low-mean component."""
    from sklearn.mixture import GaussianMixture

    z = (losses - losses.min()) / max(losses.max() - losses.min(), 1e-12)
    gmm = GaussianMixture(2, max_iter=10, tol=1e-2, reg_covar=5e-4, random_state=0).fit(z[:, None])
    return gmm.predict_proba(z[:, None])[:, int(np.argmin(gmm.means_[:, 0]))]


def selection_stats(clean, corrected, pseudo, y, y_clean) -> dict:
    """Clean-set precision / recall against the truly clean samples, corrected-label accuracy."""
    truly_clean = y == y_clean
    hits = (clean & truly_clean).sum()
    corrected_acc = (pseudo[corrected] == y_clean[corrected]).mean() if corrected.any() else float("nan")
    return {
        "select/precision": float(hits / max(clean.sum(), 1)),
        "select/recall": float(hits / max(truly_clean.sum(), 1)),
        "select/corrected_acc": float(corrected_acc),
        "select/n_clean": int(clean.sum()),
        "select/n_corrected": int(corrected.sum()),
        "select/n_unselected": int((~(clean | corrected)).sum()),
    }  # fmt: skip


def run(cfg, ctx) -> dict:
    method = cfg.method
    data = load_data(cfg.dataset, cfg.seed)
    if method.standardize:
        mean, std = data.train.x.mean(0), data.train.x.std(0).clamp(min=1e-3)
        for split in (data.train, data.val, data.test):
            split.x = (split.x - mean) / std
    model = build_model(cfg.model, data.input_shape, data.num_classes)
    dim = model.feature_dim
    if method.feature_head and method.selection != "none":
        model.csot_head = nn.Linear(dim, dim)
    if method.selection != "none" and method.loss == "paper":  # SimSiam predictor: D -> hidden -> D
        hidden = method.simsiam_hidden
        model.csot_predictor = nn.Sequential(
            nn.Linear(dim, hidden, bias=False),
            nn.BatchNorm1d(hidden),
            nn.ReLU(inplace=True),
            nn.Linear(hidden, dim),
        )
    hooks, augment = None, cfg.dataset.augment  # `ce`: plain training on the noisy labels
    if method.selection != "none":
        from runner.data.builtin import CIFAR_STATS

        mean, std = CIFAR_STATS.get(cfg.dataset.name, (None, None))
        views = Views(data.input_shape, method.strong_groups, mean, std)
        asymmetric = cfg.dataset.label_noise.kind == "asymmetric"
        hooks = NoisyLabelHooks(method, model, data, ctx, views, asymmetric, cfg.seed)
        augment = "none"  # the paper loss makes its own views
    summary = fit(model, data, cfg.train, ctx, hooks, augment=augment)
    summary["train/label_noise"] = float((data.train.y != data.train.y_clean).float().mean())
    summary |= getattr(hooks, "last_stats", {})
    return summary
