"""The `method` group's schemas: one dataclass per method, with its task, hyperparameters, defaults and
checks, the one source of them. `register()` stores each as `schema/method/<name>` in Hydra's ConfigStore,
the base that `conf/method/<name>.yaml` extends; `validate` checks a composed `method` node against it.
"""

from __future__ import annotations

import dataclasses

from runner.configs import classify, clustering, covering, hashing, longtail, noisy_labels

# task name -> {method name -> schema}
TASK_METHODS: dict[str, dict[str, type]] = {
    module.__name__.rpartition(".")[2]: module.METHODS
    for module in (classify, clustering, covering, hashing, longtail, noisy_labels)
}
METHODS: dict[str, type] = {
    name: schema for methods in TASK_METHODS.values() for name, schema in methods.items()
}


def register() -> None:
    """Store every method's defaults as `schema/method/<name>` (plain values: `validate` types them)."""
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    for name, schema in METHODS.items():
        store.store(group="schema/method", name=name, node=dataclasses.asdict(schema()), provider="runner")
