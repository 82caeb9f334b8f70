"""IS-correction weights at every level, hand-computed in float64, and the seed's long-sequence claim."""

import math

import torch

from nemo_is_plugin.loss.is_weights import finite_exp, is_log_weight
from nemo_is_plugin.loss.layout import TokenLayout

F64 = torch.float64
PREV = torch.tensor([[-1.0, -2.0, -0.5, -0.7]], dtype=F64)
GEN = torch.tensor([[-1.1, -1.9, -3.0, -0.4]], dtype=F64)  # x = p - g = [0.1, -0.1, (2.5 masked), -0.3]
MASK = torch.tensor([[1.0, 1.0, 0.0, 1.0]], dtype=F64)
LAY = TokenLayout.padded(1, 4)


def test_levels_hand_computed():
    x = [0.1, -0.1, 2.5, -0.3]
    assert torch.allclose(is_log_weight("token", PREV, GEN, MASK, LAY), torch.tensor([x], dtype=F64))
    assert torch.allclose(is_log_weight("sequence", PREV, GEN, MASK, LAY), torch.full((1, 4), -0.3, dtype=F64))
    assert torch.allclose(is_log_weight("sequence_mean", PREV, GEN, MASK, LAY), torch.full((1, 4), -0.1, dtype=F64))
    cum = is_log_weight("cumulative", PREV, GEN, MASK, LAY)
    assert torch.allclose(cum, torch.tensor([[0.1, 0.0, 0.0, -0.3]], dtype=F64))


def test_weights_are_detached_and_overflow_is_zeroed_like_nemo_rl():
    w = finite_exp(torch.tensor([0.0, 100.0, float("nan")], dtype=torch.float32))
    assert w.tolist() == [1.0, 0.0, 0.0]
    assert not is_log_weight("token", PREV.requires_grad_(True), GEN, MASK, LAY).requires_grad


def test_seed_claim_exp_sum_collapses_while_sequence_mean_stays_near_one():
    """Seed 002: a per-token mismatch of a few percent over ~9k tokens sends exp(sum) weights towards 0 or inf,
    while the geometric mean exp(mean) stays within a few percent of 1."""
    g = torch.Generator().manual_seed(0)
    B, T = 16, 9000
    prev = -torch.rand(B, T, generator=g, dtype=F64) - 0.1
    x = 0.02 * torch.randn(B, T, generator=g, dtype=F64) - 0.0002  # ~2% per token, slight negative bias
    gen = prev - x
    mask = torch.ones(B, T, dtype=F64)
    lay = TokenLayout.padded(B, T)
    seq = finite_exp(is_log_weight("sequence", prev, gen, mask, lay))[:, 0]
    mean = finite_exp(is_log_weight("sequence_mean", prev, gen, mask, lay))[:, 0]
    # std of the per-sequence log-weight is 0.02 * sqrt(9000) = 1.9: weights span orders of magnitude
    assert (seq < 0.5).sum() >= 4 and (seq > 2.0).sum() >= 2
    assert seq.std().item() > 1.0
    assert ((mean - 1).abs() < 0.03).all()
    assert math.isclose(mean.mean().item(), 1.0, abs_tol=0.01)
