"""ClippedPGLoss: the policy-gradient loss, composed from independent pieces chosen by :class:`ClippedPGLossConfig`.

    loss = aggregate( w_t * surrogate(r_t, A_t) )  +  beta * aggregate( KL_t )  +  mu * NLL(positive samples)

r_t: policy ratio at ``ratio_level`` (ratios.py), clipped in ratio or log space (surrogate.py), or instead of PPO's
clip the ``policy_objective``'s trust mask / gate / sequence objective (objective_dispatch.py, docs/objectives.md);
w_t: IS correction at ``is_correction_level`` with truncation / masking / rejection (correction.py);
KL_t: k1/k2/k3 to the reference policy (kl.py), on NeMo-RL's unfiltered current log-probs when the batch holds
``curr_logprobs_unfiltered`` (top-k / top-p training); aggregate: token or sequence means over global counts
(aggregation.py).

With every plugin field unset this reproduces NeMo-RL's ClippedPGLossFn (commit 7ea279ab): loss, gradient and metrics.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from nemo_is_plugin.config import ClippedPGLossConfig, ConfigError, load_loss_config
from nemo_is_plugin.loss.aggregation import aggregate
from nemo_is_plugin.loss.aligned_inputs import TOKEN_KEYS as TOKEN_KEYS  # re-exported: distributed/ imports it here
from nemo_is_plugin.loss.aligned_inputs import LossInputs, align_nemo_rl_inputs
from nemo_is_plugin.loss.correction import ISCorrection, ISCorrectionOptions, compute_is_correction
from nemo_is_plugin.loss.input_validation import (
    check_finite_loss,
    input_anomalies,
    required_input,
    warn_input_anomalies,
)
from nemo_is_plugin.loss.is_weights import exp_or_zero
from nemo_is_plugin.loss.kl import kl_penalty, score_function_weight
from nemo_is_plugin.loss.layout import TokenLayout
from nemo_is_plugin.loss.masked import EPS, where_mask
from nemo_is_plugin.loss.metrics import (
    Denominator,
    MetricBook,
    MetricValues,
    aggregation_denominator,
    legacy_error_metrics,
)
from nemo_is_plugin.loss.objective_dispatch import objective_surrogate, report_objective
from nemo_is_plugin.loss.ratios import policy_log_ratio, unmasked_positions
from nemo_is_plugin.loss.registry import NAME_KEY, get_loss, split_name
from nemo_is_plugin.loss.surrogate import (
    SurrogateOut,
    cispo_surrogate,
    log_space_clip_surrogate,
    on_policy_surrogate,
    ratio_clip_surrogate,
    reinforce_surrogate,
)


class ClippedPGLoss:
    """Clipped policy-gradient loss with independent ratio level, IS correction, clip space, KL and aggregation.

    Called like NeMo-RL's ClippedPGLossFn: ``loss, metrics = loss_fn(next_token_logprobs=[B, S-1], data=mapping of
    [B, S] tensors, global_valid_seqs=N_seq, global_valid_toks=N_tok)``. Picklable (holds only its config).
    """

    def __init__(self, config: ClippedPGLossConfig | Mapping[str, Any]):
        if isinstance(config, Mapping):
            config = own_section(config, type(self))
        self.config = load_loss_config(config)

    # ------------------------------------------------------------------ NeMo-RL entry point
    def __call__(
        self,
        next_token_logprobs: torch.Tensor,
        data: Mapping[str, torch.Tensor],
        global_valid_seqs: torch.Tensor | float,
        global_valid_toks: torch.Tensor | float,
        *,
        layout: TokenLayout | None = None,
        **_: Any,
    ) -> tuple[torch.Tensor, MetricValues]:
        return self.compute(*self.prepare(next_token_logprobs, data, global_valid_seqs, global_valid_toks, layout))

    def prepare(
        self,
        next_token_logprobs: torch.Tensor,
        data: Mapping[str, torch.Tensor],
        global_valid_seqs: torch.Tensor | float,
        global_valid_toks: torch.Tensor | float,
        layout: TokenLayout | None = None,
    ) -> tuple[LossInputs, TokenLayout]:
        """Validate a NeMo-RL call's arguments and align them: ``[B, S]`` data -> ``[B, S-1]`` token tensors
        (:func:`~nemo_is_plugin.loss.aligned_inputs.align_nemo_rl_inputs`)."""
        return align_nemo_rl_inputs(
            self.config, next_token_logprobs, data, global_valid_seqs, global_valid_toks, layout
        )

    # ------------------------------------------------------------------ the loss on aligned token tensors
    def compute(
        self,
        inputs: LossInputs,
        layout: TokenLayout,
        *,
        is_correction: ISCorrection | None = None,
        extra_metric_sums: Mapping[str, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, MetricValues]:
        """The loss and metrics of aligned token tensors.

        ``is_correction``: the IS correction of these inputs when the caller computed it already (the fused single pass
        builds its gradient with it); else computed here. ``extra_metric_sums``: more 0-d additive metric shares (a
        caller's own, reduced over CP like the loss's) to report with the loss's metrics, in the same single host
        synchronisation; their denominator is NONE (the caller rescales its own metrics)."""
        cfg = self.config
        c_in = inputs.curr_logprobs
        # Half-precision log-probs are upcast: the ratio / exp arithmetic needs fp32 (gradients flow back through it).
        dtype = torch.float32 if c_in.dtype in (torch.float16, torch.bfloat16) else c_in.dtype
        c = c_in.to(dtype)

        def as_f(t: torch.Tensor) -> torch.Tensor:
            return t.detach().to(dtype)

        tm, sm = inputs.token_mask.to(dtype), inputs.sample_mask.to(dtype)
        valid = tm * layout.to_tokens(sm)
        adv = as_f(inputs.advantages)
        g = as_f(inputs.generation_logprobs)
        if cfg.force_on_policy_ratio:
            p = c.detach()
        elif cfg.bypasses_prev:
            p = g
        else:
            p = as_f(required_input(inputs.prev_logprobs, "prev_logprobs"))
        # What the IS weights, rejections and mismatch diagnostics compare with mu: pi_old, or in bypass mode (pi_old =
        # mu) the current policy, detached, as verl's bypass mode does.
        p_is = c.detach() if cfg.bypasses_prev else p
        n_tok = _as_scalar(inputs.global_valid_toks, dtype, c.device)
        n_seq = _as_scalar(inputs.global_valid_seqs, dtype, c.device)
        agg = cfg.effective_loss_aggregation

        def reduce(x: torch.Tensor) -> torch.Tensor:
            return aggregate(
                x,
                tm,
                sm,
                layout,
                mode=agg,
                global_valid_toks=n_tok,
                global_valid_seqs=n_seq,
                norm=cfg.loss_aggregation_norm,
            )

        book = MetricBook(layout, valid, n_tok, n_seq)

        # 1. Mismatch diagnostics NeMo-RL reports (no grad).
        legacy_error_metrics(book, p_is, g, valid, cfg.reference_policy_kl_type)

        # 2. KL to the reference policy, on the unfiltered log-probs under top-k / top-p (NeMo-RL: the reference's are
        # unfiltered too). beta multiplies each token before the reduction and the metric divides it out again, in
        # NeMo-RL's order, so that kl_penalty carries NeMo-RL's exact value.
        beta = cfg.effective_kl_penalty
        kl_loss = torch.zeros((), dtype=dtype, device=c.device)
        if beta != 0:
            c_kl = c if inputs.curr_logprobs_unfiltered is None else inputs.curr_logprobs_unfiltered.to(dtype)
            ref = as_f(required_input(inputs.reference_logprobs, "reference_policy_logprobs"))
            kl_loss = reduce(beta * self.kl_tokens(c_kl, g, ref))
        loss_per = aggregation_denominator(agg)
        book.add_sum("kl_penalty", kl_loss.detach().double() / beta if beta != 0 else kl_loss.detach(), loss_per)

        # 3. Policy ratio and surrogate. n_t (1-based position among unmasked tokens) serves the log-space clip and
        # the clip-rate-by-position metrics.
        positions = unmasked_positions(tm, layout)
        objective = None
        if cfg.policy_objective == "ppo_clip":
            sur = self.surrogate(c, ratio_anchor(p, c, valid), adv, tm, layout, positions)
        else:  # a trust mask, gate or sequence objective instead of PPO's clip (objective_dispatch.py)
            objective = objective_surrogate(cfg, c, ratio_anchor(p, c, valid), adv, tm, layout)
            sur = objective.surrogate

        # 4. IS correction.
        trunc = cfg.truncated_importance_sampling_type
        corr = is_correction
        if corr is None:
            corr = compute_is_correction(p_is, g, tm, valid, layout, **is_correction_kwargs(cfg))

        # 5. Actor loss.
        actor_loss = reduce(corr.weights * sur.loss)

        # 6. Positive-example NLL (VAPO): mean over tokens of samples with reward > 0, local count. As in NeMo-RL the
        # term exists only for a positive weight and a batch with rewards.
        nll = torch.zeros((), dtype=dtype, device=c.device)
        mu = cfg.positive_example_nll_weight
        if mu > 0 and inputs.rewards is not None:
            pos, count = positive_sample_tokens(inputs.rewards, valid, layout)
            # Without positive tokens the sum is an exact 0 (and its gradient too): no host-side test of the count.
            nll = where_mask(-c, pos).sum() / (count.to(dtype) + EPS)
        loss = actor_loss + kl_loss + mu * nll

        # 7. Metrics.
        book.add_sum("loss", loss.detach(), loss_per)
        book.policy_ratio(sur)
        # NeMo-RL reports the truncated weights even when the correction is not applied to the loss.
        w_metric = corr.weights if cfg.use_importance_sampling_correction else corr.raw_weights
        book.importance_weights(
            corr,
            w_metric,
            trunc,
            sample_mask=sm,
            legacy_gspo=cfg.sequence_level_importance_ratios and cfg.is_correction_level is None,
        )
        book.add_replicated_scalar("num_valid_samples", sm.sum().double(), Denominator.NONE)
        # NeMo-RL's value, including its inf when exp(c - g) overflows; a certain token (c = 0)
        # contributes 0 rather than inf * 0 = NaN.
        cd = c.detach()
        ent_tok = torch.where(cd == 0, torch.zeros_like(cd), torch.exp(cd - g) * cd)
        ent = -where_mask(ent_tok, valid).sum() / (n_tok + EPS)
        book.add_sum("approx_entropy", ent, Denominator.TOKENS)
        book.add_sum("positive_nll_loss", nll.detach(), Denominator.NONE)  # a mean over a local count
        book.rejection_rules(corr, sm)
        # What the tolerant input mode computed as given (see input_validation.py); the plugin's own mismatch metrics
        # skip tokens whose generation log-prob is not finite (NeMo-RL's names above keep NeMo-RL's inf / NaN).
        nonfinite, positive = input_anomalies(
            valid,
            inputs.generation_logprobs,
            {
                "curr": c_in,
                "unfiltered": inputs.curr_logprobs_unfiltered if beta != 0 else None,
                "prev": None if cfg.force_on_policy_ratio or cfg.bypasses_prev else inputs.prev_logprobs,
                "generation": inputs.generation_logprobs,
                "reference": inputs.reference_logprobs if beta != 0 else None,
            },
        )
        book.token_mean("input_nonfinite_generation_fraction", nonfinite)
        book.token_mean("input_positive_logprob_fraction", positive)
        book.mismatch(p_is, g, tm * torch.isfinite(g).to(dtype), sm)
        book.clip_by_position(sur, positions)
        if objective is not None:
            report_objective(book, objective, sm)
        for name, value in (extra_metric_sums or {}).items():
            book.add_sum(name, value, Denominator.NONE)
        metrics = book.finish()
        if c.device.type != "meta":  # a shape-only trace has no values
            anchor = "generation_logprobs" if cfg.bypasses_prev else "prev_logprobs"
            check_finite_loss(metrics, c, p, valid, anchor, ratio_has_gradient=differentiates_ratio(cfg))
        warn_input_anomalies(metrics)
        return loss, metrics

    def metric_denominators(self) -> dict[str, Denominator]:
        """Metric name -> the global count it is divided by, for this config, as each metric declares it where it is
        emitted: the loss traced on one-token meta tensors (shapes only: no data, no computation, no host sync). The
        names and their denominators depend on the config alone."""
        meta = torch.empty(1, 1, device="meta")  # one token of one sequence; every input may be the same tensor
        inputs = LossInputs(meta, meta, meta, meta, meta, meta, meta[0], 1.0, 1.0, rewards=meta[0])
        _, metrics = self.compute(inputs, TokenLayout.padded(1, 1, device=meta.device))
        return metrics.denominators

    def kl_tokens(self, c: torch.Tensor, g: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
        """Per-token KL penalty to the reference policy (before aggregation and beta); token-wise in ``c``."""
        cfg = self.config
        w_kl = exp_or_zero(c - g) if cfg.use_on_policy_kl_approximation else score_function_weight(c)
        return kl_penalty(
            c,
            ref,
            kl_type=cfg.reference_policy_kl_type,
            input_clamp=cfg.kl_input_clamp_value,
            output_clamp=cfg.kl_output_clamp_value,
            weights=w_kl,
            straight_through_k2=cfg.reference_policy_kl_gradient == "k2",
        )

    def surrogate(
        self,
        c: torch.Tensor,
        p: torch.Tensor,
        adv: torch.Tensor,
        tm: torch.Tensor,
        layout: TokenLayout,
        positions: torch.Tensor,
    ) -> SurrogateOut:
        """The per-token surrogate (:class:`~nemo_is_plugin.loss.surrogate.SurrogateOut`) of the configured ratio and
        clip, or of the configured ``policy_objective``; ``p`` is the anchor (``ratio_anchor``)."""
        cfg = self.config
        if cfg.policy_objective != "ppo_clip":
            return objective_surrogate(cfg, c, p, adv, tm, layout).surrogate
        # NeMo-RL tests force_on_policy_ratio first: with disable_ppo_ratio as well, the ratio is still exp(c - sg c).
        if cfg.force_on_policy_ratio and not cfg.uses_log_space_clip:
            return on_policy_surrogate(c, adv, dual_clip=cfg.ratio_clip_c)
        if cfg.disable_ppo_ratio:
            return reinforce_surrogate(c, adv, dual_clip=cfg.ratio_clip_c)
        if cfg.force_on_policy_ratio:
            log_r = c - c.detach()
        else:
            log_r = policy_log_ratio(
                cfg.effective_ratio_level,
                c,
                p,
                tm,
                layout,
                token_clamp=cfg.token_log_ratio_clamp,
                max_log_ratio=cfg.max_log_ratio,
            )
        return self.clipped_surrogate(log_r, c, adv, positions)

    def clipped_surrogate(
        self, log_r: torch.Tensor, c: torch.Tensor, adv: torch.Tensor, positions: torch.Tensor
    ) -> SurrogateOut:
        """The configured clip (ratio space, log space or CISPO) of a policy log-ratio ``log_r``; all Float[*T]."""
        cfg = self.config
        if cfg.use_cispo:
            return cispo_surrogate(log_r, c, adv, clip_low=cfg.ratio_clip_min, clip_high=cfg.ratio_clip_max)
        if cfg.uses_log_space_clip:
            eps_low, eps_high = cfg.log_ratio_clip_bounds
            return log_space_clip_surrogate(
                log_r,
                adv,
                positions,
                eps_low=eps_low,
                eps_high=eps_high,
                eps_c=cfg.log_ratio_clip_c,
                power=cfg.clip_position_power,
            )
        return ratio_clip_surrogate(
            log_r, adv, clip_low=cfg.ratio_clip_min, clip_high=cfg.ratio_clip_max, dual_clip=cfg.ratio_clip_c
        )


def is_correction_kwargs(cfg: ClippedPGLossConfig) -> ISCorrectionOptions:
    """The one binding of config fields to :func:`~nemo_is_plugin.loss.correction.compute_is_correction`'s arguments."""
    return ISCorrectionOptions(
        level=cfg.effective_is_level,
        legacy=cfg.is_correction_level is None,
        apply_weights=cfg.use_importance_sampling_correction,
        truncation=cfg.truncated_importance_sampling_type,
        low=cfg.truncated_importance_sampling_ratio_min,
        high=cfg.truncated_importance_sampling_ratio,
        veto_threshold=cfg.importance_sampling_veto_threshold,
        batch_normalize=cfg.importance_sampling_batch_normalize,
        rules=cfg.rejection_rules,
    )


def differentiates_ratio(cfg: ClippedPGLossConfig) -> bool:
    """Whether the surrogate differentiates the policy ratio exp(log r) itself (PPO's clip in ratio or log space), so
    that a ratio that overflows makes its gradient NaN."""
    return cfg.policy_objective == "ppo_clip" and not (
        cfg.use_cispo or cfg.disable_ppo_ratio or cfg.force_on_policy_ratio
    )


def ratio_anchor(prev: torch.Tensor, curr: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """The old log-probs the policy ratio divides by, with ``curr``'s value on tokens that do not count.

    A masked token's ratio is dropped from the loss by a ``where``, whose backward hands it a zero gradient; but a
    masked padding value far below ``curr`` makes ``exp(curr - prev)`` overflow, and ``0 * inf`` is NaN in the
    chain rule. Anchoring masked tokens at ratio 1 keeps their gradient exactly 0 (counted tokens are untouched).
    """
    return torch.where(valid != 0, prev, curr.detach())


def positive_sample_tokens(
    rewards: torch.Tensor, valid: torch.Tensor, layout: TokenLayout
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens of samples with reward > 0 (Float[*T]) and their count over the layout (fp64 0-d; VAPO's NLL)."""
    pos = valid * layout.to_tokens((rewards > 0).to(valid.dtype))
    return pos, layout.reduce_metric_sums(pos.sum().detach().double())


def _as_scalar(x: torch.Tensor | float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.as_tensor(x, dtype=dtype, device=device)


def own_section(section: Mapping[str, Any], cls: type) -> dict[str, Any]:
    """A ``loss_fn`` mapping without its ``name``, which must name ``cls`` in the loss registry.

    The NeMo-RL adapter, ``nemo-is validate`` and this loss accept the same sections: a ``name`` that is not
    registered is refused by all three, and one registered to another loss is refused here (build that loss through
    :func:`nemo_is_plugin.registry.build_loss`).
    """
    if NAME_KEY not in section:
        return dict(section)
    name, rest = split_name(section)
    factory = get_loss(name)  # UnknownLossError (a ConfigError) lists the registered names
    if factory is not cls:
        raise ConfigError(
            f"loss_fn.name={name!r} is registered to {factory!r}, not {cls.__name__}; build it with "
            "nemo_is_plugin.build_loss_fn(section), or remove the name"
        )
    return rest
