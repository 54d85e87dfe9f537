"""The mixup family in training: `MixupHooks` plugs the batch transforms of `runner.methods.mixup`
and `runner.methods.comixup` into `runner.train.fit` (the hook protocol of `runner.method_hooks.MethodHooks`).

One step, as in the Co-Mixup / Puzzle Mix code:
1. clean pass (when `clean_lam` > 0 or the method needs saliency): forward the clean batch under the
   step's autocast, take the gradient of L_clean = c * CE (c = 2 clean_lam / K with the BCE loss,
   clean_lam with CE) with respect to the input (the saliency) and to the weights, in one backward
   (unscaled: with fp16 small gradients may underflow; bf16 and fp32 are safe). The weight gradient is
   kept and enters the step through the loss hook. With clean_lam = 0 the saliency comes from an
   eval-mode pass and no weight gradient is kept.
2. mix the batch under no_grad. Co-Mixup with a `ComixupPool` (and `overlap`) splits the backward of
   step 1: the input gradient first, the partitions go to the workers, and the weight gradient is taken
   while they solve (the same numbers as one backward). The input-gradient backward passes every layer's
   activation gradient; `ActivationGradients` keeps those of the layers that own weights and forms the
   weight gradients from them, layer by layer, rather than a second backward through the network.
   With `lag` the workers solve through the next step instead, which trains on this batch's mix;
3. loss on the mixed batch: soft-target CE, or BCE(softmax(logits), y~) averaged over B*K (`bce`,
   the authors' choice), plus the clean term, whose kept weight gradient enters the mixed backward through
   `_AddKept` (so that DDP averages it and the fp16 loss scale multiplies it, as the mixed gradient).
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path

import numpy as np
import torch
from torch.autograd.graph import get_gradient_edge

from runner.faults import Diverged
from runner.hardware import to_device
from runner.losses import soft_cross_entropy
from runner.method_hooks import MethodHooks
from runner.methods.comixup import CONFIG_KEYS as COMIXUP_CONFIG_KEYS
from runner.methods.comixup import OPTIONS as COMIXUP_OPTIONS
from runner.methods.comixup import (
    ComixupPool,
    _cell_sources,
    _solve_partitions,
    auto_workers,
    identity_sources,
    mix_cells,
    plan,
    split_options,
    summarise,
)
from runner.methods.mixup import (
    cutmix_box,
    default_mixup_layers,
    mix_hidden,
    mix_pairs,
    normalization,
    pairing,
    paste_box,
    puzzle_apply,
    puzzle_cut,
    puzzle_draw,
    puzzle_read,
    transport_grid,
)
from runner.plots import new_figure, save_figure

SALIENCY_METHODS = ("comixup", "puzzle_mix")
INPUT_PAIR_MIXUPS = ("input_mixup", "cutmix")  # mix the batch in `transform`; manifold mixup in `loss`


def mixed_loss(logits: torch.Tensor, target: torch.Tensor, kind: str = "ce") -> torch.Tensor:
    """`ce`: -sum_k y_k log softmax_k, batch mean. `bce`: BCE(softmax(logits), y) over all B*K entries
    (log clamped at -100 as torch's BCE; written out because torch's BCE refuses autocast)."""
    if kind == "ce":
        return soft_cross_entropy(logits, target)
    p = logits.float().softmax(1)
    log_p, log_q = torch.log(p).clamp(min=-100), torch.log1p(-p).clamp(min=-100)
    return -(target * log_p + (1 - target) * log_q).mean()


class ActivationGradients:
    """The weight gradients of a loss from the activation gradients that its input-gradient backward passes.

    While installed (a context manager around the forward), every call of a module that owns parameters
    records its output's gradient edge, with a hook that keeps the gradient the backward brings there. For a
    parameter p used inside one such call c only, dL/dp = (d out_c / dp)^T g_c, with g_c the kept activation
    gradient: `weight_gradients` evaluates it by one backward from the edge to the call's own parameters,
    which runs the layer's weight-gradient kernels only (the engine skips the edges that lead elsewhere).
    The edge is the output's node at the call, so an in-place op after the layer (ReLU(inplace=True))
    changes nothing. None (take a full backward) where a call's output is not one tensor in the graph, a
    call got no gradient or did not use one of its module's weights, or a trainable parameter is in no
    recorded call or in several (a module called twice: the later call's backward would reach the earlier
    one's weights through its input).
    """

    def __init__(self, model: torch.nn.Module):
        self._owners = [m for m in model.modules() if any(p.requires_grad for p in _own_parameters(m))]
        self._calls, self._handles, self.complete = [], [], True

    def __enter__(self):
        self._handles = [m.register_forward_hook(self._record) for m in self._owners]
        return self

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()

    def _record(self, module, args, output):
        if not (isinstance(output, torch.Tensor) and output.grad_fn is not None):
            self.complete = False
            return
        kept = []
        hook = output.grad_fn.register_prehook(lambda grads, i=output.output_nr: kept.append(grads[i]))
        own = _own_parameters(module)
        self._calls.append((own, get_gradient_edge(output), kept, hook))

    def weight_gradients(self, params) -> list | None:
        """After the input-gradient backward: d loss / d p for `params` (None where unused), or None."""
        for *_, hook in self._calls:
            hook.remove()
        recorded = [p for own, *_ in self._calls for p in own]
        if not self.complete or any(not kept or kept[0] is None for _, _, kept, _ in self._calls):
            return None
        if len(set(recorded)) < len(recorded) or not set(recorded).issuperset(params):
            return None
        grads = {}
        for own, edge, kept, _ in self._calls:
            layer = torch.autograd.grad(edge, own, kept[0], retain_graph=True, allow_unused=True)
            if any(g is None for g in layer):  # a weight the call did not use may be used elsewhere
                return None
            grads.update(zip(own, layer))
        return [grads[p] for p in params]


def _own_parameters(module: torch.nn.Module) -> list:
    return [p for p in module.parameters(recurse=False) if p.requires_grad]


def _diverged_saliency(saliency_maps) -> None:
    """Diverged where a mix refused a non-finite saliency map: the clean pass's input gradient is not
    finite once the network (or the data) is, which the loop's deferred non-finite check would report only
    some steps later. A read of the device (or of the host's copy), on the error path only."""
    if saliency_maps is not None and not bool(torch.isfinite(saliency_maps).all()):
        raise Diverged(
            "non-finite saliency maps (the clean pass's input gradient): the network diverged; lower "
            "train.lr (or check the data)"
        ) from None


class _AddKept(torch.autograd.Function):
    """Identity on the loss; its backward hands each parameter its kept gradient times the loss's incoming
    gradient (1, or the fp16 loss scale), in one `torch._foreach_mul`: the surrogate sum(p * g) did the same
    with about four kernels per parameter."""

    @staticmethod
    def forward(ctx, loss, kept, *params):
        ctx.kept = kept
        return loss.view_as(loss)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, *torch._foreach_mul(ctx.kept, grad)


class TargetLoss(MethodHooks):
    """The loss hook of plain training with `mixed_loss` of kind `kind` (ERM with the authors' BCE)."""

    accumulate_ok = True  # a per-sample loss: micro-batches add up to the batch
    capturable = True  # device work alone, the same every step: a CUDA graph may replay it

    def __init__(self, kind: str):
        self.kind = kind

    def loss(self, model, x, y_soft, idx, epoch):
        return mixed_loss(model(x), y_soft, self.kind)


class MixupHooks(MethodHooks):
    """Hooks for `fit`: `transform` mixes the batch (after the clean pass), `loss` scores it.

    The pair mixups (input mixup, CutMix, manifold mixup) make their host draws before the step (`draw`:
    the ratio, the partners, CutMix's box, manifold mixup's site), so that their step is device work a
    CUDA graph may replay. Co-Mixup's and Puzzle Mix's steps are split around their one host read (`read`:
    the clean pass and the cut problems' summary or costs; `solve`: the cuts, Co-Mixup's partitions drawn,
    on the host; `transform`: the mix from the cuts), each part device work a CUDA graph may replay;
    Puzzle Mix's draws (lambda, the pairing, the grid, the adversarial option's) are made before the step.

    normalize: the data's per-channel (mean, std), so that raw pixels are x * std + mean (Puzzle Mix's
    seam cost and adversarial noise live in raw pixels); None when x is raw.
    Co-Mixup's `workers`: 0 solves in-process, n > 0 on a pool of n threads, -1 (auto) one thread
    per partition of the first batch up to this rank's share of the CPU cores, less its loader workers,
    on an accelerator or with `lag` (`auto_workers`), in-process on the CPU otherwise (there the weight
    backward would take the cores the solvers need). With `lag`, `transform` returns the previous batch's
    mix, whose cuts the workers solved during this step's clean pass; the first step of a run (and of a
    resumed one) returns its clean batch; a split step keeps the previous batch in buffers for it. Where
    the step is captured (`hardware.cuda_graph`), the clean weight gradient is part of the captured clean
    pass: `overlap` applies to the eager step only.
    """

    mid_epoch_resume = True  # on_epoch_start only arms the preview; the rng is in state_dict

    @property
    def accumulate_ok(self) -> bool:
        """Pair mixing works within micro-batches; Co-Mixup and Puzzle Mix cut over the whole batch."""
        return self.cfg.name not in SALIENCY_METHODS

    @property
    def capturable(self) -> bool:
        """The pair mixups' step, their draws made before it, is device work, as is each part of the saliency
        methods' split step (but where `why_not_capturable` says)."""
        return self.why_not_capturable is None

    @property
    def why_not_capturable(self) -> str | None:
        if self.cfg.name == "puzzle_mix" and self.cfg.adv_p > 0:
            return ("Puzzle Mix's adversarial noise (method.adv_p > 0) enters the step only for the batches "
                    "the host picks")  # fmt: skip
        if self.cfg.name == "comixup" and self.cfg.grid == -1:
            return "Co-Mixup's grid drawn per batch (method.grid=-1) changes the shapes of the step's mix"
        return None

    @property
    def read(self):
        """The saliency methods' clean pass and cut problems, up to their host read (`_read`)."""
        return self._read if self.cfg.name in SALIENCY_METHODS else None

    @property
    def draw(self):
        """The pair mixups' `_draw_pair`, Puzzle Mix's `_draw_puzzle`; None for Co-Mixup (its draws go
        with the solve)."""
        return {"comixup": None, "puzzle_mix": self._draw_puzzle}.get(self.cfg.name, self._draw_pair)

    def __init__(self, cfg, num_classes: int, ctx, seed: int, normalize=None):
        self.cfg, self.num_classes, self.ctx = cfg, num_classes, ctx
        self.rng = np.random.default_rng(seed)
        self.mean, self.std = normalize if normalize is not None else (None, None)
        self.workers = cfg.get("workers", 0) if cfg.name == "comixup" else 0
        self.lag = cfg.name == "comixup" and cfg.lag
        self.pool = None  # started at the first batch (auto workers need its size)
        self._clean = None  # (loss value, [(param, grad)]) of the current step's clean pass
        self._deferred = None  # (clean loss, params) whose weight gradient is still to take
        self._lagged = None  # with lag: the previous batch's pending mix
        self._previous = None  # with lag, in a split step: the previous batch (x, y_soft), in buffers
        self._problem = None  # Co-Mixup's cut problem, as `_read` set it up on the device
        self._adv = None  # Puzzle Mix's adversarial option: (noise in raw pixels, (mask x, mask partner))
        self._adv_drawn = None  # its draws for the step: ((mask x, mask partner), the noise's scale) or None
        self._grid = None  # Puzzle Mix's grid of this step, drawn before it
        self._puzzle = {}  # per grid: Puzzle Mix's step as `_read` left it for the mix (each capture's)
        self._normalization = None  # Puzzle Mix's (shift, scale) of raw pixels, made once on the device
        self._preview = False

    def on_epoch_start(self, epoch, model, data):
        # a fresh network's saliency is flat (Co-Mixup then keeps single sources): redraw each epoch
        self._preview = bool(self.cfg.preview) and self.ctx.is_main and self.cfg.name != "manifold_mixup"

    def _draw_pair(self, x, y_soft, idx, model):
        """(lambda, partners[, CutMix's box and x's share | manifold mixup's site]) of a pair mixup, drawn
        from `self.rng` in the order of `runner.methods.mixup`'s functions, on x's device (lambda and the
        share float64: the host's 1 - lambda); the preview, when armed, of the mix they make."""
        lam, perm = pairing(len(x), self.cfg.alpha, self.rng)
        values = [np.float64(lam), perm]
        if self.cfg.name == "cutmix":
            box, keep = cutmix_box(x.shape[-2:], lam, self.rng)
            values += [box, np.float64(keep)]
        elif self.cfg.name == "manifold_mixup":
            values.append(int(self.rng.integers(len(self._mixup_layers(model)) + 1)))
        drawn = tuple(to_device(np.asarray(value), x.device) for value in values)
        if self._preview:  # here, outside a captured step: the preview reads the mix back
            with torch.no_grad():
                self._preview_once(*self._mix(x, y_soft, drawn))
        return drawn

    def _draw_puzzle(self, x, y_soft, idx, model):
        """Puzzle Mix's host draws, in the order of the step that drew them inside: the adversarial option's
        (kept on the hooks: `_adv_drawn`), then lambda, the pairing and the grid (`puzzle_draw`) -> the
        partners, the label levels and each cell's label prior (n, L), on x's device."""
        cfg = self.cfg
        self._adv_drawn = None
        if cfg.adv_p > 0:
            masks = tuple(bool(self.rng.binomial(1, cfg.adv_p)) for _ in range(2))
            self._adv_drawn = (masks, self.rng.uniform(0, 1)) if any(masks) else None
        perm, z, prior, grid = puzzle_draw(
            x.shape, cfg.alpha, cfg.eta, cfg.n_labels, cfg.grid, "gco_swap", self.rng
        )
        self._grid = grid
        cell_prior = prior.expand(grid * grid, -1).contiguous()  # its shape names the grid: a capture each
        return tuple(to_device(v, x.device) for v in (perm, z, cell_prior))

    @staticmethod
    def _mixup_layers(model):
        return default_mixup_layers(getattr(model, "module", model))  # DDP wraps the model

    def transform(self, x, y_soft, idx, model, drawn=None, solved=None):
        if drawn is None and self.cfg.name in (*INPUT_PAIR_MIXUPS, "puzzle_mix"):  # outside the loop: draw
            draw = self._draw_puzzle if self.cfg.name == "puzzle_mix" else self._draw_pair
            drawn = draw(x, y_soft, idx, model)
        if self.read is not None:  # the saliency methods: the mix from the cuts (`_read`, `solve`)
            if solved is None:  # called outside the loop: the step's read and solve here
                given = {} if drawn is None else {"drawn": drawn}
                host = self.solve(*(t.cpu() for t in self.read(x, y_soft, idx, model, **given)))
                solved = tuple(t.to(x.device) for t in host)
            with torch.no_grad():
                x_mix, y_mix = self._mix_solved(x, y_soft, *solved)
            self._keep_previous(x, y_soft)
            return x_mix, y_mix.to(y_soft.dtype)
        self._clean_pass(model, x, y_soft)  # the clean term's gradient, where clean_lam > 0
        with torch.no_grad():
            x_mix, y_mix = self._mix(x, y_soft, drawn)
        self._preview_once(x_mix, y_mix)
        return x_mix, y_mix

    def _mix_solved(self, x, y_soft, solved):
        """A saliency method's mix from its cuts: Co-Mixup's cell sources, Puzzle Mix's mask labels."""
        if self.cfg.name == "comixup":
            return mix_cells(*self._mix_source(x, y_soft), solved)
        cfg, state = self.cfg, self._puzzle[self._grid]
        noise, adv_mask = self._adv if self._adv is not None else (None, (False, False))
        t_grid = transport_grid(cfg.t_size, state["s_grid"].shape[-1], *x.shape[-2:], cfg.transport)
        return puzzle_apply(x, y_soft, solved, state["raw"], state["s"], state["s_grid"], state["index"],
                            *self._normalization, cfg.n_labels, cfg.transport, cfg.t_eps, t_grid, noise,
                            adv_mask)  # fmt: skip

    def _read(self, x, y_soft, idx, model, drawn=None):
        """The device work of a saliency method's step up to its host read: the clean pass (its weight
        gradient kept for `loss`, or deferred where `overlap` applies) and Co-Mixup's cut problem summary
        (`summarise`), or Puzzle Mix's cut costs (`puzzle_read`)."""
        if self.cfg.name == "puzzle_mix":
            saliency_maps = self._clean_pass(model, x, y_soft)
            if self._normalization is None:  # made in the first, eager, step: a captured one reuses them
                self._normalization = normalization(self.mean, self.std, x.device, x.dtype)
            index, z, cell_prior = drawn
            grid = math.isqrt(len(cell_prior))  # = self._grid
            cfg = self.cfg
            with torch.no_grad():
                costs, raw, s_grid = puzzle_read(x, saliency_maps, index, z, cell_prior, *self._normalization,
                                                 grid, cfg.beta, cfg.gamma, cfg.neigh_size)  # fmt: skip
            self._puzzle[grid] = {"raw": raw, "s": saliency_maps, "s_grid": s_grid, "index": index, "x": x,
                                  "y": y_soft}  # fmt: skip
            return (costs,)
        pool = self._comixup_pool(x)
        lag = pool is not None and self.cfg.lag
        overlap = pool is not None and self.cfg.overlap and not lag and not self.ctx.cuda_graph
        saliency_maps = self._clean_pass(model, x, y_soft, defer_weights=overlap)
        sweeps, shape = split_options(**self._comixup_options())
        with torch.no_grad():
            self._problem = summarise(x, y_soft, saliency_maps, sweeps, *shape, self.rng)
        return (self._problem["summary"],)

    def solve(self, read):
        """The host's part of a saliency method's step: Puzzle Mix's cuts from the costs read; Co-Mixup's
        partitions set up from the summary read (their draws from `self.rng`) and solved, in process or by
        the workers (the deferred clean weight gradient taken meanwhile), with `lag` this batch's sent to
        the workers and the previous one's taken (the first step: its own batch kept as it is). -> (the
        cuts, for `transform`); the preview, when armed."""
        cfg = self.cfg
        try:
            if cfg.name == "puzzle_mix":
                cuts = torch.from_numpy(puzzle_cut(read.numpy(), self._grid, cfg.n_labels, "gco_swap"))
            else:
                cuts = torch.from_numpy(self._comixup_cuts(plan(self._problem, read.numpy(), self.rng)))
        except ValueError:
            _diverged_saliency(read)
            raise
        if self._preview:  # here, outside a captured step: the preview reads the mix back
            state = self._puzzle[self._grid] if cfg.name == "puzzle_mix" else self._problem
            with torch.no_grad():
                x, y = state["x"], state["y"]
                self._preview_once(*self._mix_solved(x, y, to_device(cuts, x.device)))
        return (cuts,)

    def _comixup_cuts(self, problem: dict) -> np.ndarray:
        """The cell sources of Co-Mixup's mix (`_cell_sources`) of a problem set up on the host."""
        sweeps, _ = split_options(**self._comixup_options())
        if self.pool is None:
            return _cell_sources(_solve_partitions(*problem["arrays"], sweeps)[0], problem["index"])
        pending = self.pool.start(problem, sweeps)
        if self.lag:  # this batch's cuts run through the next step; this one mixes the previous batch
            pending, self._lagged = self._lagged, pending
        self._weight_backward()  # a deferred one (overlap): on the device while the workers solve
        if pending is None:  # the first lagged step: its own batch as it is
            return identity_sources(len(problem["x"]), problem["grid"])
        return pending.sources()

    def _mix_source(self, x, y_soft):
        """The batch a Co-Mixup step mixes: its own, or with `lag` the previous one (the first step's own)."""
        if self.lag and self._previous is not None:
            return self._previous
        return x, y_soft

    def _keep_previous(self, x, y_soft):
        """With `lag`, this batch kept for the next step: copied into the buffers of the previous one (which
        a captured step reads and writes in place), new ones for a new batch shape."""
        if not self.lag:
            return
        if self._previous is not None and self._previous[0].shape == x.shape:
            self._previous[0].copy_(x)
            self._previous[1].copy_(y_soft)
        else:
            self._previous = (x.clone(), y_soft.clone())

    def _preview_once(self, x_mix, y_mix):
        """mixup_preview.png of this mix where the epoch's preview is armed (`on_epoch_start`)."""
        if self._preview:
            self._preview = False
            path = save_mixup_preview(x_mix, y_mix, Path(self.ctx.dir) / "mixup_preview.png", self.cfg.name)
            self.ctx.tracker.image("mixup_preview", path)

    def loss(self, model, x, y_soft, idx, epoch, drawn=None, solved=None):
        if self.cfg.name == "manifold_mixup":  # the mix is inside the forward
            if drawn is None:  # called outside the loop: draw here
                drawn = self._draw_pair(x, y_soft, idx, model)
            logits, y_soft = mix_hidden(model, x, y_soft, *drawn, self._mixup_layers(model))
        else:
            logits = model(x)
        loss = mixed_loss(logits, y_soft, self.cfg.loss)
        if self._clean is not None:  # add the kept clean-pass gradient and the clean loss's value
            value, pairs = self._clean
            self._clean = None
            if pairs:
                params, kept = zip(*pairs)
                loss = _AddKept.apply(loss, list(kept), *params)
            loss = loss + value
        return loss

    def _comixup_pool(self, x):
        """The Co-Mixup worker pool, or None to solve in-process (see the class docstring)."""
        if self.workers == -1:
            wanted = self.ctx.accelerator or self.cfg.lag
            self.workers = auto_workers(len(x), self.cfg.part, self.ctx.num_workers) if wanted else 0
        if self.workers > 0 and self.pool is None:
            self.pool = ComixupPool(self.workers)
        return self.pool

    def _comixup_options(self):
        return {k: self.cfg[COMIXUP_CONFIG_KEYS.get(k, k)] for k in COMIXUP_OPTIONS}

    def _clean_pass(self, model, x, y_soft, defer_weights=False):
        """Saliency (B, H, W) of the clean batch when the method needs it; keeps the clean gradient.
        defer_weights: take the input gradient only and keep the graph for `_weight_backward`."""
        needs_saliency = self.cfg.name in SALIENCY_METHODS
        lam = self.cfg.clean_lam
        if lam == 0 and not needs_saliency:
            return None
        was_training = model.training
        if lam == 0:
            model.eval()
        x = self._adversarial_start(x)
        x = x.detach().requires_grad_(needs_saliency)
        # a compiled network would recompile on every change of its hooks: it takes the full backward
        compiled = getattr(model, "_orig_mod", None) is not None
        taps = ActivationGradients(model) if defer_weights and not compiled else None
        with self.ctx.autocast(), taps or contextlib.nullcontext():  # the precision of the step's own forward
            ce = soft_cross_entropy(model(x), y_soft)
        wrt = [x] if needs_saliency else []
        if lam > 0:
            params = [p for p in model.parameters() if p.requires_grad]
            clean = ce * (2 * lam / self.num_classes if self.cfg.loss == "bce" else lam)
            if defer_weights:
                grads = torch.autograd.grad(clean, wrt, retain_graph=True)
                self._deferred = (clean, params, taps)
            else:
                grads = torch.autograd.grad(clean, wrt + params, allow_unused=True)
                self._keep_clean(clean, params, grads[len(wrt) :])
        else:
            grads = torch.autograd.grad(ce, wrt)
        model.train(was_training)
        if self._adv is not None:  # one signed-gradient step from the random start, then a random scale
            eps = self.cfg.adv_eps / 255
            noise = (self._adv[0] + (self.cfg.adv_eps + 2) / 255 * grads[0].sign()).clamp(-eps, eps)
            self._adv = (noise * self._adv_drawn[1], self._adv[1])
        return grads[0].pow(2).mean(1).sqrt() if needs_saliency else None

    def _weight_backward(self):
        if self._deferred is not None:
            clean, params, taps = self._deferred
            self._deferred = None
            grads = taps.weight_gradients(params) if taps is not None else None
            if grads is None:
                grads = torch.autograd.grad(clean, params, allow_unused=True)
            self._keep_clean(clean, params, grads)

    def _keep_clean(self, clean, params, grads):
        self._clean = (clean.detach(), [(p, g) for p, g in zip(params, grads) if g is not None])

    def _adversarial_start(self, x):
        """Puzzle Mix with adv_p > 0: per batch, x and the partner each get noise with probability
        adv_p (drawn before the step: `_draw_puzzle`); the saliency is then taken at a uniform random start
        in the adv_eps / 255 ball (raw pixels, clipped to [0, 1]), as the authors."""
        self._adv = None
        if self.cfg.name != "puzzle_mix" or self._adv_drawn is None:
            return x
        masks = self._adv_drawn[0]
        shape = (1, -1, 1, 1)
        mean = to_device(0.0 if self.mean is None else self.mean, x.device).reshape(shape)
        std = to_device(1.0 if self.std is None else self.std, x.device).reshape(shape)
        raw = x * std + mean
        eps = self.cfg.adv_eps / 255
        noisy = (raw + torch.empty_like(raw).uniform_(-eps, eps)).clamp(0, 1)
        self._adv = (noisy - raw, masks)
        return (noisy - mean) / std

    def _mix(self, x, y_soft, drawn):
        """A pair mixup's mix of the batch with its draws (manifold mixup's is inside the forward)."""
        if self.cfg.name == "input_mixup":
            return mix_pairs(x, y_soft, *drawn)
        if self.cfg.name == "cutmix":
            lam, perm, box, keep = drawn
            return paste_box(x, y_soft, box, keep, perm)
        return x, y_soft

    def state_dict(self):
        return {"rng": self.rng.bit_generator.state}

    def load_state_dict(self, state):
        self.rng.bit_generator.state = state["rng"]


def save_mixup_preview(
    x: torch.Tensor, y: torch.Tensor, path: Path, title: str = "", count: int = 16
) -> Path:
    """PNG grid of the first `count` mixed images, each titled with its label weights (class:weight, the
    three largest, one per line so that a title stays within its image's width). The grid is one image on
    one axes, the titles text in the white band above each image: redrawn every epoch, 16 axes of their own
    took 1-2 s a drawing."""
    shown = torch.cat([x[:count].detach().flatten(1).float(), y[:count].detach().float()], 1).cpu()  # 1 read
    images, weights = shown[:, : x[0].numel()].reshape(-1, *x.shape[1:]), shown[:, x[0].numel() :]
    _, C, H, W = images.shape
    cols = min(8, len(images))
    rows = -(-len(images) // cols)
    band, gap = -(-H // 3), max(1, W // 16)  # white above each image (its title's third) and beside it
    lo, hi = images.amin((1, 2, 3), keepdim=True), images.amax((1, 2, 3), keepdim=True)
    tiles = torch.ones(rows * cols, band + H, W + gap, C)
    tiles[: len(images), band:, :W] = ((images - lo) / (hi - lo + 1e-12)).permute(0, 2, 3, 1)  # each: [0, 1]
    grid = tiles.reshape(rows, cols, band + H, W + gap, C).permute(0, 2, 1, 3, 4)
    grid = grid.reshape(rows * (band + H), cols * (W + gap), C)[:, :-gap].numpy()
    fig, ax = new_figure((1.5 * cols, 2.0 * rows + 0.4))
    ax.imshow(grid[..., 0] if C == 1 else grid, cmap="gray", vmin=0, vmax=1, interpolation="nearest")
    ax.axis("off")
    for k, w in enumerate(weights):
        top = torch.argsort(w, descending=True)[:3]
        label = "\n".join(f"{int(c)}:{w[c]:.2f}" for c in top if w[c] > 0.005)
        row, col = divmod(k, cols)
        ax.text(col * (W + gap) + W / 2 - 0.5, row * (band + H) + band - 0.5, label, ha="center", va="bottom",
                fontsize=6)  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    save_figure(fig, path, f"{title} mixed batch (class:label weight)")
    return path


# --- the factories `runner.configs.classify` declares for its methods: (method_cfg, data, ctx) -> hooks ---


def target_loss_hooks(cfg, data, ctx) -> TargetLoss | None:
    """ERM's hooks: its `loss` where it is not the loop's own soft cross-entropy (ce: None)."""
    return TargetLoss(cfg.loss) if cfg.loss != "ce" else None


def mixup_hooks(cfg, data, ctx) -> MixupHooks:
    """A mixup's hooks, drawing from the run's seed; saliency de-normalised by the dataset's statistics."""
    normalize = data.meta.get("normalize")
    return MixupHooks(cfg, data.num_classes, ctx, seed=torch.initial_seed(), normalize=normalize)
