"""Shared helpers: run the `runner` CLI in a scratch directory, find its run dirs."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import runner  # noqa: F401  (first: its environment for POT, set before a test module imports POT)


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


def summaries(root) -> dict[Path, dict]:
    """Every summary.json under `root`, by run dir."""
    return {p.parent: json.loads(p.read_text()) for p in sorted(Path(root).rglob("summary.json"))}


@pytest.fixture
def cli(tmp_path):
    """`cli(*args)` runs the CLI inside this test's tmp dir."""
    return lambda *args, **kw: run_cli(list(args), tmp_path, **kw)
