"""Training-time and evaluation code of the hierarchical hash (`runner.tasks.hashing`) around the library
`runner.methods.hier_hash`: the per-iteration loss (Alg. 1), `runner.train.fit` hooks that train a
net by iterations on class-balanced batches, and the retrieval evaluation of codes and its table."""

from __future__ import annotations

import contextlib
import copy
import math
import time

import numpy as np
import torch
import torch.nn.functional as F

from runner.batches import batches, in_order
from runner.checks import ConfigError
from runner.data.samplers import ClassBalancedEpochs, ClassBalancedSampler
from runner.distributed_passes import global_batch, predict_all
from runner.hardware import to_device
from runner.method_hooks import MethodHooks
from runner.methods import hier_hash as hh
from runner.models.hashing import PixelMeanInput
from runner.optim import adam_kernel


def hash_loss_and_codes(net, x, *, nc, m, k, d, ks, method, beta, margin, l2_reg, remap):
    """Alg. 1's loss on a batch x of nc classes x m examples (class-major): class-mean unaries per
    level -> exact codes by min-cost flow, level by level -> labels per level (the code ids with
    `remap`, else the classes) -> `hh.hash_loss` on the active dims. Returns (loss, seconds on codes).
    Under DDP x is this rank's slice of the batch: the loss and codes are those of the gathered batch.
    The flow runs on the host: the step reads the unaries, its one wait for the device, and sends codes
    and labels back in one copy the host does not wait for (`runner.hardware.to_device`). The same three
    parts as `CodesLoss`, whose step is split around that read."""
    out, unary = hash_unaries(net, x, nc=nc, m=m, k=k, d=d, method=method)
    packed, code_seconds = hash_codes(unary.cpu().numpy(), ks=ks, method=method, beta=beta, remap=remap)
    return codes_loss(out, to_device(packed, out.device), method, margin, l2_reg), code_seconds


def hash_unaries(net, x, *, nc, m, k, d, method):
    """The device work of Alg. 1 up to its host read: the net's outputs (nc, m, k, d) of the (gathered)
    batch and their class-mean unaries per level."""
    (out,) = global_batch(net(x))
    out = out.view(nc, m, k, d)
    return out, hh.class_unaries(out.float(), method.loss)


def hash_codes(unary: np.ndarray, *, ks, method, beta, remap) -> tuple[torch.Tensor, float]:
    """On the host: the exact codes of the unaries (`hh.cascade_codes`) and their labels per level, packed
    as one int64 tensor (..., d + 1) [codes, label] for one copy to the device; and the seconds it took."""
    start = time.perf_counter()
    codes = hh.cascade_codes(
        unary, ks, method.alpha, beta, method=method.solver, cost_scale=method.cost_scale
    )
    labels = hh.level_labels(codes, remap)
    code_seconds = time.perf_counter() - start
    return torch.from_numpy(
        np.concatenate([codes, labels[..., None]], axis=-1).astype(np.int64)
    ), code_seconds


def codes_loss(out, packed, method, margin, l2_reg):
    """`hh.hash_loss` of the outputs (nc, m, k, d) with the codes and labels `hash_codes` packed."""
    d = out.shape[-1]
    return hh.hash_loss(out, packed[..., :d], packed[..., d], method.loss, margin, l2_reg)


class CodesLoss:
    """Alg. 1's loss of one hash net (the keywords of `hash_loss_and_codes` bound), called whole as
    (net, x) -> (loss, code seconds), or in the parts of a step split around its host read (`HashHooks`):
    `hash_unaries` under the step's `autocast`, `hash_codes`, `codes_loss`."""

    def __init__(self, autocast=contextlib.nullcontext, **keywords):
        self.autocast, self.keywords = autocast, keywords

    def __call__(self, net, x):
        return hash_loss_and_codes(net, x, **self.keywords)

    def unaries(self, net, x):
        shape = {key: self.keywords[key] for key in ("nc", "m", "k", "d", "method")}
        with self.autocast():
            return hash_unaries(net, x, **shape)

    def codes(self, unary: np.ndarray) -> tuple[torch.Tensor, float]:
        return hash_codes(unary, **{key: self.keywords[key] for key in ("ks", "method", "beta", "remap")})

    def loss(self, out, packed):
        kw = self.keywords
        return codes_loss(out, packed, kw["method"], kw["margin"], kw["l2_reg"])


def base_loss(net, x, *, nc, m, method):
    """The base embedding's metric loss: N-pairs, or semi-hard triplet on the unit sphere (of the gathered
    batch under DDP, as `hash_loss_and_codes`)."""
    (emb,) = global_batch(net(x))
    emb = emb.view(nc, m, -1)
    labels = torch.arange(nc, device=emb.device)
    if method.base_loss == "npairs":
        return hh.npairs_loss(emb[:, 0], emb[:, 1], labels, method.base_l2)
    unit = F.normalize(emb.reshape(nc * m, -1), dim=1)
    return hh.triplet_semihard_loss(
        torch.cdist(unit, unit) ** 2, labels.repeat_interleave(m), method.base_margin
    )


def dch_batch_loss(net, x, *, nc, m, gamma, quantization):
    """Deep Cauchy Hashing's loss (`hh.dch_loss`) of the net's tanh codes on a batch of nc classes x m
    examples (class-major; of the gathered batch under DDP, as `hash_loss_and_codes`)."""
    (out,) = global_batch(net(x))
    labels = torch.arange(nc, device=out.device).repeat_interleave(m)
    return hh.dch_loss(torch.tanh(out.float()), labels, gamma, quantization)


def hash_step(net, optimizer, x, **kwargs):
    """One iteration of Alg. 1 (`hash_loss_and_codes`, then an optimizer step): (loss, code seconds)."""
    loss, code_seconds = hash_loss_and_codes(net, x, **kwargs)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss.item(), code_seconds


def lr_schedule(optimizer, decay_at, decay):
    """Stepped once per iteration: iteration i (1-based) runs at lr * decay^#{t in decay_at : t < i}.
    The paper's Cifar-100 rule is decay_at=[20000] over 70k iterations; the authors' code decays
    every 50k ([50000, 100000] over its 300 epochs); ImageNet: every 6k / 10k."""
    return torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=list(decay_at), gamma=decay)


class HashHooks(MethodHooks):
    """`runner.train.fit` hooks training one net for `method.iters` (or `iters`) iterations: batches of
    `classes_per_batch` x `per_class` (`ClassBalancedSampler`, seeded by `seed`), `loss(net, x)` per
    batch, Adam on `param_groups` (fused where `ctx` fuses optimizers) with the step decay over
    iterations. With `val_score` (a function of nothing, higher is better), `evaluate` reports it as
    `val/p@1` and fit keeps the best net; the epoch is then `method.eval_every` training epochs long, else
    one pass over the training set. `code_seconds` adds up the time spent on the codes; each epoch's is
    logged as `time/code_s`. A `CodesLoss` splits the step around its host read (`read`: the forward to
    the unaries; `solve`: the codes; `loss`: the hash loss with them); the base and DCH losses are device
    work alone."""

    capturable = True  # device work but the codes' read, whose flow `solve` runs between the two graphs

    def __init__(self, method, labels, seed, param_groups, loss, ctx, iters=None, val_score=None):
        self.method, self.param_groups, self._loss, self.val_score = method, param_groups, loss, val_score
        self.fused = ctx.fused_optimizer  # Adam as one kernel, its step count on the device
        # Under DDP the forward must run through the DDP net, whose backward all-reduces the gradients;
        # the loop's `read` takes the plain network: the loss runs whole there (never captured under DDP).
        self.split = not ctx.distributed
        self.iters = iters or method.iters
        self.per_batch = method.classes_per_batch * method.per_class
        self.sampler = ClassBalancedSampler(labels, method.classes_per_batch, method.per_class, seed)
        epoch_iters = max(1, math.ceil(len(labels) / self.per_batch))  # one pass over the training set
        self.select = None
        if val_score is not None and method.eval_every > 0:
            epoch_iters = max(1, round(method.eval_every * epoch_iters))
            self.select = ("val/p@1", "max")  # the authors' model selection
        self.epoch_iters = epoch_iters
        self.code_seconds = self.epoch_code_seconds = 0.0

    @property
    def epochs(self) -> int:
        return math.ceil(self.iters / self.epoch_iters)

    def batch_setting(self, epoch) -> str:
        """The setting that sizes the batches (named when they run out of memory)."""
        method = self.method
        return f"method.classes_per_batch={method.classes_per_batch} (x method.per_class={method.per_class})"

    def batch_sampler(self, default):
        rank, world_size = default.rank, default.world_size  # fit's own sampler knows this process's shard
        return ClassBalancedEpochs(self.sampler, self.epoch_iters, self.iters, rank, world_size)

    def optimizer(self, model):
        optimizer = torch.optim.Adam(self.param_groups, **adam_kernel(self.fused))
        return optimizer, lr_schedule(optimizer, self.method.decay_at, self.method.decay), True

    @property
    def read(self):
        """`CodesLoss`'s forward to the unaries, kept for `loss`; None for a loss without a host read (and
        under DDP)."""
        return self._unaries if self.split and isinstance(self._loss, CodesLoss) else None

    def _unaries(self, x, y_soft, idx, model):
        self._out, unary = self._loss.unaries(model, x)
        return (unary,)

    def solve(self, unary):
        packed, code_seconds = self._loss.codes(unary.numpy())
        self._count(code_seconds)
        return (packed,)

    def loss(self, net, x, y_soft, idx, epoch, solved=None):
        if solved is not None:  # the step's second part: the outputs `read` kept, the codes `solve` found
            out, self._out = self._out, None
            return self._loss.loss(out, *solved)
        loss, code_seconds = self._loss(net, x)
        self._count(code_seconds)
        return loss

    def _count(self, code_seconds: float) -> None:
        self.code_seconds += code_seconds
        self.epoch_code_seconds += code_seconds

    def evaluate(self, model):
        out = {"time/code_s": self.epoch_code_seconds}
        self.epoch_code_seconds = 0.0
        return out | ({"val/p@1": self.val_score()} if self.select is not None else {})


def train_config(train, hooks: HashHooks):
    """`train` (the run's `TrainConfig`) set to the hooks' epochs and batch, without lr warm-up."""
    train = copy.copy(train)
    train.epochs, train.batch_size, train.warmup_epochs = hooks.epochs, hooks.per_batch, 0
    return train


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


def outputs(net, split, ctx, batch_size, normalize=False) -> np.ndarray:
    """Net outputs for all of a split in eval mode (optionally L2-normalized), as a float64 array; under
    DDP each rank predicts its shard and every rank gets all."""
    out = predict_all(net, split, ctx, batch_size)
    return (F.normalize(out, dim=1) if normalize else out).double().numpy()


def val_precision(act, emb, y, d, k, ks) -> float:
    """Hash Pr@1 of the validation set against itself (query excluded): the model-selection score."""
    neighbors, _ = hh.HashIndex(act, emb, d, k, ks).search(act, emb, 1, np.arange(len(y)))
    return hh.precision_at_k(neighbors, y, y)


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


def retrieval_tables(codes, emb, splits, tables, eval_k, ks_list) -> tuple[dict, list[str]]:
    """Exhaustive search and every code `{(row, ks): (d, k, {split: activations})}` queried with the test
    set on each table: (`hash/<table>/<row>/ks<ks>/<metric>` and `hash/<table>/metric/p@K`, one
    markdown table per table)."""
    summary, report = {}, []
    queries = {"emb": emb["test"], "y": splits["test"].y_clean.numpy()}
    for table_name in tables:
        is_test = table_name == "test"
        table = {"emb": emb[table_name], "y": splits[table_name].y_clean.numpy()}
        table["n_db"] = len(table["y"]) - is_test
        queries["self_ids"] = np.arange(len(queries["y"])) if is_test else None
        metric = {}
        for K in eval_k:
            neighbors = hh.exhaustive_search(queries["emb"], table["emb"], K, queries["self_ids"])
            metric[K] = hh.precision_at_k(neighbors, queries["y"], table["y"])
            summary[f"hash/{table_name}/metric/p@{K}"] = metric[K]
        results = {}
        for (row, ks), (d, k, act) in codes.items():
            results[(row, ks)] = evaluate_code(table, queries, d, k, ks, act[table_name], act["test"], eval_k)
            summary.update(
                {f"hash/{table_name}/{row}/ks{ks}/{key}": v for key, v in results[(row, ks)].items()}
            )
        rows = list(dict.fromkeys(row for row, _ in codes))
        report.append(f"### queries: test, table: {table_name}\n\n"
                      + markdown_table(results, metric, rows, ks_list, eval_k))  # fmt: skip
    return summary, report


def bucket_bits(method) -> int:
    """The bits of the LSH and DCH baselines' codes by default: 2^n = d*k buckets, as the paper."""
    return max(1, round(math.log2(method.d * method.k)))


def vq_centroid_counts(method) -> list[int]:
    """The VQ baseline's centroid counts: `method.vq_centroids`, else [d, d^k] (as many as the hash
    codes' outputs per level, and as their buckets)."""
    return list(method.vq_centroids) or [method.d, method.d**method.k]


def baseline_codes(method, seed, emb, embed_train):
    """Th, VQ and LSH codes from the base embedding, {(row, ks): (d, 1, {split name: activations})}.

    VQ's k-means runs on the base embedding of each split of `method.vq_fit`: the training set's,
    `embed_train()` (rows VQ-<n>), the test set's (rows VQ-test-<n>). LSH is reported at ks=1 only, as
    the paper.
    """
    from sklearn.cluster import KMeans

    codes = {}
    if "th" in method.baselines:
        codes.update({("Th", ks): (emb["test"].shape[1], 1, emb) for ks in method.ks})
    if "vq" in method.baselines:
        fit_on = {"train": ("VQ", embed_train), "test": ("VQ-test", lambda: emb["test"])}
        for prefix, embedding in (fit_on[split] for split in method.vq_fit):
            fit_emb = embedding()
            for n in vq_centroid_counts(method):
                kmeans = KMeans(n, n_init=1, random_state=seed).fit(fit_emb)
                act = {name: -(kmeans.transform(e) ** 2) for name, e in emb.items()}
                codes.update({(f"{prefix}-{n}", ks): (n, 1, act) for ks in method.ks})
    if "lsh" in method.baselines and 1 in method.ks:
        for n in method.lsh_bits or [bucket_bits(method)]:
            act = {name: hh.lsh_activations(e, n, seed=seed) for name, e in emb.items()}
            codes[(f"LSH-{n}", 1)] = (2**n, 1, act)
    return codes
