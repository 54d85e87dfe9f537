"""Write what every preset and method composes to, one file per command line, so that two trees can be
diffed: a refactor must leave each `runner ... --cfg job` printout and each typed job config unchanged.

    .venv/bin/python .ci/config_snapshots.py OUT_DIR     # then: diff -r BEFORE AFTER
"""

from __future__ import annotations

import contextlib
import io
import sys
from pathlib import Path

from omegaconf import OmegaConf

from runner.checks import ConfigError
from runner.cli import run_in_process
from runner.compose import CONF_DIR, compose, typed
from runner.smoke import apply_debug
from runner.validate import validate


def command_lines() -> list[list[str]]:
    presets = sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml"))
    methods = sorted(p.stem for p in (CONF_DIR / "method").glob("*.yaml"))
    lines = [[]]
    lines += [[f"+experiment={p}"] for p in presets]
    lines += [[f"+experiment={p}", "+debug=smoke", "dataset=fake"] for p in presets]
    lines += [[f"+method={m}"] for m in methods]
    lines += [[f"+method={m}", "dataset=cifar100"] for m in methods]
    return lines


def snapshot(args: list[str]) -> str:
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
        try:
            run_in_process([*args, "--cfg", "job"])
        except SystemExit as stop:
            printed.write(f"exit {stop.code}\n")
    try:
        cfg = compose(args)
        job = typed(cfg, validate(cfg))
        apply_debug(job)
        typed_text = OmegaConf.to_yaml(job)
    except ConfigError as e:
        typed_text = f"ConfigError: {e}\n"
    return f"# runner {' '.join(args)} --cfg job\n{printed.getvalue()}# typed\n{typed_text}"


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for args in command_lines():
        name = "_".join(a.lstrip("+").replace("=", "-") for a in args) or "default"
        (out / f"{name}.txt").write_text(snapshot(args))
    print(f"{len(command_lines())} command lines -> {out}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
