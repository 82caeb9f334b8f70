"""Score centering's defining property, re-derived by enumeration in float64 on a 7-token vocabulary.

For a sampler q̂ whose tail outside the recorded top-k head is exactly rho * p (the model the term assumes), the
expectation over the sampled token y ~ q̂ of the centred loss's gradient is computed exactly (a sum over the 7 tokens,
weighted by q̂_y, of the gradient of the loss the plugin computes for that y), not sampled. With a constant advantage
it is 0 for f = 1 (IS off), TIS and masked IS (IcePop), three-policy at pi_theta = pi_old and REINFORCE against mu;
without the term it is the drift E_q̂[f grad log p], which is not 0 (so the check can fail).
"""

from __future__ import annotations

import pytest
import torch

from nemo_is_plugin.loss import ClippedPGLoss, LossInputs
from nemo_is_plugin.loss.layout import TokenLayout
from nemo_is_plugin.loss.score_centering import Calibration, ScoreCenteringHead

V = 7
HEAD = torch.tensor([4, 1, 6])  # the sampler's top-k ids (any order)


def sampler_with_modelled_tail(logits: torch.Tensor, head_q: torch.Tensor) -> torch.Tensor:
    """q̂ [V]: ``head_q`` on HEAD, rho * p elsewhere, rho = (1 - Q_H) / (1 - P_H): a distribution (sums to 1)."""
    p = torch.softmax(logits.detach(), -1)
    rho = (1 - head_q.sum()) / (1 - p[HEAD].sum())
    q = rho * p
    q[HEAD] = head_q
    return q


def loss_of(config: dict, logits: torch.Tensor, q: torch.Tensor, y: int, advantage: float, head=HEAD) -> torch.Tensor:
    """The plugin's loss of one token whose sampled id is ``y`` (padded [1, 1] layout, float64)."""
    logp = torch.log_softmax(logits, -1)
    one = torch.ones(1, 1, dtype=torch.float64)
    inputs = LossInputs(
        curr_logprobs=logp[y].reshape(1, 1),
        prev_logprobs=logp[y].detach().reshape(1, 1),  # pi_old = pi_theta: the first update on the batch
        generation_logprobs=q[y].log().reshape(1, 1),
        reference_logprobs=None,
        advantages=one * advantage,
        token_mask=one,
        sample_mask=torch.ones(1, dtype=torch.float64),
        global_valid_seqs=1.0,
        global_valid_toks=1.0,
        head=ScoreCenteringHead(head.reshape(1, 1, -1), q[head].log().reshape(1, 1, -1), logp[head].reshape(1, 1, -1)),
    )
    loss, _ = ClippedPGLoss(config).compute(inputs, TokenLayout.padded(1, 1))
    return loss


def expected_gradient(config: dict, logits: torch.Tensor, q: torch.Tensor, advantage: float) -> torch.Tensor:
    """E_{y ~ q̂}[grad_z loss(y)], exactly: the sum over the vocabulary."""
    total = torch.zeros(V, dtype=torch.float64)
    for y in range(V):
        z = logits.detach().clone().requires_grad_(True)
        (grad,) = torch.autograd.grad(loss_of(config, z, q, y, advantage), z)
        total += q[y] * grad
    return total


BASE = {"reference_policy_kl_penalty": 0.0, "score_centering": True, "score_centering_top_k": 3}
IS = {"use_importance_sampling_correction": True}
CONFIGS = {
    "f=1": {},
    "f=1 reinforce": {"disable_ppo_ratio": True},
    "tis": {**IS, "truncated_importance_sampling_type": "tis", "truncated_importance_sampling_ratio": 1.3},
    "tis with a floor": {
        **IS,
        "truncated_importance_sampling_type": "tis",
        "truncated_importance_sampling_ratio": 1.3,
        "truncated_importance_sampling_ratio_min": 0.6,
    },
    "icepop": {
        **IS,
        "truncated_importance_sampling_type": "icepop",
        "truncated_importance_sampling_ratio": 1.4,
        "truncated_importance_sampling_ratio_min": 0.7,
    },
    "icepop, explicit token level": {
        **IS,
        "is_correction_level": "token",
        "truncated_importance_sampling_type": "icepop",
        "truncated_importance_sampling_ratio": 1.4,
        "truncated_importance_sampling_ratio_min": 0.7,
    },
    "reinforce against mu, tis": {
        **IS,
        "old_policy_logprobs": "generation",
        "disable_ppo_ratio": True,
        "truncated_importance_sampling_type": "tis",
        "truncated_importance_sampling_ratio": 1.3,
    },
    "cispo": {"use_cispo": True, "ratio_clip_min": 1.0, "ratio_clip_max": 4.0},
    "seq-mean-token-sum aggregation": {"loss_aggregation": "seq-mean-token-sum"},
}
LOGITS = torch.tensor([0.3, -1.2, 2.0, 0.5, 1.1, -0.4, 0.9], dtype=torch.float64)
# sampler head masses far from the trainer's: ratios p/q on both sides of every band edge, 1/rho too
HEAD_Q = {
    "tail heavier": torch.tensor([0.05, 0.02, 0.30], dtype=torch.float64),
    "tail lighter": torch.tensor([0.30, 0.05, 0.25], dtype=torch.float64),
    "tail much heavier": torch.tensor([0.01, 0.005, 0.02], dtype=torch.float64),
}


@pytest.mark.parametrize("advantage", [0.7, -1.3])
@pytest.mark.parametrize("head", sorted(HEAD_Q))
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_expected_centred_gradient_is_zero_for_a_constant_advantage(name, head, advantage):
    q = sampler_with_modelled_tail(LOGITS, HEAD_Q[head])
    assert q.sum().item() == pytest.approx(1.0, abs=1e-15)
    config = {**BASE, **CONFIGS[name]}
    grad = expected_gradient(config, LOGITS, q, advantage)
    assert grad.abs().max().item() < 1e-14
    # without the term the same expectation is the drift, far from 0 unless f is 0 at every token (an IcePop band
    # that no ratio falls in: then there is nothing to centre, and every c_v is 0 too)
    drift = expected_gradient({**config, "score_centering": False, "score_centering_top_k": None}, LOGITS, q, advantage)
    f = Calibration.of(ClippedPGLoss(config).config)
    if (f(torch.log_softmax(LOGITS, -1) - q.log()) != 0).any():
        assert drift.abs().max().item() > 1e-2
    else:
        assert drift.abs().max().item() == 0.0


def test_the_bands_are_crossed():
    """The cases above put head ratios p/q and the tail's 1/rho on both sides of every band edge (else f would be r
    or 1 everywhere and TIS / IcePop would not be tested)."""
    p = torch.softmax(LOGITS, -1)
    ratios = torch.cat([p / sampler_with_modelled_tail(LOGITS, hq) for hq in HEAD_Q.values()])
    for edge in (0.6, 0.7, 1.3, 1.4):
        assert (ratios < edge).any() and (ratios > edge).any()
    tails = [((1 - p[HEAD].sum()) / (1 - hq.sum())).item() for hq in HEAD_Q.values()]
    assert min(tails) < 0.7 < 1.3 < max(tails) or min(tails) < 0.7 < max(tails) < 1.3


def test_on_policy_the_term_vanishes():
    """q = p: rho = 1, every coefficient 0, the loss and gradient those of the uncentred loss."""
    q = torch.softmax(LOGITS, -1)
    for name, extra in CONFIGS.items():
        config = {**BASE, **extra}
        plain = {**config, "score_centering": False, "score_centering_top_k": None}
        for y in (0, 4):
            z1, z2 = LOGITS.clone().requires_grad_(True), LOGITS.clone().requires_grad_(True)
            (g1,) = torch.autograd.grad(loss_of(config, z1, q, y, 0.9), z1)
            (g2,) = torch.autograd.grad(loss_of(plain, z2, q, y, 0.9), z2)
            torch.testing.assert_close(g1, g2, rtol=0, atol=1e-15, msg=name)


def test_the_head_coefficients_by_hand():
    """One token, f = 1: the loss gradient wrt the head log-probs is A (q_v - rho p_v), by hand."""
    q = sampler_with_modelled_tail(LOGITS, HEAD_Q["tail heavier"])
    p = torch.softmax(LOGITS, -1)
    rho = (1 - q[HEAD].sum()) / (1 - p[HEAD].sum())
    logp = torch.log_softmax(LOGITS, -1)
    head = logp[HEAD].clone().reshape(1, 1, -1).requires_grad_(True)
    one = torch.ones(1, 1, dtype=torch.float64)
    inputs = LossInputs(
        logp[2].reshape(1, 1).clone().requires_grad_(True),
        logp[2].reshape(1, 1),
        q[2].log().reshape(1, 1),
        None,
        one * 0.8,
        one,
        torch.ones(1, dtype=torch.float64),
        1.0,
        1.0,
        head=ScoreCenteringHead(HEAD.reshape(1, 1, -1), q[HEAD].log().reshape(1, 1, -1), head),
    )
    loss, metrics = ClippedPGLoss(BASE).compute(inputs, TokenLayout.padded(1, 1))
    (grad,) = torch.autograd.grad(loss, head)
    # token-mean divides by the global count + 1e-8 (NeMo-RL's masked mean)
    torch.testing.assert_close(grad.reshape(-1), 0.8 * (q[HEAD] - rho * p[HEAD]) / (1 + 1e-8), rtol=1e-14, atol=0)
    n = 1 + 1e-8  # token means divide by the global count + 1e-8
    assert metrics["score_centering_sampler_tail"] == pytest.approx((1 - q[HEAD].sum()).item() / n, rel=1e-12)
    assert metrics["score_centering_trainer_tail"] == pytest.approx((1 - p[HEAD].sum()).item() / n, rel=1e-12)
    assert metrics["score_centering_tail_ratio"] == pytest.approx(rho.item() / n, rel=1e-12)
    drift = (q[HEAD] - rho * p[HEAD]).abs().sum().item()
    assert metrics["score_centering_drift"] == pytest.approx(drift / n, rel=1e-12)
    assert metrics["score_centering_grad_abs"] == pytest.approx(0.8 * drift / n, rel=1e-12)
    assert metrics["score_centering_pg_grad_abs"] == pytest.approx(0.8 / n, rel=1e-12)
    assert metrics["score_centering_sampled_in_head"] == 0.0  # y = 2 is not in the head
    want = 0.8 * ((q[HEAD] - rho * p[HEAD]) * logp[HEAD]).sum() / (1 + 1e-8)
    assert metrics["score_centering_loss"] == pytest.approx(want.item(), rel=1e-12)
