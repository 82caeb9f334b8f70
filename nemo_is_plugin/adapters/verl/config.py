"""verl's configuration vocabulary -> the plugin's config keys (needs neither verl nor torch).

Three verl sources map onto :class:`~nemo_is_plugin.ClippedPGLossConfig` keys (docs/verl.md has the one table):

- ``algorithm.rollout_correction`` (verl 0.9.1's ``RolloutCorrectionConfig``): :func:`rollout_correction_keys`;
- its presets (the ``RolloutCorrectionConfig`` classmethods, with verl's keyword arguments): :func:`preset_settings`;
- ``actor_rollout_ref.actor`` / ``.policy_loss`` (clip ratios, ``loss_agg_mode``, ...): :func:`actor_keys`, for the
  verl ``loss_mode`` the plugin section names (:mod:`~nemo_is_plugin.adapters.verl.loss_modes`).

Every verl key is either mapped or refused with a :class:`VerlConfigError` that says why; keys verl itself ignores in
the given setting (``rollout_is_batch_normalize`` without ``rollout_is``, ``loss_type`` outside bypass mode) are
ignored here too, with a warning. :func:`plugin_section_keys` reads the plugin's own section of verl's Hydra config
(``actor_rollout_ref.actor.policy_loss.nemo_is``): plugin keys, plus an optional ``rollout_correction`` entry in verl's
vocabulary (a mapping of its keys, a preset name, or ``{preset: name, <preset keyword>: value}``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, get_args

from nemo_is_plugin.adapters.verl.fields import VerlConfigError, VerlConfigTypeError
from nemo_is_plugin.adapters.verl.fields import verl_field as _get
from nemo_is_plugin.adapters.verl.loss_modes import MODE_READS, check_loss_mode, loss_mode_keys
from nemo_is_plugin.config import LossAggregation, verl_rejection_rule

VERL_LOG_RATIO_CLAMP = 20.0  # verl clamps log(pi/pi_old) to +-20 before exp in every ratio loss
# the plugin's aggregation names are verl's loss_agg_mode names: one vocabulary
VERL_AGG_MODES: tuple[str, ...] = get_args(LossAggregation)
ROLLOUT_CORRECTION_KEYS = (
    "rollout_is",
    "rollout_is_threshold",
    "rollout_is_batch_normalize",
    "rollout_rs",
    "rollout_rs_threshold",
    "bypass_mode",
    "loss_type",
    "score_centering",  # verl-project/verl PR #8010 (after 0.9.1)
)
# algorithm/rollout_correction.yaml: the values of keys a Hydra config leaves out.
ROLLOUT_CORRECTION_DEFAULTS = {
    "rollout_is": None,
    "rollout_is_threshold": 2.0,
    "rollout_is_batch_normalize": False,
    "rollout_rs": None,
    "rollout_rs_threshold": None,
    "bypass_mode": False,
    "loss_type": "ppo_clip",
    "score_centering": False,
}


# ---------------------------------------------------------------------------------------------------------------------
# Presets: verl 0.9.1's RolloutCorrectionConfig classmethods, as (keyword defaults, settings from the keywords)
# ---------------------------------------------------------------------------------------------------------------------


def _settings(
    rollout_is=None, is_threshold: Any = 2.0, rs=None, rs_threshold=None, bypass=False, loss_type="ppo_clip"
) -> dict[str, Any]:
    return {
        "rollout_is": rollout_is,
        "rollout_is_threshold": is_threshold,
        "rollout_is_batch_normalize": False,
        "rollout_rs": rs,
        "rollout_rs_threshold": rs_threshold,
        "bypass_mode": bypass,
        "loss_type": loss_type,
    }


GEO, K3 = "0.999_1.001", 0.01  # verl's Geo-RS band and K3-RS bound
PRESETS: dict[str, tuple[dict[str, Any], Callable[..., dict[str, Any]]]] = {
    "decoupled_token_is": ({"threshold": 2.0}, lambda threshold: _settings("token", threshold)),
    "decoupled_seq_is": ({"threshold": 2.0}, lambda threshold: _settings("sequence", threshold)),
    "decoupled_token_icepop": (
        {"threshold": 5.0, "threshold_lower": 0.5},
        lambda threshold, threshold_lower: _settings("token", f"{threshold_lower}_{threshold}"),
    ),
    "decoupled_seq_is_rs": (
        {"is_threshold": 2.0, "rs_threshold": "0.5_2.0"},
        lambda is_threshold, rs_threshold: _settings("sequence", is_threshold, "seq_sum_k1", rs_threshold),
    ),
    "decoupled_geo_rs": ({"rs_threshold": GEO}, lambda rs_threshold: _settings(None, 2.0, "seq_mean_k1", rs_threshold)),
    "decoupled_geo_rs_seq_tis": (
        {"is_threshold": 2.0, "rs_threshold": GEO},
        lambda is_threshold, rs_threshold: _settings("sequence", is_threshold, "seq_mean_k1", rs_threshold),
    ),
    "decoupled_geo_rs_token_tis": (
        {"is_threshold": 2.0, "rs_threshold": GEO},
        lambda is_threshold, rs_threshold: _settings("token", is_threshold, "seq_mean_k1", rs_threshold),
    ),
    "decoupled_k3_rs": ({"rs_threshold": K3}, lambda rs_threshold: _settings(None, 2.0, "seq_mean_k3", rs_threshold)),
    "decoupled_k3_rs_seq_tis": (
        {"is_threshold": 2.0, "rs_threshold": K3},
        lambda is_threshold, rs_threshold: _settings("sequence", is_threshold, "seq_mean_k3", rs_threshold),
    ),
    "decoupled_k3_rs_token_tis": (
        {"is_threshold": 2.0, "rs_threshold": K3},
        lambda is_threshold, rs_threshold: _settings("token", is_threshold, "seq_mean_k3", rs_threshold),
    ),
    "bypass_ppo_clip": ({}, lambda: _settings(bypass=True)),
    "bypass_ppo_clip_geo_rs": (
        {"rs_threshold": GEO},
        lambda rs_threshold: _settings(None, 2.0, "seq_mean_k1", rs_threshold, True),
    ),
    "bypass_ppo_clip_k3_rs": (
        {"rs_threshold": K3},
        lambda rs_threshold: _settings(None, 2.0, "seq_mean_k3", rs_threshold, True),
    ),
    "bypass_pg_is": (
        {"threshold": 2.0},
        lambda threshold: _settings("sequence", threshold, bypass=True, loss_type="reinforce"),
    ),
    "bypass_pg_token_icepop": (
        {"threshold": 5.0, "threshold_lower": 0.5},
        lambda threshold, threshold_lower: _settings(
            "token", f"{threshold_lower}_{threshold}", bypass=True, loss_type="reinforce"
        ),
    ),
    "bypass_pg_geo_rs": (
        {"rs_threshold": GEO},
        lambda rs_threshold: _settings(None, 2.0, "seq_mean_k1", rs_threshold, True, "reinforce"),
    ),
    "bypass_pg_geo_rs_seq_tis": (
        {"is_threshold": 2.0, "rs_threshold": GEO},
        lambda is_threshold, rs_threshold: _settings(
            "sequence", is_threshold, "seq_mean_k1", rs_threshold, True, "reinforce"
        ),
    ),
    "bypass_pg_geo_rs_token_tis": (
        {"is_threshold": 2.0, "rs_threshold": GEO},
        lambda is_threshold, rs_threshold: _settings(
            "token", is_threshold, "seq_mean_k1", rs_threshold, True, "reinforce"
        ),
    ),
    "disabled": ({}, lambda: _settings()),
}


def preset_settings(name: str, **kwargs: Any) -> dict[str, Any]:
    """The ``algorithm.rollout_correction`` settings of verl's preset ``name`` (keywords as verl's classmethod's)."""
    if name not in PRESETS:
        raise VerlConfigError(f"unknown verl rollout-correction preset {name!r}; verl 0.9.1 has: {', '.join(PRESETS)}")
    defaults, build = PRESETS[name]
    unknown = sorted(set(kwargs) - set(defaults))
    if unknown:
        raise VerlConfigError(f"preset {name!r} takes {sorted(defaults) or 'no keywords'}, not {unknown}")
    return build(**{**defaults, **kwargs})


def preset_keys(name: str, **kwargs: Any) -> dict[str, Any]:
    """The plugin keys of verl's preset ``name``."""
    return rollout_correction_keys(preset_settings(name, **kwargs))


# ---------------------------------------------------------------------------------------------------------------------
# algorithm.rollout_correction
# ---------------------------------------------------------------------------------------------------------------------


def _items(config: Any) -> dict[str, Any]:
    """A dict of a mapping, an OmegaConf node or a verl dataclass config (``BaseConfig`` is a Mapping)."""
    if config is None:
        return {}
    if hasattr(config, "items"):
        return {str(k): v for k, v in config.items()}
    try:
        return dict(config)
    except (TypeError, ValueError) as exc:
        raise VerlConfigError(f"expected a mapping of verl keys, got {type(config).__name__}") from exc


def parse_is_threshold(spec: Any) -> tuple[float, float | None]:
    """verl's ``rollout_is_threshold``: a number (TIS upper bound) or ``"lo_hi"`` (IcePop band) -> (upper, lower)."""
    if isinstance(spec, bool):  # verl's own check (rollout_corr_helper._parse_rollout_is_threshold) says the same
        raise VerlConfigTypeError(
            f"rollout_is_threshold must be a number or a 'lower_upper' string, not a boolean: {spec}"
        )
    if not isinstance(spec, (int, float, str)):
        raise VerlConfigTypeError(f"rollout_is_threshold must be a number or a 'lower_upper' string, got {spec!r}")
    text = str(spec).strip()
    lo_text, hi_text = text.split("_", 1) if "_" in text else (None, text)
    try:
        upper, lower = float(hi_text), None if lo_text is None else float(lo_text)
    except ValueError:
        raise VerlConfigError(f"rollout_is_threshold {spec!r} is not a number or a 'lower_upper' string") from None
    if not upper > 0 or (lower is not None and not 0 < lower <= upper):
        raise VerlConfigError(f"rollout_is_threshold {spec!r}: bounds must be positive with lower <= upper")
    return upper, lower


def rejection_rules(rollout_rs: str | None, threshold: Any) -> list[dict[str, Any]]:
    """verl's ``rollout_rs`` (comma-separated options, duplicates dropped) with ``rollout_rs_threshold`` (one entry for
    all options, or one per option) -> the plugin's ``importance_sampling_rejection_rules``."""
    if rollout_rs is None:
        return []
    if not isinstance(rollout_rs, str):
        raise VerlConfigTypeError(f"rollout_rs must be a comma-separated string of options, got {rollout_rs!r}")
    options = list(dict.fromkeys(o.strip() for o in rollout_rs.split(",") if o.strip()))
    if not options:
        raise VerlConfigError("rollout_rs names no option; use null to disable rejection")
    if threshold is None:
        raise VerlConfigError("rollout_rs needs rollout_rs_threshold (verl has no default)")
    specs = [threshold] if not isinstance(threshold, str) else [t.strip() for t in threshold.split(",") if t.strip()]
    if len(specs) not in (1, len(options)):
        raise VerlConfigError(
            f"rollout_rs_threshold has {len(specs)} entries for {len(options)} rollout_rs options: "
            "give one for all or one per option"
        )
    specs = specs * len(options) if len(specs) == 1 else specs
    return [verl_rejection_rule(opt, spec) for opt, spec in zip(options, specs)]


def rollout_correction_keys(rollout_correction: Any) -> dict[str, Any]:
    """verl's ``algorithm.rollout_correction`` (mapping, OmegaConf node or ``RolloutCorrectionConfig``) -> plugin keys.

    Keys left out take the YAML defaults (``rollout_is: null``). See docs/verl.md for the table.
    """
    rc = _items(rollout_correction)
    rc.pop("_target_", None)  # Hydra's class path
    unknown = sorted(set(rc) - set(ROLLOUT_CORRECTION_KEYS))
    if unknown:
        hint = (
            " (rollout_token_veto_threshold was replaced in verl by rollout_rs: seq_max_k2 / seq_max_k3; the "
            "plugin's own importance_sampling_veto_threshold is the old veto)"
            if "rollout_token_veto_threshold" in unknown
            else ""
        )
        raise VerlConfigError(
            f"algorithm.rollout_correction key(s) {unknown} are not verl's keys "
            f"({', '.join(ROLLOUT_CORRECTION_KEYS)}){hint}"
        )
    rc = {**ROLLOUT_CORRECTION_DEFAULTS, **rc}
    level, bypass, loss_type = rc["rollout_is"], bool(rc["bypass_mode"]), rc["loss_type"]
    if level not in (None, "token", "sequence"):
        raise VerlConfigError(f"rollout_is={level!r} must be 'token', 'sequence' or null")
    if loss_type not in ("ppo_clip", "reinforce"):
        raise VerlConfigError(f"loss_type={loss_type!r} must be 'ppo_clip' or 'reinforce'")
    keys: dict[str, Any] = {}
    applies_is = level is not None and rc["rollout_is_threshold"] is not None
    if applies_is and bypass and loss_type == "ppo_clip":
        _ignored(
            "rollout_is",
            "bypass_mode with loss_type ppo_clip computes IS weights for metrics only (the ratio "
            "pi_theta/mu is the correction); the plugin reports its raw weights (is_raw_weight_*) instead",
        )
        applies_is = False
    if applies_is:
        upper, lower = parse_is_threshold(rc["rollout_is_threshold"])
        keys.update(
            use_importance_sampling_correction=True,
            is_correction_level=level,
            truncated_importance_sampling_type="tis" if lower is None else "icepop",
            truncated_importance_sampling_ratio=upper,
        )
        if lower is not None:
            keys["truncated_importance_sampling_ratio_min"] = lower
        if rc["rollout_is_batch_normalize"]:
            keys["importance_sampling_batch_normalize"] = True
    elif rc["rollout_is_batch_normalize"]:
        _ignored("rollout_is_batch_normalize", "it normalises IS weights, and none are applied")
    rules = rejection_rules(rc["rollout_rs"], rc["rollout_rs_threshold"])
    if rules:
        keys["importance_sampling_rejection_rules"] = rules
    if bypass:
        keys["old_policy_logprobs"] = "generation"
        if loss_type == "reinforce":
            # verl's REINFORCE: -w * A * log pi, no PPO ratio and no dual clip
            keys.update(policy_objective="reinforce", ratio_clip_c=None)
    elif loss_type != "ppo_clip":
        _ignored("loss_type", "verl reads it in bypass mode only (bypass_mode: false here)")
    if rc["score_centering"]:  # f follows from the IS truncation above; the plugin's contradictions say what composes
        keys["score_centering"] = True
    return keys


def _ignored(key: str, why: str) -> None:
    warnings.warn(f"verl's rollout_correction.{key} is ignored, as verl ignores it here: {why}", stacklevel=3)


# ---------------------------------------------------------------------------------------------------------------------
# actor_rollout_ref.actor and its policy_loss
# ---------------------------------------------------------------------------------------------------------------------

# Settings of verl's other policy losses: the plugin replaces them, so a non-default value would be silently unused.
OTHER_LOSS_KEYS = {
    "clip_cov_ratio": (0.0002, "clip_cov"),
    "clip_cov_lb": (1.0, "clip_cov"),
    "clip_cov_ub": (5.0, "clip_cov"),
    "kl_cov_ratio": (0.0002, "kl_cov"),
    "ppo_kl_coef": (0.1, "kl_cov"),
    "dro_beta": (None, "dro"),
}
OTHER_ACTOR_KEYS = {"tau_pos": (1.0, "sapo"), "tau_neg": (1.05, "sapo")}


def _refuse_other_losses(actor: Any, loss_mode: str = "vanilla") -> None:
    policy_loss = _get(actor, "policy_loss")
    read = MODE_READS.get(loss_mode, ())
    for table, where in ((OTHER_LOSS_KEYS, policy_loss), (OTHER_ACTOR_KEYS, actor)):
        for key, (default, loss) in table.items():
            value = _get(where, key)
            if key not in read and value is not None and value != default:
                raise VerlConfigError(
                    f"{key}={value} configures verl's {loss!r} loss, which the plugin's loss_mode "
                    f"replaces: unset it (default {default})"
                )
    rc = _get(policy_loss, "rollout_correction")
    if rc is not None and _items(rc) and _changed(rc):
        raise VerlConfigError(
            "actor.policy_loss.rollout_correction is read by verl's own bypass_mode loss only: put "
            "these keys under policy_loss.nemo_is.rollout_correction for the plugin"
        )


def _changed(rc: Any) -> bool:
    """Whether a policy_loss.rollout_correction differs from RolloutCorrectionConfig()'s dataclass defaults."""
    dataclass_defaults = {**ROLLOUT_CORRECTION_DEFAULTS, "rollout_is": "sequence"}
    items = {k: v for k, v in _items(rc).items() if k != "_target_"}
    changed = any(items.get(k, v) != v for k, v in dataclass_defaults.items())
    return changed or bool(set(items) - set(dataclass_defaults))


def loss_scale_factor(actor: Any) -> Any:
    """``seq-mean-token-sum-norm``'s divisor where verl 0.9's losses read it: ``global_batch_info["loss_scale_factor"]``
    (verl's ``ppo_loss`` copies ``actor.loss_scale_factor`` there), else ``actor.loss_scale_factor`` (a config whose
    ``global_batch_info`` has no such key: a direct call, an older verl); None means the response length."""
    info = dict(_get(actor, "global_batch_info", {}) or {})
    return info["loss_scale_factor"] if "loss_scale_factor" in info else _get(actor, "loss_scale_factor")


def actor_keys(actor: Any, loss_agg_mode: str, loss_mode: str = "vanilla") -> dict[str, Any]:
    """verl's actor settings as plugin keys: the defaults under which the plugin's loss is verl's ``loss_mode``
    (``vanilla`` unless the plugin section names another: :mod:`~nemo_is_plugin.adapters.verl.loss_modes`;
    ``loss_scale_factor``, the divisor of ``seq-mean-token-sum-norm``, is added once the aggregation is known)."""
    if loss_agg_mode not in VERL_AGG_MODES:
        raise VerlConfigError(f"loss_agg_mode={loss_agg_mode!r} is not one of verl's: {', '.join(VERL_AGG_MODES)}")
    check_loss_mode(loss_mode, loss_agg_mode)
    _refuse_other_losses(actor, loss_mode)
    keys: dict[str, Any] = {
        "token_log_ratio_clamp": VERL_LOG_RATIO_CLAMP,
        "reference_policy_kl_penalty": 0.0,  # verl adds its KL loss (use_kl_loss / kl_loss_coef) itself
        "loss_aggregation": loss_agg_mode,
        "token_level_loss": loss_agg_mode in ("token-mean", "token-sum"),
    }
    return {**keys, **loss_mode_keys(actor, loss_mode)}


# ---------------------------------------------------------------------------------------------------------------------
# The plugin's section of verl's Hydra config
# ---------------------------------------------------------------------------------------------------------------------


def plugin_section_keys(section: Any) -> dict[str, Any]:
    """``policy_loss.nemo_is``: plugin keys, plus ``rollout_correction`` in verl's vocabulary (mapped first, so that
    plugin keys in the section win)."""
    keys = _items(section)
    keys.pop("name", None)
    rc = keys.pop("rollout_correction", None)
    return keys if rc is None else with_rollout_correction(rc, keys)


def with_rollout_correction(rc: Any, keys: dict[str, Any]) -> dict[str, Any]:
    """A section's plugin ``keys`` overlaid on its ``rollout_correction`` entry's (they win), both choosing the
    objective refused: the one merge every host's section uses (:mod:`nemo_is_plugin.adapters.host_vocabulary`)."""
    mapped = rollout_correction_entry_keys(rc)
    chosen = mapped.get("policy_objective")
    if chosen is not None and keys.get("policy_objective", chosen) != chosen:
        raise VerlConfigError(
            f"rollout_correction's loss_type: {chosen} (policy_objective {chosen!r}) and policy_objective="
            f"{keys['policy_objective']!r} both choose the objective: keep one"
        )
    return {**mapped, **keys}


def rollout_correction_entry_keys(rc: Any) -> dict[str, Any]:
    """A ``rollout_correction`` entry (a preset name, a mapping of verl's keys, or ``{preset: name, <preset
    keyword>: value}``) as plugin keys."""
    if isinstance(rc, str):
        return preset_keys(rc)
    rc = _items(rc)
    preset = rc.pop("preset", None)
    return preset_keys(preset, **rc) if preset is not None else rollout_correction_keys(rc)


__all__ = [
    "PRESETS",
    "ROLLOUT_CORRECTION_KEYS",
    "VERL_AGG_MODES",
    "VERL_LOG_RATIO_CLAMP",
    "VerlConfigError",
    "VerlConfigTypeError",
    "actor_keys",
    "loss_scale_factor",
    "parse_is_threshold",
    "plugin_section_keys",
    "preset_keys",
    "preset_settings",
    "rejection_rules",
    "rollout_correction_entry_keys",
    "rollout_correction_keys",
    "with_rollout_correction",
]
