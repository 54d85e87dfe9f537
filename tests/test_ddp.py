"""hardware=ddp on CPU (gloo, 2 processes): the same training as one process.

`train.batch_size` is the global batch: each rank takes an interleaved half of every batch of the shared
permutation and DDP averages the two half-batch gradients, which is the one-process full-batch gradient.
So with the same seed, data and config, 2 ranks follow the single-process trajectory up to float
summation order: the metrics agree to ~1e-6, not just statistically.
"""

import faulthandler
import gc
import json
import os
import socket
import subprocess
import sys
import weakref

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from omegaconf import OmegaConf

from runner.checks import ConfigError
from runner.data import Data, split_of
from runner.hardware import RunContext, setup, teardown
from runner.method_hooks import MethodHooks
from runner.models import build_model
from runner.schema import HardwareConfig, MLPConfig, TrainConfig
from runner.track import Tracker
from runner.train import fit

ARGS = ["logger=none", "train.epochs=3", "train.batch_size=64", "train.progress=false"]


@pytest.mark.slow
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
    assert (tmp_path / "ddp" / "cli.log").read_text().count("classify: method=erm") == 1


class RecordBatches(MethodHooks):
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_gloo(body, *args, world_size=2):
    """`body(rank, world_size, *args)` in `world_size` processes forked from this one (each with its imports:
    a spawned one took 6-8 s to import them) that form one gloo group."""
    mp.start_processes(_gloo_rank, args=(world_size, _free_port(), body, args), nprocs=world_size,
                       start_method="fork")  # fmt: skip


def _gloo_rank(rank, world_size, port, body, args):
    faulthandler.enable(all_threads=True)  # a native abort shows each thread's Python stack on stderr
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        body(rank, world_size, *args)
        dist.barrier()  # both ranks done before either leaves the group
    finally:
        teardown()  # the CLI's


def test_teardown_frees_the_ddp_wrapper_before_leaving_the_group():
    """Else garbage cycles keep the wrapper until the interpreter's teardown frees it, which aborts the
    process (SIGABRT in about 1 of 9 2-rank runs of a small script)."""
    gc.disable()  # no automatic collection between the steps below
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        net = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))
        net(torch.ones(3, 2)).sum().backward()
        wrapper = weakref.ref(net)
        del net
        teardown()
        assert wrapper() is None and not dist.is_initialized()
    finally:
        gc.enable()
        if dist.is_initialized():  # the other tests run in this process
            dist.destroy_process_group()


def _rank(rank, world_size, tmp_path):
    metrics, batches = train(tmp_path, rank, world_size)
    (tmp_path / f"rank{rank}.json").write_text(json.dumps({"metrics": metrics, "batches": batches}))


@pytest.mark.slow
def test_each_rank_takes_a_disjoint_half_of_every_global_batch(tmp_path):
    spawn_gloo(_rank, tmp_path)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    metrics, batches = train(tmp_path / "single")
    assert len(batches) == len(ranks[0]["batches"]) == len(ranks[1]["batches"]) == 2 * (100 // 20)
    for step, full in enumerate(batches):
        halves = [r["batches"][step] for r in ranks]
        assert [len(h) for h in halves] == [10, 10] and not set(halves[0]) & set(halves[1])
        assert sorted(halves[0] + halves[1]) == sorted(full)
    for r in ranks:  # evaluation sums over both shards of val and test
        for key, value in metrics.items():
            if isinstance(value, str):  # a label (the selected epoch's rule)
                assert r["metrics"][key] == value, key
            elif not key.startswith(("time/", "mem/")):  # wall times differ
                assert r["metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-7), key


def test_global_batch_must_split_evenly_over_ranks(tmp_path):
    with pytest.raises(ConfigError, match="train.batch_size=21: must split evenly over 2 ranks"):
        train(tmp_path, rank=0, world_size=2, batch_size=21)


def test_ddp_outside_torchrun_is_a_one_line_error(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ConfigError, match="must be launched by torchrun"):
        setup(HardwareConfig(name="ddp", device="cpu", distributed=True))


# ----------------------------------------------------------------------------------------------------
# The method tasks under DDP (2 gloo ranks spawned here, each running the task's `run`), against one process.


def _run_task(run_dir, overrides, rank=0, world_size=1) -> dict:
    from runner.compose import compose, typed
    from runner.hardware import seed_everything
    from runner.task import task_of
    from runner.validate import validate

    cfg = compose(["logger=none", "train.progress=false", *overrides])
    cfg = typed(cfg, validate(cfg))
    seed_everything(cfg.seed)
    run_dir.mkdir(parents=True, exist_ok=True)
    ctx = RunContext(torch.device("cpu"), run_dir, Tracker(run_dir, enabled=rank == 0), rank=rank,
                     world_size=world_size)  # fmt: skip
    return task_of(cfg).run(cfg, ctx)


def _task_rank(rank, world_size, tmp_path, overrides):
    torch.set_num_threads(1)
    summary = _run_task(tmp_path / f"rank{rank}", overrides, rank, world_size)
    (tmp_path / f"rank{rank}.json").write_text(json.dumps(summary))


def _ddp_and_single(tmp_path, overrides) -> tuple[dict, dict]:
    """(rank 0's summary of a 2-rank run, the one-process summary) of the same task config."""
    spawn_gloo(_task_rank, tmp_path, overrides)
    rank0, rank1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    untimed = {key: value for key, value in rank1.items() if not key.startswith("time/")}
    assert untimed in ({}, {key: value for key, value in rank0.items() if not key.startswith("time/")})
    return rank0, _run_task(tmp_path / "single", overrides)


@pytest.mark.slow
def test_longtail_dbot_loss_under_ddp_matches_one_process(tmp_path):
    """The official DB-OT loss couples a batch (its label counts, the plan's column sums): computed on the
    global batch, the 2-rank run follows the one-process run, and so does every inference rule."""
    overrides = ["+experiment=dbot_digits_lt", "method.loss=dbot", "train.epochs=3"]
    ddp, single = _ddp_and_single(tmp_path, overrides)
    for key in (
        "test/acc",
        "test/acc_dbot",
        "uniform/sinkhorn/all",
        "reversed/dbot/few",
        "lt/class_bias/all",
    ):
        assert ddp[key] == pytest.approx(single[key], abs=1e-9), key
    assert ddp["train/loss"] == pytest.approx(single["train/loss"], rel=1e-4)


@pytest.mark.slow
def test_clustering_on_network_features_under_ddp_matches_one_process(tmp_path):
    overrides = [
        "+experiment=dbot_cluster_digits",
        "method.features=net",
        "train.epochs=2",
        "method.plot=false",
    ]
    ddp, single = _ddp_and_single(tmp_path, overrides)
    for key in ("cluster/nmi", "cluster/ari", "cluster/mass_min", "cluster/mass_max"):
        assert ddp[key] == pytest.approx(single[key], abs=1e-6), key
    assert ddp["cluster/sizes"] == single["cluster/sizes"]


@pytest.mark.slow  # two ranks and one process training: 20 s
@pytest.mark.parametrize("selector", ["ctrans", "entropy"])
def test_covering_on_network_features_under_ddp_matches_one_process(tmp_path, selector):
    overrides = ["+method=pwc", "method.features=net", f"method.selector={selector}", "method.n_app=60",
                 "method.n_dev=60", "method.k=6", "train.epochs=2", "method.plot=false"]  # fmt: skip
    ddp, single = _ddp_and_single(tmp_path, overrides)
    assert ddp["cover/picked"] == single["cover/picked"]
    # The features come from weights trained with float32 gradients summed in another order (two shards
    # all-reduced, not one batch): each step can differ by ~1e-7 relative (float32's epsilon), and a few
    # dozen steps add up to ~1e-5 (1.006e-6 measured on one CPU); the curve's transport costs carry that.
    assert ddp["cover/pw_curve"] == pytest.approx(single["cover/pw_curve"], rel=1e-4)


def _csot_rank(rank, world_size, tmp_path, method, loss):
    """CSOT's hooks and `fit` on a toy set: every rank's parameters and selection, written per rank."""
    from runner.hooks.csot import NoisyLabelHooks
    from runner.tasks.noisy_labels import METHODS, NoisyLabelNet, Views

    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, 3, (150,), generator=g)
    x = torch.randn(150, 4, generator=g) + 3 * torch.nn.functional.one_hot(y, 4).float()
    noisy = torch.where(torch.rand(150, generator=g) < 0.4, torch.randint(0, 3, (150,), generator=g), y)
    train = split_of(x[:120], y[:120])
    train.y = noisy[:120]
    data = Data(
        train, split_of(x[120:], y[120:]), split_of(x[120:], y[120:]), num_classes=3, input_shape=(4,)
    )
    torch.manual_seed(rank)  # different augmentation streams per rank; DDP must keep the weights equal
    backbone = build_model(OmegaConf.structured(MLPConfig(hidden=[8])), (4,), 3)
    torch.manual_seed(0)
    model = NoisyLabelNet(backbone, head=True, predictor_hidden=4 if loss == "paper" else None)
    cfg = METHODS[method](loss=loss, warmup=1, curriculum_end=3, solve_batch=60, stage_switch="epoch")
    ctx = RunContext(torch.device("cpu"), tmp_path, Tracker(tmp_path, enabled=rank == 0), rank=rank,
                     world_size=world_size)  # fmt: skip
    hooks = NoisyLabelHooks(cfg, model, data, ctx, Views((4,)), False, 0, 20)
    train_cfg = OmegaConf.structured(TrainConfig(epochs=4, batch_size=20, checkpoint=False, progress=False))
    fit(model, data, train_cfg, ctx, hooks)
    params = torch.cat([p.detach().flatten() for p in model.parameters()])
    out = {"params": params.tolist(), "clean": hooks.clean.tolist(), "pseudo": hooks.pseudo.tolist(),
           "stage2": bool(hooks.stage2), "n_clean": hooks.last_stats["select/n_clean"]}  # fmt: skip
    (tmp_path / f"csot{rank}.json").write_text(json.dumps(out))


@pytest.mark.parametrize(
    "method, loss",
    [("csot", "paper")] + [pytest.param(*case, marks=pytest.mark.slow) for case in
                           (("csot", "simple"), ("ot", "paper"), ("small_loss", "paper"))],
)  # fmt: skip
@pytest.mark.slow
def test_csot_trains_under_ddp_with_synchronised_weights_and_one_selection(tmp_path, method, loss):
    """The losses forward through the DDP-wrapped network (so gradients are averaged: the ranks' weights
    stay equal although their augmentations differ), the selection pass is sharded and rank 0's selection
    is every rank's. The CSOT losses draw random views per rank: a 2-rank run is not the one-process run."""
    spawn_gloo(_csot_rank, tmp_path, method, loss)
    ranks = [json.loads((tmp_path / f"csot{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["params"] == pytest.approx(ranks[1]["params"], abs=1e-6)
    for key in ("clean", "pseudo", "stage2", "n_clean"):
        assert ranks[0][key] == ranks[1][key], key
    assert ranks[0]["stage2"] and 0 < ranks[0]["n_clean"] < 120


def _passes_rank(rank, world_size, tmp_path):
    from runner.distributed_passes import broadcast_from_main, global_batch, predict_all

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    model.forward_features = lambda x: 2 * x
    split = split_of(torch.randn(7, 4), torch.zeros(7, dtype=torch.long))  # 7 rows: shards of 4 and 3
    ctx = RunContext(torch.device("cpu"), tmp_path, None, rank=rank, world_size=world_size)
    logits, feats = (
        predict_all(model, split, ctx, batch_size=2),
        predict_all(model, split, ctx, features=True),
    )
    decided = broadcast_from_main({"rank": rank, "pick": [rank, 5]})
    z = torch.full((2, 3), float(rank + 1), requires_grad=True)
    (gathered,) = global_batch(z)
    (gathered * torch.arange(4.0)[:, None]).sum().backward()
    out = {"logits": logits.tolist(), "feats": feats.tolist(), "decided": decided,
           "grad": z.grad.tolist(), "gathered": gathered.tolist()}  # fmt: skip
    (tmp_path / f"pass{rank}.json").write_text(json.dumps(out))


def test_sharded_passes_gather_every_sample_in_order(tmp_path):
    spawn_gloo(_passes_rank, tmp_path)
    ranks = [json.loads((tmp_path / f"pass{r}.json").read_text()) for r in (0, 1)]
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    x = torch.randn(7, 4)
    with torch.no_grad():
        expected = model(x)
    for r, out in enumerate(ranks):
        np.testing.assert_allclose(out["logits"], expected.numpy(), atol=1e-6)
        np.testing.assert_allclose(out["feats"], (2 * x).numpy(), atol=1e-6)
        assert out["decided"] == {"rank": 0, "pick": [0, 5]}
        assert out["gathered"] == [[1.0] * 3] * 2 + [[2.0] * 3] * 2  # rank 0's rows first
        # every rank's loss is the global one, so its rows get the gradient from both ranks' losses
        assert out["grad"] == [[2.0 * (2 * r)] * 3, [2.0 * (2 * r + 1)] * 3]


def _mixup_rank(rank, world_size, tmp_path, method):
    """A mixup-family method's hooks and `fit` on 8x8 toy images: every rank's parameters, per rank."""
    from runner.configs.classify import METHODS
    from runner.hooks.mixup import MixupHooks
    from runner.schema import CNNConfig
    from runner.validate import to_node

    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, 3, (80,), generator=g)
    x = torch.rand(80, 1, 8, 8, generator=g)
    x[torch.arange(80), 0, 2 * y, 2 * y] += 2.0  # a class-coded bright pixel
    split = [split_of(x[:60], y[:60]), split_of(x[60:], y[60:]), split_of(x[60:], y[60:])]
    data = Data(*split, num_classes=3, input_shape=(1, 8, 8))
    torch.manual_seed(0)
    model = build_model(OmegaConf.structured(CNNConfig(name="cnn", channels=[4, 8])), (1, 8, 8), 3)
    grid = {"comixup": {"grid": 2, "part": 4}, "puzzle_mix": {"grid": 2, "t_size": -1}}.get(method, {})
    cfg = to_node(METHODS[method](preview=False, **grid))
    ctx = RunContext(torch.device("cpu"), tmp_path, Tracker(tmp_path, enabled=rank == 0), rank=rank,
                     world_size=world_size)  # fmt: skip
    hooks = MixupHooks(cfg, 3, ctx=ctx, seed=rank)  # each rank mixes differently; DDP keeps weights equal
    fit(model, data, OmegaConf.structured(TrainConfig(epochs=2, batch_size=20, checkpoint=False,
                                                      progress=False)), ctx, hooks)  # fmt: skip
    params = torch.cat([p.detach().flatten() for p in model.parameters()])
    (tmp_path / f"mixup{rank}.json").write_text(json.dumps(params.tolist()))


@pytest.mark.slow
@pytest.mark.parametrize("method", ["input_mixup", "manifold_mixup", "cutmix", "puzzle_mix", "comixup"])
def test_mixup_methods_train_under_ddp_with_synchronised_weights(tmp_path, method):
    """The mix step (saliency backward included) and the mixed loss go through the DDP-wrapped network:
    the ranks mix different batches differently, yet their weights stay equal."""
    spawn_gloo(_mixup_rank, tmp_path, method)
    ranks = [json.loads((tmp_path / f"mixup{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0] == pytest.approx(ranks[1], abs=1e-6)
    assert not np.allclose(ranks[0], 0)


@pytest.mark.slow  # two ranks and one process, each training the hash nets: 25 s
@pytest.mark.parametrize(
    "extra",
    [
        pytest.param(["method.base=raw", "method.eval_every=0.5", "dataset.val_per_class=5"], id="select"),
        pytest.param(["method.base=pretrain", "method.base_iters=8", "method.base_dim=16"], id="npairs-base"),
    ],
)  # fmt: skip
def test_hashing_under_ddp_matches_one_process(tmp_path, extra):
    """A class-major batch is one loss over all its classes (class-mean unaries -> min-cost-flow codes):
    each rank forwards its slice, the loss and codes are those of the gathered batch on every rank, so
    the 2-rank run trains the one-process nets and retrieves with the same codes."""
    overrides = ["+experiment=hier_hash_synthetic", "method.iters=24", "method.ks=[1,2]",
                 "method.baselines=[level1]", "method.level1_d=[16]", "dataset.train_per_class=20",
                 "dataset.test_per_class=10", *extra]  # fmt: skip
    ddp, single = _ddp_and_single(tmp_path, overrides)
    keys = [k for k in single if k.startswith(("hash/", "test/", "val/"))]
    assert any(k.startswith("hash/test/k1-d16/") for k in keys) and "test/p@1" in keys
    for key in keys:
        assert ddp[key] == pytest.approx(single[key], abs=1e-9), key
    # the 2 x 24 iterations of each net went through fit on both ranks: its rows are rank 0's
    rows = [json.loads(line) for line in (tmp_path / "rank0" / "metrics.jsonl").read_text().splitlines()]
    assert {r["ours_ks2/epoch"] for r in rows if "ours_ks2/epoch" in r} >= {1}


def test_a_torchrun_rank_uses_rank_0s_run_dir_and_leaves_no_other(tmp_path, monkeypatch):
    import runner.distributed_passes
    from runner import rundir

    main, own = tmp_path / "22-00-00", tmp_path / "22-00-01"  # rank 1's clock passed a second
    main.mkdir(), own.mkdir()
    monkeypatch.setattr(runner.distributed_passes, "broadcast_from_main", lambda obj: str(main))
    assert rundir.shared(own, rank=1) == main
    assert sorted(tmp_path.iterdir()) == [main]
    (own / "someone's").mkdir(parents=True)  # not empty: not this rank's, kept
    assert rundir.shared(own, rank=1) == main and own.exists()


@pytest.mark.slow  # two ranks and one process training: 23 s
def test_accumulation_under_ddp_matches_one_process_without_it(tmp_path):
    """2 ranks x 2 micro-batches, gradients all-reduced once per step: the steps of one process with whole
    batches (the MLP has no batch norm), up to float32 summation order (~1e-7 per step, 3 epochs)."""
    ddp, _ = _ddp_and_single(tmp_path / "ddp", ["train.epochs=3", "train.accumulate=2"])
    single = _run_task(tmp_path / "single", ["train.epochs=3"])
    assert ddp["test/acc"] == pytest.approx(single["test/acc"], abs=1e-9)
    assert ddp["train/loss"] == pytest.approx(single["train/loss"], rel=1e-4)
