"""`benchmarks/bench_gpu.py`'s rows: the presets measured (`PRESETS`, their variants), the overrides of each
row's run on generated data (`plan`), the table's line of a measured row (`table_line`) and the targets
its figures are held to (`targets`, `speed_targets`)."""

from __future__ import annotations

import dataclasses

import torch
from omegaconf import OmegaConf

from runner.configs import TASKS
from runner.data.fake import LIKE

# The paper presets' rows and their tasks' baselines and targets: the registry's (runner.configs.TASKS).
PRESETS = tuple(preset for task in TASKS.values() for preset in task.bench_presets)
PRESET_TASKS = {preset: task for task in TASKS.values() for preset in task.bench_presets}
# --smoke: 10 classes, so that one batch of 10 holds every class (long-tailed training needs them all) and
# a class-balanced hashing batch of the 10 classes is its whole training set: one step per epoch.
SMOKE_LIKE, SMOKE_BATCH, SMOKE_SIDE = "cifar10", 10, 32
VARIANT_PRESETS = ("comixup_cifar100_preactresnet18", "comixup_imagenet")
# Beside each variant preset's row (hardware=auto: on a recent GPU channels_last and the captured step):
# today's fp32 eager step (NCHW, no graph), bf16, the whole step compiled, Co-Mixup's lag.
VARIANTS = {"eager": ["hardware.cuda_graph=false", "hardware.channels_last=false"],
            "bf16": ["hardware.precision=bf16"], "compile": ["hardware.compile=default"],
            "lag": ["method.lag=true"], "graph": ["hardware.cuda_graph=true"]}  # fmt: skip
FULL_KINDS = ("eager", "bf16", "compile", "lag")  # on CUDA hardware=auto's rows are the graph column
REFERENCE_BOUND = 1.15  # the runner's baseline step over the hand-written one, same network and precision
VARIANT_REFERENCE = {"bf16": {"precision": "bf16"}}  # a variant's reference step, where not the preset's
AUTO_SPEEDUP = 2.0  # hardware=auto's step against fp32 eager's, for the first variant preset's baseline
METHOD_VARIANTS = {"lag"}  # options of the method (Co-Mixup's cuts through the next step), not its baseline's
DDP_PRESET = "comixup_imagenet"  # its batch of 448 splits over 2, 4 or 8 GPUs
COLUMNS = ("preset", "method", "batch", "ms/step", "GPU busy ms", "host-bound", "images/s", "peak GB",
           "reserved GB", "method share", "syncs/step", "vs base", "ref ms/step", "vs ref")  # fmt: skip


class RowError(Exception):
    """A run that failed, in one line."""


def one_line(e: BaseException) -> str:
    """An exception as its type and its message's first line (a RowError: its line)."""
    if isinstance(e, RowError):
        return str(e)
    first = next((line.strip() for line in str(e).splitlines() if line.strip()), "")
    return f"{type(e).__name__}: {first}"


@dataclasses.dataclass
class Row:
    """One measured fit: its run's overrides, its batch and the pools a step draws one from (CSOT: 2), the
    prefix of its keys in metrics.jsonl (a tagged fit's), the key of the baseline row it is compared with,
    and its `result`."""

    preset: str
    method: str
    args: list[str]
    batch: int
    pools: int = 1
    prefix: str = ""
    baseline: str | None = None
    reference: dict | None = None  # the network, input shape, classes and precision of its reference step
    result: dict = dataclasses.field(default_factory=dict)

    @property
    def key(self) -> str:
        return f"{self.preset} {self.method}"

    @property
    def samples(self) -> int:
        return self.pools * self.batch

    @property
    def batches(self) -> str:
        return f"{self.pools}x{self.batch}" if self.pools > 1 else str(self.batch)


def _train_size(n: int, classes: int, imbalance: float) -> int:
    """Generated training samples whose long-tailed subset (`dataset.imbalance`) holds at least `n`, with
    a sample of every class."""
    from runner.data import longtail_counts

    if imbalance <= 1:
        return n
    n_max = int(imbalance) + 1
    while sum(longtail_counts(n_max, classes, imbalance)) < n:
        n_max *= 2
    return n_max * classes


def plan(preset: str, smoke: bool, steps: int) -> list[Row]:
    """The rows of `preset`, its baseline's first: the overrides of its runs on generated data."""
    from runner.compose import compose
    from runner.configs.hashing import PER_KS
    from runner.data.fake import IN_MEMORY, SHAPES
    from runner.models import MIN_SIDE

    cfg = compose([f"+experiment={preset}"])
    m, task, like = cfg.method, cfg.method.task, LIKE[cfg.dataset.name]
    classes, side = SHAPES[like][:2]
    side = cfg.dataset.image_size or side
    if smoke:
        like, classes = SMOKE_LIKE, SHAPES[SMOKE_LIKE][0]
        side = max(SMOKE_SIDE, MIN_SIDE.get(cfg.model.name, 0))
    in_memory = LIKE[cfg.dataset.name] in IN_MEMORY  # the real dataset's data path, not the shape's
    args = [f"+experiment={preset}", "dataset=fake", f"dataset.like={like}", f"dataset.image_size={side}",
            f"dataset.in_memory={str(in_memory).lower()}", "train.epochs=2", "train.checkpoint=false",
            "train.progress=false", "logger=none",
            "train.select=last"]  # fmt: skip  # generated data have no validation split to select on
    if smoke and not torch.cuda.is_available():
        args += ["hardware=cpu"]
    args += [f"hardware.precision={cfg.hardware.precision}"]  # the preset's, whatever hardware runs it
    if task == "hashing":
        per_batch = classes if smoke else m.classes_per_batch
        batch = per_batch * m.per_class
        iters = 2 * steps  # without a validation split an epoch is one pass: `steps` batches
        args += [f"method.classes_per_batch={per_batch}", f"method.iters={iters}",
                 f"method.base_iters={iters}", f"method.ks=[{m.ks[0]}]", "method.baselines=[]",
                 "method.tables=[test]"]  # fmt: skip
        args += [f"method.{key}=[{m[key][0]}]" for key in PER_KS if len(m[key]) > 1]  # the first ks's
    else:
        batch = SMOKE_BATCH if smoke else cfg.train.batch_size
        args += [f"train.batch_size={batch}"]
    test_size = max(classes, batch)  # the long-tailed evaluation resamples every class
    if task == "covering":  # its application and development sets come from the held-out pool
        n = 20 if smoke else max(m.n_app, m.n_dev)
        args += [f"method.n_app={n}", f"method.n_dev={n}", f"method.k={min(m.k, n // 2)}",
                 "method.plot=false"]  # fmt: skip
        test_size = 4 * n
    if cfg.train.get("phases"):  # the measured step is the preset's main phase: its batch and image side
        args += ["train.phases=[]"]
    pretrained = cfg.model.pretrained
    if pretrained == "required":  # no weights file here: random weights measure the same step
        args += ["model.pretrained=none"]
        pretrained = "none"
    if task == "longtail":  # the loss needs every class's training count
        args += ["dataset.min_per_class=1"]
    if task == "noisy_labels":  # select from the first epoch on (the preset's warm-up epochs are plain CE)
        args += ["method.warmup=0"]
    if cfg.dataset.get("epoch_samples"):  # a fresh sample each epoch (Clothing1M): of the measured size
        args += [f"dataset.epoch_samples={steps * batch}"]
    args += [f"dataset.train_size={_train_size(steps * batch, classes, cfg.dataset.imbalance)}",
             f"dataset.max_train={steps * batch}", f"dataset.test_size={test_size}"]  # fmt: skip
    if smoke:
        args += [f"train.eval_batch_size={test_size}"]

    if task == "hashing":
        base = Row(preset, "base embedding", args, batch, prefix="base/")
        ours = Row(preset, m.name, args, batch, prefix=f"ours_ks{m.ks[0]}/", baseline=base.key)
        return [base, ours]
    rows: list[Row] = []
    plain = compose([f"+experiment={preset}", *TASKS[task].bench_baseline]).method
    # the hand-written step of the preset's network, batch and precision (`reference_step`)
    model = {**OmegaConf.to_container(cfg.model), "pretrained": pretrained}
    reference = {"model": model, "shape": (3, side, side), "classes": classes,
                 "precision": cfg.hardware.precision}  # fmt: skip
    for extra, job in ((TASKS[task].bench_baseline, plain), ([], m)):
        own = list(extra)
        if "preview" in job:  # a mixup's first mixed batch as a picture: matplotlib, not training
            own += ["method.preview=false"]
        if smoke and "workers" in job:  # Co-Mixup's solver processes: seconds of imports each, same result
            own += ["method.workers=0"]
        # CSOT's step trains on a batch from each of its two pools (clean and unlabeled)
        pools = 2 if task == "noisy_labels" and job.selection != "none" else 1
        name = job.name + (f" {job.selector}" if task == "covering" else "")
        prefix = "fit/" if task == "longtail" else ""  # longtail's fit is tagged "fit"
        baseline = rows[0].key if rows else None
        rows.append(Row(preset, name, [*args, *own], batch, pools, prefix, baseline=baseline,
                        reference=None if rows else reference))  # fmt: skip
    return rows


def fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _ratio(row: Row, base: Row | None) -> float | None:
    """The row's step time over its baseline's (None: no baseline, or either failed)."""
    if base is None or "error" in row.result or "error" in base.result:
        return None
    return row.result["step_ms"] / base.result["step_ms"]


def table_line(row: Row, by_key: dict[str, Row]) -> str:
    """The row's line of the Markdown table; a failed row's error in its figures' place."""
    r = row.result
    if "error" in r:
        return f"| {row.preset} | {row.method} | {row.batches} | error: {r['error']} |"
    ratio = _ratio(row, by_key.get(row.baseline))
    syncs = "n/a" if "syncs_error" in r else fmt(r["syncs_per_step"], ".2f")
    ref = r.get("reference_ms")
    cells = [row.preset, row.method, row.batches, fmt(r["step_ms"], ".2f"), fmt(r.get("device_ms"), ".2f"),
             fmt(r.get("host_bound"), ".0%"), fmt(r["images_s"], ".0f"), fmt(r["peak_gb"], ".2f"),
             fmt(r["reserved_gb"], ".2f"), fmt(r["method_share"], ".1%"), syncs,
             "-" if ratio is None else f"{ratio:.2f}x", fmt(ref, ".2f"),
             "-" if ref is None else f"{r['step_ms'] / ref:.2f}x"]  # fmt: skip
    return "| " + " | ".join(cells) + " |"


def targets(rows: list[Row], by_key: dict[str, Row]) -> list[tuple[str, bool]]:
    """`target ...: measured ..., need ... -> OK|MISS` lines, each with whether it is met."""
    out = []
    for row in rows:
        target = PRESET_TASKS[row.preset].bench_target if row.preset in PRESET_TASKS else None
        if target is None or row.baseline is None:
            continue
        kind, bound = target
        base = by_key[row.baseline]
        if kind == "step":
            what, need = f"{row.key} step vs {base.method}", f"<= {bound}x"
            value = _ratio(row, base)
            shown = fmt(value, ".2f") + "x"
        else:
            what, need = f"{row.key} allocation share of its epoch", f"<= {bound:.0%}"
            value = row.result.get("allocation_share")
            shown = fmt(value, ".1%")
        ok = value is not None and value <= bound
        if value is None:
            shown = f"n/a ({row.result.get('error') or base.result.get('error', 'not measured')})"
        out.append((f"target {what}: measured {shown}, need {need} -> {'OK' if ok else 'MISS'}", ok))
    return out


def speed_targets(rows: list[Row], records: list[dict]) -> list[tuple[str, bool]]:
    """The GPU-speed targets: each baseline step within REFERENCE_BOUND of its reference step (as the
    preset runs and in bf16); the first variant preset's baseline under hardware=auto at least
    AUTO_SPEEDUP times fp32 eager's speed; bf16 and compile never slower than fp32 eager."""
    out = []

    def line(what: str, value: float | None, need: str, ok: bool) -> None:
        shown = "n/a" if value is None else f"{value:.2f}x"
        out.append((f"target {what}: measured {shown}, need {need} -> {'OK' if ok else 'MISS'}", ok))

    by_variant = {(r["key"], r["variant"]): r for r in records}
    for row in rows:
        if row.reference is None or row.preset not in VARIANT_PRESETS[:1]:
            continue
        for name, result in (("as preset", row.result), ("bf16", by_variant.get((row.key, "bf16"), {}))):
            ref = result.get("reference_ms")
            ratio = None if ref is None or "step_ms" not in result else result["step_ms"] / ref
            line(f"{row.key} ({name}) vs its reference step", ratio, f"<= {REFERENCE_BOUND}x",
                 ratio is not None and ratio <= REFERENCE_BOUND)  # fmt: skip
        eager = by_variant.get((row.key, "eager"), {}).get("step_ms")
        speedup = None if eager is None or "step_ms" not in row.result else eager / row.result["step_ms"]
        line(f"{row.key} hardware=auto vs fp32 eager", speedup, f">= {AUTO_SPEEDUP}x",
             speedup is not None and speedup >= AUTO_SPEEDUP)  # fmt: skip
    for (key, variant), r in by_variant.items():
        eager = by_variant.get((key, "eager"), {}).get("step_ms")
        if variant in ("bf16", "compile") and eager is not None and "step_ms" in r:
            line(f"{key} {variant} vs fp32 eager (speed-up)", eager / r["step_ms"], ">= 1.00x",
                 eager >= r["step_ms"])  # fmt: skip
    return out
