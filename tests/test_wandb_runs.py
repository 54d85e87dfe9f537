"""One W&B run per run dir (issue 25): a run killed and restarted in the default offline mode leaves one
offline folder per start; `runner-sync RUN_DIR` rebuilds them as one offline run with each step once."""

import json
import os
import subprocess
import sys
import time

import pytest
from conftest import run_cli
from test_cli import wandb_records

from runner import sync

# digits, a small MLP, 4 epochs of a few hundred ms each: a kill lands after epoch 1 and before the end
ARGS = ["logger=wandb", "train.progress=false", "model=mlp", "model.hidden=[16]", "train.batch_size=16"]
ARGS += ["train.epochs=4"]


def history(folder) -> list[dict]:
    """The history rows of an offline run folder, each with its `_step`."""
    (log_file,) = folder.glob("run-*.wandb")
    rows = []
    for record in wandb_records(log_file):
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})  # fmt: skip
    return rows


def summary(folder) -> dict:
    (log_file,) = folder.glob("run-*.wandb")
    found = {}
    for record in wandb_records(log_file):
        if record.WhichOneof("record_type") == "summary":
            found |= {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                      for item in record.summary.update}  # fmt: skip
    return found


@pytest.mark.slow  # a run killed and started again, then two syncs: four processes, 40 s
def test_killed_and_restarted_offline_run_syncs_as_one_run_with_each_epoch_once(tmp_path):
    run_dir = tmp_path / "run"
    args = [*ARGS, f"hydra.run.dir={run_dir}"]
    env = {**os.environ, "WANDB_SILENT": "true", "HYDRA_FULL_ERROR": "0"}
    proc = subprocess.Popen([sys.executable, "-m", "runner.cli", *args], cwd=tmp_path, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):  # epoch 1 logged
        assert proc.poll() is None, "the run ended before it could be killed"
        assert time.monotonic() < deadline
        time.sleep(0.01)
    proc.kill()
    proc.wait()
    restart = run_cli(args, tmp_path)
    assert f"runner-sync {run_dir}" in restart.stdout + restart.stderr  # what to run after it

    run_id = (run_dir / "wandb_run_id").read_text().strip()
    starts = sorted((run_dir / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(starts) == 2  # one folder per start: what `wandb sync` would upload as two pieces
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps == [0, 1, 2, 3]

    # as a user runs it: its own process (wandb keeps process-wide state that earlier tests may have set)
    resync = [sys.executable, "-m", "runner.sync", str(run_dir)]
    subprocess.run(resync, cwd=tmp_path, env=env, check=True, capture_output=True, timeout=120)
    (clean,) = (run_dir / sync.SYNC_DIR / "wandb").glob("offline-run-*")
    assert clean.name.endswith(f"-{run_id}")  # the same W&B run
    rows = history(clean)
    assert [row["_step"] for row in rows] == [0, 1, 2, 3]
    expected = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [row["test/acc"] for row in rows] == [r["test/acc"] for r in expected]
    assert summary(clean)["test/acc"] == json.loads((run_dir / "summary.json").read_text())["test/acc"]

    subprocess.run(resync, cwd=tmp_path, env=env, check=True, capture_output=True, timeout=120)  # again
    assert len(list((run_dir / sync.SYNC_DIR / "wandb").glob("offline-run-*"))) == 1


def test_sync_of_a_dir_without_wandb_records_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        sync.main([str(tmp_path)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"runner-sync: error: {tmp_path}: no wandb_run_id, metrics.jsonl, config.yaml")
    assert len(err.splitlines()) == 1
