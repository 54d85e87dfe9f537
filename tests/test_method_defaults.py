"""What the commands a user types first compose to (issue 25, items 1 and 2): `+method=NAME` applies its
family's preset for the dataset, a dataset brings its natural network, `hardware=auto` picks the device."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch
import yaml
from conftest import quick_first, run_cli_here
from omegaconf import OmegaConf

from runner import hardware
from runner.checks import ConfigError
from runner.compose import CONF_DIR, compose, typed
from runner.configs import METHODS, TASKS
from runner.overrides import canonical
from runner.presets import method_preset_override, preset_families
from runner.validate import option_keys, validate

OPT_OUT = "+experiment=none: without it"


def as_runner(*args: str):
    """The job config `runner ARGS` composes: with the preset `+method=` applies (as `main` adds it)."""
    overrides = canonical(list(args))
    preset, _ = method_preset_override(overrides)
    return compose(overrides + ([preset] if preset else []))


def resolved(cfg) -> dict:
    """The validated config with every default filled in and `hardware=auto` decided (what a job saves)."""
    return typed(cfg, validate(cfg))


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def cuda(monkeypatch):
    """A visible CUDA device with bf16, on a machine whose process may use 16 cores."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))  # Hopper
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)


# ------------------------------------------------------------------------------ method presets


@pytest.mark.parametrize(
    ("args", "preset"),
    [
        (["+method=csot", "dataset=cifar100"], "csot_cifar100"),
        (["+method=comixup", "dataset=tiny_imagenet"], "comixup_tiny_imagenet"),
        (["+method=dbot", "dataset=cifar10"], "dbot_cifar10_lt"),
        (["+method=focal", "dataset=cifar10"], "dbot_cifar10_lt"),  # a baseline gets its family's preset
        (["+method=csot"], "csot_digits"),  # the default dataset: the method's CPU study
        (["+method=dbot"], "dbot_digits_lt"),
        (["+method=pwc"], "pwc_digits"),
        (["+method=hier_hash"], "hier_hash_synthetic"),
        (["+method=comixup"], "comixup_digits_canvas"),
        (["-m", "+method=erm,cutmix,comixup", "seed=0,1"], "comixup_digits_canvas"),  # one family: one preset
    ],
)
def test_a_method_alone_applies_its_preset_for_the_dataset(args, preset):
    added, note = method_preset_override(canonical([a for a in args if a != "-m"]))
    assert added == f"+experiment={preset}"
    assert note.startswith(f"preset: +experiment={preset} for +method=") and note.endswith(f"({OPT_OUT})")


def test_of_several_presets_for_one_dataset_the_papers_main_one_is_applied_and_named():
    added, note = method_preset_override(["method=comixup", "dataset=cifar100"])
    assert added == "+experiment=comixup_cifar100_preactresnet18"
    assert "the paper's main one of comixup_cifar100_preactresnet18, comixup_cifar100_resnext29, " in note
    families: dict[tuple[str, str], list[str]] = {}
    for name, on in preset_families().items():
        families.setdefault(on, []).append(name)
    # every ambiguity is resolved, to one of its presets; presets that keep the default dataset
    # (pwc_mixture2d, pwc_optimality: their scenario makes the data) are applied only by name
    for (task, dataset), names in families.items():
        if dataset is not None and len(names) > 1:
            assert TASKS[task].main_presets[dataset] in names, (task, dataset, names)


@pytest.mark.parametrize(
    "args",
    [
        ["method=csot", "dataset=cifar100", "+experiment=none"],  # the opt-out
        ["method=ot", "+experiment=csot_cifar10"],  # an experiment named: it is the user's
        ["method=kmeans"],  # dbot_cluster_digits sets DB-OT's mass bounds, which k-means does not have
        ["method=hier_hash", "dataset=digits"],  # a dataset named that no preset of the family is on
        ["seed=1"],
    ],
)
def test_no_preset_where_one_is_named_opted_out_of_or_none_fits(args):
    assert method_preset_override(args) == (None, None)


def test_a_sweep_over_methods_of_different_presets_gets_none_and_says_so():
    added, note = method_preset_override(["method=csot,dbot"])
    assert (
        added is None
        and note == "no preset: the swept jobs have different ones (csot_digits, dbot_digits_lt); name one"
    )


def test_opting_out_keeps_the_methods_and_the_datasets_own_defaults():
    plain = as_runner("+method=csot", "dataset=cifar100", "+experiment=none")
    assert plain.model.name == "preactresnet18" and plain.train.epochs == 30
    assert plain.dataset.label_noise.kind == "none"


def test_on_the_default_dataset_every_method_shows_its_point():
    csot = as_runner("+method=csot")
    assert csot.dataset.label_noise.kind == "symmetric" and csot.dataset.label_noise.rate > 0
    assert as_runner("+method=dbot").dataset.imbalance > 1
    hashing = as_runner("+method=hier_hash")
    assert hashing.method.classes_per_batch <= hashing.dataset.n_super * hashing.dataset.n_sub


# ------------------------------------------------------------------------------ natural networks


@pytest.mark.parametrize(
    ("dataset", "model", "stem_stride"),
    [
        ("digits", "mlp", None),
        ("cifar10", "preactresnet18", 1),
        ("cifar100", "preactresnet18", 1),
        ("tiny_imagenet", "preactresnet18", 2),
        ("imagenet", "resnet50", None),
        ("imagefolder", "resnet50", None),
        ("webvision", "resnet50", None),
    ],
)
def test_a_dataset_brings_its_natural_network_and_model_still_wins(dataset, model, stem_stride):
    cfg = compose([f"dataset={dataset}"])
    assert (cfg.model.name, cfg.model.get("stem_stride")) == (model, stem_stride)
    assert compose([f"dataset={dataset}", "model=cnn"]).model.name == "cnn"


def test_any_network_replaces_a_presets_with_its_own_defaults():
    covered = set()  # every network, and every preset with settings some network has not, once
    for path in sorted((CONF_DIR / "experiment").glob("*.yaml")):
        own = set(yaml.safe_load(path.read_text()).get("model") or {})
        for model in sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml")):
            if own - set(option_keys("model", model)) and not {path.stem, model} <= covered:
                covered |= {path.stem, model}
                cfg = compose([f"+experiment={path.stem}", f"model={model}"])
                name = validate(cfg)["model"].name
                assert name in model and set(cfg.model) <= set(option_keys("model", name))
    kept = compose(["+experiment=csot_digits", "model=mlp"])  # the preset's own network keeps its settings
    assert list(kept.model.hidden) == [128]
    typed = ["+experiment=csot_digits", "model=cnn", "model.hidden=[3]"]  # a key the user gives is checked
    with pytest.raises(ConfigError, match=r"^unknown key model.hidden; valid keys: name, pretrained, zero_"):
        validate(compose(typed))


@pytest.mark.slow  # composes all 28 presets (test_config composes each with its method): 10 s
def test_every_preset_composes_the_network_it_names():
    for path in sorted((CONF_DIR / "experiment").glob("*.yaml")):
        defaults = yaml.safe_load(path.read_text())["defaults"]
        named = next(
            (d["override /model"] for d in defaults if isinstance(d, dict) and "override /model" in d), "mlp"
        )
        assert compose([f"+experiment={path.stem}"]).model.name == named, path.name


# ------------------------------------------------------------------------------ hardware=auto


def test_auto_is_the_default_and_runs_on_the_cpu_without_cuda(no_cuda):
    hw = resolved(compose([])).hardware
    assert (hw.name, hw.device, hw.precision, hw.num_workers) == ("auto", "cpu", "fp32", 0)
    device, rank, world = hardware.setup(hw)
    assert (device, rank, world) == (torch.device("cpu"), 0, 1)
    assert hardware.describe(hw, device) == (
        "device: cpu (hardware=auto: no CUDA device visible; fp32, 0 loader workers)"
    )


def test_auto_takes_cuda_with_bf16_and_workers_from_the_cores_where_visible(cuda, monkeypatch):
    hw = resolved(compose([])).hardware
    assert (hw.device, hw.precision, hw.num_workers) == ("cuda", "bf16", 8)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))  # Volta: no bf16
    hw = resolved(compose([])).hardware
    assert (hw.device, hw.precision, hw.num_workers) == ("cuda", "fp32", 3)  # one core for the main process
    assert resolved(compose(["hardware=cpu"])).hardware.device == "cpu"  # a named choice still forces


def test_paper_presets_keep_their_precision_on_cuda_and_run_on_a_cpu_only_machine(cuda, monkeypatch):
    hw = resolved(compose(["+experiment=csot_cifar100"])).hardware
    assert (hw.name, hw.device, hw.precision, hw.num_workers) == ("auto", "cuda", "fp32", 8)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    hw = resolved(compose(["+experiment=csot_cifar100", "+debug=smoke", "dataset=fake"])).hardware
    assert (hw.device, hw.num_workers) == ("cpu", 0)
    assert hardware.setup(hw)[0] == torch.device("cpu")


def test_forcing_the_gpu_without_cuda_is_one_line_naming_the_choices(no_cuda):
    with pytest.raises(
        ConfigError, match=r"^hardware=gpu needs CUDA but no CUDA device is visible; use hardware=auto"
    ):
        hardware.setup(resolved(compose(["hardware=gpu"])).hardware)


# ------------------------------------------------------------------------------ the CLI, in this process

TINY = ["+debug=smoke", "logger=none", "train.progress=false", "train.eval_batch_size=64"]
OTHER_MODEL = ["+method=csot", "model=cnn"]  # csot_digits' model.hidden is its MLP's


def _first_log_line(run_dir: Path) -> str:
    (log_file,) = run_dir.glob("*.log")
    return log_file.read_text().splitlines()[0]


def test_a_method_and_dataset_compose_as_their_preset_on_the_command_line(tmp_path):
    method_cfg = yaml.safe_load(
        run_cli_here(["--cfg", "job", "+method=csot", "dataset=cifar100"], tmp_path).stdout
    )
    preset_cfg = yaml.safe_load(run_cli_here(["--cfg", "job", "+experiment=csot_cifar100"], tmp_path).stdout)
    for group in ("model", "train", "method"):
        assert method_cfg[group] == preset_cfg[group], group
    assert method_cfg["model"]["name"] == "preactresnet18" and method_cfg["train"]["epochs"] == 450


# the papers' methods first: each task's paper method is the one `make test` runs
PAPERS = ("comixup", "hier_hash", "csot", "pwc", "dbot", "dbot_cluster")


@pytest.mark.parametrize("method", quick_first(sorted(METHODS, key=lambda m: (m not in PAPERS, m)),
                                               lambda m: METHODS[m]().task))  # fmt: skip
def test_every_method_runs_on_the_default_and_its_log_starts_with_the_preset_and_device(tmp_path, method):
    run_cli_here([f"+method={method}", *TINY, "hydra.run.dir=run"], tmp_path)
    assert (tmp_path / "run" / "summary.json").exists()
    first = _first_log_line(tmp_path / "run")
    preset, _ = method_preset_override([f"method={method}"])
    if preset:
        assert f"preset: {preset} for +method={method} on the default dataset" in first and OPT_OUT in first
    assert first.endswith("device: cpu (hardware=auto: no CUDA device visible; fp32, 0 loader workers)")


def test_another_model_than_the_presets_runs_without_the_presets_settings_of_its_own(tmp_path):
    run_cli_here([*OTHER_MODEL, *TINY, "hydra.run.dir=run"], tmp_path)
    first = _first_log_line(tmp_path / "run")
    assert "; left out the preset's model.hidden (for its model mlp); device: cpu" in first
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["model"]
    assert saved["name"] == "cnn" and "hidden" not in saved


def _as_the_cli_composes(args: list[str]):
    preset, _ = method_preset_override(canonical(args))  # as `CommandLine.parse` adds it
    return compose([*args, *([preset] if preset else [])])


def documented_default_datasets() -> dict[str, str]:
    """Task -> the dataset `+method=NAME` runs on, as docs/adding-a-method.md's table says."""
    page = (CONF_DIR.parent / "docs" / "adding-a-method.md").read_text()
    rows = re.findall(r"^\| (\w+) \| (\w+) \| [^|]+ \|$", page, re.M)
    return {task: dataset for task, dataset in rows if task in TASKS}


@pytest.mark.parametrize("method", sorted(METHODS))
def test_a_method_composes_the_same_with_its_default_dataset_written_out(method):
    """`+method=X` composes on the dataset of the preset its task applies there (its CPU study), else the
    config's default, as docs/adding-a-method.md's table says per task; naming that dataset changes
    nothing, in every family (presets are declared per method, `register_method(presets=)`); and the config
    validates."""
    alone = _as_the_cli_composes([f"+method={method}"])
    assert validate(alone)["method"].name == alone.method.name
    assert alone.dataset.name == documented_default_datasets()[METHODS[method]().task]
    written = _as_the_cli_composes([f"+method={method}", f"dataset={alone.dataset.name}"])
    assert OmegaConf.to_yaml(written) == OmegaConf.to_yaml(alone)


def test_the_docs_name_the_default_dataset_of_every_task():
    assert documented_default_datasets().keys() == TASKS.keys()


def test_every_preset_of_a_method_is_declared_by_its_task_and_serves_that_method():
    """A preset that chooses a method is declared by that method (`register_method(presets=)`), hence by
    its task (`TaskEntry.presets`); a preset that chooses none is declared by no task."""
    declared = {preset: task for task, entry in TASKS.items() for preset in entry.presets}
    for path in sorted((CONF_DIR / "experiment").glob("*.yaml")):
        chosen = yaml.safe_load(path.read_text()).get("defaults", [])
        methods = [e["override /method"] for e in chosen if isinstance(e, dict) and "override /method" in e]
        if not methods:
            assert path.stem not in declared, f"{path.stem} chooses no method"
            continue
        task = METHODS[methods[0]]().task
        assert declared.get(path.stem) == task, f"{path.stem}: not declared by task {task}"
        assert methods[0] in TASKS[task].presets[path.stem]
