"""The documented import path of the YAML recipe loader; the loader itself is :mod:`nemo_is_plugin.adapters.recipes`."""

from nemo_is_plugin.adapters.recipes import (
    DEFAULT_SECTION,
    LOSS_KEYS,
    LossSpec,
    RecipeError,
    apply_override,
    load_loss_spec,
    load_recipe_config,
    load_yaml,
    loss_section,
    to_loss_mapping,
)

__all__ = [
    "DEFAULT_SECTION",
    "LOSS_KEYS",
    "LossSpec",
    "RecipeError",
    "apply_override",
    "load_loss_spec",
    "load_recipe_config",
    "load_yaml",
    "loss_section",
    "to_loss_mapping",
]
