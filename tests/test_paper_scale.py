"""Each method family end to end on a file-backed `imagefolder` (decoded per batch by DataLoader workers),
through the CLI under `+debug=smoke`: the paths a paper-scale run takes, on tiny images."""

import json

import pytest

from tests.fixtures_data import write_class_folders

CLASSES = ["a", "b", "c", "d"]
COMMON = ["model=cnn", "model.channels=[8,16]", "dataset.image_size=16", "train.batch_size=16",
          "train.eval_batch_size=16", "hardware.num_workers=1", "logger=none"]  # fmt: skip
FAMILIES = {
    "comixup": ["+method=comixup", "method.workers=0"],
    "csot": ["+method=csot", "dataset.label_noise.kind=symmetric", "dataset.label_noise.rate=0.4"],
    "dbot": ["+method=dbot"],
    "hier_hash": ["+method=hier_hash", "method.classes_per_batch=4", "method.d=4", "method.ks=[1]",
                  "method.beta=[0.1]", "method.npairs_l2=[0.01]", "method.base_dim=8"],
    "pwc": ["+method=pwc", "method.features=net", "method.n_app=24", "method.n_dev=12", "method.k=3",
            "method.dev_share=0.1", "method.plot=false"],
}  # fmt: skip


@pytest.fixture(scope="module")
def imagefolder(tmp_path_factory):
    root = tmp_path_factory.mktemp("imagefolder")
    write_class_folders(root, "train", CLASSES, 16, ".jpg")
    write_class_folders(root, "val", CLASSES, 6, ".png")
    return root


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_method_family_runs_on_imagefolder(cli, tmp_path, imagefolder, family):
    args = ["dataset=imagefolder", f"dataset.root={imagefolder}", *COMMON, *FAMILIES[family], "+debug=smoke"]
    cli(*args, "hydra.run.dir=run")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary, family
