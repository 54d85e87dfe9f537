"""The `runner` command end to end (subprocesses in a scratch dir)."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from conftest import summaries
from wandb.proto import wandb_internal_pb2


def wandb_records(path: Path):
    """Decode a W&B transaction log (.wandb: a LevelDB-style log of protobuf `Record`s)."""
    data, block, pos, payload = path.read_bytes(), 32768, 7, b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        payload += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST chunk: a record is complete
            record = wandb_internal_pb2.Record()
            record.ParseFromString(payload)
            yield record
            payload = b""


def test_default_run_trains_digits_and_logs_to_wandb_offline(cli, tmp_path):
    proc = cli()
    ((run_dir, summary),) = summaries(tmp_path / "outputs").items()
    assert summary["test/acc"] >= 0.95
    console = (proc.stdout + proc.stderr).splitlines()
    assert "test/acc=" in console[-1] and len(console) <= 40  # a line per epoch, the summary line last
    # The validated config is in the run dir and its log file, not on the console.
    assert "config (validated)" not in proc.stdout + proc.stderr
    assert "config (validated):\nseed: 0" in (run_dir / "cli.log").read_text()
    assert (run_dir / "config.yaml").exists() and (run_dir / "checkpoints" / "last.pt").exists()
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 30 and json.loads(lines[-1])["test/acc"] == summary["test/acc"]
    # The offline W&B run holds the same per-epoch metrics.
    (log_file,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    history = [
        {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
        for r in wandb_records(log_file)
        if r.WhichOneof("record_type") == "history"
    ]
    accs = [h["test/acc"] for h in history if "test/acc" in h]
    assert len(accs) == 30 and accs[-1] == pytest.approx(summary["test/acc"])


def test_print_config_shows_the_validated_config_on_the_console(cli_here, tmp_path):
    proc = cli_here("print_config=true", "train.epochs=1", "logger=none")
    assert "config (validated):\nseed: 0\nname: run\ndataset:\n  name: digits" in proc.stdout


@pytest.mark.slow
def test_a_sweep_prints_a_line_per_job_and_its_table(cli, tmp_path):
    """README's 9-job sweep (each job a smoke run here): each job's line, the table, little else."""
    proc = cli("-m", "+method=erm,cutmix,comixup", "seed=0,1,2", "+debug=smoke", "logger=none")
    console = (proc.stdout + proc.stderr).splitlines()
    jobs = [line for line in console if re.match(r"#\d+ ", line)]
    assert [line.split()[:2] for line in jobs] == [[f"#{i}", "done"] for i in range(9)]
    assert all("test/acc=" in line and line.endswith(" s)") for line in jobs)
    table = console[console.index(next(line for line in console if line.startswith("| "))) :]
    assert len(console) <= len(jobs) + len(table) + 10, "\n".join(console)


@pytest.mark.slow
def test_two_job_multirun_writes_one_result_per_job(cli, tmp_path):
    cli("-m", "seed=0,1", "train.epochs=2", "logger=none", "train.progress=false")
    found = summaries(tmp_path / "outputs" / "multirun")
    assert sorted(p.name for p in found) == ["0", "1"]
    seeds = sorted(yaml.safe_load((p / "config.yaml").read_text())["seed"] for p in found)
    assert seeds == [0, 1]


@pytest.mark.slow
def test_restart_in_same_dir_resumes(cli, tmp_path):
    run_dir = tmp_path / "run"
    cli(f"hydra.run.dir={run_dir}", "train.epochs=2", "logger=none", "train.progress=false")
    proc = cli(f"hydra.run.dir={run_dir}", "train.epochs=4", "logger=none", "train.progress=false")
    assert "resumed" in proc.stderr + proc.stdout
    assert torch.load(run_dir / "checkpoints" / "last.pt", weights_only=False)["epoch"] == 3
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2, 3]


@pytest.mark.parametrize(
    "args,expected",
    [
        (["model=transformer"], "model='transformer' is not an option; choices: cnn, inception"),
        (["train.batch_size=-3"], "train.batch_size=-3 is out of range"),
        (["+method=erm", "method.alpha=1"], "unknown key method.alpha"),
        (["hardware=gpu"], "no CUDA device"),
    ],
)
def test_bad_input_exits_nonzero_with_one_line(cli_here, args, expected):
    if args == ["hardware=gpu"] and torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    proc = cli_here(*args, "logger=none", check=False)
    assert proc.returncode == 2
    assert expected in proc.stderr
    assert "Traceback" not in proc.stderr


def test_the_cli_starts_without_importing_pot_or_scikit_learn():
    """Each takes about half a second to a second to import, at every `runner` start (a sweep's jobs, each
    test's subprocess); the solvers that need them import them when they run."""
    code = "import sys, runner.cli; print(*(name in sys.modules for name in ('ot', 'sklearn')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_a_run_composes_its_config_twice_to_check_it_and_to_run_it(cli_here, monkeypatch):
    """The command line's check composes the first job once (`CommandLine`), Hydra once more to run it; its
    compose that only reads `hydra.mode` takes that value from the first (each compose: 0.3-1 s)."""
    from hydra._internal.hydra import Hydra

    composes, compose_config = [], Hydra.compose_config

    def counted(self, *args, **kwargs):
        composes.append(kwargs.get("run_mode"))
        return compose_config(self, *args, **kwargs)

    monkeypatch.setattr(Hydra, "compose_config", counted)
    cli_here("+debug=smoke", "logger=none", "train.progress=false", "hydra.run.dir=run")
    assert len(composes) == 2, composes
