"""`make bench-gpu`: the paper presets' training steps, each beside its own baseline, on generated data.

One row per paper preset (`PRESETS`: the registry's `TaskEntry.bench_presets`) at the preset's own
network, batch and precision (read from its composed config) on `dataset=fake` of the preset's data
shape, and one row for its baseline: the preset with its task's plain method in the method's place
(`TaskEntry.bench_baseline`; hashing: the preset's base embedding net, the same metric learning without
codes, trained in the same run). Each run trains 2 epochs of `--steps` steps; the second is measured (the
first warms up). Columns: ms per training step, images/s, peak and reserved GPU memory, the method's
share of the epoch's training time (its per-epoch pass and batch transform, e.g. CSOT's selection and
Co-Mixup's mixing; hashing: the min-cost flow), host-device syncs per training step (CUDA:
`torch.cuda.set_sync_debug_mode("warn")` warnings; CPU: the `runner.device_tracking` harness), and the
step time over the baseline's. On CUDA also: the targets (`TaskEntry.bench_target`), fp32 against bf16,
torch.compile and Co-Mixup's `method.lag` for `--variants` (default `VARIANT_PRESETS`), and DDP scaling
when several GPUs are visible (torchrun).

The runs share this process (`runner.cli.run_in_process`, no import per run), each in its own run dir. On
CUDA the table and a JSON record go to benchmarks/results/<gpu>-<torch>-<commit>.{md,json}; without CUDA
(and without --smoke) it prints one line and measures nothing.

    make bench-gpu                          # CUDA: every row, the targets, the variants, DDP
    make bench-gpu ARGS=--smoke             # every row for 2 steps (tests/test_bench_gpu.py runs it)
    python -m benchmarks.bench_gpu [--smoke] [--steps N] [--only SUBSTRING ...] [--variants PRESET ...]
                                   [--kinds bf16 compile lag]
                                   [--out DIR]

`--smoke` runs every row for one step per epoch at a batch of 10 on 32-px images of 10 classes (the
network's smallest side where larger) on whatever device is present, writes its record to `--out` or a
temporary directory, and fails when any row fails. Exit status: 0 when every row ran and every target
is met.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from unittest import mock

import torch
from omegaconf import OmegaConf

from benchmarks.reference_step import host_marker_us, reference_step_ms
from runner.configs import TASKS
from runner.data.fake import LIKE

# The paper presets' rows and their tasks' baselines and targets: the registry's (runner.configs.TASKS).
PRESETS = tuple(preset for task in TASKS.values() for preset in task.bench_presets)
PRESET_TASKS = {preset: task for task in TASKS.values() for preset in task.bench_presets}
# --smoke: 10 classes, so that one batch of 10 holds every class (long-tailed training needs them all) and
# a class-balanced hashing batch of the 10 classes is its whole training set: one step per epoch.
SMOKE_LIKE, SMOKE_BATCH, SMOKE_SIDE = "cifar10", 10, 32
STEPS = 50
PROFILED_STEPS = 5  # of each fit's warm-up epoch, for the GPU's busy time per step
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
# In-process runs: no Hydra files or logging set-up of their own (a run's output goes to its log).
LOG_TAIL = 40  # lines of a failed run's log kept in the record
QUIET = ["hydra.output_subdir=null", "hydra/job_logging=none", "hydra/hydra_logging=none"]
COLUMNS = ("preset", "method", "batch", "ms/step", "GPU busy ms", "host-bound", "images/s", "peak GB",
           "reserved GB", "method share", "syncs/step", "vs base", "ref ms/step", "vs ref")  # fmt: skip


class RowError(Exception):
    """A run that failed, in one line."""


def _one_line(e: BaseException) -> str:
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


def _run_cli(args: list[str], run_dir: Path) -> list[dict]:
    """`runner ARGS` in this process into `run_dir` (its output in `<run_dir>.log`): its metrics rows, or
    RowError."""
    from runner import cli

    log = run_dir.with_suffix(".log")
    try:  # HYDRA_FULL_ERROR: the job's exception itself, rather than Hydra's printed report and exit
        with (log.open("w") as out, contextlib.redirect_stdout(out), contextlib.redirect_stderr(out),
              mock.patch.dict(os.environ, HYDRA_FULL_ERROR="1")):  # fmt: skip
            cli.run_in_process([*args, f"hydra.run.dir={run_dir}", *QUIET])
    except SystemExit as stop:  # the CLI's one-line errors: a bad config, a diverged run
        lines = [line.strip() for line in log.read_text().splitlines() if line.strip()]
        raise RowError(lines[-1] if lines else f"exit status {stop.code}") from None
    except Exception as e:
        with log.open("a") as out:  # where it failed, for the record's log tail
            traceback.print_exc(file=out)
        raise RowError(_one_line(e)) from None
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@contextlib.contextmanager
def _syncs_per_step(tracker=None):
    """Host-device syncs per training step in each fit's measured (second) epoch, by fit tag ("" for an
    untagged fit): the steady state, after the first epoch's one-time work (cuDNN autotuning, caches).
    Counted by `tracker` (`runner.device_tracking`, on the CPU) or as CUDA's sync-debug warnings."""
    from runner import train

    counts: dict[str, float] = {}
    inner = train.train_one_epoch

    def counted(s, loop, epoch, first):
        if epoch != 1:
            return inner(s, loop, epoch, first)
        steps = len(loop.sampler) - first
        if tracker is not None:
            before = tracker.train_syncs()
            out = inner(s, loop, epoch, first)
            syncs = tracker.train_syncs() - before
        else:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    out = inner(s, loop, epoch, first)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            syncs = sum("synchronizing CUDA operation" in str(w.message) for w in caught)
        counts[loop.tag or ""] = syncs / max(steps, 1)
        return out

    train.train_one_epoch = counted
    try:
        yield counts
    finally:
        train.train_one_epoch = inner


@contextlib.contextmanager
def _device_busy(trace: Path | None = None):
    """The GPU's busy time per training step by fit tag: the kernels' and copies' time in the last
    `PROFILED_STEPS` steps of each fit's warm-up (first) epoch, read by torch.profiler (their sum, not the
    span: what the step would take were the host never late). With `trace`, those steps' Chrome trace
    goes there (`<trace>-<tag>.json`)."""
    from torch.profiler import ProfilerActivity, profile

    from runner import train

    busy: dict[str, float] = {}
    inner_epoch, inner_step = train.train_one_epoch, train.train_step
    state = {"steps": None, "done": 0, "prof": None}

    def epoch(s, loop, epoch, first):
        if epoch != 0:
            return inner_epoch(s, loop, epoch, first)
        state.update(steps=len(loop.sampler) - first, done=0, prof=None)
        try:
            return inner_epoch(s, loop, epoch, first)
        finally:
            prof = state["prof"]
            if prof is not None:
                torch.cuda.synchronize()
                prof.stop()
                kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
                total_us = sum(e.self_device_time_total for e in kernels)
                if total_us:  # none seen: kernels the profiler could not follow (a graph captured before it)
                    busy[loop.tag or ""] = total_us / 1000 / state["profiled"]
                if trace is not None:
                    prof.export_chrome_trace(f"{trace}-{loop.tag or 'fit'}.json")
            state["steps"] = None

    def step(s, x, idx, epoch):
        if state["steps"] is not None:
            if state["done"] == max(state["steps"] - PROFILED_STEPS, 0):
                torch.cuda.synchronize()
                state["prof"] = profile(activities=[ProfilerActivity.CUDA])
                state["prof"].start()
                state["profiled"] = state["steps"] - state["done"]
            state["done"] += 1
        return inner_step(s, x, idx, epoch)

    train.train_one_epoch, train.train_step = epoch, step
    try:
        yield busy
    finally:
        train.train_one_epoch, train.train_step = inner_epoch, inner_step


def _tracked_run(args: list[str], run_dir: Path, trace: Path | None = None):
    """`_run_cli` with the syncs counted: (metrics rows, syncs per step by fit tag, and the CPU
    tracking harness's error where the run failed under it but not without it); on CUDA also the GPU's
    busy ms per step by fit tag (`_device_busy`, its trace to `trace`), else None."""
    if torch.cuda.is_available():
        gc.collect()  # the last run's blocks out of the allocator's cache: this run's reserved memory
        torch.cuda.empty_cache()
        with _device_busy(trace) as busy, _syncs_per_step() as syncs:
            return _run_cli(args, run_dir), syncs, None, busy
    try:
        from runner.device_tracking import tracking

        with tracking() as tracker, _syncs_per_step(tracker) as syncs:
            return _run_cli(args, run_dir), syncs, None, None
    except Exception as e:  # the harness is new: a run that fails under it runs again without it
        harness_error = _one_line(e)
    return _run_cli(args, run_dir.with_name(run_dir.name + "-untracked")), None, harness_error, None


def measure(row: Row, metrics: list[dict], syncs: dict | None, busy: dict | None = None) -> dict:
    """The row's figures: the second epoch of its fit (the GPU's busy time: the first's last steps)."""
    epoch = next((r for r in metrics if r.get(row.prefix + "epoch") == 2), None)
    if epoch is None:
        raise RowError(f"no second epoch of {row.prefix or 'the fit'} in metrics.jsonl")
    m = {key.removeprefix(row.prefix): value for key, value in epoch.items() if key.startswith(row.prefix)}
    train_s = m["time/pass_s"] + m["time/train_s"]
    own_s = m["time/pass_s"] + m["time/transform_s"] + m.get("time/code_s", 0.0)  # hashing: its flow's
    out = {"step_ms": m["time/step_ms"], "images_s": 1000 * row.samples / m["time/step_ms"],
           "peak_gb": m.get("mem/peak_gb"), "reserved_gb": m.get("mem/reserved_gb"),
           "method_share": own_s / train_s,
           "syncs_per_step": None if syncs is None else syncs.get(row.prefix.removesuffix("/")),
           "device_ms": None if busy is None else busy.get(row.prefix.removesuffix("/"))}  # fmt: skip
    if out["device_ms"] is not None:  # the share of the step the GPU waits for the host
        out["host_bound"] = max(0.0, 1 - out["device_ms"] / out["step_ms"])
    if "select/solver_s" in m:  # CSOT's allocation
        out["allocation_share"] = m["select/solver_s"] / train_s
    return out


def run_rows(rows: list[Row], tmp: Path, extra: tuple[str, ...] = (), traces: Path | None = None) -> None:
    """Run `rows` (a hashing preset's two in one run) with `extra` overrides into each `row.result`; with
    `traces`, each run's profiled steps go there as Chrome traces."""
    runs: dict[tuple, list[Row]] = {}
    for row in rows:
        runs.setdefault(tuple(row.args), []).append(row)
    for args, group in runs.items():
        run_dir = tmp / f"run{len(list(tmp.glob('run*.log')))}"
        try:
            trace = None if traces is None else traces / f"trace-{group[0].preset}"
            metrics, syncs, harness_error, busy = _tracked_run([*args, *extra], run_dir, trace)
        except RowError as e:  # the run's last lines go into the record: the tmp dir is removed
            logs = [d.with_suffix(".log") for d in (run_dir, run_dir.with_name(run_dir.name + "-untracked"))]
            log = [path for path in logs if path.exists()][-1]  # the retry's without the harness
            tail = log.read_text().splitlines()[-LOG_TAIL:]
            for row in group:
                row.result = {"error": str(e), "log_tail": tail}
            continue
        for row in group:
            try:
                row.result = measure(row, metrics, syncs, busy)
            except Exception as e:
                row.result = {"error": _one_line(e)}
            if harness_error:
                row.result["syncs_error"] = harness_error


def measure_reference(row: Row, steps: int, cache: dict) -> None:
    """The hand-written step of `row.reference` (`reference_step_ms`) into `row.result["reference_ms"]`,
    measured once per network, batch and precision; an error in the record, not the row."""
    from runner.models import build_model

    spec = row.reference
    if spec is None or "error" in row.result:
        return
    key = json.dumps([spec, row.batch], sort_keys=True)
    if key not in cache:
        try:
            model = build_model(OmegaConf.create(spec["model"]), tuple(spec["shape"]), spec["classes"])
            device = "cuda" if torch.cuda.is_available() else "cpu"
            cache[key] = reference_step_ms(model, row.batch, tuple(spec["shape"]), spec["classes"],
                                           spec["precision"], steps, device)  # fmt: skip
        except Exception as e:
            cache[key] = None
            row.result["reference_error"] = _one_line(e)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    row.result["reference_ms"] = cache[key]


def _fmt(value, spec: str) -> str:
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
    syncs = "n/a" if "syncs_error" in r else _fmt(r["syncs_per_step"], ".2f")
    ref = r.get("reference_ms")
    cells = [row.preset, row.method, row.batches, _fmt(r["step_ms"], ".2f"), _fmt(r.get("device_ms"), ".2f"),
             _fmt(r.get("host_bound"), ".0%"), _fmt(r["images_s"], ".0f"), _fmt(r["peak_gb"], ".2f"),
             _fmt(r["reserved_gb"], ".2f"), _fmt(r["method_share"], ".1%"), syncs,
             "-" if ratio is None else f"{ratio:.2f}x", _fmt(ref, ".2f"),
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
            shown = _fmt(value, ".2f") + "x"
        else:
            what, need = f"{row.key} allocation share of its epoch", f"<= {bound:.0%}"
            value = row.result.get("allocation_share")
            shown = _fmt(value, ".1%")
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


def variants(rows: list[Row], tmp: Path, kinds=FULL_KINDS, steps: int = STEPS,
             reference_cache: dict | None = None) -> tuple[list[str], list[dict]]:  # fmt: skip
    """The rows as measured (the preset's hardware) against the `kinds` of `VARIANTS` (fp32 eager, bf16,
    torch.compile, lag): table lines and records (ms/step, the row's speed over the variant's, and the
    variant over its own precision's reference step); no table without rows."""
    if not rows:
        return [], []
    reference_cache = {} if reference_cache is None else reference_cache
    head = ["preset", "method", "as preset ms/step", *(f"{v} ms/step (preset's speed-up)" for v in kinds)]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    print("\n".join(lines), flush=True)
    records = []
    for row in rows:
        cells = [row.preset, row.method, _fmt(row.result.get("step_ms"), ".1f")]
        for variant in kinds:
            extra = VARIANTS[variant]
            if variant in METHOD_VARIANTS and row.baseline is None:
                cells.append("n/a (a method option)")
                continue
            reference = row.reference and {**row.reference, **VARIANT_REFERENCE.get(variant, {})}
            twin = dataclasses.replace(row, result={}, reference=reference)
            run_rows([twin], tmp, tuple(extra))
            measure_reference(twin, steps, reference_cache)
            records.append({"key": row.key, "variant": variant, **twin.result})
            if "error" in twin.result:
                cells.append(f"error: {twin.result['error']}")
            else:
                ms, ref = twin.result["step_ms"], twin.result.get("reference_ms")
                speedup = _fmt(row.result["step_ms"] / ms if "step_ms" in row.result else None, ".2f")
                cells.append(f"{ms:.2f} ({speedup}x)" + ("" if ref is None else f", {ms / ref:.2f}x ref"))
        lines.append("| " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
    return lines, records


def ddp_scaling(rows: list[Row], tmp: Path) -> str:
    """`DDP_PRESET`'s method row on every visible GPU (torchrun, `hardware=ddp`) against one GPU."""
    n = torch.cuda.device_count()
    row = next((r for r in rows if r.preset == DDP_PRESET and r.baseline), None)
    if n < 2:
        return f"DDP scaling: skipped, {n} CUDA device visible (it needs 2 or more)"
    if row is None or "error" in row.result:
        return f"DDP scaling: skipped, no single-GPU row of {DDP_PRESET} to compare with"
    if row.batch % n:
        return f"DDP scaling: skipped, {row.key}'s batch of {row.batch} does not split over {n} GPUs"
    run_dir = tmp / "ddp"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}", "-m",
           "runner.cli", *row.args, "hardware=ddp", f"hydra.run.dir={run_dir}"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if proc.returncode:  # a rank's one-line error or exception, above torchrun's report of the failure
        lines = [line.strip() for line in proc.stderr.splitlines() if line.strip()]
        reason = re.compile(r"runner: error: |[\w.]+(Error|Exception): \S")
        error = next((line for line in lines if reason.match(line)), lines[-1] if lines else "no output")
        return f"DDP scaling: {row.key} on {n} GPUs: error: {error}"
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    step = next(r for r in metrics if r.get(row.prefix + "epoch") == 2)[row.prefix + "time/step_ms"]
    images = 1000 * row.samples / step
    return (f"DDP scaling: {row.key} on {n} GPUs: {step:.1f} ms/step, {images:.0f} images/s, "
            f"{images / (n * row.result['images_s']):.0%} of {n} times one GPU's")  # fmt: skip


def _record_name() -> str:
    """<gpu>-<torch>-<commit>: the device, the torch version and the checkout measured."""
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    try:
        git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).parent).stdout.strip()  # fmt: skip
    except OSError:  # no git
        git = ""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", f"{device}-{torch.__version__}-{git or 'nogit'}")


EPOCH_PRESETS = tuple(p for p in PRESETS if "cifar" in p)  # `--epoch`: the CIFAR-size presets
SMOKE_KINDS = ("eager", "graph", "bf16")  # --smoke's variant columns (compile's CPU build takes minutes)


def _overridden(args: list[str], changes: list[str]) -> list[str]:
    """`args` with `changes` in place of their keys' earlier values (Hydra refuses a key twice)."""
    keys = {change.split("=", 1)[0] for change in changes}
    return [arg for arg in args if arg.split("=", 1)[0] not in keys] + changes


def full_epochs(presets: list[str], tmp: Path, smoke: bool) -> list[str]:
    """`--epoch`: one whole epoch of each preset's method row on generated data of the real dataset's
    size (--smoke: 2 batches), its evaluation and its checkpoint; table lines of the epoch's, the
    evaluation's and the checkpoint's seconds."""
    from runner import train
    from runner.compose import compose
    from runner.data.fake import SHAPES

    head = ["preset", "method", "steps", "epoch s", "training s", "evaluation s", "checkpoint s", "ms/step"]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    print("\n".join(lines), flush=True)
    saves: list[float] = []
    save = train.Resumable.save

    def timed_save(self, *args, **kwargs):
        start = time.perf_counter()
        save(self, *args, **kwargs)
        saves.append(time.perf_counter() - start)

    train.Resumable.save = timed_save
    try:
        for preset in presets:
            cfg = compose([f"+experiment={preset}"])
            n_train, n_test = SHAPES[LIKE[cfg.dataset.name]][2:]
            probe = plan(preset, smoke, 1)[-1]
            steps = 2 if smoke else n_train // probe.batch
            row = plan(preset, smoke, steps)[-1]
            test_size = 64 if smoke else n_test
            changes = ["train.epochs=1", "train.checkpoint=true", f"dataset.test_size={test_size}"]
            if cfg.method.task == "hashing":  # by iterations: one pass of the training set for each fit
                changes += [f"method.iters={steps}", f"method.base_iters={steps}"]
            saves.clear()
            run_dir = tmp / f"epoch-{preset}"
            try:
                metrics = _run_cli(_overridden(row.args, changes), run_dir)
                m = next(r for r in metrics if r.get(row.prefix + "epoch") == 1)
                m = {key.removeprefix(row.prefix): value for key, value in m.items()}
                cells = [preset, row.method, str(steps), f"{m['time/epoch_s']:.1f}",
                         f"{m['time/train_s'] + m['time/pass_s']:.1f}", _fmt(m.get("time/eval_s"), ".1f"),
                         _fmt(saves[-1] if saves else None, ".2f"), f"{m['time/step_ms']:.1f}"]  # fmt: skip
            except Exception as e:
                cells = [preset, row.method, str(steps), f"error: {_one_line(e)}"]
            lines.append("| " + " | ".join(cells) + " |")
            print(lines[-1], flush=True)
    finally:
        train.Resumable.save = save
    return lines


def write_record(out: Path, name: str, full: bool, steps: int, lines: list[str], rows: list[Row],
                 checks: list[tuple[str, bool]], extra: list[str], variant_records: list[dict],
                 summary: str, host: dict) -> None:
    """`<out>/<name>.md` (the tables, targets, variants, DDP line) and `.json` (every row): rewritten after
    each preset, so that a run stopped part-way keeps the rows it measured."""
    notes = [f"syncs n/a for {row.key}: runner.device_tracking failed: {row.result['syncs_error']}"
             for row in rows if "syncs_error" in row.result]  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    machine = f"{host['device']}, {host['cpus']} CPUs, host marker {host['host_marker_us']:.2f} us/torch.add"
    text = [f"# bench_gpu {name}", "", machine, "", *lines, "", *(t for t, _ in checks), *notes, *extra, "",
            summary, ""]  # fmt: skip
    (out / f"{name}.md").write_text("\n".join(text))
    record = {"name": name, "smoke": not full, "steps": steps, "summary": summary,
              "rows": [{"key": row.key, **dataclasses.asdict(row)} for row in rows],
              "targets": [{"line": t, "ok": met} for t, met in checks], "variants": variant_records,
              "ddp": extra[-1] if full and extra else None, **host}  # fmt: skip
    (out / f"{name}.json").write_text(json.dumps(record, indent=1) + "\n")


def main(argv: list[str] | None = None) -> bool | None:
    parser = argparse.ArgumentParser("python -m benchmarks.bench_gpu", description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="every row for 2 steps, at CPU size")
    parser.add_argument("--steps", type=int, default=STEPS, help="steps per epoch (default %(default)s)")
    parser.add_argument("--only", nargs="+", default=[], help="the presets whose name contains one of these")
    parser.add_argument("--variants", nargs="*", default=list(VARIANT_PRESETS), metavar="PRESET",
                        help="presets also run in bf16 and compiled (none: skip; default %(default)s)")
    parser.add_argument("--kinds", nargs="+", default=list(FULL_KINDS), choices=list(VARIANTS),
                        help="the variants' columns (default: %(default)s)")
    parser.add_argument("--profile", action="store_true",
                        help="each run's profiled steps as Chrome traces beside the record")
    parser.add_argument("--epoch", action="store_true",
                        help="one full epoch of each CIFAR-size preset (with --only: of those chosen)")
    parser.add_argument("--out", type=Path, help="where the record goes (default: results/, or a tmp dir)")
    opts = parser.parse_args([] if argv is None else argv)
    unknown = sorted(set(opts.variants) - set(PRESETS))
    if unknown:
        parser.error(f"--variants {' '.join(unknown)}: not a preset; choose from {', '.join(PRESETS)}")
    cuda = torch.cuda.is_available()
    if not cuda and not opts.smoke:
        print("bench_gpu: no CUDA device here; nothing measured (run it on a GPU machine, or with --smoke)")
        return None
    full = cuda and not opts.smoke
    steps = opts.steps if full else 1
    results = Path(__file__).parent / "results"
    out = opts.out or (results if full else Path(tempfile.mkdtemp(prefix="bench_gpu-")))
    presets = [p for p in PRESETS if not opts.only or any(s in p for s in opts.only)]
    started, threads = time.perf_counter(), torch.get_num_threads()
    if not cuda:  # tiny batches on a shared CPU: threads that wait for each other lose 10x under load
        torch.set_num_threads(1)
    name = _record_name()
    marker = host_marker_us()
    device = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"bench_gpu{'' if full else ' --smoke'} {name}: 2 epochs of {steps} step(s) per run on generated "
          f"data, the second measured; {device}, {os.cpu_count()} CPUs, host marker {marker:.2f} us per "
          "torch.add", flush=True)  # fmt: skip
    lines = ["| " + " | ".join(COLUMNS) + " |", "|---" * len(COLUMNS) + "|"]
    print("\n".join(lines), flush=True)
    rows: list[Row] = []
    by_key: dict[str, Row] = {}
    checks, extra, variant_records = [], [], []

    def record(summary: str) -> None:
        host = {"device": device, "cpus": os.cpu_count(), "host_marker_us": marker}
        write_record(out, name, full, steps, lines, rows, checks, extra, variant_records, summary, host)

    references: dict = {}
    traces = out if opts.profile else None

    try:
        with tempfile.TemporaryDirectory(prefix="bench_gpu-runs-") as tmp:
            for preset in presets:
                try:
                    planned = plan(preset, not full, steps)
                except Exception as e:
                    planned = [Row(preset, "-", [], 0, result={"error": _one_line(e)})]
                else:
                    run_rows(planned, Path(tmp), traces=traces)
                for row in planned:
                    measure_reference(row, steps, references)
                    rows.append(row)
                    by_key[row.key] = row
                    lines.append(table_line(row, by_key))
                    print(lines[-1], flush=True)
                record(f"stopped after {len(rows)} rows ({time.perf_counter() - started:.0f} s)")
            checks = targets(rows, by_key) if full else []
            for text, _ in checks:
                print(text, flush=True)
            print()
            if full:
                chosen = [row for row in rows if row.preset in opts.variants]
                kinds = opts.kinds
            else:  # in miniature: the first variant preset's baseline, the columns a CPU builds quickly
                chosen = [row for row in rows if row.preset in VARIANT_PRESETS[:1] and row.reference][:1]
                kinds = SMOKE_KINDS
            variant_lines, variant_records = variants(chosen, Path(tmp), kinds, steps, references)
            speed = speed_targets(rows, variant_records) if full else []
            for text, _ in speed:
                print(text, flush=True)
            checks += speed
            extra = ["", *variant_lines] if variant_lines else []
            if opts.epoch:
                epoch_presets = [p for p in EPOCH_PRESETS if p in presets]
                extra += ["", *full_epochs(epoch_presets, Path(tmp), not full)]
            if full:
                try:
                    ddp = ddp_scaling(rows, Path(tmp))
                except Exception as e:  # the rows' record is written whatever happens here
                    ddp = f"DDP scaling: error: {_one_line(e)}"
                extra += ["", ddp]
                print(ddp)
    finally:
        torch.set_num_threads(threads)
    for row in rows:
        if "syncs_error" in row.result:
            print(f"syncs n/a for {row.key}: runner.device_tracking failed: {row.result['syncs_error']}")
    failed = [row for row in rows if "error" in row.result]
    ok = not failed and all(met for _, met in checks)
    summary = f"{len(rows) - len(failed)}/{len(rows)} rows ran in {time.perf_counter() - started:.0f} s"
    record(summary)
    print(f"{summary}: {'all ok' if ok else 'FAILED'} -> {out / name}.md, .json")
    return ok


if __name__ == "__main__":
    sys.exit(0 if main(sys.argv[1:]) is not False else 1)
