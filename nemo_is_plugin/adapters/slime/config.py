"""slime's command-line vocabulary -> the plugin's config keys (needs neither slime nor torch).

slime (THUDM/slime, commit 624b824a) configures its loss with flags on one ``argparse.Namespace`` (``args``). The two
entry points of :mod:`nemo_is_plugin.adapters.slime` read them at their first call and map each flag that touches the
loss onto :class:`~nemo_is_plugin.ClippedPGLossConfig` keys, so that with no plugin keys the plugin computes
what slime computes; a flag the plugin cannot honour raises :class:`SlimeConfigError` naming the flag and the fix.
docs/slime.md has the table (:data:`LOSS_FLAGS` is the same table, checked by the tests).

The plugin's own keys come from, in increasing precedence: the recipe named by ``$NEMO_IS_CONFIG`` (its ``loss_fn``
section, or ``$NEMO_IS_CONFIG_SECTION``), then ``args.nemo_is`` -- a mapping of keys, or a recipe path, set through
slime's ``--custom-config-path`` YAML (``nemo_is: {...}``). Neither present raises :class:`MissingPluginConfigError`
(``nemo_is: {}`` means "slime's flags only").
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from typing import Any

from nemo_is_plugin.adapters.host_vocabulary import host_section_keys
from nemo_is_plugin.adapters.sampler_checks import SLIME_NAMES, check_sampler, slime_sampling
from nemo_is_plugin.adapters.shared import MissingPluginConfigError
from nemo_is_plugin.config import ConfigError
from nemo_is_plugin.loss.config_model import ClippedPGLossConfig
from nemo_is_plugin.loss.objectives import unread_clip_keys

CONFIG_ENV = "NEMO_IS_CONFIG"
SECTION_ENV = "NEMO_IS_CONFIG_SECTION"
ARGS_KEY = "nemo_is"  # args.nemo_is, from slime's --custom-config-path YAML
TIS_FUNCTION_PATH = "nemo_is_plugin.adapters.slime.tis_function"
POLICY_LOSS_PATH = "nemo_is_plugin.adapters.slime.policy_loss"
SLIME_ICEPOP_PATH = "slime.backends.megatron_utils.loss.icepop_function"
# Estimators that only shape the advantages (computed before the loss, handed over in the batch).
ADVANTAGE_ONLY_ESTIMATORS = ("grpo", "ppo", "reinforce_plus_plus", "reinforce_plus_plus_baseline")
SLIME_KL_TYPES = ("k1", "k2", "k3", "low_var_kl")
LOW_VAR_KL_CLAMP = 10.0  # slime clamps low_var_kl (k3, after the unbiased weight) to +-10
# The plugin keys the IS-correction entry point applies; the others belong to slime's own PPO loss there.
IS_KEYS = frozenset(
    {
        "use_importance_sampling_correction",
        "is_correction_level",
        "truncated_importance_sampling_type",
        "truncated_importance_sampling_ratio",
        "truncated_importance_sampling_ratio_min",
        "importance_sampling_rejection",
        "importance_sampling_rejection_min",
        "importance_sampling_rejection_max",
        "importance_sampling_veto_threshold",
        "importance_sampling_batch_normalize",
        "importance_sampling_rejection_rules",
        "strict_input_checks",
    }
)
BOUND_KEYS = ("truncated_importance_sampling_ratio", "truncated_importance_sampling_ratio_min")
# slime's reducer (sum_of_sample_mean, or the token sum of --calculate-per-token-loss) owns the aggregation.
REDUCER_KEYS = ("loss_aggregation", "loss_aggregation_norm", "token_level_loss")

# Every slime flag that touches the loss: (how the plugin treats it, why). "mapped": read into the plugin's config;
# "host": slime applies it before or after the loss and the plugin leaves it to slime; "refused": raises.
LOSS_FLAGS: dict[str, tuple[str, str]] = {
    "--loss-type": ("mapped", "custom_loss with --custom-loss-function-path " + POLICY_LOSS_PATH),
    "--advantage-estimator": (
        "mapped",
        "grpo / ppo / reinforce_plus_plus(_baseline): advantages only, token ratio; gspo: ratio_level sequence; "
        "cispo: use_cispo",
    ),
    "--eps-clip": ("mapped", "ratio_clip_min (PPO's clip: left out under another policy_objective, which replaces it)"),
    "--eps-clip-high": ("mapped", "ratio_clip_max (slime: --eps-clip when unset)"),
    "--eps-clip-c": ("mapped", "ratio_clip_c (dual clip; slime's CISPO ignores it, warned)"),
    "--use-kl-loss": ("mapped", "adds slime's KL term kl_loss_coef * KL(pi_theta || pi_ref) to the loss"),
    "--kl-loss-coef": ("mapped", "the KL term's coefficient"),
    "--kl-loss-type": ("mapped", "k1 / k2 / k3 estimators of the plugin's KL; low_var_kl = k3 clamped to +-10"),
    "--use-unbiased-kl": ("mapped", "KL weighted by exp(log pi_theta - log pi_old), gradient included"),
    "--entropy-coef": ("mapped", "loss -= entropy_coef * entropy (entropy from the plugin's vocab-parallel kernel)"),
    "--use-tis": ("mapped", "use_importance_sampling_correction + token-level tis"),
    "--get-mismatch-metrics": ("mapped", "as slime: the TIS function runs (and applies its weights) as with --use-tis"),
    "--tis-clip": ("mapped", "truncated_importance_sampling_ratio (tis / icepop upper bound)"),
    "--tis-clip-low": ("mapped", "truncated_importance_sampling_ratio_min (tis / icepop lower bound)"),
    "--custom-tis-function-path": (
        "mapped",
        f"unset or {TIS_FUNCTION_PATH}: the plugin's IS keys; {SLIME_ICEPOP_PATH}: icepop; others refused "
        "by the full loss (it replaces slime's PPO loss, which calls them)",
    ),
    "--use-rollout-logprobs": ("mapped", "old_policy_logprobs: generation (bypass: pi_old = rollout policy)"),
    "--rollout-temperature": ("mapped", "logits divided by it before the log-probs, as slime does"),
    "--log-probs-chunk-size": ("mapped", "tokens per chunk of the plugin's vocab-parallel log-prob kernel"),
    "--calculate-per-token-loss": ("host", "slime's reducer (token sum) and rescaling; the plugin reduces with it"),
    "--recompute-loss-function": ("host", "slime checkpoints the custom loss; nothing to map"),
    "--use-opd": ("host", "slime folds OPD into the advantages; opd_reverse_kl is reported"),
    "--opd-kl-coef": ("host", "as --use-opd"),
    "--kl-coef": ("host", "reward-side KL, in the advantages"),
    "--normalize-advantages": ("host", "advantages"),
    "--use-opsm": ("refused", "the plugin has no off-policy sequence masking; use importance_sampling_rejection_rules"),
    "--opsm-delta": ("refused", "as --use-opsm"),
    "--custom-pg-loss-reducer-function-path": (
        "refused",
        "the full loss reduces with slime's sum_of_sample_mean; a custom reducer would be silently unused",
    ),
    "--allgather-cp": ("refused", "the plugin reads slime's ring-attention CP layout only"),
    "--rollout-top-p": ("refused", "!= 1.0: slime's top-p replay masks of the log-probs are not modelled"),
    "--use-score-centering": (
        "mapped",
        "score_centering (upstream slime 2e5cd7cd; the batch's rollout_topk_token_ids / rollout_topk_log_probs)",
    ),
    "--score-centering-top-k": ("mapped", "score_centering_top_k (read with --use-score-centering)"),
    "--rollout-top-k": ("refused", "!= -1 with score centering: the head of a truncated distribution is refused"),
}


class SlimeConfigError(ConfigError):
    """A slime flag or plugin key the slime adapter cannot honour; the message names it and the fix."""


def _arg(args: Any, name: str, default: Any = None) -> Any:
    value = getattr(args, name, default)
    return default if value is None else value


def missing_message(entry: str) -> str:
    return (
        f"{entry}: no plugin config on this slime worker. Give args.{ARGS_KEY} (a mapping of plugin keys or a recipe "
        f"path, through slime's --custom-config-path YAML: '{ARGS_KEY}: {{}}' means slime's flags only) or export "
        f"{CONFIG_ENV}=/abs/recipe.yaml to the Ray workers (ray job submit --runtime-env-json "
        f'\'{{"env_vars": {{"{CONFIG_ENV}": ...}}}}\'). See docs/slime.md.'
    )


def plugin_keys(args: Any, entry: str) -> dict[str, Any]:
    """The user's plugin keys: ``$NEMO_IS_CONFIG``'s recipe, overlaid by ``args.nemo_is``; raises when neither."""
    from nemo_is_plugin.adapters.recipes import to_loss_mapping

    section = os.environ.get(SECTION_ENV, "loss_fn")
    path, own = os.environ.get(CONFIG_ENV), getattr(args, ARGS_KEY, None)
    if not path and own is None:
        raise MissingPluginConfigError(missing_message(entry))
    keys = to_loss_mapping(path, section=section) if path else {}
    if isinstance(own, (str, os.PathLike)):
        keys.update(to_loss_mapping(own, section=section))
    elif own is not None:
        if not isinstance(own, Mapping):
            raise SlimeConfigError(f"args.{ARGS_KEY} must be a mapping of plugin keys or a recipe path, got {own!r}")
        keys.update(to_loss_mapping(dict(own), section=section) if section in own else dict(own))
    keys.pop("name", None)
    return host_section_keys(keys, "slime", also=())


def tis_keys(args: Any, kind: str = "tis") -> dict[str, Any]:
    """slime's TIS settings (``--tis-clip``, ``--tis-clip-low``) as plugin keys: token-level ``kind`` truncation,
    applied (slime multiplies its TIS function's weights into the loss whenever it calls it)."""
    return {
        "use_importance_sampling_correction": True,
        "truncated_importance_sampling_type": kind,
        "truncated_importance_sampling_ratio": float(_arg(args, "tis_clip", 2.0)),
        "truncated_importance_sampling_ratio_min": float(_arg(args, "tis_clip_low", 0.0)),
    }


def _overlay_is(base: dict[str, Any], user: Mapping[str, Any]) -> dict[str, Any]:
    """Overlay the user's IS keys on slime's: slime's bounds stay only for the types they bound (tis, icepop)."""
    merged = {**base, **user}
    if merged.get("truncated_importance_sampling_type") not in ("tis", "icepop"):
        for key in BOUND_KEYS:
            if key not in user:
                merged.pop(key, None)
    return merged


def tis_config(args: Any, user: Mapping[str, Any]) -> ClippedPGLossConfig:
    """The config of the IS-correction entry point: slime's TIS flags, overlaid by the user's IS keys."""
    other = sorted(set(user) - IS_KEYS)
    if other:
        raise SlimeConfigError(
            f"plugin key(s) {other} are not IS-correction keys: the TIS function only reweights slime's own PPO loss, "
            f"whose ratio, clip, KL and aggregation come from slime's flags. Use the full loss "
            f"(--loss-type custom_loss --custom-loss-function-path {POLICY_LOSS_PATH}) for them, or remove them"
        )
    keys = _overlay_is(tis_keys(args), user)
    return ClippedPGLossConfig(**{**keys, "reference_policy_kl_penalty": 0.0})


def _is_function_kind(args: Any) -> str:
    path = getattr(args, "custom_tis_function_path", None)
    if path in (None, TIS_FUNCTION_PATH):
        return "tis"
    if path == SLIME_ICEPOP_PATH:
        return "icepop"
    raise SlimeConfigError(
        f"--custom-tis-function-path {path}: slime's PPO loss calls it, and the plugin's full loss replaces that loss, "
        f"so it would be silently unused. Unset it (the plugin's IS keys apply), or use {SLIME_ICEPOP_PATH} / "
        f"{TIS_FUNCTION_PATH}"
    )


def refuse_flags(args: Any) -> None:
    """Raise for the slime flags the full loss cannot honour (:data:`LOSS_FLAGS`, 'refused')."""
    if _arg(args, "use_opsm", False):
        raise SlimeConfigError("--use-opsm: " + LOSS_FLAGS["--use-opsm"][1] + "; remove --use-opsm")
    if getattr(args, "custom_pg_loss_reducer_function_path", None) is not None:
        raise SlimeConfigError(
            "--custom-pg-loss-reducer-function-path: " + LOSS_FLAGS["--custom-pg-loss-reducer-function-path"][1]
        )
    if _arg(args, "allgather_cp", False):
        raise SlimeConfigError("--allgather-cp: " + LOSS_FLAGS["--allgather-cp"][1] + "; remove --allgather-cp")
    if float(_arg(args, "rollout_top_p", 1.0)) != 1.0:
        raise SlimeConfigError(
            f"--rollout-top-p {args.rollout_top_p}: slime's top-p replay masks of the log-probs are not modelled by "
            "the plugin's loss; use --rollout-top-p 1.0 with it"
        )
    kl_type = _arg(args, "kl_loss_type", "k1")
    if kl_type not in SLIME_KL_TYPES:
        raise SlimeConfigError(f"--kl-loss-type {kl_type!r} is not one of slime's {SLIME_KL_TYPES}")


def score_centering_keys(args: Any) -> dict[str, Any]:
    """Upstream slime's score-centering flags (THUDM/slime 2e5cd7cd: ``--use-score-centering``,
    ``--score-centering-top-k``) as plugin keys; {} when off (the user's ``score_centering`` key may still turn the
    term on, with k taken from the batch's head)."""
    if not _arg(args, "use_score_centering", False):
        return {}
    keys: dict[str, Any] = {"score_centering": True}
    top_k = getattr(args, "score_centering_top_k", None)
    if top_k is not None:
        keys["score_centering_top_k"] = int(top_k)
    return keys


def applies_is(args: Any) -> bool:
    """slime runs its TIS function (and multiplies its weights in) under --use-tis or --get-mismatch-metrics."""
    return bool(_arg(args, "use_tis", False) or _arg(args, "get_mismatch_metrics", False))


def policy_config(args: Any, user: Mapping[str, Any]) -> ClippedPGLossConfig:
    """The config of the full loss: slime's flags as plugin keys, overlaid by the user's keys."""
    refuse_flags(args)
    refused = sorted(k for k in REDUCER_KEYS if k in user)
    if refused:
        raise SlimeConfigError(
            f"plugin key(s) {refused}: slime's reducer decides the aggregation (per-sample / per-rollout means, or "
            "the token sum with --calculate-per-token-loss); remove them"
        )
    if user.get("positive_example_nll_weight"):
        raise SlimeConfigError("positive_example_nll_weight needs per-sample rewards, which slime's loss does not get")
    if user.get("use_kl_in_reward"):
        raise SlimeConfigError("use_kl_in_reward: slime's reward-side KL is --kl-coef; remove the key")
    estimator = _arg(args, "advantage_estimator", "grpo")
    eps = float(_arg(args, "eps_clip", 0.2))
    base: dict[str, Any] = {
        "ratio_clip_min": eps,
        "ratio_clip_max": float(_arg(args, "eps_clip_high", eps)),
        "ratio_clip_c": getattr(args, "eps_clip_c", None),
        "reference_policy_kl_penalty": 0.0,  # slime's --use-kl-loss term is added by the adapter
    }
    if estimator == "gspo":
        base["ratio_level"] = "sequence"
    elif estimator == "cispo":
        if user.get("policy_objective", "cispo") != "cispo":
            raise SlimeConfigError(
                f"--advantage-estimator cispo and policy_objective={user['policy_objective']!r} both choose the "
                "objective: keep one"
            )
        base["policy_objective"] = "cispo"
        if base.pop("ratio_clip_c") is not None:
            warnings.warn("--eps-clip-c is ignored with --advantage-estimator cispo, as slime ignores it", stacklevel=3)
    elif estimator not in ADVANTAGE_ONLY_ESTIMATORS:
        raise SlimeConfigError(
            f"--advantage-estimator {estimator!r} is not one of slime's {(*ADVANTAGE_ONLY_ESTIMATORS, 'gspo', 'cispo')}"
        )
    if _arg(args, "use_rollout_logprobs", False):
        base["old_policy_logprobs"] = "generation"
    base.update(score_centering_keys(args))
    if applies_is(args):
        base.update(tis_keys(args, _is_function_kind(args)))
    if {"ratio_clip_c", "log_ratio_clip_low", "log_ratio_clip_high"} & set(user):
        base.pop("ratio_clip_c", None)
    # slime's --eps-clip* are PPO's clip, which another objective replaces with its own trust region (the config
    # refuses the clip keys it does not read; CISPO reads the bounds, not the dual clip); slime always has
    # --eps-clip, so they are left out rather than refused
    for key in unread_clip_keys({**base, **user}):
        base.pop(key, None)
    keys = _overlay_is(base, user) if applies_is(args) else {**base, **user}
    cfg = ClippedPGLossConfig(**keys)
    if cfg.score_centering:
        # the full loss divides the logits by --rollout-temperature, the flag SGLang samples at: one temperature
        check_sampler(slime_sampling(args), SLIME_NAMES, engine="sglang")
    if cfg.effective_kl_penalty != 0 and _arg(args, "use_kl_loss", False):
        raise SlimeConfigError(
            "two KL terms: slime's --use-kl-loss and the plugin's reference_policy_kl_penalty; keep one "
            "(slime's flags, or the plugin's KL keys without --use-kl-loss)"
        )
    return cfg


def slime_kl(args: Any) -> dict[str, Any] | None:
    """slime's KL term (--use-kl-loss): coefficient, estimator, output clamp, unbiased weight; None when off."""
    if not _arg(args, "use_kl_loss", False):
        return None
    kl_type = _arg(args, "kl_loss_type", "k1")
    return {
        "coef": float(_arg(args, "kl_loss_coef", 0.0)),
        "kl_type": "k3" if kl_type == "low_var_kl" else kl_type,
        "output_clamp": LOW_VAR_KL_CLAMP if kl_type == "low_var_kl" else None,
        "unbiased": bool(_arg(args, "use_unbiased_kl", False)),
    }


def args_signature(args: Any, names: tuple[str, ...]) -> tuple[Any, ...]:
    """The values of the flags a config depends on (the cache key of a validated config)."""
    return tuple(repr(getattr(args, n, None)) for n in names)


# The args the configs above read (their cache key).
CONFIG_ARGS = (
    "advantage_estimator",
    "eps_clip",
    "eps_clip_high",
    "eps_clip_c",
    "use_tis",
    "get_mismatch_metrics",
    "tis_clip",
    "tis_clip_low",
    "custom_tis_function_path",
    "use_rollout_logprobs",
    "use_kl_loss",
    "kl_loss_coef",
    "kl_loss_type",
    "use_unbiased_kl",
    "use_opsm",
    "custom_pg_loss_reducer_function_path",
    "allgather_cp",
    "rollout_top_p",
    "rollout_top_k",
    "rollout_temperature",
    "use_score_centering",
    "score_centering_top_k",
    ARGS_KEY,
)

__all__ = [
    "ARGS_KEY",
    "CONFIG_ENV",
    "IS_KEYS",
    "LOSS_FLAGS",
    "MissingPluginConfigError",
    "SlimeConfigError",
    "applies_is",
    "plugin_keys",
    "policy_config",
    "score_centering_keys",
    "slime_kl",
    "tis_config",
    "tis_keys",
]
