"""ClippedPGLoss: the policy-gradient loss, composed from independent pieces chosen by :class:`ClippedPGLossConfig`.

    loss = aggregate( w_t * surrogate(r_t, A_t) )  +  beta * aggregate( KL_t )  +  mu * NLL(positive samples)

surrogate: the ``policy_objective``'s per-token loss (``objectives/``: PPO's clip at any ``ratio_level``, in ratio or
log space, CISPO, or a trust mask, gate or sequence objective, docs/objectives.md); w_t: IS correction at
``is_correction_level`` with truncation / masking / rejection (correction.py); KL_t: k1/k2/k3 to the reference policy
(kl.py), on NeMo-RL's unfiltered current log-probs when the batch holds ``curr_logprobs_unfiltered`` (top-k / top-p
training); aggregate: token or sequence means over global counts (aggregation.py). The per-token terms are computed
once (``terms.loss_terms`` -> ``LossTerms``); :meth:`ClippedPGLoss.reduce` and :meth:`ClippedPGLoss.metrics` read them.

With every plugin field unset this reproduces NeMo-RL's ClippedPGLossFn (commit 7ea279ab): loss, gradient and metrics.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from nemo_is_plugin.config import ConfigError
from nemo_is_plugin.loss.aggregation import aggregate
from nemo_is_plugin.loss.aligned_inputs import TOKEN_KEYS as TOKEN_KEYS  # re-exported: distributed/ imports it here
from nemo_is_plugin.loss.aligned_inputs import TRAINER_HEAD_KEY, LossInputs, align_nemo_rl_inputs
from nemo_is_plugin.loss.config_model import ClippedPGLossConfig, load_loss_config
from nemo_is_plugin.loss.correction import ISCorrection
from nemo_is_plugin.loss.denominator import Denominator
from nemo_is_plugin.loss.layout import TokenLayout
from nemo_is_plugin.loss.masked import EPS, where_mask
from nemo_is_plugin.loss.metrics import (
    MetricBook,
    MetricValues,
    aggregation_denominator,
    nemo_rl_error_metrics,
    nemo_rl_ratios,
)
from nemo_is_plugin.loss.output_checks import check_finite_loss, input_anomalies, warn_input_anomalies
from nemo_is_plugin.loss.registry import NAME_KEY, get_loss, split_name
from nemo_is_plugin.loss.score_centering import ScoreCenteringHead, label_and_head_logprobs, score_centering_metrics
from nemo_is_plugin.loss.terms import LossTerms, TermInputs, loss_terms


def configured_aggregate(
    config: ClippedPGLossConfig,
    x: torch.Tensor,
    token_mask: torch.Tensor,
    sample_mask: torch.Tensor,
    layout: TokenLayout,
    *,
    global_valid_toks: torch.Tensor,
    global_valid_seqs: torch.Tensor,
) -> torch.Tensor:
    """:func:`~nemo_is_plugin.loss.aggregation.aggregate` with the config's mode (``effective_loss_aggregation``) and
    norm (``loss_aggregation_norm``): the one place the aggregation is bound to the config, read by the loss
    (:meth:`ClippedPGLoss.reduce`) and by the fused pass's per-token weights (``separable.aggregation_weights``)."""
    return aggregate(
        x,
        token_mask,
        sample_mask,
        layout,
        mode=config.effective_loss_aggregation,
        global_valid_toks=global_valid_toks,
        global_valid_seqs=global_valid_seqs,
        norm=config.loss_aggregation_norm,
    )


def positive_nll(t: TermInputs, curr: torch.Tensor) -> torch.Tensor:
    """The positive-sample NLL before its weight: -sum_t q_t c_t, q_t = nll_tokens_t / (nll_count + 1e-8) (a mean
    over the positive samples' tokens, local count); an exact 0 without the term. Its derivative is
    :func:`positive_nll_gradient`, which the fused pass adds chunk by chunk."""
    if t.nll_tokens is None or t.nll_count is None:
        return torch.zeros((), dtype=curr.dtype, device=curr.device)
    # Without positive tokens the sum is an exact 0 (and its gradient too): no host-side test of the count.
    return where_mask(-curr, t.nll_tokens).sum() / (t.nll_count.to(curr.dtype) + EPS)


def positive_nll_gradient(t: TermInputs, sl: slice, dtype: torch.dtype) -> torch.Tensor | None:
    """d positive_nll / d c of the tokens ``sl``: -q_t (the NLL is linear in c); None without the term. No positive
    sample: the tokens are all 0 and so is q (the loss drops the term): no branch, no sync."""
    if t.nll_tokens is None or t.nll_count is None:
        return None
    return -(t.nll_tokens[sl] / (t.nll_count.to(dtype) + EPS))


@dataclass
class LossParts:
    """The loss of one call and its parts (0-d tensors): the IS-weighted policy term, the KL term (beta included),
    the positive-sample NLL (before its weight), the score-centering term (0 without it)."""

    loss: torch.Tensor
    actor: torch.Tensor
    kl: torch.Tensor
    nll: torch.Tensor
    centering: torch.Tensor | None = None


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
        logits: torch.Tensor | None = None,
        **_: Any,
    ) -> tuple[torch.Tensor, MetricValues]:
        """``logits``: ``[B, S, V]`` (temperature-scaled) instead of ``next_token_logprobs`` (pass None): the label
        log-probs (``data['input_ids'][:, 1:]``) and, with ``score_centering``, the head's (``curr_topk_logprobs``)
        come from one log-softmax of ``logits[:, :-1]``."""
        if logits is not None:
            next_token_logprobs, data = self._logprobs_from_logits(next_token_logprobs, logits, data)
        return self.compute(*self.prepare(next_token_logprobs, data, global_valid_seqs, global_valid_toks, layout))

    def _logprobs_from_logits(
        self, next_token_logprobs: torch.Tensor | None, logits: torch.Tensor, data: Mapping[str, torch.Tensor]
    ) -> tuple[torch.Tensor, Mapping[str, torch.Tensor]]:
        if next_token_logprobs is not None:
            raise ValueError("pass next_token_logprobs or logits, not both (logits: the loss computes the log-probs)")
        if "input_ids" not in data:
            raise KeyError("logits given: data needs 'input_ids' [B, S] (the labels are input_ids[:, 1:])")
        labels = data["input_ids"][:, 1:]
        if not self.config.score_centering:
            return label_and_head_logprobs(logits[:, :-1], labels, labels.unsqueeze(-1))[0], data
        if "rollout_topk_ids" not in data:
            raise KeyError("score_centering: true needs data['rollout_topk_ids'] [B, S, k] (the sampler's head ids)")
        label, trainer_head = label_and_head_logprobs(logits[:, :-1], labels, data["rollout_topk_ids"][:, 1:])
        return label, {**data, TRAINER_HEAD_KEY: trainer_head}

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
        """The loss and metrics of aligned token tensors: :meth:`terms`, :meth:`reduce`, :meth:`metrics`.

        ``is_correction``: the IS correction of these inputs when the caller computed it already (the fused single pass
        builds its gradient with it); else computed here. ``extra_metric_sums``: more 0-d additive metric shares (a
        caller's own, reduced over CP like the loss's) to report with the loss's metrics, in the same single host
        synchronisation; their denominator is NONE (the caller rescales its own metrics)."""
        terms = self.terms(inputs, layout, correction=is_correction)
        parts = self.reduce(terms)
        metrics, _ = self.metrics(terms, parts, extra_metric_sums=extra_metric_sums)
        return parts.loss, metrics

    def terms(self, inputs: LossInputs, layout: TokenLayout, *, correction: ISCorrection | None = None) -> LossTerms:
        """Every per-token term of this call, computed once (:func:`~nemo_is_plugin.loss.terms.loss_terms`)."""
        return loss_terms(self.config, inputs, layout, correction=correction)

    def reduce(self, terms: LossTerms) -> LossParts:
        """The loss: the configured aggregation of the IS-weighted policy term and of beta times the KL, plus the
        positive-sample NLL (a mean over the positive samples' tokens, local count)."""
        cfg, t, c = self.config, terms.term_inputs, terms.curr

        def reduce(x: torch.Tensor) -> torch.Tensor:
            n_tok, n_seq = terms.n_tok, terms.n_seq
            return configured_aggregate(
                cfg, x, t.token_mask, terms.sample_mask, t.layout, global_valid_toks=n_tok, global_valid_seqs=n_seq
            )

        kl = terms.tokens.kl
        # beta multiplies each token before the reduction (and the metric divides it out again), in NeMo-RL's order,
        # so that kl_penalty carries NeMo-RL's exact value.
        kl_loss = torch.zeros((), dtype=c.dtype, device=c.device) if kl is None else reduce(t.kl_coef * kl)
        actor_loss = reduce(terms.tokens.actor)
        nll = positive_nll(t, c)
        loss = actor_loss + kl_loss + cfg.positive_example_nll_weight * nll
        centering = None
        if terms.tokens.centering is not None:  # the same aggregation (mask, normaliser) as the policy term
            centering = reduce(terms.tokens.centering.term)
            loss = loss + centering
        return LossParts(loss, actor_loss, kl_loss, nll, centering)

    def metrics(
        self,
        terms: LossTerms,
        parts: LossParts,
        *,
        extra_metric_sums: Mapping[str, torch.Tensor] | None = None,
        read_with: Mapping[str, torch.Tensor] | None = None,
    ) -> tuple[MetricValues, dict[str, float]]:
        """The loss's metrics from its terms, read in one host synchronisation; ``read_with``: a caller's own 0-d
        tensors read in the same synchronisation and returned beside the metrics (not among them)."""
        book = self.metric_book(terms, parts, extra_metric_sums=extra_metric_sums)
        return self.checked_metrics(terms, *book.read(*book.stacked(read_with)))

    def metric_book(
        self, terms: LossTerms, parts: LossParts, *, extra_metric_sums: Mapping[str, torch.Tensor] | None = None
    ) -> MetricBook:
        """The loss's metrics as device tensors in a :class:`MetricBook`, not read (no host synchronisation)."""
        cfg, t, src = self.config, terms.term_inputs, terms.loss_inputs
        corr, sur, c_in, g = terms.correction, terms.surrogate, src.curr_logprobs, t.mu
        book = MetricBook(t.layout, t.valid, terms.n_tok, terms.n_seq)
        # NeMo-RL's mismatch diagnostics (no grad).
        nemo_rl_error_metrics(book, terms.is_prev, g, t.valid, cfg.reference_policy_kl_type)
        beta, loss_per = cfg.effective_kl_penalty, aggregation_denominator(cfg.effective_loss_aggregation)
        kl = parts.kl.detach()
        book.add_sum("kl_penalty", kl.double() / beta if beta != 0 else kl, loss_per)
        book.add_sum("loss", parts.loss.detach(), loss_per)
        book.policy_ratio(*nemo_rl_ratios(sur, terms.curr, cfg.objective_switch))
        book.clip_fractions(sur)
        # NeMo-RL reports the truncated weights even when the correction is not applied to the loss.
        w_metric = corr.weights if cfg.use_importance_sampling_correction else corr.raw_weights
        book.importance_weights(
            corr,
            w_metric,
            cfg.truncated_importance_sampling_type,
            sample_mask=terms.sample_mask,
            nemo_rl_gspo_broadcast=cfg.sequence_level_importance_ratios and cfg.is_correction_level is None,
        )
        book.add_replicated_scalar("num_valid_samples", terms.sample_mask.sum().double(), Denominator.NONE)
        # NeMo-RL's value, including its inf when exp(c - g) overflows; a certain token (c = 0)
        # contributes 0 rather than inf * 0 = NaN.
        cd = terms.curr.detach()
        ent_tok = torch.where(cd == 0, torch.zeros_like(cd), torch.exp(cd - g) * cd)
        ent = -where_mask(ent_tok, t.valid).sum() / (terms.n_tok + EPS)
        book.add_sum("approx_entropy", ent, Denominator.TOKENS)
        book.add_sum("positive_nll_loss", parts.nll.detach(), Denominator.NONE)  # a mean over a local count
        book.rejection_rules(corr, terms.sample_mask)
        # What the tolerant input mode computed as given (see output_checks.py); the plugin's own mismatch metrics
        # skip tokens whose generation log-prob is not finite (NeMo-RL's names above keep NeMo-RL's inf / NaN).
        nonfinite, positive = input_anomalies(
            t.valid,
            src.generation_logprobs,
            {
                "curr": c_in,
                "unfiltered": src.curr_logprobs_unfiltered if beta != 0 else None,
                "prev": None if cfg.objective.pi_old_is_current or cfg.bypasses_prev else src.prev_logprobs,
                "generation": src.generation_logprobs,
                "reference": src.reference_logprobs if beta != 0 else None,
            },
        )
        book.token_mean("input_nonfinite_generation_fraction", nonfinite)
        book.token_mean("input_positive_logprob_fraction", positive)
        book.mismatch(terms.is_prev, g, t.token_mask * torch.isfinite(g).to(g.dtype), terms.sample_mask)
        book.clip_by_position(sur, t.positions)
        if terms.tokens.centering is not None and parts.centering is not None:
            assert src.head is not None and src.head.trainer_head is not None  # loss_terms required it
            trainer_head, sc = src.head.trainer_head, terms.tokens.centering
            score_centering_metrics(
                book, sc, parts.centering, loss_per, terms.curr, trainer_head, t.advantages, t.is_weight
            )
        cfg.objective.report(book, terms.tokens.objective, terms.sample_mask)
        for name, value in (extra_metric_sums or {}).items():
            book.add_sum(name, value, Denominator.NONE)
        return book

    def checked_metrics(
        self, terms: LossTerms, metrics: MetricValues, read: dict[str, float]
    ) -> tuple[MetricValues, dict[str, float]]:
        """The metrics read from a :meth:`metric_book` (and the caller's own values ``read``), after the host-side
        checks on them: a non-finite loss refused, the tolerated input anomalies warned about."""
        cfg, t = self.config, terms.term_inputs
        if terms.curr.device.type != "meta":  # a shape-only trace has no values
            anchor = "generation_logprobs" if cfg.bypasses_prev else "prev_logprobs"
            check_finite_loss(
                metrics,
                terms.curr,
                t.pi_old,
                t.valid,
                anchor,
                ratio_has_gradient=cfg.objective.differentiates_ratio(cfg),
            )
        warn_input_anomalies(metrics)
        return metrics, read

    def metric_denominators(self) -> dict[str, Denominator]:
        """Metric name -> the global count it is divided by, for this config, as each metric declares it where it is
        emitted: the loss traced on one-token meta tensors (shapes only: no data, no computation, no host sync). The
        names and their denominators depend on the config alone."""
        meta = torch.empty(1, 1, device="meta")  # one token of one sequence; every input may be the same tensor
        inputs = LossInputs(meta, meta, meta, meta, meta, meta, meta[0], 1.0, 1.0, rewards=meta[0])
        if self.config.score_centering:
            head_ids = torch.empty(1, 1, 1, dtype=torch.long, device="meta")
            inputs.head = ScoreCenteringHead(head_ids, meta.unsqueeze(-1), meta.unsqueeze(-1))
        _, metrics = self.compute(inputs, TokenLayout.padded(1, 1, device=meta.device))
        return metrics.denominators


def own_section(section: Mapping[str, Any], cls: type) -> dict[str, Any]:
    """A ``loss_fn`` mapping without its ``name``, which must name ``cls`` in the loss registry.

    The NeMo-RL adapter, ``nemo-is validate`` and this loss accept the same sections: a ``name`` that is not
    registered is refused by all three, and one registered to another loss is refused here (build that loss through
    :func:`nemo_is_plugin.build_loss_fn`).
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
