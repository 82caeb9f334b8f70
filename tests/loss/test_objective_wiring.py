"""``policy_objective`` through the whole ClippedPGLoss (reference path and the fused single pass's per-token gradient):
each objective composed with IS weights, the KL term, aggregation and bypass equals the same composition written out
from the objective's own functions (tests/loss/test_objectives.py checks those against hand values and verl), in
float64; the limits where an objective is a known one; the metrics; the refusals."""

from __future__ import annotations

import dataclasses

import pydantic
import pytest
import torch

from nemo_is_plugin.loss import ClippedPGLoss, LossInputs
from nemo_is_plugin.loss.aggregation import aggregate
from nemo_is_plugin.loss.config_model import ClippedPGLossConfig
from nemo_is_plugin.loss.layout import TokenLayout
from nemo_is_plugin.loss.objectives.base import masked_ratio_surrogate
from nemo_is_plugin.loss.objectives.cppo import cppo_mask
from nemo_is_plugin.loss.objectives.dppo import binary_kl_mask, binary_tv_mask, divergence_pg_surrogate
from nemo_is_plugin.loss.objectives.dro import dro_surrogate
from nemo_is_plugin.loss.objectives.gmpo import gmpo_surrogate
from nemo_is_plugin.loss.objectives.gpg import gpg_surrogate
from nemo_is_plugin.loss.objectives.prob_diff import probability_difference_mask
from nemo_is_plugin.loss.objectives.sapo import sapo_surrogate
from nemo_is_plugin.loss.separable import TokenLossGradient, single_pass_blocker

F64 = torch.float64
B, T = 5, 7

OBJECTIVES = {
    "dppo_tv": dict(policy_objective="dppo_tv", dppo_delta_low=0.05, dppo_delta_high=0.08, dppo_ratio_cap=1.3),
    "dppo_kl": dict(policy_objective="dppo_kl", dppo_delta_low=0.01, dppo_delta_high=0.02),
    "prob_diff": dict(policy_objective="prob_diff", prob_diff_threshold=0.06),
    "cppo": dict(policy_objective="cppo", cppo_delta=0.08, cppo_w_min=0.7, cppo_delta_b=0.01),
    "sapo": dict(policy_objective="sapo", sapo_tau_pos=1.3, sapo_tau_neg=2.0),
    "gmpo": dict(
        policy_objective="gmpo", gmpo_clip_low=0.1, gmpo_clip_high=0.15, loss_aggregation="seq-mean-token-mean"
    ),
    "gpg": dict(policy_objective="gpg"),
    "dro": dict(policy_objective="dro", dro_beta=0.7),
}
TOKEN_IS = dict(
    use_importance_sampling_correction=True,
    is_correction_level="token",
    truncated_importance_sampling_type="tis",
    truncated_importance_sampling_ratio=1.1,
)
SEQ_MEAN_IS = {**TOKEN_IS, "is_correction_level": "sequence_mean"}


def _batch(seed: int = 0):
    """float64 [B, T]: probabilities in (0.05, 0.95) so that the probability-space trust regions bite; one masked tail,
    one interior masked token, one sample masked out, per-sequence advantages of both signs and one zero."""
    g = torch.Generator().manual_seed(seed)
    prev = torch.log(torch.rand(B, T, generator=g, dtype=F64) * 0.9 + 0.05)
    gen = (prev + 0.1 * torch.randn(B, T, generator=g, dtype=F64)).clamp(max=-1e-3)
    ref = (prev + 0.1 * torch.randn(B, T, generator=g, dtype=F64)).clamp(max=-1e-3)
    c = (prev + 0.3 * torch.randn(B, T, generator=g, dtype=F64)).clamp(max=-1e-3)
    adv = torch.tensor([1.5, -0.7, 0.0, 0.9, 0.4], dtype=F64)[:, None].expand(B, T).clone()
    adv[3] += 0.2 * torch.randn(T, generator=g, dtype=F64)  # per-token advantages in one row
    tm = torch.ones(B, T, dtype=F64)
    tm[0, 5:] = 0
    tm[1, 2] = 0
    sm = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0], dtype=F64)
    valid = tm * sm[:, None]
    inputs = LossInputs(
        curr_logprobs=c,
        prev_logprobs=prev,
        generation_logprobs=gen,
        reference_logprobs=ref,
        advantages=adv,
        token_mask=tm,
        sample_mask=sm,
        global_valid_seqs=float(sm.sum()),
        global_valid_toks=float(valid.sum()),
    )
    return inputs, TokenLayout.padded(B, T)


def _loss_and_grad(cfg: dict, inputs: LossInputs, layout: TokenLayout):
    c = inputs.curr_logprobs.clone().requires_grad_(True)
    loss, metrics = ClippedPGLoss(cfg).compute(dataclasses.replace(inputs, curr_logprobs=c), layout)
    (grad,) = torch.autograd.grad(loss, c)
    return loss.detach(), grad, metrics


def _written_out(name: str, cfg: dict, c: torch.Tensor, anchor: torch.Tensor, adv, tm, layout):
    """The objective's surrogate from objectives.py / trust_masks.py / prefix_budget.py directly (d clamped at 20)."""
    d = (c - anchor).clamp(-20, 20)
    if name in ("dppo_tv", "dppo_kl"):
        rule = binary_tv_mask if name == "dppo_tv" else binary_kl_mask
        trust = rule(c.detach(), anchor, adv, delta_low=cfg["dppo_delta_low"], delta_high=cfg["dppo_delta_high"])
        return divergence_pg_surrogate(d, c, adv, trust, ratio_cap=cfg.get("dppo_ratio_cap", 20.0))
    if name == "prob_diff":
        trust = probability_difference_mask(c.detach(), anchor, adv, threshold=cfg["prob_diff_threshold"])
        return masked_ratio_surrogate(d, adv, trust)
    if name == "cppo":
        budget = cppo_mask(
            c.detach(),
            anchor,
            adv,
            tm,
            layout,
            delta=cfg["cppo_delta"],
            w_min=cfg["cppo_w_min"],
            delta_b=cfg["cppo_delta_b"],
        )
        return masked_ratio_surrogate(d, adv, budget.mask)
    if name == "sapo":
        return sapo_surrogate(d, adv, tau_pos=cfg["sapo_tau_pos"], tau_neg=cfg["sapo_tau_neg"])
    if name == "gmpo":
        return gmpo_surrogate(
            c, anchor, adv, tm, layout, clip_low=cfg["gmpo_clip_low"], clip_high=cfg["gmpo_clip_high"]
        )
    if name == "gpg":
        return gpg_surrogate(c, adv)
    return dro_surrogate(c, anchor, adv, beta=cfg["dro_beta"])


def _reference(name: str, cfg: dict, inputs: LossInputs, layout: TokenLayout, *, anchor_key: str = "prev"):
    """loss = aggregate(w * surrogate) with w = the IS weight exp(prev - gen) truncated at 1.1 (token, or the
    sequence geometric mean for GMPO), no KL; masked tokens anchored at c (ratio 1)."""
    c = inputs.curr_logprobs.clone().requires_grad_(True)
    tm, sm = inputs.token_mask, inputs.sample_mask
    valid = tm * sm[:, None]
    anchor_src = inputs.prev_logprobs if anchor_key == "prev" else inputs.generation_logprobs
    anchor = torch.where(valid != 0, anchor_src, c.detach())
    sur = _written_out(name, cfg, c, anchor, inputs.advantages, tm, layout)
    log_w = (inputs.prev_logprobs - inputs.generation_logprobs) * tm
    if name == "gmpo":
        log_w = (log_w.sum(-1) / tm.sum(-1))[:, None].expand(B, T)
    w = torch.exp(log_w).clamp(max=1.1)
    agg = cfg.get("loss_aggregation", "token-mean")
    loss = aggregate(
        w * sur.loss,
        tm,
        sm,
        layout,
        mode=agg,
        global_valid_toks=torch.tensor(inputs.global_valid_toks, dtype=F64),
        global_valid_seqs=torch.tensor(inputs.global_valid_seqs, dtype=F64),
    )
    (grad,) = torch.autograd.grad(loss, c)
    return loss.detach(), grad, sur


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_objective_with_is_weights_equals_the_written_out_composition(name):
    inputs, layout = _batch(1)
    cfg = {**OBJECTIVES[name], **(SEQ_MEAN_IS if name == "gmpo" else TOKEN_IS), "reference_policy_kl_penalty": 0.0}
    loss, grad, metrics = _loss_and_grad(cfg, inputs, layout)
    ref_loss, ref_grad, sur = _reference(name, cfg, inputs, layout)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-12, atol=1e-14)
    valid = (inputs.token_mask * inputs.sample_mask[:, None]) != 0
    n = valid.sum().item()
    for metric, flag in (
        ("clip_fraction", sur.clipped),
        ("clip_fraction_high", sur.clipped_high),
        ("clip_fraction_low", sur.clipped_low),
        ("clip_fraction_dual", sur.dual_clipped),
    ):
        if flag is None:  # an objective without that clip reports no such fraction
            assert metric not in metrics, (name, metric)
        else:
            assert metrics[metric] == pytest.approx((flag & valid).sum().item() / n, rel=1e-8)  # counts + 1e-8
    # a ratio metric only where the objective has a ratio (named by policy_objective: no NeMo-RL switch)
    assert ("probs_ratio" in metrics) == (sur.ratio is not None), name
    assert ("probs_ratio_clamped" in metrics) == (sur.clipped_ratio is not None), name


def test_the_trust_regions_really_bite_in_this_batch():
    """Each masking objective drops some but not all valid tokens on both advantage signs (else the test above could
    not tell a mask from none)."""
    inputs, layout = _batch(1)
    for name in ("dppo_tv", "dppo_kl", "prob_diff", "cppo"):
        cfg = {**OBJECTIVES[name], **TOKEN_IS, "reference_policy_kl_penalty": 0.0}
        _, _, metrics = _loss_and_grad(cfg, inputs, layout)
        assert 0 < metrics["clip_fraction"] < 1, name
        assert metrics["clip_fraction_high"] > 0 and metrics["clip_fraction_low"] > 0, name


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_the_kl_term_adds_as_for_ppo(name):
    inputs, layout = _batch(2)
    base = {**OBJECTIVES[name], "reference_policy_kl_penalty": 0.0}
    kl = {**base, "reference_policy_kl_penalty": 0.07}
    ppo = {"loss_aggregation": base.get("loss_aggregation", "token-mean"), "reference_policy_kl_penalty": 0.0}
    diff = [
        _loss_and_grad(cfg, inputs, layout) for cfg in (kl, base, {**ppo, "reference_policy_kl_penalty": 0.07}, ppo)
    ]
    torch.testing.assert_close(diff[0][0] - diff[1][0], diff[2][0] - diff[3][0], rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(diff[0][1] - diff[1][1], diff[2][1] - diff[3][1], rtol=1e-12, atol=1e-14)
    assert diff[0][2]["kl_penalty"] == pytest.approx(diff[2][2]["kl_penalty"], rel=1e-12)


@pytest.mark.parametrize("name", ["dppo_tv", "sapo", "dro", "gmpo"])
def test_bypass_anchors_at_the_rollout_policy(name):
    """old_policy_logprobs='generation': the anchor is mu (the IS weights then compare the current policy to mu)."""
    inputs, layout = _batch(3)
    agg = {"loss_aggregation": OBJECTIVES[name].get("loss_aggregation", "token-mean")}
    cfg = {**OBJECTIVES[name], **agg, "old_policy_logprobs": "generation", "reference_policy_kl_penalty": 0.0}
    loss, grad, _ = _loss_and_grad(cfg, inputs, layout)
    no_is = dataclasses.replace(inputs, prev_logprobs=inputs.generation_logprobs)  # w = exp(g - g) = 1, clamp inert
    ref_loss, ref_grad, _ = _reference(name, OBJECTIVES[name] | agg, no_is, layout, anchor_key="generation")
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-12, atol=1e-14)


# ---------------------------------------------------------------- limits through the whole loss
UNCLIPPED_PPO = dict(ratio_clip_min=1.0, ratio_clip_max=1e9, reference_policy_kl_penalty=0.0)


def test_dppo_with_unbounded_thresholds_and_cap_is_the_untruncated_policy_gradient():
    inputs, layout = _batch(4)
    for kind in ("dppo_tv", "dppo_kl"):
        cfg = dict(policy_objective=kind, dppo_delta_low=1e9, dppo_delta_high=1e9, dppo_ratio_cap=1e9)
        _, grad, metrics = _loss_and_grad({**cfg, **TOKEN_IS, "reference_policy_kl_penalty": 0.0}, inputs, layout)
        _, pg_grad, _ = _loss_and_grad({**UNCLIPPED_PPO, **TOKEN_IS}, inputs, layout)
        torch.testing.assert_close(grad, pg_grad, rtol=1e-12, atol=1e-14)
        assert metrics["clip_fraction"] == 0


def test_prob_diff_threshold_one_is_the_unclipped_ratio_objective():
    inputs, layout = _batch(5)
    got = _loss_and_grad({"policy_objective": "prob_diff", "prob_diff_threshold": 1.0, **TOKEN_IS}, inputs, layout)
    want = _loss_and_grad({**UNCLIPPED_PPO, **TOKEN_IS, "reference_policy_kl_penalty": 0.01}, inputs, layout)
    torch.testing.assert_close(got[0], want[0], rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(got[1], want[1], rtol=1e-12, atol=1e-14)


def test_gpg_is_nemo_rl_reinforce():
    inputs, layout = _batch(6)
    got = _loss_and_grad({"policy_objective": "gpg", **TOKEN_IS}, inputs, layout)
    want = _loss_and_grad({"disable_ppo_ratio": True, **TOKEN_IS}, inputs, layout)
    torch.testing.assert_close(got[0], want[0], rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(got[1], want[1], rtol=1e-12, atol=1e-14)


def test_sapo_at_the_anchor_is_the_policy_gradient():
    inputs, layout = _batch(7)
    on_anchor = dataclasses.replace(inputs, curr_logprobs=inputs.prev_logprobs.clone())
    _, grad, _ = _loss_and_grad(
        {**OBJECTIVES["sapo"], **TOKEN_IS, "reference_policy_kl_penalty": 0.0}, on_anchor, layout
    )
    _, pg_grad, _ = _loss_and_grad({**UNCLIPPED_PPO, **TOKEN_IS}, on_anchor, layout)
    torch.testing.assert_close(grad, pg_grad, rtol=1e-12, atol=1e-14)


def test_gmpo_hand_value_with_sequence_mean_weights():
    """Two sequences, no clip active: loss = mean_i w_i (-Abar_i exp(mean_t d_t)), w_i = exp(mean_t (p - g))."""
    c = torch.tensor([[-1.0, -2.0], [-0.5, -0.7]], dtype=F64)
    prev = torch.tensor([[-1.05, -1.95], [-0.45, -0.7]], dtype=F64)
    gen = torch.tensor([[-1.0, -2.0], [-0.5, -0.6]], dtype=F64)
    adv = torch.tensor([[2.0, 2.0], [-1.0, -1.0]], dtype=F64)
    ones = torch.ones(2, 2, dtype=F64)
    inputs = LossInputs(c, prev, gen, None, adv, ones, torch.ones(2, dtype=F64), 2.0, 4.0)
    cfg = {**OBJECTIVES["gmpo"], **SEQ_MEAN_IS, "truncated_importance_sampling_ratio": 10.0}
    cfg["reference_policy_kl_penalty"] = 0.0
    loss, _, _ = _loss_and_grad(cfg, inputs, TokenLayout.padded(2, 2))
    import math

    w0, w1 = math.exp((-0.05 + 0.05) / 2), math.exp((0.05 - 0.1) / 2)
    r0, r1 = math.exp((0.05 - 0.05) / 2), math.exp((-0.05 + 0.0) / 2)
    assert loss.item() == pytest.approx((w0 * -2.0 * r0 + w1 * 1.0 * r1) / 2, rel=1e-7)  # n + 1e-8


def test_cppo_reports_its_budget():
    inputs, layout = _batch(8)
    cfg = {**OBJECTIVES["cppo"], "reference_policy_kl_penalty": 0.0}
    _, _, metrics = _loss_and_grad(cfg, inputs, layout)
    tm, sm = inputs.token_mask, inputs.sample_mask
    valid = tm * sm[:, None]
    anchor = torch.where(valid != 0, inputs.prev_logprobs, inputs.curr_logprobs)
    budget = cppo_mask(inputs.curr_logprobs, anchor, inputs.advantages, tm, layout, delta=0.08, w_min=0.7, delta_b=0.01)
    bound = (budget.budget_bound & (valid != 0)).sum().item() / valid.sum().item()
    assert metrics["cppo_budget_bound_fraction"] == pytest.approx(bound, rel=1e-8)
    exhausted = (torch.isfinite(budget.first_exhausted).double() * sm).sum().item() / sm.sum().item()
    assert metrics["cppo_budget_exhausted_seq_fraction"] == pytest.approx(exhausted, rel=1e-8)
    assert 0 < exhausted  # the budget binds somewhere in this batch
    rate = (budget.rate * sm).sum().item() / sm.sum().item()
    assert metrics["cppo_budget_rate_mean"] == pytest.approx(rate, rel=1e-8)
    n = valid.sum(-1).clamp_min(1)
    first = budget.first_exhausted
    before = torch.where(torch.isfinite(first), (first - 1) / n, torch.ones_like(n))
    position = (before * sm).sum().item() / sm.sum().item()
    assert metrics["cppo_budget_exhausted_position_fraction"] == pytest.approx(position, rel=1e-8)
    assert 0 < position < 1
    assert "cppo_budget_rate_mean" not in _loss_and_grad({**OBJECTIVES["sapo"]}, inputs, layout)[2]


# ---------------------------------------------------------------- the fused single pass's per-token gradient
LOCAL = ["dppo_tv", "dppo_kl", "prob_diff", "sapo", "gpg", "dro"]


@pytest.mark.parametrize("name", LOCAL)
@pytest.mark.parametrize("chunk", [1, 5, B * T])
def test_chunked_gradient_equals_the_loss_gradient(name, chunk):
    inputs, layout = _batch(9)
    loss = ClippedPGLoss({**OBJECTIVES[name], **TOKEN_IS, "reference_policy_kl_penalty": 0.05})
    assert single_pass_blocker(loss.config, layout) is None
    tg = TokenLossGradient.build(loss, inputs, layout)
    flat = inputs.curr_logprobs.reshape(-1)
    parts = [tg(slice(s, min(s + chunk, flat.numel())), flat[s : s + chunk]) for s in range(0, flat.numel(), chunk)]
    got = torch.cat(parts).reshape(B, T)
    _, want, _ = _loss_and_grad(loss.config, inputs, layout)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("name", ["gmpo", "cppo"])
def test_sequence_objectives_take_the_two_pass_schedule(name):
    cfg = ClippedPGLossConfig(**OBJECTIVES[name])
    assert f"policy_objective='{name}'" in single_pass_blocker(cfg, TokenLayout.padded(2, 3))


# ---------------------------------------------------------------- refusals
REFUSED = [
    (dict(policy_objective="dppo_tv"), "needs dppo_delta_low"),
    (dict(policy_objective="dro"), "needs dro_beta"),
    (dict(policy_objective="gmpo", gmpo_clip_low=0.4), "needs gmpo_clip_high"),
    ({**OBJECTIVES["sapo"], "ratio_clip_c": 3.0}, "unset ratio_clip_c"),
    ({**OBJECTIVES["dppo_tv"], "ratio_clip_max": 0.28}, "unset ratio_clip_max"),
    ({**OBJECTIVES["prob_diff"], "log_ratio_clip_low": 0.1, "log_ratio_clip_high": 0.1}, "unset log_ratio_clip_low"),
    ({**OBJECTIVES["cppo"], "max_log_ratio": 10.0}, "unset max_log_ratio"),
    ({**OBJECTIVES["dppo_tv"], "ratio_level": "sequence", "token_level_loss": False}, "unset ratio_level='sequence'"),
    ({**OBJECTIVES["sapo"], "ratio_level": "cumulative"}, "unset ratio_level='cumulative'"),
    ({**OBJECTIVES["gmpo"], "ratio_level": "token"}, "unset ratio_level='token'"),
    ({**OBJECTIVES["gpg"], "ratio_level": "token"}, "no policy ratio"),
    ({**OBJECTIVES["dro"], "use_cispo": True}, "use_cispo=true"),
    ({**OBJECTIVES["sapo"], "disable_ppo_ratio": True}, "disable_ppo_ratio=true"),
    ({**OBJECTIVES["gpg"], "sequence_level_importance_ratios": True, "token_level_loss": False}, "set it false"),
    ({**OBJECTIVES["gmpo"], "loss_aggregation": "token-mean"}, "set loss_aggregation: seq-mean-token-mean"),
    ({**OBJECTIVES["gmpo"], **TOKEN_IS}, "set is_correction_level: sequence_mean"),
    (
        {
            **OBJECTIVES["gmpo"],
            "importance_sampling_rejection_rules": [{"statistic": "k1", "aggregation": "token", "max": 0.5}],
        },
        "use a sequence rule",
    ),
    (dict(dppo_delta_low=0.2), "dppo_delta_low is read by policy_objective dppo_tv / dppo_kl only"),
    ({**OBJECTIVES["sapo"], "dro_beta": 0.1}, "dro_beta is read by policy_objective dro only, not 'sapo'"),
    (dict(policy_objective="sapo", cppo_delta=0.3), "cppo_delta is read by policy_objective cppo only"),
]


@pytest.mark.parametrize("kwargs, message", REFUSED, ids=[m for _, m in REFUSED])
def test_refusals_name_the_field_and_the_fix(kwargs, message):
    with pytest.raises(pydantic.ValidationError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ClippedPGLossConfig(**kwargs)


def test_default_objective_is_ppo_clip_and_dumps_reload():
    assert ClippedPGLossConfig().policy_objective == "ppo_clip"
    for cfg in OBJECTIVES.values():
        built = ClippedPGLossConfig(**cfg)
        assert ClippedPGLossConfig(**built.model_dump()) == built


def test_effective_settings_spell_out_the_objective():
    from nemo_is_plugin.loss.effective import effective_settings

    for name, cfg in OBJECTIVES.items():
        said = effective_settings(ClippedPGLossConfig(**cfg))
        assert said["ratio clip"].startswith(f"{name}:"), said["ratio clip"]
    dppo = effective_settings(ClippedPGLossConfig(**OBJECTIVES["dppo_tv"]))["ratio clip"]
    assert "0.08 (A > 0)" in dppo and "0.05 (A <= 0)" in dppo and "min(r, 1.3)" in dppo
    assert effective_settings(ClippedPGLossConfig())["ratio clip"] == "ratio space [0.8, 1.2], no dual clip"
