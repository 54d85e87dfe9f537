"""The methods' solvers: pure functions (arrays in, arrays out, the equation in each docstring), no Hydra,
files or W&B. One façade in POT's manner:

    from runner.methods import cover, allocate, dbot_cluster, assign_codes, comixup_masks

Each name is its module's function (`runner.methods.<module>`), imported on first use, so the façade
costs nothing until a solver is asked for. Where a module and its main function share a name (`dbot`,
`comixup`) the name is the module: `runner.methods.dbot.dbot`.
"""

from __future__ import annotations

import importlib

SOLVERS = {
    "comixup": ("comixup_masks", "saliency", "compatibility", "grid_cut"),
    "csot": ("allocate", "csot_plan", "curriculum_ot", "curriculum_budget", "coherence_energy", "select"),
    "dbot": ("dbot_lp", "dbot_cluster", "dbot_predict", "dbot_loss", "dbot_objective", "dbot_dual"),
    "hier_hash": ("assign_codes", "cascade_codes", "flow_network", "code_energy", "hash_loss"),
    "mixup": ("input_mixup", "cutmix", "manifold_mixup", "puzzle_mix"),
    "pwc": ("cover", "partial_wasserstein_dual", "entropic_partial_wasserstein_dual"),
}
_MODULE_OF = {name: module for module, names in SOLVERS.items() for name in names}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    if name not in _MODULE_OF:  # a submodule is imported by the import system itself
        raise AttributeError(f"module 'runner.methods' has no attribute {name!r}")
    return getattr(importlib.import_module(f"runner.methods.{_MODULE_OF[name]}"), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
