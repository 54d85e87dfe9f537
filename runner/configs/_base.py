"""The base of every method schema."""

from __future__ import annotations

import dataclasses

from runner.checks import check_literals


class MethodConfig:
    """A method's schema (a dataclass): `name`, `task` and its hyperparameters with their defaults, the
    one source of them (registered as the `method` group's base configs, see `runner.configs.register`).
    Choices are typed `Literal[...]`; `__post_init__` checks them (subclasses call super first)."""

    def __post_init__(self):
        check_literals(self, "method")


def variant(cls_name: str, base: type, doc: str, module: str, **defaults) -> type:
    """A subclass of the schema `base` that changes only `defaults` (`name`, `loss`, ...), its fields
    typed as in `base` (so `Literal` choices keep their checks): one line per baseline or ablation."""
    types = {f.name: f.type for f in dataclasses.fields(base)}
    fields = [(key, types[key], dataclasses.field(default=value)) for key, value in defaults.items()]
    cls = dataclasses.make_dataclass(cls_name, fields, bases=(base,), namespace={"__doc__": doc})
    # its string annotations resolve in `module` (Python 3.12's make_dataclass sets the caller's, this one)
    cls.__module__ = module
    return cls
