"""hardware=ddp on CPU (gloo, 2 processes): the same training as one process.

`train.batch_size` is the global batch: each rank takes an interleaved half of every batch of the shared
permutation and DDP averages the two half-batch gradients, which is the one-process full-batch gradient.
So with the same seed, data and config, 2 ranks follow the single-process trajectory up to float
summation order: the metrics agree to ~1e-6, not just statistically.
"""

import json
import os
import socket
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from omegaconf import OmegaConf

from runner.data import Data, split_of
from runner.hardware import RunContext, setup
from runner.models import build_model
from runner.schema import ConfigError, HardwareConfig, MLPConfig, TrainConfig
from runner.track import Tracker
from runner.train import fit

ARGS = ["logger=none", "train.epochs=3", "train.batch_size=64", "train.progress=false"]


def test_torchrun_two_gloo_ranks_match_one_process(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "0"}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    jobs = {  # the documented command, and the plain run it must reproduce; side by side
        "ddp": [*torchrun, "-m", "runner.cli", "hardware=ddp", "hardware.device=cpu", *ARGS],
        "single": [sys.executable, "-m", "runner.cli", *ARGS],
    }
    procs = {name: subprocess.Popen([*cmd, f"hydra.run.dir={tmp_path / name}"], cwd=tmp_path, env=env,
                                    text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for name, cmd in jobs.items()}  # fmt: skip
    out = {name: p.communicate(timeout=300)[0] for name, p in procs.items()}
    for name, p in procs.items():
        assert p.returncode == 0, out[name][-3000:]
    ddp, single = (json.loads((tmp_path / n / "summary.json").read_text()) for n in ("ddp", "single"))
    for key in ("val/acc", "test/acc"):
        assert ddp[key] == pytest.approx(single[key], abs=1e-9), key
    for key in ("train/loss", "val/loss", "test/loss"):
        assert ddp[key] == pytest.approx(single[key], rel=1e-4), key
    # One process logs: one record per epoch, one summary line, rank 1 wrote nothing in the run dir.
    records = [json.loads(line) for line in (tmp_path / "ddp" / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records] == [1, 2, 3]
    assert out["ddp"].count("test/acc=") == 1
    assert (tmp_path / "ddp" / "cli.log").read_text().count("tasks.classify: method=erm") == 1


class RecordBatches:
    """A `fit` hook that keeps the train indices of every step."""

    def __init__(self):
        self.batches = []

    def transform(self, x, y_soft, idx, model):
        self.batches.append(idx.tolist())
        return x, y_soft


def blobs() -> Data:
    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, 3, (150,), generator=g)
    x = torch.randn(150, 4, generator=g) + 4 * torch.nn.functional.one_hot(y, 4).float()
    train, val, test = (split_of(x[s], y[s]) for s in (slice(0, 100), slice(100, 125), slice(125, None)))
    return Data(train, val, test, num_classes=3, input_shape=(4,))


def train(tmp_path, rank=0, world_size=1, batch_size=20):
    torch.manual_seed(0)
    model = build_model(OmegaConf.structured(MLPConfig(hidden=[8])), (4,), 3)
    cfg = OmegaConf.structured(TrainConfig(epochs=2, batch_size=batch_size, checkpoint=False, progress=False))
    ctx = RunContext(torch.device("cpu"), tmp_path, Tracker(tmp_path, enabled=rank == 0), rank=rank,
                     world_size=world_size)  # fmt: skip
    hooks = RecordBatches()
    return fit(model, blobs(), cfg, ctx, hooks), hooks.batches


def _rank(rank, world_size, port, tmp_path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        metrics, batches = train(tmp_path, rank, world_size)
        (tmp_path / f"rank{rank}.json").write_text(json.dumps({"metrics": metrics, "batches": batches}))
    finally:
        dist.destroy_process_group()


def test_each_rank_takes_a_disjoint_half_of_every_global_batch(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(2, port, tmp_path), nprocs=2)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    metrics, batches = train(tmp_path / "single")
    assert len(batches) == len(ranks[0]["batches"]) == len(ranks[1]["batches"]) == 2 * (100 // 20)
    for step, full in enumerate(batches):
        halves = [r["batches"][step] for r in ranks]
        assert [len(h) for h in halves] == [10, 10] and not set(halves[0]) & set(halves[1])
        assert sorted(halves[0] + halves[1]) == sorted(full)
    for r in ranks:  # evaluation sums over both shards of val and test
        for key, value in metrics.items():
            if key != "time/epoch_s":
                assert r["metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-7), key


def test_global_batch_must_split_evenly_over_ranks(tmp_path):
    with pytest.raises(ConfigError, match="train.batch_size=21: must split evenly over 2 ranks"):
        train(tmp_path, rank=0, world_size=2, batch_size=21)


def test_ddp_outside_torchrun_is_a_one_line_error(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ConfigError, match="must be launched by torchrun"):
        setup(HardwareConfig(name="ddp", device="cpu", distributed=True))
