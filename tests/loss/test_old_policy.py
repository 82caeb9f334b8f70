"""old_policy_logprobs='generation' (verl's bypass mode: pi_old = mu): the ratio is taken against the generation
log-probs, and the IS weights and rejection rules measure the current policy (detached) against mu. Hand-computed in
float64; prev_logprobs are neither needed nor read."""

import math

import pytest
import torch

from nemo_is_plugin.loss import ClippedPGLoss
from nemo_is_plugin.loss.layout import TokenLayout
from nemo_is_plugin.loss.separable import single_pass_blocker

F64 = torch.float64
g = torch.Generator().manual_seed(3)
B, S = 3, 6
CURR = -torch.rand(B, S - 1, generator=g, dtype=F64) - 0.3
GEN = torch.zeros(B, S, dtype=F64)
GEN[:, 1:] = CURR + torch.tensor([[0.01], [0.3], [-0.6]], dtype=F64) * torch.randn(B, S - 1, generator=g, dtype=F64)
TM = torch.ones(B, S, dtype=F64)
TM[:, 0] = 0
TM[1, 4:] = 0
ADV = torch.randn(B, 1, generator=g, dtype=F64).expand(B, S).contiguous()


def run(cfg: dict, prev=None):
    data = {"token_mask": TM, "sample_mask": torch.ones(B, dtype=F64), "advantages": ADV, "generation_logprobs": GEN}
    if prev is not None:
        data["prev_logprobs"] = prev
    c = CURR.clone().requires_grad_(True)
    n_tok = float(TM[:, 1:].sum())
    loss, metrics = ClippedPGLoss(cfg)(
        next_token_logprobs=c, data=data, global_valid_seqs=float(B), global_valid_toks=n_tok
    )
    (grad,) = torch.autograd.grad(loss, c)
    return loss.detach(), grad, metrics, n_tok + 1e-8  # token-mean divides by N + 1e-8


def test_reinforce_with_truncated_is_against_the_current_policy():
    """verl's bypass REINFORCE: L = -sum_t A_t min(pi_theta/mu, C) log pi_theta / N, the weight detached."""
    cfg = {
        "reference_policy_kl_penalty": 0.0,
        "old_policy_logprobs": "generation",
        "disable_ppo_ratio": True,
        "use_importance_sampling_correction": True,
        "is_correction_level": "token",
        "truncated_importance_sampling_type": "tis",
        "truncated_importance_sampling_ratio": 1.2,
    }
    loss, grad, _, n = run(cfg)
    m, a, x = TM[:, 1:], ADV[:, 1:], CURR - GEN[:, 1:]
    w = torch.exp(x).clamp(max=1.2)
    assert loss.item() == pytest.approx(float((-a * w * CURR * m).sum()) / n, rel=1e-12)
    torch.testing.assert_close(grad, -a * w * m / n, rtol=1e-12, atol=1e-15)
    assert float((torch.exp(x) > 1.2)[m > 0].float().mean()) > 0  # the truncation binds somewhere
    other_prev = run(cfg, prev=torch.full((B, S), -9.0, dtype=F64))  # prev_logprobs are not read
    assert torch.equal(other_prev[1], grad)


def test_ppo_clip_against_mu_with_a_rejection_of_the_current_policy():
    """verl's bypass PPO-clip + K3-RS: r = pi_theta/mu clipped at [0.8, 1.2]; a sequence whose mean k3 of
    log(pi_theta/mu) exceeds 0.01 is dropped (its tokens still count in N, as in verl's bypass mode)."""
    cfg = {
        "reference_policy_kl_penalty": 0.0,
        "old_policy_logprobs": "generation",
        "importance_sampling_rejection_rules": [{"option": "seq_mean_k3", "threshold": 0.01}],
    }
    loss, grad, metrics, n = run(cfg)
    m, a, x = TM[:, 1:], ADV[:, 1:], CURR - GEN[:, 1:]
    k3 = ((torch.exp(x) - 1 - x) * m).sum(-1) / (m.sum(-1) + 1e-8)
    keep = (k3 <= 0.01).to(F64).unsqueeze(-1)
    assert keep.squeeze(-1).tolist() == [1.0, 0.0, 0.0]
    r = torch.exp(x)
    sur = torch.maximum(-a * r, -a * r.clamp(0.8, 1.2))
    assert loss.item() == pytest.approx(float((sur * keep * m).sum()) / n, rel=1e-12)
    assert metrics["is_rejection_sequence_mean_k3_rejected_seq_fraction"] == pytest.approx(2 / 3)
    assert metrics["mismatch_kl_k1"] == pytest.approx(float((-x * m).sum()) / n, rel=1e-9)  # current vs mu
    assert torch.equal(grad[1:], torch.zeros_like(grad[1:]))


def test_bypass_takes_the_two_pass_schedule():
    from nemo_is_plugin.loss.config_model import ClippedPGLossConfig

    why = single_pass_blocker(ClippedPGLossConfig(old_policy_logprobs="generation"), TokenLayout.padded(1, 2))
    assert why is not None and "current log-probs" in why
    assert math.isfinite(run({"old_policy_logprobs": "generation", "reference_policy_kl_penalty": 0.0})[0].item())
