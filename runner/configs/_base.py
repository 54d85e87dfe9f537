"""The base of every method schema."""

from __future__ import annotations

from runner.checks import check_literals


class MethodConfig:
    """A method's schema (a dataclass): `name`, `task` and its hyperparameters with their defaults, the
    one source of them (registered as the `method` group's base configs, see `runner.configs.register`).
    Choices are typed `Literal[...]`; `__post_init__` checks them (subclasses call super first)."""

    def __post_init__(self):
        check_literals(self, "method")
