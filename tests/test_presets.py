"""Presets and method configs: order-free composition, one source of method defaults, users' config
folders, and (slow) every preset runs under `+debug=smoke`."""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path

import pytest
import yaml
from conftest import quick_first, run_cli
from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from omegaconf import OmegaConf

from runner.checks import ConfigError
from runner.compose import CONF_DIR, compose, preflight
from runner.configs import METHODS, TASK_METHODS, TASKS
from runner.overrides import canonical
from runner.validate import validate

PRESETS = sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml") if p.stem != "none")  # none: none
# A family preset and another method of its family that `+method=` puts in the preset's place.
REPLACED = {"comixup_digits_canvas": "cutmix", "csot_cifar100": "ot", "dbot_cifar10_lt": "focal"}


@pytest.fixture
def composed():
    """Hydra's compose of `overrides` as `runner` composes a job (`+method=` read as `method=`), as a
    plain dict."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        yield lambda *overrides: OmegaConf.to_container(
            hydra_compose("config", overrides=canonical(list(overrides)))
        )


@pytest.mark.parametrize(
    "preset", quick_first(PRESETS, lambda p: re.match("dbot_cluster|hier_hash|[a-z]+", p)[0])
)
def test_a_preset_composes_the_same_in_any_order(composed, preset):
    alone = composed(f"+experiment={preset}")
    method = alone["method"]["name"]  # every preset names its method: alone, it is the paper run
    after = composed(f"+experiment={preset}", f"+method={method}", "+debug=smoke")
    before = composed("+debug=smoke", f"+method={method}", f"+experiment={preset}")
    assert before == after
    assert {k: v for k, v in after.items() if k != "debug"} == alone
    assert after["debug"]["name"] == "smoke"


@pytest.mark.slow  # composes all 28 presets (test_config composes each with its method): 11 s
def test_every_preset_shows_its_progress_and_keeps_what_runner_eval_reads(composed):
    """A line per epoch in every preset (a CPU study that printed nothing for minutes looked hung), and
    checkpoints wherever `runner-eval` evaluates the task's network again."""
    for preset in PRESETS:
        job = composed(f"+experiment={preset}")  # composed once: a compose is a good part of a second
        train = job["train"]
        task = METHODS[job["method"]["name"]]().task
        assert train["progress"], preset
        assert train["checkpoint"] or not TASKS[task].evaluable, preset


@pytest.mark.parametrize("preset,method", REPLACED.items())
def test_a_method_given_with_a_family_preset_replaces_its_method_in_any_order(composed, preset, method):
    after = composed(f"+experiment={preset}", f"+method={method}")
    before = composed(f"+method={method}", "+debug=smoke", f"+experiment={preset}")
    assert {k: v for k, v in before.items() if k != "debug"} == after
    schema = METHODS[method]()
    assert after["method"]["name"] == method and after["method"]["task"] == schema.task
    own = composed(f"+experiment={preset}")
    assert after["train"] == own["train"] and after["dataset"] == own["dataset"]  # the preset's protocol
    validate(OmegaConf.create({k: v for k, v in after.items() if k != "paper"}))


def test_a_method_sweep_over_a_preset_composes_each_method_after_the_preset(tmp_path):
    """The Table 1 sweep: each job's method is the swept one, with the preset's protocol."""
    from runner.overrides import variants

    jobs = variants(canonical(["+method=erm,comixup", "+experiment=comixup_digits_canvas"]))
    assert [j[0] for j in jobs] == ["method=erm", "method=comixup"]
    names = [compose(job).method.name for job in jobs]
    assert names == ["erm", "comixup"]


def test_a_sweep_checks_each_distinct_job_once(tmp_path):
    from runner.compose import preflight
    from runner.overrides import variants

    jobs = variants(["seed=0,0,1,1", "train.lr=0.1"])
    assert jobs == [["seed=0", "train.lr=0.1"], ["seed=1", "train.lr=0.1"]]
    assert preflight(["-m", "seed=0,1", "logger=none"])["train"].epochs > 0  # (a repeated value is refused)


def test_without_a_method_the_plain_baseline_runs(composed):
    assert "method" not in composed()


def test_a_method_file_holds_no_defaults_but_its_schema(composed):
    """One source: conf/method/NAME.yaml only extends the schema (defaults list, comments), and composes
    to exactly the schema's defaults; every schema has its file and every file its schema."""
    files = {p.stem: p for p in (CONF_DIR / "method").glob("*.yaml")}
    assert set(files) == set(METHODS)
    for name, path in files.items():
        assert set(yaml.safe_load(path.read_text())) == {"defaults"}, path
        assert composed(f"+method={name}")["method"] == dataclasses.asdict(METHODS[name]()), name


def test_every_method_schema_names_its_task_and_checks_its_choices_by_type():
    for task, methods in TASK_METHODS.items():
        for name, schema in methods.items():
            assert (schema().name, schema().task) == (name, task)
    with pytest.raises(ConfigError) as err:
        METHODS["dbot"](inference=["argmax", "magic"])
    assert str(err.value) == (
        "method.inference='magic' is not a valid choice; choose one of: "
        "argmax, cls_norm, class_bias, posthoc_la, sinkhorn, dbot"
    )


@pytest.mark.parametrize(
    "args,expected",
    [
        (
            ["+method=comixup", "method.solver=magic"],
            "method.solver='magic' is not a valid choice; choose one of: exact, gco_swap",
        ),
        (
            ["+experiment=csot_digits", "method.budget=soon"],
            "method.budget='soon' is not a valid choice; choose one of: paper, code",
        ),
        (
            ["+method=focal", "method.loss=magic"],
            "method.loss='magic' is not a valid choice; choose one of: ce,",
        ),
        (["+method=hier_hash", "method.tables=[test,magic]"], "method.tables='magic' is not a valid choice"),
    ],
)
def test_a_bad_choice_is_one_line_naming_key_value_and_choices(args, expected):
    with pytest.raises(ConfigError) as err:
        preflight(args)
    assert expected in str(err.value) and "\n" not in str(err.value)


# ----------------------------------------------------------------------------- users' config folders


def _user_conf(root: Path, k: int = 5) -> Path:
    (root / "experiment").mkdir(parents=True)
    (root / "experiment" / "mine.yaml").write_text(
        "# @package _global_\n"
        "defaults:\n  - override /method: pwc\n  - _self_\n"
        f"method:\n  scenario: mixture2d\n  k: {k}\n  n_app: 60\n  n_dev: 40\n"
    )
    return root


@pytest.mark.parametrize("how", ["--config-dir", "hydra.searchpath"])
def test_an_experiment_from_a_users_config_folder_composes_and_validates(tmp_path, how):
    conf = _user_conf(tmp_path / "conf")
    given = ["--config-dir", str(conf)] if how == "--config-dir" else [f"hydra.searchpath=[file://{conf}]"]
    preflight([*given, "+experiment=mine", "+debug=smoke"])
    preflight([*given, "+method=pwc", "+experiment=mine"])
    with pytest.raises(ConfigError, match=r"experiment='nope' is not an option; choices: .*mine"):
        preflight([*given, "+experiment=nope"])
    bad = _user_conf(tmp_path / "bad", k=0)
    given = ["--config-dir", str(bad)] if how == "--config-dir" else [f"hydra.searchpath=[file://{bad}]"]
    with pytest.raises(ConfigError, match=r"method.k=0 is out of range"):
        preflight([*given, "+experiment=mine"])


def test_a_users_experiment_is_composed_by_hydra_too(tmp_path):
    conf = _user_conf(tmp_path / "conf")
    cfg = compose([f"hydra.searchpath=[file://{conf}]", "+experiment=mine"])
    assert (cfg.method.name, cfg.method.k, cfg.method.n_dev) == ("pwc", 5, 40)


@pytest.mark.slow
def test_the_cli_runs_an_experiment_from_a_users_config_folder(tmp_path):
    conf = _user_conf(tmp_path / "conf")
    run_cli(
        ["--config-dir", str(conf), "+experiment=mine", "logger=none", "method.plot=false",
         f"hydra.run.dir={tmp_path / 'run'}"],
        tmp_path,
    )  # fmt: skip
    assert (tmp_path / "run" / "summary.json").exists()


# ------------------------------------------------------------------------- every preset runs (slow)


def _smoke_config(*overrides):
    """A job config as `_run` makes it (typed, then bounded by +debug=smoke) and smoke's line."""
    from runner.compose import typed
    from runner.smoke import apply_debug

    cfg = compose([*overrides, "+debug=smoke", "hardware=cpu"])
    job = typed(cfg, validate(cfg))
    return job, apply_debug(job)


@pytest.mark.parametrize(
    "overrides,like",
    [
        (["+experiment=comixup_imagenet", "dataset=fake"], "dataset.like=imagenet"),
        (["+experiment=csot_webvision", "dataset=fake"], "dataset.like=imagenet"),
        (["+experiment=comixup_tiny_imagenet", "dataset=fake"], "dataset.like=tiny_imagenet"),
        (["+experiment=csot_cifar10", "dataset=fake"], "dataset.like=cifar10"),
        (["+experiment=comixup_imagenet", "dataset=fake", "dataset.like=cifar10"], None),  # the user's wins
        (["+experiment=comixup_imagenet"], None),
        (["dataset=fake"], None),
    ],
)
def test_fake_data_takes_the_shape_of_the_presets_dataset(overrides, like):
    from runner.presets import fake_like_override

    assert fake_like_override(canonical(overrides)) == like


def test_smoke_on_the_cpu_caps_batches_and_image_sides_phases_included_and_says_so():
    cfg, note = _smoke_config("+experiment=comixup_imagenet", "dataset=fake", "dataset.like=imagenet")
    assert (cfg.train.batch_size, cfg.train.eval_batch_size, cfg.dataset.image_size) == (64, 64, 96)
    assert {(p.batch_size, p.image_size) for p in cfg.train.phases} == {(64, 96)}
    assert note == (
        "+debug=smoke: on the CPU, train.batch_size, train.eval_batch_size, train.phases.*.batch_size at 64 "
        "and dataset.image_size, train.phases.*.image_size at 96 px (debug.cpu_batch, debug.cpu_side)"
    )
    # 8-px digits: the training batch as it is; evaluation batches capped at every size
    cfg, note = _smoke_config("+experiment=csot_digits")
    assert cfg.train.batch_size == compose(["+experiment=csot_digits"]).train.batch_size
    assert note == "+debug=smoke: on the CPU, train.eval_batch_size at 64 (debug.cpu_batch, debug.cpu_side)"


def test_smoke_runs_a_preset_that_requires_pretrained_weights_from_random_ones():
    with pytest.raises(ConfigError, match="model.pretrained=required"):
        validate(compose(["+experiment=csot_clothing1m"]))
    cfg, note = _smoke_config("+experiment=csot_clothing1m", "dataset=fake", "dataset.like=imagenet")
    assert cfg.model.pretrained is False and cfg.debug.random_weights
    assert note.startswith(
        "+debug=smoke: random weights in place of the preset's pretrained ones; on the CPU"
    )


@pytest.mark.slow
@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_runs_under_debug_smoke(tmp_path, preset):
    """A paper preset as README's CI smoke line has it, nothing added: generated data of its dataset's
    shape, on the CPU CPU-sized batches and images, random weights where it requires pretrained ones;
    a CPU study as it is (RUNNER_REAL_DATA: every preset on its own data)."""
    paper = "paper" in compose([f"+experiment={preset}"])
    fake = ["dataset=fake"] if paper and not os.environ.get("RUNNER_REAL_DATA") else []
    run_cli([f"+experiment={preset}", "+debug=smoke", *fake], tmp_path, timeout=900)
    (summary,) = (tmp_path / "outputs").rglob("summary.json")
    assert "error" not in json.loads(summary.read_text())
