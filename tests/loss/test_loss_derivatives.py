"""The single pass's per-token dL/dc (separable.TokenLossGradient: autograd over the loss's own per-token functions,
chunk by chunk) against autograd of the whole ClippedPGLoss, in float64, over random configurations (hypothesis) and
random chunkings.

Every branch is drawn: the four surrogates (PPO ratio clip with and without the dual clip, CTPO's log-space clip with
position powers and its dual clip, CISPO, REINFORCE with and without the dual clip), token and cumulative ratio levels,
the token clamp and the ratio cap, the KL types k1/k2/k3 with input and output clamps, the score-function and the
on-policy weights and the straight-through k2 gradient, every IS level with truncation / masks / rejection / batch
normalisation, every aggregation, and the positive-sample NLL.

Tokens are also placed *exactly* on the kinks where the kinked quantity is an affine function of one log-prob: ratio 1
(the clipped and unclipped losses tie; with a clip of 0 it is the clip bound itself), the token clamp +-k, the cap
max_log_ratio, the log-space bounds -eps_low n^p and eps_high n^p, the KL input clamp +-I, the REINFORCE dual cap and
(where exp round-trips exactly) the ratio-space dual cap. Which subgradient autograd picks at such a tie of min / max /
clamp is its own convention (and changes between torch releases: clamp's went from 1 to 0 in 2.15), so no test here
depends on it: a token's gradient must lie between the one-sided derivatives (autograd of the whole loss at c -+ h,
the token's subdifferential), and equal autograd of the whole loss where those agree (the loss is differentiable at
that token, even if a tie sits there inside the program). The KL output clamp is exercised off its boundary only (its
input is transcendental in c). Masked tokens hold extreme values.

Example count: 300 by default (~20 s on one CPU thread), derandomized; ``NEMO_IS_PROPERTY_SCALE=<k>`` multiplies it.
"""

from __future__ import annotations

import dataclasses
import math
import os

import pytest
import torch
from helpers.policy_draws import draw_policy_logprobs
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nemo_is_plugin.loss import ClippedPGLoss, LossInputs
from nemo_is_plugin.loss.layout import TokenLayout
from nemo_is_plugin.loss.ratios import unmasked_positions
from nemo_is_plugin.loss.separable import TokenLossGradient, single_pass_blocker

torch.set_num_threads(1)
F64 = torch.float64
B, T = 3, 8
_SCALE = max(1, int(os.environ.get("NEMO_IS_PROPERTY_SCALE", "1")))
# derandomized: the same examples every run, so CI never flakes
_SETTINGS = dict(deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])

IS_PRESETS = [
    {},
    dict(use_importance_sampling_correction=True, is_correction_level="token"),
    dict(
        use_importance_sampling_correction=True,
        is_correction_level="sequence_mean",
        truncated_importance_sampling_type="tis",
        truncated_importance_sampling_ratio=1.05,
    ),
    dict(
        use_importance_sampling_correction=True,
        is_correction_level="cumulative",
        truncated_importance_sampling_type="icepop",
        truncated_importance_sampling_ratio=1.1,
        truncated_importance_sampling_ratio_min=0.9,
    ),
    dict(
        use_importance_sampling_correction=True,
        is_correction_level="sequence",
        importance_sampling_rejection="geo-rs",
        importance_sampling_rejection_min=0.97,
        importance_sampling_rejection_max=1.03,
        importance_sampling_batch_normalize=True,
    ),
    dict(
        use_importance_sampling_correction=True,
        truncated_importance_sampling_type="seq-mask-tis",
        truncated_importance_sampling_ratio=1.03,
        truncated_importance_sampling_ratio_min=0.97,
        importance_sampling_veto_threshold=0.9,
    ),
]
AGGREGATIONS = [
    {},
    dict(loss_aggregation="seq-mean-token-mean"),
    dict(loss_aggregation="seq-mean-token-sum"),
    dict(loss_aggregation="seq-mean-token-sum-norm", loss_aggregation_norm=6.0),
]


@st.composite
def configs(draw) -> dict:
    sur = draw(st.sampled_from(["ratio", "log_space", "cispo", "reinforce"]))
    cfg: dict = {}
    if sur == "reinforce":
        cfg["disable_ppo_ratio"] = True
        cfg["ratio_clip_c"] = draw(st.sampled_from([None, 1.5, 3.0]))
    else:
        cfg["ratio_level"] = (
            "token" if sur == "cispo" else draw(st.sampled_from(["token", "token", "cumulative", "cumulative_mean"]))
        )
        cfg["ratio_clip_min"] = draw(st.sampled_from([0.0, 0.03, 0.2]))
        cfg["ratio_clip_max"] = draw(st.sampled_from([0.0, 0.03, 0.28]))
        cfg["token_log_ratio_clamp"] = draw(st.sampled_from([None, 0.04]))
        cfg["max_log_ratio"] = draw(st.sampled_from([None, 0.02, 0.5]))
        if sur == "cispo":
            cfg["use_cispo"] = True
        elif sur == "ratio":
            cfg["ratio_clip_c"] = draw(st.sampled_from([None, 1.02, 1.5]))
        else:
            cfg.update(
                log_ratio_clip_low=draw(st.sampled_from([0.01, 0.025])),
                log_ratio_clip_high=draw(st.sampled_from([0.015, 0.05])),
                clip_position_power=draw(st.sampled_from([0.0, 0.5, 1.0])),
                log_ratio_clip_c=draw(st.sampled_from([None, 0.05])),
            )
    beta = draw(st.sampled_from([0.0, 0.1]))
    cfg["reference_policy_kl_penalty"] = beta
    if beta:
        cfg.update(
            reference_policy_kl_type=draw(st.sampled_from(["k1", "k2", "k3"])),
            kl_input_clamp_value=draw(st.sampled_from([None, 0.05, 20.0])),
            kl_output_clamp_value=draw(st.sampled_from([None, 0.002, 10.0])),
            use_on_policy_kl_approximation=draw(st.booleans()),
            reference_policy_kl_gradient=draw(st.sampled_from(["estimator", "k2"])),
        )
    cfg.update(draw(st.sampled_from(IS_PRESETS)))
    cfg.update(draw(st.sampled_from(AGGREGATIONS[:1] if sur == "cispo" else AGGREGATIONS)))  # CISPO: token-mean
    cfg["positive_example_nll_weight"] = draw(st.sampled_from([0.0, 0.3]))
    return cfg


KINDS = ("random", "ratio_one", "clamp_hi", "clamp_lo", "cap", "log_lo", "log_hi", "kl_in_hi", "kl_in_lo", "dual_cap")


def _batch(loss: ClippedPGLoss, seed: int, kinds: list[str]):
    """float64 batch [B, T]; token t of the flattened batch is placed on the kink ``kinds[t]`` when the config has it
    (else a random token). Masked tokens hold extreme prev / gen / ref / advantage values.

    The ratio kinks are placed for the token-level ratio only: a cumulative ratio is a prefix sum, whose rounding
    depends on the summation order (chunked scan with a carry vs one scan per sequence; a GPU scan differs again),
    so there a kink is only ever hit up to rounding (the subdifferential check below covers both cases)."""
    cfg = loss.config
    if cfg.effective_ratio_level != "token" and not cfg.disable_ppo_ratio:
        kinds = [k if k in ("random", "kl_in_hi", "kl_in_lo") else "random" for k in kinds]
    g = torch.Generator().manual_seed(seed)
    c, prev, gen, ref, adv = draw_policy_logprobs(g, B, T)
    tm = torch.ones(B, T, dtype=F64)
    tm[0, 6:] = 0
    tm[1, 0] = 0
    tm[2, 3] = 0
    positions = unmasked_positions(tm, TokenLayout.padded(B, T))
    # the log-space bounds exactly as surrogate.log_space_clip_surrogate computes them
    scale = positions**cfg.clip_position_power if cfg.clip_position_power else torch.ones_like(c)
    log_lo = (-(cfg.log_ratio_clip_low or 0.0) * scale).reshape(-1)
    log_hi = ((cfg.log_ratio_clip_high or 0.0) * scale).reshape(-1)
    flat = [t.view(-1) for t in (c, prev, ref, adv)]
    for i, kind in enumerate(kinds):
        cc, pp, rr, aa = flat
        if kind == "ratio_one":
            pp[i] = cc[i]
        elif kind in ("clamp_hi", "clamp_lo") and cfg.token_log_ratio_clamp is not None:
            pp[i], cc[i] = 0.0, cfg.token_log_ratio_clamp * (1 if kind == "clamp_hi" else -1)
        elif kind == "cap" and cfg.max_log_ratio is not None:
            pp[i], cc[i] = 0.0, cfg.max_log_ratio
        elif kind in ("log_lo", "log_hi") and cfg.uses_log_space_clip:
            pp[i], cc[i] = 0.0, (log_lo if kind == "log_lo" else log_hi)[i]
        elif (
            kind in ("kl_in_hi", "kl_in_lo") and cfg.kl_input_clamp_value is not None and (cfg.kl_input_clamp_value < 1)
        ):  # at |logr| = 20, k3 ~ e^20 cancels against its weight term
            cc[i], rr[i] = 0.0, cfg.kl_input_clamp_value * (1 if kind == "kl_in_hi" else -1)
        elif kind == "dual_cap" and cfg.ratio_clip_c is not None:
            aa[i] = -abs(aa[i].item()) - 0.1
            if cfg.disable_ppo_ratio:
                cc[i] = cfg.ratio_clip_c  # -A c == -A cap
            else:
                pp[i], cc[i] = 0.0, math.log(cfg.ratio_clip_c)  # exp(log(cap)) == cap where it round-trips
    masked = tm == 0
    prev[masked], gen[masked], ref[masked], adv[masked] = 1e6, -1e6, float("-inf"), 1e30
    sm = torch.tensor([1.0, 1.0, 0.0], dtype=F64)
    inputs = LossInputs(
        c,
        prev,
        gen,
        ref,
        adv,
        tm,
        sm,
        global_valid_seqs=4.0,
        global_valid_toks=17.0,
        rewards=torch.tensor([1.0, 0.0, 1.0], dtype=F64),
    )
    return c, inputs, TokenLayout.padded(B, T)


def _autograd(loss, c, inputs, layout):
    cc = c.clone().requires_grad_(True)
    value, _ = loss.compute(dataclasses.replace(inputs, curr_logprobs=cc), layout)
    (grad,) = torch.autograd.grad(value, cc)
    return grad


def _chunked(loss, c, inputs, layout, chunk):
    tg = TokenLossGradient.build(loss, inputs, layout)
    flat = c.reshape(-1)
    parts = [tg(slice(s, min(s + chunk, flat.numel())), flat[s : s + chunk]) for s in range(0, flat.numel(), chunk)]
    return torch.cat(parts).reshape(c.shape)


# One-sided step: far above float64 rounding of c (~1e-16), far below the distance between two distinct kinks of a
# token (>= 1e-3 in these draws), so c -+ H sits on the smooth pieces left and right of a kink at c.
H = 1e-9


def _one_sided(loss, c, inputs, layout):
    """Autograd of the whole loss at ``c - H`` and ``c + H`` (every token moved at once: a token's gradient depends on
    its own log-prob, and for the cumulative ratios on the values of the earlier ones, which move the same way)."""
    return _autograd(loss, c - H, inputs, layout), _autograd(loss, c + H, inputs, layout)


def _kink_tolerance(left, right):
    """How far the derivatives of one smooth piece move over H (relative ~1e-9), with a wide margin."""
    return 1e-6 * (left.abs() + right.abs()) + 1e-12


def assert_subgradient(got, loss, c, inputs, layout, valid):
    """``got`` lies between the one-sided derivatives of the whole loss (autograd at ``c -+ H``, the token's
    subdifferential) on every valid token; where they agree (the loss is differentiable at that token) it also equals
    autograd of the whole loss at ``c`` to rounding. Returns the kink tokens (one-sided derivatives that differ).

    Both hold for any tie rule of min / max / clamp that picks a subgradient, and neither depends on which one.
    A tie inside the program can sit where the loss is differentiable (the clip bound the unclipped branch wins on
    both sides of): there the interval is a single point, so a tie rule that splits the branches (half the
    derivative, torch 2.15's clamp inside torch.maximum) fails here, as it should."""
    left, right = _one_sided(loss, c, inputs, layout)
    tol = _kink_tolerance(left, right)
    kink = valid & ((right - left).abs() > tol)
    smooth = valid & ~kink
    torch.testing.assert_close(got[smooth], _autograd(loss, c, inputs, layout)[smooth], rtol=1e-12, atol=1e-15)
    lo, hi = torch.minimum(left, right) - tol, torch.maximum(left, right) + tol
    outside = valid & ((got < lo) | (got > hi))
    assert not outside.any(), (got[outside], left[outside], right[outside], kink[outside])
    return kink


@settings(max_examples=300 * _SCALE, **_SETTINGS)
@given(
    cfg=configs(),
    seed=st.integers(0, 2**16),
    chunk=st.integers(1, B * T),
    kinds=st.lists(st.sampled_from(KINDS), min_size=B * T, max_size=B * T),
)
def test_chunked_gradient_is_a_subgradient_of_the_loss(cfg, seed, chunk, kinds):
    loss = ClippedPGLoss(cfg)
    c, inputs, layout = _batch(loss, seed, kinds)
    assert single_pass_blocker(loss.config, layout) is None
    got = _chunked(loss, c, inputs, layout, chunk)
    valid = (inputs.token_mask * inputs.sample_mask.unsqueeze(1)) != 0
    assert torch.isfinite(got).all()
    assert (got[~valid] == 0).all()  # masked tokens (holding +-1e6, -inf, 1e30) add exactly 0
    assert_subgradient(got, loss, c, inputs, layout, valid)


def test_kinks_are_hit_by_the_batch():
    """The placed tokens really sit on the kinks (else the property test would never exercise them)."""
    loss = ClippedPGLoss(
        dict(
            ratio_level="token",
            token_log_ratio_clamp=0.04,
            max_log_ratio=0.02,
            log_ratio_clip_low=0.01,
            log_ratio_clip_high=0.015,
            clip_position_power=0.5,
            reference_policy_kl_penalty=0.1,
            kl_input_clamp_value=0.05,
        )
    )
    placed = {
        0: "clamp_hi",
        1: "clamp_lo",
        2: "cap",
        3: "log_lo",
        4: "log_hi",
        5: "kl_in_hi",
        9: "kl_in_lo",
        10: "ratio_one",
    }  # valid tokens of rows 0 and 1
    c, inputs, layout = _batch(loss, 0, [placed.get(i, "random") for i in range(B * T)])
    x = (c - inputs.prev_logprobs).reshape(-1)
    logr = (inputs.reference_logprobs - c).reshape(-1)
    pos = unmasked_positions(inputs.token_mask, layout).reshape(-1)
    assert x[0] == 0.04 and x[1] == -0.04 and x[2] == 0.02 and x[10] == 0
    assert x[3] == -0.01 * pos[3] ** 0.5 and x[4] == 0.015 * pos[4] ** 0.5
    assert logr[5] == 0.05 and logr[9] == -0.05
    # the cap (token 2) and the KL input clamp (5, 9) are true kinks there: the one-sided derivatives differ, so the
    # subdifferential check is not vacuous on them
    valid = (inputs.token_mask * inputs.sample_mask.unsqueeze(1)) != 0
    kinks = assert_subgradient(_chunked(loss, c, inputs, layout, 5), loss, c, inputs, layout, valid).reshape(-1)
    assert kinks[[2, 5, 9]].all(), kinks


@pytest.mark.parametrize("cap", [1.5, 3.0])
def test_reinforce_dual_cap_tie_lies_in_the_subdifferential(cap):
    """At c == cap with A < 0, min(-A c, -A cap) has slope -A left of the tie and 0 right of it (the cap is a
    constant): every subgradient a_t x (-A) x theta with theta in [0, 1] is valid, and nothing outside."""
    loss = ClippedPGLoss(dict(disable_ppo_ratio=True, ratio_clip_c=cap, reference_policy_kl_penalty=0.0))
    c, inputs, layout = _batch(loss, 1, ["dual_cap"] * (B * T))
    got = _chunked(loss, c, inputs, layout, 4)
    a = 1 / (17.0 + 1e-8)
    valid = (inputs.token_mask * inputs.sample_mask.unsqueeze(1)) != 0
    assert (c[valid] == cap).all() and (inputs.advantages[valid] < 0).all()
    full_slope = -inputs.advantages[valid] * a  # > 0
    theta = got[valid] / full_slope
    assert ((theta >= -1e-14) & (theta <= 1 + 1e-14)).all(), theta
    assert (got[~valid] == 0).all()


@pytest.mark.parametrize("kl_type", ["k1", "k2", "k3"])
@pytest.mark.parametrize("side", [1.0, -1.0])
def test_kl_input_clamp_boundary_takes_the_unclamped_side(kl_type, side):
    """At |logr| == input_clamp the clamp is not active, so the score-function weight stays live; the estimator's own
    derivative must stay live with it (the unclamped side's gradient, a one-sided derivative). Left to clamp's tie
    rule (1 up to torch 2.13, 0 from 2.15) the pathwise part dies while the weight's part does not: a gradient that
    neither side of the boundary has."""
    from nemo_is_plugin.loss.kl import kl_penalty, score_function_weight

    clamp = 0.05
    ref = torch.tensor([side * clamp], dtype=F64)  # c = 0: logr = ref - c sits on the bound exactly

    def grad(input_clamp):
        c = torch.zeros(1, dtype=F64, requires_grad=True)
        kl = kl_penalty(c, ref, kl_type=kl_type, input_clamp=input_clamp, weights=score_function_weight(c))
        return torch.autograd.grad(kl.sum(), c)[0]

    torch.testing.assert_close(grad(clamp), grad(None), rtol=0, atol=0)


@pytest.mark.parametrize(("advantage", "bound"), [(-1.5, 0.28), (2.0, -0.2)])
def test_gmpo_clip_bound_on_the_side_it_does_not_clip_is_smooth(advantage, bound):
    """GMPO clips d only on the side the advantage pushes, so d on the other bound (A < 0 at clip_high, A > 0 at
    -clip_low) is a differentiable point: its gradient is the unclipped one, whatever torch's min / clamp tie rules
    (torch.minimum's even split with clamp's 0 of torch 2.15 gave half of it)."""
    from nemo_is_plugin.loss.objectives.gmpo import gmpo_surrogate

    layout = TokenLayout.padded(1, 1)
    tm, adv = torch.ones(1, 1, dtype=F64), torch.tensor([[advantage]], dtype=F64)

    def grad(clip_low, clip_high):
        c = torch.tensor([[bound]], dtype=F64, requires_grad=True)  # anchor 0: d == bound exactly
        out = gmpo_surrogate(c, torch.zeros_like(c), adv, tm, layout, clip_low=clip_low, clip_high=clip_high)
        return torch.autograd.grad(out.loss.sum(), c)[0]

    torch.testing.assert_close(grad(0.2, 0.28), grad(1.0, 1.0), rtol=0, atol=0)
