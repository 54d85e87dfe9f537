"""`MethodHooks`: every hook through which a method plugs into the training loop (`runner.train.fit`),
each with the loop's default. It sits below the loop, which imports it, as do the methods' hooks classes
(`runner.hooks`; the import graph reads solvers -> loop -> hooks -> tasks)."""

from __future__ import annotations

from collections.abc import Callable


class MethodHooks:
    """What a method's hooks give `fit`; subclass it and override what the method changes.

    Three kinds of member, each read by the loop as it stands here:

    - optional hooks, None here: where a method leaves one None the loop runs its own step instead (and
      may decide more on its absence, as each says); a subclass defines it as a method:
      `on_epoch_start`, `draw`, `read` (with `solve`), `transform`, `loss`, `optimizer`, `evaluate`;
    - flags, class attributes (or properties) with the cautious default: `capturable` (and its
      `why_not_capturable`), `accumulate_ok`, `mid_epoch_resume`, `select`;
    - methods whose default leaves the loop as it is: `batch_sampler`, `batch_setting`, `capture_key`,
      `epoch_metrics`, `state_dict`, `load_state_dict`.

    | hook                                          | default here  | the loop without it                   |
    |-----------------------------------------------|---------------|---------------------------------------|
    | on_epoch_start(epoch, model, data)            | None          | no per-epoch pass                     |
    | draw(x, y_soft, idx, model) -> tensors        | None          | nothing drawn before the step; with   |
    |                                               |               | it, transform and loss get `drawn=`   |
    | read(x, y_soft, idx, model) -> tensors        | None          | no host read inside the step; with    |
    | solve(*host tensors) -> host tensors          |               | it, transform and loss get `solved=`  |
    | transform(x, y_soft, idx, model) -> (x, y)    | None          | the batch as it is, nothing timed     |
    | loss(model, x, y_soft, idx, epoch) -> scalar  | None          | soft cross-entropy                    |
    | optimizer(model) -> (opt, sched, per_step)    | None          | train.optimizer, schedule, warm-up    |
    | evaluate(model) -> dict                       | None          | every evaluation split's metrics      |
    | capturable                                    | False         | the step is neither captured nor      |
    |                                               |               | compiled whole                        |
    | accumulate_ok                                 | False         | train.accumulate > 1 refused          |
    | mid_epoch_resume                              | False         | with an on_epoch_start: resumed only  |
    |                                               |               | at epoch ends                         |
    | select                                        | None          | train.select alone                    |
    | batch_sampler(default)                        | default       | fit's EpochBatches                    |
    | batch_setting(epoch)                          | None          | train.batch_size named                |
    | capture_key(epoch)                            | None          | one captured step per batch shape     |
    | epoch_metrics()                               | {}            | nothing added to the row              |
    | state_dict() / load_state_dict(state)         | None / no-op  | no hooks state in the checkpoint      |

    `fit(hooks=None)` trains with `PlainTraining`, whose step is capturable and splits into micro-batches.
    """

    on_epoch_start: Callable[..., None] | None = None
    """(epoch, model, data): the method's pass before each epoch's steps (CSOT's sample selection), timed
    as `time/pass_s`. Its presence makes a resume continue only at epoch ends unless `mid_epoch_resume`."""

    draw: Callable[..., tuple] | None = None
    """(x, y_soft, idx, model) -> tuple of tensors on x's device: what the step draws on the host for one
    micro-batch (a mixup's ratio and partners), called before the step, outside what a CUDA graph
    captures, in the order the step would have drawn it; `transform` and `loss` then get that tuple as
    the keyword `drawn` (called without it, e.g. by a test, they draw for themselves). A captured step
    copies the values into its static buffers before each replay, as it does the batch, so the host's
    random stream (and with it every CPU number) stays as it was."""

    read: Callable[..., tuple] | None = None
    """(x, y_soft, idx, model) -> tuple of device tensors: where a method's step needs the host's work on
    device values (Co-Mixup's cuts from the clean pass's saliency, the hash codes' flow from the unaries),
    the step's device work up to that one read, for one micro-batch (after `draw`, taking `drawn=` as
    `transform` does). The loop copies the tensors to the host in one wait and hands them to `solve`,
    whose results reach `transform` and `loss` on the device as the keyword `solved`: the step is split
    around the read, and a `capturable` method's two parts are each captured as a CUDA graph (replayed in
    that order, around the host's read and solve). What `read` keeps for the rest of the step (the clean
    pass's kept gradients, the forward's output) it keeps on the hooks: a captured step replays both parts
    on the tensors of their capture."""

    solve: Callable[..., tuple] | None = None
    """(*host tensors) -> tuple of host tensors or arrays: with `read`, the host's work on what it read
    (every host draw of this part of the step made here, in the eager step's order), each result copied to
    the device (into the static buffers of a captured step: their shapes follow the capture key)."""

    transform: Callable[..., tuple] | None = None
    """(x, y_soft, idx, model) -> (x, y_soft): a batch transform before the loss (the mixup family);
    `model` is the network the hooks may run their own passes through. Timed as `time/transform_s` (but in
    a step captured as a CUDA graph, where it is part of the one replay)."""

    loss: Callable[..., object] | None = None
    """(model, x, y_soft, idx, epoch) -> scalar tensor: the step's loss, under the step's autocast, in place
    of the soft cross-entropy of `model(x)` against `y_soft`."""

    optimizer: Callable[..., tuple] | None = None
    """(model) -> (optimizer, scheduler, per_step): the method's own optimizer and schedule (stepped after
    every batch where `per_step`, else after every epoch), in place of `train.optimizer`, its schedule and
    `train.warmup_epochs`; `train.phases` (which set the config's lr) are then refused."""

    evaluate: Callable[..., dict] | None = None
    """(model) -> dict: the per-epoch metrics in place of every evaluation split's accuracy, loss and ECE
    (no calibration bins then); out of memory in it names the method's evaluation."""

    capturable: bool = False
    """The hooks' share of a step is device work alone, the same every step (no host read but `read`'s;
    host randomness only through `draw` and `solve`; what else varies, through `capture_key`): the step may
    be captured as one CUDA graph, or two around `read` (`hardware.cuda_graph`), and, without `read`,
    compiled whole (`hardware.compile`). False unless a method declares
    it: one that reads the host must never inherit it."""

    why_not_capturable: str = "they read the host or draw host randomness in a step"
    """Where not `capturable`: what in the hooks' step needs the host, the reason the log line gives."""

    accumulate_ok: bool = False
    """The batch transform, loss and sampler add up over micro-batches: `train.accumulate` may split a
    batch (a method that sees the batch as one, e.g. a mix over all of it, refuses it)."""

    mid_epoch_resume: bool = False
    """`state_dict` holds everything `on_epoch_start` set up, so a resume may continue inside an epoch;
    hooks without an `on_epoch_start` resume there in any case."""

    select: tuple[str, str] | None = None
    """(metric, "max" | "min"): while `train.select` is `last`, keep and restore the weights of the best
    value of that metric (hier_hash's val/p@1)."""

    def batch_sampler(self, default):
        """The epoch's index batches in place of `default` (fit's `EpochBatches`, which knows this rank's
        shard): the same protocol (`set_epoch`, a length read after each `set_epoch`), e.g. CSOT's two
        pools or training by iterations. Here: `default`."""
        return default

    def capture_key(self, epoch: int):
        """What decides the step's device work in epoch `epoch` besides the batch's shape and the drawn
        values (DRW's re-weighting, CSOT's stage): a captured step whose key changes is warmed up and
        captured anew, as a new batch shape is. Here: None (the same work every epoch)."""
        return None

    def batch_setting(self, epoch: int) -> str | None:
        """The setting that sizes epoch `epoch`'s batches, named when training runs out of memory; None:
        the config's `train.batch_size` (or its phase's)."""
        return None

    def epoch_metrics(self) -> dict:
        """Added to each epoch's metrics row (CSOT's select/*). Here: nothing."""
        return {}

    def state_dict(self):
        """The hooks' state kept in checkpoints (their random streams, a selection); None: hooks without
        state, which checkpoints keep as None."""
        return None

    def load_state_dict(self, state) -> None:
        """Restore what `state_dict` returned; called on resume only where the checkpoint holds hooks
        state. Here: nothing to restore."""


class PlainTraining(MethodHooks):
    """No method (`fit(hooks=None)`): the loop's soft cross-entropy on its own batches, device work alone
    and per sample, so the step may be captured and compiled whole and split into micro-batches."""

    capturable = True
    accumulate_ok = True
