"""docs/adding-a-method.md, run: its `# file: PATH` blocks are written into a temporary copy of their
places (each package's search path extended there, the YAML given by `--config-dir`), the config module
registers the method, and the CLI runs its preset and `+method=` with `+debug=smoke`."""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import re
import sys
from pathlib import Path

import pytest

import runner.configs
import runner.hooks
import runner.methods
import runner.tasks
from runner.cli import run_in_process
from runner.configs import METHODS, TASK_METHODS, TASKS

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "adding-a-method.md"
BLOCK = re.compile(r"^```\w*\n# file: (\S+)\n(.*?)^```", re.M | re.S)
PACKAGES = {"runner/methods": runner.methods, "runner/configs": runner.configs, "runner/hooks": runner.hooks,
            "runner/tasks": runner.tasks}  # fmt: skip


def page_files() -> dict[str, str]:
    """The page's files: path -> content (the `# file:` line left out of Python, kept as YAML's comment)."""
    return {path: text for path, text in BLOCK.findall(PAGE.read_text())}


@pytest.fixture
def toy_method(tmp_path, monkeypatch):
    """The page's method written under tmp_path and registered; the registry and modules restored after."""
    for path, text in page_files().items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    for where, package in PACKAGES.items():
        monkeypatch.setattr(package, "__path__", [*package.__path__, str(tmp_path / where)])
    registry = [(d, dict(d)) for d in (TASKS, TASK_METHODS, METHODS)]
    before = set(sys.modules)
    yield tmp_path
    for d, saved in registry:
        d.clear()
        d.update(saved)
    for name in set(sys.modules) - before:
        if "smoothing" in name:
            del sys.modules[name]


def test_the_page_lists_eight_files_and_writes_its_code():
    rows = re.findall(r"^\| (\d) \| `([^`]+)` \|", PAGE.read_text(), re.M)
    assert [int(n) for n, _ in rows] == list(range(1, 9))
    written = page_files()
    assert len(written) == 7  # the docs page is prose
    patterns = [re.escape(p).replace("<name>", r"\w+").replace("<task>", r"\w+").replace("<preset>", r"\w+")
                for _, p in rows]  # fmt: skip
    assert all(any(re.fullmatch(p, path) for p in patterns) for path in written), sorted(written)


def test_a_new_method_runs_through_the_registry(toy_method, monkeypatch):
    importlib.import_module("runner.configs.smoothing")  # its registration, as `runner.configs` imports it
    assert METHODS["label_smoothing"]().eps == 0.1 and TASKS["smoothing"].evaluable
    hooks_module = importlib.import_module("runner.hooks.label_smoothing")
    calls = []
    loss = hooks_module.LabelSmoothingHooks.loss
    monkeypatch.setattr(hooks_module.LabelSmoothingHooks, "loss", lambda *a: calls.append(1) or loss(*a))
    conf = str(toy_method / "conf")
    preset, method = ["+experiment=label_smoothing_digits"], ["+method=label_smoothing", "method.eps=0.05"]
    for i, args in enumerate((preset, method)):
        run_dir = toy_method / f"run{i}"
        flags = ["--config-dir", conf]  # before the overrides: Hydra's parser takes one run of them
        run_in_process([*flags, *args, "+debug=smoke", "logger=none", f"hydra.run.dir={run_dir}"])
        summary = json.loads((run_dir / "summary.json").read_text())
        assert math.isfinite(summary["test/acc"])
        assert (run_dir / "config.yaml").read_text().count("task: smoothing") == 1
    assert calls  # the method's loss trained it
    from runner.report import task_metric

    assert task_metric({"method": {"task": "smoothing"}}) == ("test/acc", "max")
    with pytest.raises(SystemExit):  # its schema checks a bad value before anything runs
        run_in_process(["--config-dir", conf, "--cfg", "job", "+method=label_smoothing", "method.eps=1.5"])


def test_the_page_s_own_tests_pass(toy_method):
    path = toy_method / "tests" / "test_label_smoothing.py"
    spec = importlib.util.spec_from_file_location("test_label_smoothing", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    tests_run = [name for name in dir(module) if name.startswith("test_")]
    for name in tests_run:
        getattr(module, name)()
    assert tests_run
