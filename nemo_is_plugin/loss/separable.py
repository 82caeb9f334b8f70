"""The loss gradient chunk by chunk, for configs whose dL/dc_t is known once the log-probs up to t are.

With a token-level policy ratio (or REINFORCE) the loss of :class:`ClippedPGLoss` is

    L(c) = sum_t  a_t [ w_t sur_t(c_t) + beta kl_t(c_t) ]  -  mu sum_t q_t c_t

where everything but ``c_t`` (this token's current log-prob) is a constant of the batch: the aggregation weights
``a_t = dL_agg/dx_t`` (aggregation is linear; under any mode they depend on masks and global counts only), the IS
weights ``w_t`` (a function of prev / generation log-probs at every IS level, never of ``c``), the surrogate's
advantage, old log-prob and clip position, the KL reference, and the positive-sample NLL weights ``q_t``. Hence
``dL/dc_t`` is known as soon as ``c_t`` is: the fused hidden-state loss uses this to compute each chunk's gradients
in its forward pass (3 GEMMs per chunk instead of the recomputing backward's 4).

The cumulative ratios (CTPO) are causal: ``log r_t = sg[sum_{j<=t} m_j d_j] (/ n_t) + c_t - sg[c_t]`` needs the
log-probs of the earlier tokens of t's sequence only. When the chunks visit every sequence's tokens in position order
(a layout that holds whole sequences in memory order: padded or packed, not a CP shard), a per-sequence running sum
carried from chunk to chunk gives the same value, so they take the single pass too. ``sequence`` and
``sequence_token`` ratios need the whole sequence first (two passes).

The ``policy_objective``s whose per-token loss reads only its own token (DPPO's masks, prob_diff, SAPO, GPG, DRO) are
token-separable too; those whose loss needs whole sequences or the whole batch (GMPO's sequence mean, CPPO's prefix
budget and quantile, a statistic of the whole batch) say so (``PolicyObjective.whole_batch_reason``) and take the two
passes.

``dL/dc_t`` itself is autograd over the loss's own per-token terms (:func:`~nemo_is_plugin.loss.terms.token_terms`,
the function the whole-batch loss computes them with) on a detached ``[n]`` leaf of the chunk's log-probs: one source
of truth for every formula, and at a kink (a tie of min / max / clamp) the gradient is whatever subgradient autograd
picks for the loss itself. It is a graph of a few dozen elementwise ops on ``[n]`` vectors, small next to the chunk's
``[n x V]`` GEMMs (``python -m nemo_is_plugin.apps.bench.loss_gradient_timing`` measures both), built under
``torch.enable_grad`` so that the fused forward (which runs without grad mode) can use it; no host synchronisation.
The batch constants (:class:`~nemo_is_plugin.loss.terms.TermInputs`) are computed once per call, by the loss's own
:func:`~nemo_is_plugin.loss.terms.loss_terms` binding; the IS correction among them is handed to the loss's metrics
pass so that it is not computed twice.

Score centering adds ``sum_t a_t sg(A_t) sum_v sg(c_tv) log p_tv`` over each token's k head log-probs, as local as
the rest: :meth:`TokenLossGradient.with_head` gives the chunk's ``dL/dc_head [n, k]`` beside ``dL/dc [n]``, for the
head to scatter onto the head ids' logits (the fused LM-head loss's single pass: ``kernels/head_ids.py``).

Shapes: the constants are flat ``[N]`` (the token tensors of the layout, flattened in memory order); a chunk is a
slice of ``[0, N)``; chunks are visited in order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nemo_is_plugin.loss.clipped_pg import ClippedPGLoss, LossInputs, configured_aggregate, positive_nll_gradient
from nemo_is_plugin.loss.config_model import ClippedPGLossConfig
from nemo_is_plugin.loss.correction import ISCorrection
from nemo_is_plugin.loss.layout import TokenLayout
from nemo_is_plugin.loss.masked import where_mask
from nemo_is_plugin.loss.objectives.base import chosen_as
from nemo_is_plugin.loss.objectives.ppo_clip import CAUSAL_LEVELS
from nemo_is_plugin.loss.ratios import cumulative_anchor, token_log_ratio
from nemo_is_plugin.loss.roles import Roles
from nemo_is_plugin.loss.terms import TermInputs, loss_dtype, term_inputs, token_terms


def is_token_separable(config: ClippedPGLossConfig) -> bool:
    """True when ``dL/dc_t`` depends on ``c_t`` alone (see module docstring).

    An objective whose old log-probs are the current ones (``on_policy``, NeMo-RL's ``force_on_policy_ratio``) is
    excluded: it takes the IS weights from ``c`` itself; so is ``old_policy_logprobs='generation'`` (bypass), whose
    IS weights and rejections measure ``c`` against mu.
    """
    objective = config.objective
    if objective.pi_old_is_current or config.bypasses_prev:
        return False
    return objective.whole_batch_reason(config) is None and not objective.causal(config)


def single_pass_blocker(config: ClippedPGLossConfig, layout: TokenLayout) -> str | None:
    """Why the loss gradient of a chunk cannot be known from the log-probs seen so far; None when it can."""
    level = config.effective_ratio_level
    objective = config.objective
    if objective.pi_old_is_current:
        return f"{chosen_as(config)} takes the old log-probs (and the IS weights) from the current ones"
    if config.bypasses_prev:
        return "old_policy_logprobs='generation' takes the IS weights and rejections from the current log-probs"
    why = objective.whole_batch_reason(config)
    if why is not None:
        return why
    if not objective.causal(config):
        return None
    if not layout.holds_whole_sequences:
        return f"ratio_level={level!r} on a context-parallel shard needs the prefix sums of the other ranks"
    if not layout.in_memory_order:
        return f"ratio_level={level!r} needs each sequence's tokens in position order in memory"
    return None


@dataclass
class TokenLossGradient:
    """``dL/dc`` of the chunk ``sl`` from its log-probs ``c [n]``: ``grad(sl, c) -> [n]`` (fp32, or fp64).

    Build with :meth:`build`: ``constants`` are the loss's batch constants flattened to ``[N]``, ``agg_weight`` the
    aggregation's per-token weights; ``correction`` is the batch's IS correction (reused by the loss's metrics pass).
    The gradient is autograd of :meth:`chunk_terms` (:func:`~nemo_is_plugin.loss.terms.token_terms`) weighted by
    ``a``, plus the linear NLL term: no host synchronisation.
    """

    constants: TermInputs
    agg_weight: torch.Tensor
    prefix: PrefixCarry | None = None

    @property
    def correction(self) -> ISCorrection | None:
        return self.constants.correction

    @classmethod
    def build(cls, loss: ClippedPGLoss, inputs: LossInputs, layout: TokenLayout) -> TokenLossGradient:
        """The per-token constants of ``loss`` on ``inputs`` (whose ``curr_logprobs`` only fix shape and dtype)."""
        cfg = loss.config
        why = single_pass_blocker(cfg, layout)
        if why is not None:
            raise ValueError(f"no chunk-by-chunk loss gradient: {why} (use the two-pass path)")
        with torch.no_grad():
            c = inputs.curr_logprobs.to(loss_dtype(inputs.curr_logprobs))
            t = term_inputs(cfg, Roles.of_loss_inputs(cfg, inputs, layout, c), layout)
            agg = aggregation_weights(cfg, t.token_mask, inputs.sample_mask.to(t.token_mask.dtype), layout, inputs)
        return cls(
            constants=t.flat(),
            agg_weight=agg.reshape(-1),
            prefix=PrefixCarry(cfg, layout) if cfg.objective.causal(cfg) else None,
        )

    def __call__(self, sl: slice, c: torch.Tensor) -> torch.Tensor:
        if self.constants.sampler_head is not None:
            raise ValueError(
                "score_centering: the chunk gradient has a head part too; call with_head(sl, c, trainer_head)"
            )
        return self._grads(sl, c, None)[0]

    def with_head(self, sl: slice, c: torch.Tensor, trainer_head: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(dL/dc [n], dL/dc_head [n, k])`` of the chunk ``sl`` under ``score_centering``: the head part is each
        token's sg(A) a_t c_v, to be scattered onto the head ids' logits as the label's gradient is onto its own."""
        grad, head = self._grads(sl, c, trainer_head)
        assert head is not None
        return grad, head

    def _grads(self, sl: slice, c: torch.Tensor, trainer_head: torch.Tensor | None):
        a = self.agg_weight[sl]
        with torch.enable_grad():  # the fused forward runs without grad mode
            leaf = c.detach().to(a.dtype).requires_grad_(True)
            head = None if trainer_head is None else trainer_head.detach().to(a.dtype).requires_grad_(True)
            leaves = [leaf] if head is None else [leaf, head]
            grads = torch.autograd.grad(self.chunk_terms(sl, leaf, head), leaves, grad_outputs=a, allow_unused=True)
        # the loss's where_mask: tokens with a = 0 add exactly 0, whatever inf/NaN their terms' derivatives hold
        grad = torch.where(a != 0, grads[0], 0.0) if grads[0] is not None else torch.zeros_like(leaf)
        head_grad = None
        if head is not None:
            g_head = torch.zeros_like(head) if grads[1] is None else grads[1]
            head_grad = torch.where((a != 0).unsqueeze(-1), g_head, 0.0)
        nll_grad = positive_nll_gradient(self.constants, sl, a.dtype)
        if nll_grad is not None:
            grad = grad + self.constants.config.positive_example_nll_weight * nll_grad
        return grad, head_grad

    def chunk_terms(self, sl: slice, c: torch.Tensor, trainer_head: torch.Tensor | None = None) -> torch.Tensor:
        """``x_t = w_t sur_t(c_t) + beta kl_t(c_t)`` (+ the score-centering term of ``trainer_head [n, k]``) of the
        chunk ``sl`` (``[n]``), by the loss's own :func:`~nemo_is_plugin.loss.terms.token_terms`: the loss is
        ``sum_t a_t x_t`` plus the NLL term."""
        t, prefix = self.constants.chunk(sl), self.prefix
        causal = None if prefix is None else (lambda p: prefix.anchor(sl, c, p, t.token_mask, t.positions))
        return token_terms(t, c, trainer_head=trainer_head, causal=causal).combined(t.kl_coef)


class PrefixCarry:
    """The cumulative ratio's anchor of a chunk from its log-probs and a per-sequence running sum of the earlier
    chunks' (the layout holds whole sequences in memory order, so each sequence's tokens are consecutive).

    ``anchor(sl, c, p, tm, positions)`` equals the value of :func:`~nemo_is_plugin.loss.ratios.policy_log_ratio` on
    those tokens (before the ``max_log_ratio`` cap) provided every chunk is passed once, in order. No host sync: the
    segments inside a chunk come from comparisons of neighbouring sequence ids, the carry is a scatter to unique
    slots.
    """

    def __init__(self, config: ClippedPGLossConfig, layout: TokenLayout):
        self.level = config.effective_ratio_level
        self.token_clamp = config.token_log_ratio_clamp
        self.seq = layout.seq_index.reshape(-1)
        self.num_seqs = layout.num_seqs
        self.carry = torch.zeros(layout.num_seqs, dtype=torch.float64, device=self.seq.device)
        self.next_start = 0

    def anchor(self, sl: slice, c, p, tm, positions) -> torch.Tensor:
        d = token_log_ratio(c, p, self.token_clamp)
        prefix = self.scan(sl, where_mask(d, tm)).to(c.dtype)
        return cumulative_anchor(self.level, prefix, positions, tm)

    def scan(self, sl: slice, x: torch.Tensor) -> torch.Tensor:
        """Inclusive per-sequence prefix sums (fp64) of the chunk's ``x [n]``, continuing the earlier chunks'."""
        if sl.start != self.next_start:
            raise RuntimeError(f"chunks must be scanned in order: expected start {self.next_start}, got {sl.start}")
        self.next_start = sl.stop
        seq = self.seq[sl]
        n = seq.shape[0]
        x = x.double()
        total = torch.cumsum(x, 0)
        change = seq[1:] != seq[:-1]  # a new sequence starts at i + 1
        starts = torch.cat([change.new_ones(1), change])
        index = torch.arange(n, device=seq.device)
        first = torch.cummax(torch.where(starts, index, 0), 0).values  # the chunk's first token of each segment
        out = total - (total - x)[first] + self.carry[seq]
        # each sequence's last token in the chunk hands its sum on; the other tokens write to slots past the carry
        last = torch.cat([change, change.new_ones(1)])
        slots = torch.cat([self.carry, out.new_empty(n)])
        slots.scatter_(0, torch.where(last, seq, self.num_seqs + index), out)
        self.carry = slots[: self.num_seqs]
        return out


def aggregation_weights(
    cfg: ClippedPGLossConfig,
    token_mask: torch.Tensor,
    sample_mask: torch.Tensor,
    layout: TokenLayout,
    inputs: LossInputs,
) -> torch.Tensor:
    """``a_t = d aggregate(x) / d x_t`` (Float[*T]): the aggregation is linear in ``x``, so one autograd call on
    ``x = 1`` gives its weights exactly, whatever the mode and layout (CP shares included)."""
    with torch.enable_grad():
        x = torch.ones(token_mask.shape, dtype=token_mask.dtype, device=token_mask.device, requires_grad=True)
        agg = configured_aggregate(
            cfg,
            x,
            token_mask,
            sample_mask,
            layout,
            global_valid_toks=torch.as_tensor(inputs.global_valid_toks, dtype=x.dtype, device=x.device),
            global_valid_seqs=torch.as_tensor(inputs.global_valid_seqs, dtype=x.dtype, device=x.device),
        )
        (a,) = torch.autograd.grad(agg, x)
    return a


__all__ = [
    "CAUSAL_LEVELS",
    "PrefixCarry",
    "TokenLossGradient",
    "aggregation_weights",
    "is_token_separable",
    "single_pass_blocker",
]
