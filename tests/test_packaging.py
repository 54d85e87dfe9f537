"""The runner as installed: its own version and help, and the wheel built from this repo, installed into a
fresh virtualenv, run from another folder (its configs, its C sources and its tasks inside the package)."""

import importlib.metadata
import json
import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
from conftest import run_cli_here

ROOT = Path(__file__).resolve().parents[1]


def test_version_is_the_runner_s(tmp_path):
    out = run_cli_here(["--version"], tmp_path).stdout
    assert out.strip() == f"runner {importlib.metadata.version('runner')}"


def test_help_lists_the_user_s_groups_only(tmp_path):
    out = run_cli_here(["--help"], tmp_path).stdout
    listing = out.split("Options of each group:\n")[1]
    groups = [line.split(":")[0].strip() for line in listing.splitlines() if ":" in line]
    assert {"dataset", "method", "model", "experiment", "sweep"} <= set(groups), groups
    assert not [group for group in groups if group.startswith(("schema", "hydra"))], groups
    assert "method: " in listing and "comixup" in listing.split("method: ")[1].splitlines()[0]


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The wheel of this checkout installed into a new virtualenv; its dependencies are this interpreter's
    (a .pth of its site-packages folders: a path line, so their .pth files, the editable runner's finder
    among them, are not run), nothing downloaded. Returns (the venv's bin folder, the wheel)."""
    where = tmp_path_factory.mktemp("wheel")
    build = [
        sys.executable,
        "-m",
        "pip",
        "wheel",
        ".",
        "--no-deps",
        "--no-build-isolation",
        "-q",
        "-w",
        where,
    ]
    subprocess.run(build, cwd=ROOT, check=True, capture_output=True)
    (wheel,) = where.glob("runner-*.whl")
    venv = where / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
    site = Path(sysconfig.get_path("purelib", vars={"base": str(venv), "platbase": str(venv)}))
    deps = [p for p in sys.path if p.endswith("site-packages")]
    (site / "project_deps.pth").write_text("\n".join(deps) + "\n")
    install = [venv / "bin" / "python", "-m", "pip", "install", "-q", "--no-deps", "--no-index", wheel]
    subprocess.run(install, check=True, capture_output=True)
    return venv / "bin", wheel


def run_installed(bin_dir, command, args, cwd):
    env = {**os.environ, "WANDB_SILENT": "true", "XDG_CACHE_HOME": str(cwd / "cache")}  # a fresh C build
    proc = subprocess.run([bin_dir / command, *args], cwd=cwd, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, f"{command} {' '.join(args)}:\n{proc.stderr[-3000:]}"
    return proc


@pytest.mark.slow
def test_the_wheel_holds_configs_c_sources_and_no_top_level_tasks(installed):
    names = zipfile.ZipFile(installed[1]).namelist()
    configs = {name.removeprefix("runner/conf/") for name in names if name.startswith("runner/conf/")}
    assert configs == {str(p.relative_to(ROOT / "conf")) for p in (ROOT / "conf").rglob("*.yaml")}
    sources = {
        Path(name).name for name in names if name.startswith("runner/methods/") and name.endswith(".c")
    }
    assert sources == {p.name for p in (ROOT / "runner" / "methods").glob("*.c")} != set()
    assert {name.split("/")[0] for name in names if "/" in name and ".dist-info/" not in name} == {
        "runner",
        "hydra_plugins",
    }


@pytest.mark.slow
def test_the_installed_runner_runs_from_another_folder(installed, tmp_path):
    bin_dir, _ = installed
    where = run_installed(bin_dir, "python", ["-c", "import runner; print(runner.__file__)"], tmp_path)
    assert where.stdout.startswith(str(bin_dir.parent)), where.stdout  # the wheel's, not this checkout's
    run_installed(bin_dir, "runner", ["train.epochs=1", "logger=none", "hydra.run.dir=run"], tmp_path)
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["test/acc"] > 0.5  # ten classes
    assert "test/acc=" in run_installed(bin_dir, "runner-eval", ["run"], tmp_path).stdout
    sweep = ["-m", "+method=comixup", "+debug=smoke", "logger=none", "seed=0,1", "hydra.sweep.dir=sweep"]
    run_installed(bin_dir, "runner", sweep, tmp_path)  # the C kernel compiled from the wheel's sources
    assert len(list((tmp_path / "sweep").glob("*/summary.json"))) == 2
    assert list((tmp_path / "cache").rglob("*.so"))
    run_installed(bin_dir, "runner-report", ["sweep"], tmp_path)
