"""`runner`: compose dataset, model, hardware, logger (and an optional `+method=`), run its task.

The entry points and the run: `main` checks the command line and completes it (`runner.compose`, where
every job's config is composed and checked before Hydra starts anything), then Hydra runs `_run` once
per job: lock the run dir, set up device and tracker, run the task, write the summary.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.metadata
import logging
import math
import os
import signal
import sys
import time
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from runner import rundir, sweeper
from runner.checks import ConfigError
from runner.compose import CONF_DIR, CommandLine, build_job
from runner.data import missing_files
from runner.data.files import UnreadableImage
from runner.faults import CheckpointError, Diverged, Interrupted, JobFailed, OutOfMemory, out_of_memory_stops
from runner.interrupts import handle_dropped_exceptions
from runner.methods._native import NativeBuildError
from runner.overrides import help_text
from runner.report.callback import cancel_sweep_summary
from runner.schema import main_metric, objective_key
from runner.task import task_of

log = logging.getLogger("runner")

# The launchers that log a line as each job starts (Hydra's basic one, joblib's).
_LAUNCHER_LOGGERS = (
    "hydra._internal.core_plugins.basic_launcher",
    "hydra_plugins.hydra_joblib_launcher._core",
)


def _job(cfg: DictConfig, preset_note: str | None) -> float | None:
    """One job Hydra launches, its end whatever it is: a result, one line and an exit code, or in a
    sweep a failed job for the sweep's table."""
    hydra_cfg = HydraConfig.get()
    multirun = rundir.multirun_job(hydra_cfg)
    # Whatever ends the job, `cleanup` finishes its W&B run, leaves the process group, frees the run dir.
    with contextlib.ExitStack() as cleanup:
        if multirun:
            cleanup.callback(_count_ended)
        try:
            return _run(cfg, cleanup, preset_note)
        except (KeyboardInterrupt, Interrupted) as e:
            stop = signal.Signals(getattr(e, "signum", signal.SIGINT))
            print(f"runner: stopped by {stop.name}; resume with: {_resume_hint(hydra_cfg)}", file=sys.stderr)
            cancel_sweep_summary()
            sys.exit(128 + stop)
        # bad input, or a run gone wrong
        except (ConfigError, Diverged, CheckpointError, OutOfMemory, UnreadableImage, NativeBuildError) as e:
            if multirun:  # the sweep goes on; SweepSummary lists the job as failed
                raise JobFailed(e) from e
            print(f"runner: error: {e}", file=sys.stderr)
            sys.exit(2 if isinstance(e, ConfigError) else 1)


def _resume_hint(hydra_cfg) -> str:
    """The command that resumes the job (checkpoints/last.pt of its run dir), and in a sweep the sweep."""
    hint = rundir.resume_command(hydra_cfg.runtime.output_dir, hydra_cfg.overrides.task)
    if rundir.multirun_job(hydra_cfg):
        hint += (
            f" (the whole sweep, {sweeper.progress} ended: its command line with "
            f"hydra.sweep.dir={hydra_cfg.sweep.dir})"
        )
    return hint


def _count_ended() -> None:
    sweeper.progress.ended += 1


def _run(cfg: DictConfig, cleanup: contextlib.ExitStack, preset_note: str | None) -> float | None:
    """One job: validate, lock the run dir, set up device and tracker, run the task, write the summary;
    the search objective's value."""
    t0 = time.perf_counter()
    cfg, ctx = _start(cfg, cleanup, preset_note)
    task = task_of(cfg)
    where = task.name  # the task (runner/tasks/<name>.py)
    method = cfg.method.name if "method" in cfg else "erm"
    log.info("%s: method=%s dataset=%s model=%s device=%s seed=%d -> %s", where, method,
             task.data_name(cfg), cfg.model.name, ctx.device, cfg.seed, ctx.dir)  # fmt: skip
    outside_fit = (  # `fit` names the batch itself
        "ran out of {} outside the training steps; lower the network's size, or train.eval_batch_size for "
        "the passes over whole splits"
    )
    with out_of_memory_stops(outside_fit.format):
        metrics = task.run(cfg, ctx)  # fills ctx.info (the model's parameter count) as it goes
    summary = {"name": cfg.name, "tags": list(cfg.logger.tags), **ctx.info, **metrics}
    summary["time/total_s"] = time.perf_counter() - t0
    return _finish(cfg, task, ctx, summary, f"{where} {method} on {task.data_name(cfg)}")


def _start(cfg: DictConfig, cleanup: contextlib.ExitStack, preset_note: str | None):
    """The typed job config and the run's context: device, process group, locked run dir, seeds and
    tracker, each undone by `cleanup`; the job's first log lines say what was chosen for it."""
    from runner.hardware import (
        RunContext,
        cap_host_memory,
        capped_workers,
        describe,
        idle_flags,
        seed_everything,
        setup,
        teardown,
    )
    from runner.track import Tracker, log_to_file

    hydra_cfg = HydraConfig.get()
    print_config, multirun = cfg.get("print_config", False), rundir.multirun_job(hydra_cfg)
    cfg, left_out, smoke_note = build_job(cfg, list(hydra_cfg.overrides.task))
    cfg.hardware.num_workers = capped_workers(cfg.hardware.num_workers)
    if multirun and cfg.logger.group is None:  # one W&B group per sweep
        cfg.logger.group = "/".join(Path(hydra_cfg.sweep.dir).parts[-2:])
    run_dir = Path(hydra_cfg.runtime.output_dir)
    if multirun:  # a sweep's console: one line per job (`_finish`); the job's records go to its log file
        for handler in logging.getLogger().handlers:
            if not isinstance(handler, logging.FileHandler):
                handler.setLevel(logging.WARNING)
    cleanup.callback(teardown)
    device, rank, world_size = setup(cfg.hardware)
    if device.type == "cpu":  # running out of memory: an error that names the batch, not the OOM killer
        cap_host_memory()
    if rank == 0:  # the first line: what the runner chose for the command line (a preset, the device)
        log.info("; ".join(filter(None, [preset_note, left_out, describe(cfg.hardware, device)])))
        if smoke_note:
            log.info(smoke_note)
        for line in idle_flags(cfg, device):
            log.info(line)
    if world_size > 1:  # torchrun's ranks: rank 0's run dir (another rank's clock may name another)
        run_dir = rundir.shared(run_dir, rank)
    if rank == 0:
        rundir.lock(run_dir)
        cleanup.callback(rundir.unlock, run_dir)
    resume = rundir.check_resume(run_dir, cfg)
    seed_everything(cfg.seed, cfg.hardware.deterministic, rank)
    if rank == 0:
        OmegaConf.save(cfg, run_dir / "config.yaml")
        # 70 lines: on the console only when asked for, or a run's own lines scroll away behind them
        log_to_file(log, logging.INFO, "config (validated):\n%s", OmegaConf.to_yaml(cfg).rstrip(),
                    console=print_config)  # fmt: skip
    tracker = Tracker(run_dir, cfg.logger, OmegaConf.to_container(cfg), enabled=rank == 0, resume=resume)
    cleanup.callback(tracker.close, exit_code=1)  # a no-op after tracker.finish
    hw = cfg.hardware
    ctx = RunContext(device, run_dir, tracker, precision=hw.precision, channels_last=hw.channels_last,
                     compile=hw.compile, cuda_graph=hw.cuda_graph, sync_bn=hw.sync_bn, rank=rank,
                     world_size=world_size, num_workers=hw.num_workers)  # fmt: skip
    return cfg, ctx


def _finish(cfg: DictConfig, task, ctx, summary: dict, what: str) -> float | None:
    """Write the job's summary and say its result in one line (`what`: the task, method and data); a
    non-finite main metric or search objective fails the run (for the report, and for Optuna). Returns
    what a search optimises: the validation twin of the main metric, never the test metric."""
    hydra_cfg = HydraConfig.get()
    multirun = rundir.multirun_job(hydra_cfg)
    metric = main_metric(cfg, task.metric)[0]  # the task's, or the preset's headline (`metric:`)
    bad = [f"{k}={summary[k]}" for k in {metric, objective_key(metric)} if _non_finite(summary.get(k))]
    if bad:
        summary["error"] = f"Diverged: {', '.join(sorted(bad))}"
    ctx.tracker.finish(summary)
    if bad:
        raise Diverged(f"{', '.join(sorted(bad))} in {ctx.dir / 'summary.json'}")
    if ctx.rank == 0 and metric not in summary:  # tasks name their keys as they run: a bad metric= shows now
        keys = [k for k, v in summary.items() if isinstance(v, float) and not k.startswith("time/")]
        log.warning("metric=%s is no key of this run's summary (runner-report tables by it); its keys: %s",
                    metric, ", ".join(keys))  # fmt: skip
    if ctx.rank == 0:
        shown = [metric] if multirun else [k for k in summary if k == metric or k.startswith("test/")][:6]
        values = "  ".join(f"{k}={summary[k]:.4f}" for k in shown if isinstance(summary.get(k), float))
        seconds = f"({summary['time/total_s']:.1f} s)"
        if multirun:
            print(f"#{hydra_cfg.job.num} done  {' '.join(hydra_cfg.overrides.task)}: {values}  {seconds}")
        else:
            print(f"{what}: {values}  {seconds} -> {ctx.dir / 'summary.json'}")
    score = summary.get(objective_key(metric))
    return float(score) if score is not None else None


def _non_finite(value) -> bool:
    return isinstance(value, float) and not math.isfinite(value)


def _claim_run_dir(line: CommandLine) -> None:
    """A single run into an existing run dir (a resume): lock it and check the resume before Hydra
    rewrites the dir's .hydra/ files; `_run` takes the same lock again and releases it."""
    if line.overrides is None or line.multirun:
        return
    run_dir = Path(line.hydra_config.hydra.run.dir)
    if not run_dir.is_dir():
        return
    job = line.job().config  # the job `_run` runs, built as it builds it
    if int(os.environ.get("RANK", 0)) == 0:
        rundir.lock(run_dir)
        atexit.register(rundir.unlock, run_dir)  # should Hydra fail before the job
    rundir.check_resume(run_dir, job)


def _quiet_optuna() -> None:
    """Optuna logs in colour through its own handler and its storage layer (alembic) announces each
    plugin at INFO: keep both out of a search's log (the sweeper's own lines and the trials' remain)."""
    import optuna

    optuna.logging.disable_default_handler()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    logging.getLogger("alembic").setLevel(logging.WARNING)


def _check_writable(line: CommandLine) -> None:
    """A one-line ConfigError where the run (or sweep) dir of the command line cannot be written: a
    read-only file system or folder (the working directory, for the default `outputs/`), before Hydra
    makes it."""
    key = "hydra.sweep.dir" if line.multirun else "hydra.run.dir"
    where = Path(OmegaConf.select(line.hydra_config, key))
    existing = next(p for p in [where, *where.absolute().parents] if p.exists())
    if os.access(existing, os.W_OK):
        return
    why = "a read-only file system" if os.statvfs(existing).f_flag & os.ST_RDONLY else "no write permission"
    raise ConfigError(
        f"{key}={where}: cannot write in {existing.absolute()} ({why}); give {key}=A_WRITABLE_FOLDER "
        f"(a run dir's copy there resumes it), or start runner from a writable folder"
    )


class _ClosedReaderIgnored:
    """A standard stream whose reader may go away (`runner ... | head -3`): once a write finds the pipe
    closed, the stream's descriptor points at /dev/null and the run goes on to its own end and exit code
    (its files hold what it writes), where Python would print a BrokenPipeError for each log record."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._to_devnull()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._to_devnull()

    def _to_devnull(self) -> None:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, self._stream.fileno())  # what the stream still buffers is flushed there
        os.close(devnull)

    def __getattr__(self, name):
        return getattr(self._stream, name)


@contextlib.contextmanager
def _closed_readers_ignored():
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = (_ClosedReaderIgnored(stream) for stream in saved)
    try:
        yield
    finally:
        sys.stdout, sys.stderr = saved


def main() -> None:
    with _closed_readers_ignored():
        try:
            _main()
        except KeyboardInterrupt:  # outside a job (a job reports its own, with the command to resume it)
            print("runner: interrupted before any job started; nothing was written", file=sys.stderr)
            sys.exit(130)


def _main() -> None:
    if "--version" in sys.argv[1:]:  # the runner's own version (Hydra's flag prints Hydra's)
        print(f"runner {importlib.metadata.version('runner')}")
        return
    if {"--help", "-h"} & set(sys.argv[1:]):  # Hydra's would first load every config of every group (seconds)
        print(help_text())
        return
    if any(a.startswith("+sweep=") or a.startswith("hydra/sweeper=optuna") for a in sys.argv[1:]):
        _quiet_optuna()
    try:
        line = CommandLine.parse(sys.argv[1:])
        printout = {"-c", "--cfg", "-i", "--info"} & set(line.args)
        runs = line.checked is not None and not printout
        single = not line.multirun
        missing = runs and single and missing_files(line.checked["dataset"])
        if missing:  # before a run dir is made for it (a sweep's job without its data fails alone)
            raise ConfigError(missing)
        if runs:
            _check_writable(line)
        _claim_run_dir(line)
    except ConfigError as e:
        print(f"runner: error: {e}", file=sys.stderr)
        sys.exit(2)
    sys.argv[1:] = line.args  # what Hydra parses, records and composes again per job
    if not single:
        for launcher in _LAUNCHER_LOGGERS:  # each job's own line says what it ran, once it has
            logging.getLogger(launcher).addFilter(lambda record: not str(record.msg).startswith("\t#"))

    @hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
    def job(cfg: DictConfig) -> float | None:
        return _job(cfg, line.preset_note)

    try:
        with _mode_from(line):
            job()
    except KeyboardInterrupt:  # outside a job (a job reports its own, with the command to resume it)
        if single:
            print("runner: interrupted before the run started; its command line starts it", file=sys.stderr)
        else:
            sweep = sweeper.progress.sweep_dir
            resume = f" with hydra.sweep.dir={sweep}" if sweep else ""
            print(f"runner: interrupted after {sweeper.progress}; its command line{resume} runs the rest",
                  file=sys.stderr)  # fmt: skip
        cancel_sweep_summary()
        sys.exit(130)


@contextlib.contextmanager
def _mode_from(line: CommandLine):
    """Hydra composes a command line's whole config once only to read its `hydra.mode` (`Hydra.get_mode`),
    then again to run it; the command line's first job, composed already, holds that value (a compose
    saved: 0.3-1 s of every start)."""
    from hydra._internal.hydra import Hydra

    if line.overrides is None:  # help and info: Hydra reads no mode
        yield
        return
    mode, composing = line.hydra_config.hydra.mode, Hydra.get_mode
    Hydra.get_mode = lambda self, config_name, overrides: mode
    try:
        yield
    finally:
        Hydra.get_mode = composing


def run_in_process(args: list[str]) -> None:
    """`runner ARGS` as a call, for tools that start several runs in one process (`make bench-gpu`, the
    device-tracking harness): a finished run returns, a failed one raises its SystemExit, and sys.argv
    and the root logger's handlers are left as they were (the run's, its log file's and the console streams
    of the moment, are closed: they would outlive the run and those streams)."""
    root = logging.getLogger()
    saved, handlers, level, sys.argv = sys.argv, root.handlers[:], root.level, ["runner", *args]
    try:
        main()
    except SystemExit as stop:
        if stop.code:
            raise
    finally:
        sys.argv = saved
        for handler in set(root.handlers) - set(handlers):
            handler.close()
        root.handlers[:], root.level = handlers, level


if __name__ == "__main__":
    handle_dropped_exceptions()
    main()
