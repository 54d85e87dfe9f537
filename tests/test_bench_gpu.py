"""`make bench-gpu` (benchmarks/bench_gpu.py): `--smoke` runs every paper preset's row and its baseline's
on this machine; a failed row is one line and the others go on; the targets read the measured ratios;
without CUDA (and without --smoke) nothing is measured."""

import contextlib
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import gpu_rows

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_gpu", ROOT / "benchmarks" / "bench_gpu.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_gpu"] = module  # dataclasses resolve the module's annotations through it
    spec.loader.exec_module(module)
    yield module
    del sys.modules["bench_gpu"]


def _record(folder: Path) -> dict:
    (path,) = folder.glob("*.json")
    return json.loads(path.read_text())


# By default in miniature: one preset of each task (the variants' first among them, and `--epoch` of each)
# at half the smoke's image side (16 px; a network's own minimum, as Inception's, still holds). As shipped
# in `make test-slow`: every preset at 32 px, `--epoch` of every CIFAR preset.
SMALL_SIDE = 16
ONE_OF_EACH_TASK = ("comixup_cifar100_preactresnet18", "csot_cifar100", "dbot_cifar100_lt",
                    "hier_hash_cifar100_npairs", "pwc_cifar10")  # fmt: skip


# Both slow (`make test-slow`): the miniature alone took 97 s of the suite; the suite keeps bench.main's
# record, failure and crash paths on one cheap preset (the tests below).
@pytest.mark.slow
@pytest.mark.parametrize("size", ["small", "as_shipped"])
def test_smoke_runs_every_preset_and_its_baseline_and_records_them_outside_the_repo(
    bench, tmp_path, capsys, monkeypatch, size
):
    presets, only = list(bench.PRESETS), []
    if size == "small":
        assert set(ONE_OF_EACH_TASK) < set(bench.EPOCH_PRESETS) and SMALL_SIDE < gpu_rows.SMOKE_SIDE
        assert gpu_rows.VARIANT_PRESETS[0] in ONE_OF_EACH_TASK
        presets, only = [p for p in presets if p in ONE_OF_EACH_TASK], ["--only", *ONE_OF_EACH_TASK]
        monkeypatch.setattr(gpu_rows, "SMOKE_SIDE", SMALL_SIDE)  # what `plan` reads
    before = sorted((ROOT / "benchmarks" / "results").iterdir())
    ok = bench.main(["--smoke", "--epoch", "--out", str(tmp_path), *only])
    record = _record(tmp_path)
    rows = record["rows"]
    assert {row["key"]: row["result"]["error"] for row in rows if "error" in row["result"]} == {}
    assert ok is True
    assert [row["preset"] for row in rows[::2]] == presets
    assert all(row["result"]["step_ms"] > 0 and row["batch"] > 0 for row in rows)
    assert all(row["baseline"] == rows[i - 1]["key"] for i, row in enumerate(rows) if i % 2)  # pairs
    printed = capsys.readouterr().out
    assert all(f"| {row['preset']} | {row['method']} |" in printed for row in rows)
    md = (tmp_path / f"{record['name']}.md").read_text()
    lines = [line for line in md.splitlines() if line.startswith("| ") and line.endswith(" |")]
    epoch_presets = [p for p in bench.EPOCH_PRESETS if p in presets]
    epochs = lines[-len(epoch_presets) :]
    # the table's head and rows, the variants' head and row, the full epochs' head and rows
    assert md.count("\n| ") == 1 + len(rows) + 2 + 1 + len(epoch_presets)
    # the baselines' hand-written reference steps (hashing's embedding nets have none), the variants in
    # miniature, one epoch of each CIFAR preset
    assert all(row["result"]["reference_ms"] > 0 for row in rows if row["reference"])
    with_reference = [row["preset"] for row in rows if row["reference"] is not None]
    assert with_reference == [p for p in presets if not p.startswith("hier_hash")]
    assert [v["variant"] for v in record["variants"]] == list(bench.SMOKE_KINDS)
    assert all(v["step_ms"] > 0 and v["reference_ms"] > 0 for v in record["variants"])
    assert [line.split(" | ")[0][2:] for line in epochs] == epoch_presets
    assert not any("error" in line for line in epochs), epochs
    assert record["host_marker_us"] > 0
    assert sorted((ROOT / "benchmarks" / "results").iterdir()) == before


@pytest.mark.slow  # runs rows of `make bench-gpu`: 7 s
def test_a_failed_row_is_one_line_the_others_run_and_the_status_says_so(bench, tmp_path, monkeypatch, capsys):
    good = bench.plan("pwc_cifar10", smoke=True, steps=1)[0]
    bad = bench.Row("pwc_cifar10", "nope", ["+experiment=nope", "logger=none"], 1)
    monkeypatch.setattr(bench, "plan", lambda preset, smoke, steps: [bad, good])
    assert bench.main(["--smoke", "--only", "pwc_cifar10", "--out", str(tmp_path)]) is False
    printed = capsys.readouterr().out
    (line,) = [line for line in printed.splitlines() if "| nope |" in line]
    assert "error: runner: error: experiment='nope' is not an option" in line
    rows = {row["method"]: row["result"] for row in _record(tmp_path)["rows"]}
    assert rows["pwc random"]["step_ms"] > 0 and "error" not in rows["pwc random"]
    assert any("experiment='nope' is not an option" in line for line in rows["nope"]["log_tail"])


@pytest.mark.slow  # runs rows of `make bench-gpu`: 8 s
def test_the_record_holds_the_rows_measured_before_a_crash(bench, tmp_path, monkeypatch):
    """A run stopped part-way (a device machine's time limit, a crash) keeps what it measured."""
    good = bench.plan("pwc_cifar10", smoke=True, steps=1)

    def plan(preset, smoke, steps):
        if preset == "pwc_cifar10":
            return good
        raise KeyboardInterrupt

    monkeypatch.setattr(bench, "PRESETS", ("pwc_cifar10", "csot_cifar100"))
    monkeypatch.setattr(bench, "plan", plan)
    with pytest.raises(KeyboardInterrupt):
        bench.main(["--smoke", "--variants", "--out", str(tmp_path)])
    record = _record(tmp_path)
    assert [row["method"] for row in record["rows"]] == ["pwc random", "pwc ctrans"]
    assert record["summary"].startswith("stopped after 2 rows")


def test_variants_name_presets(bench, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--smoke", "--variants", "comixup_imagenet", "nope"])
    assert "--variants nope: not a preset" in capsys.readouterr().err


def test_variants_run_only_the_kinds_asked_and_no_method_option_on_a_baseline(bench, tmp_path, monkeypatch):
    ran = []

    def run_rows(rows, tmp, extra, traces=None):
        ran.append(extra)
        rows[0].result["step_ms"] = 5.0

    monkeypatch.setattr(bench, "run_rows", run_rows)
    base = bench.Row("p", "erm", [], 8, result={"step_ms": 4.0})
    method = bench.Row("p", "comixup", [], 8, baseline=base.key, result={"step_ms": 10.0})
    lines, records = bench.variants([base, method], tmp_path, ("lag",))
    assert ran == [tuple(bench.VARIANTS["lag"])]
    assert lines[0] == "| preset | method | as preset ms/step | lag ms/step (preset's speed-up) |"
    assert lines[2:] == ["| p | erm | 4.0 | n/a (a method option) |", "| p | comixup | 10.0 | 5.00 (2.00x) |"]
    assert records == [{"key": "p comixup", "variant": "lag", "step_ms": 5.0}]
    assert bench.variants([], tmp_path, ("lag",)) == ([], [])


@pytest.mark.slow  # runs a row of `make bench-gpu` twice: 5 s
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's tracking harness")
def test_a_run_the_tracking_harness_breaks_runs_again_without_it(bench, tmp_path, monkeypatch, capsys):
    @contextlib.contextmanager
    def broken():
        raise RuntimeError("harness broke\nsecond line")
        yield

    monkeypatch.setattr("runner.device_tracking.tracking", broken)
    assert bench.main(["--smoke", "--only", "pwc_cifar10", "--out", str(tmp_path)]) is True
    lines = capsys.readouterr().out.splitlines()
    failed = "runner.device_tracking failed: RuntimeError: harness broke"  # its error's first line
    assert [line for line in lines if failed in line] == [
        f"syncs n/a for pwc_cifar10 {method}: {failed}" for method in ("pwc random", "pwc ctrans")
    ]
    (line,) = [line for line in lines if line.startswith("| pwc_cifar10 | pwc random |")]
    assert " | n/a | - | " in line  # syncs n/a, no baseline; then its reference step
    assert all(row["result"]["step_ms"] > 0 for row in _record(tmp_path)["rows"])


def test_the_targets_bound_the_step_ratio_and_csot_allocation(bench):
    def pair(preset, base, base_ms, method, ms, **result):
        first = bench.Row(preset, base, [], 1, result={"step_ms": base_ms})
        return [first, bench.Row(preset, method, [], 1, baseline=first.key, result={"step_ms": ms, **result})]

    rows = [*pair("comixup_imagenet", "erm", 100.0, "comixup", 230.0),
            *pair("dbot_cifar100_lt", "lt_ce", 10.0, "dbot", 11.0),
            *pair("csot_cifar100", "ce", 10.0, "csot", 30.0, allocation_share=0.05),
            *pair("pwc_cifar10", "pwc random", 1.0, "pwc ctrans", 9.0),  # no target
            bench.Row("hier_hash_imagenet", "hier_hash", [], 1, baseline="comixup_imagenet erm",
                      result={"error": "boom"})]  # fmt: skip
    lines = bench.targets(rows, {r.key: r for r in rows})
    assert lines == [
        ("target comixup_imagenet comixup step vs erm: measured 2.30x, need <= 2.2x -> MISS", False),
        ("target dbot_cifar100_lt dbot step vs lt_ce: measured 1.10x, need <= 1.2x -> OK", True),
        ("target csot_cifar100 csot allocation share of its epoch: measured 5.0%, need <= 10% -> OK", True),
        ("target hier_hash_imagenet hier_hash step vs erm: measured n/a (boom), need <= 1.2x -> MISS", False),
    ]


@pytest.mark.skipif(torch.cuda.is_available(), reason="measures on CUDA")
def test_without_cuda_and_smoke_nothing_is_measured(bench, capsys):
    assert bench.main() is None
    assert capsys.readouterr().out.count("\n") == 1
