"""PPO's surrogates (objectives/ppo_clip.py): ratio clip, dual clip, CTPO log-space position-adaptive clip
(hand-computed). CISPO, REINFORCE and the on-policy ratio: test_cispo.py, test_reinforce.py, test_on_policy.py."""

import math

import torch

from nemo_is_plugin.loss.objectives.ppo_clip import log_space_clip_surrogate, ratio_clip_surrogate

F64 = torch.float64


def test_ppo_clip_and_dual_clip():
    r = torch.tensor([0.5, 1.5, 5.0, 1.1], dtype=F64)
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0], dtype=F64)
    out = ratio_clip_surrogate(torch.log(r), adv, clip_low=0.2, clip_high=0.2, dual_clip=3.0)
    # A>0: max(-r, -clip(r)) = -min(r, clip(r)); A<0: min(max(r, clip(r)), 3)
    assert torch.allclose(out.loss, torch.tensor([-0.5, -1.2, 3.0, 1.1], dtype=F64))
    assert out.clipped.tolist() == [False, True, False, False]
    assert out.dual_clipped.tolist() == [False, False, True, False]
    assert out.clipped_high.tolist() == [False, True, False, False]


def test_log_space_clip_bounds_grow_like_t_power():
    # positions 1, 100 with eps_low 0.025, eps_high 0.05, p = 0.5: windows [e^-0.025, e^0.05], [e^-0.25, e^0.5]
    log_r = torch.tensor([0.3, 0.3, -0.4, -0.4], dtype=F64, requires_grad=True)
    pos = torch.tensor([1.0, 100.0, 1.0, 100.0], dtype=F64)
    adv = torch.tensor([1.0, 1.0, 1.0, 1.0], dtype=F64)
    out = log_space_clip_surrogate(log_r, adv, pos, eps_low=0.025, eps_high=0.05, eps_c=None, power=0.5)
    want = -torch.tensor([math.exp(0.05), math.exp(0.3), math.exp(-0.4), math.exp(-0.4)], dtype=F64)
    assert torch.allclose(out.loss, want)
    (grad,) = torch.autograd.grad(out.loss.sum(), log_r)
    assert torch.allclose(grad, torch.tensor([0.0, -math.exp(0.3), -math.exp(-0.4), -math.exp(-0.4)], dtype=F64))
    assert out.clipped_high.tolist() == [True, False, False, False]


def test_log_space_dual_clip_caps_negative_advantages():
    log_r = torch.tensor([1.0, 1.0], dtype=F64)
    out = log_space_clip_surrogate(
        log_r,
        torch.tensor([-1.0, -1.0], dtype=F64),
        torch.tensor([1.0, 400.0], dtype=F64),
        eps_low=0.025,
        eps_high=0.05,
        eps_c=0.05,
        power=0.5,
    )
    # t=1: cap exp(0.05) bites; t=400: cap exp(1.0) = ratio, loss = e
    assert torch.allclose(out.loss, torch.tensor([math.exp(0.05), math.e], dtype=F64))


def test_power_zero_is_fixed_window():
    log_r = torch.tensor([0.3, 0.3], dtype=F64)
    out = log_space_clip_surrogate(
        log_r,
        torch.ones(2, dtype=F64),
        torch.tensor([1.0, 5000.0], dtype=F64),
        eps_low=0.2,
        eps_high=0.2,
        eps_c=None,
        power=0.0,
    )
    assert torch.allclose(out.loss, torch.full((2,), -math.exp(0.2), dtype=F64))
