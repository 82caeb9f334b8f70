"""verl's ``policy_loss.loss_mode`` names -> the plugin's objective keys (needs neither verl nor torch).

verl selects the plugin with ``loss_mode=nemo_is.clipped_pg``; which of verl's losses the plugin then computes is the
plugin section's ``loss_mode`` (``policy_loss.nemo_is.loss_mode``, verl's vocabulary, default ``vanilla``), read
with the same actor settings verl's own loss reads (verl 0.9.1, ``verl/trainer/ppo/core_algos.py``):

=========== ============================================ ==========================================================
verl mode   plugin keys                                  from verl's settings
=========== ============================================ ==========================================================
vanilla     PPO clip                                     clip_ratio_low/high (else clip_ratio), clip_ratio_c
gspo        ratio_level sequence_token, log r <= 10      clip_ratio_low/high; no token clamp, no dual clip
cispo       use_cispo                                    clip_ratio_low/high
dppo_tv/kl  policy_objective dppo_tv / dppo_kl           dppo_delta_low/high = clip_ratio_low/high, dppo_ratio_cap =
                                                         clip_ratio_c (verl: config.get("clip_ratio_c", 20.0); an
                                                         ActorConfig always has it, default 3.0)
sapo        policy_objective sapo                        sapo_tau_pos/neg = tau_pos/neg; seq-mean-token-mean forced
geo_mean    policy_objective gmpo                        gmpo_clip_low/high = clip_ratio_low/high; seq-mean-token-mean
gpg         policy_objective gpg                         —
dro         policy_objective dro                         dro_beta = policy_loss.dro_beta (required)
=========== ============================================ ==========================================================

``clip_cov`` / ``kl_cov`` are refused (docs/objectives.md): the tokens they treat differently are chosen per
micro-batch, so the loss changes with micro-batching, DP and CP, and Clip-Cov draws them from torch's global RNG.
verl forces ``seq-mean-token-mean`` for ``sapo`` and ``geo_mean`` whatever ``loss_agg_mode`` says; the plugin does not
override a setting silently, so another ``loss_agg_mode`` is refused with the fix. ``cispo`` keeps NeMo-RL's rule
that CISPO is token-level: a ``seq-mean-*`` aggregation is refused.
"""

from __future__ import annotations

from typing import Any

from nemo_is_plugin.adapters.verl.fields import VerlConfigError, verl_field

VERL_LOSS_MODES = ("vanilla", "gspo", "cispo", "dppo_tv", "dppo_kl", "sapo", "geo_mean", "gpg", "dro")
REFUSED_LOSS_MODES = {
    "clip_cov": "it treats a subset of tokens chosen per micro-batch differently (covariance around the micro-batch "
    "means; the subset drawn from torch's global RNG, not reproducible), so the loss changes with micro-batching, DP "
    "and CP",
    "kl_cov": "it penalises the top-k tokens of the micro-batch by covariance around the micro-batch means, so the "
    "loss changes with micro-batching, DP and CP",
}
FORCED_AGGREGATION = {"sapo": "seq-mean-token-mean", "geo_mean": "seq-mean-token-mean"}
VERL_DPPO_DEFAULT_CAP = 20.0  # verl's DPPO losses: config.get("clip_ratio_c", 20.0)
VERL_GSPO_MAX_LOG_RATIO = 10.0  # verl's GSPO caps the combined sequence log-ratio at 10
# PPO clip keys that actor_keys sets for vanilla; the other modes carry their own trust region instead.
PPO_CLIP_KEYS = ("ratio_clip_min", "ratio_clip_max", "ratio_clip_c")
# The verl keys each mode reads beyond the clip ratios (they are refused as unused under the other modes).
MODE_READS = {"sapo": ("tau_pos", "tau_neg"), "dro": ("dro_beta",)}


def check_loss_mode(loss_mode: str, loss_agg_mode: str) -> None:
    """Refuse a mode the plugin does not compute, and an aggregation verl would override for it."""
    if loss_mode in REFUSED_LOSS_MODES:
        raise VerlConfigError(
            f"loss_mode={loss_mode!r} is refused: {REFUSED_LOSS_MODES[loss_mode]}; use one of "
            f"{', '.join(VERL_LOSS_MODES)}"
        )
    if loss_mode not in VERL_LOSS_MODES:
        raise VerlConfigError(f"loss_mode={loss_mode!r} is not one of verl's: {', '.join(VERL_LOSS_MODES)}")
    if loss_mode == "cispo" and loss_agg_mode not in ("token-mean", "token-sum"):
        raise VerlConfigError(
            f"loss_mode='cispo' with loss_agg_mode={loss_agg_mode!r}: the plugin's CISPO (use_cispo) keeps NeMo-RL's "
            "rule that CISPO is token-level; set actor_rollout_ref.actor.loss_agg_mode=token-mean"
        )
    forced = FORCED_AGGREGATION.get(loss_mode)
    if forced is not None and loss_agg_mode != forced:
        raise VerlConfigError(
            f"verl's {loss_mode!r} loss uses {forced} whatever loss_agg_mode says; the plugin does not override "
            f"loss_agg_mode={loss_agg_mode!r} silently: set actor_rollout_ref.actor.loss_agg_mode={forced}"
        )


def loss_mode_keys(actor: Any, loss_mode: str) -> dict[str, Any]:
    """The plugin keys of verl's ``loss_mode`` with the actor's settings (module table)."""
    clip = verl_field(actor, "clip_ratio", 0.2)
    low, high = verl_field(actor, "clip_ratio_low", clip), verl_field(actor, "clip_ratio_high", clip)
    if loss_mode == "vanilla":
        return {"ratio_clip_min": low, "ratio_clip_max": high, "ratio_clip_c": verl_field(actor, "clip_ratio_c", 3.0)}
    if loss_mode == "gspo":
        return {
            "ratio_clip_min": low,
            "ratio_clip_max": high,
            "ratio_level": "sequence_token",
            "max_log_ratio": VERL_GSPO_MAX_LOG_RATIO,
            "token_log_ratio_clamp": None,
        }
    if loss_mode == "cispo":
        return {"ratio_clip_min": low, "ratio_clip_max": high, "use_cispo": True}
    if loss_mode in ("dppo_tv", "dppo_kl"):
        return {
            "policy_objective": loss_mode,
            "dppo_delta_low": low,
            "dppo_delta_high": high,
            "dppo_ratio_cap": verl_field(actor, "clip_ratio_c", VERL_DPPO_DEFAULT_CAP),
        }
    if loss_mode == "sapo":
        return {
            "policy_objective": "sapo",
            "sapo_tau_pos": verl_field(actor, "tau_pos", 1.0),
            "sapo_tau_neg": verl_field(actor, "tau_neg", 1.05),
        }
    if loss_mode == "geo_mean":
        return {"policy_objective": "gmpo", "gmpo_clip_low": low, "gmpo_clip_high": high}
    if loss_mode == "gpg":
        return {"policy_objective": "gpg"}
    if loss_mode == "dro":
        beta = verl_field(verl_field(actor, "policy_loss"), "dro_beta")
        if beta is None:
            raise VerlConfigError("verl's 'dro' loss needs actor_rollout_ref.actor.policy_loss.dro_beta (> 0)")
        return {"policy_objective": "dro", "dro_beta": beta}
    raise VerlConfigError(f"loss_mode={loss_mode!r} is not one of verl's: {', '.join(VERL_LOSS_MODES)}")


# verl's pg_clipfrac / pg_clipfrac_lower in the plugin's metric names, where a mode defines them differently from
# vanilla's (clip_fraction / clip_fraction_dual): geo_mean counts its clip by advantage sign.
VERL_CLIPFRAC_METRICS = {"gmpo": ("clip_fraction_high", "clip_fraction_low")}
VERL_METRIC_NAMES = ("actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower")
# What each of verl 0.9.1's losses returns besides the loss (core_algos.py): its actor/ metric names, and whether its
# ppo_kl = mean(log pi_old - log pi) clamps each token's log-ratio to +-20 first. vanilla, cispo, dppo_* and sapo clamp
# (the ratio they exponentiate is clamped); gspo, geo_mean and dro average the raw log-ratio; gpg returns no metric.
VERL_MODE_METRICS: dict[str, tuple[tuple[str, ...], bool]] = {
    "vanilla": (VERL_METRIC_NAMES, True),
    "cispo": (VERL_METRIC_NAMES, True),
    "dppo_tv": (VERL_METRIC_NAMES, True),
    "dppo_kl": (VERL_METRIC_NAMES, True),
    "sapo": (VERL_METRIC_NAMES, True),
    "gspo": (VERL_METRIC_NAMES, False),
    "geo_mean": (VERL_METRIC_NAMES, False),
    "dro": (("actor/ppo_kl",), False),
    "gpg": ((), False),
}
# verl's geo_mean ends with torch.mean over the micro-batch's rows (empty rows included) and reads no
# global_batch_info; every other mode divides by the rows with tokens (agg_loss) when no global count is given.
VERL_ALL_ROWS_OBJECTIVES = ("gmpo",)


def verl_loss_mode_of(config: Any) -> str | None:
    """The verl ``loss_mode`` a resolved plugin config computes (the module table read backwards), whether it was named
    by ``loss_mode`` or spelled in the plugin's keys; None for a config no verl mode computes (e.g. a cumulative ratio),
    whose verl metrics then follow ``vanilla``."""
    objective = config.policy_objective
    if objective == "gmpo":
        return "geo_mean"
    if objective in ("dppo_tv", "dppo_kl", "sapo", "gpg", "dro"):
        return str(objective)
    if objective != "ppo_clip":
        return None
    if config.use_cispo:
        return "cispo"
    return {"token": "vanilla", "sequence_token": "gspo"}.get(config.effective_ratio_level)


__all__ = [
    "FORCED_AGGREGATION",
    "MODE_READS",
    "PPO_CLIP_KEYS",
    "REFUSED_LOSS_MODES",
    "VERL_CLIPFRAC_METRICS",
    "VERL_DPPO_DEFAULT_CAP",
    "VERL_ALL_ROWS_OBJECTIVES",
    "VERL_GSPO_MAX_LOG_RATIO",
    "VERL_LOSS_MODES",
    "VERL_METRIC_NAMES",
    "VERL_MODE_METRICS",
    "check_loss_mode",
    "loss_mode_keys",
    "verl_loss_mode_of",
]
