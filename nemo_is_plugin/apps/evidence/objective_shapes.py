"""Shape properties of three objectives (docs/evidence.md, 4), measured with the plugin's functions:

- SAPO: the gradient weight w(r) of its soft gate against PPO clip's hard clip and the unclipped ratio, where the
  per-token loss's derivative is dL/dc = -A w(r) / N (N tokens, token-mean): the unclipped ratio has w = r, PPO's clip
  w = r inside its band and 0 beyond it on the side the advantage pushes, SAPO w = 4 sigmoid'(tau (r - 1)) r, which
  is 1 at r = 1. Measured by autograd through ``ClippedPGLoss`` on a grid of ratios.
- GMPO: the spread across sequences of its sequence ratio exp(mean_t clipped d_t) against GSPO's exp(mean_t d_t)
  (``policy_log_ratio("sequence")``) and the token ratio, as the response length grows (:func:`run_gmpo_spread`).
- CPPO: where the prefix budget runs out as the length grows, and its limit: the budget drops tokens the per-token rule
  keeps, fewer as the budget floor delta_b grows, none from delta_b = 1 on (b W_k >= W_k >= S_k since D <= 1), where
  the mask is the per-token one of ``delta_b = inf`` (:func:`run_cppo_budget`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from nemo_is_plugin.apps.evidence.objectives import (
    OBJECTIVE_CONFIGS,
    UNTRUNCATED,
    DriftBatch,
    loss_gradient,
    make_batch,
    objective_config,
    with_objective_only,
)
from nemo_is_plugin.loss import ClippedPGLoss, LossInputs
from nemo_is_plugin.loss.layout import TokenLayout
from nemo_is_plugin.loss.objectives.cppo import CppoKeys, cppo_mask
from nemo_is_plugin.loss.objectives.gmpo import GmpoKeys, gmpo_surrogate
from nemo_is_plugin.loss.ratios import policy_log_ratio

LENGTHS = (16, 32, 64, 128, 256, 512)
GMPO_DRIFT = 0.5  # logit drift of the GMPO spread (mean |log r| ~0.2 on these batches)
CPPO_DRIFTS = (0.1, 0.3, 1.0)  # the budget barely, often and always engaged
DELTA_B = (0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)
ANCHOR_PROB = 0.01  # pi_old of the SAPO grid's tokens: low enough that r up to 1 / ANCHOR_PROB is a probability
RATIO_GRID = tuple(float(r) for r in np.round(np.linspace(0.05, 5.0, 100), 6)) + (1.0,)


def gradient_weights(config: dict, ratios: torch.Tensor, advantage: float) -> torch.Tensor:
    """w(r) = -(N / A) dL/dc of ``ClippedPGLoss(config)`` on one sequence of tokens with ratios ``ratios``
    (Float64[R]) and advantage ``advantage`` each. -> Float64[R]."""
    anchor = torch.full_like(ratios, float(np.log(ANCHOR_PROB)))[None, :]
    curr = (anchor + ratios.log()[None, :]).clone().requires_grad_(True)
    adv = torch.full_like(anchor, advantage)
    ones = torch.ones_like(anchor)
    n = ratios.numel()
    inputs = LossInputs(curr, anchor, anchor, None, adv, ones, ones[:, 0], 1.0, float(n))
    loss, _ = ClippedPGLoss(with_objective_only(config)).compute(inputs, TokenLayout.padded(1, n, device=ratios.device))
    (grad,) = torch.autograd.grad(loss, curr)
    return -grad[0] * n / advantage


def run_sapo_gate(ratios: Sequence[float] = RATIO_GRID) -> dict:
    """SAPO's, PPO clip's and the unclipped ratio's gradient weight on ``ratios``, for A = +1 and A = -1."""
    r = torch.tensor(sorted(set(ratios)), dtype=torch.float64)
    curves = {}
    for name, config in (
        ("sapo", OBJECTIVE_CONFIGS["sapo"]),
        ("ppo_clip", OBJECTIVE_CONFIGS["ppo_clip"]),
        ("unclipped", UNTRUNCATED),
    ):
        curves[name] = {
            sign: gradient_weights(dict(config), r, a).tolist() for sign, a in (("pos", 1.0), ("neg", -1.0))
        }
    return {"ratios": r.tolist(), "configs": {"sapo": OBJECTIVE_CONFIGS["sapo"]}, "weights": curves}


def sequence_ratios(batch: DriftBatch, drift: float, clip: float) -> dict[str, torch.Tensor]:
    """Token ratios r [B, L], GSPO's sequence ratio exp(mean d) [B] and GMPO's exp(mean clipped d) [B] (clip
    ``clip`` on both sides) at logit drift ``drift``, by the plugin's ratio and GMPO functions."""
    with torch.no_grad():
        curr = batch.token_logprobs(batch.logits(drift))
        anchor = batch.old_logprobs()
        mask = torch.ones_like(curr)
        layout = TokenLayout.padded(*batch.shape, device=curr.device)
        gspo = policy_log_ratio("sequence", curr, anchor, mask, layout)[:, 0].exp()
        gmpo = gmpo_surrogate(curr, anchor, batch.advantages, mask, layout, clip_low=clip, clip_high=clip)
        assert gmpo.clipped_ratio is not None  # GMPO's clipped sequence ratio
        return {"token": (curr - anchor).exp(), "gspo": gspo, "gmpo": gmpo.clipped_ratio[:, 0]}


def run_gmpo_spread(
    *, num_seqs: int = 64, lengths: Sequence[int] = LENGTHS, drift: float = GMPO_DRIFT, seed: int = 0
) -> dict:
    """Spread of the token, GSPO and GMPO ratios at each length (one batch per length).

    GMPO clips d only on the side the advantage pushes, so its sequence ratio sits below GSPO's for A > 0 and above
    for A < 0: ``std`` is the spread within each advantage sign (pooled: sqrt of the mean of the two variances),
    ``mean_pos`` / ``mean_neg`` the mean ratio of each sign.
    """
    clip = GmpoKeys.of(objective_config("gmpo")).gmpo_clip_high
    assert clip is not None  # the config refuses gmpo without it
    keys = ("std", "mean_pos", "mean_neg")
    out: dict[str, dict[str, list[float]]] = {k: {s: [] for s in keys} for k in ("token", "gspo", "gmpo")}
    for i, length in enumerate(lengths):
        batch = make_batch(num_seqs=num_seqs, length=length, seed=seed + 1000 * i)
        positive = batch.advantages[:, 0] > 0
        for key, r in sequence_ratios(batch, drift, clip).items():
            groups = [r[positive], r[~positive]]
            out[key]["std"].append(float(torch.stack([g.var() for g in groups]).mean().sqrt()))
            out[key]["mean_pos"].append(float(groups[0].mean()))
            out[key]["mean_neg"].append(float(groups[1].mean()))
    return {"lengths": list(lengths), "drift": drift, "clip": clip, "num_seqs": num_seqs, "ratios": out}


def per_token_disagreement(batch: DriftBatch, drift: float, delta_b: float) -> float:
    """Share of tokens where CPPO's mask at budget floor ``delta_b`` differs from its per-token mask
    (``delta_b = inf``), both from :func:`~nemo_is_plugin.loss.objectives.cppo.cppo_mask`."""
    curr = batch.token_logprobs(batch.logits(drift)).detach()
    anchor = batch.old_logprobs()
    mask = torch.ones_like(curr)
    layout = TokenLayout.padded(*batch.shape, device=curr.device)
    cfg = CppoKeys.of(objective_config("cppo"))
    budget, token = (
        cppo_mask(curr, anchor, batch.advantages, mask, layout, delta=cfg.cppo_delta, w_min=cfg.cppo_w_min, delta_b=b)
        for b in (delta_b, float("inf"))
    )
    return float((budget.mask.keep != token.mask.keep).double().mean())


def run_cppo_budget(
    *,
    num_seqs: int = 64,
    lengths: Sequence[int] = LENGTHS,
    drifts: Sequence[float] = CPPO_DRIFTS,
    delta_b: Sequence[float] = DELTA_B,
    limit_length: int = 64,
    seed: int = 0,
) -> dict:
    """CPPO's budget metrics (the loss's ``cppo_budget_*``) per drift and length, and the limit in delta_b.

    ``by_length[drift][metric]``: lists over ``lengths``; ``limit``: over ``delta_b`` at ``limit_length`` tokens
    and the largest drift, the loss's ``cppo_budget_bound_fraction`` and the direct mask disagreement.
    """
    metrics = (
        "cppo_budget_exhausted_seq_fraction",
        "cppo_budget_exhausted_position_fraction",
        "cppo_budget_bound_fraction",
        "clip_fraction",
    )
    batches = [make_batch(num_seqs=num_seqs, length=n, seed=seed + 1000 * i) for i, n in enumerate(lengths)]
    by_length: dict[str, dict[str, list[float]]] = {}
    for drift in drifts:
        rows: dict[str, list[float]] = {m: [] for m in metrics}
        for batch in batches:
            values, _ = loss_gradient(batch, drift, OBJECTIVE_CONFIGS["cppo"])
            for m in metrics:
                rows[m].append(values[m])
        by_length[f"{drift:g}"] = rows
    limit_drift = drifts[-1]
    batch = make_batch(num_seqs=num_seqs, length=limit_length, seed=seed + 7)
    bound, disagreement = [], []
    for b in delta_b:
        values, _ = loss_gradient(batch, limit_drift, {**OBJECTIVE_CONFIGS["cppo"], "cppo_delta_b": b})
        bound.append(values["cppo_budget_bound_fraction"])
        disagreement.append(per_token_disagreement(batch, limit_drift, b))
    return {
        "lengths": list(lengths),
        "drifts": list(drifts),
        "num_seqs": num_seqs,
        "by_length": by_length,
        "limit": {
            "length": limit_length,
            "drift": limit_drift,
            "delta_b": list(delta_b),
            "budget_bound_fraction": bound,
            "mask_disagreement": disagreement,
        },
    }
