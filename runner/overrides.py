"""Overrides: a command line's Hydra overrides read from argv, parsed, expanded into the jobs to check,
and conf/ composed with them (Hydra's errors as one line). `runner.compose` builds the job config on it."""

from __future__ import annotations

import functools
import re
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from runner.checks import ConfigError

# The configs: the repo's top-level conf/, reached through the link runner/conf (pyproject copies it into the
# wheel there, so an installed runner finds them beside its code).
CONF_DIR = (Path(__file__).parent / "conf").resolve()
INTERNAL_GROUPS = ("hydra", "schema")  # config groups of Hydra and of the runner's typed schemas


def _user_groups() -> str:
    """`runner --help`'s options of each group (conf/hydra/help/runner.yaml): conf/'s groups without Hydra's
    (the runner's typed `schema*` groups live in the ConfigStore, not here). Read from the folders: OmegaConf
    resolves the template on every compose, and Hydra's own listing loads every config of every group."""
    groups = sorted(p for p in CONF_DIR.iterdir() if p.is_dir() and p.name not in INTERNAL_GROUPS)
    return "\n".join(f"{p.name}: {', '.join(sorted(f.stem for f in p.glob('*.yaml')))}" for p in groups)


OmegaConf.register_new_resolver("runner.user_groups", _user_groups)


def help_text() -> str:
    """`runner --help`: conf/hydra/help/runner.yaml's template (Hydra's help for the runner too)."""
    return OmegaConf.load(CONF_DIR / "hydra" / "help" / "runner.yaml").template


# Hydra flags that consume the next argument.
_FLAGS_WITH_VALUE = {
    "-c",
    "--cfg",
    "-p",
    "--package",
    "-cp",
    "--config-path",
    "-cn",
    "--config-name",
    "-cd",
    "--config-dir",
    "--experimental-rerun",
}
# Hydra's error for a group option no search path holds, squeezed to one line: group, value, options.
_MISSING_OPTION = (
    r"Could not (?:find|load) '([^']+)/([^']*)'.*?Available options in '[^']+':(.*?)(?:Config search path|$)"
)
_UNKNOWN_KEY = r"Could not override '([^']+)'"  # Hydra's error for a key the config lacks
_INFO_VALUES = {"all", "config", "defaults", "defaults-tree", "plugins", "searchpath"}


def override_args(argv: list[str]) -> list[str] | None:
    """The config overrides in `argv`, or None when Hydra only prints help or info."""
    out, skip = [], False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
        elif arg in ("-h", "--help", "--hydra-help", "--version", "--shell-completion", "-sc"):
            return None
        elif arg in _FLAGS_WITH_VALUE:
            skip = True
        elif arg in ("-i", "--info"):
            skip = i + 1 < len(argv) and argv[i + 1] in _INFO_VALUES
        elif not arg.startswith("-"):
            out.append(arg)
    return out


def canonical(overrides: list[str]) -> list[str]:
    """`overrides` with `+method=NAME` as `method=NAME`: the method slot of conf/config.yaml always exists
    (empty, or filled by a preset), so the method is chosen, not appended, wherever it stands."""
    return [o.removeprefix("+") if o.startswith("+method=") else o for o in overrides]


def config_dirs(argv: list[str]) -> list[str]:
    """`--config-dir DIR` / `-cd DIR` of `argv` as a `hydra.searchpath` override (what Hydra's own
    command line does with it), so that preflight composes with the user's groups too."""
    dirs = [argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg in ("-cd", "--config-dir")]
    if not dirs:
        return []
    return ["hydra.searchpath=[" + ",".join(f"file://{Path(d).resolve()}" for d in dirs) + "]"]


def job_overrides(argv: list[str]) -> list[str] | None:
    """The overrides that shape the jobs of `argv` (its `--config-dir` too), or None for help/info."""
    overrides = override_args(argv)
    return None if overrides is None else config_dirs(argv) + canonical(overrides)


# Longer keys than this are no key of the config (Hydra would look for a file named after it).
_MAX_KEY = 200


def parse_overrides(overrides: list[str]) -> list:
    """Hydra's parse of `overrides`; a one-line ConfigError naming the override it cannot read, and how
    to write it."""
    parser, parsed = _parser(), []
    for override in overrides:
        key, _, value = override.partition("=")
        if len(key) > _MAX_KEY:
            raise ConfigError(
                f"unknown key {key[:40]}... ({len(key)} characters): no config key is that long"
            )
        try:
            parsed.append(parser.parse_override(override))
        except Exception as e:
            if not value.isascii():  # Hydra's grammar reads unquoted values as ASCII
                raise ConfigError(
                    f"{override}: a value with characters outside ASCII must be quoted: '{key}=\"{value}\"'"
                ) from None
            unclosed = _unclosed_brackets(value)
            if unclosed:  # quoting would hide the list or dict the value means to be
                closers = "".join(_CLOSING[b] for b in reversed(unclosed))
                raise ConfigError(
                    f"{override}: Hydra cannot read this override: its {' '.join(unclosed)} "
                    f"{'is' if len(unclosed) == 1 else 'are'} never closed; close "
                    f"{'it' if len(unclosed) == 1 else 'them'}: {override}{closers}"
                ) from None
            reason = " ".join(str(e).split()).split(" See https://")[0]
            raise ConfigError(
                f"{override}: Hydra cannot read this override ({reason}); quote a value that holds spaces "
                f"or any of ()[]{{}},='\": '{key}=\"{value}\"'"
            ) from None
    return parsed


_CLOSING = {"[": "]", "{": "}", "(": ")"}


def _unclosed_brackets(value: str) -> list[str]:
    """The brackets `value` opens and never closes, outermost first, outside quoted strings; [] where
    every bracket closes (or a closing one comes unopened: another mistake)."""
    opened, quote = [], None
    for char in value:
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char in _CLOSING:
            opened.append(char)
        elif char in _CLOSING.values():
            if not opened or _CLOSING[opened.pop()] != char:
                return []
    return opened


@functools.cache
def _parser():
    """Hydra's override parser, made once: making it (its grammar's functions) took 3 ms, once per job
    of a 2,000-job sweep's preflight."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return OverridesParser.create()


def given(parsed, key: str) -> list[str] | None:
    """The values `key` takes in the parsed overrides (several where swept); None where it is not given."""
    for o in reversed(parsed):
        if o.key_or_group == key:
            return list(o.sweep_string_iterator()) if o.is_sweep_override() else [str(o.value())]
    return None


def is_hydra_override(override: str) -> bool:
    """Whether an override (or its key) sets Hydra's own config, which does not shape the job config."""
    key = override.lstrip("+~").partition("=")[0]
    return key == "hydra" or key.startswith(("hydra.", "hydra/"))


def variants(overrides: list[str]) -> list[list[str]]:
    """Override lists to check: every swept key at each of its values, the others at their first.

    Hydra's own keys are left out (they do not shape the job config); a continuous Optuna search space
    (`interval(a, b)`) is checked at both of its ends.
    """
    from hydra.core.override_parser.types import ValueType

    choices: list[tuple[str, list[str]]] = []
    for o in parse_overrides(overrides):
        if is_hydra_override(o.key_or_group):
            continue
        if o.value_type == ValueType.INTERVAL_SWEEP:
            ends = (o.value().start, o.value().end)  # Hydra reads both as floats; tag(int, ...) samples ints
            values = [int(v) if "int" in o.value().tags else v for v in ends]
        else:
            values = list(o.sweep_string_iterator()) if o.is_sweep_override() else [None]
        choices.append(
            (
                o.input_line,
                [f"{o.get_key_element()}={v}" for v in values] if values[0] is not None else [o.input_line],
            )
        )
    first = [vals[0] for _, vals in choices]
    jobs = [first]
    for i, (_, vals) in enumerate(choices):  # each distinct value once (seed=0,0,1 checks seeds 0 and 1)
        jobs += [first[:i] + [v] + first[i + 1 :] for v in dict.fromkeys(vals[1:]) if v != vals[0]]
    return jobs


def check_no_repeated_values(overrides: list[str]) -> None:
    """A one-line ConfigError where a swept key lists a value twice: a grid would run that job twice
    (`seed=0,0`: two runs of seed 0, reported as two seeds)."""
    for o in parse_overrides(overrides):
        if is_hydra_override(o.key_or_group) or not o.is_discrete_sweep():
            continue
        values = list(o.sweep_iterator())
        repeated = next((v for i, v in enumerate(values) if _same_value(v, values[:i])), _NONE)
        if repeated is not _NONE:
            key = o.get_key_element()
            raise ConfigError(
                f"{o.input_line} lists {key}={repeated} twice: the sweep would run the same job twice; "
                "list each value once"
            )


_NONE = object()


def _same_value(value, others: list) -> bool:
    """Whether `value` is among `others` as the same type and value (1 and 1.0 and true are not)."""
    return any(type(value) is type(other) and value == other for other in others)


def hydra_compose(overrides: list[str], return_hydra_config: bool = False) -> DictConfig:
    """Hydra's compose of conf/config.yaml with `overrides`; its errors as one-line ConfigErrors: an
    option no search path holds with the group's choices, every unknown key with the valid ones."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        try:
            return compose("config", overrides=overrides, return_hydra_config=return_hydra_config)
        except Exception as e:
            message = " ".join(str(e).split())
            missing = re.search(_MISSING_OPTION, message)
            if missing:  # a group option that no search path holds (conf/, --config-dir, hydra.searchpath)
                group, value, options = missing.groups()
                choices = ", ".join(options.split())
                raise ConfigError(f"{group}={value!r} is not an option; choices: {choices}") from None
            unknown = re.match(_UNKNOWN_KEY, message)
            if not unknown:  # e.g. a search space given as a hydra.* override
                raise ConfigError(message) from None
            raise _unknown_keys(compose, overrides, unknown.group(1), message) from None


def _unknown_keys(compose, overrides: list[str], key: str, message: str) -> ConfigError:
    """One error naming every unknown key of `overrides` (Hydra stops at the first, `key`), each with
    the keys that do exist where it was asked for; composed without them, the config tells those."""
    unknown: dict[str, list[str]] = {}  # parent -> its unknown keys, in command-line order
    while key is not None:
        unknown.setdefault(key.rpartition(".")[0], []).append(key)
        names = {k for keys in unknown.values() for k in keys}
        try:
            known = [o for o in overrides if o.partition("=")[0] not in names]
            base = compose("config", overrides=known)
            key = None
        except Exception as e:
            again = re.match(_UNKNOWN_KEY, " ".join(str(e).split()))
            if not again or again.group(1) in names:  # another kind of error, or no progress
                return ConfigError(message)
            key = again.group(1)
    clauses = []
    for parent, keys in unknown.items():
        node = OmegaConf.select(base, parent) if parent else base
        valid = ", ".join(node.keys()) if isinstance(node, DictConfig) else "none"
        plural, under = "s" if len(keys) > 1 else "", f" under {parent}" if parent else ""
        clauses.append(f"unknown key{plural} {', '.join(keys)}; valid keys{under}: {valid}")
    return ConfigError("; ".join(clauses))
