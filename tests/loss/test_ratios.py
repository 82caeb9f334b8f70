"""Policy ratios at every level: hand-computed float64 values and the gradient structure of each method."""

import math

import torch

from nemo_is_plugin.loss.layout import TokenLayout
from nemo_is_plugin.loss.ratios import policy_log_ratio, unmasked_positions

F64 = torch.float64
# One sequence of 4 tokens, token 2 masked (e.g. a tool token): d = c - p = [0.1, -0.2, (5.0 masked), 0.3]
CURR = torch.tensor([[-1.0, -2.0, -0.5, -0.7]], dtype=F64)
PREV = torch.tensor([[-1.1, -1.8, -5.5, -1.0]], dtype=F64)
MASK = torch.tensor([[1.0, 1.0, 0.0, 1.0]], dtype=F64)
LAY = TokenLayout.padded(1, 4)


def _log_r(level, **kw):
    c = CURR.clone().requires_grad_(True)
    return c, policy_log_ratio(level, c, PREV, MASK, LAY, **kw)


def _jacobian(c, out):
    rows = [torch.autograd.grad(out[0, t], c, retain_graph=True)[0][0] for t in range(4)]
    return torch.stack(rows)


def test_token_level():
    c, lr = _log_r("token")
    assert torch.allclose(lr, torch.tensor([[0.1, -0.2, 5.0, 0.3]], dtype=F64))
    assert torch.allclose(_jacobian(c, lr), torch.eye(4, dtype=F64))


def test_sequence_level_is_gspo_mean_with_full_gradient():
    c, lr = _log_r("sequence")
    mean = (0.1 - 0.2 + 0.3) / 3
    assert torch.allclose(lr, torch.full((1, 4), mean, dtype=F64))
    jac = _jacobian(c, lr)  # every token's ratio depends on every unmasked token, 1/3 each
    assert torch.allclose(jac, torch.tensor([[1 / 3, 1 / 3, 0, 1 / 3]] * 4, dtype=F64), atol=1e-12)


def test_sequence_token_level_value_of_gspo_gradient_of_token():
    c, lr = _log_r("sequence_token")
    assert torch.allclose(lr, torch.full((1, 4), 0.2 / 3, dtype=F64))
    assert torch.allclose(_jacobian(c, lr), torch.eye(4, dtype=F64))


def test_cumulative_level_is_prefix_sum_skipping_masked_tokens():
    c, lr = _log_r("cumulative")
    # prefix over unmasked tokens: 0.1, -0.1, (masked -> 0), 0.2
    assert torch.allclose(lr, torch.tensor([[0.1, -0.1, 0.0, 0.2]], dtype=F64))
    assert torch.allclose(_jacobian(c, lr), torch.eye(4, dtype=F64))


def test_cumulative_mean_divides_by_unmasked_position():
    _, lr = _log_r("cumulative_mean")
    assert torch.allclose(lr, torch.tensor([[0.1, -0.05, 0.0, 0.2 / 3]], dtype=F64))


def test_clamps_and_cap():
    _, lr = _log_r("token", token_clamp=0.25, max_log_ratio=0.2)
    assert torch.allclose(lr, torch.tensor([[0.1, -0.2, 0.2, 0.2]], dtype=F64))
    c, lr = _log_r("cumulative", max_log_ratio=0.15)
    assert math.isclose(lr[0, 3].item(), 0.15)
    assert _jacobian(c, lr)[3, 3].item() == 0.0  # capped: no gradient, as CTPO's min(., 10)


def test_unmasked_positions():
    assert unmasked_positions(MASK, LAY).tolist() == [[1.0, 2.0, 2.0, 3.0]]
    leading = torch.tensor([[0.0, 0.0, 1.0, 1.0]], dtype=F64)
    assert unmasked_positions(leading, LAY).tolist() == [[1.0, 1.0, 1.0, 2.0]]
