"""Experiment 5 (docs/evidence.md, 5): what each IS rejection rule (``importance_sampling_rejection_rules``,
:mod:`nemo_is_plugin.loss.rejection`) rejects as the rollout mismatch between pi_prev and mu grows.

The batch (:func:`make_batch`): B sequences of L tokens, K actions per position. The rollout policy
mu = softmax(theta), theta ~ N(0, logit_scale^2); the tokens are drawn from mu once (Gumbel-max). The trainer's old
policy is pi_prev = softmax(theta + m eta) with eta a *heavy-tailed* (Student-t, df 3) per-logit direction: most
tokens move a little, a few move by several nats, at low and at high probability alike. The mismatch scale m moves
pi_prev away from mu along the same path with the same tokens (m = 0: pi_prev = mu exactly).

Each statistic (k1 / k2 / k3 of y = log(pi_prev / mu), and prob_diff = |pi_prev - mu|) runs as a ``token`` rule with
a threshold *matched* at the reference mismatch :data:`REFERENCE_MISMATCH`: the (1 - :data:`TARGET_FRACTION`)
quantile of the rule's own per-token statistic there (k1 is signed: its band is [-c, c] with c the quantile of |k1|).
So every rule rejects the same share of tokens at the reference, and the sweep shows how they part elsewhere and which
tokens each picks. k2 = y^2 / 2 with a matched threshold is the same band on |y| as k1: the two reject the same set.

Measured with :func:`~nemo_is_plugin.loss.rejection.evaluate_rule` on validated
:class:`~nemo_is_plugin.config.RejectionRule` s (the function the loss applies), per mismatch:

- ``rejected_fraction``: the share of tokens the rule rejects;
- ``low_prob_share``: the share of the rejected tokens that are rare under the sampler, mu < 0.1 (for such a token
  |pi_prev - mu| <= max(pi_prev, mu), small unless pi_prev raised it a lot, whatever its log-ratio).

The sequence panel (:func:`run_sequence_lengths`) fixes the mismatch at the reference and sweeps the length with one
fresh batch per length: ``sequence_mean`` and ``sequence_max`` of k3 and prob_diff, thresholds matched to reject
:data:`TARGET_SEQUENCE_FRACTION` of the sequences at the shortest length.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from nemo_is_plugin.config import RejectionRule
from nemo_is_plugin.config.rejection_rule import REJECTION_LOG_RATIO_CLAMP
from nemo_is_plugin.loss.layout import TokenLayout
from nemo_is_plugin.loss.rejection import Rule, RuleOutcome, evaluate_rule

MISMATCHES = (0.0, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 1.0, 1.5, 2.0)
REFERENCE_MISMATCH = 0.5  # one of MISMATCHES: every statistic's threshold is matched here
HEADLINE_MISMATCHES = (0.2, 0.5, 2.0)  # the table quotes the rejected fractions here (among MISMATCHES)
TARGET_FRACTION = 0.05  # the share of tokens each token rule rejects at the reference mismatch
TARGET_SEQUENCE_FRACTION = 0.2  # the share of sequences each sequence rule rejects at the shortest length
LOW_PROB = 0.1  # a token is rare when mu (the probability it was sampled with) < LOW_PROB
STATISTICS = ("k1", "k2", "k3", "prob_diff")
SEQUENCE_STATISTICS = ("k3", "prob_diff")
SEQUENCE_AGGREGATIONS = ("sequence_mean", "sequence_max")
LENGTHS = (8, 16, 32, 64, 128, 256, 512)
TAIL_DF = 3  # Student-t degrees of freedom of the logit direction eta (integer: drawn as a normal over a chi)


@dataclass(frozen=True)
class MismatchBatch:
    """A synthetic batch (module docstring). logits (mu's), direction (eta): Float64[B, L, K]; tokens: Long[B, L]."""

    logits: torch.Tensor
    direction: torch.Tensor
    tokens: torch.Tensor

    def rollout_logprobs(self) -> torch.Tensor:
        """log mu of the tokens. Float64[B, L]."""
        return torch.log_softmax(self.logits, -1).gather(-1, self.tokens[..., None]).squeeze(-1)

    def prev_logprobs(self, mismatch: float) -> torch.Tensor:
        """log pi_prev of the tokens at mismatch scale m: log softmax(theta + m eta). Float64[B, L]."""
        lp = torch.log_softmax(self.logits + mismatch * self.direction, -1)
        return lp.gather(-1, self.tokens[..., None]).squeeze(-1)


def make_batch(
    *, num_seqs: int = 128, length: int = 128, num_actions: int = 16, logit_scale: float = 2.0, seed: int = 0
) -> MismatchBatch:
    """Draw a :class:`MismatchBatch` (module docstring); the same seed gives the same batch."""
    g = torch.Generator().manual_seed(seed)
    shape = (num_seqs, length, num_actions)
    logits = logit_scale * torch.randn(shape, generator=g, dtype=torch.float64)
    # Student-t with TAIL_DF degrees of freedom: a normal over sqrt(chi^2_df / df).
    chi2 = torch.randn((TAIL_DF, *shape), generator=g, dtype=torch.float64).square().sum(0)
    direction = torch.randn(shape, generator=g, dtype=torch.float64) / torch.sqrt(chi2 / TAIL_DF)
    gumbel = -torch.log(-torch.log(torch.rand(shape, generator=g, dtype=torch.float64)))
    tokens = (logits + gumbel).argmax(-1)
    return MismatchBatch(logits, direction, tokens)


def token_rule(statistic: str, threshold: float) -> RejectionRule:
    """The validated ``token`` rule of ``statistic`` at ``threshold`` (k1: the symmetric band [-c, c])."""
    low = -threshold if statistic == "k1" else None
    return RejectionRule(statistic=statistic, aggregation="token", min=low, max=threshold)


def apply_rule(rule: RejectionRule | Rule, prev: torch.Tensor, gen: torch.Tensor) -> RuleOutcome:
    """``evaluate_rule`` on a padded [B, L] batch whose every token is valid."""
    ones = torch.ones_like(prev)
    num_seqs, length = prev.shape
    return evaluate_rule(rule, prev, gen, ones, TokenLayout.padded(num_seqs, length, device=prev.device))


def matched_threshold(statistic: str, aggregation: str, prev: torch.Tensor, gen: torch.Tensor, fraction: float):
    """The threshold at which the ``statistic`` / ``aggregation`` rule rejects ``fraction`` of the tokens (``token``)
    or sequences: the (1 - fraction) quantile of the rule's own statistic (|k1| for k1, whose band is symmetric)."""
    clamp = None if statistic == "prob_diff" else REJECTION_LOG_RATIO_CLAMP  # the validated rule's default
    outcome = apply_rule(Rule(statistic, aggregation, log_ratio_clamp=clamp), prev, gen)  # no bounds: the statistic
    values = outcome.token_stat if outcome.seq_stat is None else outcome.seq_stat
    values = values.abs() if statistic == "k1" else values
    return float(torch.quantile(values.reshape(-1), 1.0 - fraction))


def rejection_summary(rule: RejectionRule, prev: torch.Tensor, gen: torch.Tensor) -> dict[str, float]:
    """What the rule rejects on (prev, gen): the rejected share of tokens and the share of those that are rare."""
    rejected = ~apply_rule(rule, prev, gen).keep
    rare = gen < math.log(LOW_PROB)
    count = int(rejected.sum())
    return {
        "rejected_fraction": float(rejected.double().mean()),
        "low_prob_share": float((rejected & rare).sum()) / count if count else 0.0,
        "rejected_count": count,
    }


def run_mismatch_sweep(
    batch: MismatchBatch, mismatches: Sequence[float] = MISMATCHES, progress: Callable[[str], None] | None = None
) -> dict:
    """Every statistic's token rule, matched at :data:`REFERENCE_MISMATCH`, at every mismatch on the same batch."""
    gen = batch.rollout_logprobs()
    ref_prev = batch.prev_logprobs(REFERENCE_MISMATCH)
    thresholds = {s: matched_threshold(s, "token", ref_prev, gen, TARGET_FRACTION) for s in STATISTICS}
    rules = {s: token_rule(s, c) for s, c in thresholds.items()}
    rows: dict[str, dict[str, list[float]]] = {s: {} for s in STATISTICS}
    all_low = float((gen < math.log(LOW_PROB)).double().mean())  # the tokens are mu's: the same at every m
    for m in mismatches:
        if progress:
            progress(f"rejection: mismatch {m:g}")
        prev = batch.prev_logprobs(m)
        for s, rule in rules.items():
            for key, value in rejection_summary(rule, prev, gen).items():
                rows[s].setdefault(key, []).append(value)
    num_seqs, length = batch.tokens.shape
    return {
        "mismatches": list(mismatches),
        "reference_mismatch": REFERENCE_MISMATCH,
        "target_fraction": TARGET_FRACTION,
        "low_prob": LOW_PROB,
        "num_seqs": num_seqs,
        "length": length,
        "num_actions": int(batch.logits.shape[-1]),
        "thresholds": thresholds,
        "low_prob_share_all_tokens": all_low,
        "statistics": rows,
    }


def run_sequence_lengths(
    *, num_seqs: int = 128, lengths: Sequence[int] = LENGTHS, seed: int = 0, mismatch: float = REFERENCE_MISMATCH
) -> dict:
    """``sequence_mean`` vs ``sequence_max`` rules of k3 and prob_diff: the rejected share of sequences per length at
    a fixed per-token mismatch, thresholds matched at the shortest length (one fresh batch per length)."""
    batches = [make_batch(num_seqs=num_seqs, length=n, seed=seed + i) for i, n in enumerate(lengths)]
    pairs = [(b.prev_logprobs(mismatch), b.rollout_logprobs()) for b in batches]
    out: dict = {"lengths": list(lengths), "mismatch": mismatch, "num_seqs": num_seqs}
    out["target_fraction"] = TARGET_SEQUENCE_FRACTION
    out["thresholds"], out["rejected_sequence_fraction"] = {}, {}
    for s in SEQUENCE_STATISTICS:
        for agg in SEQUENCE_AGGREGATIONS:
            name = f"{agg}_{s}"
            c = matched_threshold(s, agg, *pairs[0], TARGET_SEQUENCE_FRACTION)
            rule = RejectionRule(statistic=s, aggregation=agg, max=c)
            # a sequence rule keeps or rejects all of a sequence's tokens: its first token says which
            fractions = [float((~apply_rule(rule, prev, gen).keep[:, 0]).double().mean()) for prev, gen in pairs]
            out["thresholds"][name] = c
            out["rejected_sequence_fraction"][name] = fractions
    return out


def run_rejection(
    *,
    num_seqs: int = 128,
    length: int = 128,
    lengths: Sequence[int] = LENGTHS,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> dict:
    """The mismatch sweep and the sequence-length panel. Returns a JSON-ready dict."""
    sweep = run_mismatch_sweep(make_batch(num_seqs=num_seqs, length=length, seed=seed), progress=progress)
    if progress:
        progress("rejection: sequence lengths")
    seq = run_sequence_lengths(num_seqs=num_seqs, lengths=lengths, seed=seed + 1)
    return {"mismatch_sweep": sweep, "sequence_lengths": seq}


def step_count(mismatches: Sequence[float] = MISMATCHES) -> int:
    """Progress messages :func:`run_rejection` emits (without the runner's plotting step)."""
    return len(mismatches) + 1


def headline(result: dict) -> dict[str, dict[str, float]]:
    """Per rule, the numbers the CLI's table and docs/evidence.md quote: property label -> value."""
    sweep, seq = result["mismatch_sweep"], result["sequence_lengths"]
    m = sweep["mismatches"]
    i_ref = m.index(sweep["reference_mismatch"])
    ref = f"m={sweep['reference_mismatch']:g}"
    out: dict[str, dict[str, float]] = {}
    for s, row in sweep["statistics"].items():
        out[f"token_{s}"] = {
            "matched threshold": sweep["thresholds"][s],
            **{f"rejected fraction at m={v:g}": row["rejected_fraction"][m.index(v)] for v in HEADLINE_MISMATCHES},
            f"rare share of rejected at {ref}": row["low_prob_share"][i_ref],
        }
    out["all tokens"] = {"rare share": sweep["low_prob_share_all_tokens"]}
    lengths = seq["lengths"]
    for name, fractions in seq["rejected_sequence_fraction"].items():
        out[name] = {
            f"rejected sequences at L={lengths[0]}": fractions[0],
            f"rejected sequences at L={lengths[-1]}": fractions[-1],
        }
    return out
