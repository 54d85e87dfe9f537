"""Shared helpers: run the `runner` CLI in a scratch directory (in a subprocess, or in this process where a
test needs no process of its own), find its run dirs."""

import atexit
import contextlib
import io
import json
import logging
import os
import random
import resource
import subprocess
import sys
import warnings
from pathlib import Path
from unittest import mock

import pytest
from _pytest.mark import ParameterSet

# One intra-op thread, in this process and the CLI's subprocesses: the tests' tensors are small, and on a
# shared 2-core machine a second thread mostly waits for the first (the same tests took 20-25% longer with
# two, and 2-3x as long on a loaded machine). Read by torch when it loads; OMP_NUM_THREADS=N overrides it.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import runner  # noqa: E402, F401  (first: its environment for POT, set before a test module imports POT)


def run_cli(args, cwd, check=True, timeout=300):
    """Run `python -m runner.cli ARGS` in `cwd`; return the CompletedProcess (stdout+stderr text)."""
    env = {**os.environ, "WANDB_SILENT": "true", "HYDRA_FULL_ERROR": "0"}
    proc = subprocess.run(
        [sys.executable, "-m", "runner.cli", *args],
        cwd=cwd,
        env=env,
        text=True,
        capture_output=True,
        timeout=timeout,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"runner {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc


# The interpreter's default warning filters (`python -W` unset), as a CLI subprocess starts with them.
_PYTHON_WARNING_FILTERS = [("default", DeprecationWarning, "__main__"), ("ignore", DeprecationWarning, None),
                           ("ignore", PendingDeprecationWarning, None), ("ignore", ImportWarning, None),
                           ("ignore", ResourceWarning, None)]  # fmt: skip


def _show_on_stderr(message, category, filename, lineno, file=None, line=None):
    sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


def run_cli_here(args, cwd, check=True):
    """`run_cli` in this process (`runner.cli.run_in_process`): the same CompletedProcess (exit status,
    stdout, stderr) without the seconds of a Python start and its imports. For a run that needs no process
    of its own (no signals, DDP, W&B service, read-only cwd): its cwd, environment, warnings (as a fresh
    interpreter shows them: on its stderr), RNG and thread state, logging and memory cap are this process's
    again after it. A multirun's summary table, printed at a process's exit, is printed at the call's end."""
    import numpy as np
    import torch
    from hydra.core.hydra_config import HydraConfig

    from runner import cli as runner_cli
    from runner import hardware
    from runner.report.callback import print_sweep_summary

    out, err = io.StringIO(), io.StringIO()
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    levels = {name: (lg.level, lg.disabled) for name, lg in logging.Logger.manager.loggerDict.items()
              if isinstance(lg, logging.Logger)}  # fmt: skip
    rng = torch.get_rng_state(), np.random.get_state(), random.getstate()
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    data_limit, memory_cap = resource.getrlimit(resource.RLIMIT_DATA), hardware._memory_cap
    code, at_exit, register = 0, [], atexit.register

    def keep_sweep_summary(func, *args, **kwargs):  # Hydra's callback: at this process's exit
        if func is print_sweep_summary:
            at_exit.append(lambda: func(*args, **kwargs))
            return func
        return register(func, *args, **kwargs)

    with (mock.patch.dict(os.environ, {"WANDB_SILENT": "true", "HYDRA_FULL_ERROR": "0"}),
          mock.patch.object(atexit, "register", keep_sweep_summary),
          contextlib.chdir(cwd), warnings.catch_warnings(), contextlib.redirect_stdout(out),
          contextlib.redirect_stderr(err)):  # fmt: skip
        warnings.resetwarnings()
        for action, category, module in reversed(_PYTHON_WARNING_FILTERS):
            warnings.filterwarnings(action, category=category, module=module or "")
        warnings.showwarning = _show_on_stderr  # not into pytest's record of the test's warnings
        root.handlers[:], root.level = [], logging.WARNING  # a fresh process's (pytest's capture is off)
        try:
            runner_cli.run_in_process([str(a) for a in args])
        except SystemExit as stop:
            if isinstance(stop.code, int):
                code = stop.code
            else:  # as the interpreter exits with a message
                print(stop.code, file=sys.stderr)
                code = 1
        finally:
            for summary in at_exit:
                summary()
            root.handlers[:], root.level = handlers, level  # (the run's own, run_in_process closed)
            for name, lg in logging.Logger.manager.loggerDict.items():
                if isinstance(lg, logging.Logger):
                    lg.setLevel(levels.get(name, (logging.NOTSET, False))[0])
                    lg.disabled = levels.get(name, (logging.NOTSET, False))[1]
            torch.set_rng_state(rng[0])
            np.random.set_state(rng[1])
            random.setstate(rng[2])
            torch.set_num_threads(threads)
            torch.use_deterministic_algorithms(deterministic)
            resource.setrlimit(resource.RLIMIT_DATA, data_limit)
            hardware._memory_cap = memory_cap
            HydraConfig.instance().cfg = None
    proc = subprocess.CompletedProcess(["runner", *args], code, out.getvalue(), err.getvalue())
    if check and code != 0:
        raise AssertionError(f"runner {' '.join(map(str, args))} failed ({code}):\n{proc.stderr[-3000:]}")
    return proc


def summaries(root) -> dict[Path, dict]:
    """Every summary.json under `root`, by run dir."""
    return {p.parent: json.loads(p.read_text()) for p in sorted(Path(root).rglob("summary.json"))}


@pytest.fixture
def cli(tmp_path):
    """`cli(*args)` runs the CLI inside this test's tmp dir."""
    return lambda *args, **kw: run_cli(list(args), tmp_path, **kw)


@pytest.fixture
def cli_here(tmp_path):
    """`cli_here(*args)` runs the CLI inside this test's tmp dir, in this process (`run_cli_here`)."""
    return lambda *args, **kw: run_cli_here(list(args), tmp_path, **kw)


def quick_first(params, family=lambda param: param) -> list:
    """`params` for `pytest.mark.parametrize`, the first of each `family` run by `make test` and the others
    marked slow (`make test-slow`): the quick suite takes each family's path once, the longer one checks
    every member."""
    seen, out = set(), []
    for param in params:
        key = family(param)
        if key in seen:
            if not isinstance(param, ParameterSet):  # a tuple: the values of several names
                param = pytest.param(*(param if isinstance(param, tuple) else (param,)))
            param = pytest.param(*param.values, marks=[*param.marks, pytest.mark.slow], id=param.id)
        seen.add(key)
        out.append(param)
    return out
