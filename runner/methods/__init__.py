"""The methods' solvers: pure functions (arrays in, arrays out, the equation in each docstring), no Hydra,
files or W&B. One façade in POT's manner:

    from runner.methods import cover, allocate, dbot_cluster, assign_codes, comixup_masks

Its names are listed below with their module, each once: a name listed under two modules stops the import
of `runner.methods` (no name is dropped or shadowed in silence), and tests/test_import_graph.py checks the
list against the functions each module's `__all__` exports. A name that names a module (`dbot`, `comixup`)
is the module; its function is `runner.methods.dbot.dbot`. The modules are imported when the façade is
first asked for a name, so importing `runner.methods` (or one solver module) costs nothing more.
"""

from __future__ import annotations

import importlib

EXPORTS = {
    "comixup": (
        "auto_workers", "comixup_masks", "compatibility", "grid_cut", "objective", "pool_saliency",
        "saliency", "salient_locations",
    ),
    "csot": (
        "allocate", "batched_csot_plan", "batched_curriculum_ot", "coherence_energy", "csot_plan",
        "curriculum_budget", "curriculum_ot", "select",
    ),
    "dbot": (
        "check_problem", "class_balanced_weights", "dbot_cluster", "dbot_dual", "dbot_loss", "dbot_lp",
        "dbot_objective", "dbot_predict", "ldam_loss", "ldam_margins", "marginal_violation", "read_pending",
        "round_plan", "weighted_focal_loss",
    ),
    "hier_hash": (
        "assign_codes", "bucket_ids", "bundle_cap", "cascade_codes", "class_unaries", "code_energy",
        "decode_buckets", "encode_buckets", "exhaustive_search", "flow_network", "hash_loss", "level_labels",
        "lsh_activations", "masked_distance", "nmi", "npairs_loss", "precision_at_k", "probe_buckets",
        "remap_labels", "speedup_factor", "triplet_semihard_loss",
    ),
    "mixup": (
        "cutmix", "cutmix_box", "default_mixup_layers", "input_mixup", "manifold_mixup", "mix_hidden",
        "mix_pairs", "none", "pairing", "paste_box", "puzzle_costs", "puzzle_mix", "seam_penalty",
        "transport_plan",
    ),
    "pwc": ("cover", "entropic_partial_wasserstein_dual", "partial_wasserstein_dual"),
}  # fmt: skip


def module_of(exports: dict[str, tuple[str, ...]]) -> dict[str, str]:
    """Each exported name -> its module; a name under two modules, or one naming a module, is an error."""
    found: dict[str, str] = {}
    for module, names in exports.items():
        for name in names:
            if name in found or name in exports:
                where = f"both {found[name]} and {module}" if name in found else f"{module}, and is a module"
                raise ImportError(f"runner.methods: {name!r} is exported by {where}; rename one")
            found[name] = module
    return found


_MODULE_OF = module_of(EXPORTS)
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    if name not in _MODULE_OF:  # a submodule: the import system imports it
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_MODULE_OF[name]}"), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
