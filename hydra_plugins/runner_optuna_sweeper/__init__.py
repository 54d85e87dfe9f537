"""Hydra instantiates a sweeper only from its `hydra_plugins` namespace: this is the name under which
`hydra/sweeper=optuna` (conf/hydra/sweeper/optuna.yaml) finds runner's Optuna sweeper, runner/sweeper.py."""

import runner.sweeper


class OptunaSweeper(runner.sweeper.OptunaSweeper):
    __doc__ = runner.sweeper.OptunaSweeper.__doc__
