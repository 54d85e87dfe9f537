"""The hashing task (`+method=hier_hash`), its dataset `synthetic_hier` and its config checks."""

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from runner.cli import _compose
from runner.data import Split, load_data
from runner.methods import hier_hash as hh
from runner.schema import ConfigError, validate
from tasks import hashing


def composed(*overrides):
    return validate(_compose(list(overrides)))


def test_synthetic_hier_sizes_and_hierarchy():
    cfg = OmegaConf.structured(composed("dataset=synthetic_hier")["dataset"])
    data = load_data(cfg, seed=0)
    assert data.num_classes == 64 and data.input_shape == (32,)
    assert len(data.train) == 6400 and len(data.val) == 0 and len(data.test) == 1920
    np.testing.assert_array_equal(np.bincount(data.test.y.numpy()), np.full(64, 30))
    superclass = data.meta["superclass"]
    np.testing.assert_array_equal(superclass, np.repeat(np.arange(8), 8))
    means = np.stack([data.train.x[data.train.y == c].mean(0).numpy() for c in range(64)])
    dist = np.linalg.norm(means[:, None] - means[None], axis=-1)
    same = superclass[:, None] == superclass[None]
    off_diagonal = ~np.eye(64, dtype=bool)
    # siblings: E|d|^2 = 2 dim class_std^2 = 64; across super-classes: 2 dim (1 + 4) = 320
    assert np.mean(dist[same & off_diagonal] ** 2) == pytest.approx(64 + 2 * 32 * 2.25 / 100, rel=0.15)
    assert np.mean(dist[~same] ** 2) == pytest.approx(320, rel=0.3)
    again = load_data(cfg, seed=0)
    assert torch.equal(again.train.x, data.train.x)


def test_synthetic_hier_bad_value_is_one_line():
    with pytest.raises(ConfigError, match="dataset.n_super=0"):
        composed("dataset=synthetic_hier", "dataset.n_super=0")


@pytest.mark.parametrize(
    "override, match",
    [
        ("method.ks=[1,40]", "method.ks="),
        ("method.beta=[0.1,0.2]", "one per ks"),
        ("method.solver=lemon", "method.solver='lemon'"),
        ("method.per_class=3", "exactly 2 with the N-pairs loss"),
        ("method.tables=[val]", "method.tables="),
        ("method.baselines=[lsh]", "method.baselines="),
        ("method.decay=0", "method.decay=0"),
    ],
)
def test_bad_method_values_raise_config_error(override, match):
    with pytest.raises(ConfigError, match=match):
        composed("+method=hier_hash", override)


def test_presets_compose():
    method = composed("+experiment=hier_hash_synthetic")["method"]
    assert (method.d, method.k, method.ks, method.base) == (16, 2, [1, 2, 3], "raw")
    for preset in ("hier_hash_cifar100_npairs", "hier_hash_cifar100_triplet"):
        cfg = composed(f"+experiment={preset}")
        assert cfg["dataset"].name == "cifar100" and cfg["model"].name == "nin"


def test_class_balanced_sampler():
    labels = np.repeat(np.arange(10), [5, 5, 5, 5, 5, 5, 5, 5, 1, 1])
    sampler = hashing.ClassBalancedSampler(labels, nc=6, m=3, seed=0)
    for _ in range(20):
        batch = sampler()
        assert batch.shape == (6, 3)
        assert len(np.unique(labels[batch[:, 0]])) == 6  # distinct classes
        assert all(len(set(row)) == 3 and len(set(labels[row])) == 1 for row in batch)
    with pytest.raises(ConfigError, match=r"only 8 classes .* set method.classes_per_batch<=8"):
        hashing.ClassBalancedSampler(labels, nc=9, m=2, seed=0)


@pytest.mark.parametrize("loss", hh.LOSSES)
def test_hash_step_learns_and_reports_code_time(loss):
    torch.manual_seed(0)
    nc, m, k, d, ks = 8, 2, 2, 4, 2
    centres = torch.randn(nc, 1, 6) * 3
    x = (centres + torch.randn(nc, m, 6)).reshape(nc * m, 6)
    net = torch.nn.Linear(6, k * d)
    optimizer = torch.optim.Adam(net.parameters(), 1e-2)
    method = SimpleNamespace(loss=loss, alpha=10.0, solver="ortools", cost_scale=None, remap=True)
    step = dict(nc=nc, m=m, k=k, d=d, ks=ks, method=method, beta=0.1, margin=0.3, l2_reg=0.003)
    losses = [hashing.hash_step(net, optimizer, x, **step) for _ in range(60)]
    assert all(seconds > 0 for _, seconds in losses)
    assert np.mean([v for v, _ in losses[-10:]]) < np.mean([v for v, _ in losses[:10]])


def test_trainer_logs_its_iteration_timing_with_checkpoints_on(tmp_path, caplog):
    x, y = torch.randn(8, 3), torch.arange(4).repeat(2)
    split = Split(x, y, y)
    data = SimpleNamespace(train=split)
    method = SimpleNamespace(classes_per_batch=2, per_class=2, decay_epochs=0.0, decay=1.0, eval_every=0.0,
                             log_every=1, checkpoint_every=1)  # fmt: skip
    cfg = SimpleNamespace(method=method, dataset=SimpleNamespace(augment="none"), seed=0,
                          train=SimpleNamespace(checkpoint=True))  # fmt: skip
    ctx = SimpleNamespace(
        device=torch.device("cpu"), dir=tmp_path, tracker=SimpleNamespace(log=lambda m: None)
    )
    net = torch.nn.Linear(3, 2)

    def step(optimizer, x):
        optimizer.step()
        return 0.0, 0.0

    with caplog.at_level("INFO", logger="tasks.hashing"):
        timing = hashing.Trainer(cfg, ctx, data).run(
            "t", net, [{"params": net.parameters(), "lr": 1e-3}], step, epochs=1.0
        )
    assert timing["iters"] == 2 and (tmp_path / "checkpoints" / "hier_hash_t.pt").exists()
    assert "t: 2 iterations" in caplog.text


def test_cli_synthetic_reports_every_row(cli, tmp_path):
    run_dir = tmp_path / "run"
    cli("+experiment=hier_hash_synthetic", "method.epochs=0.5", "method.ks=[1,2]", "method.level1_d=[32]",
        "method.vq_centroids=[16,256]", "logger=none", f"hydra.run.dir={run_dir}")  # fmt: skip
    summary = json.loads((run_dir / "summary.json").read_text())
    for row in ("ours", "k1-d32", "Th", "VQ-16", "VQ-256"):
        for ks in (1, 2):
            cell = {key: summary[f"hash/test/{row}/ks{ks}/{key}"] for key in ("p@1", "p@16", "suf@1", "nmi")}
            assert 0 <= cell["p@1"] <= 1 and 0 <= cell["nmi"] <= 1 and cell["suf@1"] >= 1
    assert summary["test/p@1"] == summary["hash/test/ours/ks1/p@1"]
    assert summary["test/suf@1"] == summary["hash/test/ours/ks1/suf@1"]
    assert 0 < summary["time/mcf_share"] < 1
    # a 256-bucket table cannot beat the exhaustive search's candidate count by more than 1919x
    assert summary["hash/test/VQ-256/ks1/suf@1"] > summary["hash/test/VQ-16/ks1/suf@1"]
    assert "| ks | ours | k1-d32 | Th | VQ-16 | VQ-256 |" in (run_dir / "retrieval.md").read_text()


@pytest.mark.slow
def test_cli_pretrained_base_train_table_and_resume(cli, tmp_path):
    run_dir = tmp_path / "run"
    args = ["+method=hier_hash", "dataset=digits", "model.hidden=[32]", "method.d=4", "method.ks=[1]",
            "method.beta=[0.1]", "method.npairs_l2=[0.01]", "method.classes_per_batch=8", "method.epochs=0.3",
            "method.base_dim=8", "method.base_epochs=0.3", "method.eval_every=0.1", "method.baselines=[]",
            "logger=none", "hardware.threads=1", f"hydra.run.dir={run_dir}"]  # fmt: skip
    cli(*args)
    first = json.loads((run_dir / "summary.json").read_text())
    assert {"hash/train/metric/p@1", "hash/train/ours/ks1/suf@16", "hash/test/ours/ks1/nmi"} <= set(first)
    assert (run_dir / "checkpoints" / "hier_hash_base_final.pt").exists()
    proc = cli(*args)  # every net's checkpoint is complete: the rerun only evaluates
    assert "resumed at iteration" in proc.stderr + proc.stdout
    second = json.loads((run_dir / "summary.json").read_text())
    assert {k: v for k, v in second.items() if not k.startswith("time/")} == {
        k: v for k, v in first.items() if not k.startswith("time/")
    }


def test_cli_bad_method_value_is_one_line(cli):
    proc = cli("+method=hier_hash", "dataset=synthetic_hier", "method.ks=[0]", "logger=none", check=False)
    assert proc.returncode == 2 and "method.ks=[0]" in proc.stderr and "Traceback" not in proc.stderr
