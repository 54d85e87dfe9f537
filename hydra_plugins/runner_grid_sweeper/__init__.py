"""Hydra instantiates a sweeper only from its `hydra_plugins` namespace: this is the name under which
`hydra/sweeper=grid` (conf/hydra/sweeper/grid.yaml, the default) finds runner's grid sweeper,
runner/sweeper.py."""

import runner.sweeper


class GridSweeper(runner.sweeper.GridSweeper):
    __doc__ = runner.sweeper.GridSweeper.__doc__
