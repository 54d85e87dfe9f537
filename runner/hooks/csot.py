"""Training-time code of the noisy-label methods (`runner.tasks.noisy_labels`) around the CSOT library
`runner.methods.csot`: the `runner.train.fit` hooks (the selection at each epoch start, the two
loaders, the paper's and the simple loss), the DivideMix GMM baseline and the selection statistics."""

from __future__ import annotations

import dataclasses
import math
import time

import numpy as np
import torch
import torch.nn.functional as F

from runner.checks import ConfigError
from runner.data.samplers import EpochSample, PoolBatches, SampleBatches
from runner.distributed_passes import broadcast_from_main, predict_all
from runner.hardware import to_device
from runner.losses import soft_cross_entropy
from runner.method_hooks import MethodHooks
from runner.methods.csot import allocate, curriculum_budget


@torch.no_grad()
def probabilities_and_features(model, split, ctx, batch_size: int = 1024):
    """softmax(classifier(f)) and the features f = `model.forward_features` (float64) of every sample of
    `split` in index order, without augmentation, the pass sharded over the ranks and gathered (one
    forward pass: the classifier reads the features), in fp32 whatever the run's precision (the plan's
    cost is -log p and its structure terms cosine similarities: bf16's 8 bits would blur both). numpy
    off an accelerator, float64 tensors on it (the CSOT solver runs on either)."""
    feats = predict_all(model, split, dataclasses.replace(ctx, precision="fp32"), batch_size, features=True)
    if ctx.accelerator:
        feats = to_device(feats, ctx.device)
    probs = torch.cat([F.softmax(model.classifier(part).double(), dim=1) for part in feats.split(65_536)])
    if ctx.accelerator:
        return probs, feats.double()
    return probs.numpy(), feats.double().numpy()


def gmm_clean_probability(losses):
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


def _ddp_anchor(*outputs):
    """0 * the outputs' sum: DDP expects a gradient for every parameter each step, so the SimSiam
    predictor (and the classifier, on a step without a labeled batch) stays in the graph at zero weight."""
    return sum(0.0 * out.sum() for out in outputs)


def _numpy(a):
    return a if isinstance(a, np.ndarray) else a.cpu().numpy()


class NoisyLabelHooks(MethodHooks):
    """`runner.train.fit` hooks: the selection at each epoch start, the two loaders (`batch_sampler`:
    after the first selection each step is a clean batch and an unlabeled batch of `batch_size`, the
    epoch as long as the longer of the two, see `PoolBatches`), the method's loss per batch."""

    mid_epoch_resume = True  # state_dict holds the selection; the epoch's batches follow from it
    # device work once the paper loss's mixup ratio is drawn before the step (`draw`); the selection
    # lands in the same buffers each epoch, and its stage recaptures (`capture_key`)
    capturable = True

    def __init__(self, cfg, model, data, ctx, views, asymmetric, seed, batch_size, epoch_samples=0):
        self.cfg, self.model, self.ctx, self.views = cfg, model, ctx, views
        self.num_classes = data.num_classes
        self.penalty = cfg.asym_penalty and asymmetric or cfg.warmup_penalty
        self.seed, self.batch_size = seed, batch_size
        self.warmup_batch_size = cfg.warmup_batch_size or batch_size
        if self.warmup_batch_size % ctx.world_size:
            raise ConfigError(
                f"method.warmup_batch_size={self.warmup_batch_size}: must split evenly over "
                f"{ctx.world_size} ranks"
            )
        n, device = len(data.train), ctx.device
        # dataset.epoch_samples: each epoch trains and selects on a fresh class-balanced sample (DivideMix's
        # Clothing1M protocol); 0: on the whole training set
        self.epoch_sample = EpochSample(data.train.y, epoch_samples, seed) if epoch_samples else None
        self.sampled = torch.ones(n, dtype=torch.bool)  # the epoch's sample, as a mask (CPU)
        self.labels = to_device(data.train.y, device)
        self.clean = torch.zeros(n, dtype=torch.bool, device=device)
        self.corrected = torch.zeros(n, dtype=torch.bool, device=device)
        self.pseudo = self.labels.clone()
        self.weight = torch.ones(n, device=device)
        self.selecting = False  # a selection has been made (warm-up over)
        self.stage2 = False
        self.last_stats = {}
        self.sampler = None  # fit's batches (`batch_sampler`): their layout splits a batch

    # --- per epoch -------------------------------------------------------------------------

    def batch_sampler(self, default):
        """Until the first selection (throughout for `ce`) plain shuffled batches of the epoch's sample:
        fit's own (`default`) where that is the whole training set at `train.batch_size` in every epoch,
        else `SampleBatches` of `warmup_batch_size` in the warm-up epochs and `batch_size` after; from
        the first selection on the clean and unlabeled pools'."""
        ctx, warmup = self.ctx, self.cfg.warmup
        plain = default
        if self.epoch_sample is not None or self.warmup_batch_size != self.batch_size:
            plain = SampleBatches(
                self.sample, lambda epoch: self.warmup_batch_size if epoch < warmup else self.batch_size,
                ctx.rank, ctx.world_size, self.seed,
            )  # fmt: skip
        self.sampler = PoolBatches(self.pools, self.batch_size, ctx.rank, ctx.world_size, self.seed, plain)
        return self.sampler

    def batch_setting(self, epoch) -> str:
        """The setting that sizes epoch `epoch`'s batches (named when it runs out of memory)."""
        if epoch < self.cfg.warmup and self.warmup_batch_size != self.batch_size:
            return f"method.warmup_batch_size={self.warmup_batch_size}"
        return f"train.batch_size={self.batch_size} (a clean and an unlabeled batch of it per step)"

    def sample(self, epoch) -> torch.Tensor:
        """The training indices epoch `epoch` draws from: its `dataset.epoch_samples` sample, or all."""
        if self.epoch_sample is None:
            return torch.arange(len(self.sampled))
        return self.epoch_sample(epoch)

    def pools(self):
        """The clean set and the rest of the epoch's sample (every rank the same), or None before the
        first selection."""
        if not self.selecting:
            return None
        clean = self.clean.cpu()
        return [clean.nonzero()[:, 0], (self.sampled & ~clean).nonzero()[:, 0]]

    @torch.no_grad()
    def on_epoch_start(self, epoch, model, data):
        cfg = self.cfg
        if cfg.selection == "none" or epoch < cfg.warmup:
            return
        sample = self.sample(epoch)
        rows, whole = sample.numpy(), self.epoch_sample is None
        split = data.train if whole else data.train.subset(sample)
        probs, feats = probabilities_and_features(self.model, split, self.ctx)  # sharded, gathered
        y = data.train.y.numpy()[rows]
        # Rank 0 selects, every rank trains on its selection.
        selection = self._select(epoch, probs, feats, y, sample) if self.ctx.is_main else None
        clean, corrected, pseudo, weight, m, solver_s = broadcast_from_main(selection)
        unselected = ~(clean | corrected)
        at_t_sup = epoch + 1 >= cfg.curriculum_end  # the paper's t = epoch + 1 reaches T_sup
        if cfg.stage_switch == "never":
            self.stage2 = False
        elif cfg.stage_switch == "epoch":
            self.stage2 = at_t_sup
        else:  # the code's latch
            self.stage2 = self.stage2 or corrected.sum() > unselected.sum() or at_t_sup

        # the sample's values at their rows of the training set; `fill` elsewhere (no batch draws those)
        def on_all(values, fill):
            if whole:
                return values
            out = np.full(len(self.sampled), fill, dtype=values.dtype)
            out[rows] = values
            return out

        # into the tensors the step reads (a captured step replays their addresses)
        self.clean.copy_(to_device(on_all(clean, False), self.ctx.device, torch.bool))
        self.corrected.copy_(to_device(on_all(corrected, False), self.ctx.device, torch.bool))
        self.pseudo.copy_(to_device(on_all(pseudo, 0), self.ctx.device, torch.long))
        self.weight.copy_(to_device(on_all(weight, 1.0), self.ctx.device, torch.float32))
        self.sampled = torch.zeros(len(self.sampled), dtype=torch.bool)
        self.sampled[sample] = True
        self.selecting = True
        known = data.meta.get("clean_train_labels", True)
        y_clean = data.train.y_clean.numpy()[rows] if known else None
        stats = selection_stats(clean, corrected, pseudo, y, y_clean)
        stats |= {"select/m": m, "select/solver_s": solver_s, "select/stage2": float(self.stage2)}
        self.last_stats = stats

    def epoch_metrics(self) -> dict:
        """The last selection's statistics, in each epoch's metrics row and line."""
        return self.last_stats

    @torch.no_grad()
    def _select(self, epoch, probs, feats, y, sample):
        """(clean, corrected, pseudo-labels, confidences w, budget m, solver seconds) of the training
        samples `sample` (their outputs `probs`, `feats` and labels `y`), numpy arrays."""
        cfg = self.cfg
        start = time.perf_counter()
        if cfg.selection == "small_loss":
            m = float("nan")
            p_true = _numpy(probs)[np.arange(len(y)), y]
            p_clean = gmm_clean_probability(-np.log(np.maximum(p_true, 1e-12)))
            clean, weight = p_clean > cfg.gmm_threshold, p_clean
            pseudo, corrected = y.copy(), np.zeros(len(y), dtype=bool)
        else:
            m = (
                1.0
                if cfg.selection == "ot"
                else curriculum_budget(epoch, cfg.warmup, cfg.curriculum_end, cfg.m0, cfg.budget)
            )
            labels = y if isinstance(probs, np.ndarray) else self.labels[sample.to(self.labels.device)]
            pseudo, weight, selected = map(_numpy, allocate(
                probs, feats, labels, m, solve_batch=cfg.solve_batch, seed=self.seed * 100_003 + epoch,
                reg=cfg.eps, kappa_p=cfg.kappa_p, kappa_l=cfg.kappa_l, max_iter=cfg.outer_iters,
                inner_max_iter=cfg.inner_iters, omega_p_input=cfg.omega_p_input,
            ))  # fmt: skip
            clean, corrected = selected & (pseudo == y), selected & (pseudo != y)
        return clean, corrected, pseudo, weight, m, time.perf_counter() - start

    # --- per batch -------------------------------------------------------------------------

    def capture_key(self, epoch):
        """The step's work changes with the warm-up's end, the second stage and the pools' layout."""
        return self.selecting, self.stage2, self.selecting and tuple(self.sampler.layout)

    def draw(self, x, y_soft, idx, model):
        return self._paper_ratio()

    def _paper_ratio(self) -> tuple:
        """The paper loss's mixup ratio max(lambda, 1 - lambda), lambda ~ Beta(alpha, alpha) from numpy's
        global stream (the authors' `np.random.beta`), as a float64 0-dim tensor on the device, for a step
        with a clean batch; () otherwise."""
        if not (self.selecting and self.cfg.loss == "paper" and self.sampler.layout[0]):
            return ()
        lam = float(np.random.beta(self.cfg.mixup_alpha, self.cfg.mixup_alpha))
        return (to_device(max(lam, 1 - lam), self.ctx.device, torch.float64),)

    def loss(self, net, x, y_soft, idx, epoch, drawn=None):
        if not self.selecting:  # warm-up (or plain CE): CE on the noisy labels of fit's batch, weak view
            return self._warmup_loss(net, self.views.weak(x), y_soft)
        # fit's batch: this rank's shard of a clean batch, then of an unlabeled one (`PoolBatches.layout`)
        n_clean = self.sampler.layout[0]
        labeled = (x[:n_clean], idx[:n_clean]) if n_clean else None
        unlabeled = (x[n_clean:], idx[n_clean:]) if n_clean < len(idx) else None
        if self.cfg.loss == "simple":
            return self._simple_loss(net, labeled, unlabeled)
        if drawn is None:  # called outside the loop: draw here
            drawn = self._paper_ratio()
        return self._paper_loss(net, labeled, unlabeled, *drawn)

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

    def _paper_loss(self, net, labeled, unlabeled, lam=None):
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
        keys = ("clean", "corrected", "pseudo", "weight", "sampled", "selecting", "stage2", "last_stats")
        return {key: getattr(self, key) for key in keys}

    def load_state_dict(self, state):
        for key, value in state.items():
            setattr(self, key, value)
