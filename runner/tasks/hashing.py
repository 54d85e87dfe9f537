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
   epochs, and the best-validation weights are kept (the authors' model selection). Every net trains
   through `runner.train.fit` (`runner.hooks.hier_hash.HashHooks`), checkpointed and resumed as
   `checkpoints/<net>.pt` (net: base, ours_ks<ks>, k1-d<d>_ks<ks>), its rows `<net>/...` in metrics.
   Under DDP each rank forwards a slice of the batch and the loss is that of the gathered batch.
3. Retrieval for each ks and K: a hash table of `tables` (test: test items, query excluded;
   train: train items), queried with the test set, candidates reranked by Euclidean distance in
   the base embedding. Rows: exhaustive search (Metric), and each of `baselines`: Th (top-ks dims
   of the base embedding), VQ-m (ks nearest of m k-means centroids, m in `vq_centroids`, fit on the
   train split; VQ-test-m: on the test split, with `vq_fit: [train, test]`), [11] =
   k=1 codes trained on class labels as Jeong & Song 2018 (d in `level1_d`, their `level1_*`
   settings), LSH-n (n-bit random-hyperplane codes of the base embedding, ks=1 as the paper), DCH-n
   (Deep Cauchy Hashing, Cao et al. 2018: a hash net of n outputs trained on DCH's pairwise Cauchy loss
   with the hash nets' batches and schedule, its bucket the sign pattern of the tanh codes; ks=1).

Summary: `test/p@K`, `test/suf@K`, `test/nmi` for the hierarchical codes at the first ks on the
first table, `test/metric_p@K` for exhaustive search, `val/p@1` (the selection score, with a
validation split), every cell under `hash/<table>/<row>/ks<ks>/`, and `time/mcf_share` (the
min-cost flow's share of a training iteration). The tables also go to `retrieval.md` in the run dir.
"""

from __future__ import annotations

import copy
import logging
import zlib
from functools import partial

import numpy as np
import torch
from torch import nn

from runner.checkpoint import checkpoint_file, save_checkpoint
from runner.checks import ConfigError
from runner.configs.hashing import METHODS, PER_KS, HierHashConfig  # noqa: F401  (tests import them here)
from runner.data import load_data
from runner.hooks.hier_hash import (
    CodesLoss,
    HashHooks,
    base_loss,
    baseline_codes,
    bucket_bits,
    dch_batch_loss,
    outputs,
    pixel_mean_input,
    retrieval_tables,
    train_config,
    val_precision,
    vq_centroid_counts,
)
from runner.methods import hier_hash as hh
from runner.models import build_model
from runner.models.hashing import EmbeddingNet
from runner.task import Task
from runner.train import fit

log = logging.getLogger(__name__)


def smoke(cfg) -> None:
    """`+debug=smoke`: the nets of the first `ks` only, each trained `debug.max_batches` iterations of at
    most 4 classes (the training subset keeps `per_class` samples of every class)."""
    method, most = cfg.method, cfg.debug.max_batches
    cfg.dataset.min_per_class = max(cfg.dataset.min_per_class, method.per_class)
    method.ks = method.ks[:1]
    for key in PER_KS:
        method[key] = method[key][:1]
    method.iters, method.base_iters = min(method.iters, most), min(method.base_iters, most)
    method.classes_per_batch = min(method.classes_per_batch, 4)
    method.decay_at = [i for i in method.decay_at if i <= method.iters]
    # k-means of the VQ baselines runs on the (smoke-sized) training or test set: no more centroids
    # than samples
    sizes = [cfg.dataset.max_train] + ([cfg.dataset.max_eval] if "test" in method.vq_fit else [])
    points = min(sizes)
    method.vq_centroids = [max(min(n, points), max(method.ks)) for n in vq_centroid_counts(method)]


def per_ks(values, i):
    """The value for the i-th ks: one shared value, or one per ks."""
    return values[0] if len(values) == 1 else values[i]


def train_net(cfg, ctx, data, tag, net, param_groups, loss, iters, val_score=None) -> dict:
    """Train `net` with `loss(net, x) -> (loss, code seconds)` for `iters` iterations through
    `runner.train.fit` (checkpoint `checkpoints/<tag>.pt`, rows `<tag>/...`); with `val_score` and
    `method.eval_every`, the best-validation net is kept. Returns its timings and validation score."""
    seed = [cfg.seed, zlib.crc32(tag.encode())]
    hooks = HashHooks(cfg.method, data.train.y.numpy(), seed, param_groups, loss, ctx, iters, val_score)
    train = train_config(cfg.train, hooks)
    metrics = fit(net, data, train, ctx, hooks, augment=cfg.dataset.augment, tag=tag)
    seconds = metrics["time/train_total_s"]
    score = metrics.get("val/p@1")
    if score is None and val_score is not None:  # a validation split but no selection: score the net
        score = val_score()
    return {"seconds": seconds, "code_share": hooks.code_seconds / seconds if seconds else float("nan"),
            "val_p@1": score}  # fmt: skip


def base_embedding(cfg, ctx, data):
    """(embed(split) -> (N, e) array, backbone the hash nets start from, input normalisation)."""
    method = cfg.method
    batch_size = cfg.train.eval_batch_size
    backbone = build_model(cfg.model, data.input_shape, data.num_classes).to(ctx.device)
    if method.base == "raw":
        return (lambda split: outputs(nn.Flatten(), split, ctx, batch_size)), backbone, None
    input_norm = pixel_mean_input(data, ctx, batch_size) if method.input_norm == "pixel_mean" else None
    base = EmbeddingNet(backbone, method.base_dim, input_norm=input_norm).to(ctx.device)
    if method.base_checkpoint:
        state = torch.load(method.base_checkpoint, map_location=ctx.device, weights_only=True)
        # files saved before the embedding net dropped its backbone's unused class layer still load
        base.load_state_dict({k: v for k, v in state.items() if not k.startswith("backbone.classifier.")})
    else:
        shape = dict(nc=method.classes_per_batch, m=method.per_class, method=method)
        groups = [{"params": base.parameters(), "lr": method.base_lr}]
        train_net(cfg, ctx, data, "base", base, groups, lambda net, x: (base_loss(net, x, **shape), 0.0),
                  method.base_iters)  # fmt: skip
        if ctx.is_main:
            save_checkpoint(ctx.dir / checkpoint_file("hier_hash_base_final"), base.state_dict())
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


def new_hash_net(method, backbone, input_norm, n_outputs, device):
    """A copy of the backbone + Linear(feature_dim -> n_outputs) (std 0.01), and its Adam parameter groups
    (the head at lr_head, the backbone at lr_backbone, frozen at 0)."""
    net = EmbeddingNet(copy.deepcopy(backbone), n_outputs, 0.01, copy.deepcopy(input_norm)).to(device)
    net.backbone.requires_grad_(method.lr_backbone > 0)
    groups = [{"params": net.head.parameters(), "lr": method.lr_head}]
    if method.lr_backbone > 0:
        groups.append({"params": net.backbone.parameters(), "lr": method.lr_backbone})
    return net, groups


def train_hash_nets(cfg, ctx, data, embed, backbone, input_norm, splits):
    """Codes {(row, ks): (d, k, {split name: activations})} of every trained hash net, and timings."""
    method = cfg.method
    batch_size = cfg.train.eval_batch_size
    val_emb = embed(data.val) if len(data.val) >= 2 else None
    codes, timing = {}, {}
    for row, d, k, remap, betas, margins, l2s in hash_nets(method):
        for i, ks in enumerate(method.ks):
            net, groups = new_hash_net(method, backbone, input_norm, d * k, ctx.device)
            beta, margin, l2_reg = (per_ks(values, i) for values in (betas, margins, l2s))
            loss = CodesLoss(ctx.autocast, nc=method.classes_per_batch, m=method.per_class, k=k, d=d, ks=ks,
                             method=method, beta=beta, margin=margin, l2_reg=l2_reg, remap=remap)  # fmt: skip

            def val_score(net=net, d=d, k=k, ks=ks):
                act = outputs(net, data.val, ctx, batch_size)
                return val_precision(act, val_emb, data.val.y_clean.numpy(), d, k, ks)

            tag = f"{row}_ks{ks}"
            score = val_score if val_emb is not None else None
            timing[tag] = train_net(cfg, ctx, data, tag, net, groups, loss, method.iters, score)
            act = {name: outputs(net, split, ctx, batch_size) for name, split in splits.items()}
            codes[(row, ks)] = (d, k, act)
    return codes, timing


def train_dch_nets(cfg, ctx, data, backbone, input_norm, splits):
    """Codes {("DCH-<n>", 1): (2^n, 1, {split name: activations})} of the Deep Cauchy Hashing nets (n in
    `dch_bits`, ks=1 as the paper), trained on `hh.dch_loss` with the hash nets' batches and schedule,
    without model selection; an item's bucket is the sign pattern of its code. And their timings."""
    method = cfg.method
    codes, timing = {}, {}
    if "dch" not in method.baselines or 1 not in method.ks:
        return codes, timing
    shape = dict(nc=method.classes_per_batch, m=method.per_class)
    for n in method.dch_bits or [bucket_bits(method)]:
        net, groups = new_hash_net(method, backbone, input_norm, n, ctx.device)
        loss = partial(dch_batch_loss, **shape, gamma=method.dch_gamma, quantization=method.dch_quantization)
        tag = f"DCH-{n}"
        with_no_code_time = partial(lambda net, x, loss: (loss(net, x), 0.0), loss=loss)
        timing[tag] = train_net(cfg, ctx, data, tag, net, groups, with_no_code_time, method.iters)
        act = {
            name: hh.sign_activations(np.tanh(outputs(net, split, ctx, cfg.train.eval_batch_size)))
            for name, split in splits.items()
        }
        codes[(tag, 1)] = (2**n, 1, act)
    return codes, timing


def check_vq_centroids(method, data) -> None:
    """Before any training: the VQ baseline's k-means fits at most as many centroids as the points of
    each split it is fit on (`method.vq_fit`); ConfigError with centroid counts that fit."""
    if "vq" not in method.baselines:
        return
    centroids = vq_centroid_counts(method)
    default = "" if method.vq_centroids else " (the default [d, d^k])"
    for split in method.vq_fit:
        n = len(getattr(data, split))
        if max(centroids) > n:
            fitted = sorted({min(c, n) for c in centroids})
            fix = f"set method.vq_centroids={fitted}" if max(method.ks) <= n else "use a larger split"
            raise ConfigError(
                f"method.vq_centroids={centroids}{default}: the VQ baseline's k-means has only the {n} "
                f"{split} points to place them; {fix}, or leave vq out of method.baselines"
            )


def run(cfg, ctx) -> dict:
    method = cfg.method
    per_batch = method.classes_per_batch * method.per_class
    if per_batch % ctx.world_size:
        raise ConfigError(
            f"method.classes_per_batch x method.per_class = {per_batch}: a batch must split evenly over "
            f"{ctx.world_size} ranks (hardware=ddp)"
        )
    data = load_data(cfg.dataset, cfg.seed)
    if len(data.test) < 2:
        raise ConfigError("method=hier_hash needs a test split of at least 2 items")
    check_vq_centroids(method, data)
    embed, backbone, input_norm = base_embedding(cfg, ctx, data)
    splits = {name: getattr(data, name) for name in ("test", *method.tables)}
    emb = {name: embed(split) for name, split in splits.items()}
    codes, timing = train_hash_nets(cfg, ctx, data, embed, backbone, input_norm, splits)
    dch_codes, dch_timing = train_dch_nets(cfg, ctx, data, backbone, input_norm, splits)
    codes.update(dch_codes)
    timing.update(dch_timing)
    train_emb = (lambda: emb["train"]) if "train" in emb else partial(embed, data.train)
    codes.update(baseline_codes(method, cfg.seed, emb, train_emb))
    summary, report = retrieval_tables(codes, emb, splits, method.tables, method.eval_k, method.ks)

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


TASK = Task("hashing", ("test/p@1", "max"), run, smoke=smoke)
