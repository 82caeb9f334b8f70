"""verl's ``policy_loss.loss_mode`` names -> the plugin's objective keys (needs neither verl nor torch).

verl selects the plugin with ``loss_mode=nemo_is.clipped_pg``; which of verl's losses the plugin then computes is the
plugin section's ``loss_mode`` (``policy_loss.nemo_is.loss_mode``, verl's vocabulary, default ``vanilla``), read
with the same actor settings verl's own loss reads (verl 0.9.1, ``verl/trainer/ppo/core_algos.py``):

=========== ============================================ ==========================================================
verl mode   plugin keys                                  from verl's settings
=========== ============================================ ==========================================================
vanilla     PPO clip                                     clip_ratio_low/high (else clip_ratio), clip_ratio_c
gspo        ratio_level sequence_token, log r <= 10      clip_ratio_low/high; no token clamp, no dual clip
cispo       policy_objective cispo                       clip_ratio_low/high
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

Each mode is one :class:`VerlMode` in :data:`VERL_MODES`: its plugin keys, the verl fields they read, its forced
aggregation, the ``actor/`` metrics verl's loss of that mode returns, and how a resolved config is recognised as it.
Every table below (and the policy loss's cache key, :func:`verl_mode_settings`) is derived from those records, so a
new mode or a new field of one is written in one place.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from nemo_is_plugin.adapters.verl.fields import VerlConfigError, verl_field

REFUSED_LOSS_MODES = {
    "clip_cov": "it treats a subset of tokens chosen per micro-batch differently (covariance around the micro-batch "
    "means; the subset drawn from torch's global RNG, not reproducible), so the loss changes with micro-batching, DP "
    "and CP",
    "kl_cov": "it penalises the top-k tokens of the micro-batch by covariance around the micro-batch means, so the "
    "loss changes with micro-batching, DP and CP",
}
VERL_DPPO_DEFAULT_CAP = 20.0  # verl's DPPO losses: config.get("clip_ratio_c", 20.0)
VERL_GSPO_MAX_LOG_RATIO = 10.0  # verl's GSPO caps the combined sequence log-ratio at 10
# The clip ratios every mode may read (verl's clip_ratio_low / _high default to clip_ratio).
CLIP_RATIO_FIELDS = ("clip_ratio", "clip_ratio_low", "clip_ratio_high")
VERL_METRIC_NAMES = ("actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower")
# verl's pg_clipfrac / pg_clipfrac_lower in the plugin's metric names (vanilla's definition)
DEFAULT_CLIPFRAC_METRICS = ("clip_fraction", "clip_fraction_dual")

ModeKeys = Callable[[float, float, Mapping[str, Any]], dict[str, Any]]


@dataclass(frozen=True)
class VerlMode:
    """One of verl 0.9.1's policy losses (``verl/trainer/ppo/core_algos.py``) as the plugin computes it.

    name: verl's ``loss_mode``. objective: the plugin objective it computes (the config's ``effective_objective``,
    which its keys name with ``policy_objective``). keys(low, high, reads): the plugin keys,
    from the clip ratios (clip_ratio_low / _high, else clip_ratio, else 0.2) and ``reads``: the values of the verl
    fields the mode reads beyond them (``reads`` here: dotted path from the actor config -> default; a required one has
    default None). forced_aggregation: the aggregation verl's loss uses whatever ``loss_agg_mode`` says.
    metrics / clamped_kl: the ``actor/`` metrics verl's loss returns, and whether its ppo_kl clamps each token's
    log-ratio to +-20 first. clipfrac_metrics: the plugin metrics that are verl's pg_clipfrac / pg_clipfrac_lower.
    weights_level: the ``is_correction_level`` at which the plugin applies verl's own ``rollout_is_weights`` when verl
    owns the correction (weights-only mode): per token, or per sequence as their geometric mean (verl's geo_mean).
    all_rows: verl's loss is a plain mean over the micro-batch's rows (empty ones included) without global counts.
    signature: the resolved config's attributes that tell the mode apart from the others of its objective (the
    reverse map, :func:`verl_loss_mode_of`).
    """

    name: str
    keys: ModeKeys
    objective: str = "ppo_clip"
    reads: Mapping[str, Any] = field(default_factory=dict)
    forced_aggregation: str | None = None
    metrics: tuple[str, ...] = VERL_METRIC_NAMES
    clamped_kl: bool = True
    clipfrac_metrics: tuple[str, str] = DEFAULT_CLIPFRAC_METRICS
    weights_level: str = "token"
    all_rows: bool = False
    signature: tuple[tuple[str, Any], ...] = ()

    def read(self, actor: Any) -> dict[str, Any]:
        """The values of this mode's ``reads`` in the actor config (their defaults where unset)."""
        return {path: _field(actor, path, default) for path, default in self.reads.items()}

    def computes(self, config: Any) -> bool:
        """Whether a resolved plugin config computes this mode."""
        return config.effective_objective == self.objective and all(
            getattr(config, attr) == value for attr, value in self.signature
        )


def _field(actor: Any, path: str, default: Any = None) -> Any:
    *parents, name = path.split(".")
    for parent in parents:
        actor = verl_field(actor, parent)
    return verl_field(actor, name, default)


def _dro_keys(low: float, high: float, reads: Mapping[str, Any]) -> dict[str, Any]:
    beta = reads["policy_loss.dro_beta"]
    if beta is None:
        raise VerlConfigError("verl's 'dro' loss needs actor_rollout_ref.actor.policy_loss.dro_beta (> 0)")
    return {"policy_objective": "dro", "dro_beta": beta}


def _dppo(name: str) -> VerlMode:
    return VerlMode(
        name,
        lambda low, high, r: {
            "policy_objective": name,
            "dppo_delta_low": low,
            "dppo_delta_high": high,
            "dppo_ratio_cap": r["clip_ratio_c"],
        },
        objective=name,
        reads={"clip_ratio_c": VERL_DPPO_DEFAULT_CAP},
    )


VERL_MODES: dict[str, VerlMode] = {
    m.name: m
    for m in (
        VerlMode(
            "vanilla",
            lambda low, high, r: {"ratio_clip_min": low, "ratio_clip_max": high, "ratio_clip_c": r["clip_ratio_c"]},
            reads={"clip_ratio_c": 3.0},
            signature=(("effective_ratio_level", "token"),),
        ),
        VerlMode(
            "gspo",
            lambda low, high, r: {
                "ratio_clip_min": low,
                "ratio_clip_max": high,
                "ratio_level": "sequence_token",
                "max_log_ratio": VERL_GSPO_MAX_LOG_RATIO,
                "token_log_ratio_clamp": None,
            },
            clamped_kl=False,
            signature=(("effective_ratio_level", "sequence_token"),),
        ),
        VerlMode(
            "cispo",
            lambda low, high, r: {"policy_objective": "cispo", "ratio_clip_min": low, "ratio_clip_max": high},
            objective="cispo",
        ),
        _dppo("dppo_tv"),
        _dppo("dppo_kl"),
        VerlMode(
            "sapo",
            lambda low, high, r: {
                "policy_objective": "sapo",
                "sapo_tau_pos": r["tau_pos"],
                "sapo_tau_neg": r["tau_neg"],
            },
            objective="sapo",
            reads={"tau_pos": 1.0, "tau_neg": 1.05},
            forced_aggregation="seq-mean-token-mean",
        ),
        VerlMode(
            "geo_mean",
            lambda low, high, r: {"policy_objective": "gmpo", "gmpo_clip_low": low, "gmpo_clip_high": high},
            objective="gmpo",
            forced_aggregation="seq-mean-token-mean",
            clamped_kl=False,
            clipfrac_metrics=("clip_fraction_high", "clip_fraction_low"),  # geo_mean counts its clip by advantage sign
            weights_level="sequence_mean",  # verl's geo_mean applies its weights per sequence, their geometric mean
            all_rows=True,
        ),
        VerlMode(
            "gpg", lambda low, high, r: {"policy_objective": "gpg"}, objective="gpg", metrics=(), clamped_kl=False
        ),
        VerlMode(
            "dro",
            _dro_keys,
            objective="dro",
            reads={"policy_loss.dro_beta": None},
            metrics=("actor/ppo_kl",),
            clamped_kl=False,
        ),
    )
}

# The tables read elsewhere, derived from VERL_MODES.
VERL_LOSS_MODES = tuple(VERL_MODES)
FORCED_AGGREGATION = {m.name: m.forced_aggregation for m in VERL_MODES.values() if m.forced_aggregation}
# The verl keys each mode reads beyond the clip ratios (they are refused as unused under the other modes).
MODE_READS = {m.name: tuple(p.rsplit(".", 1)[-1] for p in m.reads) for m in VERL_MODES.values() if m.reads}
VERL_MODE_METRICS: dict[str, tuple[tuple[str, ...], bool]] = {
    m.name: (m.metrics, m.clamped_kl) for m in VERL_MODES.values()
}
VERL_CLIPFRAC_METRICS = {
    m.objective: m.clipfrac_metrics for m in VERL_MODES.values() if m.clipfrac_metrics != DEFAULT_CLIPFRAC_METRICS
}
VERL_ALL_ROWS_OBJECTIVES = tuple(m.objective for m in VERL_MODES.values() if m.all_rows)
# objective -> the level of verl's own IS weights under it (weights-only mode); "token" for the others
VERL_WEIGHTS_LEVEL = {m.objective: m.weights_level for m in VERL_MODES.values() if m.weights_level != "token"}


def check_loss_mode(loss_mode: str, loss_agg_mode: str) -> None:
    """Refuse a mode the plugin does not compute, and an aggregation verl would override for it."""
    if loss_mode in REFUSED_LOSS_MODES:
        raise VerlConfigError(
            f"loss_mode={loss_mode!r} is refused: {REFUSED_LOSS_MODES[loss_mode]}; use one of {', '.join(VERL_MODES)}"
        )
    if loss_mode not in VERL_MODES:
        raise VerlConfigError(f"loss_mode={loss_mode!r} is not one of verl's: {', '.join(VERL_MODES)}")
    if loss_mode == "cispo" and loss_agg_mode not in ("token-mean", "token-sum"):
        raise VerlConfigError(
            f"loss_mode='cispo' with loss_agg_mode={loss_agg_mode!r}: the plugin's CISPO (objective cispo) keeps "
            "NeMo-RL's rule that CISPO is token-level; set actor_rollout_ref.actor.loss_agg_mode=token-mean"
        )
    forced = VERL_MODES[loss_mode].forced_aggregation
    if forced is not None and loss_agg_mode != forced:
        raise VerlConfigError(
            f"verl's {loss_mode!r} loss uses {forced} whatever loss_agg_mode says; the plugin does not override "
            f"loss_agg_mode={loss_agg_mode!r} silently: set actor_rollout_ref.actor.loss_agg_mode={forced}"
        )


def loss_mode_keys(actor: Any, loss_mode: str) -> dict[str, Any]:
    """The plugin keys of verl's ``loss_mode`` with the actor's settings (module table)."""
    mode = VERL_MODES.get(loss_mode)
    if mode is None:
        raise VerlConfigError(f"loss_mode={loss_mode!r} is not one of verl's: {', '.join(VERL_MODES)}")
    clip = verl_field(actor, "clip_ratio", 0.2)
    low, high = verl_field(actor, "clip_ratio_low", clip), verl_field(actor, "clip_ratio_high", clip)
    return mode.keys(low, high, mode.read(actor))


def verl_mode_settings(actor: Any) -> tuple[tuple[str, Any], ...]:
    """Every verl field a mode's keys are built from, as set in ``actor`` (unset: None): the clip ratios and each
    mode's ``reads``, read from :data:`VERL_MODES` at call time. Part of the verl policy loss's cache key, so that a
    mode's new field reaches it without a second list."""
    paths = dict.fromkeys(CLIP_RATIO_FIELDS)
    for mode in VERL_MODES.values():
        paths.update(dict.fromkeys(mode.reads))
    return tuple((path, _field(actor, path)) for path in paths)


def verl_mode_of(config: Any) -> VerlMode | None:
    """The verl mode a resolved plugin config computes, whether it was named by ``loss_mode`` or spelled in the
    plugin's keys; None for a config no verl mode computes (e.g. a cumulative ratio)."""
    return next((m for m in VERL_MODES.values() if m.computes(config)), None)


def verl_loss_mode_of(config: Any) -> str | None:
    """The name of :func:`verl_mode_of`; None for a config no verl mode computes, whose verl metrics then follow
    ``vanilla``."""
    mode = verl_mode_of(config)
    return None if mode is None else mode.name


__all__ = [
    "CLIP_RATIO_FIELDS",
    "FORCED_AGGREGATION",
    "MODE_READS",
    "REFUSED_LOSS_MODES",
    "VERL_ALL_ROWS_OBJECTIVES",
    "VERL_CLIPFRAC_METRICS",
    "VERL_DPPO_DEFAULT_CAP",
    "VERL_GSPO_MAX_LOG_RATIO",
    "VERL_LOSS_MODES",
    "VERL_METRIC_NAMES",
    "VERL_MODES",
    "VERL_MODE_METRICS",
    "VERL_WEIGHTS_LEVEL",
    "VerlMode",
    "check_loss_mode",
    "loss_mode_keys",
    "verl_loss_mode_of",
    "verl_mode_of",
    "verl_mode_settings",
]
