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
from torch.profiler import ProfilerActivity, profile

from benchmarks.gpu_rows import (
    COLUMNS,
    DDP_PRESET,
    FULL_KINDS,
    METHOD_VARIANTS,
    PRESETS,
    VARIANT_PRESETS,
    VARIANT_REFERENCE,
    VARIANTS,
    Row,
    RowError,
    fmt,
    one_line,
    plan,
    speed_targets,
    table_line,
    targets,
)
from benchmarks.reference_step import host_marker_us, reference_step_ms
from runner.data.fake import LIKE
from runner.instruments import Instruments, watching

STEPS = 50
PROFILED_STEPS = 5  # of each fit's warm-up epoch, for the GPU's busy time per step
# In-process runs: no Hydra files or logging set-up of their own (a run's output goes to its log).
LOG_TAIL = 40  # lines of a failed run's log kept in the record
QUIET = ["hydra.output_subdir=null", "hydra/job_logging=none", "hydra/hydra_logging=none"]


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
        raise RowError(one_line(e)) from None
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


class _SyncCounter(Instruments):
    """Host-device syncs per training step in each fit's measured (second) epoch, by fit tag ("" for an
    untagged fit; `counts`): the steady state, after the first epoch's one-time work (cuDNN autotuning,
    caches). Counted by `tracker` (`runner.device_tracking`, on the CPU) or as CUDA's sync-debug warnings."""

    def __init__(self, tracker=None):
        self.tracker, self.counts = tracker, {}

    @contextlib.contextmanager
    def epoch(self, tag, epoch, steps):
        if epoch != 1:
            yield
            return
        if self.tracker is not None:
            before = self.tracker.train_syncs()
            yield
            syncs = self.tracker.train_syncs() - before
        else:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    yield
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            syncs = sum("synchronizing CUDA operation" in str(w.message) for w in caught)
        self.counts[tag or ""] = syncs / max(steps, 1)


class _DeviceBusy(Instruments):
    """The GPU's busy time per training step by fit tag (`busy`): the kernels' and copies' time in the last
    `PROFILED_STEPS` steps of each fit's warm-up (first) epoch, read by torch.profiler (their sum, not the
    span: what the step would take were the host never late). With `trace`, those steps' Chrome trace
    goes there (`<trace>-<tag>.json`)."""

    def __init__(self, trace: Path | None = None):
        self.trace, self.busy = trace, {}
        self.steps, self.done, self.profiled, self.prof = None, 0, 0, None

    @contextlib.contextmanager
    def epoch(self, tag, epoch, steps):
        if epoch != 0:
            yield
            return
        self.steps, self.done, self.prof = steps, 0, None
        try:
            yield
        finally:
            if self.prof is not None:
                torch.cuda.synchronize()
                self.prof.stop()
                kernels = [e for e in self.prof.key_averages()
                           if e.device_type == torch.autograd.DeviceType.CUDA]  # fmt: skip
                total_us = sum(e.self_device_time_total for e in kernels)
                if total_us:  # none seen: kernels the profiler could not follow (a graph captured before it)
                    self.busy[tag or ""] = total_us / 1000 / self.profiled
                if self.trace is not None:
                    self.prof.export_chrome_trace(f"{self.trace}-{tag or 'fit'}.json")
            self.steps = None

    def step(self, s, x, idx, epoch):
        if self.steps is not None:
            if self.done == max(self.steps - PROFILED_STEPS, 0):
                torch.cuda.synchronize()
                self.prof = profile(activities=[ProfilerActivity.CUDA])
                self.prof.start()
                self.profiled = self.steps - self.done
            self.done += 1
        return contextlib.nullcontext()


class _SaveTimer(Instruments):
    """The seconds of each checkpoint written (`seconds`)."""

    def __init__(self):
        self.seconds: list[float] = []

    @contextlib.contextmanager
    def checkpoint(self):
        start = time.perf_counter()
        yield
        self.seconds.append(time.perf_counter() - start)


def _tracked_run(args: list[str], run_dir: Path, trace: Path | None = None):
    """`_run_cli` with the syncs counted: (metrics rows, syncs per step by fit tag, and the CPU
    tracking harness's error where the run failed under it but not without it); on CUDA also the GPU's
    busy ms per step by fit tag (`_DeviceBusy`, its trace to `trace`), else None."""
    if torch.cuda.is_available():
        gc.collect()  # the last run's blocks out of the allocator's cache: this run's reserved memory
        torch.cuda.empty_cache()
        with watching(_DeviceBusy(trace)) as busy, watching(_SyncCounter()) as syncs:
            return _run_cli(args, run_dir), syncs.counts, None, busy.busy
    try:
        from runner.device_tracking import tracking

        with tracking() as tracker, watching(_SyncCounter(tracker)) as syncs:
            return _run_cli(args, run_dir), syncs.counts, None, None
    except Exception as e:  # the harness is new: a run that fails under it runs again without it
        harness_error = one_line(e)
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
                row.result = {"error": one_line(e)}
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
            row.result["reference_error"] = one_line(e)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    row.result["reference_ms"] = cache[key]


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
        cells = [row.preset, row.method, fmt(row.result.get("step_ms"), ".1f")]
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
                speedup = fmt(row.result["step_ms"] / ms if "step_ms" in row.result else None, ".2f")
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
    from runner.compose import compose
    from runner.data.fake import SHAPES

    head = ["preset", "method", "steps", "epoch s", "training s", "evaluation s", "checkpoint s", "ms/step"]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    print("\n".join(lines), flush=True)
    with watching(_SaveTimer()) as timer:
        saves = timer.seconds
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
                         f"{m['time/train_s'] + m['time/pass_s']:.1f}", fmt(m.get("time/eval_s"), ".1f"),
                         fmt(saves[-1] if saves else None, ".2f"), f"{m['time/step_ms']:.1f}"]  # fmt: skip
            except Exception as e:
                cells = [preset, row.method, str(steps), f"error: {one_line(e)}"]
            lines.append("| " + " | ".join(cells) + " |")
            print(lines[-1], flush=True)
    return lines


def write_record(
    out: Path,
    name: str,
    full: bool,
    steps: int,
    lines: list[str],
    rows: list[Row],
    checks: list[tuple[str, bool]],
    extra: list[str],
    variant_records: list[dict],
    summary: str,
    host: dict,
) -> None:
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
    parser.add_argument(
        "--variants",
        nargs="*",
        default=list(VARIANT_PRESETS),
        metavar="PRESET",
        help="presets also run in bf16 and compiled (none: skip; default %(default)s)",
    )
    parser.add_argument(
        "--kinds",
        nargs="+",
        default=list(FULL_KINDS),
        choices=list(VARIANTS),
        help="the variants' columns (default: %(default)s)",
    )
    parser.add_argument(
        "--profile", action="store_true", help="each run's profiled steps as Chrome traces beside the record"
    )
    parser.add_argument(
        "--epoch",
        action="store_true",
        help="one full epoch of each CIFAR-size preset (with --only: of those chosen)",
    )
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
                    planned = [Row(preset, "-", [], 0, result={"error": one_line(e)})]
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
                    ddp = f"DDP scaling: error: {one_line(e)}"
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
