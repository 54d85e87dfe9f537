"""docs/adding-a-method.md, run: its blocks are applied to a temporary copy of the repository (a `# file:`
block written, an `# append to:` block appended, an `# add to EXPORTS in:` line added to the façade's
list), and the page's own tests run there with the façade's check, in a Python whose `runner` is the
copy's."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "adding-a-method.md"
BLOCK = re.compile(r"^```\w*\n# (file|append to|add to EXPORTS in): (\S+)\n(.*?)^```", re.M | re.S)
COPIED = ("runner", "conf", "tests", "pyproject.toml")


def page_blocks() -> list[tuple[str, str, str]]:
    """The page's blocks: (how, path, text), the marker line left out."""
    return BLOCK.findall(PAGE.read_text())


def apply(blocks, root: Path) -> None:
    for how, path, text in blocks:
        target = root / path
        if how == "file":
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)
        elif how == "append to":
            target.write_text(target.read_text() + text)
        else:  # a line of the façade's EXPORTS
            source = target.read_text()
            assert source.count("EXPORTS = {\n") == 1
            target.write_text(source.replace("EXPORTS = {\n", "EXPORTS = {\n" + text, 1))


def test_the_page_lists_six_files_and_its_blocks_touch_only_them():
    rows = re.findall(r"^\| (\d) \| `([^`]+)` \|", PAGE.read_text(), re.M)
    assert [int(n) for n, _ in rows] == list(range(1, 7))
    patterns = [re.escape(p).replace("<name>", r"\w+").replace("<task>", r"\w+") for _, p in rows]
    touched = {path for _, path, _ in page_blocks()}
    assert len(touched) == 6, sorted(touched)  # every file of the table, each once
    assert all(any(re.fullmatch(p, path) for p in patterns) for path in touched), sorted(touched)


def test_the_page_s_method_trains_in_a_copy_of_the_repository(tmp_path):
    for name in COPIED:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(
                source, tmp_path / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__")
            )
        else:
            shutil.copy(source, tmp_path / name)
    apply(page_blocks(), tmp_path)
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "WANDB_SILENT": "true", "CUDA_VISIBLE_DEVICES": ""}
    facade = "tests/test_import_graph.py::test_the_facade_lists_every_solver_once"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "tests/test_label_smoothing.py", facade],
        cwd=tmp_path, env=env, text=True, capture_output=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "3 passed" in proc.stdout, proc.stdout[-2000:]
    # the copy's code ran, not this tree's: its method is not registered here
    from runner.configs import METHODS

    assert "label_smoothing" not in METHODS
