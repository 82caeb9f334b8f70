"""The loss gradient one token at a time, for configs whose loss is a sum of per-token terms.

With a token-level policy ratio (or REINFORCE) the loss of :class:`ClippedPGLoss` is

    L(c) = sum_t  a_t [ w_t sur_t(c_t) + beta kl_t(c_t) ]  -  mu sum_t q_t c_t

where everything but ``c_t`` (this token's current log-prob) is a constant of the batch: the aggregation weights
``a_t = dL_agg/dx_t`` (aggregation is linear; under any mode they depend on masks and global counts only), the IS
weights ``w_t`` (a function of prev / generation log-probs at every IS level, never of ``c``), the surrogate's
advantage, old log-prob and clip position, the KL reference, and the positive-sample NLL weights ``q_t``. Hence
``dL/dc_t`` is known as soon as ``c_t`` is: the fused hidden-state loss uses this to compute each chunk's gradients
in its forward pass (3 GEMMs per chunk instead of the recomputing backward's 4).

Sequence-level and cumulative ratios are not separable: their value for token t depends on the other tokens' ``c``.

Shapes: the constants are flat ``[N]`` (the token tensors of the layout, flattened in memory order); a chunk is a
slice of ``[0, N)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from nemo_is_plugin.aggregation import aggregate
from nemo_is_plugin.config import ClippedPGLossConfig
from nemo_is_plugin.correction import compute_is_correction
from nemo_is_plugin.layout import TokenLayout
from nemo_is_plugin.loss import ClippedPGLoss, LossInputs, is_correction_kwargs, positive_sample_tokens, ratio_anchor
from nemo_is_plugin.masked import EPS, where_mask
from nemo_is_plugin.ratios import unmasked_positions


def is_token_separable(config: ClippedPGLossConfig) -> bool:
    """True when ``dL/dc_t`` depends on ``c_t`` alone (see module docstring).

    ``force_on_policy_ratio`` is excluded: it takes the old log-probs, hence the IS weights, from ``c`` itself.
    """
    if config.force_on_policy_ratio:
        return False
    return config.disable_ppo_ratio or config.effective_ratio_level == "token"


@dataclass
class TokenLossGradient:
    """``dL/dc`` of the chunk ``sl`` from its log-probs ``c [n]``: ``grad(sl, c) -> [n]`` (fp32, or fp64).

    Build with :meth:`build`; every field is a flat ``[N]`` constant (None when the term is off).
    """

    loss: ClippedPGLoss
    agg_weight: torch.Tensor
    prev: torch.Tensor
    generation: torch.Tensor
    advantages: torch.Tensor
    token_mask: torch.Tensor
    valid: torch.Tensor
    positions: torch.Tensor
    is_weight: torch.Tensor
    reference: Optional[torch.Tensor]
    nll_weight: Optional[torch.Tensor]

    @classmethod
    def build(cls, loss: ClippedPGLoss, inputs: LossInputs, layout: TokenLayout) -> "TokenLossGradient":
        """The per-token constants of ``loss`` on ``inputs`` (whose ``curr_logprobs`` only fix shape and dtype)."""
        cfg = loss.config
        if not is_token_separable(cfg):
            raise ValueError(
                f"ratio_level={cfg.effective_ratio_level!r} couples the tokens of a sequence: the loss gradient of a "
                "token needs the whole sequence's log-probs (use the two-pass path)"
            )
        c_in = inputs.curr_logprobs
        dtype = torch.float32 if c_in.dtype in (torch.float16, torch.bfloat16) else c_in.dtype
        f = lambda t: None if t is None else t.detach().to(dtype)  # noqa: E731
        flat = lambda t: None if t is None else t.reshape(-1)  # noqa: E731
        tm, sm = inputs.token_mask.to(dtype), inputs.sample_mask.to(dtype)
        valid = tm * layout.to_tokens(sm)
        with torch.no_grad():
            corr = compute_is_correction(
                f(inputs.prev_logprobs), f(inputs.generation_logprobs), tm, valid, layout, **is_correction_kwargs(cfg)
            )
            nll_weight = None
            if cfg.positive_example_nll_weight != 0 and inputs.rewards is not None:
                pos, count = positive_sample_tokens(inputs.rewards, valid, layout)
                if count > 0:
                    nll_weight = pos / (count.to(dtype) + EPS)
        return cls(
            loss=loss,
            agg_weight=flat(aggregation_weights(cfg, tm, sm, layout, inputs)),
            prev=flat(f(inputs.prev_logprobs)),
            generation=flat(f(inputs.generation_logprobs)),
            advantages=flat(f(inputs.advantages)),
            token_mask=flat(tm),
            valid=flat(valid),
            positions=flat(unmasked_positions(tm, layout)),
            is_weight=flat(corr.weights.detach()),
            reference=flat(f(inputs.reference_logprobs)) if cfg.effective_kl_penalty != 0 else None,
            nll_weight=flat(nll_weight),
        )

    def __call__(self, sl: slice, c: torch.Tensor) -> torch.Tensor:
        cfg = self.loss.config
        a = self.agg_weight[sl]
        with torch.enable_grad():
            c = c.detach().to(a.dtype).requires_grad_(True)
            # layout=None: a token-level ratio never looks at the layout (is_token_separable guarantees that level)
            p = ratio_anchor(self.prev[sl], c, self.valid[sl])
            sur = self.loss.surrogate(c, p, self.advantages[sl], self.token_mask[sl], None, self.positions[sl])
            term = self.is_weight[sl] * sur.loss
            if self.reference is not None:
                term = term + cfg.effective_kl_penalty * self.loss.kl_tokens(c, self.generation[sl], self.reference[sl])
            # where_mask: masked tokens (a = 0) may hold inf/NaN terms; they must add 0, not NaN
            total = (where_mask(term, a != 0) * a).sum()
            if self.nll_weight is not None:
                total = total - cfg.positive_example_nll_weight * (self.nll_weight[sl] * c).sum()
            (grad,) = torch.autograd.grad(total, c)
        return grad


def aggregation_weights(
    cfg: ClippedPGLossConfig, token_mask: torch.Tensor, sample_mask: torch.Tensor, layout: TokenLayout,
    inputs: LossInputs,
) -> torch.Tensor:
    """``a_t = d aggregate(x) / d x_t`` (Float[*T]): the aggregation is linear in ``x``, so one autograd call on
    ``x = 1`` gives its weights exactly, whatever the mode and layout (CP shares included)."""
    with torch.enable_grad():
        x = torch.ones(token_mask.shape, dtype=token_mask.dtype, device=token_mask.device, requires_grad=True)
        agg = aggregate(
            x, token_mask, sample_mask, layout, mode=cfg.effective_loss_aggregation,
            global_valid_toks=torch.as_tensor(inputs.global_valid_toks).to(x.dtype),
            global_valid_seqs=torch.as_tensor(inputs.global_valid_seqs).to(x.dtype),
            norm=cfg.loss_aggregation_norm,
        )
        (a,) = torch.autograd.grad(agg, x)
    return a


__all__ = ["TokenLossGradient", "aggregation_weights", "is_token_separable"]
