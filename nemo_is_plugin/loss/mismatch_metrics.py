"""Mismatch diagnostics between the training engine (prev log-probs p) and the rollout engine (generation log-probs g).

Every value returned by :func:`mismatch_metric_sums` is *additive*: a local sum divided by a global count, so the
host can sum it over micro-batches and DP ranks. Statistics that are not additive (std, effective sample size,
chi-square, clip rate by position) are derived afterwards, from the summed moments, by :func:`finalize_metrics`.

x_t = p_t - g_t = log(pi_prev / mu) per token, S_i = sum_t m_t x_t per sequence.

- mismatch_kl_k1 = E_tok[g - p]                 k1 estimate of KL(mu || pi_prev) (verl ``kl``, slime ``mismatch_kl``)
- mismatch_kl_k3 = E_tok[e^x - 1 - x]           k3 estimate of the same KL (verl ``k3_kl``, the TIS blog's vllm-kl)
- training_log_ppl / rollout_log_ppl = E_seq[-mean_t p] / E_seq[-mean_t g]
- log_ppl_diff = rollout_log_ppl - ... sign as verl's code: E_seq[mean_t g - mean_t p] = training - rollout log-ppl
- is_token_weight_sq_mean = E_tok[e^{2x}]         -> chi2_token = that - 1 (verl ``chi2_token``)
- is_seq_weight_sq_mean = E_seq[e^{2 S}]          -> chi2_seq = that - 1 (verl ``chi2_seq``)

The chi-square values are the raw estimates E[w^2] - 1, as verl reports them: unbiased over many steps (clipping each
step at 0 would bias their average upwards), and negative when a sample has not seen the weights' rare large values
(E[w^2] < 1 forces the sample mean of w below its expectation 1). ``nemo-is diagnose`` marks and explains a negative
value instead of hiding it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from nemo_is_plugin.loss.layout import TokenLayout
from nemo_is_plugin.loss.masked import EPS, where_mask
from nemo_is_plugin.loss.objectives import OBJECTIVES

# Position buckets (1-based position among unmasked tokens) for the clip rate by position.
POSITION_BUCKETS = (1, 16, 128, 1024, 8192)


def bucket_names() -> list[str]:
    edges = list(POSITION_BUCKETS) + [None]
    return [f"{lo}_{hi}" if hi is not None else f"{lo}_inf" for lo, hi in zip(edges[:-1], edges[1:])]


def mismatch_metric_sums(
    prev: torch.Tensor,
    gen: torch.Tensor,
    token_mask: torch.Tensor,
    sample_mask: torch.Tensor,
    layout: TokenLayout,
    global_valid_toks: torch.Tensor | float,
    global_valid_seqs: torch.Tensor | float,
) -> dict[str, torch.Tensor]:
    """Additive mismatch metrics (0-d float64 tensors, already this process's share under CP).

    Args:
        prev, gen: Float[*T] training / rollout log-probs. token_mask: Float[*T]. sample_mask: Float[S].
    """
    token_means, seq_means = mismatch_metric_sums_by_count(
        prev, gen, token_mask, sample_mask, layout, global_valid_toks, global_valid_seqs
    )
    return {**token_means, **seq_means}


@torch.no_grad()
def mismatch_metric_sums_by_count(
    prev: torch.Tensor,
    gen: torch.Tensor,
    token_mask: torch.Tensor,
    sample_mask: torch.Tensor,
    layout: TokenLayout,
    global_valid_toks: torch.Tensor | float,
    global_valid_seqs: torch.Tensor | float,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """:func:`mismatch_metric_sums` split by the global count each is divided by: (token means, sequence means)."""
    p, g = prev.double(), gen.double()
    valid = token_mask.double() * layout.to_tokens(sample_mask.double())
    x = where_mask(p - g, valid)
    n_tok = torch.as_tensor(global_valid_toks, dtype=torch.float64, device=p.device) + EPS
    n_seq = torch.as_tensor(global_valid_seqs, dtype=torch.float64, device=p.device) + EPS
    token_means = {
        "mismatch_kl_k1": where_mask(g - p, valid).sum() / n_tok,
        "mismatch_kl_k3": where_mask(torch.expm1(x) - x, valid).sum() / n_tok,
        "is_token_weight_sq_mean": where_mask(torch.exp(2 * x), valid).sum() / n_tok,
    }
    count = layout.seq_sum(token_mask.double())
    seq_valid = sample_mask.double() * (count > 0).double()
    mean_p = layout.seq_sum(where_mask(p, token_mask)) / (count + EPS)
    mean_g = layout.seq_sum(where_mask(g, token_mask)) / (count + EPS)
    seq_x = layout.seq_sum(x)

    def per_seq(v: torch.Tensor) -> torch.Tensor:
        return layout.replicated_share(where_mask(v, seq_valid).sum()) / n_seq

    seq_means = {
        "training_log_ppl": per_seq(-mean_p),
        "rollout_log_ppl": per_seq(-mean_g),
        "log_ppl_diff": per_seq(mean_g - mean_p),
        "log_ppl_abs_diff": per_seq((mean_g - mean_p).abs()),
        "is_seq_weight_sq_mean": per_seq(torch.exp(2 * seq_x)),
    }
    return token_means, seq_means


def finalize_metrics(metrics: Mapping[str, float]) -> dict[str, float]:
    """Derive the non-additive statistics from summed, additive metrics (call once per step, after summing).

    Adds, where their inputs are present: ``is_weight_std``, ``is_weight_ess`` (normalised effective sample size
    (E w)^2 / E[w^2] in (0, 1]), the same for ``is_raw_weight_*``, ``chi2_token``, ``chi2_seq``,
    ``clip_rate/pos_<bucket>`` (clipped tokens / tokens at those positions), ``score_centering_share``
    (``loss/score_centering.py``) and each policy objective's own (``PolicyObjective.finalize``).
    """
    out = dict(metrics)
    for prefix in ("is_weight", "is_raw_weight"):
        mean, sq = metrics.get(f"{prefix}_mean"), metrics.get(f"{prefix}_sq_mean")
        if mean is None or sq is None:
            continue
        out[f"{prefix}_std"] = math.sqrt(max(sq - mean * mean, 0.0))
        out[f"{prefix}_ess"] = (mean * mean / sq) if sq > 0 else 0.0
    if "is_token_weight_sq_mean" in metrics:
        out["chi2_token"] = metrics["is_token_weight_sq_mean"] - 1.0
    if "is_seq_weight_sq_mean" in metrics:
        out["chi2_seq"] = metrics["is_seq_weight_sq_mean"] - 1.0
    for name in bucket_names():
        clipped, tokens = metrics.get(f"clip_frac/pos_{name}"), metrics.get(f"token_frac/pos_{name}")
        if clipped is not None and tokens:
            out[f"clip_rate/pos_{name}"] = clipped / tokens
    for objective in OBJECTIVES.values():
        out.update(objective.finalize(metrics))
    sc, pg = metrics.get("score_centering_grad_abs"), metrics.get("score_centering_pg_grad_abs")
    if sc is not None and pg is not None:  # score centering's share of the head-score coefficients
        out["score_centering_share"] = sc / (sc + pg) if sc + pg > 0 else 0.0
    return out
