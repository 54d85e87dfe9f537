"""The Hydra callback of every multirun (`hydra.callbacks` in conf/config.yaml): failed and pruned jobs
recorded in their summary.json, and the sweep's table printed at its end."""

from __future__ import annotations

import atexit
import json
import logging
import sys
import traceback
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import OmegaConf

from runner.checks import ConfigError
from runner.report.render import markdown
from runner.report.runs import build_report
from runner.rundir import multirun_job

log = logging.getLogger(__name__)


def print_sweep_summary(sweep_dir) -> None:
    """The table of a finished (or failed) multirun, printed at its end; never raises."""
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()  # the sweep is over; composing a preset (paper numbers) needs Hydra
    try:
        text = markdown(build_report(sweep_dir))
    except Exception as e:  # a summary must not mask the sweep's own outcome
        print(f"runner: no sweep summary for {sweep_dir}: {e}", file=sys.stderr)
        return
    print(f"\n{text}\nPlots and report.md: runner-report {sweep_dir}", flush=True)


def cancel_sweep_summary() -> None:
    """No table at this process's exit (a stopped sweep: `runner.cli`); a no-op where no sweep began."""
    atexit.unregister(print_sweep_summary)


class SweepSummary(Callback):
    """Hydra callback (hydra.callbacks in conf/config.yaml): record failed and pruned jobs (the search
    stopped them: runner.sweeper) in their summary.json, summarize each multirun.

    Hydra's sweepers run every job of a batch, then raise the first failure, so `on_multirun_end` never
    runs after a failed job: the summary is printed at exit instead, after Hydra's own error report.
    """

    def on_multirun_start(self, config, **kwargs) -> None:
        atexit.register(print_sweep_summary, Path(config.hydra.sweep.dir))

    def on_job_end(self, config, job_return, **kwargs) -> None:
        from hydra.core.utils import JobStatus

        from runner.faults import JobFailed
        from runner.sweeper import Pruned
        from runner.track import log_to_file

        if job_return.status != JobStatus.FAILED or not multirun_job(config.hydra):
            return  # a single run reports its own failure
        error = job_return._return_value  # the exception; `.return_value` would re-raise it
        error = error.cause if isinstance(error, JobFailed) else error
        path = Path(config.hydra.runtime.output_dir) / "summary.json"
        summary = json.loads(path.read_text()) if path.exists() else {}
        num, overrides = (
            config.hydra.job.num,
            " ".join(OmegaConf.select(config, "hydra.overrides.task") or []),
        )
        if isinstance(error, Pruned):  # the search stopped a trial falling behind: no failure
            log.info("job %s: %s", num, error)
            print(f"#{num} pruned  {overrides}: {error}")
            summary["pruned"] = str(error)
        else:  # one line here; the traceback (unless a bad value's one line says it all) in the job's log
            log_file = Path(config.hydra.runtime.output_dir) / f"{config.hydra.job.name}.log"
            log_to_file(log, logging.ERROR, "job %s failed: %s", num, error,
                        exc_info=None if isinstance(error, ConfigError) else error)  # fmt: skip
            summary["error"] = f"{type(error).__name__}: {error}"  # what runner-report lists it by
            print(f"#{num} failed  {overrides}: {summary['error']} (log: {log_file})")
        path.write_text(json.dumps(summary, indent=2) + "\n")
        _release_frames(error)


def _release_frames(error: BaseException | None) -> None:
    """Clear the local variables of the frames in `error`'s traceback and its causes' (the lines stay).
    Hydra holds a failed job's exception until the sweep's batch ends: its frames would keep the job's
    model and tensors, a GPU's memory among them, while the next jobs run (after an out-of-memory stop,
    into the same error)."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)
        error = error.__cause__ or error.__context__
