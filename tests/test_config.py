"""Config composition and validation: every group option composes; bad input is one clear line."""

from pathlib import Path

import pytest
from omegaconf import OmegaConf, open_dict

import runner
from runner.checks import ConfigError, check_range
from runner.compose import CONF_DIR, compose, preflight
from runner.validate import validate

GROUPS = ["dataset", "model", "hardware", "logger"]


def options(group):
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in options(g)])
def test_every_group_option_composes_and_validates(group, option):
    cfg = compose([f"{group}={option}"])
    checked = validate(cfg)
    declared = OmegaConf.load(CONF_DIR / group / f"{option}.yaml").name  # a variant names its base
    assert checked[group].name == declared and option.startswith(declared)  # preactresnet18_64px
    if group == "model":  # no network option loads weights unless asked
        assert checked["model"].pretrained is False


@pytest.mark.parametrize("experiment", [e for e in options("experiment") if e != "none"])  # none: no preset
def test_every_experiment_preset_composes_with_its_method(experiment):
    cfg = compose([f"+experiment={experiment}"])
    if cfg.model.pretrained == "required":  # csot_clothing1m: the weights a user gives (here: none)
        with pytest.raises(ConfigError, match="model.pretrained=required"):
            validate(cfg)
        cfg = compose([f"+experiment={experiment}", "model.pretrained=none"])
    assert experiment.startswith(validate(cfg)["method"].name + "_")  # csot_cifar100: csot


def test_preflight_checks_every_value_of_a_sweep():
    preflight(["-m", "seed=0,1", "dataset=digits,synthetic", "train.epochs=1"])
    with pytest.raises(ConfigError, match="train.batch_size=0"):
        preflight(["-m", "train.batch_size=8,0"])


def test_a_large_sweeps_preflight_checks_every_job_and_says_so(capsys):
    """Each job past the first sets its one value in the first job's config (no composition): a bad
    one among 122 is found all the same, and the first job's config is left as it was for the next."""
    with pytest.raises(ConfigError, match=r"train.lr=-1.0 is out of range"):
        preflight(["-m", "seed=range(0,120)", "train.lr=0.1,0.2,-1"])
    assert "runner: checking the configs of 122 jobs" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"train.batch_size=0 is out of range"):
        preflight(["-m", "train.lr=0.5,0.1", "train.batch_size=8,0,16"])
    preflight(["-m", "train.batch_size=0,-1", "train.batch_size=8"])  # the later override wins, as in Hydra
    preflight(["-m", "+experiment=comixup_imagenet", "seed=0,1"])  # a preset's top-level `metric` too


def test_help_skips_validation():
    preflight(["--help", "dataset=nope"])


def test_check_range_open_and_closed_bounds():
    check_range("x", 0.0, 0.0, 1.0)
    with pytest.raises(ConfigError, match=r"\(0.0, 1.0\]"):
        check_range("x", 0.0, 0.0, 1.0, lo_open=True)


def test_conf_dir_is_the_repo_conf():
    """In a checkout, runner/conf is a link to the repo's top-level conf/ (the one folder to edit)."""
    assert CONF_DIR == Path(__file__).resolve().parents[1] / "conf"
    assert (Path(runner.__file__).parent / "conf").is_symlink()


def _with_paper(paper):
    cfg = compose([])
    with open_dict(cfg):
        cfg.paper = paper
    return cfg


def test_a_paper_block_maps_metrics_to_a_value_and_its_table():
    checked = validate(
        _with_paper({"test/acc": {"value": 0.5, "table": "Table 1"}, "test/p@1": {"value": 1, "table": "T2"}})
    )
    assert checked["paper"]["test/acc"].value == 0.5 and checked["paper"]["test/acc"].table == "Table 1"
    assert isinstance(checked["paper"]["test/p@1"].value, float)
    assert validate(_with_paper({}))["paper"] == {}


@pytest.mark.parametrize(
    "paper,expected",
    [
        ([0.5], "paper=[0.5] must be a mapping"),
        ({"test/acc": 0.5}, "paper.test/acc=0.5 must be a mapping with keys: value, table"),
        ({"test/acc": {"value": "high", "table": "T1"}}, "bad value for paper.test/acc.value"),
        ({"test/acc": {"value": 0.5}}, "paper.test/acc.table"),
        ({"test/acc": {"value": 0.5, "table": "T1", "std": 0.1}}, "unknown key paper.test/acc.std"),
        ({"test/acc": {"value": float("nan"), "table": "T1"}}, "paper.test/acc.value=nan: must be a finite"),
    ],
)
def test_a_malformed_paper_block_is_one_line(paper, expected):
    with pytest.raises(ConfigError) as err:
        validate(_with_paper(paper))
    assert expected in str(err.value) and "\n" not in str(err.value)


def test_every_method_schema_lives_in_its_task_module_and_resolves_its_annotations():
    """`variant` schemas resolve their string annotations in the module that declares them (Python 3.12's
    make_dataclass would otherwise give them `runner.configs._base`, where `Literal` is unknown)."""
    import typing

    from runner.configs import METHODS

    for name, schema in METHODS.items():
        assert schema.__module__ not in ("runner.configs._base", "types"), name
        assert "name" in typing.get_type_hints(schema), name
