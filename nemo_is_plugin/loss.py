"""ClippedPGLoss: the policy-gradient loss, composed from independent pieces chosen by :class:`ClippedPGLossConfig`.

    loss = aggregate( w_t * surrogate(r_t, A_t) )  +  beta * aggregate( KL_t )  +  mu * NLL(positive samples)

r_t: policy ratio at ``ratio_level`` (ratios.py), clipped in ratio or log space (surrogate.py);
w_t: IS correction at ``is_correction_level`` with truncation / masking / rejection (correction.py);
KL_t: k1/k2/k3 to the reference policy (kl.py); aggregate: token or sequence means over global counts (aggregation.py).

With every plugin field unset this reproduces NeMo-RL's ClippedPGLossFn (commit 7ea279ab): loss, gradient and metrics.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch

from nemo_is_plugin.aggregation import aggregate
from nemo_is_plugin.config import ClippedPGLossConfig, load_loss_config
from nemo_is_plugin.correction import ISCorrection, compute_is_correction
from nemo_is_plugin.is_weights import exp_or_zero
from nemo_is_plugin.kl import kl_penalty, score_function_weight
from nemo_is_plugin.layout import TokenLayout
from nemo_is_plugin.loss_metrics import MetricBook, legacy_error_metrics
from nemo_is_plugin.masked import EPS, where_mask
from nemo_is_plugin.ratios import policy_log_ratio, unmasked_positions
from nemo_is_plugin.surrogate import (
    cispo_surrogate,
    log_space_clip_surrogate,
    ratio_clip_surrogate,
    reinforce_surrogate,
)

# NeMo-RL's data keys; [B, S] tensors are sliced [:, 1:] to align with next-token log-probs [B, S-1].
TOKEN_KEYS = ("token_mask", "advantages", "prev_logprobs", "generation_logprobs", "reference_policy_logprobs")


@dataclass
class LossInputs:
    """Token tensors aligned with one TokenLayout (shape *T), plus per-sequence tensors [S] and global counts.

    curr_logprobs requires grad; prev / generation / reference log-probs are treated as constants.
    """

    curr_logprobs: torch.Tensor
    prev_logprobs: Optional[torch.Tensor]
    generation_logprobs: torch.Tensor
    reference_logprobs: Optional[torch.Tensor]
    advantages: torch.Tensor
    token_mask: torch.Tensor
    sample_mask: torch.Tensor
    global_valid_seqs: torch.Tensor | float
    global_valid_toks: torch.Tensor | float
    rewards: Optional[torch.Tensor] = None

    @classmethod
    def from_tokens(
        cls,
        curr_logprobs: torch.Tensor,
        tokens: Mapping[str, torch.Tensor],
        data: Mapping[str, torch.Tensor],
        global_valid_seqs: torch.Tensor | float,
        global_valid_toks: torch.Tensor | float,
    ) -> "LossInputs":
        """Build from token tensors under NeMo-RL's keys (``tokens``, already aligned with ``curr_logprobs``) and the
        per-sequence entries of ``data`` (``sample_mask``, optional ``rewards``)."""
        return cls(
            curr_logprobs=curr_logprobs,
            prev_logprobs=tokens.get("prev_logprobs"),
            generation_logprobs=tokens["generation_logprobs"],
            reference_logprobs=tokens.get("reference_policy_logprobs"),
            advantages=tokens["advantages"],
            token_mask=tokens["token_mask"],
            sample_mask=data["sample_mask"],
            global_valid_seqs=global_valid_seqs,
            global_valid_toks=global_valid_toks,
            rewards=data.get("rewards"),
        )


class ClippedPGLoss:
    """Clipped policy-gradient loss with independent ratio level, IS correction, clip space, KL and aggregation.

    Called like NeMo-RL's ClippedPGLossFn: ``loss, metrics = loss_fn(next_token_logprobs=[B, S-1], data=mapping of
    [B, S] tensors, global_valid_seqs=N_seq, global_valid_toks=N_tok)``. Picklable (holds only its config).
    """

    def __init__(self, config: ClippedPGLossConfig | Mapping[str, Any]):
        self.config = load_loss_config(dict(config) if isinstance(config, Mapping) else config)

    # ------------------------------------------------------------------ NeMo-RL entry point
    def __call__(
        self,
        next_token_logprobs: torch.Tensor,
        data: Mapping[str, torch.Tensor],
        global_valid_seqs: torch.Tensor | float,
        global_valid_toks: torch.Tensor | float,
        *,
        layout: Optional[TokenLayout] = None,
        **_: Any,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        return self.compute(*self.prepare(next_token_logprobs, data, global_valid_seqs, global_valid_toks, layout))

    def prepare(
        self,
        next_token_logprobs: torch.Tensor,
        data: Mapping[str, torch.Tensor],
        global_valid_seqs: torch.Tensor | float,
        global_valid_toks: torch.Tensor | float,
        layout: Optional[TokenLayout] = None,
    ) -> tuple["LossInputs", TokenLayout]:
        """Validate a NeMo-RL call's arguments and align them: ``[B, S]`` data -> ``[B, S-1]`` token tensors."""
        from nemo_is_plugin.validation import validate_loss_inputs

        cfg = self.config
        validate_loss_inputs(
            next_token_logprobs, data, global_valid_seqs, global_valid_toks,
            num_seqs=None if layout is None else layout.num_seqs,
            needs_prev=not cfg.force_on_policy_ratio,
            needs_generation=True,
            needs_reference=cfg.effective_kl_penalty != 0,
            needs_rewards=cfg.positive_example_nll_weight != 0,
        )
        sliced = {k: data[k][:, 1:] for k in TOKEN_KEYS if k in data}
        curr = next_token_logprobs
        if layout is None:
            layout = TokenLayout.padded(curr.shape[0], curr.shape[1], device=curr.device)
        return LossInputs.from_tokens(curr, sliced, data, global_valid_seqs, global_valid_toks), layout

    # ------------------------------------------------------------------ the loss on aligned token tensors
    def compute(
        self, inputs: LossInputs, layout: TokenLayout, *, is_correction: Optional[ISCorrection] = None
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """The loss and metrics of aligned token tensors. ``is_correction``: the IS correction of these inputs when
        the caller computed it already (the fused single pass builds its gradient with it); else computed here."""
        cfg = self.config
        c_in = inputs.curr_logprobs
        # Half-precision log-probs are upcast: the ratio / exp arithmetic needs fp32 (gradients flow back through it).
        dtype = torch.float32 if c_in.dtype in (torch.float16, torch.bfloat16) else c_in.dtype
        c = c_in.to(dtype)
        as_f = lambda t: None if t is None else t.detach().to(dtype)  # noqa: E731
        tm, sm = inputs.token_mask.to(dtype), inputs.sample_mask.to(dtype)
        valid = tm * layout.to_tokens(sm)
        adv = as_f(inputs.advantages)
        g = as_f(inputs.generation_logprobs)
        p = c.detach() if cfg.force_on_policy_ratio else as_f(inputs.prev_logprobs)
        n_tok = _as_scalar(inputs.global_valid_toks, dtype)
        n_seq = _as_scalar(inputs.global_valid_seqs, dtype)
        agg = cfg.effective_loss_aggregation
        reduce = lambda x: aggregate(  # noqa: E731
            x, tm, sm, layout, mode=agg, global_valid_toks=n_tok, global_valid_seqs=n_seq,
            norm=cfg.loss_aggregation_norm,
        )
        book = MetricBook(layout, valid, n_tok, n_seq)

        # 1. Mismatch diagnostics NeMo-RL reports (no grad).
        legacy_error_metrics(book, p, g, valid, cfg.reference_policy_kl_type)

        # 2. KL to the reference policy.
        beta = cfg.effective_kl_penalty
        kl_loss = torch.zeros((), dtype=dtype, device=c.device)
        if beta != 0:
            kl_tok = self.kl_tokens(c, g, as_f(inputs.reference_logprobs))
            kl = reduce(kl_tok)
            kl_loss = beta * kl
            book.add_sum("kl_penalty", kl.detach())
        else:
            book.add_sum("kl_penalty", torch.zeros((), dtype=torch.float64))

        # 3. Policy ratio and surrogate. n_t (1-based position among unmasked tokens) serves the log-space clip and
        # the clip-rate-by-position metrics.
        positions = unmasked_positions(tm, layout)
        sur = self.surrogate(c, ratio_anchor(p, c, valid), adv, tm, layout, positions)

        # 4. IS correction.
        trunc = cfg.truncated_importance_sampling_type
        corr = is_correction
        if corr is None:
            corr = compute_is_correction(p, g, tm, valid, layout, **is_correction_kwargs(cfg))

        # 5. Actor loss.
        actor_loss = reduce(corr.weights * sur.loss)

        # 6. Positive-example NLL (VAPO): mean over tokens of samples with reward > 0, local count (NeMo-RL).
        nll = torch.zeros((), dtype=dtype, device=c.device)
        mu = cfg.positive_example_nll_weight
        if mu != 0 and inputs.rewards is not None:
            pos, count = positive_sample_tokens(inputs.rewards, valid, layout)
            if count > 0:
                nll = where_mask(-c, pos).sum() / (count.to(dtype) + EPS)
        loss = actor_loss + kl_loss + mu * nll

        # 7. Metrics.
        book.add_sum("loss", loss.detach())
        book.policy_ratio(sur)
        # NeMo-RL reports the truncated weights even when the correction is not applied to the loss.
        w_metric = corr.weights if cfg.use_importance_sampling_correction else corr.raw_weights
        book.importance_weights(
            corr, w_metric, trunc, sample_mask=sm,
            legacy_gspo=cfg.sequence_level_importance_ratios and cfg.is_correction_level is None,
        )
        book.add_replicated_scalar("num_valid_samples", sm.sum().double())
        # NeMo-RL's value, including its inf when exp(c - g) overflows (golden 088); a certain token (c = 0)
        # contributes 0 rather than inf * 0 = NaN.
        cd = c.detach()
        ent_tok = torch.where(cd == 0, torch.zeros_like(cd), torch.exp(cd - g) * cd)
        ent = -where_mask(ent_tok, valid).sum() / (n_tok + EPS)
        book.add_sum("approx_entropy", ent)
        book.add_sum("positive_nll_loss", nll.detach())
        book.mismatch(p, g, tm, sm)
        book.clip_by_position(sur, positions)
        return loss, book.finish()

    def kl_tokens(self, c: torch.Tensor, g: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
        """Per-token KL penalty to the reference policy (before aggregation and beta); token-wise in ``c``."""
        cfg = self.config
        w_kl = exp_or_zero(c - g) if cfg.use_on_policy_kl_approximation else score_function_weight(c)
        return kl_penalty(
            c, ref, kl_type=cfg.reference_policy_kl_type,
            input_clamp=cfg.kl_input_clamp_value, output_clamp=cfg.kl_output_clamp_value, weights=w_kl,
            straight_through_k2=cfg.reference_policy_kl_gradient == "k2",
        )

    def surrogate(self, c, p, adv, tm, layout, positions):
        """The per-token surrogate (:class:`~nemo_is_plugin.surrogate.SurrogateOut`) of the configured ratio."""
        cfg = self.config
        if cfg.disable_ppo_ratio:
            return reinforce_surrogate(c, adv, dual_clip=cfg.ratio_clip_c)
        if cfg.force_on_policy_ratio:
            log_r = c - c.detach()
        else:
            log_r = policy_log_ratio(
                cfg.effective_ratio_level, c, p, tm, layout,
                token_clamp=cfg.token_log_ratio_clamp, max_log_ratio=cfg.max_log_ratio,
            )
        return self.clipped_surrogate(log_r, c, adv, positions)

    def clipped_surrogate(self, log_r, c, adv, positions):
        """The configured clip (ratio space, log space or CISPO) of a policy log-ratio ``log_r``; all Float[*T]."""
        cfg = self.config
        if cfg.use_cispo:
            return cispo_surrogate(log_r, c, adv, clip_low=cfg.ratio_clip_min, clip_high=cfg.ratio_clip_max)
        if cfg.uses_log_space_clip:
            return log_space_clip_surrogate(
                log_r, adv, positions, eps_low=cfg.log_ratio_clip_low,
                eps_high=cfg.log_ratio_clip_high, eps_c=cfg.log_ratio_clip_c, power=cfg.clip_position_power,
            )
        return ratio_clip_surrogate(
            log_r, adv, clip_low=cfg.ratio_clip_min, clip_high=cfg.ratio_clip_max, dual_clip=cfg.ratio_clip_c
        )


def is_correction_kwargs(cfg: ClippedPGLossConfig) -> dict[str, Any]:
    """The one binding of config fields to :func:`~nemo_is_plugin.correction.compute_is_correction`'s arguments."""
    return dict(
        level=cfg.effective_is_level,
        legacy=cfg.is_correction_level is None,
        apply_weights=cfg.use_importance_sampling_correction,
        truncation=cfg.truncated_importance_sampling_type,
        low=cfg.truncated_importance_sampling_ratio_min,
        high=cfg.truncated_importance_sampling_ratio,
        veto_threshold=cfg.importance_sampling_veto_threshold,
        batch_normalize=cfg.importance_sampling_batch_normalize,
        rejection=cfg.importance_sampling_rejection,
        rejection_low=cfg.importance_sampling_rejection_min,
        rejection_high=cfg.importance_sampling_rejection_max,
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


def _as_scalar(x: torch.Tensor | float, dtype: torch.dtype) -> torch.Tensor:
    return torch.as_tensor(x).to(dtype)


def build_loss_fn(config: ClippedPGLossConfig | Mapping[str, Any]) -> ClippedPGLoss:
    """Return the loss for a NeMo-RL ``loss_fn`` section (a mapping) or a validated config."""
    return ClippedPGLoss(config)
