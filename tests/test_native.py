"""The C kernels' build cache (`runner.methods._native`): an unwritable one falls back to a private folder."""

import logging

import numpy as np
import pytest

from runner.methods import _native, comixup


@pytest.fixture
def fresh_kernels():
    """No kernel loaded yet in this process, before and after (each loader caches its library)."""
    cached = (_native.load, _native._private_dir, comixup._native_dp)
    for loader in cached:
        loader.cache_clear()
    yield
    for loader in cached:
        loader.cache_clear()


@pytest.mark.parametrize("variable", ["XDG_CACHE_HOME", "HOME"])
def test_an_unwritable_cache_builds_in_a_private_folder_said_in_one_line(
    monkeypatch, tmp_path, caplog, fresh_kernels, variable
):
    # a folder under a regular file can be made by no one, root included (a permission-less one can by root)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv(variable, str(blocker / "cache"))
    with caplog.at_level(logging.WARNING, logger=_native.__name__):
        library = _native.load("grid_dp", instead="method.solver=gco_swap")
        s = np.random.default_rng(0).random((4, 2, 2))
        masks = comixup.comixup_masks(s / s.sum((1, 2), keepdims=True), np.eye(4), np.full(4, 0.25), rng=0)
    assert library.grid_dp  # built and loaded, and the solve below it ran through it
    np.testing.assert_allclose(masks.sum(-1), 1)
    lines = [r.getMessage() for r in caplog.records if r.name == _native.__name__]
    assert len(lines) == 1, lines
    said = f"the C kernel cache {_native._cache_dir()} cannot be written (Not a directory): building in "
    assert lines[0].startswith(said)
    assert str(blocker) in lines[0]
    assert not (blocker.parent / "cache").exists()
