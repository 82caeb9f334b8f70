"""The objectives beside PPO's clip (loss/trust_masks.py, loss/objectives.py, loss/prefix_budget.py).

Three kinds of evidence: float64 references re-derived here element by element from the formulas (DPPO / verl for
the masks, SAPO, GMPO; UniRL's CPPO for the prefix budget), hand-computed 3-token cases, and the limits the issue
names (infinite thresholds, infinite budget). tests/data/golden/verl_loss_modes holds verl's own numbers; the plugin's
compositions (helpers/golden_objectives.py) must reproduce loss, gradient and metrics within float32 tolerance.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers.device_guard import device_guard
from helpers.golden_objectives import load_cases, plugin_loss

from nemo_is_plugin.adapters.verl.loss_modes import VERL_LOSS_MODES
from nemo_is_plugin.loss.layout import TokenLayout
from nemo_is_plugin.loss.objectives.base import masked_ratio_surrogate
from nemo_is_plugin.loss.objectives.cppo import cppo_mask, sequence_quantile
from nemo_is_plugin.loss.objectives.dppo import binary_kl_mask, binary_tv_mask, divergence_pg_surrogate
from nemo_is_plugin.loss.objectives.gmpo import gmpo_surrogate
from nemo_is_plugin.loss.objectives.prob_diff import probability_difference_mask
from nemo_is_plugin.loss.objectives.sapo import sapo_surrogate

INF = float("inf")


def _draw(B=4, T=9, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    anchor = torch.log(0.02 + 0.96 * torch.rand(B, T, generator=g, dtype=dtype))
    curr = torch.minimum(anchor + 0.7 * torch.randn(B, T, generator=g, dtype=dtype), torch.full_like(anchor, -1e-4))
    adv = torch.randn(B, T, generator=g, dtype=dtype)
    adv[0, :3] = 0.0
    mask = torch.ones(B, T, dtype=dtype)
    if B > 3:
        mask[1, (2 * T) // 3 :] = 0
        mask[2, 2:] = 0
        mask[3, T // 2] = 0  # interior
    return curr, anchor, adv, mask


# ---------------------------------------------------------------- float64 references, element by element
def test_binary_tv_and_kl_match_elementwise_reference():
    curr, anchor, adv, _ = _draw()
    tv = binary_tv_mask(curr, anchor, adv, delta_low=0.1, delta_high=0.15)
    kl = binary_kl_mask(curr, anchor, adv, delta_low=0.03, delta_high=0.05)
    for c, a, A, k_tv, k_kl in zip(
        curr.flatten(), anchor.flatten(), adv.flatten(), tv.keep.flatten(), kl.keep.flatten()
    ):
        p, q = math.exp(float(c)), math.exp(float(a))
        assert bool(k_tv) == ((p - q <= 0.15) if A > 0 else (p - q >= -0.1))
        kl_b = q * math.log(q / p) + (1 - q) * math.log((1 - q + 1e-8) / (1 - p + 1e-8))
        assert bool(k_kl) == ((kl_b <= 0.05 or p <= q) if A > 0 else (kl_b <= 0.03 or p >= q))
    for m in (tv, kl):
        assert torch.equal(m.masked_high | m.masked_low, ~m.keep)
        assert not (m.masked_high & (adv <= 0)).any() and not (m.masked_low & (adv > 0)).any()
    assert (~tv.keep).any() and tv.keep.any() and (~kl.keep).any() and kl.keep.any()


def test_probability_difference_ignores_the_advantage_sign():
    curr, anchor, adv, _ = _draw(seed=1)
    a = probability_difference_mask(curr, anchor, adv, threshold=0.1)
    b = probability_difference_mask(curr, anchor, -adv, threshold=0.1)
    ref = (torch.exp(curr) - torch.exp(anchor)).abs() <= 0.1
    assert torch.equal(a.keep, ref) and torch.equal(b.keep, ref) and (~ref).any()


def test_sapo_matches_elementwise_reference_and_its_gradient():
    curr, anchor, adv, _ = _draw(seed=2)
    curr.requires_grad_(True)
    out = sapo_surrogate(curr - anchor, adv, tau_pos=1.0, tau_neg=1.05)
    out.loss.sum().backward()
    for c, a, A, loss, grad in zip(
        curr.detach().flatten(), anchor.flatten(), adv.flatten(), out.loss.detach().flatten(), curr.grad.flatten()
    ):
        r, tau = math.exp(float(c - a)), (1.0 if A > 0 else 1.05)
        s = 1 / (1 + math.exp(-tau * (r - 1)))
        assert float(loss) == pytest.approx(-float(A) * s * 4 / tau, rel=1e-12, abs=1e-15)
        # d/dc of -A sigmoid(tau (r - 1)) 4 / tau = -A 4 s (1 - s) r
        assert float(grad) == pytest.approx(-float(A) * 4 * s * (1 - s) * r, rel=1e-12, abs=1e-15)


def test_gmpo_matches_per_sequence_reference():
    curr, anchor, adv, mask = _draw(seed=3)
    lo, hi = 0.2, 0.3
    out = gmpo_surrogate(curr, anchor, adv, mask, TokenLayout.padded(*mask.shape), clip_low=lo, clip_high=hi)
    for i in range(mask.shape[0]):
        total, adv_sum, n = 0.0, 0.0, 0
        for t in range(mask.shape[1]):
            if mask[i, t] == 0:
                continue
            d, A = float(curr[i, t] - anchor[i, t]), float(adv[i, t])
            total += (min(d, hi) if A > 0 else max(d, -lo)) if A != 0 else 0.0
            adv_sum, n = adv_sum + A, n + 1
        expected = -(adv_sum / n) * math.exp(total / n)
        assert float(out.loss[i, 0]) == pytest.approx(expected, rel=1e-7)


def _cppo_reference(curr, anchor, adv, delta, w_min, delta_b):
    """UniRL's CPPO mask for one response (all tokens unmasked), written from the formulas in float64."""
    p, q = torch.exp(curr), torch.exp(anchor)
    D = (p - q).abs()
    n = len(D)
    rate = min(max(float(torch.quantile(D, 0.9)), delta_b), 2 * delta_b)
    keep, S, W = [], 0.0, 0.0
    for k in range(n):
        w = 1 - (1 - w_min) * k / max(n - 1, 1)
        z = w * float(D[k])
        c = min(delta, delta + rate * W - S)
        toward = float(adv[k]) * (math.exp(float(curr[k] - anchor[k])) - 1) <= 0
        keep.append(toward or z <= c)
        S, W = S + z, W + w
    return torch.tensor(keep)


@pytest.mark.parametrize("seed", [4, 5, 6])
def test_cppo_matches_reference_on_padded_and_packed_layouts(seed):
    curr, anchor, adv, mask = _draw(B=3, T=40, seed=seed)
    mask = torch.ones_like(mask)
    mask[0, 30:] = 0
    mask[1, 12:] = 0
    lengths = [30, 12, 40]
    padded = cppo_mask(curr, anchor, adv, mask, TokenLayout.padded(3, 40), delta=0.2, w_min=0.8, delta_b=0.02)
    flat = lambda x: torch.cat([x[i, :n] for i, n in enumerate(lengths)])  # noqa: E731
    cu = [0, 30, 42, 82]
    packed = cppo_mask(
        flat(curr),
        flat(anchor),
        flat(adv),
        torch.ones(82, dtype=torch.float64),
        TokenLayout.packed(cu),
        delta=0.2,
        w_min=0.8,
        delta_b=0.02,
    )
    for i, n in enumerate(lengths):
        ref = _cppo_reference(curr[i, :n], anchor[i, :n], adv[i, :n], 0.2, 0.8, 0.02)
        assert torch.equal(padded.mask.keep[i, :n], ref)
        assert torch.equal(packed.mask.keep[cu[i] : cu[i + 1]], ref)
    assert (~padded.mask.keep & (mask != 0)).any()
    assert torch.equal(padded.first_exhausted, packed.first_exhausted)


def test_sequence_quantile_matches_torch_quantile_and_refuses_split_sequences():
    curr, _, _, mask = _draw(seed=7)
    q = sequence_quantile(curr, mask, TokenLayout.padded(*mask.shape), 0.9)
    for i in range(mask.shape[0]):
        assert float(q[i]) == pytest.approx(float(torch.quantile(curr[i][mask[i] != 0], 0.9)), rel=1e-12)

    class Shard(TokenLayout):
        @property
        def holds_whole_sequences(self) -> bool:
            return False

    layout = TokenLayout.padded(*mask.shape)
    shard = Shard(layout.seq_index, layout.position, layout.num_seqs, padded=True)
    with pytest.raises(ValueError, match="context-parallel"):
        sequence_quantile(curr, mask, shard, 0.9)


def test_cppo_accumulates_in_float32_from_bf16_inputs():
    curr, anchor, adv, mask = _draw(B=2, T=300, seed=8)
    lay = TokenLayout.padded(2, 300)
    kw = dict(delta=0.2, w_min=0.8, delta_b=0.02)
    low = cppo_mask(curr.bfloat16(), anchor.bfloat16(), adv.bfloat16(), mask.bfloat16(), lay, **kw)
    upcast = cppo_mask(
        curr.bfloat16().float(), anchor.bfloat16().float(), adv.bfloat16().float(), mask.float(), lay, **kw
    )
    assert low.mask.divergence.dtype == torch.float32
    assert torch.equal(low.mask.keep, upcast.mask.keep)


# ---------------------------------------------------------------- hand-computed 3-token cases
def _log(*probs):
    return torch.log(torch.tensor(probs, dtype=torch.float64))


def test_hand_binary_tv_and_probability_difference():
    curr, anchor, adv = _log(0.5, 0.2, 0.9), _log(0.3, 0.4, 0.85), torch.tensor([1.0, -1.0, 1.0], dtype=torch.float64)
    tv = binary_tv_mask(curr, anchor, adv, delta_low=0.1, delta_high=0.1)  # p - q = 0.2, -0.2, 0.05
    assert tv.keep.tolist() == [False, False, True]
    assert tv.masked_high.tolist() == [True, False, False] and tv.masked_low.tolist() == [False, True, False]
    # the A < 0 token fell by 0.2: DPPO drops it; a drop of 0.2 with A > 0 is kept (it moves against the push)
    all_positive = torch.ones(3, dtype=torch.float64)
    assert binary_tv_mask(curr, anchor, all_positive, delta_low=0.1, delta_high=0.1).keep.tolist() == [
        False,
        True,
        True,
    ]
    assert probability_difference_mask(curr, anchor, adv, threshold=0.1).keep.tolist() == [False, False, True]


def test_hand_binary_kl():
    # q = 0.5 -> p = 0.6: KL_b = 0.5 ln(0.5/0.6) + 0.5 ln(0.5/0.4) = 0.0204110...
    curr, anchor, adv = _log(0.6), _log(0.5), torch.tensor([1.0], dtype=torch.float64)
    kl = binary_kl_mask(curr, anchor, adv, delta_low=0.0, delta_high=0.0204)
    assert float(kl.divergence[0]) == pytest.approx(0.5 * math.log(5 / 6) + 0.5 * math.log(5 / 4), rel=1e-6)
    assert not bool(kl.keep[0])
    assert bool(binary_kl_mask(curr, anchor, adv, delta_low=0.0, delta_high=0.0205).keep[0])
    assert bool(binary_kl_mask(curr, anchor, -adv, delta_low=0.0, delta_high=0.0).keep[0])  # rose, A < 0: kept


def test_hand_gmpo_three_tokens():
    anchor = torch.zeros(1, 3, dtype=torch.float64)
    curr = torch.tensor([[0.1, 0.5, -0.6]], dtype=torch.float64)
    adv, mask = torch.ones(1, 3, dtype=torch.float64), torch.ones(1, 3, dtype=torch.float64)
    out = gmpo_surrogate(curr, anchor, adv, mask, TokenLayout.padded(1, 3), clip_low=0.4, clip_high=0.4)
    # A > 0 clips from above only: (0.1 + 0.4 - 0.6) / 3 = -1/30
    assert float(out.loss[0, 0]) == pytest.approx(-math.exp(-1 / 30), rel=1e-7)
    # verl's clip fractions count every token outside the band by advantage sign, moved by the clip or not
    assert out.clipped_high.tolist() == [[False, True, True]] and not out.clipped_low.any()
    out_neg = gmpo_surrogate(curr, anchor, -adv, mask, TokenLayout.padded(1, 3), clip_low=0.4, clip_high=0.4)
    # A < 0 clips from below only: (0.1 + 0.5 - 0.4) / 3
    assert float(out_neg.loss[0, 0]) == pytest.approx(math.exp(0.2 / 3), rel=1e-7)


def test_hand_cppo_three_tokens():
    # q = 0.3, p = 0.45, 0.5, 0.4: D = 0.15, 0.2, 0.1; w = 1, 0.9, 0.8; Z = 0.15, 0.18, 0.08
    # quantile_0.9(D) = 0.19 -> b = clamp(0.19, 0.02, 0.04) = 0.04; S = 0, 0.15, 0.33; W = 0, 1, 1.9
    # c = min(0.2, 0.2 + b W - S) = 0.2, 0.09, -0.054 -> keep Z <= c: yes, no, no (every p rose and A > 0)
    curr, anchor = _log(0.45, 0.5, 0.4).unsqueeze(0), _log(0.3, 0.3, 0.3).unsqueeze(0)
    adv, mask = torch.ones(1, 3, dtype=torch.float64), torch.ones(1, 3, dtype=torch.float64)
    lay = TokenLayout.padded(1, 3)
    out = cppo_mask(curr, anchor, adv, mask, lay, delta=0.2, w_min=0.8, delta_b=0.02)
    assert out.mask.keep.tolist() == [[True, False, False]]
    assert out.budget_bound.tolist() == [[False, True, True]]
    assert float(out.rate[0]) == pytest.approx(0.04) and float(out.first_exhausted[0]) == 2.0
    # negative advantages: every token moved away from the push direction (toward the anchor) and is kept
    assert cppo_mask(curr, anchor, -adv, mask, lay, delta=0.2, w_min=0.8, delta_b=0.02).mask.keep.all()


# ---------------------------------------------------------------- limits
def test_dppo_with_infinite_thresholds_is_the_untruncated_policy_gradient():
    curr, anchor, adv, _ = _draw(seed=9)
    for rule in (binary_tv_mask, binary_kl_mask):
        c = curr.clone().requires_grad_(True)
        trust = rule(c.detach(), anchor, adv, delta_low=INF, delta_high=INF)
        assert trust.keep.all()
        divergence_pg_surrogate(c - anchor, c, adv, trust, ratio_cap=INF).loss.sum().backward()
        ref = curr.clone().requires_grad_(True)
        (-adv * torch.exp(ref - anchor)).sum().backward()
        torch.testing.assert_close(c.grad, ref.grad, rtol=1e-12, atol=1e-14)


def test_cppo_with_infinite_budget_is_its_position_weighted_per_token_mask():
    curr, anchor, adv, mask = _draw(B=3, T=30, seed=10)
    lay = TokenLayout.padded(3, 30)
    inf_budget = cppo_mask(curr, anchor, adv, mask, lay, delta=0.15, w_min=0.7, delta_b=INF)
    huge_budget = cppo_mask(curr, anchor, adv, mask, lay, delta=0.15, w_min=0.7, delta_b=1e9)
    n = mask.sum(-1, keepdim=True)
    k = torch.cumsum(mask, -1)
    w = 1 - 0.3 * (k - 1) / (n - 1)
    toward = adv * (torch.exp(curr - anchor) - 1) <= 0
    per_token = toward | (w * (torch.exp(curr) - torch.exp(anchor)).abs() <= 0.15)
    valid = mask != 0
    assert torch.equal(inf_budget.mask.keep[valid], per_token[valid])
    assert torch.equal(huge_budget.mask.keep[valid], per_token[valid])
    assert not inf_budget.budget_bound[valid].any() and torch.isinf(inf_budget.first_exhausted).all()
    assert (~per_token[valid]).any()


def test_probability_difference_with_threshold_one_keeps_everything_and_masked_ratio_is_plain_pg():
    curr, anchor, adv, _ = _draw(seed=11)
    trust = probability_difference_mask(curr, anchor, adv, threshold=1.0)
    assert trust.keep.all()
    out = masked_ratio_surrogate(curr - anchor, adv, trust)
    torch.testing.assert_close(out.loss, -adv * torch.exp(curr - anchor), rtol=0, atol=0)


def test_sapo_gradient_at_the_anchor_is_the_policy_gradient():
    anchor = torch.log(torch.tensor([0.3, 0.6, 0.9], dtype=torch.float64))
    curr = anchor.clone().requires_grad_(True)
    adv = torch.tensor([1.5, -0.5, 0.0], dtype=torch.float64)
    sapo_surrogate(curr - anchor, adv, tau_pos=2.0, tau_neg=3.0).loss.sum().backward()
    torch.testing.assert_close(curr.grad, -adv, rtol=1e-12, atol=0)


def test_gmpo_of_one_token_sequences_without_clip_is_the_token_ratio_objective():
    curr, anchor, adv, _ = _draw(B=6, T=1, seed=12)
    out = gmpo_surrogate(
        curr, anchor, adv, torch.ones_like(curr), TokenLayout.padded(6, 1), clip_low=INF, clip_high=INF
    )
    torch.testing.assert_close(out.loss, -adv * torch.exp(curr - anchor), rtol=1e-7, atol=1e-12)


# ---------------------------------------------------------------- verl's own numbers
CASES = load_cases()


@pytest.mark.parametrize("case", CASES, ids=[f"{i:03d}-{c['mode']}" for i, c in enumerate(CASES)])
def test_reproduces_verl_loss_gradient_and_metrics(case):
    loss, grad, metrics = plugin_loss(case)
    expected = case["expected"]
    torch.testing.assert_close(loss, expected["loss"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, expected["grad_log_prob"], rtol=1e-5, atol=1e-7)
    assert set(metrics) == set(expected["metrics"])
    for name, value in expected["metrics"].items():
        assert metrics[name] == pytest.approx(value, rel=1e-5, abs=1e-7), name


def test_golden_cases_cover_every_mode_and_cross_the_thresholds():
    assert {c["mode"] for c in CASES} == set(VERL_LOSS_MODES)  # the list itself: tests/adapters/test_verl_loss_modes.py
    clipfracs = [c["expected"]["metrics"].get("actor/pg_clipfrac", 0.0) for c in CASES if c["mode"].startswith("dppo")]
    lowers = [
        c["expected"]["metrics"].get("actor/pg_clipfrac_lower", 0.0) for c in CASES if c["mode"].startswith("dppo")
    ]
    assert all(f > 0 for f in clipfracs) and all(f > 0 for f in lowers)


def test_device_clean():
    curr, anchor, adv, mask = _draw(B=2, T=6, seed=13, dtype=torch.float32)
    lay = TokenLayout.padded(2, 6)
    with device_guard():
        cppo_mask(curr, anchor, adv, mask, lay, delta=0.2, w_min=0.8, delta_b=0.02)
        gmpo_surrogate(curr, anchor, adv, mask, lay, clip_low=0.2, clip_high=0.2)
        sapo_surrogate(curr - anchor, adv, tau_pos=1.0, tau_neg=1.05)
        binary_kl_mask(curr, anchor, adv, delta_low=0.05, delta_high=0.05)
