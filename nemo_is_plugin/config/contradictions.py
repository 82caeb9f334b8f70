"""The combination checks of a loss config: every contradiction NeMo-RL rejects, plus the plugin's own.

Each message names the fields and the fix. Run by :class:`~nemo_is_plugin.loss.config_model.ClippedPGLossConfig` once
every field is valid (types, choices and numeric ranges are the fields' own, in :mod:`~nemo_is_plugin.config.keys` and
the objectives' key sections). The checks here read the generic keys only (:class:`~nemo_is_plugin.config.keys.
LossKeys`): IS, rejection, aggregation, KL and score centering. The rules every objective shares (required keys,
``ratio_level``, the other objectives' unread keys) are the objective registry's
(:func:`~nemo_is_plugin.loss.objectives.base.objective_contradictions`), and each objective's own are its module's;
the caller passes their messages in, so that the joined message keeps one order.
"""

from __future__ import annotations

import warnings

from nemo_is_plugin.config.keys import REJECTION_TYPES, SEQUENCE_MASK_TYPES, TOKEN_AGGREGATIONS, LossKeys


def contradictions(cfg: LossKeys, objective_messages: list[str]) -> list[str]:
    """Every contradiction NeMo-RL rejects, plus the plugin's own; each message names the fields and the fix.
    ``objective_messages``: the objective registry's checks of the chosen objective (its own refusals, and what
    score centering needs of it), placed after the rejection rules'."""
    out: list[str] = []
    tis = cfg.truncated_importance_sampling_type
    lo, hi = cfg.truncated_importance_sampling_ratio_min, cfg.truncated_importance_sampling_ratio
    gspo = cfg.sequence_level_importance_ratios

    if gspo and cfg.token_level_loss:
        out.append(
            "sequence-level importance sampling (e.g. GSPO) is mutually exclusive with token-level loss: "
            "sequence_level_importance_ratios=true requires token_level_loss: false"
        )
    if tis is not None:
        if tis not in REJECTION_TYPES and not cfg.use_importance_sampling_correction:
            out.append(
                "truncated importance sampling is only supported when use_importance_sampling_correction is True: "
                "set use_importance_sampling_correction: true or truncated_importance_sampling_type: null"
            )
        if hi is None or hi <= 0:
            out.append(
                f"truncated_importance_sampling_ratio should be positive: truncated_importance_sampling_type={tis!r} "
                f"needs truncated_importance_sampling_ratio > 0 (got {hi})"
            )
        if tis in ("icepop", *SEQUENCE_MASK_TYPES) and lo is None:
            out.append(
                f"truncated_importance_sampling_ratio_min should be set when truncated_importance_sampling_type is "
                f"{tis!r}: set the lower bound of the band"
            )
        if lo is not None and hi is not None and lo > hi:
            # NeMo-RL's wording, which its tests match on
            out.append(
                "truncated_importance_sampling_ratio_min must be <= truncated_importance_sampling_ratio "
                f"(got {lo} > {hi}): swap them or lower truncated_importance_sampling_ratio_min"
            )
        if tis == "seq-mask-tis" and gspo and cfg.is_correction_level is None:
            out.append(
                "seq-mask-tis is not supported with sequence_level_importance_ratios=true unless is_correction_level "
                "is set explicitly (token or sequence_mean)"
            )
        if tis == "seq-mask-tis" and cfg.is_correction_level in ("sequence", "cumulative"):
            out.append(
                f"seq-mask-tis masks token weights by the sequence geometric mean; is_correction_level="
                f"{cfg.is_correction_level!r} is not a token-wise weight: use 'token' or 'sequence_mean'"
            )
    elif hi is not None:  # NeMo-RL refuses this at its first call ("Invalid truncated importance sampling type")
        out.append(
            "truncated_importance_sampling_ratio is set but truncated_importance_sampling_type is null: set the type "
            "('tis', 'icepop', ...) or unset truncated_importance_sampling_ratio"
        )
    elif lo is not None:  # NeMo-RL runs with it (and ignores it)
        warnings.warn(
            "truncated_importance_sampling_ratio_min is ignored: truncated_importance_sampling_type is null",
            UserWarning,
            stacklevel=2,
        )

    if cfg.loss_aggregation is not None:
        token_agg = cfg.loss_aggregation in TOKEN_AGGREGATIONS
        if "token_level_loss" in cfg.model_fields_set and token_agg != cfg.token_level_loss:
            out.append(
                f"loss_aggregation={cfg.loss_aggregation!r} contradicts token_level_loss={cfg.token_level_loss}; "
                "set only one of them"
            )
    if cfg.effective_loss_aggregation == "seq-mean-token-sum-norm" and cfg.loss_aggregation_norm is None:
        out.append("loss_aggregation='seq-mean-token-sum-norm' needs loss_aggregation_norm (e.g. max response length)")
    if cfg.loss_aggregation_norm is not None and cfg.effective_loss_aggregation != "seq-mean-token-sum-norm":
        out.append("loss_aggregation_norm is only read by loss_aggregation='seq-mean-token-sum-norm'")

    out.extend(_rejection_contradictions(cfg))
    out.extend(_rule_contradictions(cfg))
    out.extend(objective_messages)
    out.extend(score_centering_contradictions(cfg))
    needs_is = cfg.importance_sampling_batch_normalize or cfg.is_correction_level is not None
    rejects = tis in REJECTION_TYPES or bool(cfg.rejection_rules)
    if needs_is and not cfg.use_importance_sampling_correction and not rejects:
        which = "is_correction_level" if cfg.is_correction_level is not None else "importance_sampling_batch_normalize"
        out.append(f"{which} has no effect without use_importance_sampling_correction=true; enable it or unset {which}")
    if cfg.reference_policy_kl_gradient == "k2" and cfg.effective_kl_penalty == 0:
        out.append("reference_policy_kl_gradient='k2' needs a non-zero reference_policy_kl_penalty in the loss")
    return out


def _rejection_contradictions(cfg: LossKeys) -> list[str]:
    rej = cfg.importance_sampling_rejection
    lo, hi = cfg.importance_sampling_rejection_min, cfg.importance_sampling_rejection_max
    if rej is None:
        if lo is not None or hi is not None:
            return [
                "importance_sampling_rejection_min and importance_sampling_rejection_max are only read with "
                "importance_sampling_rejection, which is null: set it to 'seq-mis' or 'geo-rs', or unset them"
            ]
        return []
    out = []
    if lo is None or hi is None:
        out.append(
            f"importance_sampling_rejection={rej!r} needs importance_sampling_rejection_min and "
            "importance_sampling_rejection_max (verl presets: seq-mis 0.5 and 2.0, geo-rs 0.999 and 1.001)"
        )
    elif lo > hi:
        out.append(f"importance_sampling_rejection_min={lo} must be <= importance_sampling_rejection_max={hi}")
    tis = cfg.truncated_importance_sampling_type
    if tis in SEQUENCE_MASK_TYPES:
        out.append(
            f"truncated_importance_sampling_type={tis!r} already masks whole sequences: combine "
            "importance_sampling_rejection with 'tis', 'icepop' or null, or use a single sequence rule"
        )
    return out


def _rule_contradictions(cfg: LossKeys) -> list[str]:
    out = []
    names = [rule.name for rule in cfg.rejection_rules]
    for name in sorted({n for n in names if names.count(n) > 1}):
        shorthand = (
            " (importance_sampling_rejection is one)"
            if any(r.name == name for r in cfg.rejection_rules[:1]) and cfg.importance_sampling_rejection
            else ""
        )
        out.append(f"two rejection rules on {name}{shorthand}: merge their bounds into one rule")
    return out


def score_centering_contradictions(cfg: LossKeys) -> list[str]:
    """What ``score_centering`` composes with (docs/config.md, *Score centering*): the term subtracts the sampler's
    expected f-weighted score of one token, f = the token IS weight's truncation as a function of p_v / q_v, so every
    setting whose weight of the sampled token's score is not such an f of that token alone is refused. What the
    policy objective's own weight allows is the objective's (``PolicyObjective.score_centering_refusals``)."""
    if not cfg.score_centering:
        keys = ("score_centering_top_k", "score_centering_tail_floor")
        unread = [k for k in keys if getattr(cfg, k) != type(cfg).model_fields[k].default]
        return [f"{k} is read with score_centering: true only: set score_centering or unset {k}" for k in unread]
    why = "score_centering"
    out = []
    if cfg.effective_ratio_level != "token":
        out.append(
            f"{why} subtracts one token's expected score; ratio_level={cfg.effective_ratio_level!r} (GSPO / CTPO) "
            "weights it by a ratio of the whole sequence or prefix: use ratio_level: token"
        )
    if cfg.use_importance_sampling_correction and cfg.effective_is_level != "token":
        out.append(
            f"{why}'s f is a function of one token's ratio p_v/q_v; is_correction_level={cfg.effective_is_level!r} "
            "weights a token by the other tokens' ratios, which the head cannot evaluate: use is_correction_level: "
            "token"
        )
    tis = cfg.truncated_importance_sampling_type
    if cfg.use_importance_sampling_correction and tis is None:
        out.append(
            f"{why} with untruncated IS weights has f(r) = r, whose centring coefficients are exactly 0 (the IS "
            "weight removes the drift itself): add truncated_importance_sampling_type 'tis' or 'icepop', or set "
            "use_importance_sampling_correction: false (f = 1)"
        )
    masks = [
        name
        for name, on in (
            (f"truncated_importance_sampling_type={tis!r}", tis in SEQUENCE_MASK_TYPES),
            ("importance_sampling_rejection", cfg.importance_sampling_rejection is not None),
            ("importance_sampling_rejection_rules", bool(cfg.importance_sampling_rejection_rules)),
            ("importance_sampling_veto_threshold", cfg.importance_sampling_veto_threshold is not None),
        )
        if on
    ]
    if masks:
        out.append(
            f"{why} with {', '.join(masks)}: a rejection reads the sampled token itself (and its sequence), so the "
            "score it keeps is not f(p/q) of that token and the centred gradient is not zero-mean (miles and "
            "vime refuse it too; verl runs it): use 'tis' or 'icepop'"
        )
    return out
