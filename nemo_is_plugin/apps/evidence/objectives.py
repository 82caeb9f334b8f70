"""Experiment 4 (docs/evidence.md, 4): one measured property per ``policy_objective``, on synthetic batches whose
current policy pi has drifted a controlled distance from pi_old.

The batch (:func:`make_batch`): B sequences of L tokens, K actions per position. pi_old = softmax(theta_old) with
theta_old ~ N(0, logit_scale^2); the rollout policy mu = softmax(theta_old + mismatch eta) (a small fixed engine
mismatch); the tokens are drawn from mu once (Gumbel-max), so every objective and every drift sees the same tokens;
the advantage is one N(0, 1) draw per sequence (GRPO-like). The current policy is pi_s = softmax(theta_old + s eps)
with one fixed direction eps ~ N(0, 1): the logit drift s moves pi away from pi_old along the same path for every s.

At each drift the whole :class:`~nemo_is_plugin.loss.ClippedPGLoss`, configured with each objective
(:data:`OBJECTIVE_CONFIGS`), gives the loss's own metrics (``clip_fraction``: dropped or clipped tokens) and, by
autograd, the batch gradient with respect to the logits. The reference is the *untruncated policy gradient*: the
gradient of the token-mean of -A r (``ppo_clip`` with a band no ratio leaves). The sweep records, per objective:

- ``clip_fraction``: the share of tokens the objective drops or clips (PPO: the clipped branch is active);
- ``deviation``: ||g - g_pg|| / ||g_pg||, how far the batch gradient is from the untruncated one;
- ``grad_norm``: ||g||;
- ``pull_back``: <g, grad P> / ||grad P|| with P = token-mean (log r)^2 / 2: how fast a descent step along -g
  reduces the drift (positive: pulled back toward pi_old). DRO's penalty beta/2 (log r)^2 adds beta ||grad P||.

The shape properties (SAPO's gate, GMPO's spread, CPPO's budget) are in :mod:`.objective_shapes`; the whole run and
its headline numbers in :mod:`.objective_experiment`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from nemo_is_plugin.loss import ClippedPGLoss, LossInputs
from nemo_is_plugin.loss.config_model import ClippedPGLossConfig, load_loss_config
from nemo_is_plugin.loss.layout import TokenLayout

DRIFTS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 1.0, 1.5, 2.0, 3.0)
# The thresholds each objective runs with: the sources' defaults (docs/objectives.md), and two DRO penalties.
OBJECTIVE_CONFIGS: dict[str, dict[str, object]] = {
    "ppo_clip": {"ratio_clip_min": 0.2, "ratio_clip_max": 0.2},
    "dppo_tv": {"policy_objective": "dppo_tv", "dppo_delta_low": 0.2, "dppo_delta_high": 0.28},
    "dppo_kl": {"policy_objective": "dppo_kl", "dppo_delta_low": 0.2, "dppo_delta_high": 0.28},
    "prob_diff": {"policy_objective": "prob_diff", "prob_diff_threshold": 0.1},
    "cppo": {"policy_objective": "cppo", "cppo_delta": 0.2, "cppo_w_min": 0.8, "cppo_delta_b": 0.02},
    "sapo": {"policy_objective": "sapo", "sapo_tau_pos": 1.0, "sapo_tau_neg": 1.05},
    "gmpo": {
        "policy_objective": "gmpo",
        "gmpo_clip_low": 0.4,
        "gmpo_clip_high": 0.4,
        "loss_aggregation": "seq-mean-token-mean",
    },
    "gpg": {"policy_objective": "gpg"},
    "dro (beta 0.5)": {"policy_objective": "dro", "dro_beta": 0.5},
    "dro (beta 2)": {"policy_objective": "dro", "dro_beta": 2.0},
}
# The untruncated policy gradient -A r: ratio_clip_min = 1 puts the band's lower edge at 0, no ratio leaves it.
UNTRUNCATED = {"ratio_clip_min": 1.0, "ratio_clip_max": 1e9}
# Thresholds no token reaches (|p - q| <= 1; the binary KL of these batches stays far below 1e6): the masks keep all.
UNREACHABLE_THRESHOLDS: dict[str, dict[str, object]] = {
    "dppo_tv": {"policy_objective": "dppo_tv", "dppo_delta_low": 1e6, "dppo_delta_high": 1e6, "dppo_ratio_cap": 1e9},
    "dppo_kl": {"policy_objective": "dppo_kl", "dppo_delta_low": 1e6, "dppo_delta_high": 1e6, "dppo_ratio_cap": 1e9},
    "prob_diff": {"policy_objective": "prob_diff", "prob_diff_threshold": 1.0},
    "cppo": {"policy_objective": "cppo", "cppo_delta": 1.0, "cppo_delta_b": 1.0},
}


@dataclass(frozen=True)
class DriftBatch:
    """A synthetic batch (module docstring). old_logits, direction: Float64[B, L, K]; tokens: Long[B, L];
    rollout_logprobs (log mu of the tokens), advantages: Float64[B, L]."""

    old_logits: torch.Tensor
    direction: torch.Tensor
    tokens: torch.Tensor
    rollout_logprobs: torch.Tensor
    advantages: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return self.tokens.shape[0], self.tokens.shape[1]

    def logits(self, drift: float) -> torch.Tensor:
        """theta_old + drift eps: the current policy's logits at logit drift ``drift``. Float64[B, L, K]."""
        return self.old_logits + drift * self.direction

    def token_logprobs(self, logits: torch.Tensor) -> torch.Tensor:
        """log softmax(logits) of the batch's tokens. Float64[B, L] (differentiable in ``logits``)."""
        return torch.log_softmax(logits, -1).gather(-1, self.tokens[..., None]).squeeze(-1)

    def old_logprobs(self) -> torch.Tensor:
        return self.token_logprobs(self.old_logits)


def make_batch(
    *,
    num_seqs: int = 64,
    length: int = 64,
    num_actions: int = 16,
    logit_scale: float = 2.0,
    rollout_mismatch: float = 0.05,
    seed: int = 0,
) -> DriftBatch:
    """Draw a :class:`DriftBatch` (module docstring); the same seed gives the same batch."""
    g = torch.Generator().manual_seed(seed)
    shape = (num_seqs, length, num_actions)
    old = logit_scale * torch.randn(shape, generator=g, dtype=torch.float64)
    direction = torch.randn(shape, generator=g, dtype=torch.float64)
    rollout = old + rollout_mismatch * torch.randn(shape, generator=g, dtype=torch.float64)
    gumbel = -torch.log(-torch.log(torch.rand(shape, generator=g, dtype=torch.float64)))
    tokens = (rollout + gumbel).argmax(-1)
    adv = torch.randn(num_seqs, 1, generator=g, dtype=torch.float64).expand(num_seqs, length).contiguous()
    rollout_lp = torch.log_softmax(rollout, -1).gather(-1, tokens[..., None]).squeeze(-1)
    return DriftBatch(old, direction, tokens, rollout_lp, adv)


def loss_gradient(
    batch: DriftBatch, drift: float, config: Mapping[str, object], *, anchor: torch.Tensor | None = None
) -> tuple[dict[str, float], torch.Tensor]:
    """``ClippedPGLoss(config)`` on the batch at logit drift ``drift``: its metrics and its gradient with respect to
    the current logits (Float64[B, L, K]). ``anchor`` replaces pi_old's log-probs (default: the batch's pi_old)."""
    num_seqs, length = batch.shape
    theta = batch.logits(drift).clone().requires_grad_(True)
    curr = batch.token_logprobs(theta)
    ones = torch.ones_like(batch.advantages)
    inputs = LossInputs(
        curr_logprobs=curr,
        prev_logprobs=batch.old_logprobs() if anchor is None else anchor,
        generation_logprobs=batch.rollout_logprobs,
        reference_logprobs=None,
        advantages=batch.advantages,
        token_mask=ones,
        sample_mask=ones[:, 0],
        global_valid_seqs=float(num_seqs),
        global_valid_toks=float(num_seqs * length),
    )
    layout = TokenLayout.padded(num_seqs, length, device=curr.device)
    loss, metrics = ClippedPGLoss(with_objective_only(config)).compute(inputs, layout)
    (grad,) = torch.autograd.grad(loss, theta)
    return dict(metrics), grad


def with_objective_only(config: Mapping[str, object]) -> dict[str, object]:
    """``config`` with the KL penalty off: the KL term is the same for every objective, the objective is measured."""
    return {"reference_policy_kl_penalty": 0.0, **config}


def objective_config(name: str) -> ClippedPGLossConfig:
    """The validated loss config of :data:`OBJECTIVE_CONFIGS` ``[name]`` (typed keys for direct function calls)."""
    return load_loss_config(with_objective_only(OBJECTIVE_CONFIGS[name]))


def drift_gradient(batch: DriftBatch, drift: float) -> torch.Tensor:
    """grad_theta P, P = token-mean of (log r)^2 / 2 at logit drift ``drift``: the direction that increases the
    drift (a step along -grad P pulls pi back toward pi_old). Float64[B, L, K]."""
    theta = batch.logits(drift).clone().requires_grad_(True)
    d = batch.token_logprobs(theta) - batch.old_logprobs()
    (grad,) = torch.autograd.grad(0.5 * (d * d).mean(), theta)
    return grad


def drift_summary(batch: DriftBatch, drift: float) -> dict[str, float]:
    """How far pi_s is from pi_old on the batch's tokens: mean |log r| and mean |p - q|."""
    with torch.no_grad():
        c, a = batch.token_logprobs(batch.logits(drift)), batch.old_logprobs()
    return {
        "mean_abs_log_ratio": float((c - a).abs().mean()),
        "mean_abs_prob_diff": float((c.exp() - a.exp()).abs().mean()),
    }


def run_drift_sweep(
    batch: DriftBatch,
    drifts: Sequence[float] = DRIFTS,
    configs: Mapping[str, Mapping[str, object]] = OBJECTIVE_CONFIGS,
    progress: Callable[[str], None] | None = None,
) -> dict:
    """Every objective at every drift on the same batch. Returns a JSON-ready dict of lists over ``drifts``."""
    rows: dict[str, dict[str, list[float]]] = {name: {} for name in configs}
    summaries: dict[str, list[float]] = {}
    pg_norms = []
    for drift in drifts:
        if progress:
            progress(f"objectives: drift {drift:g}")
        for key, value in drift_summary(batch, drift).items():
            summaries.setdefault(key, []).append(value)
        _, g_pg = loss_gradient(batch, drift, UNTRUNCATED)
        g_drift = drift_gradient(batch, drift)
        pg_norm, drift_norm = float(g_pg.norm()), float(g_drift.norm())
        pg_norms.append(pg_norm)
        for name, config in configs.items():
            metrics, g = loss_gradient(batch, drift, config)
            # <g, grad P> / ||grad P||: a descent step -eta g changes P by -eta <g, grad P>; 0 at drift 0, where P
            # is flat (grad P = 0 exactly).
            pull = float((g * g_drift).sum() / drift_norm) if drift_norm > 0 else 0.0
            for key, value in (
                ("clip_fraction", metrics.get("clip_fraction", 0.0)),  # none: it drops no token (SAPO, GPG, DRO)
                ("deviation", float((g - g_pg).norm()) / pg_norm),
                ("grad_norm", float(g.norm())),
                ("pull_back", pull),
            ):
                rows[name].setdefault(key, []).append(value)
    num_seqs, length = batch.shape
    return {
        "drifts": list(drifts),
        "num_seqs": num_seqs,
        "length": length,
        "num_actions": int(batch.old_logits.shape[-1]),
        "configs": {name: dict(c) for name, c in configs.items()},
        "untruncated_grad_norm": pg_norms,
        "objectives": rows,
        **summaries,
    }
