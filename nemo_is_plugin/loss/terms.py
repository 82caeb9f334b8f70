"""The per-token terms of one loss call, computed once, into one typed result that the reductions and metrics read.

    x_t = w_t sur_t(c_t)  +  beta kl_t(c_t)          (and the positive-sample NLL term -q_t c_t)

The batch constants (:class:`TermInputs`: which log-probs the ratio divides by, the IS correction ``w`` with its masks,
the advantages, masks and positions, the KL reference) do not depend on the current log-probs ``c`` except through
a stop-gradient; :func:`token_terms` is the one function that turns them and ``c`` into the per-token terms
(:class:`TokenTerms`: the chosen policy objective's surrogate and indicators, the IS-weighted policy term, the KL).
It runs on the whole batch (:func:`loss_terms` -> :class:`LossTerms`, read by ``ClippedPGLoss``'s reductions and
metrics, and by the hosts' adapters) and on the ``[n]`` slices of one chunk (``separable``: the fused single pass
differentiates it chunk by chunk). Hosts name and bind their log-probs differently; each fills one
:class:`~nemo_is_plugin.loss.roles.Roles` record (which log-probs are pi_old, mu, pi_prev, what weights the KL) and
:func:`term_inputs` turns every host's roles into the constants the same way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from nemo_is_plugin.loss.aligned_inputs import LossInputs
from nemo_is_plugin.loss.correction import ISCorrection, ISCorrectionOptions, compute_is_correction
from nemo_is_plugin.loss.input_validation import required_input
from nemo_is_plugin.loss.kl import KLSpec, KLWeight
from nemo_is_plugin.loss.layout import TokenLayout
from nemo_is_plugin.loss.objectives import ObjectiveInputs, ObjectiveOut, SurrogateOut
from nemo_is_plugin.loss.ratios import unmasked_positions
from nemo_is_plugin.loss.roles import Roles
from nemo_is_plugin.loss.score_centering import CenteringOut, CenteringSpec, centering_term

if TYPE_CHECKING:
    from nemo_is_plugin.loss.config_model import ClippedPGLossConfig


@dataclass
class TermInputs:
    """The batch constants of the per-token terms: detached token tensors of ``layout`` (flat ``[N]`` after
    :meth:`flat`, ``[n]`` after :meth:`chunk`).

    pi_old: the old log-probs the policy ratio divides by (``roles.pi_old_of``). mu: the sampler's log-probs (the
    KL's on-policy weight reads them; the roles' pi_old where the roles have none). Each field has its role's name in
    :class:`~nemo_is_plugin.loss.roles.Roles`. valid: token_mask times the sequence's sample mask. positions: n_t,
    1-based among unmasked tokens. correction: the IS correction (weights, truncation and rejection masks, rule
    outcomes), None without one; is_weight: its final weights (None: 1). reference / kl / kl_coef: the KL term
    (reference None: no KL). nll_tokens / nll_count: the positive samples' tokens (Float[*T]) and their count (0-d)
    for the NLL term -sum_t q_t c_t, q_t = nll_tokens / (nll_count + 1e-8) (None: no NLL term).
    """

    config: ClippedPGLossConfig
    layout: TokenLayout
    pi_old: torch.Tensor
    mu: torch.Tensor
    advantages: torch.Tensor
    token_mask: torch.Tensor
    valid: torch.Tensor
    positions: torch.Tensor
    correction: ISCorrection | None
    is_weight: torch.Tensor | None
    reference: torch.Tensor | None = None
    kl: KLSpec | None = None
    kl_coef: float = 0.0
    nll_tokens: torch.Tensor | None = None
    nll_count: torch.Tensor | None = None
    sampler_head: torch.Tensor | None = None
    centering: CenteringSpec | None = None

    _TOKEN_FIELDS = (
        "pi_old",
        "mu",
        "advantages",
        "token_mask",
        "valid",
        "positions",
        "is_weight",
        "reference",
        "nll_tokens",
    )

    def _map(
        self, fn: Callable[[torch.Tensor], torch.Tensor], head_fn: Callable[[torch.Tensor], torch.Tensor] | None = None
    ) -> TermInputs:
        changes: dict[str, Any] = {
            k: None if getattr(self, k) is None else fn(getattr(self, k)) for k in self._TOKEN_FIELDS
        }
        if self.sampler_head is not None:
            changes["sampler_head"] = (head_fn or fn)(self.sampler_head)
        return dataclasses.replace(self, **changes)

    def flat(self) -> TermInputs:
        """The token tensors flattened in memory order (the fused single pass's ``[N]``; heads ``[N, k]``)."""
        return self._map(lambda t: t.reshape(-1), lambda h: h.reshape(-1, h.shape[-1]))

    def chunk(self, sl: slice) -> TermInputs:
        """The flat constants of the chunk ``sl`` (after :meth:`flat`)."""
        return self._map(lambda t: t[sl])


@dataclass
class TokenTerms:
    """The per-token terms of :func:`token_terms`. objective: the chosen objective's surrogate (its per-token loss and
    indicators) and the state its metrics read. actor: w_t sur_t. kl: the per-token KL before its coefficient (None
    without a KL term). centering: the score-centering term and its statistics (None without ``score_centering``)."""

    objective: ObjectiveOut
    actor: torch.Tensor
    kl: torch.Tensor | None
    centering: CenteringOut | None = None

    @property
    def surrogate(self) -> SurrogateOut:
        return self.objective.surrogate

    def combined(self, kl_coef: float) -> torch.Tensor:
        """x_t = w_t sur_t + beta kl_t (+ the score-centering term; the loss is its aggregation plus the NLL term)."""
        x = self.actor if self.kl is None else self.actor + kl_coef * self.kl
        return x if self.centering is None else x + self.centering.term


def token_terms(
    t: TermInputs,
    c: torch.Tensor,
    *,
    c_kl: torch.Tensor | None = None,
    trainer_head: torch.Tensor | None = None,
    causal: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> TokenTerms:
    """The per-token terms of the current log-probs ``c`` (requires grad) on the constants ``t``.

    ``trainer_head``: the current log-probs at the sampler's head ids ``[*T, k]`` (requires grad), read by score
    centering (``t.sampler_head`` set), from the same log-softmax as ``c``.
    ``c_kl``: the log-probs the KL reads when they differ from ``c`` (NeMo-RL's unfiltered ones under top-k / top-p).
    ``causal``: the fused single pass's cumulative ratio (``separable``): its stop-gradient value from the ratio's
    anchor and the running sums of the earlier chunks.
    """
    # The KL first, then the surrogate: the order NeMo-RL builds them in, which fixes the order autograd sums their
    # gradients in (bit-identical gradients to NeMo-RL's float32 arithmetic).
    kl = None
    if t.reference is not None and t.kl is not None:
        kl = t.kl.tokens(c if c_kl is None else c_kl, t.reference, t.mu, t.pi_old)
    anchor = ratio_anchor(t.pi_old, c, t.valid)
    causal_anchor = None
    if causal is not None:
        with torch.no_grad():  # as ratios.policy_log_ratio: the cumulative value carries no gradient
            causal_anchor = causal(anchor)
    objective = t.config.objective.surrogate(
        ObjectiveInputs(t.config, c, anchor, t.advantages, t.token_mask, t.valid, t.layout, t.positions, causal_anchor)
    )
    sur = objective.surrogate
    actor = sur.loss if t.is_weight is None else t.is_weight * sur.loss
    centering = None
    if t.sampler_head is not None and t.centering is not None:
        if trainer_head is None:
            raise ValueError("score centering needs the current log-probs at the head ids (trainer_head)")
        # the tokens the term acts on: counted, with a finite generation log-prob (without one the sampler's
        # distribution at that position is not what it recorded: the IS weight is 0 there too)
        counted = (t.valid != 0) & torch.isfinite(t.mu)
        spec = t.centering
        centering = centering_term(
            trainer_head.to(c.dtype),
            t.sampler_head,
            t.advantages,
            counted,
            spec.calibration,
            tail_floor=spec.tail_floor,
            scale=spec.scale,
        )
    return TokenTerms(objective, actor, kl, centering)


@dataclass
class LossTerms:
    """Every per-token term of one ``ClippedPGLoss`` call (token tensors of ``term_inputs.layout``), and what its
    reductions and metrics read besides: the call's ``LossInputs`` as given (``loss_inputs``) and the batch constants
    of its terms (``term_inputs``), the loss dtype's current log-probs ``curr``, the roles' ``is_prev`` (log
    pi_prev, what the IS weights pi_prev / mu compare with mu: pi_old, or sg c in bypass mode), the sample mask and the
    global counts."""

    loss_inputs: LossInputs
    term_inputs: TermInputs
    tokens: TokenTerms
    curr: torch.Tensor
    is_prev: torch.Tensor
    sample_mask: torch.Tensor
    n_tok: torch.Tensor
    n_seq: torch.Tensor

    @property
    def surrogate(self) -> SurrogateOut:
        return self.tokens.surrogate

    @property
    def correction(self) -> ISCorrection:
        if self.term_inputs.correction is None:  # loss_terms always computes one
            raise ValueError("these terms carry no IS correction")
        return self.term_inputs.correction


def _as_scalar(x: torch.Tensor | float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.as_tensor(x, dtype=dtype, device=device)


def loss_dtype(c: torch.Tensor) -> torch.dtype:
    """Half-precision log-probs are upcast: the ratio / exp arithmetic needs fp32 (gradients flow back through it)."""
    return torch.float32 if c.dtype in (torch.float16, torch.bfloat16) else c.dtype


def is_correction_kwargs(cfg: ClippedPGLossConfig) -> ISCorrectionOptions:
    """The one binding of config fields to :func:`~nemo_is_plugin.loss.correction.compute_is_correction`'s arguments."""
    return ISCorrectionOptions(
        level=cfg.effective_is_level,
        nemo_rl_exact=cfg.is_correction_level is None,
        apply_weights=cfg.use_importance_sampling_correction,
        truncation=cfg.truncated_importance_sampling_type,
        low=cfg.truncated_importance_sampling_ratio_min,
        high=cfg.truncated_importance_sampling_ratio,
        veto_threshold=cfg.importance_sampling_veto_threshold,
        batch_normalize=cfg.importance_sampling_batch_normalize,
        rules=cfg.rejection_rules,
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


def term_inputs(
    cfg: ClippedPGLossConfig,
    roles: Roles,
    layout: TokenLayout,
    *,
    correction: ISCorrection | None = None,
) -> TermInputs:
    """The batch constants of the per-token terms from a host's :class:`~nemo_is_plugin.loss.roles.Roles`: the one
    place roles become terms, for every host. The IS correction compares ``roles.is_prev`` with mu when the roles say
    the plugin corrects (``correction``: the batch's, when the caller has it already); its weights multiply the
    policy term only, so its rejections (weight 0) leave that term and the KL keeps them; the NLL's positive tokens
    (``rewards``); score centering's head and calibration."""
    mu = roles.pi_old if roles.mu is None else roles.mu
    valid, tm = roles.valid, roles.token_mask
    if correction is None and roles.corrects:
        if roles.mu is None:
            raise ValueError("the IS correction needs the sampler's log-probs (Roles.mu)")
        correction = compute_is_correction(roles.is_prev, mu, tm, valid, layout, **is_correction_kwargs(cfg))
    # Positive-example NLL (VAPO): as in NeMo-RL the term exists only for a positive weight and a batch with rewards.
    pos = count = None
    if cfg.positive_example_nll_weight > 0 and roles.rewards is not None:
        pos, count = positive_sample_tokens(roles.rewards, valid, layout)
    if cfg.score_centering and roles.sampler_head is None:
        raise ValueError("score_centering: the roles carry no sampler head (Roles.sampler_head)")
    return TermInputs(
        config=cfg,
        layout=layout,
        pi_old=roles.pi_old,
        mu=mu,
        advantages=roles.advantages,
        token_mask=tm,
        valid=valid,
        positions=unmasked_positions(tm, layout),
        correction=correction,
        # The weights of tokens that do not count are 0 here (the correction keeps them for NeMo-RL's metrics): the
        # loss drops those tokens by a where, whose backward still multiplies their zero gradient by the weight, and
        # a weight there may be inf (batch normalisation by a denormal mean of the counted ones: 1 / 1e-39).
        is_weight=None if correction is None else torch.where(valid != 0, correction.weights, 0.0),
        reference=roles.reference,
        kl=roles.kl if roles.reference is not None else None,
        kl_coef=roles.kl_coef,
        nll_tokens=pos,
        nll_count=count,
        sampler_head=roles.sampler_head if cfg.score_centering else None,
        centering=CenteringSpec.of(cfg, correction) if cfg.score_centering else None,
    )


def loss_terms(
    cfg: ClippedPGLossConfig,
    inputs: LossInputs,
    layout: TokenLayout,
    *,
    correction: ISCorrection | None = None,
) -> LossTerms:
    """The terms of ``ClippedPGLoss`` on aligned inputs (``correction``: the batch's IS correction when the caller
    has it already, e.g. the fused single pass; else computed here)."""
    c = inputs.curr_logprobs.to(loss_dtype(inputs.curr_logprobs))
    roles = Roles.of_loss_inputs(cfg, inputs, layout, c)
    t = term_inputs(cfg, roles, layout, correction=correction)
    # KL on the unfiltered log-probs under top-k / top-p (NeMo-RL: the reference's are unfiltered too).
    unfiltered = inputs.curr_logprobs_unfiltered
    c_kl = None if t.reference is None or unfiltered is None else unfiltered.to(c.dtype)
    trainer_head = None
    if cfg.score_centering:
        head = required_input(inputs.head, "rollout_topk_logprobs")
        trainer_head = required_input(head.trainer_head, "curr_topk_logprobs").to(c.dtype)
    return LossTerms(
        loss_inputs=inputs,
        term_inputs=t,
        tokens=token_terms(t, c, c_kl=c_kl, trainer_head=trainer_head),
        curr=c,
        is_prev=roles.is_prev,
        sample_mask=inputs.sample_mask.to(c.dtype),
        n_tok=_as_scalar(inputs.global_valid_toks, c.dtype, c.device),
        n_seq=_as_scalar(inputs.global_valid_seqs, c.dtype, c.device),
    )


__all__ = [
    "KLSpec",
    "KLWeight",
    "LossTerms",
    "TermInputs",
    "TokenTerms",
    "is_correction_kwargs",
    "loss_dtype",
    "loss_terms",
    "positive_sample_tokens",
    "ratio_anchor",
    "term_inputs",
    "token_terms",
]
