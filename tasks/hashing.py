"""Retrieval with learned hash tables: hierarchically quantized codes by cascaded min-cost flow.

`runner +method=hier_hash` (Jeong, Kim & Song, CVPR 2019; library: `runner.methods.hier_hash`):

1. Base metric embedding: `base=pretrain` trains backbone + Linear(feature_dim -> base_dim) with the
   N-pairs or triplet loss on class-balanced batches (or loads `base_checkpoint`); `base=raw` uses
   the flattened inputs. Its frozen copy reranks the candidates. With `input_norm=pixel_mean` every
   net sees the authors' input, x/255 minus the training set's per-pixel mean (`PixelMeanInput`).
2. Hash net: a copy of the backbone + Linear(feature_dim -> d*k) (std 0.01). Per iteration
   (nc classes x m examples): class-mean unaries per level -> exact codes by min-cost flow, level
   by level -> labels remapped to code ids -> one Adam step on the loss measured on active dims.
   `iters` iterations, the learning rates x `decay` after each iteration in `decay_at`. One net
   is trained per ks (the paper's protocol; margin, N-pairs lambda and beta may differ per ks).
   With `eval_every`, the validation hash Pr@1 is measured before training and every that many
   epochs, and the best-validation weights are kept (the authors' model selection).
3. Retrieval for each ks and K: a hash table of `tables` (test: test items, query excluded;
   train: train items), queried with the test set, candidates reranked by Euclidean distance in
   the base embedding. Rows: exhaustive search (Metric), and each of `baselines`: Th (top-ks dims
   of the base embedding), VQ-m (ks nearest of m k-means centroids, m in `vq_centroids`), [11] =
   k=1 codes trained on class labels as Jeong & Song 2018 (d in `level1_d`, their `level1_*`
   settings), LSH-n (n-bit random-hyperplane codes of the base embedding, ks=1 as the paper).

Summary: `test/p@K`, `test/suf@K`, `test/nmi` for the hierarchical codes at the first ks on the
first table, `test/metric_p@K` for exhaustive search, `val/p@1` (the selection score, with a
validation split), every cell under `hash/<table>/<row>/ks<ks>/`, and `time/mcf_share` (the
min-cost flow's share of a training iteration). The tables also go to `retrieval.md` in the run dir.
"""

from __future__ import annotations

import copy
import logging
import math
import time
import zlib
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from runner.data import load_data
from runner.methods import hier_hash as hh
from runner.models import build_model
from runner.schema import ConfigError, check_choice, check_range
from runner.train import batches, in_order, predict, save_checkpoint

log = logging.getLogger(__name__)

METRIC = ("test/p@1", "max")
TABLES = ("test", "train")
BASELINES = ("th", "vq", "level1", "lsh")
INPUT_NORMS = ("dataset", "pixel_mean")


@dataclass
class HierHashConfig:
    """Defaults: the paper's Cifar-100 N-pairs setting (70k iterations of 64 x 2, x0.3 after 20k)."""

    name: str = "hier_hash"
    task: str = "hashing"
    # codes: k levels of d, ks active buckets at the last level; energy weights (code units)
    d: int = 32
    k: int = 2
    ks: list[int] = field(default_factory=lambda: [1, 2, 3, 4])
    alpha: float = 100.0
    beta: list[float] = field(default_factory=lambda: [0.07, 0.1, 0.1, 0.1])  # one value or one per ks
    solver: str = "ortools"
    cost_scale: float | None = None
    remap: bool = True
    # metric loss given codes
    loss: str = "npairs"
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
    base: str = "pretrain"
    base_dim: int = 64
    base_loss: str = "npairs"
    base_margin: float = 0.3
    base_l2: float = 0.003
    base_iters: int = 70_000
    base_lr: float = 1e-3
    base_checkpoint: str | None = None
    input_norm: str = "dataset"  # dataset: its normalisation | pixel_mean: x/255 - train mean image
    # evaluation
    eval_k: list[int] = field(default_factory=lambda: [1, 4, 16])
    tables: list[str] = field(default_factory=lambda: ["test", "train"])
    baselines: list[str] = field(default_factory=lambda: ["th", "vq"])
    vq_centroids: list[int] = field(default_factory=list)  # empty: [d, d^k]
    level1_d: list[int] = field(default_factory=list)  # [11]: empty: [d*k], equal output count
    level1_beta: list[float] = field(default_factory=lambda: [0.3])  # [11]'s own (ICML18 Cifar N-pairs)
    level1_margin: list[float] = field(default_factory=lambda: [1.0])
    level1_npairs_l2: list[float] = field(default_factory=lambda: [0.003])
    lsh_bits: list[int] = field(default_factory=list)  # empty: [log2(d*k)] (2^n = dk buckets, as the paper)
    eval_every: float = 0.0  # epochs between validation Pr@1 checks (best kept); 0: never
    log_every: int = 100
    checkpoint_every: int = 2000

    def __post_init__(self):
        def bad(key, value, allowed):  # list-valued keys; scalars go through check_range/check_choice
            raise ConfigError(f"method.{key}={value!r}: must be {allowed}")

        check_range("method.d", self.d, 2)
        check_range("method.k", self.k, 1)
        if not self.ks or not all(1 <= s <= self.d for s in self.ks):
            bad("ks", self.ks, f"a non-empty list of ints in [1, d={self.d}]")
        check_range("method.alpha", self.alpha, 0.0)
        for key in ("beta", "margin", "npairs_l2", "level1_beta", "level1_margin", "level1_npairs_l2"):
            values = getattr(self, key)
            if len(values) not in (1, len(self.ks)) or min(values) < 0:
                bad(key, values, f"one value >= 0, or one per ks ({len(self.ks)})")
        check_choice("method.solver", self.solver, hh.BACKENDS)
        if self.cost_scale is not None:  # null: automatic
            check_range("method.cost_scale", self.cost_scale, 0.0, lo_open=True)
        check_choice("method.loss", self.loss, hh.LOSSES)
        check_choice("method.base_loss", self.base_loss, hh.LOSSES)
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
        check_choice("method.base", self.base, ("pretrain", "raw"))
        check_choice("method.input_norm", self.input_norm, INPUT_NORMS)
        if self.base == "pretrain":
            check_range("method.base_dim", self.base_dim, 1)
            check_range("method.base_iters", self.base_iters, 1)
            check_range("method.base_lr", self.base_lr, 0.0, lo_open=True)
        if not self.eval_k or min(self.eval_k) < 1:
            bad("eval_k", self.eval_k, "a non-empty list of ints >= 1")
        if not self.tables or not set(self.tables) <= set(TABLES):
            bad("tables", self.tables, f"a non-empty subset of {list(TABLES)}")
        if not set(self.baselines) <= set(BASELINES):
            bad("baselines", self.baselines, f"a subset of {list(BASELINES)}")
        if self.vq_centroids and min(self.vq_centroids) < max(self.ks):
            bad("vq_centroids", self.vq_centroids, f"ints >= max(ks)={max(self.ks)}")
        if self.level1_d and min(self.level1_d) < max(self.ks):
            bad("level1_d", self.level1_d, f"ints >= max(ks)={max(self.ks)}")
        if self.lsh_bits and not all(1 <= n <= 20 for n in self.lsh_bits):
            bad("lsh_bits", self.lsh_bits, "ints in [1, 20]")
        check_range("method.log_every", self.log_every, 1)
        check_range("method.checkpoint_every", self.checkpoint_every, 1)


METHODS = {"hier_hash": HierHashConfig}


def smoke(cfg) -> None:
    """`+debug=smoke`: every net trains `debug.max_batches` iterations of at most 4 classes."""
    method, most = cfg.method, cfg.debug.max_batches
    method.iters, method.base_iters = min(method.iters, most), min(method.base_iters, most)
    method.classes_per_batch = min(method.classes_per_batch, 4)
    method.decay_at = [i for i in method.decay_at if i <= method.iters]
    # k-means of the VQ baselines runs on the (smoke-sized) training set: no more centroids than samples
    centroids = method.vq_centroids or [method.d, method.d**method.k]
    method.vq_centroids = [max(min(n, cfg.dataset.max_train), max(method.ks)) for n in centroids]


def per_ks(values, i):
    """The value for the i-th ks: one shared value, or one per ks."""
    return values[0] if len(values) == 1 else values[i]


# --------------------------------------------------------------------------------------------
# Networks, batches, training steps
# --------------------------------------------------------------------------------------------


class PixelMeanInput(nn.Module):
    """x -> std * (x - mean): from input normalised per channel, (x_raw / 255 - m_c) / s_c, the authors'
    input x_raw / 255 - M with M the training set's mean image (`mean` = M in normalised units)."""

    def __init__(self, mean: torch.Tensor, std):
        super().__init__()
        self.register_buffer("mean", mean.float())
        self.register_buffer("std", torch.as_tensor(std, dtype=torch.float32).reshape(-1, 1, 1))

    def forward(self, x):
        return (x - self.mean) * self.std


def pixel_mean_input(data, ctx, batch_size) -> PixelMeanInput:
    """`PixelMeanInput` of the training split: its mean image, streamed without augmentation."""
    normalize = data.meta.get("normalize")
    if normalize is None and getattr(data.train, "std", None) is not None:  # a uint8 split decoded per batch
        normalize = (data.train.mean, data.train.std)
    if normalize is None:
        raise ConfigError(
            "method.input_norm=pixel_mean needs the dataset's per-channel (mean, std) (its meta "
            "'normalize'), which this dataset does not give; use method.input_norm=dataset"
        )
    total = None
    for x, _ in batches(data.train, ctx, in_order(len(data.train), batch_size)):
        part = x.double().sum(0)
        total = part if total is None else total + part
    return PixelMeanInput((total / len(data.train)).cpu(), normalize[1])


class EmbeddingNet(nn.Module):
    """[input_norm ->] backbone.forward_features -> a new linear layer (std `init_std` when given)."""

    def __init__(self, backbone, out_dim, init_std=None, input_norm=None):
        super().__init__()
        self.input_norm = input_norm if input_norm is not None else nn.Identity()
        self.backbone = backbone
        self.head = nn.Linear(backbone.feature_dim, out_dim)
        if init_std is not None:
            nn.init.normal_(self.head.weight, std=init_std)
            nn.init.zeros_(self.head.bias)

    def forward(self, x):
        return self.head(self.backbone.forward_features(self.input_norm(x)))


class ClassBalancedSampler:
    """Batches of `nc` distinct classes x `m` distinct examples each, as an (nc, m) index array;
    batch i is a function of (seed, i) alone, so a resumed run draws the batches it would have."""

    def __init__(self, labels, nc, m, seed):
        labels = np.asarray(labels)
        self.by_class = [idx for c in np.unique(labels) if len(idx := np.flatnonzero(labels == c)) >= m]
        if len(self.by_class) < nc:
            raise ConfigError(
                f"method.classes_per_batch={nc}: only {len(self.by_class)} classes have >= {m} training "
                f"examples (method.per_class); set method.classes_per_batch<={len(self.by_class)}"
            )
        self.nc, self.m, self.seed = nc, m, list(np.atleast_1d(seed))

    def batch(self, i: int) -> np.ndarray:
        rng = np.random.default_rng([*self.seed, i])
        classes = rng.choice(len(self.by_class), self.nc, replace=False)
        return np.stack([rng.choice(self.by_class[c], self.m, replace=False) for c in classes])

    def stream(self, start: int, stop: int) -> list[torch.Tensor]:
        """Flat index batches start..stop-1 (class-major), for `runner.train.batches`."""
        return [torch.as_tensor(self.batch(i).ravel()) for i in range(start, stop)]


def hash_step(net, optimizer, x, *, nc, m, k, d, ks, method, beta, margin, l2_reg, remap):
    """One iteration of Alg. 1 on a batch x of nc classes x m examples (class-major); labels per
    level are the code ids (`remap`) or the classes. Returns (loss, seconds spent on codes)."""
    out = net(x).view(nc, m, k, d)
    unary = hh.class_unaries(out, method.loss).cpu().numpy()  # on the device; the copy waits for it
    start = time.perf_counter()
    codes = hh.cascade_codes(unary, ks, method.alpha, beta, method.solver, method.cost_scale)
    labels = hh.level_labels(codes, remap)
    code_seconds = time.perf_counter() - start
    loss = hh.hash_loss(out, codes, labels, method.loss, margin, l2_reg)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss.item(), code_seconds


def base_step(net, optimizer, x, *, nc, m, method):
    """One metric-learning step of the base embedding (N-pairs, or semi-hard triplet on the sphere)."""
    emb = net(x).view(nc, m, -1)
    labels = torch.arange(nc, device=emb.device)
    if method.base_loss == "npairs":
        loss = hh.npairs_loss(emb[:, 0], emb[:, 1], labels, method.base_l2)
    else:
        unit = F.normalize(emb.reshape(nc * m, -1), dim=1)
        dist = torch.cdist(unit, unit) ** 2
        loss = hh.triplet_semihard_loss(dist, labels.repeat_interleave(m), method.base_margin)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss.item(), 0.0


def outputs(net, split, ctx, batch_size, normalize=False) -> np.ndarray:
    """Net outputs for all of a split in eval mode (optionally L2-normalized), as a float64 array."""
    out = predict(net, split, ctx, batch_size)
    return (F.normalize(out, dim=1) if normalize else out).double().numpy()


def lr_schedule(optimizer, decay_at, decay):
    """Stepped once per iteration: iteration i (1-based) runs at lr * decay^#{t in decay_at : t < i}.
    The paper's Cifar-100 rule is decay_at=[20000] over 70k iterations; the authors' code decays
    every 50k ([50000, 100000] over its 300 epochs); ImageNet: every 6k / 10k."""
    return torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=list(decay_at), gamma=decay)


class Trainer:
    """Runs one net's iterations: Adam + step decay, checkpoint/resume, logging, best-val selection."""

    def __init__(self, cfg, ctx, data):
        self.cfg, self.method, self.ctx, self.data = cfg, cfg.method, ctx, data
        self.batch = self.method.classes_per_batch * self.method.per_class
        self.epoch_iters = max(1, math.ceil(len(data.train) / self.batch))  # iterations per epoch

    def run(self, tag, net, param_groups, step, iters, val_score=None) -> dict:
        """Train with `step(optimizer, x) -> (loss, code_seconds)` for `iters` iterations; with
        `val_score` and `eval_every`, keep the weights of the best validation score (the initial
        net included). Returns iterations, timings and the kept net's validation score."""
        method, ctx = self.method, self.ctx
        optimizer = torch.optim.Adam(param_groups)
        scheduler = lr_schedule(optimizer, method.decay_at, method.decay)
        eval_every = (
            max(1, round(method.eval_every * self.epoch_iters)) if method.eval_every > 0 and val_score else 0
        )
        sampler = ClassBalancedSampler(self.data.train.y.numpy(), method.classes_per_batch, method.per_class,
                                       seed=[self.cfg.seed, zlib.crc32(tag.encode())])  # fmt: skip
        path = ctx.dir / "checkpoints" / f"hier_hash_{tag}.pt"
        state = {"iter": 0, "best": (-math.inf, None)}
        if self.cfg.train.checkpoint and path.exists():
            state = torch.load(path, map_location=ctx.device, weights_only=False)
            net.load_state_dict(state["net"])
            optimizer.load_state_dict(state["optimizer"])
            scheduler.load_state_dict(state["scheduler"])
            torch.set_rng_state(state["torch_rng"].cpu())
            log.info("%s: resumed at iteration %d/%d", tag, state["iter"], iters)
        best_score, best_net = state["best"]
        first = state["iter"]  # `state` is replaced by every checkpoint below
        if eval_every and first == 0:  # the authors keep the untrained net unless training beats it
            best_score, best_net = val_score(), copy.deepcopy(net.state_dict())
            ctx.tracker.log({"iter": 0, f"{tag}/val_p@1": best_score})
        net.train()
        total_s = code_s = 0.0
        dataset = self.cfg.dataset
        stream = batches(
            self.data.train, ctx, sampler.stream(first, iters), dataset.augment, dataset.crop_pad
        )
        start = time.perf_counter()
        for done, (x, _) in enumerate(stream, start=first + 1):
            loss, seconds = step(optimizer, x)
            scheduler.step()
            total_s += time.perf_counter() - start
            code_s += seconds
            if done % method.log_every == 0 or done == iters:
                ctx.tracker.log({"iter": done, f"{tag}/loss": loss, f"{tag}/lr": scheduler.get_last_lr()[0]})
            if eval_every and (done % eval_every == 0 or done == iters):
                score = val_score()
                ctx.tracker.log({"iter": done, f"{tag}/val_p@1": score})
                if score > best_score:
                    best_score, best_net = score, copy.deepcopy(net.state_dict())
            if self.cfg.train.checkpoint and (done % method.checkpoint_every == 0 or done == iters):
                state = {"iter": done, "net": net.state_dict(), "optimizer": optimizer.state_dict(),
                         "scheduler": scheduler.state_dict(), "torch_rng": torch.get_rng_state(),
                         "best": (best_score, best_net)}  # fmt: skip
                save_checkpoint(path, state)
            start = time.perf_counter()
        if best_net is not None:
            net.load_state_dict(best_net)
        ran = iters - first
        if ran:
            log.info("%s: %d iterations, %.1f ms each, codes %.0f%% of it", tag, ran, 1e3 * total_s / ran,
                     100 * code_s / max(total_s, 1e-12))  # fmt: skip
        return {
            "iters": iters,
            "seconds": total_s,
            "code_share": code_s / total_s if total_s else float("nan"),
            "val_p@1": best_score if best_net is not None else None,
        }


# --------------------------------------------------------------------------------------------
# Retrieval evaluation
# --------------------------------------------------------------------------------------------


def evaluate_code(table, queries, d, k, ks, table_act, query_act, eval_k) -> dict:
    """Pr@K and SUF@K per K, and NMI of the ks = 1 buckets vs the classes, for one code and table.

    table: `emb` (N, e), `y` (N,), `n_db`; queries: `emb`, `y`, `self_ids` (row in the table or None).
    """
    index = hh.HashIndex(table_act, table["emb"], d, k, ks)
    cell = {"nmi": hh.nmi(hh.bucket_ids(table_act, d, k, 1)[:, 0], table["y"])}
    for K in eval_k:
        neighbors, n_cand = index.search(query_act, queries["emb"], K, queries["self_ids"])
        cell[f"p@{K}"] = hh.precision_at_k(neighbors, queries["y"], table["y"])
        cell[f"suf@{K}"] = hh.speedup_factor(n_cand, table["n_db"])
    return cell


def markdown_table(results, metric, rows, ks_list, eval_k) -> str:
    """Rows = ks, columns = methods; cells 'SUF@K1; P@K1/P@K2/...' (percent) as in the paper."""
    ks_header = "/".join(f"P@{K}" for K in eval_k)
    lines = [
        f"Metric (exhaustive, SUF 1): {ks_header} = " + "/".join(f"{100 * metric[K]:.1f}" for K in eval_k),
        "",
        f"| ks | {' | '.join(rows)} |",
        "|---" * (len(rows) + 1) + "|",
    ]
    for ks in ks_list:
        cells = [
            f"{r[f'suf@{eval_k[0]}']:.1f}; " + "/".join(f"{100 * r[f'p@{K}']:.1f}" for K in eval_k)
            if (r := results.get((row, ks))) is not None
            else "-"
            for row in rows
        ]
        lines.append(f"| {ks} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# The task
# --------------------------------------------------------------------------------------------


def base_embedding(cfg, ctx, data, trainer):
    """(embed(split) -> (N, e) array, backbone the hash nets start from, input normalisation)."""
    method = cfg.method
    batch_size = cfg.train.eval_batch_size
    backbone = build_model(cfg.model, data.input_shape, data.num_classes).to(ctx.device)
    if method.base == "raw":
        return (lambda split: outputs(nn.Flatten(), split, ctx, batch_size)), backbone, None
    input_norm = pixel_mean_input(data, ctx, batch_size) if method.input_norm == "pixel_mean" else None
    base = EmbeddingNet(backbone, method.base_dim, input_norm=input_norm).to(ctx.device)
    if method.base_checkpoint:
        base.load_state_dict(torch.load(method.base_checkpoint, map_location=ctx.device, weights_only=True))
    else:
        step = partial(base_step, base, nc=method.classes_per_batch, m=method.per_class, method=method)
        groups = [{"params": base.parameters(), "lr": method.base_lr}]
        trainer.run("base", base, groups, step, method.base_iters)
        save_checkpoint(ctx.dir / "checkpoints" / "hier_hash_base_final.pt", base.state_dict())
    base.requires_grad_(False)
    normalize = method.base_loss == "triplet"
    return (lambda split: outputs(base, split, ctx, batch_size, normalize)), base.backbone, base.input_norm


def hash_nets(method) -> list[tuple]:
    """(row, d, k, remap, beta, margin, N-pairs lambda) of every net to train: ours, and [11]
    (single-level codes on class labels, Jeong & Song 2018, with its own settings)."""
    nets = [("ours", method.d, method.k, method.remap, method.beta, method.margin, method.npairs_l2)]
    if "level1" in method.baselines:
        nets += [
            (f"k1-d{d1}", d1, 1, False, method.level1_beta, method.level1_margin, method.level1_npairs_l2)
            for d1 in (method.level1_d or [method.d * method.k])
        ]
    return nets


def train_hash_nets(cfg, ctx, data, trainer, embed, backbone, input_norm, splits):
    """Codes {(row, ks): (d, k, {split name: activations})} of every trained hash net, and timings."""
    method = cfg.method
    batch_size = cfg.train.eval_batch_size
    val_emb = embed(data.val) if len(data.val) >= 2 else None
    codes, timing = {}, {}
    for row, d, k, remap, betas, margins, l2s in hash_nets(method):
        for i, ks in enumerate(method.ks):
            net = EmbeddingNet(copy.deepcopy(backbone), d * k, 0.01, copy.deepcopy(input_norm)).to(ctx.device)
            net.backbone.requires_grad_(method.lr_backbone > 0)
            groups = [{"params": net.head.parameters(), "lr": method.lr_head}]
            if method.lr_backbone > 0:
                groups.append({"params": net.backbone.parameters(), "lr": method.lr_backbone})
            beta, margin, l2_reg = (per_ks(values, i) for values in (betas, margins, l2s))
            step = partial(hash_step, net, nc=method.classes_per_batch, m=method.per_class, k=k, d=d, ks=ks,
                           method=method, beta=beta, margin=margin, l2_reg=l2_reg, remap=remap)  # fmt: skip

            def val_score(net=net, d=d, k=k, ks=ks):
                act, y = outputs(net, data.val, ctx, batch_size), data.val.y_clean.numpy()
                neighbors, _ = hh.HashIndex(act, val_emb, d, k, ks).search(act, val_emb, 1, np.arange(len(y)))
                return hh.precision_at_k(neighbors, y, y)

            tag = f"{row}_ks{ks}"
            timing[tag] = trainer.run(
                tag, net, groups, step, method.iters, val_score if val_emb is not None else None
            )
            if val_emb is not None and timing[tag]["val_p@1"] is None:
                timing[tag]["val_p@1"] = val_score()
            codes[(row, ks)] = (
                d,
                k,
                {name: outputs(net, split, ctx, batch_size) for name, split in splits.items()},
            )
    return codes, timing


def baseline_codes(cfg, emb, embed_train):
    """Th, VQ and LSH codes from the base embedding, {(row, ks): (d, 1, {split name: activations})}.

    VQ's k-means runs on the training set's base embedding, `embed_train()`. LSH is reported at ks=1
    only, as the paper.
    """
    from sklearn.cluster import KMeans

    method = cfg.method
    codes = {}
    if "th" in method.baselines:
        codes.update({("Th", ks): (emb["test"].shape[1], 1, emb) for ks in method.ks})
    if "vq" in method.baselines:
        train_emb = embed_train()
        for n in method.vq_centroids or [method.d, method.d**method.k]:
            kmeans = KMeans(n, n_init=1, random_state=cfg.seed).fit(train_emb)
            act = {name: -(kmeans.transform(e) ** 2) for name, e in emb.items()}
            codes.update({(f"VQ-{n}", ks): (n, 1, act) for ks in method.ks})
    if "lsh" in method.baselines and 1 in method.ks:
        for n in method.lsh_bits or [max(1, round(math.log2(method.d * method.k)))]:
            act = {name: hh.lsh_activations(e, n, seed=cfg.seed) for name, e in emb.items()}
            codes[(f"LSH-{n}", 1)] = (2**n, 1, act)
    return codes


def run(cfg, ctx) -> dict:
    method = cfg.method
    if ctx.distributed:
        raise ConfigError("method=hier_hash trains on one device; use hardware=cpu or hardware=gpu")
    data = load_data(cfg.dataset, cfg.seed)
    if len(data.test) < 2:
        raise ConfigError("method=hier_hash needs a test split of at least 2 items")
    trainer = Trainer(cfg, ctx, data)
    embed, backbone, input_norm = base_embedding(cfg, ctx, data, trainer)
    splits = {name: getattr(data, name) for name in ("test", *method.tables)}
    emb = {name: embed(split) for name, split in splits.items()}
    codes, timing = train_hash_nets(cfg, ctx, data, trainer, embed, backbone, input_norm, splits)
    codes.update(baseline_codes(cfg, emb, lambda: emb["train"] if "train" in emb else embed(data.train)))

    summary, report = {}, []
    queries = {"emb": emb["test"], "y": data.test.y_clean.numpy()}
    for table_name in method.tables:
        is_test = table_name == "test"
        table = {"emb": emb[table_name], "y": splits[table_name].y_clean.numpy()}
        table["n_db"] = len(table["y"]) - is_test
        queries["self_ids"] = np.arange(len(queries["y"])) if is_test else None
        metric = {}
        for K in method.eval_k:
            neighbors = hh.exhaustive_search(queries["emb"], table["emb"], K, queries["self_ids"])
            metric[K] = hh.precision_at_k(neighbors, queries["y"], table["y"])
            summary[f"hash/{table_name}/metric/p@{K}"] = metric[K]
        results = {}
        for (row, ks), (d, k, act) in codes.items():
            results[(row, ks)] = evaluate_code(
                table, queries, d, k, ks, act[table_name], act["test"], method.eval_k
            )
            summary.update(
                {f"hash/{table_name}/{row}/ks{ks}/{key}": v for key, v in results[(row, ks)].items()}
            )
        rows = list(dict.fromkeys(row for row, _ in codes))
        report.append(f"### queries: test, table: {table_name}\n\n"
                      + markdown_table(results, metric, rows, method.ks, method.eval_k))  # fmt: skip

    first, ks0 = method.tables[0], method.ks[0]
    for key, value in list(summary.items()):
        if key.startswith(f"hash/{first}/ours/ks{ks0}/"):
            summary["test/" + key.rsplit("/", 1)[1]] = value
        elif key.startswith(f"hash/{first}/metric/"):
            summary["test/metric_" + key.rsplit("/", 1)[1]] = value
    if timing[f"ours_ks{ks0}"]["val_p@1"] is not None:  # the score model selection and searches use
        summary["val/p@1"] = timing[f"ours_ks{ks0}"]["val_p@1"]
    summary["time/mcf_share"] = timing[f"ours_ks{ks0}"]["code_share"]
    summary["time/train_s"] = sum(t["seconds"] for t in timing.values())
    text = "\n\n".join(report) + "\n"
    if ctx.is_main:
        (ctx.dir / "retrieval.md").write_text(text)
    log.info("retrieval (cells: SUF@%d; P@K in %%):\n%s", method.eval_k[0], text)
    return summary
