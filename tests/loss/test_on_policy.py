"""``on_policy`` (objectives/on_policy.py): the ratio exp(c - sg c), 1 with the policy gradient, by hand in float64;
pi_old is sg(pi) for the IS weights too; NeMo-RL's ``force_on_policy_ratio`` selecting it bit for bit like
``policy_objective: on_policy``, tested before ``disable_ppo_ratio`` as NeMo-RL does; its refusals."""

from __future__ import annotations

import dataclasses

import pydantic
import pytest
import torch
from helpers.switch_objectives import F64, loss_and_grad, switch_batch

from nemo_is_plugin.loss.config_model import ClippedPGLossConfig
from nemo_is_plugin.loss.effective import effective_settings
from nemo_is_plugin.loss.layout import TokenLayout
from nemo_is_plugin.loss.objectives import objective_of
from nemo_is_plugin.loss.objectives.on_policy import on_policy_surrogate
from nemo_is_plugin.loss.separable import is_token_separable, single_pass_blocker


def test_on_policy_surrogate_by_hand():
    c = torch.tensor([-0.5, -2.0], dtype=F64, requires_grad=True)
    adv = torch.tensor([1.5, -1.0], dtype=F64)
    out = on_policy_surrogate(c, adv, dual_clip=3.0)
    assert torch.equal(out.ratio, torch.ones(2, dtype=F64)) and torch.equal(out.loss.detach(), -adv)
    (grad,) = torch.autograd.grad(out.loss.sum(), c)
    assert torch.equal(grad, -adv)  # d/dc of -A exp(c - sg c) = -A
    assert out.clipped is None and out.clipped_ratio is None  # no clip; only the dual clip, inactive here
    assert not out.dual_clipped.any()  # -A * 1 < -A * 3 for A < 0


@pytest.mark.parametrize(
    "selected",
    [
        dict(force_on_policy_ratio=True),
        dict(force_on_policy_ratio=True, disable_ppo_ratio=True),
        dict(policy_objective="on_policy"),
    ],
    ids=["force_on_policy_ratio", "with_disable_ppo_ratio", "name"],
)
def test_the_whole_loss_ignores_prev_and_weights_by_exp_c_minus_g(selected):
    inputs, layout = switch_batch(5)
    cfg = {**selected, "use_importance_sampling_correction": True}
    loss, grad, metrics = loss_and_grad(cfg, dataclasses.replace(inputs, prev_logprobs=None), layout)
    c, g, a, m = inputs.curr_logprobs, inputs.generation_logprobs, inputs.advantages, inputs.token_mask
    w = torch.exp(c - g)  # the IS weight compares pi_old = sg pi with mu
    torch.testing.assert_close(loss, (-a * w * m).sum() / (m.sum() + 1e-8), rtol=1e-14, atol=0)
    torch.testing.assert_close(grad, -a * w * m / (m.sum() + 1e-8), rtol=1e-14, atol=0)
    assert metrics["probs_ratio"] == pytest.approx(1.0, rel=1e-8)  # a mean of ones over the count + 1e-8


def test_force_on_policy_ratio_and_the_name_compute_the_same_bits():
    inputs, layout = switch_batch(6)
    by_key = loss_and_grad(dict(force_on_policy_ratio=True, ratio_clip_c=2.0), inputs, layout)
    by_name = loss_and_grad(dict(policy_objective="on_policy", ratio_clip_c=2.0), inputs, layout)
    assert torch.equal(by_key[0], by_name[0]) and torch.equal(by_key[1], by_name[1])
    # NeMo-RL's switch also reports probs_ratio_clamped (NeMo-RL's ratios_clamped = ratios = 1); the name, whose
    # objective clamps nothing, does not
    clamped = {"probs_ratio_clamped", "probs_ratio_clamped_min", "probs_ratio_clamped_max"}
    assert set(by_key[2]) - set(by_name[2]) == clamped and {k: by_key[2][k] for k in by_name[2]} == by_name[2]
    assert [by_key[2][k] for k in sorted(clamped)] == [by_key[2]["probs_ratio" + k[19:]] for k in sorted(clamped)]


def test_nemo_rl_precedence_and_show_effective():
    cfg = ClippedPGLossConfig(force_on_policy_ratio=True, disable_ppo_ratio=True)
    assert cfg.effective_objective == "on_policy" and objective_of(cfg).pi_old_is_current
    said = effective_settings(cfg)
    assert said["policy objective"] == (
        "on_policy (selected by NeMo-RL's force_on_policy_ratio: true; disable_ppo_ratio: true ignored, as NeMo-RL "
        "tests force_on_policy_ratio first)"
    )
    assert said["policy ratio"].startswith("fixed to 1")


def test_the_fused_loss_takes_two_passes():
    cfg = ClippedPGLossConfig(policy_objective="on_policy")
    assert not is_token_separable(cfg)
    why = single_pass_blocker(ClippedPGLossConfig(force_on_policy_ratio=True), TokenLayout.padded(2, 3))
    assert why is not None and "force_on_policy_ratio=true" in why and "from the current ones" in why


REFUSED = [
    (dict(force_on_policy_ratio=True, old_policy_logprobs="generation"), "both choose pi_old; keep one"),
    (dict(force_on_policy_ratio=True, use_cispo=True), "use_cispo=true is incompatible with force_on_policy_ratio"),
    (dict(force_on_policy_ratio=True, max_log_ratio=10.0), "max_log_ratio configures PPO's ratio clip"),
    (
        dict(force_on_policy_ratio=True, log_ratio_clip_low=0.1, log_ratio_clip_high=0.1),
        "unset log_ratio_clip_low",
    ),
    (dict(force_on_policy_ratio=True, ratio_level="cumulative"), "unset ratio_level='cumulative'"),
    (dict(policy_objective="on_policy", ratio_clip_min=0.1), "ratio_clip_min configures PPO's ratio clip"),
]


@pytest.mark.parametrize("kwargs, message", REFUSED, ids=[m[:40] for _, m in REFUSED])
def test_refusals_name_the_field_and_the_fix(kwargs, message):
    with pytest.raises(pydantic.ValidationError, match=message):
        ClippedPGLossConfig(**kwargs)


def test_nemo_rl_ignored_keys_still_validate():
    cfg = ClippedPGLossConfig(
        force_on_policy_ratio=True, ratio_clip_max=0.28, sequence_level_importance_ratios=True, token_level_loss=False
    )
    assert cfg.effective_objective == "on_policy"
