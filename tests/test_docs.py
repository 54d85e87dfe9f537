"""The docs cannot drift from the code: every relative link in README.md and docs/ resolves, and every
`runner` command they quote composes and validates (through the CLI's own `preflight`, nothing trains).

Commands are read from fenced code blocks and from inline code spans that start with `runner `
(`torchrun ... -m runner.cli ARGS` counts as `runner ARGS`). A sweep is checked at the first value of
each comma list (every value of a config group must still name a file in conf/). A command holding a
placeholder (`<dir>`, `$VAR`, `+experiment=...`) is skipped; a lone trailing `...` (an elided tail) is
dropped and the rest is checked. The commands in `EXPECTED_ERRORS` are the docs' examples of bad input:
they must fail.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from conftest import quick_first
from omegaconf import OmegaConf

from runner.compose import CONF_DIR

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

# The docs show these on purpose as bad input; they must stop with a ConfigError.
EXPECTED_ERRORS = {"runner dataset=imagenett", "runner train.lr=-1"}
# A token with one of these is a placeholder for the reader to fill in: the command is not checked.
PLACEHOLDER = re.compile(r"<[^>]*>|\$\w|\$\{|\.\.\.|\bDATE\b|\bTIME\b|\bHOST\b|\bNAME\b")
# Files the reader supplies (checked for existence when a config is validated): the override is dropped
# (weights: random ones stand in) and the rest of the command is checked.
USER_FILE = re.compile(r"^(model\.pretrained|method\.(base_)?checkpoint)=/")

_FENCE = re.compile(r"^\s*(```|~~~)")
_INLINE = re.compile(r"`([^`\n]+)`")
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _blocks(text: str):
    """(line number, line, inside a fenced block) for every line of a markdown text."""
    fenced = False
    for n, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        yield n, line, fenced


def _logical_lines(text: str):
    """Fenced lines joined over trailing backslashes, with the number of their first line."""
    start, buf = 0, []
    for n, line, fenced in _blocks(text):
        if not fenced:
            continue
        if not buf:
            start = n
        stripped = line.rstrip()
        if stripped.endswith("\\"):
            buf.append(stripped[:-1])
            continue
        buf.append(stripped)
        yield start, " ".join(buf)
        buf = []


def _runner_args(line: str) -> list[str] | None:
    """The arguments of a `runner` command line (None if the line is no runner command)."""
    line = line.strip()
    if line.startswith("$ "):
        line = line[2:]
    if not (line.startswith("runner ") or line == "runner" or line.startswith("torchrun ")):
        return None
    try:
        words = shlex.split(line, comments=True)
    except ValueError:
        return None
    if words[0] == "torchrun":
        if "runner.cli" not in words:
            return None
        words = words[words.index("runner.cli") + 1 :]
    else:
        words = words[1:]
    return words


def _commands():
    """(id, argv) for every runner command in the docs; argv is None where a placeholder skips it."""
    seen = set()  # a command quoted twice is checked once
    for path in DOCS:
        text = path.read_text()
        found = []
        for n, line in _logical_lines(text):
            found.append((n, line))
        for n, line, fenced in _blocks(text):
            if not fenced:
                found += [(n, span) for span in _INLINE.findall(line) if span.startswith("runner ")]
        for n, line in found:
            args = _runner_args(line)
            if args is None:
                continue
            key = " ".join(args)
            if key in seen:
                continue
            seen.add(key)
            yield f"{_rel(path)}:{n}: runner {' '.join(args)}", args


COMMANDS = list(_commands())


def _page(param) -> str:
    """The page a documented command's test param comes from (its id: PAGE:LINE: COMMAND)."""
    return param.id.split(":")[0]


def _first_values(overrides: list[str]) -> list[str]:
    """Overrides with every comma / range sweep at its first value; each value of a group sweep must
    name a file in conf/."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import ValueType

    groups = {p.name for p in CONF_DIR.iterdir() if p.is_dir()}
    out = []
    for o in OverridesParser.create().parse_overrides(overrides):
        if not o.is_sweep_override() or o.value_type == ValueType.INTERVAL_SWEEP:
            out.append(o.input_line)
            continue
        values = list(o.sweep_string_iterator())
        if o.key_or_group in groups:
            missing = [v for v in values if not (CONF_DIR / o.key_or_group / f"{v}.yaml").exists()]
            assert not missing, (
                f"{o.key_or_group}={','.join(missing)}: no such file in conf/{o.key_or_group}/"
            )
        out.append(f"{o.get_key_element()}={values[0]}")
    return out


@pytest.mark.parametrize("args", quick_first([pytest.param(a, id=i) for i, a in COMMANDS], _page))
def test_every_runner_command_in_the_docs_composes(args):
    from runner.checks import ConfigError
    from runner.compose import preflight
    from runner.overrides import override_args
    from runner.rundir import multirun_args

    command = "runner " + " ".join(args)
    if command in EXPECTED_ERRORS:
        with pytest.raises(ConfigError):
            preflight(args)
        return
    if args and args[-1] == "...":
        args = args[:-1]
    if PLACEHOLDER.search(" ".join(args)):
        pytest.skip(f"placeholder in: {command}")
    overrides = override_args(args)
    if overrides is None:
        pytest.skip(f"help or info only: {command}")
    # a weights file the reader supplies stands in as random weights (a preset may require some)
    overrides = [("model.pretrained=none" if o.startswith("model.") else None) if USER_FILE.match(o) else o
                 for o in overrides]  # fmt: skip
    overrides = [o for o in overrides if o is not None]
    # -m only matters to preflight where a sweeper config adds search spaces (conf/sweep, hydra/sweeper).
    searched = any(o.startswith(("+sweep=", "hydra/sweeper=")) for o in overrides)
    multirun = ["-m"] if searched and multirun_args(args) else []
    error = None
    try:
        preflight(multirun + _first_values(overrides))
    except (ConfigError, AssertionError) as e:
        error = str(e)
    except Exception as e:  # a Hydra parse error, a missing plugin, ...
        error = f"{type(e).__name__}: {' '.join(str(e).split())}"
    if error:
        pytest.fail(f"{command}\n  -> {error}", pytrace=False)


def test_the_docs_quote_commands_and_the_expected_errors():
    commands = {"runner " + " ".join(a) for _, a in COMMANDS}
    assert len(COMMANDS) >= 30, f"only {len(COMMANDS)} runner commands found in the docs"
    assert EXPECTED_ERRORS <= commands, f"not in the docs any more: {EXPECTED_ERRORS - commands}"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    anchors, counts = set(), {}
    for _, line, fenced in _blocks(path.read_text()):
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if fenced or not m:
            continue
        slug = _slug(m.group(1))
        anchors.add(slug if slug not in counts else f"{slug}-{counts[slug]}")
        counts[slug] = counts.get(slug, 0) + 1
    return anchors


def _links():
    for path in DOCS:
        for n, line, fenced in _blocks(path.read_text()):
            if fenced:
                continue
            for target in _LINK.findall(_INLINE.sub("", line)):
                if not re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, mailto:, ...
                    yield path, n, target


def test_every_relative_link_in_the_docs_resolves():
    bad = []
    for path, n, target in _links():
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        where = f"{_rel(path)}:{n}: ({target})"
        if not dest.exists():
            bad.append(f"{where} -> no such file {dest.relative_to(ROOT) if ROOT in dest.parents else dest}")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            bad.append(f"{where} -> no heading with anchor #{anchor} in {_rel(dest)}")
    assert not bad, "broken links:\n" + "\n".join(bad)


def test_the_link_checker_finds_links():
    assert sum(1 for _ in _links()) >= 10
    assert _slug("Co-Mixup and the `mixup` baselines") == "co-mixup-and-the-mixup-baselines"


def _single_runs_of_the_readme() -> list[tuple[str, list[str]]]:
    """(id, overrides) of each README command that starts one run (no sweep, no bad input, no help or
    info), its files the reader supplies dropped as above."""
    from runner.overrides import override_args

    runs = []
    for where, args in COMMANDS:
        command = "runner " + " ".join(args)
        args = args[:-1] if args and args[-1] == "..." else args
        sweep = {"-m", "--multirun"} & set(args)
        if not where.startswith("README.md") or command in EXPECTED_ERRORS or sweep:
            continue
        overrides = override_args(args)
        if overrides is None or PLACEHOLDER.search(" ".join(args)) or {"-c", "--cfg"} & set(args):
            continue
        runs.append((where, [o for o in overrides if not USER_FILE.match(o)]))
    return runs


README_RUNS = _single_runs_of_the_readme()
# a preset's key for its own model where the command line names another (the resume once refused it)
OTHER_MODEL = ("+method=csot on another model", ["+method=csot", "model=cnn", "train.epochs=1"])


@pytest.mark.parametrize("args", [a for _, a in [*README_RUNS, OTHER_MODEL]],
                         ids=[i for i, _ in [*README_RUNS, OTHER_MODEL]])  # fmt: skip
def test_every_readme_run_resumed_in_its_run_dir_composes_its_first_job_again(args, tmp_path):
    """A run's job is what Hydra composes of the command line `CommandLine` completed, built by `build_job`
    (`runner.cli`); the same command again in that run dir (a resume) checks the checkpoint against
    `CommandLine.job()`: both must be the same job config."""
    from runner.compose import CommandLine, build_job
    from runner.overrides import hydra_compose, is_hydra_override

    argv = [*args, f"hydra.run.dir={tmp_path / 'run'}"]
    first = CommandLine.parse(argv)
    recorded = [o for o in first.overrides if not is_hydra_override(o)]  # Hydra's `overrides.task`
    ran = build_job(hydra_compose(recorded), recorded).config
    (tmp_path / "run").mkdir()
    resumed = CommandLine.parse(argv).job().config
    assert OmegaConf.to_yaml(resumed) == OmegaConf.to_yaml(ran)


def test_the_readme_runs_are_found():
    assert len(README_RUNS) >= 5, [i for i, _ in README_RUNS]
