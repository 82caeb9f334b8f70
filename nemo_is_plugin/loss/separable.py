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
``[n x V]`` GEMMs (``python -m nemo_is_plugin.apps.bench.loss_gradient_timing`` measures both), taken with
``torch.func.vjp`` (:func:`chunk_gradient`): it ignores the fused forward's no-grad mode, and ``torch.compile`` traces
it into one graph with the terms (a compiled loss, ``loss/compiled.py``, runs a chunk's whole step as one or a few
kernels); no host synchronisation. The batch constants (:class:`~nemo_is_plugin.loss.terms.TermInputs`) are computed
once per call (:func:`batch_constants`), by the loss's own :func:`~nemo_is_plugin.loss.terms.term_inputs` binding; the
IS correction among them is handed to the eager loss's metrics pass so that it is not computed twice. The
cumulative ratio's running sums are a pure function of a chunk and the carry (:func:`prefix_scan`), held from chunk to
chunk by :class:`PrefixCarry`.

Score centering adds ``sum_t a_t sg(A_t) sum_v sg(c_tv) log p_tv`` over each token's k head log-probs, as local as
the rest: :meth:`TokenLossGradient.with_head` gives the chunk's ``dL/dc_head [n, k]`` beside ``dL/dc [n]``, for the
head to scatter onto the head ids' logits (the fused LM-head loss's single pass: ``kernels/head_ids.py``).

Shapes: the constants are flat ``[N]`` (the token tensors of the layout, flattened in memory order); a chunk is a
slice of ``[0, N)``; chunks are visited in order.
"""

from __future__ import annotations

from collections.abc import Callable
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
class ChunkPrefix:
    """The cumulative ratio's state for one chunk: the chunk's sequence ids ``seq [n]`` and the running sums of the
    earlier chunks ``carry [num_seqs]`` (fp64), with the ratio's level and per-token clamp."""

    level: str
    token_clamp: float | None
    seq: torch.Tensor
    carry: torch.Tensor


def prefix_scan(seq: torch.Tensor, x: torch.Tensor, carry: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inclusive per-sequence prefix sums (fp64) of a chunk's ``x [n]`` (``seq [n]`` its tokens' sequence ids, each
    sequence's tokens consecutive), continuing the earlier chunks' sums ``carry [num_seqs]``; returns ``(sums [n],
    the carry after this chunk)``. No host sync: the segments come from comparisons of neighbouring sequence ids, the
    carry is a scatter to unique slots."""
    n, num_seqs = seq.shape[0], carry.shape[0]
    x = x.double()
    total = torch.cumsum(x, 0)
    change = seq[1:] != seq[:-1]  # a new sequence starts at i + 1
    starts = torch.cat([change.new_ones(1), change])
    index = torch.arange(n, device=seq.device)
    first = torch.cummax(torch.where(starts, index, 0), 0).values  # the chunk's first token of each segment
    out = total - (total - x)[first] + carry[seq]
    # each sequence's last token in the chunk hands its sum on; the other tokens write to slots past the carry
    last = torch.cat([change, change.new_ones(1)])
    slots = torch.cat([carry, out.new_empty(n)])
    slots = slots.scatter(0, torch.where(last, seq, num_seqs + index), out)
    return out, slots[:num_seqs]


def chunk_terms(
    t: TermInputs, c: torch.Tensor, trainer_head: torch.Tensor | None = None, prefix: ChunkPrefix | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``x_t = w_t sur_t(c_t) + beta kl_t(c_t)`` (+ the score-centering term of ``trainer_head [n, k]``) of one
    chunk's constants ``t`` (``[n]``), by the loss's own :func:`~nemo_is_plugin.loss.terms.token_terms`: the loss is
    ``sum_t a_t x_t`` plus the NLL term. Returns ``(x [n], the prefix carry after the chunk or None)``."""
    carry: list[torch.Tensor] = []

    def causal(p: torch.Tensor) -> torch.Tensor:
        assert prefix is not None
        d = token_log_ratio(c, p, prefix.token_clamp)
        sums, after = prefix_scan(prefix.seq, where_mask(d, t.token_mask), prefix.carry)
        carry.append(after)
        return cumulative_anchor(prefix.level, sums.to(c.dtype), t.positions, t.token_mask)

    x = token_terms(t, c, trainer_head=trainer_head, causal=None if prefix is None else causal).combined(t.kl_coef)
    return x, carry[0] if carry else None


def chunk_gradient(
    t: TermInputs,
    a: torch.Tensor,
    c: torch.Tensor,
    trainer_head: torch.Tensor | None = None,
    prefix: ChunkPrefix | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(dL/dc [n], dL/d(trainer_head) [n, k] or None, the prefix carry after the chunk or None)`` of one chunk:
    the vector-Jacobian product of :func:`chunk_terms` with the aggregation weights ``a [n]`` (``torch.func.vjp``,
    which ``torch.compile`` traces into the same graph: no graph break, no host sync), plus the linear NLL term."""
    leaves = (c.detach().to(a.dtype),) + (() if trainer_head is None else (trainer_head.detach().to(a.dtype),))

    def terms(*x: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        out, after = chunk_terms(t, x[0], x[1] if len(x) > 1 else None, prefix)
        return out, () if after is None else (after,)  # vjp's aux: tensors only

    vjp = torch.func.vjp(terms, *leaves, has_aux=True)
    pull, aux = vjp[1], vjp[2]  # type: ignore[misc]  # torch types vjp without has_aux
    carry = aux[0] if aux else None
    grads = pull(a)
    kept = a != 0  # the loss's where_mask: tokens with a = 0 add exactly 0, whatever inf/NaN their derivatives hold
    grad = torch.where(kept, grads[0], 0.0)
    head_grad = None if trainer_head is None else torch.where(kept.unsqueeze(-1), grads[1], 0.0)
    nll_grad = positive_nll_gradient(t, slice(None), a.dtype)
    if nll_grad is not None:
        grad = grad + t.config.positive_example_nll_weight * nll_grad
    return grad, head_grad, carry


def batch_constants(
    cfg: ClippedPGLossConfig, inputs: LossInputs, layout: TokenLayout
) -> tuple[TermInputs, torch.Tensor]:
    """The loss's batch constants flattened to ``[N]`` (:func:`~nemo_is_plugin.loss.terms.term_inputs`, the loss's
    own binding) and the aggregation weights ``a [N]``, for log-probs of ``inputs.curr_logprobs``' shape and dtype."""
    c = inputs.curr_logprobs.to(loss_dtype(inputs.curr_logprobs))
    t = term_inputs(cfg, Roles.of_loss_inputs(cfg, inputs, layout, c), layout)
    agg = aggregation_weights(cfg, t.token_mask, inputs.sample_mask.to(t.token_mask.dtype), layout, inputs)
    return t.flat(), agg.reshape(-1)


BatchConstants = Callable[[ClippedPGLossConfig, LossInputs, TokenLayout], tuple[TermInputs, torch.Tensor]]


@dataclass
class TokenLossGradient:
    """``dL/dc`` of the chunk ``sl`` from its log-probs ``c [n]``: ``grad(sl, c) -> [n]`` (fp32, or fp64).

    Build with :meth:`build`: ``constants`` are the loss's batch constants flattened to ``[N]``, ``agg_weight`` the
    aggregation's per-token weights; ``correction`` is the batch's IS correction (reused by the loss's metrics pass).
    The gradient is :func:`chunk_gradient` of the chunk's constants (:meth:`chunk_inputs`).
    """

    constants: TermInputs
    agg_weight: torch.Tensor
    prefix: PrefixCarry | None = None

    @property
    def correction(self) -> ISCorrection | None:
        return self.constants.correction

    @classmethod
    def build(
        cls, loss: ClippedPGLoss, inputs: LossInputs, layout: TokenLayout, constants: BatchConstants | None = None
    ) -> TokenLossGradient:
        """The per-token constants of ``loss`` on ``inputs`` (whose ``curr_logprobs`` only fix shape and dtype), by
        ``constants`` (:func:`batch_constants`, or a compiled form of it)."""
        cfg = loss.config
        why = single_pass_blocker(cfg, layout)
        if why is not None:
            raise ValueError(f"no chunk-by-chunk loss gradient: {why} (use the two-pass path)")
        with torch.no_grad():
            t, agg = (constants or batch_constants)(cfg, inputs, layout)
        return cls(constants=t, agg_weight=agg, prefix=PrefixCarry(cfg, layout) if cfg.objective.causal(cfg) else None)

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

    def chunk_inputs(self, sl: slice) -> tuple[TermInputs, torch.Tensor, ChunkPrefix | None]:
        """The chunk's constants, aggregation weights and prefix state (chunks in order; :meth:`advance` after)."""
        return self.constants.chunk(sl), self.agg_weight[sl], None if self.prefix is None else self.prefix.chunk(sl)

    def advance(self, carry: torch.Tensor | None) -> None:
        """Hand the chunk's prefix carry on to the next chunk (no-op without a cumulative ratio)."""
        if self.prefix is not None and carry is not None:
            self.prefix.carry = carry

    def _grads(self, sl: slice, c: torch.Tensor, trainer_head: torch.Tensor | None):
        t, a, prefix = self.chunk_inputs(sl)
        grad, head_grad, carry = chunk_gradient(t, a, c, trainer_head, prefix)
        self.advance(carry)
        return grad, head_grad

    def chunk_terms(self, sl: slice, c: torch.Tensor, trainer_head: torch.Tensor | None = None) -> torch.Tensor:
        """:func:`chunk_terms` of the chunk ``sl`` (the prefix state advances as in :meth:`_grads`)."""
        t, _, prefix = self.chunk_inputs(sl)
        x, carry = chunk_terms(t, c, trainer_head, prefix)
        self.advance(carry)
        return x


class PrefixCarry:
    """The running per-sequence sums of the cumulative ratio from chunk to chunk (the layout holds whole sequences
    in memory order, so each sequence's tokens are consecutive): :meth:`chunk` gives a chunk's
    :class:`ChunkPrefix`; the anchor of :func:`chunk_terms` then equals the value of
    :func:`~nemo_is_plugin.loss.ratios.policy_log_ratio` on those tokens (before the ``max_log_ratio`` cap) provided
    every chunk is passed once, in order."""

    def __init__(self, config: ClippedPGLossConfig, layout: TokenLayout):
        self.level = config.effective_ratio_level
        self.token_clamp = config.token_log_ratio_clamp
        self.seq = layout.seq_index.reshape(-1)
        self.carry = torch.zeros(layout.num_seqs, dtype=torch.float64, device=self.seq.device)
        self.next_start = 0

    def chunk(self, sl: slice) -> ChunkPrefix:
        """The state of chunk ``sl``, which must start where the previous one stopped."""
        if sl.start != self.next_start:
            raise RuntimeError(f"chunks must be scanned in order: expected start {self.next_start}, got {sl.start}")
        self.next_start = sl.stop
        return ChunkPrefix(self.level, self.token_clamp, self.seq[sl], self.carry)

    def scan(self, sl: slice, x: torch.Tensor) -> torch.Tensor:
        """Inclusive per-sequence prefix sums (fp64) of the chunk's ``x [n]``, continuing the earlier chunks'."""
        sums, self.carry = prefix_scan(self.chunk(sl).seq, x, self.carry)
        return sums


def aggregation_weights(
    cfg: ClippedPGLossConfig,
    token_mask: torch.Tensor,
    sample_mask: torch.Tensor,
    layout: TokenLayout,
    inputs: LossInputs,
) -> torch.Tensor:
    """``a_t = d aggregate(x) / d x_t`` (Float[*T]): the aggregation is linear in ``x``, so one vector-Jacobian
    product at ``x = 1`` gives its weights exactly, whatever the mode and layout (CP shares included). By
    ``torch.func.vjp``: ``torch.compile`` traces it (``loss/compiled.py``), and it ignores the fused forward's no-grad
    mode."""
    seqs = torch.as_tensor(inputs.global_valid_seqs, dtype=token_mask.dtype, device=token_mask.device)
    toks = torch.as_tensor(inputs.global_valid_toks, dtype=token_mask.dtype, device=token_mask.device)

    def aggregate(x: torch.Tensor) -> torch.Tensor:
        return configured_aggregate(
            cfg,
            x,
            token_mask,
            sample_mask,
            layout,
            global_valid_toks=toks,
            global_valid_seqs=seqs,
        )

    pull = torch.func.vjp(aggregate, torch.ones_like(token_mask))[1]
    (a,) = pull(torch.ones((), dtype=token_mask.dtype, device=token_mask.device))
    return a


__all__ = [
    "CAUSAL_LEVELS",
    "ChunkPrefix",
    "PrefixCarry",
    "TokenLossGradient",
    "aggregation_weights",
    "batch_constants",
    "chunk_gradient",
    "chunk_terms",
    "is_token_separable",
    "prefix_scan",
    "single_pass_blocker",
]
