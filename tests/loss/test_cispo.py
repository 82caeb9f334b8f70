"""``cispo`` (objectives/cispo.py): CISPO's surrogate by hand in float64, the whole loss against its written-out
token mean, NeMo-RL's ``use_cispo`` selecting it bit for bit like ``policy_objective: cispo``, its refusals."""

from __future__ import annotations

import pydantic
import pytest
import torch
from helpers.switch_objectives import F64, loss_and_grad, switch_batch

from nemo_is_plugin.loss.config_model import ClippedPGLossConfig
from nemo_is_plugin.loss.effective import effective_settings
from nemo_is_plugin.loss.objectives import objective_of
from nemo_is_plugin.loss.objectives.cispo import cispo_surrogate


def test_cispo_surrogate_by_hand():
    c = torch.tensor([-0.5, -2.0, -1.0], dtype=F64, requires_grad=True)
    log_r = torch.log(torch.tensor([2.0, 0.5, 1.1], dtype=F64))
    adv = torch.tensor([1.0, -1.0, 1.0], dtype=F64)
    out = cispo_surrogate(log_r, c, adv, clip_low=0.2, clip_high=0.2)
    # -A sg(clip(r, 0.8, 1.2)) c: 1.2 * 0.5, -(0.8 * 2), -(1.1 * -1)
    assert torch.allclose(out.loss, torch.tensor([0.6, -1.6, 1.1], dtype=F64), rtol=0, atol=1e-15)
    (grad,) = torch.autograd.grad(out.loss.sum(), c)
    assert torch.allclose(grad, torch.tensor([-1.2, 0.8, -1.1], dtype=F64), rtol=0, atol=1e-15)  # sg weight
    assert out.clipped.tolist() == [True, True, False]
    assert out.clipped_high.tolist() == [True, False, False] and out.clipped_low.tolist() == [False, True, False]


@pytest.mark.parametrize("selected", [dict(use_cispo=True), dict(policy_objective="cispo")], ids=["use_cispo", "name"])
def test_the_whole_loss_is_the_token_mean_of_the_surrogate(selected):
    inputs, layout = switch_batch(1)
    cfg = {**selected, "ratio_clip_min": 0.2, "ratio_clip_max": 0.3}
    loss, grad, metrics = loss_and_grad(cfg, inputs, layout)
    c, p, a, m = inputs.curr_logprobs, inputs.prev_logprobs, inputs.advantages, inputs.token_mask
    w = torch.exp(c - p).clamp(0.8, 1.3)
    torch.testing.assert_close(loss, (-a * w * c * m).sum() / (m.sum() + 1e-8), rtol=1e-14, atol=0)
    torch.testing.assert_close(grad, -a * w * m / (m.sum() + 1e-8), rtol=1e-14, atol=0)
    assert 0 < metrics["clip_fraction"] < 1  # the band bites in this batch


def test_use_cispo_and_the_name_compute_the_same_bits():
    inputs, layout = switch_batch(2)
    by_key = loss_and_grad(dict(use_cispo=True, ratio_clip_min=1.0, ratio_clip_max=5.0), inputs, layout)
    by_name = loss_and_grad(dict(policy_objective="cispo", ratio_clip_min=1.0, ratio_clip_max=5.0), inputs, layout)
    assert torch.equal(by_key[0], by_name[0]) and torch.equal(by_key[1], by_name[1])
    assert by_key[2] == by_name[2]


def test_nemo_rl_key_selects_cispo_and_show_effective_says_so():
    cfg = ClippedPGLossConfig(use_cispo=True)
    assert cfg.policy_objective == "ppo_clip" and cfg.effective_objective == "cispo"
    assert objective_of(cfg).name == "cispo"
    said = effective_settings(cfg)
    assert said["policy objective"] == "cispo (selected by NeMo-RL's use_cispo: true)"
    assert said["ratio clip"] == "CISPO: stop-gradient weight clamp(r, 0.8, 1.2) times -A * log pi"
    assert (
        effective_settings(ClippedPGLossConfig(policy_objective="cispo"))["policy objective"]
        == "cispo (policy_objective)"
    )


REFUSED = [
    (dict(use_cispo=True, ratio_clip_c=3.0), "ratio_clip_c is incompatible with use_cispo=true"),
    (dict(use_cispo=True, disable_ppo_ratio=True), "use_cispo=true is incompatible with disable_ppo_ratio=true"),
    (dict(use_cispo=True, force_on_policy_ratio=True), "use_cispo=true is incompatible with force_on_policy_ratio"),
    (
        dict(use_cispo=True, sequence_level_importance_ratios=True, token_level_loss=False),
        "sequence_level_importance_ratios=true is incompatible with use_cispo=true",
    ),
    (dict(use_cispo=True, token_level_loss=False), "requires token_level_loss=true"),
    (dict(use_cispo=True, ratio_level="cumulative"), "uses the token ratio: unset ratio_level='cumulative'"),
    (dict(policy_objective="cispo", ratio_clip_c=3.0), "ratio_clip_c configures PPO's ratio clip"),
    (dict(policy_objective="cispo", disable_ppo_ratio=True), "disable_ppo_ratio=true chooses another policy ratio"),
    (
        dict(policy_objective="cispo", log_ratio_clip_low=0.1, log_ratio_clip_high=0.1),
        "clips in ratio space \\(ratio_clip_min/max\\): unset log_ratio_clip_low",
    ),
]


@pytest.mark.parametrize("kwargs, message", REFUSED, ids=[m[:40] for _, m in REFUSED])
def test_refusals_name_the_field_and_the_fix(kwargs, message):
    with pytest.raises(pydantic.ValidationError, match=message):
        ClippedPGLossConfig(**kwargs)


def test_cispo_reads_max_log_ratio_and_the_clip_bounds():
    cfg = ClippedPGLossConfig(policy_objective="cispo", ratio_clip_min=1.0, ratio_clip_max=5.0, max_log_ratio=1.0)
    assert cfg.effective_ratio_level == "token" and not objective_of(cfg).differentiates_ratio(cfg)
