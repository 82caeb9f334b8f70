"""KL estimators, NeMo-RL's clamps and weights, and the straight-through option (value k3, gradient k2)."""

import math

import torch

from nemo_is_plugin.loss.kl import kl_estimate, kl_penalty, score_function_weight

F64 = torch.float64


def test_estimators_hand_computed():
    logr = torch.tensor([0.5, -1.0], dtype=F64)
    assert torch.allclose(kl_estimate(logr, "k1"), torch.tensor([-0.5, 1.0], dtype=F64))
    assert torch.allclose(kl_estimate(logr, "k2"), torch.tensor([0.125, 0.5], dtype=F64))
    k3 = torch.tensor([math.exp(0.5) - 1.5, math.exp(-1.0)], dtype=F64)
    assert torch.allclose(kl_estimate(logr, "k3"), k3)


def test_clamps_and_weight_detached_where_input_clamp_is_active():
    c = torch.tensor([-1.0, -30.0], dtype=F64, requires_grad=True)
    ref = torch.tensor([-1.5, -1.0], dtype=F64)  # logr = -0.5 and 29 (clamped to 20)
    kl = kl_penalty(c, ref, kl_type="k1", input_clamp=20.0, output_clamp=10.0, weights=score_function_weight(c))
    assert torch.allclose(kl, torch.tensor([0.5, -10.0], dtype=F64))
    (grad,) = torch.autograd.grad(kl.sum(), c)
    # token 0: d/dc [w * (c - ref)] = k1 + 1 = 1.5; token 1: clamped everywhere -> 0
    assert torch.allclose(grad, torch.tensor([1.5, 0.0], dtype=F64))


def test_straight_through_has_k3_value_and_k2_gradient():
    c = torch.tensor([-1.0, -2.0, -0.3], dtype=F64, requires_grad=True)
    ref = torch.tensor([-1.4, -1.0, -0.3], dtype=F64)
    st = kl_penalty(c, ref, kl_type="k3", straight_through_k2=True)
    assert torch.allclose(st, kl_estimate(ref - c, "k3"))
    (g_st,) = torch.autograd.grad(st.sum(), c)
    assert torch.allclose(g_st, (c - ref).detach())  # d/dc (ref - c)^2 / 2
    (g_k3,) = torch.autograd.grad(kl_penalty(c, ref, kl_type="k3").sum(), c)
    assert torch.allclose(g_k3, (1 - torch.exp(ref - c)).detach())
    assert not torch.allclose(g_k3, g_st)
