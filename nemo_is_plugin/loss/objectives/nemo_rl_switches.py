"""NeMo-RL's switches of its PPO loss as a choice of objective: the one place ``use_cispo``, ``disable_ppo_ratio`` and
``force_on_policy_ratio`` become ``cispo``, ``reinforce`` and ``on_policy`` (docs/objectives.md, *NeMo-RL's
switches*). Plain functions of a config or of a mapping of ``loss_fn`` keys, no registry: ``base.objective_of`` looks
the name up. Imports neither torch nor the registry.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

DEFAULT_OBJECTIVE = "ppo_clip"
# NeMo-RL's keys of PPO's ratio, in its generic block (config/keys.py): the clip bounds, and the switches that choose
# another ratio (or, sequence_level_importance_ratios, its level). Each objective says which it reads / accepts.
NEMO_RL_CLIP_KEYS = ("ratio_clip_min", "ratio_clip_max", "ratio_clip_c")
RATIO_SWITCHES = ("use_cispo", "disable_ppo_ratio", "force_on_policy_ratio", "sequence_level_importance_ratios")
# NeMo-RL's switches that select another objective while policy_objective is ppo_clip (its default), in NeMo-RL's
# precedence: ClippedPGLossFn tests force_on_policy_ratio first, then disable_ppo_ratio, then use_cispo
# (NVIDIA-NeMo/RL nemo_rl/algorithms/loss/loss_functions.py @ 7ea279ab). The one place a switch becomes an objective.
NEMO_RL_SWITCHES: tuple[tuple[str, str], ...] = (
    ("force_on_policy_ratio", "on_policy"),
    ("disable_ppo_ratio", "reinforce"),
    ("use_cispo", "cispo"),
)


def selecting_switch(policy_objective: str, keys: Any) -> str | None:
    """The NeMo-RL switch that selects the objective (:data:`NEMO_RL_SWITCHES`), None when ``policy_objective`` names
    it. ``keys``: a config, or a mapping of ``loss_fn`` keys (an adapter's, before the config is built)."""
    if policy_objective != DEFAULT_OBJECTIVE:
        return None
    read = keys.get if isinstance(keys, Mapping) else lambda key, default: getattr(keys, key, default)
    return next((switch for switch, _ in NEMO_RL_SWITCHES if read(switch, False)), None)


def effective_objective(policy_objective: str, keys: Any) -> str:
    """The objective a config computes: ``policy_objective``, or under its default (``ppo_clip``) the one NeMo-RL's
    switches select (``force_on_policy_ratio`` -> ``on_policy``, else ``disable_ppo_ratio`` -> ``reinforce``, else
    ``use_cispo`` -> ``cispo``). ``keys`` as :func:`selecting_switch`."""
    switch = selecting_switch(policy_objective, keys)
    return policy_objective if switch is None else dict(NEMO_RL_SWITCHES)[switch]


__all__ = [
    "DEFAULT_OBJECTIVE",
    "NEMO_RL_CLIP_KEYS",
    "NEMO_RL_SWITCHES",
    "RATIO_SWITCHES",
    "effective_objective",
    "selecting_switch",
]
