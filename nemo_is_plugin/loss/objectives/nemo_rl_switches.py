"""NeMo-RL's keys of PPO's ratio as the objectives see them: the one place ``use_cispo``, ``disable_ppo_ratio`` and
``force_on_policy_ratio`` become ``cispo``, ``reinforce`` and ``on_policy`` (docs/objectives.md, *NeMo-RL's
switches*), and, keyed by objective name, which of NeMo-RL's clip keys and switches each objective reads
(:data:`NEMO_RL_RATIO_KEYS`). These are NeMo-RL's vocabulary, not the objectives': an objective's class says nothing
of them. They stay in the loss layer, beside the objectives rather than in ``adapters/nemo_rl``, because the loss's
own config (``ClippedPGLossConfig``, whose keys are NeMo-RL's ``loss_fn`` keys) validates them and the loss reports
NeMo-RL's metrics under them, both below the adapters (docs/design.md, *Layers*). Plain functions of a config or of a
mapping of ``loss_fn`` keys, no registry; imports neither torch nor the registry.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from nemo_is_plugin.config.keys import LossKeys

DEFAULT_OBJECTIVE = "ppo_clip"
# NeMo-RL's keys of PPO's ratio, in its generic block (config/keys.py): the clip bounds, and the switches that choose
# another ratio (or, sequence_level_importance_ratios, its level). NEMO_RL_RATIO_KEYS says which each objective reads.
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


@dataclass(frozen=True)
class NemoRlRatioKeys:
    """What of NeMo-RL's ratio keys one objective reads. clip_keys: those of :data:`NEMO_RL_CLIP_KEYS` it reads;
    switches: those of :data:`RATIO_SWITCHES` it accepts set (the others are refused with it); ignored: clip keys
    NeMo-RL's switch that selects it leaves unread without a word (REINFORCE's and the on-policy ratio's
    ``ratio_clip_min`` / ``_max``), accepted when it is selected that way and refused when it is named."""

    clip_keys: tuple[str, ...] = ()
    switches: tuple[str, ...] = ()
    ignored: tuple[str, ...] = ()


# By objective name; an objective not listed reads none of them (every one set away from its default is refused).
NEMO_RL_RATIO_KEYS: dict[str, NemoRlRatioKeys] = {
    "ppo_clip": NemoRlRatioKeys(NEMO_RL_CLIP_KEYS, ("sequence_level_importance_ratios",)),
    "cispo": NemoRlRatioKeys(("ratio_clip_min", "ratio_clip_max"), ("use_cispo",)),
    "reinforce": NemoRlRatioKeys(
        ("ratio_clip_c",),
        ("disable_ppo_ratio", "sequence_level_importance_ratios"),
        ("ratio_clip_min", "ratio_clip_max"),
    ),
    "on_policy": NemoRlRatioKeys(
        ("ratio_clip_c",),
        ("force_on_policy_ratio", "disable_ppo_ratio", "sequence_level_importance_ratios"),
        ("ratio_clip_min", "ratio_clip_max"),
    ),
}


def selecting_switch(policy_objective: str, keys: Any) -> str | None:
    """The NeMo-RL switch that selects the objective (:data:`NEMO_RL_SWITCHES`), None when ``policy_objective`` names
    it. ``keys``: a config, or a mapping of ``loss_fn`` keys (an adapter's, before the config is built)."""
    if policy_objective != DEFAULT_OBJECTIVE:
        return None
    read = keys.get if isinstance(keys, Mapping) else lambda key, default: getattr(keys, key, default)
    return next((switch for switch, _ in NEMO_RL_SWITCHES if read(switch, False)), None)


def resolve_objective(policy_objective: str, keys: Any) -> tuple[str, str | None]:
    """(the objective a config computes, the NeMo-RL switch that selected it): ``policy_objective`` and None, or under
    its default (``ppo_clip``) the one NeMo-RL's switches select (``force_on_policy_ratio`` -> ``on_policy``, else
    ``disable_ppo_ratio`` -> ``reinforce``, else ``use_cispo`` -> ``cispo``) and that switch. ``keys`` as
    :func:`selecting_switch`. ``ClippedPGLossConfig`` calls it once per validation and stores the answer."""
    switch = selecting_switch(policy_objective, keys)
    return (policy_objective, None) if switch is None else (dict(NEMO_RL_SWITCHES)[switch], switch)


def effective_objective(policy_objective: str, keys: Any) -> str:
    """The objective of :func:`resolve_objective`."""
    return resolve_objective(policy_objective, keys)[0]


def effective_objective_of_keys(keys: Mapping[str, Any]) -> str:
    """The name of the objective a mapping of ``loss_fn`` keys selects (an adapter's keys, before the config is
    built)."""
    return effective_objective(keys.get("policy_objective", DEFAULT_OBJECTIVE), keys)


def unread_clip_keys(keys: Mapping[str, Any]) -> tuple[str, ...]:
    """NeMo-RL's clip keys (:data:`NEMO_RL_CLIP_KEYS`) that the objective ``keys`` select refuses: what an adapter
    leaves out of the host's clip settings (verl's ``clip_ratio*``, slime's ``--eps-clip*``) when that objective
    replaces PPO's clip."""
    reads = NEMO_RL_RATIO_KEYS.get(effective_objective_of_keys(keys), NemoRlRatioKeys())
    switch = selecting_switch(keys.get("policy_objective", DEFAULT_OBJECTIVE), keys)
    ignored = reads.ignored if switch is not None else ()
    return tuple(k for k in NEMO_RL_CLIP_KEYS if k not in reads.clip_keys and k not in ignored)


def nemo_rl_key_refusals(cfg: Any) -> list[str]:
    """NeMo-RL's clip keys set away from their defaults and ratio switches set that the config's objective does not
    read (:data:`NEMO_RL_RATIO_KEYS`; its ``ignored`` keys pass when a NeMo-RL switch selected it, as in NeMo-RL).
    ``cfg``: the config being validated (its objective resolved: ``effective_objective``, ``objective_switch``)."""
    switch, name = cfg.objective_switch, cfg.effective_objective
    reads = NEMO_RL_RATIO_KEYS.get(name, NemoRlRatioKeys())
    fields = LossKeys.model_fields  # the clip keys are generic keys: their defaults are NeMo-RL's
    out = []
    for key in NEMO_RL_CLIP_KEYS:
        if key in reads.clip_keys or (switch is not None and key in reads.ignored):
            continue
        if getattr(cfg, key) != fields[key].default:
            out.append(
                f"{key} is incompatible with {switch}=true (policy_objective {name!r} does not read it): unset {key}"
                if switch is not None
                else f"{key} configures PPO's ratio clip, which policy_objective={name!r} does not have: unset {key} "
                "(or use policy_objective: ppo_clip)"
            )
    for key in RATIO_SWITCHES:
        if key == switch or key in reads.switches or not getattr(cfg, key):
            continue
        out.append(
            f"{key}=true is incompatible with {switch}=true (policy_objective {name!r}); turn one of them off"
            if switch is not None
            else f"{key}=true chooses another policy ratio than policy_objective={name!r}'s: set it false"
        )
    return out


__all__ = [
    "DEFAULT_OBJECTIVE",
    "NEMO_RL_CLIP_KEYS",
    "NEMO_RL_RATIO_KEYS",
    "NEMO_RL_SWITCHES",
    "RATIO_SWITCHES",
    "NemoRlRatioKeys",
    "effective_objective",
    "nemo_rl_key_refusals",
    "resolve_objective",
    "effective_objective_of_keys",
    "selecting_switch",
    "unread_clip_keys",
]
